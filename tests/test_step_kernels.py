"""A whole training step's kernels on several gloo ranks, priced against dispatched: a tiny
GPT whose every kernel costs a second of host time and nothing else costs anything, so
its predicted step's seconds are the kernels it prices (one device:
:mod:`tests.test_host_time`). Counted by :mod:`tests.helpers.rank_kernels` on every rank.

What the model prices but the runtime does not dispatch, by name: each layernorm's
backward, one aten op that CUDA runs as two kernels (dx; dγ and dβ), which the model
counts. What the runtime dispatches unpriced, by name: the optimizer's two fused calls a
step (Adam's update and its step counts, priced as bytes shared by every op) and the zero
fill of each flat gradient buffer at the step's start (one a device group). Nothing
else differs: SUMMA's gathered weight casts and its weight's gradient additions outside
the buckets, the loss's reductions' copies, a vocabulary-split lookup's mask, the float16
unscale of every tensor the optimizer reads (a sharded bucket's shard, a whole block).

A pipelined plan is checked stage by stage: each rank of a stage dispatches the kernels the
stage prices, its cross-mesh transfers' copies and fills and the tied table's exchange
across the stages included."""

from __future__ import annotations

import collections
import json
import sys

import pytest

from ilp_planner.api import solve
from ilp_planner.inputs.config import parse_config
from ilp_planner.ir.graph import OpKind
from ilp_planner.lowering.strategies import is_summa
from ilp_planner.reports.explain import step_seconds
from ilp_planner.testing import (
    matmul_filter,
    pipelined_plan,
    restricted_plan,
    sharded_plan,
    three_d_filter,
)
from tests.helpers.procs import run

LAYERS = 2
LAYERNORMS = 2 * LAYERS + 1  # two a block and the final one


def _config(devices: int, dtype: str, microbatches: int):
    free = {"latency_us": 0, "bandwidth_gbps": 1e9}
    return parse_config({
        "model": {"kind": "gpt", "hidden": 64, "layers": LAYERS, "heads": 4, "seq_len": 16,
                  "vocab": 128, "batch": 8, "dtype": dtype},
        "cluster": {"name": "kernels", "nodes": 1, "devices_per_node": devices,
                    "memory_gib": 2, "peak_tflops": 1e6, "links": {"intra": free, "inter": free},
                    "compute": {"hbm_gbps": 1e9, "peak_tflops": 1e6, "kernel_floor_us": 0,
                                "dispatch_us": 1e6}},
        "training": {"optimizer": "adam"}, "pipeline": {"microbatches": microbatches}})


def _summa_matmuls(op, s) -> bool:
    """Every linear as SUMMA (the embedding and the tied head as they may)."""
    return op.kind is OpKind.EMBEDDING or op.attrs.get("tied") or is_summa(s.label)


CASES = {
    # SUMMA 2 × 2 in float16: casts at the gathered size, the weight outside every bucket
    "summa-fp16": (4, "float16", 2, lambda c: restricted_plan(c, matmul_filter(_summa_matmuls))),
    # the same with ZeRO-1: the bias's shard and the weight's whole block unscaled
    "summa-zero1-fp16": (4, "float16", 2,
                         lambda c: sharded_plan(c, 1, keep=matmul_filter(_summa_matmuls))),
    # the vocabulary split two ways: the lookup's mask, the loss's reductions on copies
    "vocab-bf16": (2, "bfloat16", 1, lambda c: restricted_plan(c, three_d_filter((1, 1, 2)))),
    # data parallel in float16: the loss reported on a copy, every gradient bucketed
    "dp-fp16": (2, "float16", 2, lambda c: restricted_plan(c, three_d_filter((2, 1, 1)))),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_step_prices_the_kernels_every_rank_dispatches(case: str, tmp_path) -> None:
    devices, dtype, microbatches, plan_of = CASES[case]
    plan = plan_of(_config(devices, dtype, microbatches))
    path = tmp_path / "plan.json"
    plan.save(path)
    out = tmp_path / "kernels"
    done = run([sys.executable, "-m", "tests.helpers.rank_kernels", str(path), str(out),
                str(devices)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    priced = step_seconds(plan)
    assert priced == pytest.approx(round(priced), abs=1e-6)
    for rank in range(devices):
        counts = collections.Counter(json.loads((tmp_path / f"kernels.{rank}").read_text()))
        fills = counts["aten::zero_ @ grad_sync.py:begin_step"]
        optimizer = sum(v for k, v in counts.items() if k.endswith("optim.py:step"))
        assert optimizer == 2
        assert round(priced) - sum(counts.values()) == \
            LAYERNORMS * microbatches - optimizer - fills, (case, rank, counts)


def _pipelined_config():
    return _config(4, "float32", 2).with_overrides(
        {"pipeline": {"stages": 2, "microbatches": 2, "schedule": "1f1b"}})


PIPELINED = {
    # the planner's own: data parallel on each stage, the tied table replicated on both
    "solved": lambda: solve(_pipelined_config(), baselines=False),
    # a hand-cut plan (mid-block: a residual crosses read by one add) with the table split
    # over the vocabulary: the head's gradient cut back from the sum's transpose
    "vocab-split": lambda: pipelined_plan(_config(4, "float32", 2), stages=2, microbatches=2,
                                          keep=three_d_filter((1, 1, 2))),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(PIPELINED))
def test_a_pipelined_step_prices_the_kernels_every_rank_dispatches(case: str, tmp_path) -> None:
    """Each stage's priced seconds (micro-batches × its forward and backward, and its
    gradient synchronisation) are the kernels each of its ranks dispatches, the cross-mesh
    transfers' copies and the tied table's exchange across the stages included, but for
    the named exceptions above and one more: the exchange's zero fill, priced for a stage's
    slowest devices, which its first does not run."""
    plan = PIPELINED[case]()
    assert len(plan.stages) == 2 and any(
        c.purpose == "tied_weight" for ly in plan.layers for c in ly.collectives)
    path = tmp_path / "plan.json"
    plan.save(path)
    out = tmp_path / "kernels"
    done = run([sys.executable, "-m", "tests.helpers.rank_kernels", str(path), str(out), "4"],
               timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    m = plan.schedule.num_microbatches
    for stage in plan.stages:
        t = stage.times
        priced = m * (t.forward_s + t.backward_s) + t.grad_sync_s
        assert priced == pytest.approx(round(priced), abs=1e-6)
        norms = sum(1 for ly in plan.layers if ly.stage == stage.index and ly.kind == "layernorm")
        for rank in stage.devices:
            counts = collections.Counter(json.loads((tmp_path / f"kernels.{rank}").read_text()))
            assert counts["aten::_fused_adam_ @ optim.py:step"] == 1
            assert any(k.endswith("transfers.py:recv_forward") or
                       k.endswith("transfers.py:recv_backward") for k in counts)
            fills = counts["aten::zero_ @ grad_sync.py:begin_step"]
            first = 1 if rank == stage.devices[0] else 0
            assert round(priced) - sum(counts.values()) == \
                norms * m - 2 - fills + first, (case, rank, counts)
