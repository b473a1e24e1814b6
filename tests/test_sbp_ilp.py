"""The intra-op SBP ILP (every MILP backend) against brute force, the chain DP and the
heuristic searches.

Random small problems (≤ 6 groups, ≤ 4 strategies, random DAG edges, random costs, edge
matrices and memory) are built directly as :class:`Problem` data, so the ILP's encoding
(one-hot, class-compressed edge linearisation, memory row) is checked against
:func:`exhaustive` on the very objective it claims to minimise. Budgets are drawn between
the least and the largest total memory so that the constraint binds on some instances.
Problems built from real graphs check the same equalities on realistic cost magnitudes
(seconds around 1e-6 … 1e-2) and the tying of repeated layers.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from formulations.problem import Problem
from formulations.sbp_ilp import DEFAULT_MILP, MILP_BACKENDS, SbpIlp
from formulations.sbp_search import (
    chain_dp,
    coordinate_descent,
    exhaustive,
    metropolis_hastings,
    random_search,
)
from ilp_planner.inputs import models
from ilp_planner.intra_op.problem import build_problem
from ilp_planner.intra_op.realise import realise
from ilp_planner.ir.cluster import Cluster, Link
from ilp_planner.lowering.cost_model import MemorySpec

N_RANDOM = 40
REL = 1e-9


def _matrix(rng: np.random.Generator, rows: int, cols: int, scale: float) -> np.ndarray:
    """A random resharding matrix: sometimes all zero, sometimes with repeated rows or
    columns (strategies with the same output or input layout), zero diagonal-ish entries."""
    kind = rng.integers(4)
    if kind == 0:
        return np.zeros((rows, cols))
    r = rng.uniform(0, scale, (rows, cols)) * (rng.random((rows, cols)) < 0.8)
    if kind == 2 and rows > 1:
        r[rng.integers(rows)] = r[0]
    if kind == 3 and cols > 1:
        r[:, rng.integers(cols)] = r[:, 0]
    return r


def random_problem(seed: int, *, chain: bool = False, budget: str | None = None,
                   scale: float = 1.0, max_groups: int = 6, max_k: int = 4) -> Problem:
    """``budget``: None (no memory row), ``"mid"`` (between least and largest total memory,
    so it binds sometimes) or ``"tight"`` (just above the least total memory)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, max_groups + 1))
    sizes = [int(rng.integers(1, max_k + 1)) for _ in range(n)]
    cost = [rng.uniform(0, scale, k) for k in sizes]
    memory = [rng.uniform(1.0, 10.0, k) for k in sizes]
    if chain:
        pairs = [(i, i + 1) for i in range(n - 1)]
    else:
        pairs = [(u, v) for u in range(n) for v in range(u + 1, n) if rng.random() < 0.45]
    edges = {(u, v): _matrix(rng, sizes[u], sizes[v], scale) for u, v in pairs}
    lo = sum(float(m.min()) for m in memory)
    hi = sum(float(m.max()) for m in memory)
    mem_budget = None
    if budget == "mid":
        mem_budget = lo + rng.uniform(0.0, 1.0) * (hi - lo)
    elif budget == "tight":
        mem_budget = lo + 0.05 * (hi - lo)
    return Problem([f"g{i}" for i in range(n)], cost, memory, edges, mem_budget)


def _close(a: float, b: float, rel: float = REL) -> bool:
    return math.isclose(a, b, rel_tol=rel, abs_tol=1e-12)


def _ilp(problem: Problem, backend: str = DEFAULT_MILP):
    res = SbpIlp(problem, backend).solve(time_limit_s=30)
    assert res is not None, f"{backend} found no solution on a feasible problem"
    return res


# -- ILP == brute force --------------------------------------------------------------------


def test_exhaustive_equals_a_naive_enumeration():
    """exhaustive() scores the last group as a vector; check it against one
    Problem.objective call per point."""
    for seed in range(500, 530):
        p = random_problem(seed, budget="mid" if seed % 2 else None)
        best = min((p.objective(c), c) for c in itertools.product(*(range(len(x)) for x in p.cost))
                   if p.feasible(c))
        res = exhaustive(p)
        assert _close(res.objective, best[0]) and p.feasible(res.choice), seed
    with pytest.raises(ValueError, match="exceeds the limit"):
        exhaustive(random_problem(1, max_groups=6), max_points=1)



@pytest.mark.parametrize("backend", MILP_BACKENDS)
@pytest.mark.parametrize("budget", [None, "mid"])
def test_ilp_matches_exhaustive_on_random_dags(budget, backend):
    binding = 0
    for seed in range(N_RANDOM):
        p = random_problem(seed, budget=budget)
        brute = exhaustive(p)
        res = _ilp(p, backend)
        assert res.status == "optimal" and res.gap == 0.0, (seed, res)
        assert p.feasible(res.choice), seed
        assert _close(res.objective, brute.objective), (seed, res.objective, brute.objective)
        assert _close(res.objective, p.objective(res.choice))
        if budget is not None:
            unconstrained = exhaustive(Problem(p.names, p.cost, p.memory, p.edges, None))
            binding += unconstrained.objective < brute.objective - 1e-12
    if budget is not None:
        assert binding >= 3, f"the memory budget bound on only {binding} of {N_RANDOM} instances"


@pytest.mark.parametrize("backend", MILP_BACKENDS)
def test_ilp_matches_exhaustive_with_tight_budget(backend):
    for seed in range(100, 120):
        p = random_problem(seed, budget="tight")
        brute = exhaustive(p)
        res = _ilp(p, backend)
        assert p.feasible(res.choice) and _close(res.objective, brute.objective), seed


def test_ilp_is_exact_on_a_real_graph():
    """A 3-layer MLP on a 1 × 4 mesh: real resharding matrices (many identical rows and
    columns, costs ~1e-6 s) and real memory."""
    g = models.mlp([64, 48, 32, 16], batch=16)
    gp = build_problem(g, small_cluster(1, 4), 1, 4, MemorySpec.preset("adam"), tie_layers=False)
    p = gp.problem
    assert math.prod(len(c) for c in p.cost) <= 200_000
    brute = exhaustive(p)
    res = _ilp(p)
    assert _close(res.objective, brute.objective)
    lo, hi = p.min_memory()[0], sum(float(m.max()) for m in p.memory)
    for frac in (0.0, 0.02, 0.2):
        q = Problem(p.names, p.cost, p.memory, p.edges, lo + frac * (hi - lo))
        brute, res = exhaustive(q), _ilp(q)
        assert q.feasible(res.choice) and _close(res.objective, brute.objective), frac


def _scip_objective(p: Problem) -> float:
    """The same problem in SCIP (OR-Tools), written independently: one e variable per
    strategy pair, no class compression, gap 0."""
    from ortools.linear_solver import pywraplp

    solver = pywraplp.Solver.CreateSolver("SCIP")
    solver.SetSolverSpecificParametersAsString("limits/gap = 0\nlimits/absgap = 0\n")
    upper = sum(float(c.max()) for c in p.cost) + sum(float(r.max()) for r in p.edges.values())
    scale = 1e6 / upper
    s = [[solver.BoolVar(f"s{g}_{k}") for k in range(len(c))] for g, c in enumerate(p.cost)]
    obj = solver.Objective()
    for g, c in enumerate(p.cost):
        solver.Add(sum(s[g]) == 1)
        for k, x in enumerate(c):
            obj.SetCoefficient(s[g][k], scale * float(x))
    for (u, v), r in p.edges.items():
        e = [[solver.NumVar(0, 1, f"e{u}_{v}_{a}_{b}") for b in range(r.shape[1])]
             for a in range(r.shape[0])]
        for a in range(r.shape[0]):
            solver.Add(sum(e[a]) == s[u][a])
            for b in range(r.shape[1]):
                obj.SetCoefficient(e[a][b], scale * float(r[a, b]))
        for b in range(r.shape[1]):
            solver.Add(sum(e[a][b] for a in range(r.shape[0])) == s[v][b])
    if p.memory_budget is not None:
        solver.Add(sum(float(m[k]) / p.memory_budget * s[g][k]
                       for g, m in enumerate(p.memory) for k in range(len(m))) <= 1)
    obj.SetMinimization()
    assert solver.Solve() == pywraplp.Solver.OPTIMAL
    return p.objective([int(np.argmax([x.solution_value() for x in row])) for row in s])


def test_ilp_matches_scip_on_a_real_tied_gpt():
    """Real magnitudes (seconds ~1e-3, memory ~1e9 bytes), a DAG with residual cycles and
    a binding memory budget: the class-compressed model (both backends) against SCIP on
    the uncompressed model."""
    cl = Cluster(1, 8, memory_bytes=16 * 2**30, peak_flops=312e12,
                 intra=Link.from_bandwidth(5, 2400), inter=Link.from_bandwidth(10, 100))
    g = models.gpt(hidden=1024, layers=4, heads=16, seq_len=1024, vocab=32768, batch=8,
                   dtype="float16")
    p = build_problem(g, cl, 1, 8, MemorySpec.preset("adam_mixed")).problem
    assert not p.is_chain()
    lo, hi = p.min_memory()[0], sum(float(m.max()) for m in p.memory)
    free = _ilp(Problem(p.names, p.cost, p.memory, p.edges, None)).objective
    for frac in (0.0, 0.01, 0.03):
        q = Problem(p.names, p.cost, p.memory, p.edges, lo + frac * (hi - lo))
        reference = _scip_objective(q)
        for backend in MILP_BACKENDS:
            res = _ilp(q, backend)
            assert q.feasible(res.choice)
            assert _close(res.objective, reference), (frac, backend)
        assert res.objective > free * (1 + 1e-6)  # the budget binds


def test_ilp_with_one_group_and_no_edges():
    p = Problem(["only"], [np.array([3.0, 1.0, 2.0])], [np.array([1.0, 5.0, 2.0])], {}, 2.5)
    res = _ilp(p)
    assert res.choice == (2,) and res.objective == 2.0


# -- the model's size, warm start, time limit and statistics -----------------------------


def _distinct(rows: np.ndarray) -> int:
    return len({tuple(float(x) for x in row) for row in rows})


def _expected_size(p: Problem) -> tuple[int, int, int]:
    """(variables, integer variables, constraints) of the ILP of ``p``, counted from the
    problem data: one binary per strategy, one e per (distinct row, distinct column) pair of
    each non-zero edge matrix, one integer z per device group some strategy reduces over;
    one row per group, per row class and column class of each edge, the memory row, one row
    per z."""
    binaries = sum(len(c) for c in p.cost)
    nonzero = [r for r in p.edges.values() if np.any(r)]
    edge_vars = sum(_distinct(r) * _distinct(r.T) for r in nonzero)
    zs = 0 if p.buckets is None else sum(
        any(np.any(b[:, j]) for b in p.buckets.bytes) for j in range(len(p.buckets.alpha)))
    rows = (p.num_groups + sum(_distinct(r) + _distinct(r.T) for r in nonzero)
            + (p.memory_budget is not None) + zs)
    return binaries + edge_vars + zs, binaries + zs, rows


def _gpt_problem(layers: int = 2, tie: bool = True, bucket_mb: float = 25.0) -> Problem:
    g = models.gpt(hidden=64, layers=layers, heads=4, seq_len=16, vocab=128, batch=4)
    return build_problem(g, small_cluster(2, 2), 2, 2, MemorySpec.preset("adam"), tie_layers=tie,
                         memory_budget=2**30, grad_bucket_bytes=bucket_mb * 2**20).problem


@pytest.mark.parametrize("backend", MILP_BACKENDS)
def test_stats_count_the_model_built(backend):
    problems = [random_problem(seed, budget="mid" if seed % 2 else None) for seed in range(6)]
    problems.append(_gpt_problem())
    assert problems[-1].buckets is not None and problems[-1].memory_budget is not None
    for p in problems:
        ilp = SbpIlp(p, backend)
        res = ilp.solve(time_limit_s=30, warm_start=coordinate_descent(p).choice)
        st = res.stats
        assert st is ilp.stats
        assert (st.variables, st.integer_variables, st.constraints) == _expected_size(p)
        assert st.nodes is not None and st.nodes >= 0
        assert st.build_s == pytest.approx(res.build_s) and st.build_s > 0
        assert st.search_s is not None and st.proof_s is not None
        assert st.search_s >= 0 and st.proof_s >= 0
        assert st.search_s + st.proof_s == pytest.approx(res.solve_s)
        assert (st.presolve_s is None) == (backend == "cbc")
        d = res.to_dict()["stats"]
        assert d["variables"] == st.variables and d["note"] == st.note


def test_warm_start_is_a_full_feasible_point():
    """The hint gives s, e and z of the choice: every row holds and the scaled objective is
    the choice's objective."""
    for p in [random_problem(seed, budget=None) for seed in range(10)] + [_gpt_problem()]:
        milp = SbpIlp(p).milp
        choice = coordinate_descent(p).choice
        x = milp.point(p, choice)
        act = milp.matrix @ x
        assert np.all(act >= milp.row_lower - 1e-9) and np.all(act <= milp.row_upper + 1e-9)
        assert np.all(x >= milp.lower) and np.all(x <= milp.upper)
        assert _close(float(milp.objective @ x) / milp.scale, p.objective(choice), 1e-9)


@pytest.mark.parametrize("backend", MILP_BACKENDS)
def test_time_limit_keeps_the_warm_start_or_returns_none(backend):
    """Stopped at once: with a warm start the result is ``feasible`` (never worse than the
    start, a bound and gap only if the solver had one) or proved optimal; without one, None
    or a solution; the stats are set either way."""
    p = _gpt_problem(layers=4, tie=False)
    warm = coordinate_descent(p).choice
    best = _ilp(p, backend).objective
    ilp = SbpIlp(p, backend)
    res = ilp.solve(time_limit_s=1e-3, warm_start=warm)
    assert res is not None and res.status in ("feasible", "optimal")
    assert res.objective <= p.objective(warm) * (1 + 1e-12)
    if res.status == "feasible":
        assert "time limit" in res.message
        assert (res.bound is None) == (res.gap is None)
        if res.bound is not None:
            assert res.bound <= best * (1 + 1e-9) and res.gap >= 0
    assert ilp.stats.variables == _expected_size(p)[0]
    cold = SbpIlp(p, backend)
    res = cold.solve(time_limit_s=1e-3)
    assert cold.stats is not None and cold.stats.variables == _expected_size(p)[0]
    if res is None:
        assert cold.stats.proof_s == 0.0 and cold.stats.search_s > 0


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="unknown MILP backend"):
        SbpIlp(random_problem(0), "glpk")


# -- chain DP == ILP ---------------------------------------------------------------------


@pytest.mark.parametrize("budget", [None, "mid", "tight"])
def test_chain_dp_matches_ilp(budget):
    for seed in range(200, 200 + N_RANDOM // 2):
        p = random_problem(seed, chain=True, budget=budget, max_groups=8, max_k=5)
        assert p.is_chain()
        dp, res = chain_dp(p), _ilp(p)
        assert p.feasible(dp.choice)
        assert _close(dp.objective, res.objective), (seed, dp.objective, res.objective)
        assert _close(dp.objective, p.objective(dp.choice))


def test_chain_dp_rejects_a_dag():
    p = Problem(["a", "b", "c"], [np.ones(2)] * 3, [np.ones(2)] * 3,
                {(0, 2): np.ones((2, 2))})
    assert not p.is_chain()
    with pytest.raises(ValueError, match="chain"):
        chain_dp(p)


def test_mlp_problem_is_a_chain_and_dp_is_exact():
    g = models.mlp([128, 64, 64, 32, 16], batch=32)
    gp = build_problem(g, small_cluster(2, 4), 2, 4, MemorySpec.preset("adam"), tie_layers=False)
    p = gp.problem
    assert p.is_chain() and p.num_groups == 4
    assert _close(chain_dp(p).objective, _ilp(p).objective)


# -- heuristics -------------------------------------------------------------------------

HEURISTICS = {
    "random": lambda p: random_search(p, samples=300, seed=1),
    "metropolis_hastings": lambda p: metropolis_hastings(p, iterations=1500, seed=1),
    "coordinate_descent": lambda p: coordinate_descent(p, restarts=4, seed=1),
}


@pytest.mark.parametrize("name", sorted(HEURISTICS))
@pytest.mark.parametrize("budget,scale", [(None, 1.0), ("mid", 1.0), ("tight", 1.0),
                                          ("tight", 50.0)])
def test_heuristics_are_feasible_and_no_better_than_the_ilp(name, budget, scale):
    """Costs of 50 per group make objectives differ by far more than one unit, so an
    infeasible choice must lose to every feasible one whatever the cost scale."""
    for seed in range(300, 300 + N_RANDOM // 2):
        p = random_problem(seed, budget=budget, scale=scale)
        opt = _ilp(p).objective
        res = HEURISTICS[name](p)
        assert p.feasible(res.choice), (seed, res.message)
        assert res.message == ""
        assert _close(res.objective, p.objective(res.choice))
        assert res.objective >= opt * (1 - 1e-9) - 1e-12, (seed, res.objective, opt)


def test_coordinate_descent_finds_the_optimum_of_an_easy_chain():
    # no edges: each group independently takes its cheapest strategy
    rng = np.random.default_rng(7)
    cost = [rng.uniform(0, 1, 4) for _ in range(5)]
    p = Problem([f"g{i}" for i in range(5)], cost, [np.ones(4)] * 5, {})
    assert coordinate_descent(p).objective == pytest.approx(sum(c.min() for c in cost))


# -- tying --------------------------------------------------------------------------------


def small_cluster(nodes: int, local: int) -> Cluster:
    return Cluster(nodes, local, memory_bytes=16 * 2**30, peak_flops=1e13,
                   intra=Link.from_bandwidth(5, 800), inter=Link.from_bandwidth(10, 50))


def test_tied_layers_share_strategies():
    g = models.gpt(hidden=64, layers=3, heads=4, seq_len=16, vocab=128, batch=4)
    cluster = small_cluster(2, 2)
    gp = build_problem(g, cluster, 2, 2, MemorySpec.preset("adam"), tie_layers=True)
    untied = build_problem(g, cluster, 2, 2, MemorySpec.preset("adam"), tie_layers=False)
    assert gp.problem.num_groups < untied.problem.num_groups
    res = _ilp(gp.problem)
    layers, cost = realise(gp, list(res.choice))
    by_name = {layer.name: layer for layer in layers}
    suffixes = [name[len("h.0."):] for name in by_name if name.startswith("h.0.")]
    assert "attn.qkv" in suffixes and "mlp.fc2" in suffixes and "ln1" in suffixes
    for x in suffixes:
        ref = by_name[f"h.0.{x}"]
        for i in (1, 2):
            other = by_name[f"h.{i}.{x}"]
            assert other.strategy.replace(f"h.{i}.", "h.0.") == ref.strategy, x
            assert other.output == ref.output and other.inputs == ref.inputs, x
    assert _close(cost.total_s, res.objective)
    # tying restricts the space: the untied optimum is no worse
    assert _ilp(untied.problem).objective <= res.objective * (1 + 1e-9)


def test_followers_choose_how_partial_sums_are_reduced():
    """A follower reading partial sums takes them reduce-scattered or all-reduced, and the
    ILP chooses. Row-parallel MLP on 1 × 4: its loss reads the logits all-reduced (no
    collective in the loss), strictly cheaper than the reduce-scattered (vocabulary-
    parallel) logits that were the only option before; ILP = exhaustive on both spaces."""
    from ilp_planner.intra_op.baselines import restrict
    from ilp_planner.lowering.strategies import partial_resolutions, resolve_partial
    from ilp_planner.testing import three_d_filter

    g = models.mlp([32, 64, 64, 16], batch=32, bias=True)
    gp = build_problem(g, small_cluster(1, 4), 1, 4, MemorySpec.preset("adam"), tie_layers=False)
    sub, allowed = restrict(gp, three_d_filter((1, 1, 4)))
    loss_node = gp.owner["loss"]
    opts = [gp.options[loss_node][k] for k in allowed[gp.group_of[loss_node]]]
    pos = gp.position["loss"]
    fc3 = g["fc3"].output
    assert {o.inputs[pos][0] for o in opts} == {r for o in opts
                                                for r in partial_resolutions(o.outputs[0], fc3)}

    def fixed_rule(node: str, k: int) -> bool:  # every follower reduce-scattered where it can
        o = gp.options[node][k]
        members = gp.members[node]
        return all(o.inputs[i][0] == resolve_partial(o.outputs[members.index(g[f].inputs[0])],
                                                     g[g[f].inputs[0]].output)
                   for i, f in enumerate(members) if i)

    old = [np.array([k for k in idx if fixed_rule(gp.groups[j][0], int(k))])
           for j, idx in enumerate(allowed)]
    old_sub = gp.problem.subset(old)
    new, before = _ilp(sub), _ilp(old_sub)
    assert _close(new.objective, exhaustive(sub).objective)
    assert _close(before.objective, exhaustive(old_sub).objective)
    assert new.objective < before.objective
    j = gp.group_of[loss_node]
    chosen = gp.options[loss_node][int(allowed[j][new.choice[j]])]
    assert chosen.inputs[pos][0].split_degree(1) == 1  # the logits all-reduced: classes whole
