"""Pipelined plans (Alpa §5): slice the layer sequence into stages on sub-meshes, plan
each stage's ops with the intra-op ILP, plan the cross-mesh resharding of every tensor that
crosses a stage boundary (long skip connections included), and simulate the schedule.

:func:`solve_pipelined` runs the steps, each in its module: the layer units and their
signature classes (:mod:`~ilp_planner.inter_op.layer_units`); the stage variants of
every (range, sub-mesh) pair from intra-op solves (:mod:`~ilp_planner.inter_op.stage_solver`),
pruned by an incumbent plan (:mod:`~ilp_planner.inter_op.stage_incumbent`); the boundary
estimate of every cut (:mod:`~ilp_planner.inter_op.boundary_estimate`); the stage DP
(:func:`formulations.stage_dp.solve_stages`); the torchtitan grid beside it
(:mod:`~ilp_planner.inter_op.pipelined_grid`); and the chosen stages assembled — the
crossing tensors resharded on their real layouts (:mod:`~ilp_planner.inter_op.stage_resharding`)
and the schedule simulated (:mod:`~ilp_planner.inter_op.assembly`).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from formulations.schedules import INTERLEAVED
from formulations.stage_dp import StagePlan, solve_stages
from ilp_planner.errors import InfeasibleError
from ilp_planner.inputs.config import Config
from ilp_planner.inter_op.assembly import (
    AssembledPipeline,
    SolvedStage,
    assemble_pipeline,
    pipeline_plan,
)
from ilp_planner.inter_op.boundary_estimate import BoundaryCost
from ilp_planner.inter_op.given_rival import given_if_faster, given_if_faster_noted
from ilp_planner.inter_op.interleaved import best_interleaved, interleaved_report
from ilp_planner.inter_op.layer_units import check_stage_count, layer_units
from ilp_planner.inter_op.pipelined_grid import (
    GridPipeline,
    grid_stage_plans,
    pipelined_grid,
    price_pipelined_grid,
)
from ilp_planner.inter_op.resharding import ReshardingPlan
from ilp_planner.inter_op.stage_incumbent import most_stages, set_incumbent
from ilp_planner.inter_op.stage_solver import StageSolver
from ilp_planner.inter_op.stage_variants import AtGridPoint, Gap
from ilp_planner.intra_op.baseline_prices import grid_baseline, price_baselines, price_grid
from ilp_planner.intra_op.realise import realise
from ilp_planner.intra_op.request import MeshSolveRequest
from ilp_planner.intra_op.solve_mesh import solve_single_mesh
from ilp_planner.ir.cluster import submesh_shapes
from ilp_planner.plan.data import Plan, SolverReport, StageSolves


def solve_pipelined(config: Config, *, baselines: bool = True) -> Plan:
    """Stages by the DP, intra-op plans per stage, resharding per crossing tensor, and the
    simulated schedule."""
    return _solve_pipelined(config, baselines)


@dataclass(frozen=True)
class _StageSpace:
    """Where the DP may place stages: the sub-mesh shapes allowed, the stage count (None:
    the DP's choice) and the sub-meshes the config fixes (None: the DP's choice)."""

    shapes: list[tuple[int, int]]
    num_stages: int | None
    fixed: list | None

    @classmethod
    def of(cls, config: Config, num_units: int) -> _StageSpace:
        """The config's space for ``num_units`` layer units (no more stages than units)."""
        pipe, cluster = config.pipeline, config.cluster
        check_stage_count(config, num_units)
        num_stages = None if pipe.stages == "auto" else int(pipe.stages)
        return cls(submesh_shapes(cluster.nodes, cluster.devices_per_node, pipe.submesh_space),
                   num_stages, list(pipe.submeshes) if pipe.submeshes else None)


def _solve_pipelined(config: Config, baselines: bool) -> Plan:
    """The steps of :func:`solve_pipelined` (module docstring); with ``baselines``, the
    torchtitan grid's stages are offered to the DP as variants where it is faster, and the
    plan carries the baselines' costs; a faster compared configuration (``compare:``) is
    kept as the plan (:mod:`~ilp_planner.inter_op.given_rival`)."""
    t0 = time.perf_counter()
    graph = config.microbatch_graph()
    units = layer_units(graph, config.pipeline.max_units)
    space = _StageSpace.of(config, len(units))
    solver = StageSolver(config, graph, units)
    if config.pipeline.schedule == INTERLEAVED:
        return _solve_interleaved(config, graph, solver, space, baselines, t0)
    boundary = BoundaryCost(config, graph, units)
    if space.fixed is None and config.pipeline.stage_bound:
        set_incumbent(solver, boundary, space.shapes, space.num_stages,
                      config.pipeline.imbalance_tolerance)
    dp = _stage_dp(config, solver, boundary, space)
    grid, grid_s = None, 0.0
    if baselines and space.fixed is None and space.num_stages != 1:
        t1 = time.perf_counter()
        grid = pipelined_grid(config, graph, solver, boundary, space.shapes, space.num_stages,
                              len(dp.stages))
        grid_s = time.perf_counter() - t1  # pricing the baseline, not the plan
        if isinstance(grid, GridPipeline) and grid.latency_s < dp.objective_s:
            for st in grid.stages:  # its stage plans, re-solved in the whole space
                solver.add_variant(st.start, st.end, grid.shape, st.how)
            dp = _stage_dp(config, solver, boundary, space)
    reshardings: dict[tuple, ReshardingPlan] = {}
    pipeline = assemble_pipeline(config, graph, _chosen_stage_plans(solver, dp), dp.objective_s,
                         reshardings)
    grid_pipeline = None
    if isinstance(grid, GridPipeline):
        own = grid_stage_plans(config, solver, grid)
        assert own is not None
        grid_pipeline = assemble_pipeline(config, graph, own, grid.latency_s, reshardings)
        pipeline = _faster_of(config, solver, grid, pipeline, grid_pipeline, reshardings)
    if config.pipeline.virtual_stages == "auto":
        pipeline = _interleaved_if_faster(config, graph, solver, pipeline, len(dp.stages),
                                          reshardings)
    pipeline = given_if_faster(config, pipeline)  # never slower than a compared configuration
    report = _solver_report(pipeline, dp, solver, boundary, len(units),
                            time.perf_counter() - t0, grid_s)
    plan = pipeline_plan(config, pipeline, report)
    if baselines:
        plan.baselines = _single_mesh_baselines(config)
        plan.baselines.update(price_pipelined_grid(grid, grid_pipeline))
    return plan


def _solve_interleaved(config: Config, graph, solver: StageSolver, space: _StageSpace,
                       baselines: bool, t0: float) -> Plan:
    """``schedule: interleaved-1f1b``: the fastest interleaved pipeline on the config's stage
    count (``auto``: every count that splits the cluster evenly), or a faster interleaved
    compared configuration (:mod:`~ilp_planner.inter_op.given_rival`), its plan and
    baselines."""
    n = config.cluster.num_devices
    counts = [space.num_stages] if space.num_stages is not None else [
        p for p in range(2, n + 1) if n % p == 0]
    pipeline, why = best_interleaved(config, graph, solver, counts, {})
    # never slower than a compared configuration; where neither fits, the refusal says why
    # each compared configuration was not kept, too
    pipeline, rivals = given_if_faster_noted(config, pipeline)
    if pipeline is None:
        raise InfeasibleError("no interleaved 1F1B pipeline fits: " + "; ".join([*why, *rivals]))
    plan = pipeline_plan(config, pipeline, interleaved_report(
        pipeline, solver, time.perf_counter() - t0))
    if baselines:
        plan.baselines = _single_mesh_baselines(config)
    return plan


def _interleaved_if_faster(config: Config, graph, solver: StageSolver,
                           pipeline: AssembledPipeline, num_stages: int, reshardings: dict
                           ) -> AssembledPipeline:
    """``virtual_stages: auto`` beside another schedule: the stage DP's pipeline, or an
    interleaved one on its stage count where that simulates faster (noted in the report)."""
    if num_stages < 2:
        return pipeline
    rival, why = best_interleaved(config, graph, solver, [num_stages], reshardings)
    if rival is None:
        return _noted(pipeline, "no interleaved 1F1B pipeline fits (" + "; ".join(why[:2]) + ")")
    v = rival.schedule.virtual_stages
    if rival.step_s >= pipeline.step_s:
        return _noted(pipeline, f"interleaved 1F1B priced: the best, {num_stages} stage meshes "
                                f"× {v} chunks, simulates to {rival.step_s:.6g} s a step: kept "
                                f"the stage DP's {pipeline.step_s:.6g} s")
    return dataclasses.replace(rival, note=(
        f"interleaved 1F1B ({num_stages} stage meshes × {v} chunks) simulates to "
        f"{rival.step_s:.6g} s a step, the stage DP's {pipeline.schedule.name} pipeline "
        f"{pipeline.step_s:.6g} s: kept the interleaved one"))


def _noted(pipeline: AssembledPipeline, note: str) -> AssembledPipeline:
    """``pipeline`` with ``note`` added to its report's."""
    return dataclasses.replace(pipeline, note="; ".join(n for n in (pipeline.note, note) if n))


def _stage_dp(config: Config, solver: StageSolver, boundary: BoundaryCost,
              space: _StageSpace) -> StagePlan:
    """The stage DP over the solver's table, run again until its answer is exact: while a
    deeper stage than the variants were made for could beat it (the positions widen), and
    while it chooses a :class:`Gap` variant no solved one serves (the gap is refined)."""
    pipe, cluster = config.pipeline, config.cluster
    while True:
        solver.stats.calls = 0  # the pairs of the last table
        dp = solve_stages(
            len(solver.units), cluster.nodes, cluster.devices_per_node, pipe.microbatches,
            solver.stage_cost, boundary_cost=boundary, schedule=pipe.schedule,
            memory_budget_bytes=cluster.memory_bytes, num_stages=space.num_stages,
            submesh_shapes=space.shapes, fixed_submeshes=space.fixed,
            imbalance_tolerance=pipe.imbalance_tolerance,
            least_memory=lambda k, i, shape, held: solver.state.least_memory(
                (solver.keys.key(k, i + 1), shape), held, cluster.memory_bytes),
        )
        state = solver.state
        if state.max_position is not None:
            # variants were solved for positions up to max_position only: exact once
            # no plan with a deeper stage can beat this one, else widen and solve again
            # (the incumbent's bound holds it already, up to the float tolerance)
            deepest = most_stages(solver, dp.objective_s)
            if deepest > state.max_position:
                state.widen_positions(deepest)
                continue
        gaps = [j for j, st in enumerate(dp.stages) if isinstance(
            solver.variant_how(st.start, st.end, st.submesh, st.variant), Gap)]
        if any([solver.refine(dp.stages[j]) for j in gaps]):
            continue
        if gaps:  # each chosen gap's time is that of a solved variant fitting there
            dp = dataclasses.replace(dp, stages=tuple(
                _served(solver, st) if j in gaps else st for j, st in enumerate(dp.stages)))
        if state.incumbent_s is None or dp.objective_s <= state.incumbent_s * (1 + 1e-9):
            return dp
        # the incumbent is a plan of the table: cannot happen; stay exact regardless
        state.forget_incumbent()


def _served(solver: StageSolver, stage):
    """``stage`` (a StageChoice on a :class:`Gap`) on the solved variant serving it."""
    v = solver.serving(stage)
    assert v is not None
    c = solver.state.variants[(solver.keys.key(stage.start, stage.end), stage.submesh)][v][1]
    return dataclasses.replace(stage, variant=v, memory_bytes=c.memory(stage.inflight_microbatches))


def _chosen_stage_plans(solver: StageSolver, dp: StagePlan) -> list[SolvedStage]:
    """The DP's stages with the plans their variants were solved with."""
    chosen = []
    for st in dp.stages:
        how = solver.variant_how(st.start, st.end, st.submesh, st.variant)
        _, res, stage_layers, _ = solver.solve(st.start, st.end, st.submesh, how)  # type: ignore[misc]
        chosen.append(SolvedStage(st, solver.names(st.start, st.end), stage_layers,
                                 SolverReport.of(res),
                                 how.inflight if isinstance(how, AtGridPoint) else how))
    return chosen


def _faster_of(config: Config, solver: StageSolver, grid: GridPipeline, pipeline: AssembledPipeline,
               grid_pipeline: AssembledPipeline, reshardings: dict) -> AssembledPipeline:
    """The DP's pipeline, or where the grid's simulates faster (the DP's formula and the
    simulated schedule disagree there) the grid's stages re-solved in the whole space, or
    the grid's own points (members of the space where they recompute what
    ``solver.recompute`` allows), whichever simulates fastest. Every rival is runnable
    already: a grid point is a baseline member, whose solve refuses a choice breaking a
    coupling (:func:`~ilp_planner.intra_op.baselines.torchtitan_choice` prices it as
    ``parallelize: …`` instead), and a re-solve goes through the stage solver's checked
    solve."""
    if grid_pipeline.step_s >= pipeline.step_s:
        return pipeline
    resolved = grid_stage_plans(config, solver, grid, True)
    # the grid's own points only where they recompute what solver.recompute allows
    rivals = [grid_pipeline] if all(st.in_space for st in grid.stages) else []
    if resolved is not None:
        rivals.append(assemble_pipeline(config, solver.graph, resolved, grid.latency_s,
                                        reshardings))
    if not rivals:
        return pipeline
    better = min(rivals, key=lambda p: p.step_s)
    if better.step_s >= pipeline.step_s:
        return pipeline
    return dataclasses.replace(better, note=(
        f"the stage DP's pipeline simulates to {pipeline.step_s:.6g} s a step; "
        f"kept the torchtitan grid's {len(grid.stages)} stages"
        f"{'' if better is grid_pipeline else ' re-solved in the whole space'}, "
        f"{better.step_s:.6g} s"))


def _solver_report(pipeline: AssembledPipeline, dp: StagePlan, solver: StageSolver,
                   boundary: BoundaryCost, num_units: int, total_s: float,
                   grid_s: float = 0.0) -> SolverReport:
    """The plan's solver report: the stages' ILP statuses combined, the DP's objective, the
    stage solver's counts and where the time went (``grid_s``: of ``total_s``, pricing the
    pipelined torchtitan grid)."""
    stages = pipeline.stages
    reports = [s.dp.solver for s in stages if s.dp is not None]
    status = "optimal"
    for st in (r.status for r in reports):
        if st != "optimal":
            status = "feasible" if st == "feasible" and status == "optimal" else st
    gaps = [r.gap for r in reports if r.gap]
    stats, state = solver.stats, solver.state
    table_rest_s = max(0.0, dp.table_s - stats.solve_s - boundary.seconds)
    assert pipeline.schedule.simulated is not None
    return SolverReport(
        status, pipeline.schedule.simulated.dp_objective_s, "stage_dp+ilp", None,
        max(gaps) if gaps else (0.0 if status == "optimal" else None),
        dp.table_s, total_s - dp.table_s,
        f"{len(stages)} stages from {stats.solves} intra-op solves ({num_units} layer units, "
        f"{stats.calls} (range, sub-mesh) pairs); each stage's ILP {status}; the stage DP is "
        f"exact over its cost table" + (f"; {pipeline.note}" if pipeline.note else ""),
        stages=StageSolves(
            num_units, stats.solves, stats.calls, len(state.bounded), len(state.relaxed),
            len(state.cut_off), state.incumbent_s, stats.not_optimal, solver.time_limit_s,
            {"stage_solve_s": stats.solve_s, "stage_build_s": stats.build_s,
             "boundary_s": boundary.seconds, "dp_s": dp.solve_s + table_rest_s,
             "resharding_s": pipeline.resharding_s, "grid_s": grid_s, "total_s": total_s}),
    )


def _single_mesh_baselines(config: Config) -> dict[str, dict]:
    """Without pipelining (gradient accumulation over the same micro-batches on the whole
    cluster): the planner's own single-mesh optimum and the usual baselines."""

    request = MeshSolveRequest.whole_cluster(config)
    try:
        gp, res, grid = solve_single_mesh(config)
        out = {"ilp_single_mesh": realise(gp, list(res.choice))[1].to_dict()}
    except InfeasibleError as exc:
        out, grid = {"ilp_single_mesh": {"error": str(exc)}}, grid_baseline(request)
    out.update(price_baselines(request))
    out.update(price_grid(grid))
    return out
