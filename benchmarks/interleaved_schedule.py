"""Interleaved 1F1B (Narayanan et al. SC'21 §2.2.2) against 1F1B: the simulator beside the
closed form, then the planner's own pipelines of the shipped GPT 2.6B config.

1. Equal chunks, free communication: the simulated bubble (makespan over the ideal
   ``M(f + b)``, minus 1) of 1F1B and of interleaved 1F1B with ``v`` chunks per stage, beside
   the closed forms ``(p − 1)/M`` and ``(p − 1)/(v·M)``.
2. ``configs/gpt-2.6b-2x4.yaml`` (2 stages on 2 × 4 V100-like devices) at 16 and at 4
   micro-batches: the stage DP's 1F1B pipeline and the interleaved ones the planner builds
   (``schedule: interleaved-1f1b``, ``v`` = 2 and 4): simulated step, bubble, peak in-flight
   activations per stage and memory per device.

Run: python benchmarks/interleaved_schedule.py
"""

from __future__ import annotations

import time
from pathlib import Path

from formulations.simulator import simulate_named
from ilp_planner.api import solve
from ilp_planner.errors import InfeasibleError
from ilp_planner.inputs.config import load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def bubbles() -> None:
    """Part 1: simulated bubble vs closed form, chunks of f/v = 1/v and b/v = 2/v."""
    print(f"{'p':>3}{'M':>5}{'1F1B':>9}{'(p-1)/M':>9}" + "".join(
        f"{f'v={v}':>9}{'closed':>9}" for v in (2, 4)))
    for p in (2, 4, 8):
        for m in (p, 4 * p, 16 * p):
            plain = simulate_named("1f1b", p, m, 1.0, 2.0).makespan_s / (3.0 * m) - 1
            row = f"{p:>3}{m:>5}{plain:>9.4f}{(p - 1) / m:>9.4f}"
            for v in (2, 4):
                sim = simulate_named("interleaved-1f1b", p, m, 1.0 / v, 2.0 / v, virtual_stages=v)
                row += f"{sim.makespan_s / (3.0 * m) - 1:>9.4f}{(p - 1) / (v * m):>9.4f}"
            print(row)


def planner() -> None:
    """Part 2: the planner's 1F1B and interleaved pipelines of GPT 2.6B."""
    base = load_config(CONFIGS / "gpt-2.6b-2x4.yaml")
    print(f"\n{'micro-batches':<14}{'schedule':<22}{'step s':>9}{'bubble':>8}"
          f"{'peak in-flight':>16}{'GiB/device':>12}{'solve s':>9}")
    for m in (16, 4):
        for schedule, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4)):
            pipe = {"stages": 2, "microbatches": m, "schedule": schedule, "virtual_stages": v}
            t0 = time.perf_counter()
            try:
                plan = solve(base.with_overrides({"pipeline": pipe}), baselines=False)
            except InfeasibleError as exc:
                print(f"{m:<14}{schedule + f' v={v}':<22}  infeasible: {str(exc)[:90]}")
                continue
            sim = plan.schedule.simulated
            print(f"{m:<14}{schedule + f' v={v}':<22}{plan.step_s:>9.4f}{sim.bubble_fraction:>8.1%}"
                  f"{str(list(sim.peak_inflight)):>16}{plan.cost.peak_memory_bytes / 2**30:>12.2f}"
                  f"{time.perf_counter() - t0:>9.1f}")


if __name__ == "__main__":
    bubbles()
    planner()
