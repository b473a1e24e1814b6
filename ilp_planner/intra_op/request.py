"""What one intra-op solve answers: which graph, on which mesh, under which budget."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ilp_planner.inputs.config import Config
from ilp_planner.intra_op.problem import BuildCache
from ilp_planner.ir.graph import Graph
from ilp_planner.lowering.stage_boundary import StageBoundary


@dataclass(frozen=True)
class MeshSolveRequest:
    """The question :func:`~ilp_planner.intra_op.solve_mesh.solve_mesh` answers, passed
    whole down its steps (each changes a field or two, ``dataclasses.replace``): ``graph``
    (``microbatches`` accumulated per step; a pipeline stage at ``boundary``) planned on a
    ``nodes × local`` mesh, every plan's exact peak within ``memory_budget`` (None: the
    fastest plan), under the options of ``config``. ``recompute``: the blocks recomputed
    (``solve_mesh`` picks them per ``solver.recompute``; its steps solve at the set given).
    ``cache`` carries build work across the many builds of one solve and across solves
    of graphs cut from one model."""

    config: Config
    nodes: int
    local: int
    memory_budget: float | None
    graph: Graph
    microbatches: int = 1
    boundary: StageBoundary | None = None
    cache: BuildCache | None = None
    recompute: frozenset = frozenset()

    @classmethod
    def whole_model(cls, config: Config, nodes: int, local: int,
                    memory_budget: float | None) -> MeshSolveRequest:
        """The config's graph of one micro-batch, accumulated over
        ``pipeline.microbatches``, on an ``nodes × local`` mesh."""
        return cls(config, nodes, local, memory_budget, config.microbatch_graph(),
                   config.pipeline.microbatches)

    @classmethod
    def whole_cluster(cls, config: Config) -> MeshSolveRequest:
        """The whole model on the whole cluster under its device memory."""
        c = config.cluster
        return cls.whole_model(config, c.nodes, c.devices_per_node, c.memory_bytes)


@dataclass
class PhaseTimes:
    """Wall seconds a solve spent per phase: solving (the ILPs and searches, for a pipeline
    the stage DP around them) and pricing the baselines beside it — so that a timing line
    adds up to the time the command took, not just the final ILP's build and solve."""

    solve_s: float = 0.0
    baselines_s: float = 0.0

    @contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        """Add the wall time of the ``with`` block to ``phase`` (``"solve_s"``, ...)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            setattr(self, phase, getattr(self, phase) + time.perf_counter() - t0)
