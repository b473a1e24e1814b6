"""Baselines built restricted to their own strategies and solved by elimination: the same
problem and the same prices as the old path (the full problem restricted, solved by the
ILP), every family priced on a wide mesh whose micro-batches the data-parallel degree does
not split (another micro-batch count, named), and a family that cannot fit says the least
memory one of its members needs."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from formulations.sbp_ilp import SbpIlp
from ilp_planner.inputs import models
from ilp_planner.inputs.config import parse_config
from ilp_planner.intra_op.baseline_prices import MemberBuilder, grid_baseline, price_baselines
from ilp_planner.intra_op.baselines import (
    AC_MODES,
    ac_blocks,
    baseline_choices,
    data_parallel_filter,
    megatron_filter,
    price_families,
    restrict,
    summa_filter,
    torchtitan_choice,
)
from ilp_planner.intra_op.problem import build_problem, peak_memory
from ilp_planner.intra_op.request import MeshSolveRequest
from ilp_planner.ir.cluster import Cluster, Link, MeshAxis, mesh_factorisations
from ilp_planner.ir.graph import OpKind
from ilp_planner.lowering.cost_model import MemorySpec

GIB = 2**30
TIED_TABLE = {"embed", "lm_head"}  # the GPT builder's tied input / output embedding


def cluster(nodes: int, local: int, memory_gib: float = 16) -> Cluster:
    return Cluster(nodes, local, memory_bytes=memory_gib * GIB, peak_flops=1e13,
                   intra=Link.from_bandwidth(5, 800), inter=Link.from_bandwidth(10, 50))


def gpt_config(nodes: int, local: int, *, batch: int = 8, microbatches: int = 1,
               memory_gib: float = 80, layers: int = 2, hidden: int = 64, heads: int = 4,
               vocab: int = 128):
    return parse_config({
        "name": "gpt", "model": {"kind": "gpt", "hidden": hidden, "layers": layers,
                                 "heads": heads, "seq_len": 16, "vocab": vocab, "batch": batch},
        "cluster": {"nodes": nodes, "devices_per_node": local, "memory_gib": memory_gib,
                    "peak_tflops": 10, "efficiency": 1.0,
                    "links": {"intra": {"latency_us": 5, "bandwidth_gbps": 800},
                              "inter": {"latency_us": 10, "bandwidth_gbps": 50}}},
        "training": {"optimizer": "adam", "grad_bucket_mb": 0},
        "pipeline": {"stages": 1, "microbatches": microbatches}})


def test_a_restricted_build_is_the_full_problem_restricted():
    """``build_problem(keep=…)`` builds exactly ``restrict(build_problem(…), keep)``: the
    same costs, memory and edge matrices, strategy for strategy, and the same objective."""
    g = models.gpt(hidden=64, layers=2, heads=4, seq_len=16, vocab=128, batch=8)
    cl, mem = cluster(2, 4), MemorySpec.preset("adam")
    full = build_problem(g, cl, 2, 4, mem, zero_levels=(0, 3), grad_bucket_bytes=2**20)
    for keep in (megatron_filter(MeshAxis(2, 1), MeshAxis(1, 4), True),
                 summa_filter(MeshAxis(1, 2), MeshAxis(2, 2))):
        sub, _ = restrict(full, keep)
        own = build_problem(g, cl, 2, 4, mem, zero_levels=(0, 3), grad_bucket_bytes=2**20,
                            keep=keep).problem
        assert [len(c) for c in own.cost] == [len(c) for c in sub.cost]
        for a, b in zip(own.cost + own.memory, sub.cost + sub.memory, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-12)
        assert own.edges.keys() == sub.edges.keys()
        for k in own.edges:
            np.testing.assert_allclose(own.edges[k], sub.edges[k], rtol=1e-12)
        rng = np.random.default_rng(0)  # the fused-bucket term: device groups may differ
        for _ in range(20):            # in number (unused ones), never in price
            choice = [int(rng.integers(len(c))) for c in own.cost]
            assert math.isclose(own.objective(choice), sub.objective(choice), rel_tol=1e-12)


@pytest.mark.parametrize("shape", [(2, 4), (1, 8)])
def test_each_family_prices_as_the_restricted_ilp(shape):
    """Each family's price by restricted builds and elimination equals the old path's
    (the full problem restricted and solved by the ILP), member for member."""
    nodes, local = shape
    config = gpt_config(nodes, local)
    request = MeshSolveRequest.whole_model(config, nodes, local, None)
    full = build_problem(request.graph, config.cluster, nodes, local, config.memory)
    old = baseline_choices(full)
    new = price_families(MemberBuilder(request), nodes, local, 1, None, 30.0)
    assert set(old) == set(new)
    for name, choice in old.items():
        assert not isinstance(choice, str), (name, choice)
        assert math.isclose(new[name].objective, full.problem.objective(choice), rel_tol=1e-9)


def test_the_torchtitan_grid_prices_as_its_points_solved_on_the_full_problem():
    """The grid's best point under a memory budget (FSDP's reserve and the exact peak
    checked) equals the best over its points each restricted from the full problem
    (DDP/FSDP × mesh × SP × checkpointing) and solved by the ILP — the old path, with the
    tied table's state replicated under FSDP as the planner's space has it."""
    config = gpt_config(1, 4, memory_gib=0.001, layers=3)
    budget = config.cluster.memory_bytes
    request = MeshSolveRequest.whole_model(config, 1, 4, budget)
    point = torchtitan_choice(request.graph, MemberBuilder(request), 1, 4, budget, 30.0, 1)
    assert not isinstance(point, str), point
    best = math.inf
    for fsdp in (False, True):
        for mode in AC_MODES:
            full = build_problem(request.graph, config.cluster, 1, 4, config.memory,
                                 zero_levels=(0, 3) if fsdp else (0,),
                                 recompute=ac_blocks(request.graph, mode))
            for dp, tp in mesh_factorisations(1, 4, 2):
                for sp in (False, True) if tp.size > 1 else (False,):
                    state = (lambda s: s.zero == 3 or not any(
                        c.purpose == "grad_sync" for c in s.collectives)) if fsdp else (
                        lambda s: s.zero == 0)
                    keep, layout = (megatron_filter(dp, tp, sp, state),
                                    megatron_filter(dp, tp, sp, lambda s: True))
                    res = restrict(full, lambda op, s, keep=keep, layout=layout: keep(op, s) or (
                        op.name in TIED_TABLE and layout(op, s)))
                    if isinstance(res, str):
                        continue
                    sub, allowed = res
                    reserve = max((full.options[n][int(k)].transient_bytes
                                   for g, group in enumerate(full.groups) for n in group
                                   for k in allowed[g]), default=0.0)
                    sub.memory_budget = budget - reserve
                    if sub.memory_budget <= 0 or sub.min_memory()[0] > sub.memory_budget:
                        continue
                    out = SbpIlp(sub).solve()
                    choice = [int(allowed[g][k]) for g, k in enumerate(out.choice)]
                    if peak_memory(full, choice) <= budget * (1 + 1e-9):
                        best = min(best, out.objective)
    assert math.isclose(point.objective, best, rel_tol=1e-9)


def test_an_infeasible_family_names_the_least_memory_a_member_needs():
    """No member fits: the error gives the smallest per-device memory over the family's
    members (each member's own memory lower bound) against the budget."""
    config = gpt_config(1, 4, memory_gib=1e-4)
    budget = config.cluster.memory_bytes
    request = MeshSolveRequest.whole_cluster(config)
    priced = price_baselines(request)
    full = build_problem(request.graph, config.cluster, 1, 4, config.memory)
    least = min(restrict(full, megatron_filter(a, b))[0].min_memory()[0]
                for a, b in mesh_factorisations(1, 4, 2) if a.size > 1 and b.size > 1)
    message = priced["megatron"]["error"]
    assert f"the smallest needs {least / GIB:.4g} GiB per device" in message, message
    assert f"the budget is {budget / GIB:.4g} GiB" in message
    assert re.search(r"GiB per device \(megatron\(dp=\d,tp=\d\)\)", message), message
    assert "GiB per device" in grid_baseline(request)  # the grid says it too


def test_every_family_prices_on_a_wide_mesh_with_small_micro_batches():
    """A GPT whose micro-batch (8 sequences) no data-parallel degree of 16 × 8 devices
    above 8 divides: the families whose degree needs more run on fewer, larger
    micro-batches (Megatron's accumulation steps), say so in their names, and price —
    no family is left without layouts."""
    config = gpt_config(16, 8, batch=128, microbatches=16, hidden=256, heads=16)
    request = MeshSolveRequest.whole_cluster(config)
    priced = price_baselines(request)
    point = grid_baseline(request)
    assert not isinstance(point, str), point
    families = {name.split("(", 1)[0]: name for name in [*priced, point.name]}
    assert set(families) == {"data_parallel", "megatron", "megatron_sp", "summa", "torchtitan"}
    for name, block in priced.items():
        assert "error" not in block, (name, block)
    assert "microbatches=1" in families["data_parallel"]  # 128 sequences over 128 devices


def test_a_batch_no_micro_batch_count_splits_is_named():
    """Data parallel over 16 × 8 devices with a batch of 96 sequences: no micro-batch count
    gives every device whole sequences, and the error says so with the numbers."""
    config = gpt_config(16, 8, batch=96, microbatches=4)
    builder = MemberBuilder(MeshSolveRequest.whole_cluster(config))
    with pytest.raises(ValueError, match="the batch of 96 does not split over a "
                                         "data-parallel degree of 128"):
        builder((0,), frozenset(), data_parallel_filter(MeshAxis(16, 8)), 128)


def test_summa_prices_a_head_the_mesh_does_not_divide_by_splitting_what_divides():
    """A 127-wide head (odd: no SUMMA on any mesh) keeps its width whole in the SUMMA
    member — tokens over the rows, the contraction or the output columns over the columns —
    while every other linear runs SUMMA; the family prices instead of ``n/a``."""
    config = gpt_config(2, 4, vocab=127)
    request = MeshSolveRequest.whole_model(config, 2, 4, None)
    families = price_families(MemberBuilder(request), 2, 4, 1, None, 30.0)
    (priced,) = [v for k, v in families.items() if k.startswith("summa")]
    assert not isinstance(priced, str), priced
    chosen = {}
    for group, k in zip(priced.gp.groups, priced.choice, strict=True):
        chosen[group[0]] = priced.gp.options[group[0]][k].base
    # one representative per group (tied blocks share their choice)
    linears = [op for op in request.graph.ops if op.kind is OpKind.LINEAR and op.name in chosen]
    assert "lm_head" in {op.name for op in linears} and len(linears) > 1
    one = MeshAxis(1, 1)
    for op in linears:
        s = chosen[op.name]
        if op.name == "lm_head":
            rows, cols = s.fact[0], s.fact[2] if s.fact[1] == one else s.fact[1]
            assert s.label.startswith("3d") and one in s.fact and rows.size * cols.size == 8
            assert s.weight.split_degree(1) == 1 or 127 % s.weight.split_degree(1) == 0
        else:
            assert s.label.startswith("summa"), (op.name, s.label)
