"""The stage solver: the stage DP's table of (range, sub-mesh) variants from intra-op solves.

Stage cost ``t_i`` is the time of one micro-batch (forward + backward compute and
activation communication) of the stage's ops on its sub-mesh, from the ILP. Ranges of one
signature class (:class:`~ilp_planner.inter_op.layer_units.RangeKeys`) share one solve
per sub-mesh shape.

Stage memory. A stage at position ``s`` from the end holds the activations of
``inflight(s)`` micro-batches (1F1B: ``min(s, B)``). Each (range, mesh) pair is solved
first without a memory row — the fastest plan, whose peak ``fixed + inflight · act`` is
exact at every position — and then, for the in-flight counts the pair can meet (its
possible positions) at which that plan does not fit, with the memory row of a count
(:attr:`StageBoundary.inflight`): the fastest plan that fits there, with state sharding
and recomputation where the config offers them. Counts are bisected: the best time grows
with the count, so where two solved counts give the same time the larger one's plan is
the best for every count between (exact for an exact stage solver; the ``recompute:
auto`` counts of blocks and the transient caps are each exact over all of them, or the
solve says it is ``feasible``).
The DP picks per stage the fastest variant that fits its position (:data:`formulations.stage_dp.StageCostFn`).
Stage ILPs price one step of ``B`` accumulated micro-batches (per-micro-batch work ``B``
times, gradient synchronisation and ZeRO's weight gathers once), the DP's stage time is
that divided by ``B``.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from formulations.schedules import inflight_microbatches
from formulations.stage_dp import StageCost
from ilp_planner.errors import InfeasibleError
from ilp_planner.inputs.config import Config
from ilp_planner.inter_op.layer_units import RangeKeys, subgraph
from ilp_planner.inter_op.stage_variants import AtGridPoint, Gap, How
from ilp_planner.intra_op.problem import BuildCache, held_activations, peak_memory
from ilp_planner.intra_op.realise import EdgeMemo, LazyRealisation
from ilp_planner.intra_op.request import MeshSolveRequest
from ilp_planner.intra_op.solve_mesh import (
    CutOff,
    fastest_bound,
    memory_floor,
    solve_mesh,
    solve_under_reserve,
)
from ilp_planner.ir.graph import Graph
from ilp_planner.lowering.compute_model import least_seconds
from ilp_planner.lowering.stage_boundary import StageBoundary, stage_boundary

#: Default per-stage intra-op time limit (s) when ``pipeline.stage_time_limit_s`` is unset:
#: ``min(solver.time_limit_s, STAGE_TIME_LIMIT_S)`` — the DP runs hundreds of stage solves.
STAGE_TIME_LIMIT_S = 10.0

Pair = tuple[int, int, tuple[int, int]]
"""A unit range ``[a, e)`` on a sub-mesh shape."""


@dataclass
class StageSolverState:
    """What a :class:`StageSolver` keeps between calls: its caches, keyed by signature
    class (``RangeKeys.key``) and shape, and the exact pruning an incumbent plan allows."""

    #: (signature class, shape, how) → the solve (unpacking as (GraphProblem, SolveResult,
    #: layers, cost), realised on first use), or None where nothing fits
    solved: dict[tuple, LazyRealisation | None] = field(default_factory=dict)
    #: the edges' programs across the realisations of the solves
    edge_memo: EdgeMemo = field(default_factory=dict)
    #: (signature class, shape) → the DP's variants of the pair, each with how it was solved
    variants: dict[tuple, list[tuple[How, StageCost]]] = field(default_factory=dict)
    #: (signature class, shape) → the relaxation's time per micro-batch, a lower bound
    relaxations: dict[tuple, float] = field(default_factory=dict)
    #: per-op options and edge matrices across the solves
    build_cache: BuildCache = field(default_factory=BuildCache)
    #: the last range's (a, e, graph, boundary): a bound and the solve after it share a build
    last_range: tuple[int, int, Graph, StageBoundary] | None = None
    #: the latency of a plan of the table (:func:`~ilp_planner.inter_op.stage_incumbent.set_incumbent`)
    incumbent_s: float | None = None
    #: the deepest position a plan faster than the incumbent can use
    max_position: int | None = None
    #: pairs left out of the table: proven slower than the incumbent
    bounded: set[Pair] = field(default_factory=set)
    #: of them, those bounded by their relaxation (built, not solved)
    relaxed: set[Pair] = field(default_factory=set)
    #: (signature class, shape, count) solves cut off: slower than the incumbent
    cut_off: set[tuple] = field(default_factory=set)
    #: (signature class, shape) → {count: a lower bound on the peak of every plan holding
    #: that many micro-batches} where the count's solve found none (:func:`memory_floor`)
    floors: dict[tuple, dict[int, float]] = field(default_factory=dict)

    def found_none(self, key: tuple, request: MeshSolveRequest) -> None:
        """The solve ``key`` (signature class, shape, how) found no plan; at an in-flight
        count, its floor is kept (:func:`memory_floor`: the solve's builds are in the
        cache, so it is cheap)."""
        self.solved[key] = None
        if isinstance(key[2], int):
            self.floors.setdefault(key[:2], {})[key[2]] = memory_floor(request)

    def least_memory(self, key: tuple, held: int, budget: float) -> float:
        """A lower bound on the memory any plan of the pair ``key`` (signature class,
        shape) needs holding ``held`` micro-batches, for the stage DP's infeasibility
        message (:data:`formulations.stage_dp.LeastMemoryFn`): 0 where a variant fits
        there, else the largest floor of the counts at most ``held`` whose solves found no
        plan (more held needs at least as much), else 0 (nothing proven)."""
        if any(c.memory(held) <= budget for _, c in self.variants.get(key, [])):
            return 0.0
        return max((f for h, f in self.floors.get(key, {}).items() if h <= held), default=0.0)

    def widen_positions(self, deepest: int) -> None:
        """Allow positions up to ``deepest``: the variants were made for fewer (the solves
        stay)."""
        self.max_position = deepest
        self.variants.clear()

    def forget_incumbent(self) -> None:
        """Drop the incumbent and all it pruned (the solves stay)."""
        self.incumbent_s = self.max_position = None
        self.bounded.clear()
        self.relaxed.clear()
        self.cut_off.clear()
        self.variants.clear()


@dataclass
class StageSolveStats:
    """What a :class:`StageSolver` did, for the plan's solver report."""

    solves: int = 0
    solve_s: float = 0.0
    build_s: float = 0.0
    not_optimal: int = 0
    calls: int = 0  # (range, shape) pairs the DP asked for


def pipeline_latency(times: Sequence[float], microbatches: int) -> float:
    """The stage DP's pipeline latency: ``Σ t + (B − 1) max t``."""
    return sum(times) + (microbatches - 1) * max(times)


class StageSolver:
    """Intra-op solves of layer ranges on sub-mesh shapes, one per (signature class, shape)
    (:class:`~ilp_planner.inter_op.layer_units.RangeKeys`), and the DP's table of stage
    variants made of them (module docstring). What it keeps between calls is its
    :attr:`state`; what it did, for the plan's solver report, its :attr:`stats`."""

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
        # a lower bound on every stage's time from its FLOPs, for the exact pruning
        # (:func:`~ilp_planner.inter_op.stage_incumbent.set_incumbent`)
        cluster = config.cluster
        work = [sum(least_seconds(graph[n], cluster) for n in u) for u in units]
        self.work_prefix = [0.0, *itertools.accumulate(work)]
        self.num_devices = cluster.num_devices
        self.num_stages = (len(pipe.submeshes) if pipe.submeshes else
                           None if pipe.stages == "auto" else int(pipe.stages))
        self.lazy = True  # in-flight counts between solved ones as Gap variants
        self.state = StageSolverState()
        self.stats = StageSolveStats()

    def names(self, a: int, e: int) -> list[str]:
        return [n for u in self.units[a:e] for n in u]

    def _stage_graph(self, a: int, e: int) -> tuple[Graph, StageBoundary]:
        """Units [a, e) as a graph and its boundary. The last pair's are kept: the build
        cache holds one graph's problems, so a bound (:meth:`_relaxed_above`) and the
        solve after it share one build."""
        if self.state.last_range is None or self.state.last_range[:2] != (a, e):
            names = self.names(a, e)
            self.state.last_range = (a, e, subgraph(self.graph, names), stage_boundary(self.graph, names))
        return self.state.last_range[2], self.state.last_range[3]

    def solve(self, a: int, e: int, shape: tuple[int, int],
              how: int | AtGridPoint | None = None, useful_only: bool = False):
        """The solve of units [a, e) on ``shape`` (a :class:`LazyRealisation`: unpacks as
        (GraphProblem, SolveResult, layers, cost), realised on first use), or None.
        ``how`` None: without a memory row (the fastest plan); a count: the fastest plan
        whose exact peak holding that many micro-batches fits the budget; an
        :class:`AtGridPoint`: that, at a grid point's recomputed blocks and reserve.
        ``useful_only`` (a count, with an incumbent): None too when the solve proves
        every plan using the variant slower than the incumbent (:meth:`_cutoff`) — as if
        it did not fit, which :meth:`_variants` may assume: the best time grows with the
        count, so every larger count is as useless."""

        key = (self.keys.key(a, e), shape, how)
        if useful_only and key in self.state.cut_off:
            return None
        if key not in self.state.solved:
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
                                           boundary, self.state.build_cache)
                if isinstance(how, AtGridPoint):
                    gp, res = solve_under_reserve(dataclasses.replace(
                        request, recompute=how.blocks(graph)), how.reserve)
                else:
                    gp, res = solve_mesh(request, cutoff)
            except InfeasibleError:
                self.state.found_none(key, request)
            except CutOff:
                self.state.cut_off.add(key)
                return None
            else:  # realised on first use: the DP's table reads only its total
                self.state.solved[key] = LazyRealisation(gp, res, self.state.edge_memo)
                self.stats.build_s += res.build_s
                self.stats.not_optimal += res.status != "optimal"
            finally:
                self.stats.solves += 1
                self.stats.solve_s += time.perf_counter() - t0
        return self.state.solved[key]

    def _cutoff(self, a: int, e: int, shape: tuple[int, int]) -> float | None:
        """The objective per step from which every plan using [a, e) on ``shape`` is
        slower than the incumbent: the largest time per micro-batch ``t`` whose
        :meth:`lower_bound` ``t + rest + (B − 1) max(t, rest)`` stays within the
        incumbent, times ``B`` (a hair above, so a cut-off variant is one the DP's own
        test would drop)."""
        if self.state.incumbent_s is None:
            return None
        B = self.config.pipeline.microbatches
        rest = self._rest(a, e, shape)
        inc = self.state.incumbent_s * (1 + 2e-9)
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
        (:func:`~ilp_planner.inter_op.stage_incumbent.set_incumbent`), a pair whose
        :meth:`lower_bound` exceeds it — from its FLOPs, then from its relaxation
        (:meth:`_relaxed_above`) — is not solved and left
        out of the DP's table (no variant): every plan using it costs more than the
        incumbent, itself a plan of the table, so the DP's optimum is unchanged — and the
        DP, without the small sub-meshes no stage can use, steps its device count by their
        common divisor (:func:`formulations.stage_dp.device_step`)."""
        self.stats.calls += 1
        key = (self.keys.key(a, e), shape)
        if key not in self.state.variants and self.state.incumbent_s is not None and (
                self.lower_bound(a, e, shape) * (1 - 1e-9) > self.state.incumbent_s
                or self._relaxed_above(a, e, shape)):
            self.state.bounded.add((a, e, shape))
            return []
        if key not in self.state.variants:
            self.state.variants[key] = self._variants(a, e, shape)
        return [c for _, c in self.state.variants[key]]

    def _relaxed_above(self, a: int, e: int, shape: tuple[int, int]) -> bool:
        """Whether [a, e) on ``shape`` is proven slower than the incumbent by the
        relaxation of the problem its solve would build (:func:`fastest_bound`: the
        fastest plan's objective per step, so its time per micro-batch is at least that
        over the micro-batches). Communication makes most pairs on large sub-meshes far
        slower than their FLOPs alone (GPT-175B on 32 × 8: 1.7×, on 64 × 8: 3.8×); the
        build is kept for the solve when the bound does not decide."""

        key = (self.keys.key(a, e), shape)
        if (*key, None) in self.state.solved:
            return False  # solved already: :meth:`_variants` bounds it by its time
        M = self.config.pipeline.microbatches
        if key not in self.state.relaxations:  # one per signature class, as the solves
            t0 = time.perf_counter()
            graph, boundary = self._stage_graph(a, e)
            try:
                self.state.relaxations[key] = fastest_bound(MeshSolveRequest(
                    self.config, shape[0], shape[1], None, graph, M, boundary,
                    self.state.build_cache)) / M
            except InfeasibleError:  # what the solve would find: no build to repeat
                self.state.solved[(*key, None)] = None
                return False
            self.stats.solve_s += time.perf_counter() - t0
        above = (self.lower_bound(a, e, shape, self.state.relaxations[key]) * (1 - 1e-9)
                 > self.state.incumbent_s)
        if above:
            self.state.relaxed.add((a, e, shape))
        return above

    def variant_how(self, a: int, e: int, shape: tuple[int, int], variant: int
                    ) -> How:
        """How variant ``variant`` of [a, e) on ``shape`` was solved (:meth:`solve`)."""
        return self.state.variants[(self.keys.key(a, e), shape)][variant][0]

    def add_variant(self, a: int, e: int, shape: tuple[int, int], how: AtGridPoint) -> None:
        """Solve [a, e) on ``shape`` as ``how`` says and offer it to the DP as a variant of
        every range of its signature class."""
        key = (self.keys.key(a, e), shape)
        if key not in self.state.variants:
            self.state.variants[key] = self._variants(a, e, shape)
        solved = self.solve(a, e, shape, how)
        if solved is not None and all(h != how for h, _ in self.state.variants[key]):
            self.state.variants[key].append((how, self.variant_cost(solved)))

    def _variants(self, a: int, e: int, shape: tuple[int, int]
                  ) -> list[tuple[How, StageCost]]:
        solved = self.solve(a, e, shape)
        if solved is None:
            return []
        out = [(None, self.variant_cost(solved))]
        if (self.state.incumbent_s is not None and self.lower_bound(a, e, shape, out[0][1].time_s)
                * (1 - 1e-9) > self.state.incumbent_s):
            return out  # slower variants: every plan using them costs more than the incumbent
        budget = self.config.cluster.memory_bytes
        fastest = out[0][1]
        levels = [h for h in self._inflight_levels(a, e, shape) if fastest.memory(h) > budget]
        sig = self.keys.key(a, e)
        found: dict[int, StageCost | None] = {}  # counts solved already (the incumbent's)
        for i, h in enumerate(levels):
            if (sig, shape, h) in self.state.solved:
                cached = self.state.solved[(sig, shape, h)]
                found[i] = None if cached is None else self.variant_cost(cached)
            elif (sig, shape, h) in self.state.cut_off:  # useless: as if it did not fit (solve)
                found[i] = None

        def at(i: int) -> StageCost | None:
            if i not in found:
                solved = self.solve(a, e, shape, levels[i], useful_only=True)
                found[i] = None if solved is None else self.variant_cost(solved)
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
        if (*key, stage.inflight_microbatches) in self.state.solved.keys() | self.state.cut_off:
            raise AssertionError(f"gap variant chosen at a solved count: {stage}")
        self.solve(a, e, shape, stage.inflight_microbatches, useful_only=True)
        grid = [v for v in self.state.variants[key] if isinstance(v[0], AtGridPoint)]
        self.state.variants[key] = self._variants(a, e, shape) + grid
        return True

    def serving(self, stage) -> int | None:
        """A solved variant of ``stage``'s pair that fits its position and is as fast as
        the :class:`Gap` variant chosen (the gap's lower end, when the position holds no
        more than it), or None."""
        variants = self.state.variants[(self.keys.key(stage.start, stage.end), stage.submesh)]
        gap = variants[stage.variant][1]
        budget, n = self.config.cluster.memory_bytes, stage.inflight_microbatches
        for v, (how, c) in enumerate(variants):
            if not isinstance(how, Gap) and c.time_s <= gap.time_s \
                    and c.memory(n) <= budget:
                return v
        return None

    def variant_cost(self, solved) -> StageCost:
        """The DP's variant of a solve: time per micro-batch, fixed and per-micro-batch memory."""
        gp, choice = solved.gp, solved.res.choice
        act = held_activations(gp, choice)
        fixed = peak_memory(gp, choice) - gp.boundary.inflight * act
        return StageCost(solved.total_s / self.config.pipeline.microbatches, fixed, act)

    def _inflight_levels(self, start: int, end: int, shape: tuple[int, int]) -> list[int]:
        """The in-flight counts a stage of units [start, end) on ``shape`` can hold: its
        position ``s`` (counted from the last stage, 1) is 1 if it ends the model, else at
        least 2 and at most ``1 +`` the units and the devices left after it; with ``S``
        stages fixed, ``s = S`` if it starts the model, else ``S − start ≤ s < S``."""
        pipe = self.config.pipeline
        L = len(self.units)
        lo, hi = (1, 1) if end == L else (
            2, 1 + min(L - end, self.num_devices - shape[0] * shape[1]))
        if self.state.max_position is not None:
            hi = min(hi, self.state.max_position)
        if self.num_stages is not None:
            S = self.num_stages
            lo, hi = (max(lo, S), min(hi, S)) if start == 0 else (max(lo, S - start),
                                                                  min(hi, S - 1))
        return sorted({inflight_microbatches(pipe.schedule, s, pipe.microbatches)
                       for s in range(lo, hi + 1)})
