"""The exact elimination solver against brute force and the plain ILP.

Variable elimination must return the exact minimum of unary + pairwise terms and exact
min-marginals (checked by enumeration); with bucket and memory terms it must return a true
lower bound and an incumbent, and the strategies it keeps must contain an optimum, so that
``solve_mesh`` (elimination, then the ILP on what the bound keeps) equals the ILP alone on
random problems and on problems built from real graphs, tied and untied, with fused
gradient buckets, binding memory budgets and pipeline-stage boundaries.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_sbp_ilp import random_problem

from formulations import elimination
from formulations.elimination import (
    NoFit,
    _BranchAndBound,
    _enumerated,
    _lagrange,
    _merged_edges,
    _Relaxation,
    bound_prune,
    elimination_order,
    enumerated_optimum,
    min_marginals,
    minimise,
    solve_elimination,
)
from formulations.problem import BucketTerms, Problem
from formulations.sbp_search import exhaustive
from ilp_planner.inputs.config import parse_config
from ilp_planner.inter_op.layer_units import subgraph
from ilp_planner.intra_op.request import MeshSolveRequest
from ilp_planner.intra_op.solve_mesh import solve_mesh
from ilp_planner.lowering.stage_boundary import stage_boundary

REL = 1e-9


def _pairwise(problem: Problem, choice) -> float:
    return (sum(float(problem.cost[g][k]) for g, k in enumerate(choice))
            + sum(float(r[choice[u], choice[v]]) for (u, v), r in problem.edges.items()))


@pytest.mark.parametrize("seed", range(25))
def test_minimise_and_min_marginals_equal_enumeration(seed):
    p = random_problem(seed, max_groups=6, max_k=3)
    sizes = [len(c) for c in p.cost]
    value, choice, steps = minimise(p.cost, p.edges, elimination_order(sizes, p.edges))
    marg = min_marginals(steps, sizes)
    best: dict[tuple[int, int], float] = {}
    for c in itertools.product(*(range(k) for k in sizes)):
        obj = _pairwise(p, c)
        for g, k in enumerate(c):
            best[g, k] = min(best.get((g, k), math.inf), obj)
    assert math.isclose(value, min(best.values()), rel_tol=REL, abs_tol=1e-12)
    assert math.isclose(_pairwise(p, choice), value, rel_tol=REL, abs_tol=1e-12)
    for (g, k), v in best.items():
        assert math.isclose(marg[g][k], v, rel_tol=REL, abs_tol=1e-12), (g, k)


@pytest.mark.parametrize("seed", range(12))
def test_messages_by_slabs_are_the_whole_tables_minimised(seed, monkeypatch):
    """``_Step.reduced`` (slab by slab along one scope axis) equals the whole table's
    minimum bit for bit, on dense random factor graphs (cliques of 3-5 groups, unary and
    pairwise factors, some groups of one strategy)."""
    rng = np.random.default_rng(seed)
    monkeypatch.setattr(elimination, "SLAB", int(rng.integers(1, 5)))
    groups = int(rng.integers(3, 6))
    sizes = [int(rng.integers(1, 7)) for _ in range(groups - 1)] + [5]
    unary = [rng.normal(size=k) * 10.0 ** rng.integers(-3, 3) for k in sizes]
    edges = {(u, v): rng.normal(size=(sizes[u], sizes[v]))
             for u, v in itertools.combinations(range(groups), 2)
             if rng.random() < 0.8 or (u, v) == (0, groups - 1)}
    order = elimination_order(sizes, edges)
    value, choice, steps = minimise(unary, edges, order)
    assert any(math.prod(sizes[v] for v in s.axes) > elimination.SLAB for s in steps if s.scope)
    for step in steps:
        assert np.array_equal(step.reduced(sizes), step.total(sizes).min(axis=-1))
    monkeypatch.setattr(elimination, "SLAB", 1 << 30)  # whole tables throughout
    assert minimise(unary, edges, order)[:2] == (value, choice)


def test_order_of_a_chain_has_width_one_and_of_a_residual_chain_width_two():
    chain = elimination_order([5] * 8, {(i, i + 1): None for i in range(7)})
    assert chain.width == 1
    residual = {(i, i + 1): None for i in range(12)} | {(i, i + 4): None for i in range(0, 9, 4)}
    assert elimination_order([5] * 13, residual).width == 2


def _with_buckets(p: Problem, seed: int) -> Problem:
    """Random fused-bucket terms: two device groups, byte counts of a few chunks."""
    rng = np.random.default_rng(seed)
    nbytes = [rng.integers(0, 3, (len(c), 2)).astype(float) * rng.uniform(0.3, 1.5)
              for c in p.cost]
    alpha = rng.uniform(0.05, 0.5, 2) * max(float(c.max()) for c in p.cost)
    return Problem(p.names, p.cost, p.memory, p.edges, p.memory_budget,
                   BucketTerms(alpha, nbytes, 1.0))


def _budgeted_with_optimum(seed: int) -> tuple[Problem | None, float]:
    """A random problem under a tight or middling budget (with buckets on odd seeds) and
    its exhaustive optimum; (None, inf) where nothing fits."""
    p = random_problem(seed, budget="tight" if seed % 3 else "mid", max_groups=6, max_k=4)
    if seed % 2:
        p = _with_buckets(p, seed)
    try:
        return p, exhaustive(p).objective
    except ValueError:
        return None, math.inf


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("budget", [None, "mid", "tight"])
def test_bound_and_kept_strategies_contain_the_optimum(seed, budget):
    p = random_problem(seed, budget=budget, max_groups=5, max_k=4)
    if seed % 2:
        p = _with_buckets(p, seed)
    try:
        opt = exhaustive(p)
    except ValueError:
        with pytest.raises(ValueError):
            solve_elimination(p)
        return
    res = solve_elimination(p)
    assert p.feasible(res.result.choice)
    assert math.isclose(res.result.objective, p.objective(res.result.choice), rel_tol=REL)
    assert res.result.bound <= opt.objective * (1 + REL) + 1e-12
    if res.keep is None:  # claimed optimal
        assert math.isclose(res.result.objective, opt.objective, rel_tol=1e-8, abs_tol=1e-12)
        return
    sub = p.subset(res.keep)
    assert math.isclose(exhaustive(sub).objective, opt.objective, rel_tol=1e-8, abs_tol=1e-12)


@pytest.mark.parametrize("seed", range(30))
def test_lagrangian_reaches_the_exact_dual_maximum(seed):
    """The memory row's dual, ``max_λ min_c obj(c) + λ (mem(c) − M)``, computed from every
    choice's line: the cutting-plane search returns exactly its maximum (bisection only
    approached it), and a λ attaining it."""
    p = random_problem(seed, budget="tight" if seed % 3 else "mid", max_groups=5, max_k=4)
    choices = list(itertools.product(*(range(len(c)) for c in p.cost)))
    lines = [(_pairwise(p, c), p.memory_of(c) - p.memory_budget) for c in choices]
    kinks = [0.0] + [(a2 - a1) / (s1 - s2) for a1, s1 in lines for a2, s2 in lines
                     if s1 > s2 and (a2 - a1) / (s1 - s2) > 0]
    dual = max(min(a + s * lam for a, s in lines) for lam in kinks)
    edges = _merged_edges(p)
    order = elimination_order([len(c) for c in p.cost], edges)

    def relaxed(lam):
        value, choice, _ = minimise([c + lam * m for c, m in zip(p.cost, p.memory, strict=True)],
                                    edges, order)
        return value - lam * p.memory_budget, choice, None

    lower0, first, _ = relaxed(0.0)
    if p.feasible(first):  # the row does not bind: the dual peaks at λ = 0
        assert math.isclose(lower0, dual, rel_tol=1e-9, abs_tol=1e-12)
        return
    lower, seen, lam = _lagrange(p, relaxed, lower0, first)
    assert math.isclose(lower, dual, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(min(a + s * lam for a, s in lines), dual, rel_tol=1e-9, abs_tol=1e-12)
    assert all(len(c) == p.num_groups for c in seen)


@pytest.mark.parametrize("seed", range(60))
@pytest.mark.parametrize("by_index_up_to", [0, 10**9])
def test_evaluating_every_choice_finds_the_optimum(seed, by_index_up_to, monkeypatch):
    """On a grid with an axis per group (index arrays up to no size) and by index arrays
    (up to any size): the optimum, bucket rounding and memory row included."""
    monkeypatch.setattr(elimination, "BY_INDEX_UP_TO", by_index_up_to)
    p = random_problem(seed, budget=[None, "mid", "tight"][seed % 3], max_groups=6, max_k=4)
    if seed % 2:
        p = _with_buckets(p, seed)
    try:
        opt = exhaustive(p).objective
    except ValueError:
        assert _enumerated(p) is None
        return
    found = _enumerated(p)
    assert p.feasible(found)
    assert math.isclose(p.objective(found), opt, rel_tol=1e-8, abs_tol=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_evaluating_every_choice_of_many_groups_most_decided(seed):
    """A model's restriction: hundreds of groups, most with one strategy left (more than
    an array has dimensions), a chain of edges, buckets and a memory row."""
    rng = np.random.default_rng(seed)
    sizes = [1] * 150
    for g in rng.choice(150, 4, replace=False):
        sizes[g] = int(rng.integers(2, 4))
    cost = [rng.uniform(0, 1, k) for k in sizes]
    memory = [rng.uniform(1, 10, k) for k in sizes]
    edges = {(g, g + 1): rng.uniform(0, 1, (sizes[g], sizes[g + 1])) for g in range(149)}
    lo, hi = sum(m.min() for m in memory), sum(m.max() for m in memory)
    p = _with_buckets(Problem([f"g{g}" for g in range(150)], cost, memory, edges,
                              float(lo + 0.5 * (hi - lo))), seed)
    found = _enumerated(p)
    want = exhaustive(p)
    assert p.feasible(found)
    assert math.isclose(p.objective(found), want.objective, rel_tol=1e-9)


@pytest.mark.parametrize("seed", range(20))
def test_grid_and_index_evaluation_break_ties_alike(seed, monkeypatch):
    """Costs on a coarse integer scale make ties: both ways of evaluating every choice
    return the first optimal choice in index order. Every third problem lists its edges
    from the later group to the earlier one (the grid lays such a matrix out transposed)."""
    rng = np.random.default_rng(seed)
    sizes = [int(rng.integers(1, 4)) for _ in range(int(rng.integers(2, 7)))]
    pairs = [(g + 1, g) if seed % 3 == 0 else (g, g + 1) for g in range(len(sizes) - 1)]
    p = Problem([f"g{g}" for g in range(len(sizes))],
                [rng.integers(0, 3, k).astype(float) for k in sizes],
                [rng.integers(0, 3, k).astype(float) for k in sizes],
                {(u, v): rng.integers(0, 2, (sizes[u], sizes[v])).astype(float)
                 for u, v in pairs})
    p = _with_buckets(p, seed) if seed % 2 else p
    first = min(itertools.product(*(range(k) for k in sizes)), key=p.objective)
    found = []
    for up_to in (0, 10**9):
        monkeypatch.setattr(elimination, "BY_INDEX_UP_TO", up_to)
        found.append(_enumerated(p))
    assert found[0] == found[1] == first


def test_enumerated_optimum_is_exact_declines_large_spaces_and_says_nothing_fits():
    p = random_problem(3, budget="mid", max_groups=6, max_k=4)
    choice, objective = enumerated_optimum(p)
    assert p.feasible(choice) and math.isclose(objective, exhaustive(p).objective, rel_tol=1e-9)
    wide = Problem([f"g{g}" for g in range(17)], [np.arange(2.0)] * 17, [np.zeros(2)] * 17, {})
    assert enumerated_optimum(wide) is None  # 2^17 choices: the elimination's work
    tight = replace(p, memory_budget=sum(float(m.min()) for m in p.memory) * 0.5)
    with pytest.raises(NoFit):
        enumerated_optimum(tight)


def _exhaustive_node(sub):
    """A node solver that enumerates the node: exact, its optimum is its bound."""
    found = exhaustive(sub)
    return tuple(found.choice), found.objective


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("gap", [0.0, 0.02])
@pytest.mark.parametrize("enumerate_below", [0, 12])
@pytest.mark.parametrize("node_solver", [None, _exhaustive_node])
def test_branch_and_bound_on_the_memory_row_equals_enumeration(seed, gap, enumerate_below,
                                                               node_solver, monkeypatch):
    """The search over memory splits, from the least-memory choice (nodes of at most
    ``enumerate_below`` choices evaluated outright; nodes left open by bucket rounding
    alone solved by ``node_solver`` when given): what it returns fits, and a bound it
    proves is at most the optimum and within ``gap`` of what it returns — always proven
    with a node solver unless it split on a device group's use (such a node goes to the
    ILP on every strategy instead)."""
    monkeypatch.setattr(elimination, "ENUMERATE_POINTS", enumerate_below)
    p, opt = _budgeted_with_optimum(seed)
    if p is None:
        return
    search = _BranchAndBound(p, gap, node_solver)
    best, bound = search.run(tuple(int(np.argmin(m)) for m in p.memory))
    assert p.feasible(best) and p.objective(best) >= opt * (1 - REL) - 1e-12
    if seed % 2 == 0 or (node_solver and not search.splits):  # no buckets: the dual closes
        assert bound is not None
    if seed % 2 == 0:
        assert search.solved == 0
    if bound is not None:
        assert bound <= opt * (1 + REL) + 1e-12
        assert p.objective(best) - bound <= max(gap, 1e-9) * abs(p.objective(best)) + 1e-12
        if gap == 0.0:
            assert math.isclose(p.objective(best), opt, rel_tol=1e-8, abs_tol=1e-12)


def _first_chunk_buckets(p: Problem, seed: int, groups: int = 4) -> Problem:
    """Fused-bucket terms whose every choice fills less than one chunk of each of
    ``groups`` device groups (each layer reduces over some of them): the buckets' whole
    difficulty is the first chunk's latency, paid once per group used — VGG's and
    ResNet's case on 64 devices."""
    rng = np.random.default_rng(seed)
    share = 1.0 / (p.num_groups + 1)
    nbytes = [(rng.random((len(c), groups)) < 0.5) * rng.uniform(0.1, 1.0, (len(c), groups))
              * share for c in p.cost]
    alpha = rng.uniform(0.2, 1.0, groups) * max(float(c.max()) for c in p.cost)
    return Problem(p.names, p.cost, p.memory, p.edges, p.memory_budget,
                   BucketTerms(alpha, nbytes, 1.0))


@pytest.mark.parametrize("seed", range(30))
def test_a_used_groups_first_chunk_is_a_lower_bound_on_the_choices_that_use_it(seed):
    """With device groups U decided ``used``, a pass at the base prices, and at the prices
    re-set from any choice, is at most the objective of every choice reducing over each
    group of U (a lower bound where only those are of interest), on branching graphs
    with multi-chunk buckets."""
    p = _with_buckets(random_problem(seed, max_groups=5, max_k=3), seed)
    rng = np.random.default_rng(seed)
    used = frozenset(int(j) for j in np.flatnonzero(rng.random(len(p.buckets.alpha)) < 0.6))
    edges = _merged_edges(p)
    relax = _Relaxation(p, edges, elimination_order([len(c) for c in p.cost], edges), used)
    choices = list(itertools.product(*(range(len(c)) for c in p.cost)))
    using = [c for c in choices if all(p.buckets.totals(c)[j] > 0 for j in used)]
    if not using:
        return
    least = min(p.objective(c) for c in using)
    for prices in (relax.base_prices(), relax.usage_prices(choices[seed % len(choices)])):
        assert relax.run(*prices, 0.0)[0] <= least * (1 + REL) + 1e-12


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("budget", [None, "mid", "tight"])
def test_splitting_on_device_groups_closes_first_chunk_gaps_without_an_ilp(seed, budget,
                                                                          monkeypatch):
    """On branching graphs whose buckets fill less than a chunk per device group, the
    branch and bound (nothing enumerated, no node solver) proves the optimum by splitting
    on which groups are used: exactly the exhaustive optimum, and so does
    :func:`solve_elimination` (status optimal, no ILP)."""
    monkeypatch.setattr(elimination, "ENUMERATE_POINTS", 0)
    p = _first_chunk_buckets(random_problem(seed, budget=budget, max_groups=6, max_k=4), seed)
    try:
        opt = exhaustive(p).objective
    except ValueError:
        return
    search = _BranchAndBound(p, 0.0)
    best, bound = search.run(tuple(int(np.argmin(m)) for m in p.memory))
    assert bound is not None and bound <= opt * (1 + REL) + 1e-12
    assert p.feasible(best) and math.isclose(p.objective(best), opt, rel_tol=1e-8, abs_tol=1e-12)
    res = solve_elimination(p)
    assert res.keep is None and res.result.status == "optimal"
    assert math.isclose(res.result.objective, opt, rel_tol=1e-8, abs_tol=1e-12)


def test_too_wide_a_graph_is_refused():
    p = random_problem(3, max_groups=6, max_k=4)
    assert solve_elimination(p, max_work=1.0) is None


def _tiny_gpt(layers: int, nodes: int, local: int, **solver) -> object:
    return parse_config({
        "name": "tiny",
        "model": {"kind": "gpt", "hidden": 64, "layers": layers, "heads": 4, "seq_len": 16,
                  "vocab": 128, "batch": 8},
        "cluster": {"nodes": nodes, "devices_per_node": local, "memory_gib": 1,
                    "peak_tflops": 10, "links": {"intra": {"latency_us": 5, "bandwidth_gbps": 800},
                                                 "inter": {"latency_us": 20,
                                                           "bandwidth_gbps": 50}}},
        "training": {"grad_bucket_mb": 0.01},
        "solver": {"time_limit_s": 120, **solver},
    })


@pytest.mark.parametrize("seed", range(0, 24, 3))
def test_the_planners_node_solver_is_the_ilp_on_the_node(seed):
    """``planner._node_ilp`` (what the branch and bound hands a node that bucket rounding
    alone leaves open): the node's optimum and a bound at most it, at a zero gap."""
    from ilp_planner.intra_op.solve_mesh import _node_ilp

    p = _with_buckets(random_problem(seed, budget="mid", max_groups=5, max_k=3), seed)
    try:
        opt = exhaustive(p).objective
    except ValueError:
        return
    opts = _tiny_gpt(1, 1, 2).solver
    choice, bound = _node_ilp(opts, lambda: time.perf_counter() + 60, p)
    assert p.feasible(choice)
    assert math.isclose(p.objective(choice), opt, rel_tol=1e-7, abs_tol=1e-12)
    assert bound <= opt * (1 + 1e-7) + 1e-12
    assert _node_ilp(opts, time.perf_counter, p) is None  # the solve's budget is spent


def _pair(config, budget=None, **kw):
    """(elimination solve, ILP-alone solve) of one mesh."""
    nodes, local = config.cluster.nodes, config.cluster.devices_per_node
    request = MeshSolveRequest.whole_model(config, nodes, local, budget)
    if kw:
        request = replace(request, **kw)
    on = solve_mesh(request)[1]
    off_config = config.with_overrides({"solver.elimination": False})
    off = solve_mesh(replace(request, config=off_config))[1]
    return on, off


@pytest.mark.parametrize("tie", [True, False])
def test_solve_mesh_equals_the_ilp_alone_on_a_gpt(tie):
    on, off = _pair(_tiny_gpt(2, 2, 2, tie_layers=tie))
    assert on.status == off.status == "optimal"
    assert on.method.startswith("elimination")
    assert math.isclose(on.objective, off.objective, rel_tol=1e-7)


def test_solve_mesh_equals_the_ilp_alone_with_a_binding_memory_budget():
    config = _tiny_gpt(2, 1, 4, tie_layers=False)
    free = solve_mesh(MeshSolveRequest.whole_model(config, 1, 4, None))
    gp, res = free
    least = gp.problem.min_memory()[0]
    budget = least + 0.3 * (gp.problem.memory_of(res.choice) - least)
    on, off = _pair(config, budget)
    assert on.status == off.status == "optimal"
    assert gp.problem.memory_of(on.choice) <= budget * (1 + 1e-9)
    assert math.isclose(on.objective, off.objective, rel_tol=1e-7)
    assert on.objective >= res.objective * (1 - 1e-9)


def test_solve_mesh_equals_the_ilp_alone_on_a_pipeline_stage():
    """The middle block of three: an imported input and an exported output."""
    config = _tiny_gpt(3, 1, 4, tie_layers=False)
    graph = config.microbatch_graph()
    names = [op.name for op in graph.ops if op.block_index == 1]
    stage = subgraph(graph, names)
    on, off = _pair(config, None, graph=stage, microbatches=1,
                    boundary=stage_boundary(graph, names))
    assert on.status == off.status == "optimal"
    assert math.isclose(on.objective, off.objective, rel_tol=1e-7)


@pytest.mark.parametrize("seed", range(30))
def test_bound_pruning_keeps_an_optimum(seed):
    p = random_problem(seed, budget="mid" if seed % 3 == 0 else None, max_groups=5, max_k=4)
    if seed % 2:
        p = _with_buckets(p, seed)
    try:
        opt = exhaustive(p)
    except ValueError:
        return
    rng = np.random.default_rng(seed)
    upper = opt.objective * (1 + rng.uniform(0, 0.2))
    keep = bound_prune(p, upper)
    assert all(len(k) for k in keep)
    assert all(opt.choice[g] in keep[g] for g in range(p.num_groups)) or math.isclose(
        exhaustive(p.subset(keep)).objective, opt.objective, rel_tol=1e-9)


def test_a_too_wide_problem_is_pruned_by_an_incumbent_then_solved():
    """Hopeless strategies (a huge cost) widen the problem past the work limit; an
    incumbent's objective rules them out, and the pruned problem is solved exactly."""
    p = random_problem(5, max_groups=6, max_k=4)
    sizes = [len(c) for c in p.cost]
    limit = elimination_order(sizes, p.edges).work
    extra = 6
    wide = Problem(p.names, [np.concatenate([c, np.full(extra, 1e6)]) for c in p.cost],
                   [np.concatenate([m, np.full(extra, m.min())]) for m in p.memory],
                   {(u, v): np.pad(r, ((0, extra), (0, extra))) for (u, v), r in p.edges.items()})
    opt = exhaustive(p)
    hopeless = tuple(len(c) for c in p.cost)  # a feasible choice of only the added strategies
    for incumbents in ([hopeless], [hopeless, opt.choice]):  # the forest's own, or given
        res = solve_elimination(wide, max_work=limit, prune_above=limit, incumbents=incumbents)
        assert math.isclose(res.result.objective, opt.objective, rel_tol=1e-9)
        assert "ruled out by the forest bound" in res.result.message


def test_the_forest_incumbent_is_feasible_and_priced_exactly():
    """The wide branch's own incumbent: a feasible choice of the whole problem (memory
    row included) whenever one exists, never below the optimum, and the optimum on a
    problem that is itself a forest."""
    from formulations.elimination import _forest_incumbent

    for seed in range(45):
        p = random_problem(seed, budget=(None, "mid", "tight")[seed % 3], max_groups=6,
                           max_k=4)
        opt = exhaustive(p)
        choice = _forest_incumbent(p)
        assert p.feasible(choice)
        assert p.objective(choice) >= opt.objective * (1 - 1e-9)
        forest = Problem(p.names, p.cost, p.memory, {})  # no edges: the relaxation is exact
        if forest.memory_budget is None or forest.feasible(
                tuple(int(np.argmin(c)) for c in forest.cost)):
            assert math.isclose(forest.objective(_forest_incumbent(forest)),
                                exhaustive(forest).objective, rel_tol=1e-9)


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("where", [0.9, 0.99, 1.0, 1.1])
def test_a_cutoff_stops_the_search_only_where_nothing_beats_it(seed, where, monkeypatch):
    """``cutoff`` (a plan in hand elsewhere): above the optimum the result is the one
    without a cutoff, optimum included; at or below it the search stops once its proven
    bound reaches the cutoff — never later than without one — and where the search without
    a cutoff proves the optimum, the one with it proves the cutoff (the caller's CutOff).
    No node is enumerated, so the branch and bound does the work (at 0.99 × the optimum
    it stops sooner on 8 of these 40 problems)."""
    monkeypatch.setattr(elimination, "ENUMERATE_POINTS", 0)
    p, opt = _budgeted_with_optimum(seed)
    if p is None:
        return
    plain = solve_elimination(p)
    cut = solve_elimination(p, cutoff=where * opt)
    assert p.feasible(cut.result.choice)
    assert cut.result.bound <= opt * (1 + REL) + 1e-12
    assert cut.result.stats.nodes <= plain.result.stats.nodes
    if where > 1:
        assert cut.result.objective == plain.result.objective
        assert (cut.keep is None) == (plain.keep is None)
        if cut.keep is not None:
            assert math.isclose(exhaustive(p.subset(cut.keep)).objective, opt, rel_tol=1e-8,
                                abs_tol=1e-12)
    elif plain.keep is None:
        assert cut.result.bound >= where * opt * (1 - REL) - 1e-12


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("where", [0.5, 0.9, 0.999, 1.0, 1.01])
def test_the_dual_stopped_at_a_cutoff_decides_as_the_full_dual(seed, where):
    """The memory row's dual stops once its bound reaches ``stop`` (a cutoff): where it
    stops there, the full search's bound reaches it too (the caller drops the problem
    either way); where it does not, it is the full search, pass for pass. Stops placed
    from below the λ = 0 bound to above the dual's maximum."""
    p = random_problem(seed, budget="tight" if seed % 3 else "mid", max_groups=5, max_k=4)
    edges = _merged_edges(p)
    order = elimination_order([len(c) for c in p.cost], edges)
    relax = _Relaxation(p, edges, order)
    theta, usage = relax.base_prices()
    lower0, first, _ = relax.run(theta, usage, 0.0)
    if p.feasible(first):
        return
    try:
        full = _lagrange(p, lambda v: relax.run(theta, usage, v), lower0, first)
    except elimination.NoFit:
        return
    stop = lower0 + where * (full[0] - lower0) if where < 1 else where * full[0]
    stopped = _lagrange(p, lambda v: relax.run(theta, usage, v), lower0, first, stop)
    if stopped[0] >= stop:
        assert full[0] >= stop and len(stopped[1]) <= len(full[1])
    else:
        assert stopped[0] == full[0] and stopped[2] == full[2]
        assert [list(c) for c in stopped[1]] == [list(c) for c in full[1]]


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("where", [0.9, 1.0, 1.1])
def test_incumbents_given_lazily_are_asked_for_only_where_needed(seed, where):
    """``incumbents`` as a callable: a problem cut off at its first bound never calls it
    (its answer, the cut-off, is the one with the incumbents given), and everywhere else
    the result is the one with them given as a list."""
    p, opt = _budgeted_with_optimum(seed)
    if p is None:
        return
    incumbent = exhaustive(p).choice  # feasible: it decides the search where it runs
    calls = []

    def lazy():
        calls.append(1)
        return [incumbent]

    given = solve_elimination(p, cutoff=where * opt, incumbents=[incumbent])
    asked = solve_elimination(p, cutoff=where * opt, incumbents=lazy)
    assert (asked.result.bound >= where * opt) == (given.result.bound >= where * opt)
    if calls:
        assert asked.result.choice == given.result.choice
        assert asked.result.objective == given.result.objective
        assert asked.result.bound == given.result.bound
        assert (asked.keep is None) == (given.keep is None)
    else:  # cut off at the first bound: the incumbents could not have changed that
        assert asked.result.bound >= where * opt and given.result.bound >= where * opt


def test_an_ilp_cutoff_without_a_warm_start_raises_cutoff_not_a_heuristic_plan(monkeypatch):
    """The ILP path with no elimination result and a fallback search whose choice does not
    fit (so SCIP gets no warm start): a cutoff below the optimum still ends in
    :class:`CutOff` — SCIP's dual limit, which may stop it before any incumbent, is set only
    with one; before, such a run read as a time-out and returned the non-fitting fallback
    choice as a heuristic plan."""
    from ilp_planner.inputs.config import load_config
    from ilp_planner.intra_op import solve_mesh as sm

    config = load_config(Path(__file__).resolve().parent.parent / "configs" / "tiny-gpt-cpu.yaml")
    rng = np.random.default_rng(0)
    cost = [rng.uniform(1, 2, 6) for _ in range(30)]
    mem = [rng.uniform(1, 2, 6) for _ in range(30)]
    edges = {(g, g + 1): rng.uniform(0, 1, (6, 6)) for g in range(29)}
    p = Problem([f"g{g}" for g in range(30)], cost, mem, edges,
                memory_budget=sum(m.min() for m in mem) * 1.02)
    optimum = sm._solve_ilp(config, p, None, None, [], 0.0)
    assert optimum.status == "optimal"
    worst = tuple(int(np.argmax(m)) for m in mem)
    assert not p.feasible(worst)

    class NotFitting:  # the fallback search, replaced by one whose choice does not fit
        choice, solve_s = worst, 0.0

    monkeypatch.setitem(sm.SEARCHES, config.solver.fallback, lambda problem, seed=0: NotFitting)
    with pytest.raises(sm.CutOff):
        sm._solve_ilp(config, p, None, None, [], 0.0, cutoff=optimum.objective * 0.99)
    kept = sm._solve_ilp(config, p, None, None, [], 0.0, cutoff=optimum.objective * 1.01)
    assert kept.status == "optimal" and kept.objective == pytest.approx(optimum.objective)


@pytest.mark.parametrize("open_nodes", [0, 1, 2])
def test_a_branch_and_bound_stopped_for_its_pile_of_open_nodes_keeps_the_optimum(
        open_nodes, monkeypatch):
    """``BRANCH_OPEN``: the search stops once more open nodes than that lie below the
    incumbent, the proof left to the ILP on the kept strategies. On random budgeted
    problems (buckets on odd seeds; nothing enumerated) where the stop fires, what it
    returns fits and claims no bound, and the kept strategies still hold the exhaustive
    optimum — the result the un-stopped search (or the ILP after it) reaches."""
    monkeypatch.setattr(elimination, "ENUMERATE_POINTS", 0)
    monkeypatch.setattr(elimination, "BRANCH_OPEN", open_nodes)
    stopped = 0
    for seed in range(60):
        p, opt = _budgeted_with_optimum(seed)
        if p is None:
            continue
        search = _BranchAndBound(p, 0.0)
        best, bound = search.run(tuple(int(np.argmin(m)) for m in p.memory))
        assert p.feasible(best) and p.objective(best) >= opt * (1 - REL) - 1e-12
        if bound is None:
            stopped += 1
        else:
            assert bound <= opt * (1 + REL) + 1e-12
        res = solve_elimination(p)
        assert p.feasible(res.result.choice)
        assert res.result.bound <= opt * (1 + REL) + 1e-12
        if res.keep is None:
            assert math.isclose(res.result.objective, opt, rel_tol=1e-8, abs_tol=1e-12)
        else:
            found = exhaustive(p.subset(res.keep)).objective
            assert math.isclose(found, opt, rel_tol=1e-8, abs_tol=1e-12), seed
    assert stopped > 0  # the rule fired: the cases above are the ones it leaves to the ILP


def test_solve_mesh_with_the_pile_rule_firing_at_once_equals_the_ilp_alone(monkeypatch):
    """Any branch and bound of a solve under a binding budget stopped at its first open
    node (``BRANCH_OPEN`` 0): the ILP after it proves the same optimum as the ILP alone."""
    monkeypatch.setattr(elimination, "BRANCH_OPEN", 0)
    config = _tiny_gpt(2, 1, 4, tie_layers=False)
    gp, res = solve_mesh(MeshSolveRequest.whole_model(config, 1, 4, None))
    least = gp.problem.min_memory()[0]
    on, off = _pair(config, least + 0.3 * (gp.problem.memory_of(res.choice) - least))
    assert on.status == off.status == "optimal"
    assert math.isclose(on.objective, off.objective, rel_tol=1e-7)
