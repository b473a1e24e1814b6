"""Interleaved 1F1B pipelines (Narayanan et al. SC'21 §2.2.2, Megatron-LM's virtual pipeline
stages): ``p`` stage meshes of one shape, the layer units cut into ``p·v`` contiguous chunks,
chunk ``j`` on mesh ``j mod p``, run by :func:`formulations.schedules.interleaved_1f1b`.

How the planner builds and prices one (:func:`interleaved_pipeline`):

1. **meshes** — ``p`` equal sub-meshes (``pipeline.submeshes`` when given, all equal; else
   the cluster split evenly), placed by :func:`formulations.stage_dp.pack_submeshes`;
2. **chunks** — a min–max DP over the layer units with exactly ``p·v`` chunks, each range
   priced by the stage solver's fastest intra-op plan on that shape (the stage DP's own
   per-range table, cached by signature class), ties broken by the total time. The
   slowest *chunk*, not the slowest mesh's sum of chunks: the schedule runs its chunks in
   lockstep rounds, so an uneven cut that balances the meshes' sums still waits on its
   largest chunk — on gpt-13b-a100-2x8 (4 × 2 chunks, 8 micro-batches) a cut balancing the
   mesh sums (chunks of 1 to 9 blocks) simulated 26 % slower than the balanced one;
3. **memory** — per mesh, the fixed memory of its ``v`` chunks plus the chunk activations
   in flight at its peak (:func:`formulations.schedules.inflight_interleaved`, more than
   1F1B's) times the largest of its chunks'; a mesh over the budget has its chunks re-solved
   each within a ``v``-th of it (sufficient, not necessary: a candidate that fits only with
   an uneven split of the budget between its chunks is missed);
4. **assembly** — :func:`~ilp_planner.inter_op.assembly.assemble_pipeline`: the crossing
   tensors resharded (each chunk boundary one transfer, the wrap-around from mesh ``p − 1``
   to mesh 0 included), the schedule simulated per chunk with the solved transfer times.

:func:`best_interleaved` tries the candidate ``(p, v)`` pairs and keeps the fastest
simulated step; the pipeline driver (:mod:`ilp_planner.inter_op.pipeline`) calls it for
``schedule: interleaved-1f1b`` alone, or beside the stage DP's pipeline for
``virtual_stages: auto``, keeping the faster.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from formulations.schedules import inflight_interleaved
from formulations.stage_dp import StageChoice, StageCost, pack_submeshes
from ilp_planner.errors import InfeasibleError
from ilp_planner.inputs.config import Config
from ilp_planner.inter_op.assembly import AssembledPipeline, SolvedStage, assemble_pipeline
from ilp_planner.inter_op.stage_solver import StageSolver
from ilp_planner.ir.graph import Graph
from ilp_planner.plan.data import SolverReport

MAX_AUTO_VIRTUAL = 8  # ``virtual_stages: auto`` tries 2..8 chunks per mesh (Megatron uses 2–6)


def mesh_shape(config: Config, p: int) -> tuple[int, int]:
    """The one sub-mesh shape of ``p`` stage meshes: ``pipeline.submeshes`` (all equal), else
    the cluster's devices split evenly — within a node or over whole nodes."""
    pipe, cluster = config.pipeline, config.cluster
    if pipe.submeshes:
        if len(set(pipe.submeshes)) != 1 or len(pipe.submeshes) != p:
            raise InfeasibleError(f"interleaved 1F1B runs {p} equal stage meshes; "
                                  f"pipeline.submeshes gives {list(pipe.submeshes)}")
        return pipe.submeshes[0]
    n, dpn = cluster.num_devices, cluster.devices_per_node
    d = n // p
    if n % p == 0 and dpn % d == 0:
        return (1, d)
    if n % p == 0 and d % dpn == 0:
        return (d // dpn, dpn)
    raise InfeasibleError(f"{n} devices ({cluster.nodes} × {dpn}) do not split into {p} equal "
                          f"stage meshes within a node or over whole nodes")


def virtual_stage_counts(config: Config, num_units: int, p: int) -> list[int]:
    """The ``v`` to try on ``p`` meshes: the config's count, or for ``auto`` 2 up to
    :data:`MAX_AUTO_VIRTUAL` while every chunk keeps a layer unit; none when the
    micro-batches are not whole rounds of ``p`` (Megatron-LM's rule)."""
    pipe = config.pipeline
    if pipe.microbatches % p:
        return []
    if isinstance(pipe.virtual_stages, int) and pipe.virtual_stages > 1:
        return [pipe.virtual_stages]
    return [v for v in range(2, MAX_AUTO_VIRTUAL + 1) if p * v <= num_units]


def chunk_ranges(solver: StageSolver, shape: tuple[int, int], chunks: int
                 ) -> list[tuple[int, int]] | None:
    """Cut the units into ``chunks`` contiguous ranges minimising the slowest chunk's time
    on ``shape`` (then the total): a DP from the end over the stage solver's fastest plans.
    None when no cut has every range solvable."""
    L = len(solver.units)
    if chunks > L:
        return None

    def cost(a: int, e: int) -> float:
        solved = solver.solve(a, e, shape)
        return math.inf if solved is None else solver.variant_cost(solved).time_s

    # best[c][k]: (max, sum, next cut) of the best cut of units k..L-1 into c chunks
    best: list[dict[int, tuple[float, float, int]]] = [{L: (0.0, 0.0, L)}]
    for c in range(1, chunks + 1):
        best.append({k: min(((max(t, best[c - 1][i][0]), t + best[c - 1][i][1], i)
                             for i in range(k + 1, L - c + 2) if i in best[c - 1]
                             for t in (cost(k, i),)),
                            default=(math.inf, math.inf, L))
                     for k in range(L - c + 1)})
    if not math.isfinite(best[chunks][0][0]):
        return None
    out, k = [], 0
    for c in range(chunks, 0, -1):
        nxt = best[c][k][2]
        out.append((k, nxt))
        k = nxt
    return out


def _mesh_memory(costs: Sequence[StageCost], held: int) -> float:
    """Per-device bytes of one mesh: its chunks' fixed memory plus ``held`` chunk
    activations in flight, each counted at the largest of its chunks'."""
    return (sum(c.memory_bytes_fixed for c in costs)
            + held * max(c.activation_bytes_per_microbatch for c in costs))


def _fitted(config: Config, graph: Graph, solver: StageSolver, ranges: list[tuple[int, int]],
            shape: tuple[int, int], p: int, v: int) -> tuple[list, list[int | None]]:
    """Each chunk's solve and the in-flight count it was solved for (None: its fastest
    plan, no memory row): its fastest plan; on a mesh over the budget, its ``v`` chunks
    re-solved each within ``budget / v`` holding the mesh's in-flight count ``n`` (state
    sharding, recomputation — whatever the config offers the ILP). That fits the mesh:
    ``Σ fixed_j + n·max act_j ≤ Σ (budget/v − n·act_j) + n·max act_j ≤ budget``."""
    solved = [solver.solve(a, e, shape) for a, e in ranges]
    solved_for: list[int | None] = [None] * len(ranges)
    M, budget = config.pipeline.microbatches, config.cluster.memory_bytes
    share = None
    for r in range(p):
        held = inflight_interleaved(p, r, M, v)
        if _mesh_memory([solver.variant_cost(s) for s in solved[r::p]], held) <= budget:
            continue
        if share is None:  # the same intra-op solves under a v-th of the memory
            share = StageSolver(dataclasses.replace(config, cluster=dataclasses.replace(
                config.cluster, memory_bytes=budget / v)), graph, solver.units)
        for j in range(r, p * v, p):
            solved[j], solved_for[j] = share.solve(*ranges[j], shape, held), held
            if solved[j] is None:
                raise InfeasibleError(
                    f"interleaved 1F1B {p}×{v}: chunk {j} (units {ranges[j][0]}..{ranges[j][1] - 1}) "
                    f"has no plan within {budget / v / 2**20:.4g} MiB per device (1/{v} of the "
                    f"budget) holding {held} chunk activations, and its mesh's fastest plans "
                    f"need more than the {budget / 2**20:.4g} MiB")
    if share is not None:  # its solves count among the plan's
        solver.stats.solves += share.stats.solves
        solver.stats.solve_s += share.stats.solve_s
        solver.stats.build_s += share.stats.build_s
    return solved, solved_for


def interleaved_pipeline(config: Config, graph: Graph, solver: StageSolver, p: int, v: int,
                         reshardings: dict) -> AssembledPipeline:
    """The interleaved pipeline of ``p`` meshes × ``v`` chunks (module docstring), assembled
    and simulated. Raises :class:`InfeasibleError` naming what does not fit."""
    shape = mesh_shape(config, p)
    cluster = config.cluster
    placements = pack_submeshes([shape] * p, cluster.nodes, cluster.devices_per_node)
    ranges = chunk_ranges(solver, shape, p * v)
    if ranges is None:
        raise InfeasibleError(f"no cut of the {len(solver.units)} layer units into {p}×{v} "
                              f"chunks has an intra-op plan for every chunk on {shape}")
    solved, solved_for = _fitted(config, graph, solver, ranges, shape, p, v)
    costs = [solver.variant_cost(s) for s in solved]
    M = config.pipeline.microbatches
    held = [inflight_interleaved(p, r, M, v) for r in range(p)]
    memory = [_mesh_memory(costs[r::p], held[r]) for r in range(p)]
    plans = []
    for j, ((a, e), s, c) in enumerate(zip(ranges, solved, costs, strict=True)):
        choice = StageChoice(a, e, shape, c.time_s, c.time_s, 0.0, memory[j % p], held[j % p],
                             placements[j % p])
        plans.append(SolvedStage(choice, solver.names(a, e), s[2], SolverReport.of(s[1]),
                                 solved_for[j]))
    objective = (M + (p - 1) / v) * max(sum(c.time_s for c in costs[r::p]) for r in range(p))
    return assemble_pipeline(config, graph, plans, objective, reshardings, virtual_stages=v)


def best_interleaved(config: Config, graph: Graph, solver: StageSolver, stage_counts: Sequence[int],
                     reshardings: dict) -> tuple[AssembledPipeline | None, list[str]]:
    """The fastest simulated interleaved pipeline over ``stage_counts`` × the config's
    virtual-stage counts (:func:`virtual_stage_counts`), and why each other candidate was
    left out."""
    best, why = None, []
    for p in stage_counts:
        counts = virtual_stage_counts(config, len(solver.units), p)
        if not counts:
            why.append(f"{p} stages: {config.pipeline.microbatches} micro-batches are not "
                       f"whole rounds of {p} (pipeline.microbatches must be a multiple of "
                       f"the stages), or too few layer units for 2 chunks per stage")
        for v in counts:
            try:
                cand = interleaved_pipeline(config, graph, solver, p, v, reshardings)
            except InfeasibleError as exc:
                why.append(f"{p}×{v}: {exc}")
                continue
            if best is None or cand.step_s < best.step_s:
                best = cand
    return best, why


def interleaved_report(pipeline: AssembledPipeline, solver: StageSolver, total_s: float
                       ) -> SolverReport:
    """The plan's solver report: the chunks' ILP statuses combined, the simulated step as
    the objective, the stage solver's counts."""
    reports = [s.dp.solver for s in pipeline.stages if s.dp is not None]
    statuses = {r.status for r in reports}
    status = "optimal" if statuses == {"optimal"} else (
        "feasible" if statuses <= {"optimal", "feasible"} else sorted(statuses - {"optimal"})[0])
    gaps = [r.gap for r in reports if r.gap]
    stats = solver.stats
    v = pipeline.schedule.virtual_stages
    return SolverReport(
        status, pipeline.step_s, "interleaved+ilp", None,
        max(gaps) if gaps else (0.0 if status == "optimal" else None),
        stats.build_s, max(0.0, total_s - stats.build_s),
        f"interleaved 1F1B: {len(pipeline.stages) // v} stage meshes × {v} chunks from "
        f"{stats.solves} intra-op solves; each chunk's ILP {status}; chunks cut by a min-max "
        f"DP over the fastest plans (not proven optimal over cuts)"
        + (f"; {pipeline.note}" if pipeline.note else ""))
