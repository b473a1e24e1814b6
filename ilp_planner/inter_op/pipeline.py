"""Pipelined plans: slice the layer sequence into stages on sub-meshes (Alpa §5 DP), plan
each stage's ops with the intra-op ILP, plan the cross-mesh resharding of every tensor that
crosses a stage boundary (long skip connections included), and simulate the schedule.

Layer units. The DP slices a sequence of *units*: each repetition of a block is a unit
(ops before the first block join the first, ops after the last join the last); a graph
without blocks has one unit per weighted op with its followers. There is no ceiling on the
number of units: a 96-block model gives the DP 96 units. ``pipeline.max_units`` coarsens
explicitly (consecutive units merged into at most that many) where a long block-free graph
would otherwise need too many distinct intra-op solves.

Stage cost ``t_i`` is the time of one micro-batch (forward + backward compute and
activation communication) of the stage's ops on its sub-mesh, from the ILP. Ranges with
the same signature (:func:`signature`: the ops, their in-range wiring and which tensors
cross the range's boundary) share one solve per sub-mesh shape, so for a model of ``L``
identical blocks the intra-op solves number about ``3 L`` per shape (a range is its block
count, whether it holds the first unit's extra ops and whether it holds the last's), not
``L²/2``. :class:`RangeKeys` finds a range's signature class from per-unit parts, without
building the range's op list. The boundary cost of a cut is the cross-mesh time of every
tensor crossing it, estimated with the stage's batch-split layout on both sides; the
final plan re-plans every crossing tensor with its real layouts (CP-SAT). A skip edge
crossing several cuts is charged at each cut it crosses in the DP (as if relayed), and
sent once, directly, in the plan.

Stage memory. A stage at position ``s`` from the end holds the activations of
``inflight(s)`` micro-batches (1F1B: ``min(s, B)``). Each (range, mesh) pair is solved
first without a memory row — the fastest plan, whose peak ``fixed + inflight · act`` is
exact at every position — and then, for the in-flight counts the pair can meet (its
possible positions) at which that plan does not fit, with the memory row of a count
(:attr:`StageBoundary.inflight`): the fastest plan that fits there, with state sharding
and recomputation where the config offers them. Counts are bisected: the best time grows
with the count, so where two solved counts give the same time the larger one's plan is
the best for every count between (exact for an exact stage solver; the ``recompute:
auto`` enumeration and the transient caps are exact per choice, not over all choices).
The DP picks per stage the fastest variant that fits its position (:data:`formulations.stage_dp.StageCostFn`).
Stage ILPs price one step of ``B`` accumulated micro-batches (per-micro-batch work ``B``
times, gradient synchronisation and ZeRO's weight gathers once), the DP's stage time is
that divided by ``B``.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import math
import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from formulations.schedules import inflight_microbatches, make_schedule
from formulations.simulator import StageDurations, simulate
from formulations.stage_dp import StageChoice, StageCost, admissible, pack_submeshes, solve_stages
from ilp_planner.errors import InfeasibleError
from ilp_planner.inputs.config import Config
from ilp_planner.inter_op.resharding import ReshardingPlan, ReshardOptions, plan_resharding, with_scheduler
from ilp_planner.intra_op.baseline_prices import grid_baseline, price_baselines, price_grid
from ilp_planner.intra_op.baselines import GridPoint, torchtitan_choice
from ilp_planner.intra_op.problem import BuildCache, build_problem, held_activations, peak_memory
from ilp_planner.intra_op.realise import realise
from ilp_planner.intra_op.request import MeshSolveRequest
from ilp_planner.intra_op.solve_mesh import (
    CutOff,
    _fit_blocks,
    fastest_bound,
    solve_mesh,
    solve_single_mesh,
)
from ilp_planner.ir.cluster import Cluster, SubMesh, submesh_shapes
from ilp_planner.ir.graph import Graph, Op, OpKind, TensorSpec
from ilp_planner.ir.layouts import Layout
from ilp_planner.lowering.cost_model import (
    ONCE_PER_STEP,
    Collective,
    CollectiveKind,
    compute_time,
    make_collective,
)
from ilp_planner.lowering.grad_buckets import exposed_grad_sync
from ilp_planner.lowering.redistribution import plan_redistribution
from ilp_planner.lowering.stage_boundary import StageBoundary, stage_boundary
from ilp_planner.lowering.strategies import resolve_partial, tied_source
from ilp_planner.plan.check import find_entry
from ilp_planner.plan.data import CostBreakdown, LayerPlan, Plan, layout_from_dict, layout_to_dict

#: Default per-stage intra-op time limit (s) when ``pipeline.stage_time_limit_s`` is unset:
#: ``min(solver.time_limit_s, STAGE_TIME_LIMIT_S)`` — the DP runs hundreds of stage solves.
STAGE_TIME_LIMIT_S = 10.0


def layer_units(graph: Graph, max_units: int | None = None) -> list[list[str]]:
    """Op names per unit, in graph order (inputs excluded): one unit per block, or per
    weighted op in a graph without blocks. ``max_units`` (``pipeline.max_units``) merges
    consecutive units into at most that many; ``None`` keeps them all."""
    ops = [op for op in graph.ops if op.kind is not OpKind.INPUT]
    blocks = [op.block_index for op in ops]
    if any(b is not None for b in blocks):
        first = next(i for i, b in enumerate(blocks) if b is not None)
        units: list[list[str]] = []
        current: int | None = None
        for i, op in enumerate(ops):
            b = op.block_index
            if i < first:
                b = blocks[first]
            elif b is None:
                b = current
            if b != current:
                units.append([])
                current = b
            units[-1].append(op.name)
    else:
        units = []
        for op in ops:
            weighted = op.weight is not None or op.params > 0
            if weighted or not units:
                units.append([])
            units[-1].append(op.name)
    return units if max_units is None else _coarsen(units, max_units)


def _coarsen(units: list[list[str]], max_units: int) -> list[list[str]]:
    if len(units) <= max_units:
        return units
    per = math.ceil(len(units) / max_units)
    return [sum(units[i:i + per], []) for i in range(0, len(units), per)]


def subgraph(graph: Graph, names: Sequence[str]) -> Graph:
    """The ops ``names`` as a graph; tensors produced outside become inputs (they arrive by
    cross-mesh resharding, whose cost is the boundary cost, so loading them is free here)."""
    inside = set(names)
    ops: list[Op] = []
    added: set[str] = set()
    for name in names:
        op = graph[name]
        for src in op.inputs:
            if src not in inside and src not in added:
                ops.append(Op(src, OpKind.INPUT, (), graph[src].output))
                added.add(src)
        ops.append(op)
    return Graph(f"{graph.name}[{names[0]}..{names[-1]}]", ops)


def signature(graph: Graph, names: Sequence[str], boundary: StageBoundary | None = None) -> tuple:
    """Name-free description of a range: equal for any k consecutive repeated blocks with
    the same boundary (which ops a later stage reads, which inputs come from a stage)."""
    index = {n: i for i, n in enumerate(names)}
    b = boundary or StageBoundary()
    return tuple(
        (*_op_key(op), n in b.exported,
         tuple(index[s] - index[n] if s in index else ("ext", graph[s].output, s in b.imported)
               for s in op.inputs))
        for n in names for op in (graph[n],)
    )


def _op_key(op: Op) -> tuple:
    """What of an op, besides its wiring, its stage problem depends on (no names)."""
    return (op.kind, op.output, op.weight, op.params, op.flops,
            tuple(sorted(op.attrs.items())), op.tie_key)


class RangeKeys:
    """Signature classes of unit ranges ``[a, e)`` without building their op lists.

    A range's :func:`signature` is the concatenation of its units' parts, and unit ``u``'s
    part depends on the range only through which of its inputs come from before ``a`` and
    which of its outputs are read at or after ``e``: that is, through ``x = min(u − a,
    back(u))`` and ``y = min(e − 1 − u, ahead(u))`` with ``back``/``ahead`` the farthest
    unit its ops read from / are read by (1 for a chain of blocks; more with skip edges).
    In-range wiring is kept as offsets in the global op order, equal to the offsets in the
    range's own list (units are contiguous). So :meth:`key` — the tuple of part ids — is
    equal for two ranges iff their signatures are equal with the same unit lengths; parts
    are built once per ``(u, x, y)``, and a key costs ``O(e − a)`` integer look-ups."""

    def __init__(self, graph: Graph, units: Sequence[Sequence[str]]):
        self.graph = graph
        self.units = [list(u) for u in units]
        self.unit_of = {n: j for j, u in enumerate(self.units) for n in u}
        order = [n for u in self.units for n in u]
        self.pos = {n: i for i, n in enumerate(order)}
        self.back: list[int] = []
        self.ahead: list[int] = []
        for j, u in enumerate(self.units):
            self.back.append(max((j - self.unit_of[s] for n in u for s in graph[n].inputs
                                  if s in self.unit_of), default=0))
            self.ahead.append(max((self.unit_of[c] - j for n in u for c in graph.consumers(n)),
                                  default=0))
        self._parts: dict[tuple[int, int, int], int] = {}
        self._part_ids: dict[tuple, int] = {}
        self._keys: dict[tuple[int, int], tuple[int, ...]] = {}

    def part(self, u: int, x: int, y: int) -> int:
        """Id of unit ``u``'s signature part when ``x`` units of the range precede it
        (capped at ``back(u)``) and ``y`` follow it (capped at ``ahead(u)``)."""
        k = (u, x, y)
        if k not in self._parts:
            g, a, e = self.graph, u - x, u + y + 1
            sig = []
            for n in self.units[u]:
                op = g[n]
                sig.append((
                    *_op_key(op),
                    any(self.unit_of[c] >= e for c in g.consumers(n)),
                    tuple(self.pos[s] - self.pos[n]
                          if s in self.unit_of and self.unit_of[s] >= a
                          else ("ext", g[s].output, s in self.unit_of) for s in op.inputs)))
            self._parts[k] = self._part_ids.setdefault(tuple(sig), len(self._part_ids))
        return self._parts[k]

    def key(self, a: int, e: int) -> tuple[int, ...]:
        """The signature class of units ``[a, e)``."""
        k = (a, e)
        if k not in self._keys:
            self._keys[k] = tuple(self.part(u, min(u - a, self.back[u]), min(e - 1 - u, self.ahead[u]))
                                  for u in range(a, e))
        return self._keys[k]





def crossing(graph: Graph, units: list[list[str]], cut: int) -> list[tuple[str, str]]:
    """(producer, consumer) edges from units ``< cut`` to units ``≥ cut``."""
    before = {n for u in units[:cut] for n in u} | {op.name for op in graph.ops
                                                    if op.kind is OpKind.INPUT}
    after = {n for u in units[cut:] for n in u}
    return [(s, d) for s, d in graph.edges() if s in before and d in after
            and graph[s].kind is not OpKind.INPUT]


class _StageSolver:
    """Intra-op solves of layer ranges on sub-mesh shapes, one per (signature class, shape)
    (:class:`RangeKeys`). Counts and times them for the plan's solver report."""

    def __init__(self, config: Config, graph: Graph, units: list[list[str]]):
        pipe = config.pipeline
        limit = pipe.stage_time_limit_s
        if limit is None:
            limit = min(config.solver.time_limit_s, STAGE_TIME_LIMIT_S)
        self.time_limit_s = limit
        self.config = (config if limit == config.solver.time_limit_s else
                       dataclasses.replace(config, solver=dataclasses.replace(
                           config.solver, time_limit_s=limit)))
        self.graph = graph
        self.units = units
        self.keys = RangeKeys(graph, units)
        self.cache: dict[tuple, tuple | None] = {}
        self.build_cache = BuildCache()  # per-op options and edge matrices across solves
        self.costs: dict[tuple, list[tuple[int | AtGridPoint | Gap | None, StageCost]]] = {}
        self.solves = 0
        self.solve_s = 0.0
        self.build_s = 0.0
        self.not_optimal = 0
        self.calls = 0
        # exact pruning (set_incumbent): a lower bound on every stage's time from its FLOPs
        # (then from its relaxation, :meth:`_relaxed_above`, and a solve's own bound, CutOff)
        cluster = config.cluster
        work = [sum(compute_time(3.0 * graph[n].flops, cluster) for n in u) for u in units]
        self.work_prefix = [0.0, *itertools.accumulate(work)]
        self.num_devices = cluster.num_devices
        self.incumbent_s: float | None = None
        self.bounded: set[tuple[int, int, tuple[int, int]]] = set()
        # of them, those bounded by their relaxation (built, not solved)
        self.relaxed: set[tuple[int, int, tuple[int, int]]] = set()
        # (signature class, shape, count) solves cut off: slower than the incumbent
        self.cut_off: set[tuple] = set()
        # per (signature class, shape): the relaxation's time per micro-batch, a lower bound
        self.relaxations: dict[tuple, float] = {}
        self._last: tuple[int, int, Graph, StageBoundary] | None = None
        self.num_stages = (len(pipe.submeshes) if pipe.submeshes else
                           None if pipe.stages == "auto" else int(pipe.stages))
        self.max_position: int | None = None  # deepest position a better plan can use
        self.lazy = True  # in-flight counts between solved ones as Gap variants

    def names(self, a: int, e: int) -> list[str]:
        return [n for u in self.units[a:e] for n in u]

    def _stage_graph(self, a: int, e: int) -> tuple[Graph, StageBoundary]:
        """Units [a, e) as a graph and its boundary. The last pair's are kept: the build
        cache holds one graph's problems, so a bound (:meth:`_relaxed_above`) and the
        solve after it share one build."""
        if self._last is None or self._last[:2] != (a, e):
            names = self.names(a, e)
            self._last = (a, e, subgraph(self.graph, names), stage_boundary(self.graph, names))
        return self._last[2], self._last[3]

    def solve(self, a: int, e: int, shape: tuple[int, int],
              how: int | AtGridPoint | None = None, useful_only: bool = False):
        """(GraphProblem, SolveResult, layers, cost) of units [a, e) on ``shape``, or None.
        ``how`` None: without a memory row (the fastest plan); a count: the fastest plan
        whose exact peak holding that many micro-batches fits the budget; an
        :class:`AtGridPoint`: that, at a grid point's recomputed blocks and reserve.
        ``useful_only`` (a count, with an incumbent): None too when the solve proves
        every plan using the variant slower than the incumbent (:meth:`_cutoff`) — as if
        it did not fit, which :meth:`_variants` may assume: the best time grows with the
        count, so every larger count is as useless."""

        key = (self.keys.key(a, e), shape, how)
        if useful_only and key in self.cut_off:
            return None
        if key not in self.cache:
            cutoff = self._cutoff(a, e, shape) if useful_only and isinstance(how, int) else None
            t0 = time.perf_counter()
            graph, boundary = self._stage_graph(a, e)
            budget = None
            held = how.inflight if isinstance(how, AtGridPoint) else how
            if held is not None:
                boundary = dataclasses.replace(boundary, inflight=held)
                budget = self.config.cluster.memory_bytes
            M = self.config.pipeline.microbatches
            try:
                request = MeshSolveRequest(self.config, shape[0], shape[1], budget, graph, M,
                                           boundary, self.build_cache)
                if isinstance(how, AtGridPoint):
                    gp, res = _fit_blocks(dataclasses.replace(
                        request, recompute=how.blocks(graph)), how.reserve)
                else:
                    gp, res = solve_mesh(request, cutoff)
            except InfeasibleError:
                self.cache[key] = None
            except CutOff:
                self.cut_off.add(key)
                return None
            else:
                layers, cost = realise(gp, list(res.choice))
                self.cache[key] = (gp, res, layers, cost)
                self.build_s += res.build_s
                self.not_optimal += res.status != "optimal"
            finally:
                self.solves += 1
                self.solve_s += time.perf_counter() - t0
        return self.cache[key]

    def _cutoff(self, a: int, e: int, shape: tuple[int, int]) -> float | None:
        """The objective per step from which every plan using [a, e) on ``shape`` is
        slower than the incumbent: the largest time per micro-batch ``t`` whose
        :meth:`lower_bound` ``t + rest + (B − 1) max(t, rest)`` stays within the
        incumbent, times ``B`` (a hair above, so a cut-off variant is one the DP's own
        test would drop)."""
        if self.incumbent_s is None:
            return None
        B = self.config.pipeline.microbatches
        rest = self._rest(a, e, shape)
        inc = self.incumbent_s * (1 + 2e-9)
        t = (inc - rest) / B if inc >= (B + 1) * rest else inc - B * rest
        return t * B * (1 + 1e-6)

    def _rest(self, a: int, e: int, shape: tuple[int, int]) -> float:
        """The other stages' least largest time: the rest of the work spread perfectly
        over the rest of the devices."""
        W, D, z = self.work_prefix, self.num_devices, shape[0] * shape[1]
        return (W[-1] - W[e] + W[a]) / (D - z) if z < D else 0.0

    def lower_bound(self, a: int, e: int, shape: tuple[int, int],
                    time_s: float | None = None) -> float:
        """Least pipeline latency ``Σ t + (B − 1) max t`` of any plan with units [a, e) on
        ``shape`` (taking at least ``time_s`` per micro-batch when given): every stage's
        time is at least its FLOPs (×3 for the backward) spread perfectly over its
        devices, and the other stages share the rest of the work on the rest of the
        devices (their largest time ≥ that average, their sum ≥ it too)."""
        W, z = self.work_prefix, shape[0] * shape[1]
        mine = max((W[e] - W[a]) / z, time_s or 0.0)
        rest = self._rest(a, e, shape)
        return mine + rest + (self.config.pipeline.microbatches - 1) * max(mine, rest)

    def stage_cost(self, a: int, e: int, shape: tuple[int, int]) -> list[StageCost]:
        """The variants of units [a, e) on ``shape`` (module docstring, *Stage memory*),
        each per micro-batch: compute + activation communication, plus the step's
        once-per-step communication divided by the micro-batches. With an incumbent plan
        (:meth:`set_incumbent`), a pair whose :meth:`lower_bound` exceeds it — from its
        FLOPs, then from its relaxation (:meth:`_relaxed_above`) — is not solved and left
        out of the DP's table (no variant): every plan using it costs more than the
        incumbent, itself a plan of the table, so the DP's optimum is unchanged — and the
        DP, without the small sub-meshes no stage can use, steps its device count by their
        common divisor (:func:`formulations.stage_dp.device_step`)."""
        self.calls += 1
        key = (self.keys.key(a, e), shape)
        if key not in self.costs and self.incumbent_s is not None and (
                self.lower_bound(a, e, shape) * (1 - 1e-9) > self.incumbent_s
                or self._relaxed_above(a, e, shape)):
            self.bounded.add((a, e, shape))
            return []
        if key not in self.costs:
            self.costs[key] = self._variants(a, e, shape)
        return [c for _, c in self.costs[key]]

    def _relaxed_above(self, a: int, e: int, shape: tuple[int, int]) -> bool:
        """Whether [a, e) on ``shape`` is proven slower than the incumbent by the
        relaxation of the problem its solve would build (:func:`fastest_bound`: the
        fastest plan's objective per step, so its time per micro-batch is at least that
        over the micro-batches). Communication makes most pairs on large sub-meshes far
        slower than their FLOPs alone (GPT-175B on 32 × 8: 1.7×, on 64 × 8: 3.8×); the
        build is kept for the solve when the bound does not decide."""

        key = (self.keys.key(a, e), shape)
        if (*key, None) in self.cache:
            return False  # solved already: :meth:`_variants` bounds it by its time
        M = self.config.pipeline.microbatches
        if key not in self.relaxations:  # one per signature class, as the solves
            t0 = time.perf_counter()
            graph, boundary = self._stage_graph(a, e)
            try:
                self.relaxations[key] = fastest_bound(MeshSolveRequest(
                    self.config, shape[0], shape[1], None, graph, M, boundary,
                    self.build_cache)) / M
            except InfeasibleError:  # what the solve would find: no build to repeat
                self.cache[(*key, None)] = None
                return False
            self.solve_s += time.perf_counter() - t0
        above = (self.lower_bound(a, e, shape, self.relaxations[key]) * (1 - 1e-9)
                 > self.incumbent_s)
        if above:
            self.relaxed.add((a, e, shape))
        return above

    def variant_how(self, a: int, e: int, shape: tuple[int, int], variant: int
                    ) -> int | AtGridPoint | Gap | None:
        """How variant ``variant`` of [a, e) on ``shape`` was solved (:meth:`solve`)."""
        return self.costs[(self.keys.key(a, e), shape)][variant][0]

    def add_variant(self, a: int, e: int, shape: tuple[int, int], how: AtGridPoint) -> None:
        """Solve [a, e) on ``shape`` as ``how`` says and offer it to the DP as a variant of
        every range of its signature class."""
        key = (self.keys.key(a, e), shape)
        if key not in self.costs:
            self.costs[key] = self._variants(a, e, shape)
        solved = self.solve(a, e, shape, how)
        if solved is not None and all(h != how for h, _ in self.costs[key]):
            self.costs[key].append((how, self._cost(solved)))

    def _variants(self, a: int, e: int, shape: tuple[int, int]
                  ) -> list[tuple[int | AtGridPoint | Gap | None, StageCost]]:
        solved = self.solve(a, e, shape)
        if solved is None:
            return []
        out = [(None, self._cost(solved))]
        if (self.incumbent_s is not None and self.lower_bound(a, e, shape, out[0][1].time_s)
                * (1 - 1e-9) > self.incumbent_s):
            return out  # slower variants: every plan using them costs more than the incumbent
        budget = self.config.cluster.memory_bytes
        fastest = out[0][1]
        levels = [h for h in self._inflight_levels(a, e, shape) if fastest.memory(h) > budget]
        sig = self.keys.key(a, e)
        found: dict[int, StageCost | None] = {}  # counts solved already (the incumbent's)
        for i, h in enumerate(levels):
            if (sig, shape, h) in self.cache:
                cached = self.cache[(sig, shape, h)]
                found[i] = None if cached is None else self._cost(cached)
            elif (sig, shape, h) in self.cut_off:  # useless: as if it did not fit (solve)
                found[i] = None

        def at(i: int) -> StageCost | None:
            if i not in found:
                solved = self.solve(a, e, shape, levels[i], useful_only=True)
                found[i] = None if solved is None else self._cost(solved)
            return found[i]

        if not levels or at(0) is None:
            return out
        # the best time T(h) holding h micro-batches grows with h (fewer plans fit) and a
        # plan fitting h fits every smaller count: where two solved counts take the same
        # time, the plan for the larger is the best for every count between (not solved)
        last = len(levels) - 1
        at(last)
        if not self.lazy:
            if found[last] is None:  # the most held that fits: infeasibility is monotone
                good, bad = 0, last
                while bad - good > 1:
                    mid = (good + bad) // 2
                    good, bad = (good, mid) if at(mid) is None else (mid, bad)
            spans = [(0, last)]
            while spans:
                i, j = spans.pop()
                lo, hi = at(i), at(j)
                if j - i > 1 and lo is not None and (hi is None or lo.time_s < hi.time_s
                                                     * (1 - 1e-9)):
                    mid = (i + j) // 2
                    at(mid)
                    spans += [(i, mid), (mid, j)]
        done = sorted(found.items())
        for (i, lo), (j, hi) in itertools.pairwise(done):
            if lo is None:
                break
            if j - i > 1 and (hi is None or lo.time_s < hi.time_s * (1 - 1e-9)):
                # the counts strictly between, not solved yet: the time of the count below,
                # fitting every count up to the one before ``j`` (:class:`Gap`)
                out.append((Gap(levels[i], levels[j]),
                            StageCost(lo.time_s, 0.0, budget / (levels[j - 1] + 0.5))))
        return out + [(levels[i], c) for i, c in done if c is not None]

    def refine(self, stage) -> bool:
        """Resolve a :class:`Gap` variant the DP chose for ``stage`` (a StageChoice): solve
        its range at the micro-batches its position holds and rebuild the pair's variants.
        False when a solved variant already serves that position at the gap's time (then
        :meth:`serving` names it)."""
        if self.serving(stage) is not None:
            return False
        a, e, shape = stage.start, stage.end, stage.submesh
        key = (self.keys.key(a, e), shape)
        if (*key, stage.inflight_microbatches) in self.cache.keys() | self.cut_off:
            raise AssertionError(f"gap variant chosen at a solved count: {stage}")
        self.solve(a, e, shape, stage.inflight_microbatches, useful_only=True)
        grid = [v for v in self.costs[key] if isinstance(v[0], AtGridPoint)]
        self.costs[key] = self._variants(a, e, shape) + grid
        return True

    def serving(self, stage) -> int | None:
        """A solved variant of ``stage``'s pair that fits its position and is as fast as
        the :class:`Gap` variant chosen (the gap's lower end, when the position holds no
        more than it), or None."""
        variants = self.costs[(self.keys.key(stage.start, stage.end), stage.submesh)]
        gap = variants[stage.variant][1]
        budget, n = self.config.cluster.memory_bytes, stage.inflight_microbatches
        for v, (how, c) in enumerate(variants):
            if not isinstance(how, Gap) and c.time_s <= gap.time_s \
                    and c.memory(n) <= budget:
                return v
        return None

    def _cost(self, solved) -> StageCost:
        gp, res, _, cost = solved
        act = held_activations(gp, res.choice)
        fixed = peak_memory(gp, res.choice) - gp.boundary.inflight * act
        return StageCost(cost.total_s / self.config.pipeline.microbatches, fixed, act)

    def _inflight_levels(self, start: int, end: int, shape: tuple[int, int]) -> list[int]:
        """The in-flight counts a stage of units [start, end) on ``shape`` can hold: its
        position ``s`` (counted from the last stage, 1) is 1 if it ends the model, else at
        least 2 and at most ``1 +`` the units and the devices left after it; with ``S``
        stages fixed, ``s = S`` if it starts the model, else ``S − start ≤ s < S``."""
        pipe = self.config.pipeline
        L = len(self.units)
        lo, hi = (1, 1) if end == L else (
            2, 1 + min(L - end, self.num_devices - shape[0] * shape[1]))
        if self.max_position is not None:
            hi = min(hi, self.max_position)
        if self.num_stages is not None:
            S = self.num_stages
            lo, hi = (max(lo, S), min(hi, S)) if start == 0 else (max(lo, S - start),
                                                                  min(hi, S - 1))
        return sorted({inflight_microbatches(pipe.schedule, s, pipe.microbatches)
                       for s in range(lo, hi + 1)})

    def set_incumbent(self, boundary, shapes: Sequence[tuple[int, int]],
                      num_stages: int | None, tolerance: float | None) -> None:
        """Price a few even pipelines (``S`` stages of ``L/S`` units on equal meshes of
        ``D/S`` devices: the largest such ``S`` whose meshes are whole nodes, then smaller
        ones — fewer micro-batches in flight — until two fit in memory) with real stage
        solves, which the DP reuses, and keep the best feasible one's latency as the bound
        for :meth:`stage_cost`. Exact: the incumbent is one of the DP's own plans
        (admissible pairs, memory checked by pipeline position)."""

        pipe, cluster = self.config.pipeline, self.config.cluster
        L, D, dpn = len(self.units), cluster.num_devices, cluster.devices_per_node
        sizes = {n * d: (n, d) for n, d in shapes}
        counts = [S for S in range(1, min(L, D) + 1) if D % S == 0 and D // S in sizes
                  and (num_stages is None or S == num_stages)]
        counts.sort(key=lambda S: (L % S != 0, D // S < dpn, -S))
        prefix = [float(i) for i in range(L + 1)]
        best, calls, tried, fits = None, self.calls, 0, 0
        for S in counts:
            if fits == 2 or (tried >= 2 and fits):
                break
            tried += 1
            shape = sizes[D // S]
            q, r = divmod(L, S)
            ends = list(itertools.accumulate(q + (j < r) for j in range(S)))
            times = []
            for j, e in enumerate(ends):
                a = ends[j - 1] if j else 0
                if not admissible(a, e, shape, L, D, tolerance, prefix):
                    break
                held = inflight_microbatches(pipe.schedule, S - j, pipe.microbatches)
                t = self._fastest_at(a, e, shape, held)
                if t is None:
                    break
                times.append(t + (boundary(e, shape) if e < L else 0.0))
            else:
                value = _latency(times, pipe.microbatches)
                if best is None or value < best:
                    best = value
                fits += 1
        self.incumbent_s, self.calls = best, calls
        if best is not None:  # the DP's optimum is at most the incumbent: exact bound
            self.max_position = self.most_stages(best)

    def _fastest_at(self, a: int, e: int, shape: tuple[int, int], held: int) -> float | None:
        """Time of the fastest plan of [a, e) on ``shape`` that fits holding ``held``
        micro-batches (one solve at that count at most; no variant table)."""
        budget = self.config.cluster.memory_bytes
        for how in (None, held):
            solved = self.solve(a, e, shape, how)
            if solved is None:
                return None
            c = self._cost(solved)
            if c.memory(held) <= budget:
                return c.time_s
        return None

    def most_stages(self, incumbent: float) -> int:
        """The most stages a plan faster than ``incumbent`` can have, so the deepest
        position a stage can take. With ``S`` stages of work ``W_j`` on ``z_j`` devices,
        ``Σ t ≥ Σ W_j / z_j ≥ (Σ √W_j)² / D`` (Cauchy–Schwarz, ``Σ z_j = D``) and ``max t ≥
        W / D``; the least ``Σ √W_j`` over contiguous splits into ``S`` ranges grows with
        ``S`` (merging two ranges never raises it), found by a DP over split points."""
        W = np.array(self.work_prefix)
        L, D, M = len(self.units), self.num_devices, self.config.pipeline.microbatches
        root = np.sqrt(np.maximum(W[None, :] - W[:, None], 0.0))
        root[np.tril_indices(L + 1)] = np.inf  # a range needs a unit
        f = root[0].copy()  # least Σ √W_j covering units [0, e) with s ranges
        floor = (M - 1) * W[-1] / D
        most = 1
        for S in range(2, min(L, D) + 1):
            f = (f[:, None] + root).min(axis=0)
            if f[L] ** 2 / D + floor > incumbent * (1 + 1e-9):
                break
            most = S
        return most


class _BoundaryCost:
    """Cross-mesh seconds of every tensor crossing a cut, estimated during the DP with
    batch-split layouts on both sides and the cheap schedulers."""

    def __init__(self, config: Config, graph: Graph, units: list[list[str]]):
        self.config = config
        self.graph = graph
        self.units = units
        self.cache: dict[tuple, float] = {}
        self.options = with_scheduler(ReshardOptions(compare_strategies=False),
                                      algorithms=("load_balance", "randomized_greedy"))
        # tensors crossing each cut (in the order of :func:`crossing`), from one pass
        unit_of = {n: j for j, u in enumerate(units) for n in u}
        cuts: list[dict[str, None]] = [{} for _ in range(len(units) + 1)]
        for src, dst in graph.edges():
            if src in unit_of and dst in unit_of:
                for cut in range(unit_of[src] + 1, unit_of[dst] + 1):
                    cuts[cut][src] = None
        self.crossing = [list(c) for c in cuts]
        self.seconds = 0.0

    def __call__(self, end: int, shape: tuple[int, int]) -> float:
        t0 = time.perf_counter()
        out = sum(self.tensor_time(self.graph[s].output, shape) for s in self.crossing[end])
        self.seconds += time.perf_counter() - t0
        return out

    def tensor_time(self, tensor: TensorSpec, shape: tuple[int, int]) -> float:
        key = (tensor, shape)
        if key not in self.cache:
            cluster = self.config.cluster
            n, d = shape
            dpn = cluster.devices_per_node
            src = SubMesh(0, n, 0, d, dpn)
            if n == 1 and 2 * d <= dpn:
                dst = SubMesh(0, 1, d, d, dpn)
            elif cluster.nodes >= 2 * n:
                dst = SubMesh(n, n, 0, d, dpn)
            else:
                dst = SubMesh(n, max(1, cluster.nodes - n), 0, d, dpn) if cluster.nodes > n else None
            if dst is None:
                self.cache[key] = 0.0
            else:
                spec = _estimate_spec(tensor, src, dst)
                self.cache[key] = plan_resharding(tensor, src, spec, dst, spec, cluster,
                                                  self.options).makespan_s
        return self.cache[key]


def _estimate_spec(tensor: TensorSpec, src: SubMesh, dst: SubMesh) -> str:
    rest = "R" * (tensor.rank - 1)
    for spec, deg in (("S^{01}", src.size), ("S^0", src.nodes)):
        if tensor.shape[0] % max(deg, 1) == 0 and tensor.shape[0] % max(dst.size, 1) == 0:
            return spec + rest
    return "R" + rest


def stage_costs(layers: Sequence[LayerPlan], stages: Sequence[dict], microbatches: int) -> list[dict]:
    """Per stage, what its layers price (boundary programs and tied exchanges included):
    per micro-batch ``forward_s`` (a third of the compute, backward ≈ 2 × forward FLOPs,
    plus the forward-phase activation collectives) and ``backward_s``; per step
    ``grad_sync_s`` (and its exposed part) and the stage's :class:`CostBreakdown` (memory
    from the stage's DP row when present, else its layers')."""
    out = []
    for s in stages:
        mine = [ly for ly in layers if ly.stage == int(s["index"])]
        compute = sum(ly.compute_s for ly in mine)
        colls = [c for ly in mine for c in ly.collectives]
        act = [c for c in colls if c.purpose not in ONCE_PER_STEP]
        memory = s.get("memory_bytes", sum(ly.memory_bytes for ly in mine))
        exposed = exposed_grad_sync(mine)
        out.append({
            "forward_s": compute / 3 + sum(c.seconds for c in act if c.phase == "forward"),
            "backward_s": 2 * compute / 3 + sum(c.seconds for c in act if c.phase != "forward"),
            "grad_sync_s": sum(c.seconds for c in colls if c.purpose in ONCE_PER_STEP),
            "grad_sync_exposed_s": exposed,
            "cost": CostBreakdown.of(compute, colls, memory, microbatches, exposed).to_dict(),
        })
    return out


def stage_durations(stages: Sequence[dict], resharding: Sequence[dict]) -> StageDurations:
    """Simulator durations of a pipelined plan: each stage's priced forward and backward
    per micro-batch (:func:`stage_costs`); each boundary's transfers are the solved
    resharding makespans of the tensors entering the next stage, forward (``tasks``) and
    backward (``backward_tasks``); a skip edge from an earlier stage is charged to the
    boundary just before its destination."""
    S = len(stages)
    forward, backward = [0.0] * (S - 1), [0.0] * (S - 1)
    for r in resharding:
        forward[r["dst_stage"] - 1] += r["makespan_s"]
        backward[r["dst_stage"] - 1] += r["backward_makespan_s"]
    return StageDurations.make(S, [s["forward_s"] for s in stages], [s["backward_s"] for s in stages],
                               activation_transfer=forward, gradient_transfer=backward)


@contextmanager
def _young_collections_only():
    """The stage table keeps millions of small objects in its caches (layouts, options,
    search rows); the cyclic collector's full passes walk all of them again and again and
    free nothing there (a fifth of a 1,024-device plan's time). While the planner runs only
    the young generations are collected; the previous thresholds come back after."""
    old = gc.get_threshold()
    gc.set_threshold(old[0], old[1] if len(old) > 1 else 10, 10**9)
    try:
        yield
    finally:
        gc.set_threshold(*old)


def solve_pipelined(config: Config, *, baselines: bool = True) -> Plan:
    """Stages by the DP, intra-op plans per stage, resharding per crossing tensor, and the
    simulated schedule."""
    with _young_collections_only():
        return _solve_pipelined(config, baselines)


def _solve_pipelined(config: Config, baselines: bool) -> Plan:
    t0 = time.perf_counter()
    pipe = config.pipeline
    cluster = config.cluster
    graph = config.microbatch_graph()
    units = layer_units(graph, pipe.max_units)
    solver = _StageSolver(config, graph, units)
    boundary = _BoundaryCost(config, graph, units)
    fixed = list(pipe.submeshes) if pipe.submeshes else None
    num_stages = None if pipe.stages == "auto" else int(pipe.stages)
    if num_stages is not None and num_stages > len(units):
        raise InfeasibleError(f"{num_stages} stages requested but the model has only "
                              f"{len(units)} layer units to distribute")
    shapes = submesh_shapes(cluster.nodes, cluster.devices_per_node, pipe.submesh_space)
    if fixed is None and pipe.stage_bound:
        solver.set_incumbent(boundary, shapes, num_stages, pipe.imbalance_tolerance)

    def run_dp():
        while True:
            solver.calls = 0  # the pairs of the last table
            dp = solve_stages(
                len(units), cluster.nodes, cluster.devices_per_node, pipe.microbatches,
                solver.stage_cost, boundary_cost=boundary, schedule=pipe.schedule,
                memory_budget_bytes=cluster.memory_bytes, num_stages=num_stages,
                submesh_shapes=shapes, fixed_submeshes=fixed,
                imbalance_tolerance=pipe.imbalance_tolerance,
            )
            if solver.max_position is not None:
                # variants were solved for positions up to max_position only: exact once
                # no plan with a deeper stage can beat this one, else widen and solve again
                # (the incumbent's bound holds it already, up to the float tolerance)
                deepest = solver.most_stages(dp.objective_s)
                if deepest > solver.max_position:
                    solver.max_position = deepest
                    solver.costs.clear()  # stage solves stay cached
                    continue
            gaps = [j for j, st in enumerate(dp.stages) if isinstance(
                solver.variant_how(st.start, st.end, st.submesh, st.variant), Gap)]
            if any([solver.refine(dp.stages[j]) for j in gaps]):
                continue
            if gaps:  # each chosen gap's time is that of a solved variant fitting there
                dp = dataclasses.replace(dp, stages=tuple(
                    _served(solver, st) if j in gaps else st for j, st in enumerate(dp.stages)))
            if solver.incumbent_s is None or dp.objective_s <= solver.incumbent_s * (1 + 1e-9):
                return dp
            # the incumbent is a plan of the table: cannot happen; stay exact regardless
            solver.incumbent_s = solver.max_position = None
            solver.bounded.clear()
            solver.relaxed.clear()
            solver.cut_off.clear()
            solver.costs.clear()  # variants were cut at the incumbent's deepest position

    dp = run_dp()
    grid = None
    if baselines and fixed is None and num_stages != 1:
        grid = pipelined_grid(config, graph, solver, boundary, shapes, num_stages,
                              len(dp.stages))
        if isinstance(grid, GridPipeline) and grid.latency_s < dp.objective_s:
            for st in grid.stages:  # its stage plans, re-solved in the whole space
                solver.add_variant(st.start, st.end, grid.shape, st.how)
            dp = run_dp()
    chosen = []
    for st in dp.stages:
        how = solver.variant_how(st.start, st.end, st.submesh, st.variant)
        _, res, stage_layers, _ = solver.solve(st.start, st.end, st.submesh, how)  # type: ignore[misc]
        chosen.append(_StagePlan(st, solver.names(st.start, st.end), stage_layers, res.to_dict(),
                                 how.inflight if isinstance(how, AtGridPoint) else how))
    reshardings: dict[tuple, ReshardingPlan] = {}
    pipeline = _assemble(config, graph, chosen, dp.objective_s, reshardings)
    grid_pipeline = None
    if isinstance(grid, GridPipeline):
        own = _grid_stage_plans(config, solver, grid)
        assert own is not None
        grid_pipeline = _assemble(config, graph, own, grid.latency_s, reshardings)
        if grid_pipeline.step_s < pipeline.step_s:
            # the DP's formula and the simulated schedule disagree here: the grid's stages,
            # re-solved in the whole space, or the grid's own points (members of the space)
            resolved = _grid_stage_plans(config, solver, grid, True)
            rivals = [grid_pipeline] if resolved is None else [
                _assemble(config, graph, resolved, grid.latency_s, reshardings), grid_pipeline]
            better = min(rivals, key=lambda p: p.step_s)
            if better.step_s < pipeline.step_s:
                pipeline = dataclasses.replace(better, note=(
                    f"the stage DP's pipeline simulates to {pipeline.step_s:.6g} s a step; "
                    f"kept the torchtitan grid's {len(grid.stages)} stages"
                    f"{'' if better is grid_pipeline else ' re-solved in the whole space'}, "
                    f"{better.step_s:.6g} s"))
    layers, stages, resharding = pipeline.layers, pipeline.stages, pipeline.resharding
    schedule, resharding_s = pipeline.schedule, pipeline.resharding_s
    status = "optimal"
    for s in stages:
        st = s["solver"].get("status", "optimal")
        if st != "optimal":
            status = "feasible" if st == "feasible" and status == "optimal" else st
    gaps = [s["solver"]["gap"] for s in stages if s["solver"].get("gap")]
    S = len(stages)
    total_s = time.perf_counter() - t0
    table_rest_s = max(0.0, dp.table_s - solver.solve_s - boundary.seconds)
    solver_report = {
        "status": status, "objective": schedule["dp_objective_s"], "bound": None,
        "gap": max(gaps) if gaps else (0.0 if status == "optimal" else None),
        "build_s": dp.table_s, "solve_s": total_s - dp.table_s, "method": "stage_dp+ilp",
        "message": f"{S} stages from {solver.solves} intra-op solves ({len(units)} layer "
                   f"units, {solver.calls} (range, sub-mesh) pairs); each stage's ILP "
                   f"{status}; the stage DP is exact over its cost table"
                   + (f"; {pipeline.note}" if pipeline.note else ""),
        "units": len(units),
        "stage_solves": solver.solves,
        "stage_pairs": solver.calls,
        "stage_bounded": len(solver.bounded),
        "stage_relaxed": len(solver.relaxed),
        "stage_cut_off": len(solver.cut_off),
        "incumbent_s": solver.incumbent_s,
        "stage_not_optimal": solver.not_optimal,
        "stage_time_limit_s": solver.time_limit_s,
        "timings": {
            "stage_solve_s": solver.solve_s, "stage_build_s": solver.build_s,
            "boundary_s": boundary.seconds, "dp_s": dp.solve_s + table_rest_s,
            "resharding_s": resharding_s, "total_s": total_s,
        },
    }
    per_stage = [CostBreakdown.from_dict(s["cost"]) for s in stages]
    busiest = max(per_stage, key=lambda c: c.total_s)
    cost = dataclasses.replace(busiest, peak_memory_bytes=max(c.peak_memory_bytes for c in per_stage))
    plan = Plan(config.name, config.raw, solver_report, cost, layers, stages=stages,
                schedule=schedule, resharding=resharding)
    if baselines:
        plan.baselines = _single_mesh_baselines(config)
        plan.baselines.update(price_pipelined_grid(grid, grid_pipeline))
    return plan


@dataclass(frozen=True)
class _StagePlan:
    """One stage of a pipeline to assemble: where it runs (``choice``), its layers' names in
    the full graph, its layer plans (under the names of the range they were solved for, in
    the same order), the solver's report, and the in-flight count its memory was solved for."""

    choice: StageChoice
    names: list[str]
    layers: list[LayerPlan]
    solver: dict
    solved_for: int | None


@dataclass(frozen=True)
class _Pipeline:
    """A pipeline as the plan stores it: its layers tagged with their stages, the stage
    rows, the cross-mesh resharding entries, and the simulated schedule."""

    layers: list[LayerPlan]
    stages: list[dict]
    resharding: list[dict]
    schedule: dict
    resharding_s: float
    note: str = ""

    @property
    def step_s(self) -> float:
        return float(self.schedule["step_s"])


def _assemble(config: Config, graph: Graph, plans: Sequence[_StagePlan],
              dp_objective_s: float, reshardings: dict | None = None) -> _Pipeline:
    """The pipeline of ``plans`` as it runs: resharding solved for every crossing tensor,
    the stage boundaries checked and priced, each stage's forward and backward per
    micro-batch, and the schedule simulated (``step_s``: makespan + the exposed gradient
    synchronisation tail). The planner's plan and the pipelined grid baseline both come
    from here, so their steps compare like for like; ``reshardings`` carries the solved
    resharding schedules from one assembly to the next (pipelines on the same meshes share
    their crossings)."""
    pipe = config.pipeline
    layers: list[LayerPlan] = []
    stages: list[dict] = []
    stage_of: dict[str, int] = {}
    out_layout: dict[str, Layout] = {}
    in_layouts: dict[tuple[str, str], Layout] = {}
    for i, sp in enumerate(plans):
        st = sp.choice
        rename = dict(zip((ly.name for ly in sp.layers), sp.names, strict=True))
        for ly in sp.layers:
            name = rename[ly.name]
            stage_of[name] = i
            out_layout[name] = ly.output
            for src, lay in zip(graph[name].inputs, ly.inputs, strict=True):
                in_layouts[(src, name)] = lay
            layers.append(_renamed(ly, name, i))
        stages.append({
            "index": i,
            "devices": st.placement.device_ids() if st.placement else [],
            "mesh": list(st.submesh),
            "placement": str(st.placement),
            "layers": sp.names,
            "layer_units": [st.start, st.end],
            "dp_time_s": st.time_s,
            "dp_boundary_time_s": st.boundary_time_s,
            "memory_bytes": st.memory_bytes,
            "inflight_microbatches": st.inflight_microbatches,
            "memory_solved_for_inflight": sp.solved_for,
            "solver": sp.solver,
        })
    t0 = time.perf_counter()
    resharding = _plan_resharding(config, graph, [sp.choice.placement for sp in plans],
                                  stage_of, out_layout, in_layouts,
                                  {} if reshardings is None else reshardings)
    resharding_s = time.perf_counter() - t0
    layers = price_stage_boundaries(graph, layers, stages, resharding, config.cluster)
    for s, priced in zip(stages, stage_costs(layers, stages, pipe.microbatches), strict=True):
        s.update(priced)
    sched = make_schedule(pipe.schedule, len(plans), pipe.microbatches)
    sim = simulate(sched, stage_durations(stages, resharding), overlap=pipe.overlap)
    schedule = {
        "name": pipe.schedule,
        "num_microbatches": pipe.microbatches,
        "actions": {str(i): [str(a) for a in row] for i, row in enumerate(sched.rows)},
        "makespan_s": sim.makespan_s,
        "bubble_fraction": sim.bubble_fraction,
        "peak_inflight": list(sim.peak_inflight),
        "overlap": pipe.overlap,
        "dp_objective_s": dp_objective_s,
        "step_s": sim.makespan_s + max(s["grad_sync_exposed_s"] for s in stages),
    }
    return _Pipeline(layers, stages, resharding, schedule, resharding_s)


def _grid_stage_plans(config: Config, solver: _StageSolver, grid: GridPipeline,
                      whole_space: bool = False) -> list[_StagePlan] | None:
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
            report, choice = res.to_dict(), list(res.choice)
        else:
            gp, choice = st.point.gp, st.point.choice
            layers = realise(gp, choice)[0]
            report = {"status": "optimal", "objective": st.point.objective,
                      "method": f"grid point {st.point.name}"}
        stage = StageChoice(st.start, st.end, grid.shape, st.time_s, st.time_s - st.boundary_s,
                            st.boundary_s, peak_memory(gp, choice), st.how.inflight, mesh)
        out.append(_StagePlan(stage, names, layers, report, st.how.inflight))
    return out


@dataclass(frozen=True)
class Gap:
    """A stand-in variant for the in-flight counts strictly between two solved ones,
    ``below`` and ``above`` (their plans differ in time, or none fits ``above``): the time
    of ``below``'s plan (a lower bound: fewer plans fit holding more), fitting every count
    below ``above`` and no more (its memory figures are made for that, not measured). The DP may choose it;
    :meth:`_StageSolver.refine` then solves the count the stage holds and the DP runs
    again, until no gap is chosen — exact, as a gap never costs more than what it stands
    for, with far fewer stage solves."""

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


@dataclass(frozen=True)
class GridStage:
    start: int
    end: int
    point: GridPoint
    time_s: float  # per micro-batch, boundary send included
    boundary_s: float  # of which the boundary send (the DP's estimate)
    how: AtGridPoint


@dataclass(frozen=True)
class GridPipeline:
    """torchtitan's pipeline dimension: ``S`` stages of ``L/S`` units on equal meshes of
    ``shape``, each stage at its best grid point; ``latency_s`` = ``Σ t + (B − 1) max t``
    with the DP's boundary estimates, the formula of the planner's ``dp_objective_s``."""

    shape: tuple[int, int]
    stages: tuple[GridStage, ...]
    latency_s: float


def pipelined_grid(config: Config, graph: Graph, solver: _StageSolver, boundary: _BoundaryCost,
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
    its mesh (:attr:`_StageSolver.work_prefix`), so a degree whose latency with those
    floors for the stages not yet priced reaches the best found is dropped — before its
    first stage or after any. The degree ``first`` (the stage DP's) is tried first."""

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
            if best is not None and _latency([st.time_s for st in stages] + floors[j:], M) * (
                    1 - 1e-9) >= best.latency_s:
                break  # this degree cannot beat the best found
            a = ends[j - 1] if j else 0
            held = inflight_microbatches(pipe.schedule, S - j, M)
            names = solver.names(a, e)
            sub = subgraph(graph, names)
            bound = dataclasses.replace(stage_boundary(graph, names), inflight=held)

            def build(levels, blocks, sub=sub, bound=bound, n=n, d=d):
                return build_problem(sub, cluster, n, d, config.memory,
                                     tie_layers=opts.tie_layers,
                                     max_weight_replication=opts.max_weight_replication,
                                     memory_budget=cluster.memory_bytes, microbatches=M,
                                     boundary=bound, grad_bucket_bytes=config.grad_bucket_bytes,
                                     cache=solver.build_cache, zero_levels=levels,
                                     recompute=blocks)

            point = torchtitan_choice(sub, build, n, d, cluster.memory_bytes, solver.time_limit_s)
            if isinstance(point, str):
                reasons.append(f"pp={S}, stage {j}: {point}")
                break
            units = sub.blocks()
            how = AtGridPoint(held, tuple(i for i, u in enumerate(units)
                                          if u in point.gp.recompute_units), point.reserve)
            t = realise(point.gp, point.choice)[1].total_s / M
            send = boundary(e, (n, d)) if e < L else 0.0
            stages.append(GridStage(a, e, point, t + send, send, how))
        if len(stages) == S:
            latency = _latency([st.time_s for st in stages], M)
            if best is None or latency < best.latency_s:
                best = GridPipeline((n, d), tuple(stages), latency)
    if best is None:
        return reasons[0] if reasons else "no pipeline degree splits the cluster into " \
            "allowed equal meshes"
    return best


def _latency(times: Sequence[float], microbatches: int) -> float:
    """The stage DP's pipeline latency: ``Σ t + (B − 1) max t``."""
    return sum(times) + (microbatches - 1) * max(times)


def price_pipelined_grid(grid: GridPipeline | str | None,
                         pipeline: _Pipeline | None = None) -> dict[str, dict]:
    """The pipelined grid's baseline block: its busiest stage's cost breakdown (per step),
    with ``pipeline_s`` the step that ratios compare — ``pipeline``'s, the grid assembled
    and simulated as the planner's own pipeline is (:func:`_assemble`) — and
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


def _served(solver: _StageSolver, stage):
    """``stage`` (a StageChoice on a :class:`Gap`) on the solved variant serving it."""
    v = solver.serving(stage)
    assert v is not None
    c = solver.costs[(solver.keys.key(stage.start, stage.end), stage.submesh)][v][1]
    return dataclasses.replace(stage, variant=v, memory_bytes=c.memory(stage.inflight_microbatches))




def cross_stage_tied_collectives(layout: Layout, table: TensorSpec, ranks: Sequence[int],
                                 cluster: Cluster) -> list[Collective]:
    """One side of a tied table's gradient exchange across two stages, as the runtime runs
    it: the copy's gradient gathered to replicated within its stage (lowered program), then
    one AllReduce of the full table over both stages' ranks, in the master dtype."""
    table = table.master
    gather = plan_redistribution(layout, Layout.replicated(layout.fact), table, cluster)
    spans = len({r // cluster.devices_per_node for r in ranks}) > 1
    return [c.with_phase("step", "tied_weight") for c in gather.forward] + [
        make_collective(CollectiveKind.ALL_REDUCE, len(ranks), table.nbytes, cluster, spans,
                        phase="step", purpose="tied_weight")]


def price_stage_boundaries(graph: Graph, layers: list[LayerPlan], stages: Sequence[dict],
                           resharding: Sequence[dict], cluster: Cluster) -> list[LayerPlan]:
    """Check that every edge crossing stages has a resharding entry delivering exactly the
    layout its consumer reads (the stage's own export and import programs are already on
    its layers, :mod:`ilp_planner.lowering.stage_boundary`), and add the one boundary cost no stage
    ILP can see: the gradient exchange of a table tied across two stages."""
    by_name = {ly.name: ly for ly in layers}
    stage_of = {ly.name: ly.stage for ly in layers}
    rows = [(e["tensor"], e["consumer"], int(e["dst_stage"]), layout_from_dict(e["dst_layout"]))
            for e in resharding]
    extra: dict[str, list[Collective]] = {ly.name: [] for ly in layers}
    for op in graph.ops:
        if op.name not in by_name:
            continue
        ly = by_name[op.name]
        for idx, src in enumerate(op.inputs):
            if graph[src].kind is OpKind.INPUT or stage_of[src] == ly.stage:
                continue
            if find_entry(rows, src, op.name, ly.stage, ly.inputs[idx]) is None:
                raise InfeasibleError(f"edge {src} -> {op.name} crosses stages without a "
                                      f"resharding entry delivering {ly.inputs[idx]}")
        emb = tied_source(graph, op) if op.attrs.get("tied") else None
        if emb is not None and stage_of[emb.name] != ly.stage:
            assert emb.weight is not None
            ranks = [d for n in (emb.name, op.name) for d in stages[stage_of[n]]["devices"]]
            for name, table in ((emb.name, emb.weight),
                                (op.name, TensorSpec(emb.weight.shape[::-1], emb.weight.dtype))):
                weight = by_name[name].weight
                assert weight is not None
                extra[name] += cross_stage_tied_collectives(weight, table, ranks, cluster)
    return [dataclasses.replace(ly, collectives=ly.collectives + tuple(extra[ly.name]))
            for ly in layers]


def _single_mesh_baselines(config: Config) -> dict[str, dict]:
    """Without pipelining (gradient accumulation over the same micro-batches on the whole
    cluster): the planner's own single-mesh optimum and the usual baselines."""

    cluster = config.cluster
    try:
        gp, res, grid = solve_single_mesh(config)
    except InfeasibleError as exc:
        return {"ilp_single_mesh": {"error": str(exc)},
                **price_grid(grid_baseline(MeshSolveRequest.whole_cluster(config)))}
    out = {"ilp_single_mesh": realise(gp, list(res.choice))[1].to_dict()}
    out.update(price_baselines(gp, config.solver.time_limit_s, cluster.memory_bytes))
    out.update(price_grid(grid))
    return out


def _renamed(layer: LayerPlan, name: str, stage: int) -> LayerPlan:
    """A stage's LayerPlan under its name in the full graph, tagged with its stage."""
    return dataclasses.replace(layer, name=name, stage=stage)


def _task_rows(rp: ReshardingPlan) -> list[dict]:
    """A solved resharding's unit tasks in their scheduled order, as the plan stores them."""
    return [
        {"slice": [list(r) for r in rp.tasks[t].region],
         "sender": rp.transfers[t].sender_device,
         "holders": list(rp.tasks[t].holders),
         "receivers": list(rp.tasks[t].receivers),
         "start_s": rp.transfers[t].start_s,
         "bytes": rp.tasks[t].nbytes}
        for t in rp.order
    ]


def _resharding(tensor: TensorSpec, src: SubMesh, src_layout: Layout, dst: SubMesh,
                dst_layout: Layout, cluster: Cluster, options: ReshardOptions,
                solved: dict[tuple, ReshardingPlan]) -> ReshardingPlan:
    """:func:`plan_resharding`, solved once per crossing shape: meshes that differ from a
    solved pair's by the same whole number of nodes get its plan shifted there
    (:meth:`ReshardingPlan.shifted`) — an even pipeline's crossings are one problem."""
    base = min(src.node0, dst.node0)
    key = (tensor, dataclasses.replace(src, node0=src.node0 - base), src_layout,
           dataclasses.replace(dst, node0=dst.node0 - base), dst_layout)
    if key not in solved:
        solved[key] = plan_resharding(tensor, src, src_layout, dst, dst_layout, cluster,
                                      options)
    return solved[key].shifted(src.node0 - solved[key].src.node0)


def _plan_resharding(config: Config, graph: Graph, meshes: Sequence[SubMesh | None],
                     stage_of: dict[str, int],
                     out_layout: dict[str, Layout], in_layouts: dict[tuple[str, str], Layout],
                     solved: dict[tuple, ReshardingPlan]) -> list[dict]:
    """Every tensor crossing stages, once per (tensor, destination stage, layout), with its
    CP-SAT resharding schedules: ``tasks`` forward, ``backward_tasks`` for its gradient
    going back (from the devices that received it to those that sent it). A partial-sum
    output is reduced inside its stage first. ``solved``: schedules by (tensor, meshes,
    layouts), reused and filled."""
    out: list[dict] = []
    seen: set[tuple] = set()
    options = ReshardOptions(compare_strategies=False)
    for src, dst in graph.edges():
        if graph[src].kind is OpKind.INPUT or stage_of[src] == stage_of[dst]:
            continue
        a, b = stage_of[src], stage_of[dst]
        tensor = graph[src].output
        src_layout = resolve_partial(out_layout[src], tensor)
        dst_layout = in_layouts[(src, dst)]
        key = (src, b, dst_layout)
        if key in seen:
            continue
        seen.add(key)
        fwd, bwd = (_resharding(tensor, *ends, config.cluster, options, solved)
                    for ends in ((meshes[a], src_layout, meshes[b], dst_layout),
                                 (meshes[b], dst_layout, meshes[a], src_layout)))
        out.append({
            "src_stage": a, "dst_stage": b, "tensor": src, "consumer": dst,
            "shape": list(tensor.shape), "dtype": tensor.dtype,
            "src_layout": layout_to_dict(src_layout, tensor.shape),
            "dst_layout": layout_to_dict(dst_layout, tensor.shape),
            "src_spec": fwd.src_spec, "dst_spec": fwd.dst_spec,
            "algorithm": fwd.algorithm, "status": fwd.status,
            "makespan_s": fwd.makespan_s, "lower_bound_s": fwd.lower_bound_s,
            "algorithms": {r.name: r.makespan_s for r in fwd.runs},
            "tasks": _task_rows(fwd),
            "backward_makespan_s": bwd.makespan_s,
            "backward_lower_bound_s": bwd.lower_bound_s,
            "backward_tasks": _task_rows(bwd),
        })
    return out
