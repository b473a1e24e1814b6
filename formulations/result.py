"""The one result shape every intra-op solver path returns."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SolveResult:
    """``status``: ``optimal`` (proved), ``feasible`` (ILP stopped at its time limit with a
    solution; ``gap`` says how far from the bound), ``heuristic`` (the ILP found nothing in
    time; the best search result is used). ``bound`` is a proven lower bound when known."""

    status: str
    objective: float
    bound: float | None
    gap: float | None
    build_s: float
    solve_s: float
    choice: tuple[int, ...]
    method: str
    message: str = ""

    def to_dict(self) -> dict:
        return {
            "status": self.status,
            "objective": self.objective,
            "bound": self.bound,
            "gap": self.gap,
            "build_s": self.build_s,
            "solve_s": self.solve_s,
            "method": self.method,
            "message": self.message,
        }
