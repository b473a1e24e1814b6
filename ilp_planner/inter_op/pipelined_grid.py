"""The torchtitan-style grid with pipelining, the baseline a pipelined plan is compared
with: every PP degree on equal meshes, the units split evenly, each stage at its best
point of the intra-stage grid (:func:`~ilp_planner.intra_op.baselines.torchtitan_choice`),
assembled and simulated as the planner's own pipeline is."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from formulations.schedules import inflight_microbatches
from formulations.stage_dp import StageChoice, pack_submeshes
from ilp_planner.inputs.config import Config
from ilp_planner.inter_op.assembly import AssembledPipeline, SolvedStage
from ilp_planner.inter_op.boundary_estimate import BoundaryCost
from ilp_planner.inter_op.layer_units import subgraph
from ilp_planner.inter_op.stage_solver import StageSolver, pipeline_latency
from ilp_planner.inter_op.stage_variants import AtGridPoint
from ilp_planner.intra_op.baselines import GridPoint, torchtitan_choice
from ilp_planner.intra_op.problem import build_nodes, peak_memory
from ilp_planner.intra_op.realise import realise
from ilp_planner.intra_op.solve_mesh import recompute_in_space
from ilp_planner.ir.graph import Graph
from ilp_planner.lowering.stage_boundary import stage_boundary
from ilp_planner.plan.data import SolverReport


@dataclass(frozen=True)
class GridStage:
    start: int
    end: int
    point: GridPoint
    time_s: float  # per micro-batch, boundary send included
    boundary_s: float  # of which the boundary send (the DP's estimate)
    how: AtGridPoint  # its whole-space re-solve, recomputing only what solver.recompute allows
    # the point recomputes what solver.recompute allows and shards state only at the
    # solver.state_sharding levels: a plan may keep it
    in_space: bool


@dataclass(frozen=True)
class GridPipeline:
    """torchtitan's pipeline dimension: ``S`` stages of ``L/S`` units on equal meshes of
    ``shape``, each stage at its best grid point; ``latency_s`` = ``Σ t + (B − 1) max t``
    with the DP's boundary estimates, the formula of the planner's ``dp_objective_s``."""

    shape: tuple[int, int]
    stages: tuple[GridStage, ...]
    latency_s: float


def pipelined_grid(config: Config, graph: Graph, solver: StageSolver, boundary: BoundaryCost,
                   shapes: Sequence[tuple[int, int]], num_stages: int | None,
                   first: int | None = None) -> GridPipeline | str:
    """The torchtitan-style grid with pipelining: every PP degree ``S ≥ 2`` (the stage
    count when the config fixes it) whose equal meshes are an allowed sub-mesh shape, the
    units split evenly (torchtitan's default split), and per stage the best point of the
    intra-stage grid (:func:`~ilp_planner.intra_op.baselines.torchtitan_choice`: DDP/FSDP × dp × tp
    × SP × AC) holding its position's in-flight micro-batches. torchtitan applies one
    point to every stage; taking each stage's best is at least as good. Returns the
    fastest, or why none fits.

    Exact pruning (each grid point is several exact solves, and 1,024 devices have many
    PP degrees): no stage runs a micro-batch faster than its FLOPs spread perfectly over
    its mesh (:attr:`~ilp_planner.inter_op.stage_solver.StageSolver.work_prefix`), so a
    degree whose latency with those floors for the stages not yet priced reaches the best
    found is dropped — before its first stage or after any. The degree ``first`` (the stage
    DP's) is tried first."""

    pipe, cluster, opts = config.pipeline, config.cluster, config.solver
    L, D, M = len(solver.units), cluster.num_devices, pipe.microbatches
    sizes = {n * d: (n, d) for n, d in shapes}
    best: GridPipeline | None = None
    reasons = []
    degrees = [S for S in range(2, min(L, D) + 1) if D % S == 0 and D // S in sizes
               and (num_stages is None or S == num_stages)]
    W = solver.work_prefix
    for S in sorted(degrees, key=lambda S: (S != first, S)):
        n, d = sizes[D // S]
        q, r = divmod(L, S)
        ends = list(itertools.accumulate(q + (j < r) for j in range(S)))
        floors = [(W[e] - W[ends[j - 1] if j else 0]) / (n * d) for j, e in enumerate(ends)]
        stages: list[GridStage] = []
        for j, e in enumerate(ends):
            if best is not None and pipeline_latency([st.time_s for st in stages] + floors[j:], M) * (
                    1 - 1e-9) >= best.latency_s:
                break  # this degree cannot beat the best found
            a = ends[j - 1] if j else 0
            held = inflight_microbatches(pipe.schedule, S - j, M)
            names = solver.names(a, e)
            sub = subgraph(graph, names)
            bound = dataclasses.replace(stage_boundary(graph, names), inflight=held)

            def build(levels, blocks, keep, _dp, sub=sub, bound=bound, n=n, d=d):
                # the pipeline fixes the micro-batches: a member they do not suit has no price
                return build_nodes(sub, cluster, n, d, config.memory,
                                   tie_layers=opts.tie_layers,
                                   memory_budget=cluster.memory_bytes, microbatches=M,
                                   boundary=bound, grad_bucket_bytes=config.grad_bucket_bytes,
                                   cache=solver.state.build_cache, zero_levels=levels,
                                   recompute=blocks, keep=keep)

            point = torchtitan_choice(sub, build, n, d, cluster.memory_bytes, solver.time_limit_s)
            if isinstance(point, str):
                reasons.append(f"pp={S}, stage {j}: {point}")
                break
            units = sub.blocks()
            mine = recompute_in_space(config, units, point.gp.recompute_units)
            how = AtGridPoint(held, tuple(i for i, u in enumerate(units) if u in mine),
                              point.reserve)
            layers, cost = realise(point.gp, point.choice)
            t = cost.total_s / M
            send = boundary(e, (n, d)) if e < L else 0.0
            in_space = mine == point.gp.recompute_units and \
                {ly.zero for ly in layers} <= set(opts.state_sharding)
            stages.append(GridStage(a, e, point, t + send, send, how, in_space))
        if len(stages) == S:
            latency = pipeline_latency([st.time_s for st in stages], M)
            if best is None or latency < best.latency_s:
                best = GridPipeline((n, d), tuple(stages), latency)
    if best is None:
        return reasons[0] if reasons else "no pipeline degree splits the cluster into " \
            "allowed equal meshes"
    return best


def grid_stage_plans(config: Config, solver: StageSolver, grid: GridPipeline,
                      whole_space: bool = False) -> list[SolvedStage] | None:
    """The pipelined grid's stages on equal meshes packed in stage order: each at its grid
    point, or (``whole_space``) re-solved in the planner's whole space at the point's
    recomputed blocks and reserve (never slower per step: the point is in that space;
    None should a re-solve find nothing)."""

    cluster = config.cluster
    meshes = pack_submeshes([grid.shape] * len(grid.stages), cluster.nodes,
                            cluster.devices_per_node)
    out = []
    for st, mesh in zip(grid.stages, meshes, strict=True):
        names = solver.names(st.start, st.end)
        if whole_space:
            solved = solver.solve(st.start, st.end, grid.shape, st.how)
            if solved is None:
                return None
            gp, res, layers, _ = solved
            report, choice = SolverReport.of(res), list(res.choice)
        else:
            gp, choice = st.point.gp, st.point.choice
            layers = realise(gp, choice)[0]
            report = SolverReport("optimal", st.point.objective, f"grid point {st.point.name}")
        stage = StageChoice(st.start, st.end, grid.shape, st.time_s, st.time_s - st.boundary_s,
                            st.boundary_s, peak_memory(gp, choice), st.how.inflight, mesh)
        out.append(SolvedStage(stage, names, layers, report, st.how.inflight))
    return out


def price_pipelined_grid(grid: GridPipeline | str | None,
                         pipeline: AssembledPipeline | None = None) -> dict[str, dict]:
    """The pipelined grid's baseline block: its busiest stage's cost breakdown (per step),
    with ``pipeline_s`` the step that ratios compare — ``pipeline``'s, the grid assembled
    and simulated as the planner's own pipeline is (:func:`assemble_pipeline`) — and
    ``dp_formula_s`` its latency by the stage DP's formula (or why it has none)."""

    if grid is None:
        return {}
    if isinstance(grid, str):
        return {"torchtitan_pp": {"error": grid}}
    assert pipeline is not None
    busiest = max(grid.stages, key=lambda st: st.time_s)
    points = dict.fromkeys(st.point.name.removeprefix("torchtitan(").rstrip(")")
                           for st in grid.stages)
    name = f"torchtitan(pp={len(grid.stages)}; {' | '.join(points)})"
    block = realise(busiest.point.gp, busiest.point.choice)[1].to_dict()
    block["pipeline_s"] = pipeline.step_s
    block["dp_formula_s"] = grid.latency_s
    return {name: block}
