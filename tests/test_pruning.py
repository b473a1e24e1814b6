"""Dropping dominated strategies never changes the optimum (against brute force)."""

from __future__ import annotations

import numpy as np
import pytest

from formulations.problem import Problem, dominated_free
from formulations.sbp_search import exhaustive


def random_problem(rng: np.random.Generator, budget: bool) -> Problem:
    n = int(rng.integers(2, 6))
    sizes = [int(rng.integers(1, 5)) for _ in range(n)]
    # small integer grids make ties and dominance common
    cost = [rng.integers(0, 4, s).astype(float) for s in sizes]
    mem = [rng.integers(1, 4, s).astype(float) for s in sizes]
    edges = {}
    for v in range(1, n):
        for u in rng.choice(v, size=min(v, int(rng.integers(1, 3))), replace=False):
            edges[(int(u), v)] = rng.integers(0, 3, (sizes[u], sizes[v])).astype(float)
    lo, hi = sum(m.min() for m in mem), sum(m.max() for m in mem)
    return Problem([f"g{i}" for i in range(n)], cost, mem, edges,
                   float(rng.uniform(lo, hi)) if budget else None)


@pytest.mark.parametrize("budget", [False, True])
def test_pruned_problem_keeps_the_optimum(budget):
    rng = np.random.default_rng(7)
    dropped = 0
    for _ in range(60):
        p = random_problem(rng, budget)
        kept = dominated_free(p)
        assert all(len(k) >= 1 for k in kept)
        dropped += sum(len(c) - len(k) for c, k in zip(p.cost, kept, strict=True))
        best = exhaustive(p).objective
        assert exhaustive(p.subset(kept)).objective == pytest.approx(best, abs=1e-12)
    assert dropped > 0  # the instances do exercise pruning


def test_exact_duplicates_keep_one_and_a_dominated_strategy_goes():
    cost = [np.array([1.0, 1.0, 2.0]), np.array([0.0, 0.0])]
    mem = [np.array([1.0, 1.0, 1.0]), np.array([1.0, 2.0])]
    edges = {(0, 1): np.array([[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]])}
    kept = dominated_free(Problem(["a", "b"], cost, mem, edges))
    assert kept[0].tolist() == [0]
    assert kept[1].tolist() == [0]


def test_weakly_below_equals_the_all_pairs_comparison():
    """The column-block narrowing finds exactly the pairs the full k × k × columns
    comparison finds, ties and repeated rows included."""
    import numpy as np

    from formulations.problem import _weakly_below

    rng = np.random.default_rng(0)
    for k, cols in [(1, 1), (5, 3), (40, 100), (90, 260)]:
        f = rng.integers(0, 3, (k, cols)).astype(float)
        f[::3] = f[0]
        f[-1, 0] = np.inf  # an infinite entry is below itself too
        full = np.all(f[:, None, :] <= f[None, :, :] + 1e-15, axis=2)
        for budget in (1, 7, 1000, 1 << 20):  # one column at a time … all at once
            assert np.array_equal(_weakly_below(f, budget), full)
