"""What one intra-op solve answers: which graph, on which mesh, under which budget."""

from __future__ import annotations

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
