"""The one result shape every intra-op solver path returns."""

from __future__ import annotations

from dataclasses import asdict, dataclass

# The MILP backends an intra-op solve can use (the config's ``solver.milp`` choices).
MILP_BACKENDS = ("scip", "cbc")


@dataclass(frozen=True)
class SolveStats:
    """Where a solve's time went and how big it was, so a slow solve explains itself.

    Every field may be None: a solver path that does not expose a figure leaves it None
    rather than estimating it.

    ``variables``, ``integer_variables``, ``constraints``
        the size of the model as built (before the solver's own presolve); for a search
        without a model, None.
    ``nodes``
        branch-and-bound nodes the solver explored (1 or 0: solved at the root; the count
        follows the solver's own convention).
    ``build_s``
        seconds building the solver's model: emitting rows and columns and loading them into
        the solver (the planner's ``SolveResult.build_s`` adds the problem build and pruning).
    ``presolve_s``
        seconds of the solver's presolve, a part of ``search_s`` (or of ``proof_s`` when the
        final incumbent was known before it, e.g. a warm start that stayed the best).
    ``search_s``
        seconds from the solver's start until the final incumbent (the returned solution)
        was found; 0 when the warm start was never improved; the whole run when the
        solver found no solution.
    ``proof_s``
        seconds after the final incumbent until the solver stopped: closing the gap to prove
        optimality, or waiting for the time limit. ``search_s + proof_s`` is the solver's
        own run time.
    ``note``
        a free-form remark of the solver path (e.g. which engine, why a figure is missing).
    """

    variables: int | None = None
    integer_variables: int | None = None
    constraints: int | None = None
    nodes: int | None = None
    build_s: float | None = None
    presolve_s: float | None = None
    search_s: float | None = None
    proof_s: float | None = None
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SolveResult:
    """``status``: ``optimal`` (proved), ``feasible`` (ILP stopped at its time limit with a
    solution; ``gap`` says how far from the bound), ``heuristic`` (the ILP found nothing in
    time; the best search result is used). ``bound`` is a proven lower bound when known.
    ``stats``: the size of the model and where the time went (:class:`SolveStats`), None
    where the path records none."""

    status: str
    objective: float
    bound: float | None
    gap: float | None
    build_s: float
    solve_s: float
    choice: tuple[int, ...]
    method: str
    message: str = ""
    stats: SolveStats | None = None

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
            "stats": None if self.stats is None else self.stats.to_dict(),
        }
