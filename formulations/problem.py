"""The intra-op problem as solver data: groups with one cost and one memory figure per
strategy, edges with resharding cost matrices, fused gradient-bucket terms (:class:`Problem`,
:class:`BucketTerms`), and the dominance pruning every solver path shares
(:func:`dominated_free`). Built from a layer graph by :mod:`ilp_planner.intra_op.problem`;
solved by :mod:`formulations.elimination`, :mod:`formulations.sbp_ilp` and
:mod:`formulations.sbp_search`."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def chunk_count(total_bytes, cap: float):
    """⌈bytes / cap⌉ chunks (at least one for any gradient, none for none); works on numpy
    arrays too, so the ILP's objective and the runtime use one rounding."""
    n = np.maximum(np.ceil(np.asarray(total_bytes, dtype=float) / cap - 1e-9), 1)
    return np.where(np.asarray(total_bytes) > 0, n, 0)


@dataclass
class BucketTerms:
    """Fused weight-gradient AllReduces: per device group j (a partition of the mesh),
    ``alpha[j]`` seconds of latency per collective; per problem group g, ``bytes[g][k, j]``
    the gradient bytes strategy k reduces over j; ``cap`` bytes per chunk."""

    alpha: np.ndarray
    bytes: list[np.ndarray]
    cap: float

    def totals(self, choice) -> np.ndarray:
        return sum((self.bytes[g][k] for g, k in enumerate(choice)), np.zeros(len(self.alpha)))

    def seconds(self, totals: np.ndarray) -> np.ndarray:
        """Latency of ``totals`` (…, J) bytes per device group, summed over the groups."""
        return chunk_count(np.asarray(totals), self.cap) @ self.alpha

    def upper_bound(self) -> float:
        """The most latency any choice pays (every group's largest bytes at once)."""
        return float(self.seconds(sum(b.max(axis=0) for b in self.bytes)))
@dataclass
class Problem:
    """Solver-ready data. ``cost[g][k]``, ``memory[g][k]``; ``edges[(u, v)] = R`` with
    ``R.shape == (len(cost[u]), len(cost[v]))``; ``memory_budget`` may be None."""

    names: list[str]
    cost: list[np.ndarray]
    memory: list[np.ndarray]
    edges: dict[tuple[int, int], np.ndarray]
    memory_budget: float | None = None
    buckets: BucketTerms | None = None

    def __post_init__(self) -> None:
        for g, (c, m) in enumerate(zip(self.cost, self.memory, strict=True)):
            if len(c) == 0 or len(c) != len(m):
                raise ValueError(f"group {self.names[g]!r}: {len(c)} costs, {len(m)} memories")
        for (u, v), r in self.edges.items():
            if r.shape != (len(self.cost[u]), len(self.cost[v])):
                raise ValueError(f"edge {self.names[u]}->{self.names[v]}: matrix {r.shape}")

    @property
    def num_groups(self) -> int:
        return len(self.names)

    def objective(self, choice: np.ndarray | list[int]) -> float:
        total = sum(float(self.cost[g][k]) for g, k in enumerate(choice))
        total += sum(float(r[choice[u], choice[v]]) for (u, v), r in self.edges.items())
        if self.buckets is not None:
            total += float(self.buckets.seconds(self.buckets.totals(choice)))
        return total

    def memory_of(self, choice: np.ndarray | list[int]) -> float:
        return sum(float(self.memory[g][k]) for g, k in enumerate(choice))

    def feasible(self, choice: np.ndarray | list[int]) -> bool:
        return self.memory_budget is None or self.memory_of(choice) <= self.memory_budget * (1 + 1e-9)

    def min_memory(self) -> tuple[float, int]:
        """Smallest memory any choice needs, and the group contributing most to it."""
        mins = [float(m.min()) for m in self.memory]
        return sum(mins), int(np.argmax(mins))

    def is_chain(self) -> bool:
        """Edges only between consecutive groups (i, i+1)."""
        return all(v == u + 1 for (u, v) in self.edges)

    def subset(self, allowed: list[np.ndarray]) -> Problem:
        """The problem keeping only strategies ``allowed[g]`` of each group g."""
        return Problem(
            list(self.names),
            [self.cost[g][a] for g, a in enumerate(allowed)],
            [self.memory[g][a] for g, a in enumerate(allowed)],
            {(u, v): r[np.ix_(allowed[u], allowed[v])] for (u, v), r in self.edges.items()},
            self.memory_budget,
            None if self.buckets is None else BucketTerms(
                self.buckets.alpha, [b[a] for b, a in zip(self.buckets.bytes, allowed, strict=True)],
                self.buckets.cap),
        )
def dominated_free(problem: Problem) -> list[np.ndarray]:
    """Per group, the strategies not dominated in every cost term.

    Strategy k of group g is dropped when another strategy l has cost, memory, gradient
    bytes per bucket group and every resharding cost to and from every neighbour strategy
    no larger (and, for exact ties, a lower index): swapping k for l in any choice never
    raises the objective or the memory, so the optimum survives. Vectorised over all pairs
    of one group."""
    features: list[list[np.ndarray]] = [[c[:, None], m[:, None]]
                                        for c, m in zip(problem.cost, problem.memory, strict=True)]
    if problem.buckets is not None:
        for g, b in enumerate(problem.buckets.bytes):
            features[g].append(b)
    for (u, v), r in problem.edges.items():
        features[u].append(r)
        features[v].append(r.T)
    kept = []
    for feats in features:
        le = _weakly_below(np.hstack(feats))
        eq = le & le.T
        k = len(le)
        idx = np.arange(k)
        strictly = le & ~eq
        earlier_equal = eq & (idx[:, None] < idx[None, :])
        dominated = np.any(strictly | earlier_equal, axis=0)
        kept.append(np.flatnonzero(~dominated))
    return kept
def _weakly_below(f: np.ndarray, budget: int = 1 << 13) -> np.ndarray:
    """``le[l, k]``: row l of ``f`` is at most row k (+1e-15) in every column. The first
    columns (cost and memory first) are compared for all pairs at once, one k × k
    comparison each, while most pairs survive; then the candidate pairs are narrowed
    column block by column block, since most fail early — a group with hundreds of
    strategies and thousands of edge columns would otherwise need a k × k × columns
    array. Blocks widen as the pairs thin out, so each step compares about ``budget``
    numbers; the pairs left at the end do not depend on the blocking. The diagonal (a
    row is below itself) is set at the end, not carried through every block."""
    k, width = f.shape
    le = np.ones((k, k), dtype=bool)
    np.fill_diagonal(le, False)
    start = 0
    while start < width:
        col = f[:, start]
        le &= col[:, None] <= col[None, :] + 1e-15
        start += 1
        if start >= 2 and np.count_nonzero(le) * 8 < k * k:
            break
    ls, ks = np.nonzero(le)
    while start < width and len(ls):
        block = max(1, min(width - start, budget // len(ls)))
        cols = f[:, start:start + block]
        ok = np.all(cols[ls] <= cols[ks] + 1e-15, axis=1)
        ls, ks = ls[ok], ks[ok]
        start += block
    le = np.eye(k, dtype=bool)
    le[ls, ks] = True
    return le
