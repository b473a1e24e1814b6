"""State sharding's passes, priced as the runtime runs them
(:func:`~ilp_planner.lowering.compute_model.state_shard_seconds`): by hand for one bucket at
each level, and — on two gloo ranks, counted at dispatch — the kernels one GPT block's
sharded buckets issue against the kernels its plan prices."""

from __future__ import annotations

import collections
import dataclasses
import json
import sys

import pytest

from ilp_planner.inputs.config import parse_config
from ilp_planner.ir.cluster import Cluster, Link
from ilp_planner.ir.device import ComputeFit, DeviceSpec
from ilp_planner.ir.graph import Op, OpKind, TensorSpec
from ilp_planner.lowering.compute_model import shard_cast_seconds, state_shard_seconds
from ilp_planner.reports.explain import step_seconds
from ilp_planner.testing import sharded_plan
from tests.helpers.procs import run

HBM = 1e12


def _cluster(dispatch_s: float) -> Cluster:
    dev = DeviceSpec("t", 80 * 2**30, {"bfloat16": 1e15, "float32": 1e15}, HBM, (),
                     ComputeFit(0.8, 128.0, 1.0, 0.0, "flash", dispatch_s))
    link = Link(1e-5, 1e-10)
    return Cluster(1, 4, 80 * 2**30, 1e15, link, link, 0.5, "t", dev)


def _linear(dtype: str) -> Op:
    return Op("fc", OpKind.LINEAR, ("x",), TensorSpec((8, 16), dtype),
              weight=TensorSpec((16, 16), dtype), params=272, attrs={"bias": True})


# one bucket: R = 2 roles, N = 1000 elements of padded local blocks, p = 4 (s = 250, n = 1000)
R, N, P, S, M = 2, 1000, 4, 250, 3


@pytest.mark.parametrize(("level", "dtype", "kernels", "moved"), [
    # zero both gradients; R adds a micro-batch; the shard's add; the cast; R copies
    (1, "bfloat16", 2 + R * M + 1 + 1 + R,
     4 * N + 4 * S + M * 10 * N + 12 * S + 6 * S + 4 * N),
    # ZeRO-2: the shard's add and the flat buffer's zeroing every micro-batch
    (2, "bfloat16", 2 + M * (R + 2) + 1 + R,
     4 * N + 4 * S + M * (10 * N + 12 * S + 4 * N) + 6 * S + 4 * N),
    (1, "float32", 2 + R * M + 1 + R, 4 * N + 4 * S + M * 12 * N + 12 * S + 8 * N),
    # ZeRO-3 a micro-batch: 2 gathers' casts, R slice_backwards of 2 kernels, R - 1 adds, the
    # reduce-scatter's cast; the shard's gradient accumulated from the second on
    (3, "bfloat16", M * (2 + 2 * R + R - 1 + 1) + M - 1,
     M * (2 * 6 * S + R * 2 * N + 2 * 2 * N + (R - 1) * 6 * N + 6 * N) + (M - 1) * 12 * S),
    (3, "float32", M * (2 * R + R - 1) + M - 1,
     M * (R * 4 * N + 2 * 4 * N + (R - 1) * 12 * N) + (M - 1) * 12 * S),
])
def test_a_buckets_passes_by_hand(level: int, dtype: str, kernels: int, moved: float) -> None:
    """Bytes at the bandwidth where the device binds, kernels × the host's time where it
    does (its reads of the weights: two gathers a micro-batch at ZeRO-3)."""
    op, bucket = _linear(dtype), [(R, N, P, True)]
    assert state_shard_seconds(op, bucket, level, M, _cluster(0.0)) == \
        pytest.approx(moved / HBM, rel=1e-12)
    assert state_shard_seconds(op, bucket, level, M, _cluster(1.0)) == pytest.approx(kernels)


def test_an_unread_zero3_bucket_gathers_once_but_under_recomputation() -> None:
    """A ZeRO-3 bucket whose backward reads no weight (the first layer's, an embedding's)
    casts its shard once a micro-batch; a recomputation gathers it again, one cast
    (:attr:`~ilp_planner.intra_op.problem.NodeOption.recompute_cast_s`), whose host time is
    a replayed kernel's."""
    op, host = _linear("bfloat16"), _cluster(1.0)
    read = state_shard_seconds(op, [(R, N, P, True)], 3, M, host)
    unread = state_shard_seconds(op, [(R, N, P, False)], 3, M, host)
    assert read - unread == pytest.approx(M)
    assert shard_cast_seconds(op, N, P, host) == pytest.approx(1.0)
    replaying = dataclasses.replace(host, device=dataclasses.replace(
        host.device, fit=dataclasses.replace(host.device.fit, replay_s=0.5)))
    assert shard_cast_seconds(op, N, P, replaying, replayed=True) == pytest.approx(1.5)
    assert shard_cast_seconds(_linear("float32"), N, P, host) == 0.0


def _config(layers: int, dtype: str, microbatches: int):
    """A tiny GPT on two devices whose every kernel costs a second of host time and nothing
    else costs anything: its predicted step's seconds are the kernels it prices."""
    free = {"latency_us": 0, "bandwidth_gbps": 1e9}
    return parse_config({
        "model": {"kind": "gpt", "hidden": 64, "layers": layers, "heads": 4, "seq_len": 16,
                  "vocab": 128, "batch": 8, "dtype": dtype},
        "cluster": {"name": "two", "nodes": 1, "devices_per_node": 2, "memory_gib": 2,
                    "peak_tflops": 1e6, "links": {"intra": free, "inter": free},
                    "compute": {"hbm_gbps": 1e9, "peak_tflops": 1e6, "kernel_floor_us": 0,
                                "dispatch_us": 1e6}},
        "training": {"optimizer": "adam"}, "pipeline": {"microbatches": microbatches}})


def _step(level: int, layers: int, dtype: str, microbatches: int, recompute: bool,
          tmp_path) -> tuple[float, collections.Counter]:
    """(priced kernels, rank 0's dispatched kernels by op and frame) of the plan sharding
    every op it can at ``level``."""
    plan = sharded_plan(_config(layers, dtype, microbatches), level, recompute=recompute)
    path = tmp_path / f"z{level}-{layers}.json"
    plan.save(path)
    out = tmp_path / f"k{level}-{layers}"
    done = run([sys.executable, "-m", "tests.helpers.rank_kernels", str(path), str(out), "2"],
               timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"{out.name}.{r}").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]  # data parallel: both ranks run the same program
    return step_seconds(plan), collections.Counter(ranks[0])


def _block_kernels(level: int, dtype: str, microbatches: int, recompute: bool, tmp_path
                   ) -> tuple[int, collections.Counter]:
    """One block's priced kernels and dispatched ones: a 3-block plan's less a 2-block's."""
    (p2, d2), (p3, d3) = (_step(level, n, dtype, microbatches, recompute, tmp_path)
                          for n in (2, 3))
    assert p3 - p2 == pytest.approx(round(p3 - p2), abs=1e-6)
    d3.subtract(d2)
    return round(p3 - p2), d3


@pytest.mark.parametrize(("level", "dtype", "microbatches", "recompute"), [
    pytest.param(1, "bfloat16", 2, False, marks=pytest.mark.slow),
    pytest.param(2, "bfloat16", 2, False, marks=pytest.mark.slow),
    (3, "bfloat16", 2, False),
    pytest.param(3, "bfloat16", 2, True, marks=pytest.mark.slow),
    pytest.param(3, "float32", 1, False, marks=pytest.mark.slow),
])
def test_a_sharded_block_prices_the_kernels_its_ranks_dispatch(
        level: int, dtype: str, microbatches: int, recompute: bool, tmp_path) -> None:
    """A GPT block with every weight's state sharded at ``level``, on two gloo ranks: the
    kernels it prices equal those each rank dispatches, but for two kinds the model counts
    as the two CUDA kernels they launch and dispatch counts once — the layernorms' backward
    (dx; dγ and dβ) and ZeRO-3's ``slice_backward`` (a zero fill and a copy). The edge
    programs' local kernels count too (:mod:`tests.test_edge_local_kernels`)."""
    priced, block = _block_kernels(level, dtype, microbatches, recompute, tmp_path)
    # the block's buckets are sharded and their passes ran (ZeRO-3 in float32 casts
    # nothing: its passes are autograd's, the flat gradient's slices)
    if level == 3:
        assert block["aten::slice_backward @ step_loop.py:backward"] > 0
    else:
        assert block["aten::add_ @ zero_state.py:_accumulate"] > 0
    dispatched = sum(block.values())
    twice = sum(v for k, v in block.items()
                if k.startswith(("aten::native_layer_norm_backward", "aten::slice_backward")))
    assert priced == dispatched + twice, sorted(block.items())
