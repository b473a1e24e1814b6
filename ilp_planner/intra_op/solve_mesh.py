"""The solve pipeline for one mesh: build the problem, check memory, run a fast search as
warm start and fallback, solve the ILP, and keep the cheapest plan over every count of
recomputed blocks (:class:`_CountsCover`) and every transient cap (:class:`_CapsCover`).
What is solved travels as one :class:`~ilp_planner.intra_op.request.MeshSolveRequest`."""

from __future__ import annotations

import dataclasses
import functools
import heapq
import time
from collections.abc import Callable, Mapping

import numpy as np

from formulations.elimination import (
    EliminationResult,
    NoFit,
    relaxation_bound,
    solve_elimination,
)
from formulations.problem import dominated_free
from formulations.result import SolveResult
from formulations.sbp_ilp import SbpIlp
from formulations.sbp_search import SEARCHES
from ilp_planner.errors import ConfigError, InfeasibleError, UnprovenInfeasible
from ilp_planner.inputs.config import Config
from ilp_planner.intra_op.baseline_prices import grid_baseline
from ilp_planner.intra_op.baselines import GridPoint
from ilp_planner.intra_op.problem import (
    BuildCache,
    GraphProblem,
    build_problem,
    describe_infeasible,
    peak_memory,
    problem_key,
)
from ilp_planner.intra_op.request import MeshSolveRequest, PhaseTimes

EVERY_COUNT_UP_TO = 3
"""``recompute: auto`` solves every count of recomputed blocks for models this small."""

CAP_SAMPLES = 5
"""Transient caps sampled per solve under state sharding (:func:`_cap_candidates`)."""


class CutOff(Exception):
    """A solve skipped because its proven lower bound reaches a plan already found."""


Solved = tuple[GraphProblem, SolveResult]


def solve_single_mesh(config: Config, grid: bool = True, times: PhaseTimes | None = None
                      ) -> tuple[GraphProblem, SolveResult, GridPoint | str | None]:
    """The whole cluster as one mesh (:func:`solve_mesh`), and with ``grid`` the
    torchtitan-style baseline beside it: its point is in the planner's space, so where it
    beats the planner's enumeration the whole space is solved again at its recomputed
    blocks and transient reserve, which can only do better. ``times`` collects the wall
    time of the solves and of the baseline."""
    times = times or PhaseTimes()
    # one build cache for the plan and the baselines: each member's options are the plan's
    # (:class:`~ilp_planner.intra_op.baseline_prices.MemberBuilder` builds in it)
    request = dataclasses.replace(MeshSolveRequest.whole_cluster(config), cache=BuildCache())
    with times.timing("solve_s"):
        gp, result = solve_mesh(request)
    with times.timing("baselines_s"):
        point = grid_baseline(request) if grid else None
    if isinstance(point, GridPoint) and point.objective < result.objective and \
            point.gp.microbatches == request.microbatches:  # else not in the plan's space
        with times.timing("solve_s"):
            gp, result = _at_grid_point(request, (gp, result), point)
    return gp, result, point


def _at_grid_point(request: MeshSolveRequest, solved: Solved, grid: GridPoint) -> Solved:
    """``solved``, or the whole space at the grid point's recomputed blocks and transient
    reserve where that is cheaper — the blocks only as far as the user's
    ``solver.recompute`` allows (:func:`recompute_in_space`): the grid is a warm start,
    not a licence to leave the user's space."""
    units = recompute_in_space(request.config, request.graph.blocks(),
                                grid.gp.recompute_units)
    sgp, sres = solve_under_reserve(dataclasses.replace(request, cache=BuildCache(),
                                                        recompute=units), grid.reserve)
    if sres.objective >= solved[1].objective:
        return solved
    return sgp, dataclasses.replace(sres, message="; ".join(m for m in (
        sres.message, f"solved at the recomputed blocks and transient reserve of the grid's "
        f"best point {grid.name}, which the enumeration above had not tried") if m))


def solve_mesh(request: MeshSolveRequest, cutoff: float | None = None) -> Solved:
    """Build and solve the intra-op problem of ``request``. Raises
    :class:`InfeasibleError` naming the binding layer. ``cutoff``: no plan costing that
    much is wanted — :class:`CutOff` is raised instead of proving the optimum when the
    elimination's bound reaches it (the pipeline planner's variants slower than a plan in
    hand).

    ``solver.recompute``: ``never`` solves once; ``always`` recomputes every block;
    ``auto`` (under a memory budget — without one recomputation only costs) solves with
    none, with every block, and with the fewest leading blocks that fit
    (:class:`_RecomputeSearch`), each exactly, covers the counts between by relaxations
    (:class:`_CountsCover`), and keeps the cheapest plan that fits."""
    config = request.config
    if request.cache is None and (config.solver.recompute != "never"
                                  or set(config.solver.state_sharding) & {2, 3}):
        request = dataclasses.replace(request, cache=BuildCache())  # several builds follow
    units = request.graph.blocks()
    policy = config.solver.recompute
    t0 = time.perf_counter()
    searched = request.memory_budget is not None and bool(
        set(config.solver.state_sharding) & {2, 3} or (policy == "auto" and units))
    if policy == "never" or not units:
        solved = _solve_fitting(dataclasses.replace(request, recompute=frozenset()), cutoff)
    elif policy == "always" or request.memory_budget is None:
        solved = _solve_fitting(dataclasses.replace(
            request, recompute=_recomputed_without_budget(config, units)), cutoff)
    else:
        solved = _RecomputeSearch(request, units, cutoff).best()
    if not searched:  # one solve (or a few row tightenings): its own times say it
        return solved
    return solved[0], _whole_search_timed(solved[1], time.perf_counter() - t0)


def _whole_search_timed(res: SolveResult, spent: float) -> SolveResult:
    """``res`` (the kept plan's own solve, one of the search's over transient caps and
    counts of recomputed blocks) with ``solve_s`` the whole search's ``spent`` seconds less
    its build, the plan's own solve named in the message: a report of the last solve alone
    understated what the search cost (tiny-utf-zero-cpu: 1.8 s of 33 s)."""
    build = res.build_s or 0.0
    return dataclasses.replace(res, solve_s=max(spent - build, res.solve_s), message="; ".join(
        m for m in (res.message, f"solve_s is the whole search over transient caps and "
                    f"recomputed blocks ({spent:.3g} s); the kept plan's own solve took "
                    f"{build:.3g} s to build and {res.solve_s:.3g} s to solve") if m))


class _RecomputeSearch:
    """``recompute: auto`` under a budget: the counts of leading recomputed blocks solved —
    every count for up to :data:`EVERY_COUNT_UP_TO` blocks, else none, all, and the fewest
    that fit (bisection) — then the counts between covered (:class:`_CountsCover`), for as
    long as those took or ``solver.time_limit_s``, whichever is longer (``cover_s``
    instead, where given)."""

    def __init__(self, request: MeshSolveRequest, units: list, cutoff: float | None,
                 cover_s: float | None = None):
        self.request = request
        self.units = units
        self.cutoff = cutoff
        self.cover_s = cover_s
        self.tried: dict[int, Solved | InfeasibleError | CutOff] = {}
        self.found: list[Solved] = []  # plans the cover met at counts not solved

    def attempt(self, k: int, cut: bool = True) -> Solved | InfeasibleError | CutOff:
        """Count ``k`` solved; with ``cut``, stopped once proven no better than the best
        so far (or ``cutoff``). The bisection steers by whether a count fits, which a
        cut-off solve does not tell: its probes run (again) without one."""
        tried = self.tried
        if k not in tried or (not cut and isinstance(tried[k], CutOff)):
            best = self.best_objective() if cut else None
            try:
                tried[k] = _solve_fitting(self.at(k), best)
            except (InfeasibleError, CutOff) as exc:
                tried[k] = exc
        return tried[k]

    def at(self, k: int) -> MeshSolveRequest:
        """The request with the first ``k`` blocks recomputed."""
        return dataclasses.replace(self.request, recompute=frozenset(self.units[:k]))

    def best_objective(self) -> float | None:
        """The best plan's objective so far, or the caller's cutoff where lower."""
        return min([self.cutoff] * (self.cutoff is not None)
                   + [v[1].objective for v in self._fits()], default=None)

    def best(self) -> Solved:
        """The cheapest plan over every count (or :meth:`_CountsCover.labelled` says which
        were left); its message lists the counts solved."""
        t0 = time.perf_counter()
        n = len(self.units)
        if n <= EVERY_COUNT_UP_TO:
            for k in range(n + 1):
                self.attempt(k)
        else:  # the bisection's first probe first: where it fits, "all" runs with its cutoff
            self.attempt(0, cut=False)
            self.attempt(n)
            self._bisect_fewest_fitting()
        cover = _CountsCover(self, max(self.request.config.solver.time_limit_s,
                                       time.perf_counter() - t0)
                             if self.cover_s is None else self.cover_s)
        cover.run()
        fits = self._fits()
        if not fits:  # every count infeasible or cut off: the cut-off says more
            raise cover.unproven() or next(
                (v for v in self.tried.values() if isinstance(v, CutOff)), self.attempt(n))
        gp, best = min(fits, key=lambda v: v[1].objective)
        counts = ", ".join(f"{k}: {_outcome(v)}" for k, v in sorted(self.tried.items()))
        return cover.labelled((gp, dataclasses.replace(best, message="; ".join(
            m for m in (best.message, f"recomputed blocks tried ({counts}); kept "
                        f"{len(gp.recompute_units)}") if m))))

    def _fits(self) -> list[Solved]:
        return [v for v in self.tried.values() if isinstance(v, tuple)] + self.found

    def _bisect_fewest_fitting(self) -> None:
        """Where "all" fits, the fewest leading recomputed blocks that fit, by bisection
        (on the guess that fitting is monotone in the count; the cover checks the rest)."""
        lo, hi = 0, len(self.units)  # the fewest recomputed blocks that fit lie in (lo, hi]
        if not isinstance(self.attempt(0, cut=False), InfeasibleError):
            hi = 0
        elif isinstance(self.tried[hi], InfeasibleError):  # "all" was solved first
            return
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if isinstance(self.attempt(mid, cut=False), InfeasibleError):
                lo = mid
            else:
                hi = mid


@dataclasses.dataclass
class _CountSpan:
    """The counts of leading recomputed blocks ``lo`` to ``hi`` (inclusive), none solved,
    and a proven lower bound on every plan at one of them (``bound``)."""

    lo: int
    hi: int
    bound: float


class _CountsCover:
    """What makes :class:`_RecomputeSearch`'s sampled counts exact, the shape of
    :class:`_CapsCover`. Recomputing one more leading block changes, per option of the
    nodes it recomputes (:func:`~ilp_planner.intra_op.problem.recomputed`):

    - its cost by ``microbatches ×`` (the forward compute again, ≥ 0; the forward
      activation collectives again, ≥ 0; under ZeRO-3 every forward gather again, less the
      backward gathers it drops — one per forward gather at most, the same collective —
      so ≥ 0), and an edge into it replays its forward program (≥ 0): no cost falls, and
      the option lists and edge pairs line up across counts (a recomputed list maps its
      source option by option, the groups are the graph's), so count ``a``'s costs are a
      lower bound for every count ``k ≥ a``;
    - its memory row's charge from its activations held (× micro-batches in flight) to
      ``(activations + regathered weights) / c`` (``c`` the recomputed blocks of its
      family, growing with the count) — not monotone under ZeRO-3, whose regathered
      weights can exceed the activations freed. So no single count's row bounds the rest:
      per node and option the lesser of counts ``a``'s and ``b``'s charges bounds every
      ``k`` in ``[a, b]`` (a node is recomputed at ``a`` and at every later count, or not
      at ``b`` nor any earlier one, or one then the other; ``1/c`` only falls).

    The problem with count ``a``'s costs and those least charges (:func:`_counts_relaxed`;
    no transient cap, none reserved) therefore relaxes every count of ``[a, b]`` as each
    count is solved (every plan a count's solve returns meets its own row within the
    budget). Solved with the best plan so far as its cutoff, its proven bound reaching that
    plan, or nothing fitting it, covers the span; its optimum fitting count ``a``'s exact
    peak is a plan at ``a`` no count of the span beats, and fitting only later it is a
    plan at the fewest counts where it fits (:meth:`_fitting_later`); else the span is
    halved and each half covered so in turn, under the span's bound, the weakest bound
    first — down to one count, solved exactly where its own relaxation (one build, no
    caps: far cheaper) does not rule it out. What is left when its ``seconds`` are spent —
    spans, and counts whose own solve stopped short of a proof (a time limit, transient
    caps left, an unproven infeasibility) — makes the plan ``feasible`` with the gap to the
    weakest bound left (:meth:`labelled`). The relaxations are solved for their bound (the
    elimination's, no ILP after it): a bound is what they are for."""

    def __init__(self, search: _RecomputeSearch, seconds: float):
        self.search = search
        self.seconds = seconds
        self.tolerance = max(search.request.config.solver.gap, 1e-9)
        self.relaxations = 0
        self.proved: set[int] = set()  # counts a relaxation shows no better, or not fitting
        self.uncovered: list[_CountSpan] = []

    def run(self) -> None:
        """Cover every count not solved, solving the counts it cannot rule out, until done
        or the time is spent (the spans left in ``uncovered``)."""
        until = time.perf_counter() + self.seconds
        todo = [k for k in range(len(self.search.units) + 1) if k not in self.search.tried]
        # the weakest bound first: where a better plan may be, found early, cuts off more
        heap = [(span.bound, span.lo, span) for r in _runs(todo)
                for span in [_CountSpan(r[0], r[-1], self._free_bound(r[0]))]]
        heapq.heapify(heap)
        while heap:
            span = heapq.heappop(heap)[2]
            if self._covered(span.bound):
                self.proved.update(range(span.lo, span.hi + 1))
            elif time.perf_counter() >= until:
                self.uncovered.append(span)
            else:
                for half in self._split(span):
                    heapq.heappush(heap, (half.bound, half.lo, half))

    def _threshold(self) -> float | None:
        """The cutoff: the best plan so far, or the caller's, less the gap accepted as
        optimal (a relaxation stops as soon as its bound is within it)."""
        best = self.search.best_objective()
        return None if best is None else best * (1 - self.tolerance)

    def _covered(self, bound: float) -> bool:
        threshold = self._threshold()
        return threshold is not None and bound >= threshold

    def _built(self, k: int) -> GraphProblem:
        return _built(self.search.at(k))

    def _free_bound(self, k: int) -> float:
        """A bound on every count from ``k`` up, before any solve: count ``k``'s problem
        with the memory row aside (its costs bound the later counts')."""
        try:
            return relaxation_bound(self._built(k).problem)
        except ValueError:  # an op with no strategy: nothing at this count, no bound
            return -np.inf

    def _split(self, span: _CountSpan) -> list[_CountSpan]:
        """The span's relaxation solved; the halves left to cover (or its one count
        solved exactly)."""
        search, lo = self.search, span.lo
        self.relaxations += 1
        try:  # a bound is wanted: the elimination's, no ILP after it (warm_only)
            low = self._built(lo)
            gp, res = _solve_once(search.at(lo), None, self._threshold(), warm_only=True,
                                  built=_counts_relaxed(low, self._built(span.hi)))
        except UnprovenInfeasible:
            self.uncovered.append(span)  # no proof: the span stays open
            return []
        except (CutOff, InfeasibleError, ValueError):  # ValueError: an op with no strategy
            self.proved.update(range(lo, span.hi + 1))
            return []
        bound = max(span.bound, -np.inf if res.bound is None else res.bound)
        runnable = gp.unrunnable(res.choice) is None
        if runnable and res.status == "optimal" and self._fits_at(lo, res.choice):
            # a plan at ``lo`` (the relaxation's costs are its own), as cheap as the bound
            search.tried[lo] = (low, dataclasses.replace(res, message="; ".join(m for m in (
                res.message, f"the relaxation of counts {lo}–{span.hi}, fitting at {lo}")
                if m)))
        elif runnable:
            self._fitting_later(res, lo, span.hi)
        if self._covered(bound):
            self.proved.update(range(lo, span.hi + 1))
            return []
        if lo == span.hi:
            search.attempt(lo)
            return []
        mid = (lo + span.hi) // 2
        return [_CountSpan(mid + 1, span.hi, bound), _CountSpan(lo, mid, bound)]

    def _fits_at(self, k: int, choice) -> bool:
        """Whether ``choice``'s exact peak at count ``k`` fits the budget."""
        budget = self.search.request.memory_budget
        assert budget is not None
        return peak_memory(self._built(k), choice) <= budget * (1 + 1e-9)

    def _fitting_later(self, res: SolveResult, lo: int, hi: int) -> None:
        """The relaxed optimum as a plan at the span's middle or last count, the first where
        it fits, priced there: no proof for the count, but a plan found early, which cuts
        off more of the rest. Only those two: their problems are built for the halves'
        relaxations anyway, where a finer search would build others."""
        choice = res.choice
        mid = (lo + hi) // 2
        b = next((k for k in dict.fromkeys((mid, hi)) if lo < k and self._fits_at(k, choice)),
                 None)
        if b is None:
            return
        gp = self._built(b)
        self.search.found.append((gp, dataclasses.replace(
            res, status="feasible", objective=gp.problem.objective(choice), bound=None,
            gap=None, message=f"the relaxed optimum of counts {lo}–{hi}, fitting at {b}")))

    def left(self) -> dict[int, float]:
        """The counts not covered, each with its best proven lower bound: those inside
        spans left, and those whose own solve proved nothing below the best plan."""
        out: dict[int, float] = {}
        for span in self.uncovered:
            for k in range(span.lo, span.hi + 1):
                out[k] = max(out.get(k, -np.inf), span.bound)
        for k, v in self.search.tried.items():
            if k in self.proved or isinstance(v, CutOff) or (
                    isinstance(v, InfeasibleError) and not isinstance(v, UnprovenInfeasible)):
                continue
            if isinstance(v, tuple) and v[1].status == "optimal":
                continue
            bound = v[1].bound if isinstance(v, tuple) else None
            bound = self._free_bound(k) if bound is None else bound
            if not self._covered(bound):
                out[k] = bound
        return out

    def unproven(self) -> UnprovenInfeasible | None:
        """Where no count fits but some were left uncovered: the error saying so."""
        left = self.left()
        if not left:
            return None
        return UnprovenInfeasible(
            f"no plan fits at the counts of recomputed blocks solved; counts "
            f"{_count_ranges(left)} not covered within {self.seconds:.3g} s")

    def labelled(self, solved: Solved) -> Solved:
        """``solved`` (the best plan over the counts solved) with what the cover proved:
        every count covered, or the status ``feasible`` and the gap to the counts left."""
        gp, res = solved
        total = len(self.search.units) + 1
        left = self.left()
        if not left and res.bound is None:  # a plan the cover met: proven by the cover alone
            threshold = self._threshold()  # (the caller's cutoff, where below it: no proof)
            assert threshold is not None
            gap = max(0.0, (res.objective - threshold) / max(abs(res.objective), 1e-30))
            res = dataclasses.replace(res, bound=threshold, gap=gap, status="optimal" if gap
                                      <= self.tolerance * (1 + 1e-9) else "feasible")
        if not left:
            return gp, dataclasses.replace(res, message="; ".join(m for m in (
                res.message, f"every count of recomputed blocks covered ({len(self.search.tried)}"
                f" of {total} solved, {self.relaxations} relaxations proving the rest no "
                f"better)") if m))
        return gp, _left_open(res, min(left.values()), lambda gap: (
            f"{len(left)} of {total} counts of recomputed blocks ({_count_ranges(left)}) "
            f"left open — not covered within {self.seconds:.3g} s (the longer of "
            f"solver.time_limit_s and the sampled counts' time) or solved short of a "
            f"proof: a plan at one of them may be up to {gap:.3%} faster than this one"))


def _runs(counts) -> list[list[int]]:
    """``[1, 2, 3, 5]`` as ``[[1, 2, 3], [5]]``: the runs of consecutive counts."""
    runs: list[list[int]] = []
    for k in sorted(counts):
        if runs and k == runs[-1][-1] + 1:
            runs[-1].append(k)
        else:
            runs.append([k])
    return runs


def _count_ranges(counts) -> str:
    """``[1, 2, 3, 5]`` as ``1–3, 5``."""
    return ", ".join(f"{r[0]}–{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in _runs(counts))


def _row_charges(opts: list, inflight: int, blocks: int | None = None) -> np.ndarray:
    """Per option, what a node's options charge the memory row (as
    :func:`~ilp_planner.intra_op.problem.build_nodes` sums them): state and one
    micro-batch's activations, plus the held activations of the other micro-batches in
    flight. ``blocks``: a recomputed option charges its re-materialised bytes over that
    many blocks instead (:func:`memory_floor`)."""
    return np.array([o.state_bytes + o.recompute_bytes / blocks if o.recompute and blocks
                     else o.memory_bytes + (inflight - 1) * (0.0 if o.recompute
                                                             else o.activation_bytes)
                     for o in opts])


def _counts_relaxed(low: GraphProblem, high: GraphProblem) -> GraphProblem:
    """The problem relaxing every count of recomputed blocks from ``low``'s to ``high``'s
    (:class:`_CountsCover`): ``low``'s costs, edges and buckets, and per group and option
    the sum over its nodes of the lesser of the two counts' memory charges."""
    inflight = low.boundary.inflight
    pairs: dict[tuple[int, int, int], tuple[list, list, int]] = {}
    for node, g in low.group_of.items():
        a, b = low.options[node], high.options[node]
        key = (g, id(a), id(b))
        hit = pairs.get(key)
        pairs[key] = (a, b, 1 if hit is None else hit[2] + 1)
    rows = [np.zeros(len(c)) for c in low.problem.cost]
    charges: dict[int, np.ndarray] = {}
    for (g, ia, ib), (a, b, count) in pairs.items():
        ca = charges.setdefault(ia, _row_charges(a, inflight))
        cb = charges.setdefault(ib, _row_charges(b, inflight))
        rows[g] += count * np.minimum(ca, cb)
    return dataclasses.replace(low, problem=dataclasses.replace(low.problem, memory=rows))


def _outcome(v: Solved | InfeasibleError | CutOff) -> str:
    if isinstance(v, InfeasibleError):
        return "infeasible"
    return "bound ≥ best" if isinstance(v, CutOff) else f"{v[1].objective:.6g} s"


def recompute_in_space(config: Config, units, wanted: frozenset) -> frozenset:
    """``wanted`` recomputed blocks (a torchtitan grid point's ``ac``) brought into the
    user's ``solver.recompute`` where the config sets it: every block under ``always``,
    none under ``never``, ``wanted`` under ``auto``. Left at its default the key is no
    choice of the user's, and the grid may guide the plan's recomputation."""
    solver = config.raw.get("solver")
    if not (isinstance(solver, Mapping) and "recompute" in solver):
        return frozenset(wanted)
    policy = config.solver.recompute
    if policy == "auto":
        return frozenset(wanted)
    return frozenset(units) if policy == "always" else frozenset()


def _recomputed_without_budget(config: Config, units) -> frozenset:
    """The blocks :func:`solve_mesh` recomputes with no memory budget: all under
    ``recompute: always``, else none (recomputation then only costs)."""
    return frozenset(units) if config.solver.recompute == "always" else frozenset()


def memory_floor(request: MeshSolveRequest) -> float:
    """A lower bound on the exact peak (:func:`peak_memory`) of every plan in ``request``'s
    space — any set of recomputed blocks its ``solver.recompute`` allows, any state
    sharding — for what an infeasibility message may claim. Per node and option the lesser
    of two charges: held (state and the in-flight micro-batches' activations, as with no
    block recomputed) and recomputed (state and its re-materialised activations over the
    ``n`` blocks there are: with ``k ≤ n`` of them recomputed, the peak's largest block
    holds at least their average, so each recomputed node brings at least ``1/k ≥ 1/n`` of
    its bytes — the memory row's charge per family can exceed that where a model has
    several families); per group the least option's sum, summed. Transients come on top.
    The builds are :func:`solve_mesh`'s own (its cache's)."""
    config, units = request.config, request.graph.blocks()
    policy = config.solver.recompute
    free = dataclasses.replace(request, memory_budget=None)
    builds = ([] if policy == "always" and units else [frozenset()]) + (
        [] if policy == "never" or not units else [frozenset(units)])
    try:
        gps = [_built(dataclasses.replace(free, recompute=blocks)) for blocks in builds]
    except ValueError:  # no problem to bound (what the solve raised): nothing proven
        return 0.0
    first = gps[0]
    rows = [np.zeros(len(c)) for c in first.problem.cost]
    for node, g in first.group_of.items():
        rows[g] += np.min([_row_charges(gp.options[node], first.boundary.inflight, len(units))
                           for gp in gps], axis=0)
    return float(sum(r.min() for r in rows))


def fastest_bound(request: MeshSolveRequest) -> float:
    """A lower bound on the objective of :func:`solve_mesh` without a memory budget (the
    fastest plan) on ``request``, from the problem that solve builds (kept in its cache
    for it) relaxed by :func:`relaxation_bound` — no dominance, no search: the pipeline
    planner drops the (range, mesh) pairs it proves slower than a plan in hand. Raises
    :class:`InfeasibleError` where that build does."""
    chosen = _recomputed_without_budget(request.config, request.graph.blocks())
    try:
        gp = _built(dataclasses.replace(request, memory_budget=None, recompute=chosen))
    except ValueError as exc:
        raise InfeasibleError(str(exc)) from exc
    return relaxation_bound(gp.problem)


def _solve_fitting(request: MeshSolveRequest, cutoff: float | None = None,
                   cover_s: float | None = None) -> Solved:
    """The best plan whose exact peak (:func:`peak_memory`) fits the budget.

    State sharding's transients (gathered weights, unscattered gradients; at most one op's
    at a time) are a max, not a sum: a cap ``T`` keeps only options whose transient is at
    most ``T`` and reserves ``T`` of the budget. Every cap spread over the transients
    (:func:`_cap_candidates`) is tried, from the largest down, each followed by the
    transient its plan really uses (a plan using less than its cap may improve with the
    smaller reserve), until that stops falling; last ``T = 0`` (the space without
    transients: never worse than not sharding). Every plan is exact for its cap, the
    cheapest is kept; a solve whose proven bound reaches the best plan so far stops there
    (:class:`CutOff`), so a cap that cannot win costs a few elimination passes. Sampling
    alone is not exact — on a tiny GPT under ZeRO-3 on 1 × 4 devices at 0.00068 GiB a cap
    not sampled holds a plan 1.5 % faster (0.0037335 s a step against 0.0037918 s) — so the
    caps between those tried are then covered by relaxations (:class:`_CapsCover`), for as
    long as the sampled caps took or ``solver.time_limit_s``, whichever is longer
    (``cover_s`` instead, where given): the plan kept is optimal over every cap, or its
    status is ``feasible`` with its gap to the caps left uncovered.
    Untied recomputed blocks are charged their average in the memory row; where a plan's
    largest re-materialised block exceeds what that leaves, the row is tightened by the
    difference and the problem solved again (the message says so)."""
    if request.memory_budget is None:
        return _solve_once(request, None)
    t0 = time.perf_counter()
    results: list[Solved] = []
    caps: list[float] = []
    sharded = bool(set(request.config.solver.state_sharding) & {2, 3})
    if sharded:
        caps += _cap_candidates(request)
    caps.append(0.0)
    failure: InfeasibleError | CutOff | None = None
    done: set[float] = set()
    while caps:
        cap = caps.pop(0)
        if cap in done:
            continue
        done.add(cap)
        best = min([cutoff] * (cutoff is not None) + [r[1].objective for r in results],
                   default=None)
        try:
            gp, res = solve_under_reserve(request, cap, best)
        except InfeasibleError as exc:
            failure = failure or exc
            continue
        except CutOff as exc:
            failure = exc  # not better than a plan found: says more than infeasible
            continue
        results.append((gp, res))
        used = _transient(gp, res.choice)
        if 0 < used < cap:
            caps.insert(0, used)
    cover = _CapsCover(request, results, done, cutoff, max(
        request.config.solver.time_limit_s, time.perf_counter() - t0) if cover_s is None
        else cover_s)
    if sharded:
        cover.run()
    if not results:
        assert failure is not None
        raise failure
    return cover.labelled(min(results, key=lambda r: r[1].objective))


@dataclasses.dataclass
class _Span:
    """Distinct transients not solved as caps, ascending, all strictly between two caps
    that were (``inside``), and a proven lower bound on every plan under a cap among them
    (``bound``)."""

    inside: list[float]
    bound: float


class _CapsCover:
    """What makes :func:`_solve_fitting`'s sampled caps exact. A plan under a cap ``T``
    among the untried transients ``inside`` of a span keeps options with transients up to
    ``inside[-1]`` and reserves at least ``inside[0]``: the problem with those options and
    that reserve relaxes every cap of the span. Solved with the best plan so far as its
    cutoff, its proven bound reaching that plan (:class:`CutOff`) or nothing fitting it
    covers the span; its optimum fitting the budget with its own transient is a plan, the
    span's best; else the middle transient is solved as a cap and each half covered so in
    turn, under the halves' bound. Spans left when its ``seconds`` are spent are reported:
    the plan's status is then ``feasible``, its gap against their weakest bound
    (:meth:`labelled`)."""

    def __init__(self, request: MeshSolveRequest, results: list[Solved], tried: set[float],
                 cutoff: float | None, seconds: float):
        self.request, self.results, self.cutoff = request, results, cutoff
        self.seconds = seconds
        self.tolerance = max(request.config.solver.gap, 1e-9)
        self.gp = _built(dataclasses.replace(request, memory_budget=None))
        self.values = sorted({o.transient_bytes for os in self.gp.options.values()
                              for o in os} | {0.0})
        self.tried = set(tried)
        self.relaxations = 0
        self.ran = False
        self.uncovered: list[_Span] = []

    def run(self) -> None:
        """Cover every span between the caps tried, adding the plans found to ``results``,
        until done or the time is spent (the spans left in ``uncovered``)."""
        self.ran = True
        until = time.perf_counter() + self.seconds
        caps = sorted(self.tried)
        stack = [_Span(inside, self._forest_bound(inside))
                 for lo, hi in zip(caps, caps[1:], strict=False)
                 if (inside := [v for v in self.values if lo < v < hi])]
        while stack:
            span = stack.pop()
            if self._covered(span.bound):
                continue
            if time.perf_counter() >= until:
                self.uncovered.append(span)
                continue
            stack += self._split(span)

    def _threshold(self) -> float | None:
        """The cutoff: the best plan so far, or the caller's, less the gap accepted as
        optimal (a relaxation stops as soon as its bound is within it)."""
        best = min([self.cutoff] * (self.cutoff is not None)
                   + [r[1].objective for r in self.results], default=None)
        return None if best is None else best * (1 - self.tolerance)

    def _covered(self, bound: float) -> bool:
        threshold = self._threshold()
        return threshold is not None and bound >= threshold

    def _forest_bound(self, inside: list[float]) -> float:
        """A bound on the span before any solve: the memory row aside, with its options."""
        allowed = _allowed(self.gp, inside[-1])
        if any(a.size == 0 for a in allowed):
            return np.inf
        return relaxation_bound(self.gp.problem.subset(allowed))

    def _split(self, span: _Span) -> list[_Span]:
        """The span's relaxation solved; the halves left to cover."""
        inside, request = span.inside, self.request
        if len(inside) == 1:  # the relaxation is the cap's own first solve
            self._solve_cap(inside[0])
            return []
        try:
            gp, res = _solve_once(request, inside[-1], self._threshold(), reserve=inside[0])
        except UnprovenInfeasible:
            self.uncovered.append(span)  # no proof: the span stays open
            return []
        except (CutOff, InfeasibleError):
            return []
        self.relaxations += 1
        bound = max(span.bound, -np.inf if res.bound is None else res.bound)
        assert request.memory_budget is not None
        if peak_memory(gp, res.choice) <= request.memory_budget * (1 + 1e-9):
            self.results.append((gp, res))  # a plan: the relaxation's optimum fits
        if self._covered(bound):
            return []
        mid = len(inside) // 2
        self._solve_cap(inside[mid])
        return [_Span(part, bound) for part in (inside[:mid], inside[mid + 1:]) if part]

    def _solve_cap(self, cap: float) -> None:
        """``cap`` solved exactly (:func:`solve_under_reserve`), its plan kept if any."""
        self.tried.add(cap)
        try:
            self.results.append(solve_under_reserve(self.request, cap, self._threshold()))
        except UnprovenInfeasible:  # no plan and no proof: the cap stays open
            self.uncovered.append(_Span([cap], self._forest_bound([cap])))
        except (CutOff, InfeasibleError):
            pass

    def labelled(self, solved: Solved) -> Solved:
        """``solved`` (the cheapest of ``results``) with what the caps search proved: every
        cap covered, or the status ``feasible`` and the gap to the spans left."""
        gp, res = solved
        if not self.ran:
            return solved
        n = len(self.values)
        if not self.uncovered:
            return gp, dataclasses.replace(res, message="; ".join(m for m in (
                res.message, f"every transient cap covered ({len(self.tried)} of {n} solved, "
                f"{self.relaxations} relaxations proving the rest no better)") if m))
        left = sorted(v for s in self.uncovered for v in s.inside)
        return gp, _left_open(res, min(s.bound for s in self.uncovered), lambda gap: (
            f"{len(left)} of {n} transient caps ({left[0]:.6g}–{left[-1]:.6g} B) not "
            f"covered within {self.seconds:.3g} s (the longer of solver.time_limit_s and "
            f"the sampled caps' time): a plan under one of them may be up to {gap:.3%} "
            f"faster than this one"))


def _left_open(res: SolveResult, lower: float, note: Callable[[float], str]) -> SolveResult:
    """``res`` where a cover left part of its space open with ``lower`` the weakest bound
    there: ``feasible`` (where it said optimal), its bound and gap no better than that, and
    ``note(gap)`` added to its message."""
    bound = lower if res.bound is None else min(lower, res.bound)
    gap = max(0.0, (res.objective - bound) / max(abs(res.objective), 1e-30))
    return dataclasses.replace(
        res, status="feasible" if res.status == "optimal" else res.status, bound=bound,
        gap=gap, message="; ".join(m for m in (res.message, note(gap)) if m))


def _cap_candidates(request: MeshSolveRequest) -> list[float]:
    """Transient caps to try, largest first: :data:`CAP_SAMPLES` values spread evenly over
    the sorted distinct transients of all options (the largest always among them)."""
    gp = _built(dataclasses.replace(request, memory_budget=None))
    values = sorted({o.transient_bytes for opts in gp.options.values() for o in opts} - {0.0})
    if len(values) > CAP_SAMPLES:
        values = [values[round(i * (len(values) - 1) / (CAP_SAMPLES - 1))]
                  for i in range(CAP_SAMPLES)]
    return values[::-1]


def _built(request: MeshSolveRequest) -> GraphProblem:
    """:func:`build_problem` for one solve. The caps, budgets and recomputed sets that
    :func:`solve_mesh` tries rebuild the same problem many times over with only the memory
    row's budget changed; the request's cache keeps the problems of the graph it last saw
    (a new graph replaces them, so it holds one graph's) and each caller gets its own copy
    with its budget — the same arrays, so the same problem bit for bit."""
    config, cache, graph = request.config, request.cache, request.graph
    opts = config.solver
    key = problem_key(config.cluster, request.nodes, request.local, config.memory,
                      opts.tie_layers, opts.max_weight_replication, request.microbatches,
                      request.boundary, config.grad_bucket_bytes, tuple(opts.state_sharding),
                      request.recompute)
    gp = None
    if cache is not None:
        if cache.problems_of is not graph:
            cache.problems.clear()
            cache.problems_of = graph
        gp = cache.problems.get(key)
    if gp is None:
        gp = build_problem(graph, config.cluster, request.nodes, request.local, config.memory,
                           tie_layers=opts.tie_layers,
                           max_weight_replication=opts.max_weight_replication,
                           microbatches=request.microbatches, boundary=request.boundary,
                           grad_bucket_bytes=config.grad_bucket_bytes, cache=cache,
                           zero_levels=opts.state_sharding, recompute=request.recompute)
        if cache is not None:
            cache.problems[key] = gp
    return _budgeted(gp, request.memory_budget)


def _budgeted(gp: GraphProblem, budget: float | None) -> GraphProblem:
    """``gp`` under ``budget``: a copy of it and its problem (the same arrays)."""
    return dataclasses.replace(gp, problem=dataclasses.replace(gp.problem, memory_budget=budget))


def _allowed(gp: GraphProblem, cap: float) -> list[np.ndarray]:
    """Per group, the strategies whose every node's transient is at most ``cap``."""
    return [np.array([k for k in range(len(gp.problem.cost[g]))
                      if all(gp.options[n][k].transient_bytes <= cap for n in group)],
                     dtype=int) for g, group in enumerate(gp.groups)]


def _transient(gp: GraphProblem, choice) -> float:
    return max((o.transient_bytes for o in gp.node_choice(choice).values()), default=0.0)


def solve_under_reserve(request: MeshSolveRequest, cap: float,
                        cutoff: float | None = None) -> Solved:
    """The best plan of ``request`` (its recomputed blocks as given) whose exact peak fits
    its budget with ``cap`` reserved for state sharding's transients (and no option's
    transient above it): :func:`_solve_once`, with the re-materialised blocks checked
    exactly (see :func:`_solve_fitting`). The solve at one point of the space — a grid
    point's blocks and reserve, say — where :func:`solve_mesh` searches them."""
    budget = request.memory_budget
    assert budget is not None
    row = budget
    for _ in range(4):
        gp, res = _solve_once(dataclasses.replace(request, memory_budget=row), cap, cutoff)
        peak = peak_memory(gp, res.choice)
        if peak <= budget * (1 + 1e-9):
            if row < budget:
                res = dataclasses.replace(res, message="; ".join(m for m in (
                    res.message, f"memory row tightened by {(budget - row) / 2**30:.4g} "
                    f"GiB for the largest re-materialised block") if m))
            return gp, res
        charged = gp.problem.memory_of(res.choice) + _transient(gp, res.choice)
        row = min(row - (peak - budget), budget - (peak - charged))
        if row <= 0:
            break
    raise UnprovenInfeasible(  # the row's tightening is no proof that none fits
        f"no plan fits with its transients: the best plan under the memory row peaks at "
        f"{peak / 2**30:.4g} GiB (re-materialised activations and gathered weights "
        f"included); the budget is {budget / 2**30:.4g} GiB")


def _solve_once(request: MeshSolveRequest, transient_cap: float | None,
                cutoff: float | None = None, warm_only: bool = False,
                reserve: float | None = None, built: GraphProblem | None = None) -> Solved:
    """Build and solve once. ``transient_cap`` (under a budget): only options whose
    transient is at most the cap, and the cap (or ``reserve``: a relaxation of the caps
    between, :class:`_CapsCover`) reserved from the memory row. Raises :class:`CutOff` when
    the elimination's or the ILP's proven bound reaches ``cutoff`` (a plan found elsewhere
    is as good; each stops there). ``warm_only``: a good plan is wanted, not a proof (a
    warm start) — the elimination's incumbent as it stands, no ILP in or after it.
    ``built``: solved instead of ``request``'s own problem (:class:`_CountsCover`)."""
    opts = request.config.solver
    t0 = time.perf_counter()
    try:
        gp = _built(request) if built is None else _budgeted(built, request.memory_budget)
    except ValueError as exc:
        raise InfeasibleError(str(exc)) from exc
    memory_budget = request.memory_budget
    allowed = None
    if transient_cap is not None:
        allowed = _allowed(gp, transient_cap)
        held = transient_cap if reserve is None else reserve
        if held > 0:
            memory_budget -= held
            if memory_budget <= 0:
                raise InfeasibleError("the transient reserved exceeds the memory budget")
            gp.problem = dataclasses.replace(gp.problem, memory_budget=memory_budget)
    problem_s = time.perf_counter() - t0
    if memory_budget is not None and gp.problem.min_memory()[0] > memory_budget:
        raise InfeasibleError(describe_infeasible(gp, memory_budget, opts.tie_layers))
    if opts.fallback not in SEARCHES:
        raise ConfigError(f"unknown fallback search {opts.fallback!r}; expected one of "
                          f"{sorted(SEARCHES)}", key="solver.fallback")
    t1 = time.perf_counter()
    if allowed is None:
        kept = dominated_free(gp.problem)
    else:  # the cap first: dominance does not compare transients
        if any(a.size == 0 for a in allowed):
            raise InfeasibleError(f"no strategy's transient fits the cap {transient_cap} B")
        kept = [a[k] for a, k in zip(allowed, dominated_free(gp.problem.subset(allowed)),
                                     strict=True)]
    problem = gp.problem.subset(kept)
    total = sum(len(c) for c in gp.problem.cost)
    notes = [f"{total - sum(len(k) for k in kept)} of {total} strategies dominated and dropped"]
    problem_s += time.perf_counter() - t1
    # the tied warm start (itself a solve) once, and only where the elimination needs it:
    # not where its first bound reaches the cutoff. The node ILPs' time limit leaves its
    # time out, as when it ran first.
    tied_once = functools.cache(lambda: _tied_warm_start(
        dataclasses.replace(request, memory_budget=memory_budget), gp, kept))
    since = [time.perf_counter()]

    def incumbents() -> list[tuple[int, ...]]:
        t = time.perf_counter()
        tied = tied_once()
        since[0] += time.perf_counter() - t
        return [tied] if tied else []

    exact = None
    if opts.elimination:
        try:
            exact = solve_elimination(
                problem, gap=opts.gap, cutoff=cutoff, incumbents=incumbents,
                node_solver=None if warm_only else functools.partial(
                    _node_ilp, opts, lambda: since[0] + opts.time_limit_s))
        except NoFit as exc:  # under a transient cap, fewer strategies than checked above
            raise InfeasibleError(f"{exc} (strategies with transients up to {transient_cap} B)"
                                  ) from exc
    if (cutoff is not None and exact is not None and exact.result.bound is not None
            and exact.result.bound >= cutoff):
        raise CutOff(exact.result.bound)
    if exact is not None and (exact.keep is None or warm_only):
        result = dataclasses.replace(exact.result, build_s=problem_s, message="; ".join(
            [exact.result.message, *notes]))
    else:
        result = _solve_ilp(request.config, problem, exact, tied_once(), notes, problem_s,
                            cutoff)
    full = tuple(int(kept[g][k]) for g, k in enumerate(result.choice))
    if not warm_only:  # a warm start is no plan: a breaking one only loses to a runnable one
        gp.refuse_unrunnable(full, _chosen(result), proven=result.status == "optimal")
    return gp, dataclasses.replace(result, choice=full)


def _chosen(result: SolveResult) -> str:
    """What a solve's choice is, for :meth:`GraphProblem.refuse_unrunnable`: an optimum
    breaking a coupling means every choice does (each costs more than any choice keeping
    them); a solve stopped short may have missed a runnable one."""
    if result.status == "optimal":
        return "any choice of this problem (its optimum breaks a coupling, so all do)"
    return (f"the solver's choice ({result.status}, {result.method}; a longer "
            f"solver.time_limit_s may find one it can run)")


def _node_ilp(opts, until: Callable[[], float], problem) -> tuple[tuple[int, ...], float] | None:
    """The elimination's node solver: the ILP on one branch-and-bound node's strategies,
    to the configured gap — its choice and the bound SCIP proved (never more than the
    choice's objective), or None when it stops short of the gap. The nodes of one solve
    share one ``solver.time_limit_s``, ending at ``until()`` (``time.perf_counter``); when
    it runs out the branch and bound stops and the ILP on every kept strategy runs with its
    own limit, as without a node solver."""
    left = until() - time.perf_counter()
    if left <= 0:
        return None
    res = SbpIlp(problem, opts.milp).solve(time_limit_s=left, threads=opts.threads,
                                           seed=opts.seed, gap=opts.gap)
    if res is None or res.status != "optimal":
        return None
    return res.choice, min(res.objective, res.bound)


def _solve_ilp(config: Config, problem, exact: EliminationResult | None, tied, notes: list[str],
               problem_s: float, cutoff: float | None = None) -> SolveResult:
    """The ILP on ``problem`` (pruned indices). After an elimination: on the strategies
    its bound keeps (the optimum is among them), warm-started from its incumbent, whose
    proven bound also bounds the ILP's. Without one: on all strategies, warm-started from
    the fallback search or the tied optimum ``tied``. ``cutoff``: SCIP stops once its bound
    reaches it, and :class:`CutOff` is raised (the caller drops the problem)."""
    opts = config.solver
    if exact is not None:
        index = [np.asarray(keep) for keep in exact.keep]
        sub = problem.subset(index)
        position = [{int(k): i for i, k in enumerate(keep)} for keep in index]
        warm_method = "tied ILP" if tied is not None and tuple(tied) == exact.result.choice \
            else "elimination"
        incumbent = tuple(position[g][k] for g, k in enumerate(exact.result.choice))
        warm, search_s = incumbent, exact.result.solve_s
        notes = [*notes, f"{sum(len(k) for k in index)} of {sum(len(c) for c in problem.cost)} "
                         f"strategies within the elimination bound ({exact.result.message})"]
    else:
        index, sub = None, problem
        heuristic = SEARCHES[opts.fallback](problem, seed=opts.seed)
        incumbent, search_s = heuristic.choice, heuristic.solve_s
        warm, warm_method = ((incumbent, opts.fallback) if problem.feasible(incumbent)
                             else (None, ""))
        if tied is not None and problem.feasible(tied) and (
                warm is None or problem.objective(tied) < problem.objective(warm)):
            warm, warm_method = tied, "tied ILP"
    ilp = SbpIlp(sub, opts.milp)
    # SCIP's dual limit only with an incumbent: a run stopped there before finding one
    # reads as a time-out with nothing found, not as a cutoff (its bound is then lost)
    result = ilp.solve(time_limit_s=opts.time_limit_s, threads=opts.threads, warm_start=warm,
                       seed=opts.seed, gap=opts.gap, cutoff=cutoff if warm is not None else None)
    build_s = problem_s + ilp.build_s
    if result is None and exact is not None:
        objective = sub.objective(incumbent)
        result = dataclasses.replace(
            exact.result, choice=incumbent, objective=objective, stats=ilp.stats,
            gap=max(0.0, (objective - exact.result.bound) / objective), method=warm_method,
            message=f"the ILP found nothing better within {opts.time_limit_s} s")
    elif result is None:
        choice = warm if warm is not None else incumbent
        result = SolveResult(
            "heuristic", problem.objective(choice), None, None, 0.0, 0.0, tuple(choice),
            warm_method or opts.fallback,
            f"the ILP found no solution within {opts.time_limit_s} s; using "
            f"{warm_method or opts.fallback}", ilp.stats)
    elif exact is not None:
        bound = result.bound if result.status == "optimal" else max(
            result.bound if result.bound is not None else -np.inf, exact.result.bound)
        gap = max(0.0, (result.objective - bound) / max(abs(result.objective), 1e-30))
        result = dataclasses.replace(result, bound=bound, gap=result.gap if result.status ==
                                     "optimal" else gap, method="elimination+ilp")
    if cutoff is not None and result.bound is not None and result.bound >= cutoff:
        raise CutOff(result.bound)
    result = dataclasses.replace(
        result, build_s=build_s, solve_s=result.solve_s + search_s,
        message="; ".join(m for m in (result.message, *notes) if m))
    if index is None:
        return result
    return dataclasses.replace(result, choice=tuple(int(index[g][k])
                                                    for g, k in enumerate(result.choice)))


def _tied_warm_start(request: MeshSolveRequest, gp: GraphProblem, kept
                     ) -> tuple[int, ...] | None:
    """For an untied solve of a graph with repeated blocks: the tied optimum (a valid
    untied choice, since tying only restricts) as a warm start, in the pruned problem's
    indices. The ILP alone can stall far above it on large untied models, and the
    elimination's incumbent ignores bucket rounding. Not proven optimal for the tied
    problem (no ILP after the elimination): a warm start needs no proof, and on
    tiny-utf-zero-cpu those proofs were half the solve (several stopped at the limit)."""
    config = request.config
    if config.solver.tie_layers or not any(op.tie_key for op in gp.graph.ops):
        return None
    tied_config = dataclasses.replace(
        config, solver=dataclasses.replace(config.solver, tie_layers=True))
    try:
        tgp, tres = _solve_once(dataclasses.replace(request, config=tied_config), None,
                                warm_only=True)
    except InfeasibleError:
        return None
    full = [tres.choice[tgp.group_of[group[0]]] for group in gp.groups]
    positions = [{int(k): i for i, k in enumerate(kept[g])} for g in range(len(kept))]
    if any(k not in positions[g] for g, k in enumerate(full)):
        return None
    return tuple(positions[g][k] for g, k in enumerate(full))
