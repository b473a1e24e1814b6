"""How a stage variant of the DP's table was solved, besides a plain in-flight count (or
None, the fastest plan): a :class:`Gap` standing in for the counts between two solved
ones, or a grid point's blocks and reserve (:class:`AtGridPoint`)."""

from __future__ import annotations

from dataclasses import dataclass

from ilp_planner.ir.graph import Graph


@dataclass(frozen=True)
class Gap:
    """A stand-in variant for the in-flight counts strictly between two solved ones,
    ``below`` and ``above`` (their plans differ in time, or none fits ``above``): the time
    of ``below``'s plan (a lower bound: fewer plans fit holding more), fitting every count
    below ``above`` and no more (its memory figures are made for that, not measured). The
    DP may choose it; :meth:`~ilp_planner.inter_op.stage_solver.StageSolver.refine` then
    solves the count the stage holds and the DP runs again, until no gap is chosen —
    exact, as a gap never costs more than what it stands for, with far fewer stage solves."""

    below: int
    above: int


@dataclass(frozen=True)
class AtGridPoint:
    """A stage solved in the planner's whole space at a grid point's recomputed blocks
    (``offsets`` into the range's blocks, so one entry serves every range of its signature
    class) and transient reserve, holding ``inflight`` micro-batches."""

    inflight: int
    offsets: tuple[int, ...]
    reserve: float

    def blocks(self, graph: Graph) -> frozenset[tuple[str, int]]:
        units = graph.blocks()
        return frozenset(units[i] for i in self.offsets)


How = int | AtGridPoint | Gap | None
"""How a stage variant was solved: None the fastest plan (no memory row), an in-flight
count the fastest plan fitting it, or one of the classes above."""
