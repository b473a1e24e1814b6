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
unscale of every tensor the optimizer reads (a sharded bucket's shard, a whole block)."""

from __future__ import annotations

import collections
import json
import sys

import pytest

from ilp_planner.inputs.config import parse_config
from ilp_planner.ir.graph import OpKind
from ilp_planner.lowering.strategies import is_summa
from ilp_planner.reports.explain import step_seconds
from ilp_planner.testing import matmul_filter, restricted_plan, sharded_plan, three_d_filter
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
