"""The configurations a user runs, priced beside the plan (``solve --compare``): one
paragraph each for ``summary`` and ``explain`` — step time, TFLOP/s per GPU beside the
plan's, the plan's speed-up, whether it fits memory (and by how much it does not), what
the plan does otherwise, and the engine flags that reproduce the configuration — and the
engine flags of the Megatron and torchtitan baseline rows."""

from __future__ import annotations

import math
import re

from ilp_planner.inputs.given_config import GivenConfig, engine_flags
from ilp_planner.plan.data import Plan

_GIB = 2**30
_BASELINE = re.compile(r"(megatron|megatron_sp|torchtitan)\(([^;()]*)\)")


def given_lines(plan: Plan) -> list[str]:
    """The paragraphs of the plan's priced configurations (its baselines entries with a
    ``given`` block); none when it has none."""
    out = []
    for name, block in plan.baselines.items():
        g = block.get("given")
        if not isinstance(g, dict):
            continue
        fit = ("fits memory" if g["fits"] else
               f"DOES NOT FIT: needs {g['peak_memory_bytes'] / _GIB:.4g} GiB per device, budget "
               f"{g['budget_bytes'] / _GIB:.4g} GiB "
               f"(over by {(g['peak_memory_bytes'] - g['budget_bytes']) / _GIB:.4g} GiB)")
        out += [f"{name}:",
                f"- step {g['step_s']:.6g} s, {g['tflops_per_gpu']:.4g} TFLOP/s per GPU (plan "
                f"{g['plan_tflops_per_gpu']:.4g}); plan speed-up {g['speedup']:.2f}x; {fit}",
                "- plan differs: " + ("; ".join(g["differs"]) or "nothing (same layout)"),
                *(f"- note: {n}" for n in g["notes"]),
                f"- flags: {g['flags']}"]
    return (["configurations compared (TFLOP/s: model FLOPs as Megatron counts them, "
             "recomputation included):", *out] if out else []) + baseline_flag_lines(plan)


def baseline_given(name: str, batch: int, microbatches: int) -> GivenConfig | None:
    """The engine configuration of a Megatron, Megatron-SP or (single-mesh) torchtitan
    baseline row, read from its name (``megatron(dp=2x2,tp=2)``,
    ``torchtitan(fsdp=4,tp=2,sp,ac=selective)``; an axis ``2x4`` is 8 devices), its
    micro-batch size from the global ``batch`` and the plan's ``microbatches``; None for
    any other row."""
    match = _BASELINE.fullmatch(name)
    if match is None:
        return None
    family, items = match.groups()
    kv = dict(item.split("=", 1) if "=" in item else (item, "true") for item in items.split(","))
    size = {k: math.prod(int(x) for x in v.split("x")) for k, v in kv.items()
            if k in ("dp", "tp", "ddp", "fsdp")}
    dp = size.get("dp", size.get("ddp", size.get("fsdp", 1)))
    if dp * microbatches == 0 or batch % (dp * microbatches):
        return None
    mbs = batch // (dp * microbatches)
    if family == "torchtitan":
        return GivenConfig("torchtitan", tp=size.get("tp", 1), replicate=size.get("ddp", 1),
                           shard=size.get("fsdp", 1), mbs=mbs, recompute=kv.get("ac", "none"),
                           sp="sp" in kv)
    return GivenConfig("megatron", tp=size.get("tp", 1), replicate=dp, mbs=mbs,
                       sp=family == "megatron_sp")


def baseline_flag_lines(plan: Plan) -> list[str]:
    """The engine flags reproducing each Megatron and torchtitan baseline row (as far as
    the engine can: its TP sits inside a node, where a baseline's may span nodes)."""
    model = plan.config.get("model") or {}
    pipe = plan.config.get("pipeline") or {}
    batch, micro = model.get("batch"), int(pipe.get("microbatches", 1) or 1)
    if not isinstance(batch, int):
        return []
    out = []
    for name, block in plan.baselines.items():
        g = None if "error" in block else baseline_given(name, batch, micro)
        if g is not None:
            out.append(f"- {name}: {engine_flags(g, batch, 0)}")
    return ["engine flags of the baselines:", *out] if out else []
