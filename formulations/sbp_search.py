"""Searches kept beside the ILP (AutoDDL §4.6): exhaustive, random, Metropolis–Hastings,
coordinate descent with restarts, and an exact dynamic program for chains.

All work on a :class:`~formulations.problem.Problem` and return a
:class:`~formulations.result.SolveResult`. Memory is handled by a penalty: an over-budget
choice scores ``objective + U + penalty × excess``, with U an upper bound on any choice's
objective, so every infeasible choice scores worse than every feasible one and searches walk
back into the feasible region; the start point is the least-memory choice, which is feasible
whenever any is.

The chain DP is exact with a memory budget too: per strategy of the current group it keeps
the Pareto front of (cost, memory) of the best prefixes.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np

from formulations.problem import Problem
from formulations.result import SolveResult


class _Evaluator:
    """Incremental objective: per group, the edges touching it."""

    def __init__(self, problem: Problem):
        self.p = problem
        self.adj: list[list[tuple[int, np.ndarray, bool]]] = [[] for _ in problem.names]
        for (u, v), r in problem.edges.items():
            self.adj[u].append((v, r, True))
            self.adj[v].append((u, r, False))
        total_cost = sum(float(c.max()) for c in problem.cost) + sum(
            float(r.max()) for r in problem.edges.values())
        if problem.buckets is not None:
            total_cost += problem.buckets.upper_bound()
        mem_scale = max(float(m.max()) for m in problem.memory) or 1.0
        self.penalty = 10.0 * (total_cost + 1.0) / mem_scale
        # added to any over-budget score: above every feasible objective (costs are >= 0)
        self.infeasible = total_cost + 1.0

    def score(self, choice: np.ndarray) -> float:
        obj = self.p.objective(choice)
        if self.p.memory_budget is not None:
            excess = self.p.memory_of(choice) - self.p.memory_budget
            if excess > 0:
                obj += self.penalty * excess + self.infeasible
        return obj

    def local(self, choice: np.ndarray, g: int) -> np.ndarray:
        """Objective contribution of every strategy of g with the others fixed."""
        vals = self.p.cost[g].astype(float).copy()
        for other, r, outgoing in self.adj[g]:
            vals += r[:, choice[other]] if outgoing else r[choice[other], :]
        b = self.p.buckets
        if b is not None:
            others = b.totals(choice) - b.bytes[g][choice[g]]
            vals += b.seconds(others[None, :] + b.bytes[g])
        return vals

    def least_memory(self) -> np.ndarray:
        return np.array([int(np.argmin(m)) for m in self.p.memory])


def _result(problem: Problem, choice, method: str, t0: float, message: str = "") -> SolveResult:
    choice = tuple(int(c) for c in choice)
    feasible = problem.feasible(choice)
    return SolveResult("heuristic", problem.objective(choice), None, None, 0.0,
                       time.perf_counter() - t0, choice, method,
                       message or ("" if feasible else "no feasible choice found"))


def exhaustive(problem: Problem, max_points: int = 2_000_000) -> SolveResult:
    """Every combination (only when the space has at most ``max_points`` points).

    The prefixes (all groups but the last) are enumerated one by one; the last group's
    strategies are scored together as one numpy vector (its cost, the edges joining it to
    the prefix, its memory), so every point is still evaluated, ~k times faster."""
    t0 = time.perf_counter()
    sizes = [len(c) for c in problem.cost]
    space = math.prod(sizes)
    if space > max_points:
        raise ValueError(f"exhaustive search over {space:.3g} points exceeds the limit {max_points}")
    last = problem.num_groups - 1
    prefix_edges = {e: r for e, r in problem.edges.items() if last not in e}
    into_last = [(u, r) for (u, v), r in problem.edges.items() if v == last and u != last]
    out_of_last = [(v, r) for (u, v), r in problem.edges.items() if u == last and v != last]
    budget = problem.memory_budget
    best, best_choice = math.inf, None
    for prefix in itertools.product(*(range(s) for s in sizes[:last])):
        base = sum(float(problem.cost[g][k]) for g, k in enumerate(prefix))
        base += sum(float(r[prefix[u], prefix[v]]) for (u, v), r in prefix_edges.items())
        vals = base + problem.cost[last]
        if problem.buckets is not None:
            b = problem.buckets
            vals = vals + b.seconds(b.totals(prefix)[None, :] + b.bytes[last])
        for u, r in into_last:
            vals = vals + r[prefix[u], :]
        for v, r in out_of_last:
            vals = vals + r[:, prefix[v]]
        if budget is not None:
            mem = sum(float(problem.memory[g][k]) for g, k in enumerate(prefix)) + problem.memory[last]
            vals = np.where(mem <= budget * (1 + 1e-9), vals, math.inf)
        k = int(np.argmin(vals))
        if vals[k] < best:
            best, best_choice = float(vals[k]), (*prefix, k)
    if best_choice is None:
        raise ValueError("no choice satisfies the memory budget")
    res = _result(problem, best_choice, "exhaustive", t0)
    return SolveResult("optimal", res.objective, res.objective, 0.0, 0.0, res.solve_s,
                       res.choice, "exhaustive")


def random_search(problem: Problem, samples: int = 2000, seed: int = 0) -> SolveResult:
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    ev = _Evaluator(problem)
    best = ev.least_memory()
    best_score = ev.score(best)
    for _ in range(samples):
        cand = np.array([rng.integers(len(c)) for c in problem.cost])
        sc = ev.score(cand)
        if sc < best_score:
            best, best_score = cand, sc
    return _result(problem, best, "random", t0)


def metropolis_hastings(problem: Problem, iterations: int = 20000, seed: int = 0,
                        temperature: float | None = None) -> SolveResult:
    """Single-group proposals accepted with probability exp(−Δ/T); T starts at 5 % of the
    initial objective and cools geometrically to 0.1 % of it."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    ev = _Evaluator(problem)
    cur = ev.least_memory()
    cur_score = ev.score(cur)
    best, best_score = cur.copy(), cur_score
    t_start = temperature or max(0.05 * abs(cur_score), 1e-12)
    cool = (0.02) ** (1.0 / max(iterations, 1))
    temp = t_start
    for _ in range(iterations):
        g = int(rng.integers(problem.num_groups))
        k = int(rng.integers(len(problem.cost[g])))
        if k == cur[g]:
            continue
        cand = cur.copy()
        cand[g] = k
        sc = ev.score(cand)
        if sc <= cur_score or rng.random() < math.exp(-(sc - cur_score) / temp):
            cur, cur_score = cand, sc
            if sc < best_score:
                best, best_score = cand.copy(), sc
        temp *= cool
    return _result(problem, best, "metropolis_hastings", t0)


def coordinate_descent(problem: Problem, restarts: int = 8, seed: int = 0,
                       max_rounds: int = 100) -> SolveResult:
    """Each group in turn takes its best strategy given the others, until no group moves;
    restarted from the least-memory choice and from random points."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    ev = _Evaluator(problem)
    best, best_score = None, math.inf
    for r in range(restarts):
        cur = ev.least_memory() if r == 0 else np.array(
            [rng.integers(len(c)) for c in problem.cost])
        cur = _descend(ev, cur, rng, max_rounds)
        sc = ev.score(cur)
        if sc < best_score:
            best, best_score = cur.copy(), sc
    return _result(problem, best, "coordinate_descent", t0)


def _descend(ev: _Evaluator, cur: np.ndarray, rng: np.random.Generator,
             max_rounds: int) -> np.ndarray:
    problem = ev.p
    for _ in range(max_rounds):
        moved = False
        for g in rng.permutation(problem.num_groups):
            vals = ev.local(cur, g)
            if problem.memory_budget is not None:
                others = problem.memory_of(cur) - problem.memory[g][cur[g]]
                excess = others + problem.memory[g] - problem.memory_budget
                vals = vals + np.where(excess > 0, ev.penalty * excess + ev.infeasible, 0.0)
            k = int(np.argmin(vals))
            if vals[k] < vals[cur[g]] - 1e-15:
                cur[g] = k
                moved = True
        if not moved:
            break
    return cur


def chain_dp(problem: Problem) -> SolveResult:
    """Exact optimum of a chain (edges only between groups i and i+1), memory included."""
    if not problem.is_chain():
        raise ValueError("chain_dp needs a chain: every edge must join groups i and i+1")
    if problem.buckets is not None:
        raise ValueError("chain_dp is exact only without fused gradient buckets (their "
                         "latency couples every group); build the problem with grad_bucket_bytes=0")
    t0 = time.perf_counter()
    budget = problem.memory_budget
    n = problem.num_groups
    # fronts[k] = list of (cost, memory, choice tuple), Pareto-minimal, for prefixes ending in k
    fronts = [[(float(problem.cost[0][k]), float(problem.memory[0][k]), (k,))]
              for k in range(len(problem.cost[0]))]
    for g in range(1, n):
        r = problem.edges.get((g - 1, g))
        new = []
        for k in range(len(problem.cost[g])):
            cands = []
            for j, front in enumerate(fronts):
                step = float(problem.cost[g][k]) + (0.0 if r is None else float(r[j, k]))
                for c, m, ch in front:
                    mem = m + float(problem.memory[g][k])
                    if budget is None or mem <= budget * (1 + 1e-9):
                        cands.append((c + step, mem, ch + (k,)))
            new.append(_pareto(cands) if budget is not None else sorted(cands)[:1])
        fronts = new
    finals = [entry for front in fronts for entry in front]
    if not finals:
        raise ValueError("no choice satisfies the memory budget")
    cost, _, choice = min(finals)
    return SolveResult("optimal", problem.objective(choice), cost, 0.0, 0.0,
                       time.perf_counter() - t0, choice, "chain_dp")


def _pareto(cands: list[tuple[float, float, tuple]]) -> list[tuple[float, float, tuple]]:
    out: list[tuple[float, float, tuple]] = []
    best_mem = math.inf
    for c, m, ch in sorted(cands):
        if m < best_mem - 1e-12:
            out.append((c, m, ch))
            best_mem = m
    return out


SEARCHES = {
    "coordinate_descent": coordinate_descent,
    "metropolis_hastings": metropolis_hastings,
    "random": random_search,
}
