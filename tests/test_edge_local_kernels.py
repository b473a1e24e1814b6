"""The local kernels of edge programs, priced as :mod:`runtime.comm` runs them
(:func:`~ilp_planner.lowering.redistribution.step_work`): by hand per kind, inside each
lowered step's seconds and the ILP's matrices alike, and — on two gloo ranks, counted at
dispatch — the kernels a tensor-parallel GPT block prices against the kernels its ranks
issue (the bias share ``b / p`` before a partial sum included). Program by program, the
kernels each rank issues are checked by ``tests/test_redistribution.py``'s gloo run."""

from __future__ import annotations

import collections
import itertools
import json
import math
import sys

import pytest

from ilp_planner.intra_op.baselines import megatron_filter
from ilp_planner.ir.cluster import Cluster, Link, MeshAxis
from ilp_planner.ir.device import ComputeFit, DeviceSpec
from ilp_planner.ir.graph import TensorSpec
from ilp_planner.ir.layouts import B, Layout, P, S
from ilp_planner.lowering.compute_model import PhaseWork, phase_seconds
from ilp_planner.lowering.cost_model import CollectiveKind, collective_seconds
from ilp_planner.lowering.redistribution import (
    plan_redistribution,
    planner_for,
    slice_work,
    step_local_work,
    step_work,
)
from ilp_planner.reports.explain import step_seconds
from ilp_planner.testing import restricted_plan
from tests.helpers.procs import run
from tests.test_zero_passes import _config

K = CollectiveKind
N = 4096.0  # the formula's n, bytes


@pytest.mark.parametrize(("kind", "uneven", "kernels", "moved"), [
    (K.ALL_REDUCE, False, 1, 2 * N),  # a fresh copy to reduce in place
    (K.ALL_REDUCE, True, 2, 4 * N),  # the padded copy, and the block copied out
    (K.REDUCE_SCATTER, False, 1, 2 * N),  # the stack of the k pieces
    (K.REDUCE_SCATTER, True, 1 + 4 + 1, 2 * N + 2 * N + 2 * N / 4),  # + k pads, the unpadding
    (K.ALL_GATHER, False, 1, 2 * N),  # the cat of the k blocks
    (K.ALL_GATHER, True, 2, 2 * N + 2 * N / 4),  # + the block's pad
    (K.ALL_TO_ALL, False, 2, 4 * N),  # stack and cat
    (K.ALL_TO_ALL, True, 2 + 4, 4 * N + 2 * N),  # + k pads
])
def test_a_steps_local_kernels_by_hand(kind, uneven, kernels, moved) -> None:
    assert step_local_work(kind, N, 4, uneven) == PhaseWork(0.0, moved, kernels)


def test_a_slice_copies_only_a_strided_piece() -> None:
    """``B → S(d)`` keeps a view where no dim before ``d`` holds more than one element
    (the runtime's ``_slice``), else copies the piece once."""
    fact = (MeshAxis(1, 4),)
    rows, cols = Layout(fact, (S(0),)), Layout(fact, (S(1),))
    whole = Layout(fact, (B,))
    for tensor, dst, kernels in ((T, rows, 0), (T, cols, 1), (TensorSpec((1, 32)), cols, 0)):
        [step] = plan_redistribution(whole, dst, tensor, _device_cluster(1, 4)).steps
        assert step.collective is None
        assert step_work(step, tensor) == slice_work(
            math.prod(dst.padded_shape(tensor.shape)) * tensor.itemsize, bool(kernels))
        assert step_work(step, tensor).kernels == kernels
        assert (step.local_s > 0) == bool(kernels)


def _device_cluster(nodes: int, local: int) -> Cluster:
    dev = DeviceSpec("t", 80 * 2**30, {"float32": 1e14, "bfloat16": 1e14}, 1e11, (),
                     ComputeFit(0.8, 128.0, 0.7, 5e-6, "flash", 2e-6))
    return Cluster(nodes, local, 80 * 2**30, 1e14, Link(2e-6, 1e-11), Link(3e-5, 4e-10), 0.5,
                   "t", dev)


T = TensorSpec((16, 32), "bfloat16")


def test_a_lowered_step_costs_its_call_and_its_local_kernels() -> None:
    """(S0, P) → (S0, S1) on 1 × 2 × 4: one ReduceScatter over 4, its seconds the α–β
    call's and the stack's; on a flat cluster the call's alone."""
    fact = (MeshAxis(1, 2), MeshAxis(1, 4))
    src, dst = Layout(fact, (S(0), P)), Layout(fact, (S(0), S(1)))
    n = T.nbytes / 2
    for c, local in ((_device_cluster(1, 8), True), (Cluster(1, 8, 80e9, 1e14, Link(2e-6, 1e-11),
                                                             Link(3e-5, 4e-10)), False)):
        [col] = plan_redistribution(src, dst, T, c).forward
        call = collective_seconds(K.REDUCE_SCATTER, 4, n, c, False, 1)
        kernels = phase_seconds(PhaseWork(0.0, 2 * n, 1), c.device, "bfloat16") if local \
            else 0.0
        assert (col.kind, col.bytes) == (K.REDUCE_SCATTER, n)
        assert col.seconds == pytest.approx(call + kernels, rel=1e-12)
        assert (kernels > 0) == local


@pytest.mark.parametrize("shape", [(16, 32), (12, 10)])  # even, and uneven on 2 × 4
def test_the_ilp_prices_each_path_as_its_steps(shape) -> None:
    """The ILP's matrices (Dijkstra over every move, local kernels included) price each
    pair as the lowered program's steps add up: the same seconds, an uneven split's pads
    included."""
    c = _device_cluster(2, 4)
    tensor = TensorSpec(shape, "bfloat16")
    facts = [(MeshAxis(2, 4),), (MeshAxis(2, 1), MeshAxis(1, 4)), (MeshAxis(1, 4), MeshAxis(2, 1))]
    lays = [Layout(f, pls) for f in facts
            for pls in itertools.product([B, P, S(0), S(1)], repeat=len(f))]
    srcs = lays[::2]
    dsts = [lay for lay in lays if not lay.has_partial]
    planner = planner_for(srcs[0], c)
    matrix = planner.forward_costs(srcs, dsts, tensor)
    priced = 0
    for i, s in enumerate(srcs):
        for j, d in enumerate(dsts):
            red = plan_redistribution(s, d, tensor, c)
            assert matrix[i, j] == pytest.approx(red.forward_seconds, rel=1e-9, abs=1e-13)
            priced += bool(red.forward)
    assert priced > 50


def _tp_block(sequence_parallel: bool, tmp_path) -> tuple[int, collections.Counter]:
    """One Megatron block's priced kernels (every kernel a second of host time, nothing
    else costing anything: :func:`tests.test_zero_passes._config`) and rank 0's dispatched
    ones — a 3-block plan's less a 2-block's, on tensor parallelism over two ranks."""
    keep = megatron_filter(MeshAxis(1, 1), MeshAxis(1, 2), sequence_parallel)
    priced, counts = [], []
    for layers in (2, 3):
        plan = restricted_plan(_config(layers, "bfloat16", 2), keep)
        path = tmp_path / f"tp{layers}.json"
        plan.save(path)
        out = tmp_path / f"k{layers}"
        done = run([sys.executable, "-m", "tests.helpers.rank_kernels", str(path), str(out),
                    "2"], timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        ranks = [json.loads((tmp_path / f"{out.name}.{r}").read_text()) for r in (0, 1)]
        assert ranks[0] == ranks[1]  # tensor parallel: both ranks run the same kernels
        priced.append(step_seconds(plan))
        counts.append(collections.Counter(ranks[0]))
    assert priced[1] - priced[0] == pytest.approx(round(priced[1] - priced[0]), abs=1e-6)
    counts[1].subtract(counts[0])
    return round(priced[1] - priced[0]), counts[1]


@pytest.mark.parametrize("sequence_parallel", [
    True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_tensor_parallel_block_prices_the_kernels_its_ranks_dispatch(
        sequence_parallel: bool, tmp_path) -> None:
    """Megatron and Megatron-SP on two ranks: the kernels a GPT block prices equal those
    each rank dispatches — the row-parallel biases' shares (``b / p``) and any edge
    program's local kernels included — but for the layernorms' backward, which the model
    counts as the two CUDA kernels it launches (dx; dγ and dβ) and dispatch counts once.
    (Every kernel costing a second and no collective anything, the planner lowers each
    edge to collectives that need no local kernel: their counts are checked program by
    program in ``tests/test_redistribution.py``'s gloo run.)"""
    priced, block = _tp_block(sequence_parallel, tmp_path)
    assert block["aten::div @ ops.py:forward"] > 0  # the row-parallel biases' shares
    twice = sum(v for k, v in block.items() if k.startswith("aten::native_layer_norm_backward"))
    assert priced == sum(block.values()) + twice, sorted(block.items())
