"""Reference answers the tests check the production solvers against: exhaustive or
independent re-derivations, too slow or too naive to ship, kept beside the tests."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence

from formulations.cross_mesh import _REL_TOL as REL_TOL
from formulations.cross_mesh import CrossMeshProblem, ScheduledTask
from formulations.schedules import Schedule, check_schedule_name, inflight_microbatches
from formulations.stage_dp import (
    BoundaryCostFn,
    Shape,
    StageChoice,
    StageCost,
    StageCostFn,
    StagePlan,
    _check_shapes,
    _stage_cost_checked,
    _work_prefix,
    admissible,
    pack_submeshes,
)
from ilp_planner.errors import InfeasibleError
from ilp_planner.inter_op.layer_units import _op_key
from ilp_planner.ir.cluster import submesh_shapes as all_shapes
from ilp_planner.ir.graph import Graph, OpKind
from ilp_planner.lowering.stage_boundary import StageBoundary


def brute_force_stages(
    num_layers: int,
    nodes: int,
    devices_per_node: int,
    num_microbatches: int,
    stage_cost: StageCostFn,
    *,
    boundary_cost: BoundaryCostFn | None = None,
    schedule: str = "1f1b",
    memory_budget_bytes: float = math.inf,
    num_stages: int | None = None,
    submesh_shapes: Sequence[Shape] | None = None,
    fixed_submeshes: Sequence[Shape] | None = None,
    imbalance_tolerance: float | None = None,
    layer_work: Sequence[float] | None = None,
) -> StagePlan:
    """The stage DP's oracle: enumerate every slicing × sub-mesh assignment (exponential; keep
    ``L ≤ 6`` and small clusters). Same arguments and result as :func:`solve_stages`."""
    t0 = time.perf_counter()
    schedule = check_schedule_name(schedule)
    L, D, M = num_layers, nodes * devices_per_node, num_microbatches

    shapes = _check_shapes(
        all_shapes(nodes, devices_per_node) if submesh_shapes is None else submesh_shapes,
        nodes,
        devices_per_node,
        "pipeline.submesh_shapes",
    )
    prefix = _work_prefix(L, layer_work)
    cache: dict[tuple[int, int, Shape], list[StageCost]] = {}

    def cost(a: int, e: int, sh: Shape, n_in: int) -> tuple[int, StageCost] | None:
        """The fastest variant that fits holding ``n_in`` micro-batches (the objective
        only grows with a stage's time, so it is the only one worth trying)."""
        if (a, e, sh) not in cache:
            cache[(a, e, sh)] = (
                _stage_cost_checked(stage_cost, a, e, sh)
                if admissible(a, e, sh, L, D, imbalance_tolerance, prefix)
                else []
            )
        fits = [(c.time_s, v, c) for v, c in enumerate(cache[(a, e, sh)])
                if c.memory(n_in) <= memory_budget_bytes]
        return min(fits, key=lambda f: f[:2])[1:] if fits else None

    best = None
    counts = [num_stages] if num_stages is not None else range(1, min(L, D) + 1)
    if fixed_submeshes is not None:
        counts = [len(fixed_submeshes)]
    for S in counts:
        for cuts in itertools.combinations(range(1, L), S - 1):
            bounds = [0, *cuts, L]
            ranges = list(zip(bounds[:-1], bounds[1:], strict=True))
            choices = (
                [tuple(tuple(s) for s in fixed_submeshes)]
                if fixed_submeshes is not None
                else itertools.product(shapes, repeat=S)
            )
            for assign in choices:
                if sum(n * d for n, d in assign) != D:
                    continue
                times, rows, ok = [], [], True
                for j, ((a, e), sh) in enumerate(zip(ranges, assign, strict=True)):
                    n_in = inflight_microbatches(schedule, S - j, M)
                    found = cost(a, e, sh, n_in)
                    if found is None:
                        ok = False
                        break
                    v, c = found
                    memory = c.memory(n_in)
                    b = float(boundary_cost(e, sh)) if (boundary_cost and e < L) else 0.0
                    times.append(c.time_s + b)
                    rows.append((a, e, sh, c.time_s, b, memory, n_in, v))
                if not ok:
                    continue
                obj = sum(times) + (M - 1) * max(times)
                if best is None or obj < best[0]:
                    try:
                        placement = pack_submeshes(list(assign), nodes, devices_per_node)
                    except InfeasibleError:
                        continue
                    best = (obj, sum(times), max(times), rows, placement)
    if best is None:
        raise InfeasibleError(f"brute force: no feasible assignment of {L} layers on {D} devices")
    obj, total, tmax, rows, placement = best
    stages = tuple(
        StageChoice(a, e, sh, t + b, t, b, mem, n_in, placement[j], v)
        for j, (a, e, sh, t, b, mem, n_in, v) in enumerate(rows)
    )
    return StagePlan(
        stages=stages,
        objective_s=obj,
        sum_time_s=total,
        t_max_s=tmax,
        num_microbatches=M,
        schedule=schedule,
        memory_budget_bytes=float(memory_budget_bytes),
        method="brute_force",
        solve_s=time.perf_counter() - t0,
    )


def validate_schedule(problem: CrossMeshProblem, schedule: Sequence[ScheduledTask]) -> list[str]:
    """Every violation of eqs. (2)–(3) and of the timing, as readable lines (empty = valid)."""
    errors: list[str] = []
    if len(schedule) != problem.size:
        return [f"schedule has {len(schedule)} entries for {problem.size} tasks"]
    busy: dict[int, list[tuple[float, float, int]]] = {}
    for i, s in enumerate(schedule):
        t = problem.tasks[i]
        if s.task != i:
            errors.append(f"entry {i} is for task {s.task}")
            continue
        if not 0 <= s.candidate < len(t.candidates) or t.candidates[s.candidate].sender != s.sender:
            errors.append(f"task {i} ({t.name}): sender {s.sender} is not candidate {s.candidate}")
            continue
        c = t.candidates[s.candidate]
        tol = REL_TOL * max(1.0, s.end)
        if s.start < -tol or abs(s.end - s.start - c.duration) > tol or \
                abs(s.finish - s.end - c.tail) > tol:
            errors.append(f"task {i} ({t.name}): times [{s.start}, {s.end}, {s.finish}] do not "
                          f"match duration {c.duration} and tail {c.tail}")
        for r in problem.resources(i, s.candidate):
            busy.setdefault(r, []).append((s.start, s.end, i))
    H = problem.num_hosts
    for r, spans in sorted(busy.items()):
        spans.sort()
        for (s0, e0, i0), (s1, _e1, i1) in itertools.pairwise(spans):
            if s1 < e0 - REL_TOL * max(1.0, e0):
                side = "send" if r < H else "receive"
                errors.append(f"host {r % H} {side} side: task {i0} [{s0}, {e0}) overlaps task "
                              f"{i1} starting {s1}")
    return errors


def strip_comm(schedule: Schedule) -> Schedule:
    """Inverse of :func:`lower`: only the compute actions."""
    rows = tuple(tuple(a for a in row if a.kind.is_compute) for row in schedule.rows)
    return Schedule(
        schedule.name, schedule.num_stages, schedule.num_microbatches, rows, schedule.split_backward
    )


def signature(graph: Graph, names: Sequence[str], boundary: StageBoundary | None = None) -> tuple:
    """The signature of a unit range (what :class:`~ilp_planner.inter_op.layer_units.RangeKeys`
    finds part by part): a name-free description of a range, equal for any k consecutive repeated blocks with
    the same boundary (which ops a later stage reads, which inputs come from a stage)."""
    index = {n: i for i, n in enumerate(names)}
    b = boundary or StageBoundary()
    return tuple(
        (*_op_key(op), n in b.exported,
         tuple(index[s] - index[n] if s in index else ("ext", graph[s].output, s in b.imported)
               for s in op.inputs))
        for n in names for op in (graph[n],)
    )


def crossing(graph: Graph, units: list[list[str]], cut: int) -> list[tuple[str, str]]:
    """(producer, consumer) edges from units ``< cut`` to units ``≥ cut`` (what
    :class:`~ilp_planner.inter_op.boundary_estimate.BoundaryCost` finds in one pass)."""
    before = {n for u in units[:cut] for n in u} | {op.name for op in graph.ops
                                                    if op.kind is OpKind.INPUT}
    after = {n for u in units[cut:] for n in u}
    return [(s, d) for s, d in graph.edges() if s in before and d in after
            and graph[s].kind is not OpKind.INPUT]
