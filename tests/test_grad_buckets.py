"""Fused gradient buckets: the chunks the runtime reduces, their exact price in the ILP, and
the exposed part of gradient synchronisation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from formulations.problem import dominated_free
from formulations.sbp_ilp import SbpIlp
from formulations.sbp_search import _Evaluator, chain_dp, exhaustive
from ilp_planner.errors import ConfigError
from ilp_planner.inputs import models
from ilp_planner.inputs.config import load_config
from ilp_planner.intra_op.problem import build_problem
from ilp_planner.intra_op.realise import realise
from ilp_planner.ir.cluster import Cluster, Link, MeshAxis, axis_coordinates, proper_factorisations
from ilp_planner.ir.layouts import Layout
from ilp_planner.lowering.cost_model import Collective, CollectiveKind, MemorySpec
from ilp_planner.lowering.grad_buckets import chunk_count, device_groups, exposed_grad_sync, fill_buckets
from ilp_planner.lowering.strategies import grad_sync
from ilp_planner.plan.data import LayerPlan

CLUSTER = Cluster(2, 2, memory_bytes=16 * 2**30, peak_flops=1e13,
                  intra=Link.from_bandwidth(5, 800), inter=Link.from_bandwidth(10, 50))
GPT = models.gpt(hidden=32, layers=2, heads=4, seq_len=8, vocab=64, batch=4)
CAPS = [0.0, 700.0, 4096.0, 25 * 2**20]


def _problem(cap: float, graph=GPT, tie: bool = True):
    return build_problem(graph, CLUSTER, 2, 2, MemorySpec.preset("adam"), tie_layers=tie,
                         grad_bucket_bytes=cap)


def _syncs(gp, choice):
    chosen = gp.node_choice(choice)
    out = []
    for op in gp.graph.ops:
        if op.name in gp.members:
            o = chosen[op.name]
            out += [(op.name, b) for b in grad_sync(op, o.base.label, o.inputs[0], o.base.weight,
                                                     o.outputs[0], gp.ctx)]
    return out


def _random_choices(problem, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [[int(rng.integers(len(c))) for c in problem.cost] for _ in range(n)]


@pytest.mark.parametrize("nodes,local", [(1, 1), (2, 4), (4, 8), (3, 2)])
def test_device_groups_are_the_devices_sharing_coordinates_off_the_axes(nodes, local):
    """The plain definition: devices (mesh order) grouped by their coordinates on the
    axes a collective does not run over; groups listed sorted."""
    import itertools

    for fact in proper_factorisations(nodes, local):
        coords = axis_coordinates(fact)
        for r in range(len(fact) + 1):
            for axes in itertools.combinations(range(len(fact)), r):
                keep = [a for a in range(len(fact)) if a not in axes]
                groups: dict[tuple[int, ...], list[int]] = {}
                for i, row in enumerate(coords):
                    groups.setdefault(tuple(int(row[a]) for a in keep), []).append(i)
                assert device_groups(fact, axes) == tuple(sorted(map(tuple, groups.values())))


@pytest.mark.parametrize("cap", CAPS[1:])
def test_chunks_cut_each_device_groups_buffer_into_ceil_bytes_over_cap(cap):
    gp = _problem(cap)
    for choice in _random_choices(gp.problem, 5):
        syncs = _syncs(gp, choice)
        chunks = fill_buckets(syncs, cap, gp.ctx)
        assert sum(c.collective.bytes for c in chunks) == sum(b.collective.bytes for _, b in syncs)
        for buf in {c.buffer for c in chunks}:
            mine = [c for c in chunks if c.buffer == buf]
            total = mine[-1].stop
            assert [c.start for c in mine] == [0] + [c.stop for c in mine[:-1]]  # contiguous
            itemsize = mine[0].collective.bytes / (mine[0].stop - mine[0].start)
            assert len(mine) == math.ceil(total * itemsize / cap)
            # members overlap their chunk, and the launcher is the last of them to be ready
            for c in mine:
                assert all(m.start < c.stop and m.stop > c.start for m in c.members)
                assert c.launcher == c.members[-1].layer


def test_cap_zero_is_one_allreduce_per_op_and_axes():
    gp = _problem(0.0)
    syncs = _syncs(gp, _random_choices(gp.problem, 1)[0])
    chunks = fill_buckets(syncs, 0.0, gp.ctx)
    assert sorted((c.launcher, c.collective) for c in chunks) == sorted(
        (layer, b.collective) for layer, b in syncs)


@pytest.mark.parametrize("cap", CAPS)
def test_realised_cost_is_the_problem_objective_for_any_choice(cap):
    """The plan's priced collectives (fused chunks included) cost exactly the objective the
    ILP minimises — for random choices, not just the optimum."""
    gp = _problem(cap)
    for choice in _random_choices(gp.problem, 8, seed=1):
        _, cost = realise(gp, choice)
        assert cost.total_s == pytest.approx(gp.problem.objective(choice), rel=1e-9)


def test_ilp_with_buckets_equals_exhaustive_and_pruning_keeps_the_optimum():
    graph = models.mlp([16, 32, 32, 32, 8], batch=8)  # 4 KiB: several chunks per device group
    gp = _problem(4096.0, graph, tie=False)
    p = gp.problem
    assert p.buckets is not None and p.buckets.alpha.size >= 2
    brute = exhaustive(p)
    ilp = SbpIlp(p).solve()
    assert ilp.status == "optimal"
    assert ilp.objective == pytest.approx(brute.objective, rel=1e-9)
    pruned = p.subset(dominated_free(p))
    assert exhaustive(pruned).objective == pytest.approx(brute.objective, rel=1e-9)
    # the bucket term changes the answer: the per-op optimum is another plan, dearer here
    per_op = exhaustive(_problem(0.0, graph, tie=False).problem)
    assert per_op.choice != ilp.choice
    assert ilp.objective < p.objective(per_op.choice)
    # a larger cap (fewer chunks) is cheaper still: the ceiling is binding at 4 KiB
    assert exhaustive(_problem(25 * 2**20, graph, tie=False).problem).objective < ilp.objective


def test_incremental_search_scores_include_the_bucket_latency():
    p = _problem(700.0).problem
    ev = _Evaluator(p)
    for choice in _random_choices(p, 4, seed=2):
        for g in range(p.num_groups):
            local = ev.local(np.array(choice), g)
            for k in range(len(p.cost[g])):
                moved = list(choice)
                moved[g] = k
                assert local[k] - local[choice[g]] == pytest.approx(
                    p.objective(moved) - p.objective(choice), abs=1e-12)


def test_chain_dp_refuses_bucket_terms():
    with pytest.raises(ValueError, match="grad_bucket_bytes=0"):
        chain_dp(_problem(700.0, models.mlp([16, 32, 8], batch=8), tie=False).problem)


def test_chunk_count_rounds_up_and_counts_nothing_for_no_gradient():
    assert chunk_count(0.0, 10.0) == 0
    assert chunk_count(1.0, 10.0) == 1
    assert chunk_count(10.0, 10.0) == 1
    assert chunk_count(10.5, 10.0) == 2
    assert list(chunk_count(np.array([0.0, 25.0]), 10.0)) == [0, 3]


def _layer(name: str, compute: float, *colls: Collective) -> LayerPlan:
    lay = Layout.replicated((MeshAxis(1, 2),))
    return LayerPlan(name, "linear", "x", (lay,), None, lay, compute, 0.0, colls)


def _c(seconds: float, phase: str, purpose: str) -> Collective:
    return Collective(CollectiveKind.ALL_REDUCE, 2, 1.0, "intra", seconds, (0,), phase, purpose)


def test_exposed_grad_sync_closed_form():
    """Backward in reverse: c (2 s), b (1 s + a 0.5 s collective), a (3 s). c's chunk (4 s)
    starts at 2 and ends at 6; b's (1 s) waits for it, 6 → 7; a's (0.5 s) starts when a's
    backward ends at 6.5 and the channel frees at 7, so it ends at 7.5: 7.5 − 6.5 = 1 s
    exposed, plus the tied exchange (0.25 s) after all of them."""
    layers = [
        _layer("a", 4.5, _c(0.5, "backward", "grad_sync"), _c(0.25, "step", "tied_weight")),
        _layer("b", 1.5, _c(0.5, "backward", "activation"), _c(9.0, "forward", "activation"),
               _c(1.0, "backward", "grad_sync")),
        _layer("c", 3.0, _c(4.0, "backward", "grad_sync")),
    ]
    assert exposed_grad_sync(layers) == pytest.approx(1.25)
    # nothing to hide behind: one chunk launched by the first layer is fully exposed
    assert exposed_grad_sync([_layer("a", 3.0, _c(2.0, "backward", "grad_sync"))]) == 2.0


def test_config_reads_the_bucket_cap(tmp_path):
    base = load_config("configs/tiny-mlp-cpu.yaml")
    assert base.grad_bucket_bytes == 25 * 2**20
    assert base.with_overrides({"training.grad_bucket_mb": 1}).grad_bucket_bytes == 2**20
    for bad in (-1, "many"):
        with pytest.raises(ConfigError, match="training.grad_bucket_mb"):
            base.with_overrides({"training.grad_bucket_mb": bad})


def test_the_last_backward_is_the_last_in_action_order():
    """A schedule may run its backwards out of micro-batch order: the gradients are complete
    (and the chunks may be launched) only in the last B action, not the highest index."""
    from runtime.grad_sync import last_backward

    assert last_backward([("F", 0), ("F", 1), ("B", 1), ("B", 0)]) == 0
    assert last_backward([("F", 0), ("B", 0), ("F", 1), ("B", 1), ("W", 1)]) == 1
    assert last_backward([("F", 0), ("SF", 0)]) is None


def test_gradients_of_different_element_sizes_fill_a_buffer_each():
    """Like DDP's buckets, a buffer holds one dtype: float32 and float64 gradients over
    the same devices are two buffers, each cut by the cap on its own bytes, and the ILP
    prices each buffer's chunks — the realised cost is the objective for any choice, and
    the ILP's optimum the exhaustive one."""
    spec = {"kind": "graph", "ops": [
        {"name": "x", "kind": "input", "shape": [8, 16]},
        {"name": "fc1", "kind": "linear", "inputs": ["x"], "shape": [8, 16], "weight": [16, 16]},
        {"name": "fc2", "kind": "linear", "inputs": ["fc1"], "shape": [8, 4], "weight": [16, 4],
         "dtype": "float64"},
        {"name": "loss", "kind": "loss", "inputs": ["fc2"], "shape": [1]}]}
    graph = models.graph_from_spec(spec)
    cap = 700.0
    gp = _problem(cap, graph, tie=False)
    seen = 0
    for choice in _random_choices(gp.problem, 30, seed=3):
        syncs = _syncs(gp, choice)
        chunks = fill_buckets(syncs, cap, gp.ctx)
        for buf in {c.buffer for c in chunks}:
            sizes = {c.collective.bytes / (c.stop - c.start) for c in chunks if c.buffer == buf}
            assert len(sizes) == 1  # one dtype a buffer
        pairs = {(device_groups(c.fact, c.axes), c.collective.bytes / (c.stop - c.start))
                 for c in chunks}
        assert len(pairs) == len({c.buffer for c in chunks})
        groups = [g for g, _ in pairs]
        seen += len(set(groups)) < len(groups)  # the same devices, two dtypes: two buffers
        _, cost = realise(gp, choice)
        assert cost.total_s == pytest.approx(gp.problem.objective(choice), rel=1e-9)
    assert seen  # some choices synchronise both dtypes over the same devices
    assert SbpIlp(gp.problem).solve().objective == pytest.approx(
        exhaustive(gp.problem).objective, rel=1e-9)
