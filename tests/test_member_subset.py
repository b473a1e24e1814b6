"""A baseline member read off the plan's whole problem (:func:`subset_nodes`) is the member
built on its own: the same option objects node for node, the same rows and matrices, and
every family and grid point priced the same — choice for choice — with the whole problem
at hand or without it."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ilp_planner.inputs.config import load_config
from ilp_planner.inputs.importer import from_module
from ilp_planner.intra_op.baseline_prices import MemberBuilder
from ilp_planner.intra_op.baselines import (
    data_parallel_filter,
    megatron_filter,
    price_families,
    summa_filter,
    torchtitan_choice,
)
from ilp_planner.intra_op.moe_baselines import (
    deepspeed_moe_filter,
    moe_grid_filter,
    replicated_experts_filter,
    with_moe,
)
from ilp_planner.intra_op.problem import (
    BuildCache,
    SubsetNodes,
    build_problem,
    problem_key,
    subset_nodes,
)
from ilp_planner.intra_op.request import MeshSolveRequest
from ilp_planner.ir.cluster import Cluster, Link, MeshAxis
from ilp_planner.lowering.cost_model import MemorySpec
from tests.test_shared_reads import TOKENS, D, FanOut

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _whole(request: MeshSolveRequest):
    """The plan's whole problem of ``request``, built and kept in its cache as the plan's
    solve keeps it."""
    config, cache = request.config, request.cache
    gp = build_problem(request.graph, config.cluster, request.nodes, request.local,
                       config.memory, tie_layers=config.solver.tie_layers,
                       microbatches=request.microbatches,
                       grad_bucket_bytes=config.grad_bucket_bytes, cache=cache)
    cache.problems_of = request.graph
    cache.problems[problem_key(config.cluster, request.nodes, request.local, config.memory,
                               config.solver.tie_layers, None, request.microbatches, None,
                               config.grad_bucket_bytes, (0,), frozenset())] = gp
    return gp


def _filters(nodes: int, local: int) -> list:
    whole = MeshAxis(nodes, local)
    out = [with_moe(data_parallel_filter(whole), replicated_experts_filter(nodes * local)),
           with_moe(data_parallel_filter(whole), deepspeed_moe_filter(nodes * local))]
    for a, b in ((MeshAxis(nodes, 1), MeshAxis(1, local)), (MeshAxis(1, 2), MeshAxis(nodes, 2))):
        out.append(summa_filter(a, b))
        for sp in (False, True):
            out.append(with_moe(megatron_filter(a, b, sp),
                                moe_grid_filter(a, b, lambda s: s.zero == 0)))
    return out


@pytest.mark.parametrize("name", ["tiny-gpt-cpu", "tiny-moe-cpu", "tiny-vgg-cpu"])
def test_a_subset_is_the_restricted_build(name):
    """Options (the same objects), cost and memory rows, edge matrices and the fused
    buckets' price of every member read off the whole problem equal its own build's."""
    config = load_config(CONFIGS / f"{name}.yaml")
    request = dataclasses.replace(MeshSolveRequest.whole_cluster(config), cache=BuildCache())
    whole = _whole(request)
    c = config.cluster
    for keep in _filters(c.nodes, c.devices_per_node):
        try:
            own = build_problem(request.graph, c, request.nodes, request.local, config.memory,
                                tie_layers=config.solver.tie_layers,
                                microbatches=request.microbatches,
                                grad_bucket_bytes=config.grad_bucket_bytes,
                                cache=request.cache, keep=keep)
        except ValueError as exc:  # no strategy for some op: the subset says the same
            with pytest.raises(ValueError, match="no allowed strategy"):
                subset_nodes(whole, keep, request.cache, config.solver.tie_layers, None)
            assert "no allowed strategy" in str(exc)
            continue
        sub = subset_nodes(whole, keep, request.cache, config.solver.tie_layers, None)
        assert isinstance(sub, SubsetNodes)
        assert sub.min_memory() == pytest.approx(sum(float(m.min()) for m in own.problem.memory),
                                                 rel=1e-12)
        assert sub.bound() >= sum(float(r.min()) for r in own.problem.cost) * (1 - 1e-12)
        gp = sub.complete()
        for node, opts in own.options.items():
            assert len(gp.options[node]) == len(opts)
            assert all(a is b for a, b in zip(gp.options[node], opts, strict=True)), node
        p, q = own.problem, gp.problem
        for a, b in zip(p.cost + p.memory, q.cost + q.memory, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12)
        assert p.edges.keys() == q.edges.keys()
        for k in p.edges:
            np.testing.assert_allclose(p.edges[k], q.edges[k], rtol=1e-12)
        rng = np.random.default_rng(0)
        for _ in range(20):
            choice = [int(rng.integers(len(r))) for r in p.cost]
            assert math.isclose(p.objective(choice), q.objective(choice), rel_tol=1e-12)


@pytest.mark.parametrize("name,budget_gib", [
    ("tiny-gpt-cpu", None), ("tiny-moe-cpu", None),
    ("tiny-gpt-cpu", 0.0008),  # Megatron's best member bound by its memory row
    ("tiny-gpt-cpu", 0.0007),  # the grid's best point checkpoints; data parallel cannot fit
])
def test_families_and_grid_price_the_same_with_the_whole_problem_at_hand(name, budget_gib):
    """Every family's best member and the torchtitan grid's best point (each member solved
    to its optimum: no pruning) are the same members at the same prices and choices
    whether the builder reads them off the plan's whole problem or builds each (the first
    pruned but under one budget, the second never); under a budget that binds, too."""
    config = load_config(CONFIGS / f"{name}.yaml")
    base = MeshSolveRequest.whole_cluster(config)
    if budget_gib is not None:
        base = dataclasses.replace(base, memory_budget=budget_gib * 2**30)
    read_off = dataclasses.replace(base, cache=BuildCache())
    _whole(read_off)
    builders = [MemberBuilder(read_off), MemberBuilder(dataclasses.replace(base, cache=None))]
    prune = budget_gib != 0.0008  # pruned too: members may be solved in another order
    assert isinstance(builders[0]((0,), frozenset(), summa_filter(MeshAxis(2, 1),
                                                                  MeshAxis(1, 4)), 1),
                      SubsetNodes)
    c = config.cluster
    fams = [price_families(b, c.nodes, c.devices_per_node, base.microbatches,
                           base.memory_budget, 30.0, moe="moe" in name, prune=p)
            for b, p in zip(builders, (prune, False), strict=True)]
    assert fams[0].keys() == fams[1].keys()
    if budget_gib == 0.0008:
        assert fams[0]["megatron(dp=2,tp=4)"].memory_binds
    for k, a in fams[0].items():
        b = fams[1][k]
        if isinstance(a, str):
            assert a == b
            continue
        assert a.choice == b.choice, k
        assert math.isclose(a.objective, b.objective, rel_tol=1e-9), k
    grids = [torchtitan_choice(base.graph, b, c.nodes, c.devices_per_node, base.memory_budget,
                               30.0, base.microbatches, prune=p)
             for b, p in zip(builders, (prune, False), strict=True)]
    if isinstance(grids[0], str):
        assert grids[0] == grids[1]
        return
    assert grids[0].name == grids[1].name
    assert grids[0].choice == grids[1].choice
    assert math.isclose(grids[0].objective, grids[1].objective, rel_tol=1e-9)


def test_a_graph_with_couplings_is_built():
    """Where the graph couples readers (a value two pieces of functional code read), the
    couplings' penalty depends on every option the problem holds: the member is built,
    not read off."""
    torch.manual_seed(0)
    graph = from_module(FanOut(), (torch.randn(TOKENS, D),))
    cache = BuildCache()
    cl = Cluster(1, 4, memory_bytes=16 * 2**30, peak_flops=1e12,
                 intra=Link.from_bandwidth(1, 10), inter=Link.from_bandwidth(2, 5))
    whole = build_problem(graph, cl, 1, 4, MemorySpec.preset("adam"), cache=cache)
    assert any(bool(np.any(c > 1.0)) for c in whole.problem.edges.values())  # penalties
    keep = megatron_filter(MeshAxis(1, 2), MeshAxis(1, 2))
    assert subset_nodes(whole, keep, cache, True, None) is None
