"""The baselines priced beside a plan, under the same cost model: the usual hand-written
layouts (:func:`~ilp_planner.intra_op.baselines.baseline_choices`) and the
torchtitan-style grid (:func:`~ilp_planner.intra_op.baselines.torchtitan_choice`), each
as the cost breakdown of its choice realised (:func:`realise`)."""

from __future__ import annotations

from ilp_planner.intra_op.baselines import GridPoint, baseline_choices, torchtitan_choice
from ilp_planner.intra_op.problem import BuildCache, GraphProblem, build_problem
from ilp_planner.intra_op.realise import realise
from ilp_planner.intra_op.request import MeshSolveRequest


def price_baselines(gp: GraphProblem, time_limit_s: float,
                    memory_budget: float | None = None) -> dict[str, dict]:
    """The usual baselines (:func:`~ilp_planner.intra_op.baselines.baseline_choices`), each on the
    problem without state sharding and recomputation (``gp`` rebuilt where it has them,
    under ``memory_budget``)."""
    if gp.ctx.zero_levels != (0,) or gp.recompute_units:
        gp = build_problem(gp.graph, gp.ctx.cluster, gp.ctx.nodes, gp.ctx.local, gp.ctx.memory,
                           tie_layers=any(len(g) > 1 for g in gp.groups),
                           max_weight_replication=gp.ctx.max_weight_replication,
                           memory_budget=memory_budget, microbatches=gp.microbatches,
                           boundary=gp.boundary, grad_bucket_bytes=gp.grad_bucket_bytes)
    out: dict[str, dict] = {}
    for name, choice in baseline_choices(gp, time_limit_s).items():
        if isinstance(choice, str):
            out[name] = {"error": choice}
        else:
            out[name] = realise(gp, choice)[1].to_dict()
    return out


def grid_baseline(request: MeshSolveRequest) -> GridPoint | str:
    """The torchtitan-style grid (:func:`~ilp_planner.intra_op.baselines.torchtitan_choice`) on
    the planner's own problems for the request's graph and mesh, under its budget (with a
    build cache of its own: the grid's state sharding and recomputation are its own)."""
    config, graph = request.config, request.graph
    cache = BuildCache()

    def build(levels: tuple[int, ...], blocks: frozenset) -> GraphProblem:
        return build_problem(graph, config.cluster, request.nodes, request.local, config.memory,
                             tie_layers=config.solver.tie_layers,
                             max_weight_replication=config.solver.max_weight_replication,
                             memory_budget=request.memory_budget,
                             microbatches=request.microbatches, boundary=request.boundary,
                             grad_bucket_bytes=config.grad_bucket_bytes, cache=cache,
                             zero_levels=levels, recompute=blocks)

    return torchtitan_choice(graph, build, request.nodes, request.local, request.memory_budget,
                             config.solver.time_limit_s)


def price_grid(grid: GridPoint | str | None) -> dict[str, dict]:
    """The torchtitan-style baseline's cost block (or why it has none)."""
    if grid is None:
        return {}
    if isinstance(grid, str):
        return {"torchtitan": {"error": grid}}
    return {grid.name: realise(grid.gp, grid.choice)[1].to_dict()}
