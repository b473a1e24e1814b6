"""Exact intra-op solve by variable elimination (non-serial dynamic programming).

The intra-op objective without its two coupling terms is a sum of unary costs and pairwise
resharding costs over the group graph, ``Σ_g cost_g[c_g] + Σ_(u,v) R_uv[c_u, c_v]``. Such a
min-sum problem is solved exactly by eliminating groups one at a time (Bertelè & Brioschi's
non-serial DP; bucket elimination): eliminating y replaces every term touching y by one
table over y's neighbours, ``T(N) = min_y Σ terms(y, N)``, remembering the argmin. The
work is ``Σ k_y · Π_{n∈N(y)} k_n``; a model that is a chain of blocks with residual edges
(GPT, U-Transformer, VGG) has induced width 2 or 3 (the residual stream, the tied
embedding), so every elimination is a min-plus product of small matrices — the min-plus
product over the block transfer of the issue, found by the elimination order rather than
written per model.

The two terms that couple every group are handled with certified bounds
(:class:`_Relaxation`):

* **fused gradient buckets** ``Σ_j α_j ⌈x_j⌉``: priced ``θ_j`` per chunk plus a usage
  charge ``μ_gj`` for each group whose strategy reduces anything over device group j, with
  ``θ_j + Σ_g μ_gj ≤ α_j`` (``⌈x⌉ ≥ x`` and ``⌈x⌉ ≥ 1`` once anything is reduced): first
  ``θ = α``, then the chunk a choice fills only partly is charged to its users;
* **the memory row** ``Σ mem ≤ M``: Lagrangian relaxation, ``min obj + λ (mem − M)``, with
  λ found by cutting planes on the dual (:func:`_lagrange`).

Every pass is exact for its prices, so its value is a lower bound and every feasible
minimiser an upper one. When they do not meet, min-marginals (a second, backward pass)
bound the best objective of any choice using each strategy, and only strategies whose
bound does not exceed the incumbent are kept (reduced-cost fixing by dynamic
programming). Over those, a branch and bound on the memory row and on which device groups
the buckets use (:class:`_BranchAndBound`) closes the Lagrangian and bucket gaps, and a
restriction of a few thousand choices is solved by evaluating them all
(:func:`_enumerated`); what neither closes goes on to the ILP, which proves the optimum
on the kept strategies (``ilp_planner.intra_op.solve_mesh.solve_mesh``).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from formulations.problem import Problem, chunk_count
from formulations.result import SolveResult, SolveStats

# largest elimination work (table entries summed over eliminations) attempted
MAX_WORK = 4e8
# above this many entries in one elimination table, strategies an incumbent rules out are
# dropped first (tied models on large meshes: width 3 with hundreds of strategies a group)
PRUNE_ABOVE = 1e7
# most passes of the λ search on a binding memory row (:func:`_lagrange`)
LAGRANGE_STEPS = 32
# relative gap below which the incumbent counts as proven optimal (float rounding)
EXACT = 1e-9


class NoFit(ValueError):
    """No choice meets the memory budget (a ValueError: the callers' infeasibility)."""


@dataclass(frozen=True)
class Elimination:
    """An elimination order of a group graph and its cost: ``work`` table entries computed
    over all eliminations, ``width`` the largest neighbourhood eliminated (induced width),
    ``peak`` the largest single table."""

    order: tuple[int, ...]
    work: float
    width: int
    peak: float = 0.0


def elimination_order(sizes: list[int], edges) -> Elimination:
    """Greedy min-work order: repeatedly eliminate the group whose elimination table
    ``k_y · Π k_N`` is smallest, ties broken by fewer fill-in edges. Exact for chains and
    trees (width 1) and finds the block-by-block order on residual chains."""
    adj: list[set[int]] = [set() for _ in sizes]
    for u, v in edges:
        if u != v:
            adj[u].add(v)
            adj[v].add(u)

    def key(y: int) -> tuple[float, int]:
        nbrs = adj[y]
        work = sizes[y] * math.prod(sizes[n] for n in nbrs)
        fill = sum(1 for a in nbrs for b in nbrs if a < b and b not in adj[a])
        return work, fill

    stamp = [0] * len(sizes)
    heap = [(*key(y), 0, y) for y in range(len(sizes))]
    heapq.heapify(heap)
    done = [False] * len(sizes)
    order: list[int] = []
    work, width, peak = 0.0, 0, 0.0
    while heap:
        w, _, st, y = heapq.heappop(heap)
        if done[y] or st != stamp[y]:
            continue
        done[y] = True
        order.append(y)
        work += w
        peak = max(peak, w)
        nbrs = adj[y]
        width = max(width, len(nbrs))
        for a in nbrs:
            adj[a].discard(y)
            adj[a] |= nbrs - {a}
        touched = set(nbrs)
        for a in nbrs:
            touched |= adj[a]
        for a in touched:
            if not done[a]:
                stamp[a] += 1
                heapq.heappush(heap, (*key(a), stamp[a], a))
        adj[y] = set()
    return Elimination(tuple(order), work, width, peak)


Input = tuple[tuple[int, ...], np.ndarray, "int | None"]  # (vars, table, producing step)


@dataclass
class _Step:
    """One elimination: group ``y`` minimised out of ``inputs`` (factors over
    ``scope ∪ {y}``, each with the step that produced it, None for the problem's own)."""

    y: int
    scope: tuple[int, ...]
    inputs: list[Input]

    @property
    def axes(self) -> list[int]:
        return [*self.scope, self.y]

    def total(self, sizes: list[int], extra: tuple[Input, ...] = (),
              at: dict[int, int] | None = None) -> np.ndarray:
        """Σ of the inputs (and ``extra`` factors) over ``scope + (y,)``, in one table;
        with ``at`` (a strategy per scope group), only its row over y.

        Factors whose groups are a subset of a larger factor's are first folded into it
        (small tables), so the full table is written by as few broadcast additions as
        there are maximal factors — usually one or two. The row is the same additions on
        the factors' rows, so its entries are bit-identical to the full table's."""
        axes = self.axes
        parts = self._parts(extra, at)
        if at is not None:
            out = np.zeros(1)
            for _, t in parts:
                out = out + t
            return np.broadcast_to(out, [sizes[self.y]])
        out = np.zeros([1] * len(axes))
        for vs, t in parts:
            term = _aligned(vs, t, axes)
            if np.broadcast_shapes(out.shape, term.shape) == out.shape:
                np.add(out, term, out=out)
            else:
                out = out + term
        return np.broadcast_to(out, [sizes[v] for v in axes])

    def _parts(self, extra: tuple[Input, ...] = (), at: dict[int, int] | None = None
               ) -> list[tuple[tuple[int, ...], np.ndarray]]:
        """The maximal factors, each with the smaller ones folded into it (their rows at
        ``at`` when given), in the order :meth:`total` adds them."""
        factors = [*self.inputs, *extra]
        parts: list[tuple[tuple[int, ...], np.ndarray]] = []
        for i, host in _fold_plan(tuple(f[0] for f in factors)):
            vars_, table = factors[i][0], np.asarray(factors[i][1], dtype=float)
            if at is not None:  # the row (1-d over y, or a scalar): broadcasts as it is
                piece = table[tuple(slice(None) if v == self.y else at[v] for v in vars_)]
            if host is None:
                parts.append((vars_, table if at is None else piece))
            else:
                vs, t = parts[host]
                parts[host] = (vs, t + (_aligned(vars_, table, vs) if at is None else piece))
        return parts

    def reduced(self, sizes: list[int]) -> np.ndarray:
        """``total(sizes).min(axis=-1)`` — the message this elimination sends — a slab
        of one scope axis at a time when the table is large. A treewidth-3 step of GPT-175B
        tied (25M entries, three pairwise factors) then adds the factors without that
        axis once, and per slab only the rest, in cache, instead of writing the whole
        table per factor. Entries are the same additions in the same order: bit-identical."""
        axes = self.axes
        shape = [sizes[v] for v in axes]
        if math.prod(shape) <= SLAB or not self.scope:
            return self.total(sizes).min(axis=-1)
        terms = [_aligned(vs, t, axes) for vs, t in self._parts()]
        # per scope axis, the first term spanning it: slab the axis that comes in last
        first = {a: next(i for i, t in enumerate(terms) if t.shape[a] > 1)
                 for a in range(len(self.scope)) if shape[a] > 1}
        if not first:
            return self.total(sizes).min(axis=-1)
        a = max(first, key=lambda x: (first[x], shape[x]))
        shared = np.zeros([1] * len(axes))
        for t in terms[: first[a]]:
            shared = shared + t
        out = np.empty(shape[:-1])
        width = max(1, SLAB * shape[a] // math.prod(shape))
        for lo in range(0, shape[a], width):
            cut = tuple(slice(lo, lo + width) if i == a else slice(None)
                        for i in range(len(axes)))
            acc = shared
            for t in terms[first[a]:]:
                acc = acc + (t[cut] if t.shape[a] > 1 else t)
            slab = [min(width, shape[a] - lo) if i == a else n for i, n in enumerate(shape)]
            out[cut[:-1]] = np.broadcast_to(acc, slab).min(axis=-1)
        return out


# entries a slab of :meth:`_Step.reduced` aims at (2 MiB: in cache; a slab is at least one
# index of its axis)
SLAB = 1 << 18


def minimise(unary: list[np.ndarray], edges: dict[tuple[int, int], np.ndarray],
             order: Elimination) -> tuple[float, list[int], list[_Step]]:
    """Exact ``min Σ_g unary[g][c_g] + Σ R_uv[c_u, c_v]``, a minimiser, and the
    eliminations (for :func:`min_marginals`), eliminating the groups in ``order``."""
    sizes = [len(u) for u in unary]
    factors: dict[int, Input] = {}
    touching: list[set[int]] = [set() for _ in unary]
    ids = itertools.count()

    def add(vars_: tuple[int, ...], table: np.ndarray, step: int | None) -> None:
        fid = next(ids)
        factors[fid] = (vars_, table, step)
        for v in vars_:
            touching[v].add(fid)

    for g, u in enumerate(unary):
        add((g,), np.asarray(u, dtype=float), None)
    for (u, v), r in edges.items():
        add((u, v), np.asarray(r, dtype=float), None)
    steps: list[_Step] = []
    constant = 0.0
    for y in order.order:
        fids = sorted(touching[y])
        inputs = [factors.pop(f) for f in fids]
        for f, (vars_, _, _) in zip(fids, inputs, strict=True):
            for v in vars_:
                touching[v].discard(f)
        scope = tuple(sorted({v for vars_, _, _ in inputs for v in vars_} - {y}))
        step = _Step(y, scope, inputs)
        reduced = step.reduced(sizes)
        steps.append(step)
        if scope:
            add(scope, reduced, len(steps) - 1)
        else:
            constant += float(reduced)
    # the argmins on the way back: each step's row at its scope's choice (cheaper than an
    # argmin over every table, and the same first minimum: the row is bit-identical)
    choice = [0] * len(unary)
    for step in reversed(steps):
        choice[step.y] = int(step.total(sizes, at={v: choice[v] for v in step.scope}).argmin())
    return constant, choice, steps


def min_marginals(steps: list[_Step], sizes: list[int]) -> list[np.ndarray]:
    """Per group g and strategy k, the least objective of any choice with ``c_g = k``
    (the two-pass junction-tree algorithm in min-sum: each elimination's clique, its
    inputs plus the message from outside, minimised over all but one group)."""
    marg: list[np.ndarray] = [np.empty(0)] * len(sizes)
    # a root (empty scope) closes one connected component; the others' optima are its outside
    roots = {i: float(step.total(sizes).min()) for i, step in enumerate(steps) if not step.scope}
    outside: dict[int, np.ndarray] = {i: np.asarray(sum(roots.values()) - v)
                                      for i, v in roots.items()}
    for i in reversed(range(len(steps))):
        step = steps[i]
        axes = step.axes
        total = step.total(sizes, ((step.scope, outside.pop(i), None),))
        marg[step.y] = total.min(axis=tuple(range(len(step.scope)))) if step.scope else total
        for vars_, table, child in step.inputs:
            if child is None:
                continue
            rest = total - _aligned(vars_, table, axes)
            drop = tuple(a for a, v in enumerate(axes) if v not in vars_)
            kept = [v for v in axes if v in vars_]
            outside[child] = np.transpose(rest.min(axis=drop), [kept.index(v) for v in vars_])
    return marg


def _aligned(vars_: tuple[int, ...], table: np.ndarray, axes) -> np.ndarray:
    """``table`` (one axis per var of ``vars_``) broadcastable against ``axes``."""
    perm, slots = _alignment(tuple(vars_), tuple(axes))
    moved = np.transpose(table, perm)
    return moved.reshape([1 if i < 0 else moved.shape[i] for i in slots])


@functools.lru_cache(maxsize=1 << 14)
def _alignment(vars_: tuple[int, ...], axes: tuple[int, ...]
               ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """How :func:`_aligned` moves a table over ``vars_`` onto ``axes``: the transpose,
    and per axis the moved table's axis of that size (-1: a unit axis). Every pass of
    every branch-and-bound node aligns the same few factors, so it is worked out once."""
    perm = tuple(sorted(range(len(vars_)), key=lambda i: axes.index(vars_[i])))
    moved = [vars_[i] for i in perm]
    return perm, tuple(moved.index(a) if a in moved else -1 for a in axes)


@functools.lru_cache(maxsize=1 << 14)
def _fold_plan(scopes: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, int | None], ...]:
    """How :meth:`_Step._parts` folds factors over ``scopes``: the factors by falling
    dimension (stable), each with the part it is folded into (the first earlier one whose
    groups hold its own) or None where it starts a part. Depends on the scopes alone, which
    every pass over one group graph repeats."""
    plan: list[tuple[int, int | None]] = []
    hosts: list[set[int]] = []
    for i in sorted(range(len(scopes)), key=lambda i: -len(scopes[i])):
        host = next((h for h, vs in enumerate(hosts) if set(scopes[i]) <= vs), None)
        if host is None:
            hosts.append(set(scopes[i]))
        plan.append((i, host))
    return tuple(plan)


def _merged_edges(problem: Problem) -> dict[tuple[int, int], np.ndarray]:
    """Edge matrices keyed (min, max): parallel edges summed, none left reversed."""
    out: dict[tuple[int, int], np.ndarray] = {}
    for (u, v), r in problem.edges.items():
        key, mat = ((u, v), r) if u < v else ((v, u), r.T)
        out[key] = out[key] + mat if key in out else np.array(mat, dtype=float)
    return out


@dataclass
class _Relaxation:
    """The separable relaxation the passes minimise: costs and edges exactly, each device
    group's bucket chunks priced ``theta[j]`` per chunk plus ``usage[g, j]`` when group g's
    strategy reduces anything over j, and memory at ``lam`` per byte. Any ``theta[j] +
    Σ_g usage[g, j] ≤ α_j`` (all ≥ 0) and ``lam ≥ 0`` give a lower bound: ⌈x_j⌉ is at least
    x_j and at least every usage indicator, and a feasible choice has mem ≤ M.

    ``used``: device groups every choice of interest reduces something over (a branch of
    :class:`_BranchAndBound`). For those ``⌈x_j⌉ ≥ max(1, x_j)``, so
    ``α_j ⌈x_j⌉ ≥ α_j + θ_j (x_j − 1)`` for any ``0 ≤ θ_j ≤ α_j``: the pass charges
    ``α_j − θ_j`` as a constant and ``θ_j`` per chunk, no usage prices — exact at
    ``θ_j = 0`` when the group reduces at most one chunk, the sum of first chunks the
    usage prices could only share out among a group's users."""

    problem: Problem
    edges: dict[tuple[int, int], np.ndarray]
    order: Elimination
    used: frozenset[int] = frozenset()
    passes: int = 0

    def __post_init__(self) -> None:
        b = self.problem.buckets
        self.alpha = np.zeros(0) if b is None else np.asarray(b.alpha, dtype=float)
        self.chunks = [np.zeros((len(c), 0)) if b is None else b.bytes[g] / b.cap
                       for g, c in enumerate(self.problem.cost)]
        self.uses = [(x > 0).astype(float) for x in self.chunks]

    def run(self, theta: np.ndarray, usage: np.ndarray, lam: float
            ) -> tuple[float, list[int], list[_Step]]:
        """The dual value (a lower bound), its minimiser and its eliminations."""
        self.passes += 1
        unary = [c + x @ theta + u @ usage[g] + lam * m for g, (c, x, u, m) in enumerate(zip(
            self.problem.cost, self.chunks, self.uses, self.problem.memory, strict=True))]
        value, choice, steps = minimise(unary, self.edges, self.order)
        first_chunks = sum(float(self.alpha[j] - theta[j]) for j in self.used)
        return (value + first_chunks - (lam * self.problem.memory_budget if lam else 0.0),
                choice, steps)

    def base_prices(self) -> tuple[np.ndarray, np.ndarray]:
        """The first prices: α per chunk, and for a ``used`` group its first chunk as a
        constant (θ = 0, exact up to one chunk)."""
        theta = self.alpha.copy()
        theta[list(self.used)] = 0.0
        return theta, np.zeros((len(self.chunks), len(theta)))

    def usage_prices(self, choice) -> tuple[np.ndarray, np.ndarray]:
        """Prices that charge a device group's first chunk to its users: where ``choice``
        reduces less than one chunk over group j, α_j is split evenly over the groups that
        use j instead of being paid per chunk (the relaxation priced that chunk at a
        fraction of α_j); elsewhere α_j per chunk. A ``used`` group keeps its constant
        first chunk (θ = 0) where ``choice`` reduces at most one chunk over it, else is
        charged α_j per chunk (θ = α)."""
        theta, usage = self.base_prices()
        used = np.array([u[k] for u, k in zip(self.uses, choice, strict=True)])
        x = sum(c[k] for c, k in zip(self.chunks, choice, strict=True))
        for j in self.used:
            theta[j] = self.alpha[j] if x[j] > 1 else 0.0
        for j in np.flatnonzero((x > 0) & (x < 1)):
            if j in self.used:
                continue
            users = used[:, j] > 0
            theta[j] = 0.0
            usage[users, j] = self.alpha[j] / users.sum()
        return theta, usage


@dataclass(frozen=True)
class EliminationResult:
    """``result``: the best feasible choice found, its proven lower bound and gap (status
    ``optimal`` when the gap is within the tolerance). ``keep``: when not optimal, per
    group the strategies whose min-marginal of the relaxation is at most the incumbent's
    objective — every choice using another strategy costs more than the incumbent, so the
    optimum lies in ``problem.subset(keep)`` (reduced-cost fixing by dynamic programming)."""

    result: SolveResult
    keep: list[np.ndarray] | None


# passes re-pricing under-charged bucket chunks (:meth:`_Relaxation.usage_prices`)
USAGE_ROUNDS = 3


def _index_in(keep: list[np.ndarray], choice) -> tuple[int, ...]:
    """``choice`` in the indices of ``problem.subset(keep)``."""
    return tuple(int(np.searchsorted(kk, k)) for kk, k in zip(keep, choice, strict=True))


def _lifted(keep: list[np.ndarray], choice) -> tuple[int, ...]:
    """A choice of ``problem.subset(keep)`` in ``problem``'s indices (:func:`_index_in`'s
    inverse)."""
    return tuple(int(kk[k]) for kk, k in zip(keep, choice, strict=True))


def _on_subset(problem: Problem, keep: list[np.ndarray], t0: float,
               inner: EliminationResult | None) -> EliminationResult | None:
    """``inner`` (solved on ``problem.subset(keep)``) in ``problem``'s indices."""
    if inner is None:
        return None
    res = inner.result
    dropped = sum(len(c) for c in problem.cost) - sum(map(len, keep))
    return EliminationResult(
        dataclasses.replace(res, choice=_lifted(keep, res.choice),
                            solve_s=time.perf_counter() - t0,
                            message=f"{res.message}; {dropped} of {sum(len(c) for c in problem.cost)}"
                                    f" strategies ruled out by the forest bound"),
        None if inner.keep is None else [keep[g][k] for g, k in enumerate(inner.keep)])


def _forest_unary(problem: Problem) -> list[np.ndarray]:
    """The strategies' costs with every bucket chunk priced α (the relaxation's unary)."""
    relax = _Relaxation(problem, {}, Elimination((), 0.0, 0))
    return [c + x @ relax.alpha for c, x in zip(problem.cost, relax.chunks, strict=True)]


def _forest(n: int, edges: dict[tuple[int, int], np.ndarray]
            ) -> tuple[dict[tuple[int, int], np.ndarray], float]:
    """The graph cut to a spanning forest: its edges, and the sum of the smallest entries
    of the edges outside it (the lightest), which the relaxation charges instead."""
    tree = _spanning_forest(n, edges)
    constant = sum(float(r.min()) for e, r in edges.items() if e not in tree)
    return {e: edges[e] for e in tree}, constant


def _forest_pass(unary: list[np.ndarray], edges: dict[tuple[int, int], np.ndarray]
                 ) -> tuple[float, list[_Step], float]:
    """The forest relaxation (:func:`_forest`) eliminated once: (its minimum, the
    eliminations, the constant of the replaced edges, part of the minimum)."""
    forest, constant = _forest(len(unary), edges)
    value, _, steps = minimise(unary, forest, elimination_order([len(x) for x in unary], forest))
    return value + constant, steps, constant


def relaxation_bound(problem: Problem) -> float:
    """A lower bound on every choice's objective (the memory row aside), cheap however
    many strategies a group has: :func:`bound_prune`'s relaxation minimised once."""
    return _forest_pass(_forest_unary(problem), _merged_edges(problem))[0]


def bound_prune(problem: Problem, upper: float) -> list[np.ndarray]:
    """Per group, the strategies whose lower bound does not exceed ``upper``, repeated
    until nothing more drops. The bound is exact on a relaxation: bucket chunks priced α
    each, and the problem's graph cut to a spanning forest by replacing the edges outside
    it (the lightest) with their smallest entry — a forest eliminates in k² per edge, so
    its min-marginals are cheap however many strategies a group has. No choice using a
    dropped strategy costs ``upper`` or less, so an optimum survives when ``upper`` is a
    feasible choice's objective."""
    unary = _forest_unary(problem)
    merged = _merged_edges(problem)
    keep = [np.arange(len(u)) for u in unary]
    while True:
        edges = {e: r[np.ix_(keep[e[0]], keep[e[1]])] for e, r in merged.items()}
        u = [x[k] for x, k in zip(unary, keep, strict=True)]
        _, steps, constant = _forest_pass(u, edges)
        marg = min_marginals(steps, [len(x) for x in u])
        limit = upper * (1 + EXACT) - constant
        new = [k[m <= limit] for k, m in zip(keep, marg, strict=True)]
        if sum(map(len, new)) == sum(map(len, keep)):
            return keep
        keep = new


def _forest_incumbent(problem: Problem) -> tuple[int, ...]:
    """A good feasible choice to prune a wide problem with, found cheaply: the relaxation
    of :func:`bound_prune` (the graph cut to a spanning forest) eliminates in k² per edge,
    and its minimisers — over the Lagrangian's λ where the memory row binds — are choices
    of the whole problem, priced exactly here. The prune is only as strong as this
    incumbent: on the tied GPT-175B on 1,024 devices it comes within 2.5 % of the optimum
    (21.55 s a step against 21.05 s) where local search stops at 39.5 s, and the
    elimination then runs on 40× fewer table entries (whose branch and bound closes the
    rest). Raises :class:`NoFit` when no choice meets the memory budget."""
    forest, _ = _forest(problem.num_groups, _merged_edges(problem))
    sizes = [len(c) for c in problem.cost]
    relax = _Relaxation(problem, forest, elimination_order(sizes, forest))
    theta, usage = relax.base_prices()
    lower, first, _ = relax.run(theta, usage, 0.0)
    if problem.feasible(first):
        return tuple(first)
    _, seen, _ = _lagrange(problem, lambda v: relax.run(theta, usage, v), lower, first)
    return min((tuple(c) for c in seen if problem.feasible(c)), key=problem.objective)


def _spanning_forest(n: int, edges: dict[tuple[int, int], np.ndarray]) -> set[tuple[int, int]]:
    """Kruskal on the edges by their spread (max − min): the edges kept matter most to
    which strategies win; the others are replaced by their minimum."""
    parent = list(range(n))

    def root(a: int) -> int:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    chosen: set[tuple[int, int]] = set()
    for e in sorted(edges, key=lambda e: -float(np.ptp(edges[e])) if edges[e].size else 0.0):
        a, b = root(e[0]), root(e[1])
        if a != b:
            parent[a] = b
            chosen.add(e)
    return chosen


def solve_elimination(problem: Problem, *, gap: float = 0.0, incumbents=(),
                      max_work: float = MAX_WORK,
                      prune_above: float = PRUNE_ABOVE,
                      node_solver: NodeSolver | None = None,
                      cutoff: float | None = None) -> EliminationResult | None:
    """Solve ``problem`` by variable elimination with relaxed bucket and memory terms.
    ``incumbents``: feasible choices (e.g. the tied optimum) the result may use when
    cheaper. When the elimination would take more than ``max_work`` table entries in all,
    or one table of more than ``prune_above`` entries, the strategies the best incumbent
    (these and :func:`_forest_incumbent`'s) rules out (:func:`bound_prune`) are dropped
    first; None is returned if it would still exceed
    ``max_work`` (too wide a graph: use the ILP). The incumbent
    counts as optimal when its relative gap is at most ``gap`` (or float rounding).
    ``node_solver``: solves the branch and bound's nodes that bucket rounding alone leaves
    open (:class:`_BranchAndBound`). Raises :class:`NoFit` when no choice meets the memory
    budget. ``cutoff``: no choice costing that much is wanted (a plan in hand elsewhere):
    once the proven bound reaches it, the search stops and returns it (status
    ``feasible``, every strategy kept) — the caller's sign to drop this problem; the dual
    stops there. ``incumbents`` may be a callable, called only if a bound is short of it."""
    t0 = time.perf_counter()
    edges = _merged_edges(problem)
    sizes = [len(c) for c in problem.cost]
    order = elimination_order(sizes, edges)
    wide = order.work > max_work or order.peak > prune_above
    incumbents = _feasible_incumbents(problem, incumbents) if wide else incumbents
    if wide:
        incumbents.append(_forest_incumbent(problem))
    if wide and incumbents:
        keep = bound_prune(problem, min(map(problem.objective, incumbents)))
        if sum(map(len, keep)) < sum(sizes):
            inside = [c for c in incumbents  # the best one always is; a worse one may not be
                      if all(np.isin(k, kk) for k, kk in zip(c, keep, strict=True))]
            return _on_subset(problem, keep, t0, solve_elimination(
                problem.subset(keep), gap=gap, max_work=max_work, prune_above=math.inf,
                incumbents=[_index_in(keep, c) for c in inside], node_solver=node_solver,
                cutoff=cutoff))
    if order.work > max_work:
        return None
    relax = _Relaxation(problem, edges, order)
    lower, seen, lam, steps = _dual(problem, relax, stop := math.inf if cutoff is None else cutoff)
    # from ``stop`` on it is dropped whatever the incumbents (the rounds only raise ``lower``)
    incumbents = _feasible_incumbents(problem, [] if lower >= stop else incumbents)
    best = min([*incumbents, *(tuple(c) for c in seen if problem.feasible(c))],
               key=problem.objective)
    best, lower, prices, steps = _usage_rounds(problem, relax, best, lower, lam, steps, gap,
                                               stop)
    objective = problem.objective(best)
    lower = min(lower, objective)
    rel = _rel_gap(problem, best, lower)
    search_s = time.perf_counter() - t0
    keep = None
    note = (f"elimination: width {order.width}, {order.work:.3g} table entries per pass, "
            f"{relax.passes} pass{'es' if relax.passes > 1 else ''}")
    passes = relax.passes
    if rel > max(gap, EXACT) and cutoff is not None and lower >= cutoff:
        keep = [np.arange(k) for k in sizes]  # the caller drops it: no keep to compute
    elif rel > max(gap, EXACT):
        if steps is None:
            steps = relax.run(*prices, lam)[2]
        slack = objective + EXACT * abs(objective) + (lam * problem.memory_budget if lam else 0.0)
        keep = [np.flatnonzero(m <= slack) for m in min_marginals(steps, sizes)]
        if lam or problem.buckets is not None or _space(keep) <= ENUMERATE_POINTS:
            # branch on the memory row and the buckets' device groups, or enumerate
            search = _BranchAndBound(problem.subset(keep), gap, node_solver, cutoff)
            found, proven = search.run(_index_in(keep, best))
            passes += search.passes
            note += _search_note(search, keep, proven)
            best = _lifted(keep, found)
            objective = problem.objective(best)
            lower = min(max(lower, proven if proven is not None else lower), objective)
            rel = _rel_gap(problem, best, lower)
            if proven is not None and rel <= max(gap, EXACT):
                keep = None
    stats = SolveStats(variables=sum(sizes), nodes=passes, search_s=search_s,
                       proof_s=time.perf_counter() - t0 - search_s,
                       note=note + "; nodes = elimination passes, proof = min-marginals")
    result = SolveResult("optimal" if keep is None else "feasible", objective, lower, rel, 0.0,
                         time.perf_counter() - t0, tuple(best), "elimination", note, stats)
    return EliminationResult(result, keep)


def _feasible_incumbents(problem: Problem, incumbents) -> list[tuple[int, ...]]:
    """The feasible ones of ``incumbents`` (a sequence, or a callable giving one)."""
    given = incumbents() if callable(incumbents) else incumbents
    return [tuple(c) for c in given if problem.feasible(c)]


def _rel_gap(problem: Problem, best, low: float) -> float:
    """The relative gap between ``best``'s objective and the lower bound ``low``."""
    return (problem.objective(best) - low) / max(abs(problem.objective(best)), 1e-30)


def _usage_rounds(problem: Problem, relax: _Relaxation, best: tuple, lower: float, lam,
                  steps, gap: float, stop: float = math.inf
                  ) -> tuple[tuple, float, tuple, object]:
    """With bucket terms, the dual bound tightened by pricing each bucket's usage at the
    last choice (up to :data:`USAGE_ROUNDS` rounds, while it rises and the gap is open):
    the best choice, the bound, the prices ``(theta, usage)`` and the steps that proved it
    (None: :func:`_dual`'s). No round once the bound reaches ``stop`` (a cutoff)."""
    prices = relax.base_prices()
    last = best
    for _ in range(USAGE_ROUNDS if problem.buckets is not None else 0):
        if _rel_gap(problem, best, lower) <= max(gap, EXACT) or lower >= stop:
            break
        tried = relax.usage_prices(last)
        value, last, run_steps = relax.run(*tried, lam)
        if problem.feasible(last) and problem.objective(last) < problem.objective(best):
            best = last
        if value <= lower:
            break
        lower, prices, steps = value, tried, run_steps
    return best, lower, prices, steps


def _search_note(search: _BranchAndBound, keep, proven: float | None) -> str:
    """What the search over the kept strategies did, for the result's message."""
    if _space(keep) <= ENUMERATE_POINTS:
        return f"; the {_space(keep)} kept choices enumerated"
    return (f"; branch and bound on the memory row and the buckets' device groups over the "
            f"kept strategies: {search.nodes} nodes ({search.splits} on a device group's use), "
            f"{search.passes} passes"
            + (f", {search.solved} solved by the ILP (bucket rounding alone open)"
               if search.solved else "")
            + ("" if proven is not None else " (stopped: the ILP proves the rest)"))


# most elimination passes :class:`_BranchAndBound` spends before leaving the proof to the ILP
BRANCH_PASSES = 400
# most open nodes below the incumbent :class:`_BranchAndBound` carries before leaving the
# proof to the ILP (:meth:`_BranchAndBound._piling_up`)
BRANCH_OPEN = 8
# solves a restriction to its gap: (a best choice, a proven lower bound on its objective),
# or None when it gives up; the restriction has a choice that fits
NodeSolver = Callable[[Problem], "tuple[tuple[int, ...], float] | None"]
# a restriction with at most this many choices is solved by evaluating every one of them
ENUMERATE_POINTS = 20_000
# a whole problem with at most this many choices is (:func:`enumerated_optimum`)
ENUMERATE_DIRECTLY = 65_536
# most groups with a choice to make that :func:`_enumerated` lays out as a grid's axes
# (numpy's limit is 64); more than a 2-choice group each would exceed ``ENUMERATE_DIRECTLY``
GRID_AXES = 16
# :func:`_enumerated` gathers by index arrays up to this many choices (fewer numpy calls)
BY_INDEX_UP_TO = 4_096


def _space(allowed) -> int:
    return math.prod(len(a) for a in allowed)


def _enumerated(problem: Problem, limit: int | None = None) -> tuple[int, ...] | None:
    """The exact optimum of a small problem (at most ``limit`` choices, by default
    ``ENUMERATE_POINTS``), bucket rounding and memory row included, by evaluating every
    choice at once; None when no choice fits. The kept strategies of a stage solve are
    often a handful of choices whose only open question is the buckets' rounding: this
    settles it without an ILP. Ties go to the first choice in index order."""
    sizes = [len(c) for c in problem.cost]
    n = math.prod(sizes)
    limit = ENUMERATE_POINTS if limit is None else limit
    if n > limit:
        raise ValueError(f"{n} choices exceed {limit}")
    free = [g for g, k in enumerate(sizes) if k > 1]
    if len(free) > GRID_AXES or n <= BY_INDEX_UP_TO:
        return _enumerated_by_index(problem, sizes, free, n)
    # a grid with an axis per group with a choice to make (the rest fixed at their one
    # strategy): every term is added by broadcasting, each sum growing only over the axes
    # its terms span, with no index arrays to gather by
    axis = {g: i for i, g in enumerate(free)}
    shape = tuple(sizes[g] for g in free)

    def along(groups: tuple[int, ...], table: np.ndarray) -> np.ndarray:
        """``table`` (one dimension per group in ``groups``) on the grid's axes."""
        for d in reversed(range(len(groups))):
            if groups[d] not in axis:  # a fixed group: its one strategy
                table = np.take(table, 0, axis=d)
        kept = [g for g in groups if g in axis]
        if not kept:  # a number
            return np.asarray(table)
        if len(kept) == 2 and axis[kept[0]] > axis[kept[1]]:
            table, kept = table.T, kept[::-1]
        dims = [1] * len(shape)
        for g in kept:
            dims[axis[g]] = sizes[g]
        return np.reshape(table, dims)

    terms = [along((g,), c) for g, c in enumerate(problem.cost)]
    terms += [along((u, v), r) for (u, v), r in problem.edges.items()]
    # the fixed groups' terms are numbers: summed first, added to the grid once
    value = np.full(shape, float(sum(t for t in terms if t.ndim == 0)))
    for t in terms:
        if t.ndim:
            value += t
    b = problem.buckets
    if b is not None:
        for j, alpha in enumerate(b.alpha):
            total = sum((along((g,), x[:, j]) for g, x in enumerate(b.bytes) if x[:, j].any()),
                        np.zeros(()))
            value += alpha * chunk_count(total, b.cap)
    if problem.memory_budget is not None:
        memory = sum(along((g,), m) for g, m in enumerate(problem.memory))
        value = np.where(memory <= problem.memory_budget * (1 + 1e-9), value, np.inf)
    best = int(np.argmin(value))
    if not np.isfinite(value.flat[best]):
        return None
    choice = [0] * len(sizes)
    for g, k in zip(free, np.unravel_index(best, shape), strict=True):
        choice[g] = int(k)
    return tuple(choice)


def _enumerated_by_index(problem: Problem, sizes: list[int], free: list[int], n: int
                         ) -> tuple[int, ...] | None:
    """:func:`_enumerated` with more groups to choose than a grid has axes: an index array
    per group with a choice to make, the rest fixed at their one strategy."""
    grid: list[np.ndarray | int] = [0] * len(sizes)
    if free:
        for g, k in zip(free, np.unravel_index(np.arange(n), [sizes[g] for g in free]),
                        strict=True):
            grid[g] = k
    value = np.zeros(n) + sum(c[k] for c, k in zip(problem.cost, grid, strict=True))
    value = value + sum(r[grid[u], grid[v]] for (u, v), r in problem.edges.items())
    b = problem.buckets
    if b is not None:
        value = value + b.seconds(sum(x[k] for x, k in zip(b.bytes, grid, strict=True)))
    if problem.memory_budget is not None:
        memory = sum(m[k] for m, k in zip(problem.memory, grid, strict=True))
        value = np.where(memory <= problem.memory_budget * (1 + 1e-9), value, np.inf)
    best = int(np.argmin(value))
    if not np.isfinite(value[best]):
        return None
    return tuple(int(k[best]) if isinstance(k, np.ndarray) else 0 for k in grid)


def enumerated_optimum(problem: Problem) -> tuple[tuple[int, ...], float] | None:
    """The exact optimum of a problem of at most ``ENUMERATE_DIRECTLY`` choices, found by
    evaluating them all (:func:`_enumerated`): the choice and its objective; None where it
    has more. Raises :class:`NoFit` when no choice meets the memory budget. A baseline
    member (a few strategies per op) is often such a problem: :func:`solve_elimination`'s
    fixed work (the dual, the usage rounds, the min-marginals) costs it 1.5 – 5 ms where
    evaluating its choices takes a fraction of a millisecond up to about 50,000 of them."""
    if _space(problem.cost) > ENUMERATE_DIRECTLY:
        return None
    found = _enumerated(problem, ENUMERATE_DIRECTLY)
    if found is None:
        raise NoFit("no choice meets the memory budget")
    return found, problem.objective(found)


@dataclass(frozen=True)
class _Node:
    """A restriction :class:`_BranchAndBound` bounds: the ``allowed`` strategies per group,
    and the device groups ``used`` — only choices reducing something over each of them are
    of interest here (the other choices lie in the sibling that forbids the group), so its
    bound need only hold for those. ``over``: the over-budget minimiser its passes met last
    (None when the bound's own minimiser fits); ``minimiser``: the choice of the pass that
    gave the bound. Choices in the problem's indices."""

    allowed: list[np.ndarray]
    used: frozenset[int] = frozenset()
    over: tuple[int, ...] | None = None
    minimiser: tuple[int, ...] | None = None


class _BranchAndBound:
    """Branch and bound on the memory row and on the device groups the gradient buckets
    use, bounded by the Lagrangian dual.

    The dual leaves a gap where the minimisers jump between extremes at the critical λ
    (every layer replicated, or every layer sharded). Splitting one group's strategies by
    memory — below the over-budget minimiser's, or not — removes that minimiser from one
    child and forces the other to save memory elsewhere, and each child's dual is again
    exact for its prices. Best-first by bound; a node closes when its bound is within the
    gap of the incumbent. On GPT-175B tied on 1,024 devices this proves the optimum within
    0.1 % in 7 nodes (77 passes, about 1 s) where SCIP took 39 s on the same kept
    strategies.

    Where a node's minimiser fits, what is left open is the buckets' rounding: a device
    group j whose gradients fill less than a chunk pays α_j for it, which the relaxation
    charges only in part (α_j per chunk, or shared among the layers that use j). Each
    choice either reduces nothing over j or pays at least α_j for it, so the node splits
    into a child without the strategies that reduce over j and a child where j is
    ``used``, whose first chunk is then a constant (:class:`_Relaxation`) — exact once
    every group the minimiser uses is decided and fills at most one chunk. VGG13 and
    ResNets on 64 devices, whose step is mostly such latencies (a few layers reduce over
    each of several groups), close this way in a few dozen passes where SCIP stopped at
    its time limit with a gap of 3 – 11 %.

    A node of at most ``ENUMERATE_POINTS`` choices is solved outright by evaluating them
    all (:func:`_enumerated`), bucket rounding included. A node whose minimiser fits with
    no device group left to split (several chunks per group: the rounding of ⌈x⌉ ≥ x)
    goes to ``node_solver``, which solves it outright (the ILP on the node's strategies:
    after memory splits a small fraction of the kept ones — GPT-175B tied at a zero gap:
    one node, 115 of the 1,256 kept strategies, where SCIP on all of them took 36 s).
    Without one, when it gives up, or when the node has groups marked ``used`` (its
    strategies, all the ILP would see, are its parent's: an untied ViT-B/16's node took
    SCIP longer than the whole kept problem warm-started), the search stops and
    :meth:`run` returns no bound (the ILP on every kept strategy, warm-started from the
    incumbent, proves the rest); so it does after ``BRANCH_PASSES`` passes. With a
    ``cutoff`` (a plan in hand elsewhere) it also stops once neither an open node nor the
    incumbent can go below it, returning that bound: the caller drops the problem."""

    def __init__(self, problem: Problem, gap: float, node_solver: NodeSolver | None = None,
                 cutoff: float | None = None):
        self.problem = problem
        self.gap = max(gap, EXACT)
        self.node_solver = node_solver
        self.cutoff = math.inf if cutoff is None else cutoff
        sizes = [len(c) for c in problem.cost]
        self.order = elimination_order(sizes, _merged_edges(problem))
        self.passes = 0
        self.nodes = 0
        self.solved = 0  # nodes the node solver closed
        self.splits = 0  # nodes split on a device group's use
        self.best: tuple[int, ...] = ()
        self.best_obj = math.inf
        self._heap: list[tuple[float, int, _Node]] = []
        self._ids = itertools.count()

    def run(self, incumbent: tuple[int, ...]) -> tuple[tuple[int, ...], float | None]:
        """The best choice found (at least as good as the feasible ``incumbent``) and a
        proven lower bound on every choice's objective, or None if the search stopped."""
        self._offer(tuple(incumbent))
        self._visit(_Node([np.arange(len(c)) for c in self.problem.cost]))
        floor = math.inf  # least bound of the nodes the node solver closed
        while self._heap:
            low, _, node = heapq.heappop(self._heap)
            if self.best_obj - low <= self.gap * abs(self.best_obj) or \
                    min(low, self.best_obj) >= self.cutoff:  # nothing below the cutoff
                return self.best, min(low, self.best_obj, floor)  # every open node ≥ this
            if _space(node.allowed) <= ENUMERATE_POINTS:  # solved outright: nothing open
                self.nodes += 1
                found = _enumerated(self.problem.subset(node.allowed))
                if found is not None:
                    self._offer(_lifted(node.allowed, found))
                continue
            if self.passes > BRANCH_PASSES or self._piling_up(low):
                return self.best, None
            if node.over is not None:
                self._split_memory(node)
                continue
            j = self._open_group(node)
            if j is not None:
                self._split_group(node, j)
                continue
            if self.node_solver is None or node.used:
                return self.best, None
            solved = self.node_solver(self.problem.subset(node.allowed))
            if solved is None:  # gave up (a time limit)
                return self.best, None
            self.nodes += 1
            self.solved += 1
            self._offer(_lifted(node.allowed, solved[0]))
            floor = min(floor, solved[1])
        return self.best, min(self.best_obj, floor)  # every node infeasible, closed or solved

    def _piling_up(self, low: float) -> bool:
        """Whether the open nodes the incumbent does not close (the one popped at ``low``
        among them) number more than :data:`BRANCH_OPEN`: the searches that close do so
        with a handful open, and past that the pile only grows until ``BRANCH_PASSES``
        are spent and the ILP proves the rest anyway. Counts only: deterministic."""
        limit = self.best_obj - self.gap * abs(self.best_obj)
        return (low < limit) + sum(1 for entry in self._heap if entry[0] < limit) > BRANCH_OPEN

    def _offer(self, choice: tuple[int, ...]) -> None:
        """Keep ``choice`` (the problem's indices) as the incumbent if it fits and is better."""
        p = self.problem
        if p.feasible(choice) and p.objective(choice) < self.best_obj:
            self.best, self.best_obj = choice, p.objective(choice)

    def _visit(self, node: _Node) -> None:
        """Bound ``node`` and queue it (a small one unbounded: it is enumerated when popped)."""
        if _space(node.allowed) <= ENUMERATE_POINTS:
            heapq.heappush(self._heap, (-math.inf, next(self._ids), node))
            return
        bound = self._bound(node)
        if bound is None:  # nothing allowed fits
            return
        low, fitting, bounded = bound
        for c in fitting:
            self._offer(c)
        heapq.heappush(self._heap, (low, next(self._ids), bounded))

    def _split_memory(self, node: _Node) -> None:
        """Children of ``node`` without, and with only, the strategies of one group using
        at least the memory the over-budget minimiser gives it: the group where that is
        most above the group's least."""
        p, allowed = self.problem, node.allowed
        self.nodes += 1
        mem = [p.memory[g][a] for g, a in enumerate(allowed)]
        idx = [int(np.searchsorted(a, k)) for a, k in zip(allowed, node.over, strict=True)]
        g = max(range(p.num_groups), key=lambda g: mem[g][idx[g]] - mem[g].min())
        cut = mem[g][idx[g]]
        for part in (allowed[g][mem[g] < cut], allowed[g][mem[g] >= cut]):
            self._visit(_Node([part if h == g else a for h, a in enumerate(allowed)],
                              node.used))

    def _open_group(self, node: _Node) -> int | None:
        """The device group not yet decided in ``node`` that its minimiser reduces over
        and whose chunks the relaxation undercharges most (``α_j (⌈x_j⌉ − x_j)``), or None."""
        b = self.problem.buckets
        if b is None or node.minimiser is None:
            return None
        x = b.totals(node.minimiser) / b.cap
        short = np.where(x > 0, b.alpha * (np.ceil(x - 1e-9) - x), -1.0)
        short[list(node.used)] = -1.0
        j = int(np.argmax(short))
        return j if short[j] > 0 else None

    def _split_group(self, node: _Node, j: int) -> None:
        """Children of ``node``: its strategies that reduce nothing over device group j
        (none where some group has no such strategy), and all of them with j ``used``."""
        self.nodes += 1
        self.splits += 1
        b = self.problem.buckets
        without = [a[b.bytes[g][a, j] == 0] for g, a in enumerate(node.allowed)]
        if all(len(a) for a in without):
            self._visit(_Node(without, node.used))
        self._visit(_Node(node.allowed, node.used | {j}))

    def _bound(self, node: _Node) -> tuple[float, list[tuple[int, ...]], _Node] | None:
        """The restriction ``node``: its dual bound, the fitting choices the passes met and
        the node with its minimisers; None when no allowed choice fits."""
        allowed = node.allowed
        sub = self.problem.subset(allowed)
        relax = _Relaxation(sub, _merged_edges(sub), self.order, node.used)
        try:
            lower, seen, lam, _ = _dual(sub, relax)
        except NoFit:
            self.passes += relax.passes
            return None
        last = at = seen[-1]
        for _ in range(USAGE_ROUNDS if sub.buckets is not None else 0):
            if not sub.feasible(last):
                break
            # the minimiser fits: what is left is the buckets' gap (first chunks underpriced)
            value, last, _ = relax.run(*relax.usage_prices(last), lam)
            seen.append(last)
            if value <= lower:
                break
            lower, at = value, last
        self.passes += relax.passes
        over = [c for c in seen if not sub.feasible(c)]
        return (lower, [_lifted(allowed, c) for c in seen if sub.feasible(c)],
                dataclasses.replace(node, over=_lifted(allowed, over[-1]) if over else None,
                                    minimiser=_lifted(allowed, at)))


def _dual(problem: Problem, relax: _Relaxation, stop: float = math.inf
          ) -> tuple[float, list[list[int]], float, list[_Step] | None]:
    """The memory row's Lagrangian bound at the base bucket prices
    (:meth:`_Relaxation.base_prices`): the pass at λ = 0, and where
    its minimiser does not fit, the dual's maximum (:func:`_lagrange`). Returns the bound,
    every minimiser met (the first included), the λ, and the eliminations of the λ = 0
    pass when that pass is the bound (else None). Raises :class:`NoFit` when no choice fits.
    The dual's search stops once its bound reaches ``stop`` (a cutoff: the caller drops the
    problem at any bound from there, and the bound only rises)."""
    theta, usage = relax.base_prices()
    lower, first, steps = relax.run(theta, usage, 0.0)
    if problem.feasible(first):
        return lower, [first], 0.0, steps
    lower, seen, lam = _lagrange(problem, lambda v: relax.run(theta, usage, v), lower, first,
                                 stop)
    return lower, [first, *seen], lam, None


def _lagrange(problem: Problem, relaxed, lower: float, first: list[int],
              stop: float = math.inf) -> tuple[float, list[list[int]], float]:
    """The best λ ≥ 0 for ``min obj + λ (mem − M)`` (``relaxed(λ)`` gives the dual value,
    a lower bound, and its minimiser; ``lower`` and ``first`` are those at λ = 0): the
    largest dual value seen (returned with its λ) and every minimiser met, the
    least-memory choice included.

    The dual is the lower envelope of one line per choice c, ``obj(c) + λ (mem(c) − M)``,
    and each pass returns the line of its minimiser. So λ is found by cutting planes
    (Kelley), starting from the λ = 0 minimiser's line and the least-memory choice's (a
    line sloping down): the next λ maximises the envelope of the lines met so far, an
    upper bound on the dual; when the pass there adds no lower line, that λ maximises the
    dual itself (exact; usually a few passes, where bisection spent its whole budget
    approaching the same kink). It stops early once the dual value reaches ``stop``."""
    least = [int(np.argmin(m)) for m in problem.memory]
    if not problem.feasible(least):
        raise NoFit("no choice meets the memory budget")
    budget = problem.memory_budget
    seen = [least]
    best_obj = problem.objective(least)
    best_lam = 0.0
    # (value at λ = 0, slope) of each minimiser met, and of the least-memory choice: its
    # line (true objective, at least its relaxed one) slopes down and bounds the dual
    # from above like any choice's, so the cutting planes start at once
    lines = [(lower, problem.memory_of(first) - budget),
             (best_obj, problem.memory_of(least) - budget)]

    def visit(lam: float) -> float:
        """The pass at ``lam``; returns its dual value."""
        nonlocal lower, best_obj, best_lam
        value, choice, _ = relaxed(lam)
        seen.append(choice)
        if value > lower:
            lower, best_lam = value, lam
        slope = problem.memory_of(choice) - budget
        lines.append((value - lam * slope, slope))
        if slope <= budget * 1e-9:
            best_obj = min(best_obj, problem.objective(choice))
        return value

    tol = 1e-9 * max(abs(best_obj), 1e-30)
    for _ in range(LAGRANGE_STEPS):
        if best_obj - lower <= tol or lower >= stop:
            break
        lam, envelope = _envelope_peak(lines)
        if envelope - visit(lam) <= tol:
            break
    return lower, seen, best_lam


def _envelope_peak(lines: list[tuple[float, float]]) -> tuple[float, float]:
    """The λ ≥ 0 maximising ``min_i a_i + s_i λ`` over ``lines`` ``(a_i, s_i)`` (one of
    them sloping down), and that maximum: at λ = 0 or where a rising and a falling line
    cross."""
    def envelope(lam: float) -> float:
        return min(a + s * lam for a, s in lines)

    candidates = [0.0] + [(a2 - a1) / (s1 - s2) for a1, s1 in lines if s1 > 0
                          for a2, s2 in lines if s2 <= 0 and s1 > s2]
    lam = max((c for c in candidates if c >= 0), key=envelope)
    return lam, envelope(lam)
