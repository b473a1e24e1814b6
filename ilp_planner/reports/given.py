"""The configurations a user runs, priced beside the plan (``solve --compare``): one
paragraph each for ``summary`` and ``explain`` — step time, TFLOP/s per GPU beside the
plan's, the plan's speed-up, whether it fits memory (and by how much it does not), what
the plan does otherwise, and the engine flags that reproduce the configuration."""

from __future__ import annotations

from ilp_planner.plan.data import Plan

_GIB = 2**30


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
                f"  step {g['step_s']:.6g} s, {g['tflops_per_gpu']:.4g} TFLOP/s per GPU (plan "
                f"{g['plan_tflops_per_gpu']:.4g}); plan speed-up {g['speedup']:.2f}x; {fit}",
                "  plan differs: " + ("; ".join(g["differs"]) or "nothing (same layout)"),
                *(f"  note: {n}" for n in g["notes"]),
                f"  flags: {g['flags']}"]
    return (["configurations compared (TFLOP/s: model FLOPs as Megatron counts them, "
             "recomputation included):", *out] if out else [])
