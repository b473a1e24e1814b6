"""Simulated step time of GPipe, 1F1B and eager-1F1B (Zhuang et al. §5.2) for the shipped
GPT 2.6B and U-Transformer configs on 2 × 4 V100-like nodes.

For each model the stage DP and the per-stage ILP choose the stages once (with the config's
schedule); the resulting stage compute times and the solved cross-mesh resharding makespans
are then replayed under each schedule, with communication on its own stream (overlap) and
without. "signal send/recv" is the communication-free bound: the same schedule with every
transfer taking zero time (Zhuang et al.'s upper bound "Signal Send/Recv").

Run: python benchmarks/pipeline_schedules.py
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from formulations.schedules import make_schedule
from formulations.simulator import simulate
from ilp_planner.api import solve
from ilp_planner.inputs.config import load_config
from ilp_planner.inter_op.assembly import stage_durations

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SCHEDULES = ("gpipe", "1f1b", "eager-1f1b")


def main() -> None:
    for name in ("gpt-2.6b-2x4", "u-transformer-2x4"):
        config = load_config(CONFIGS / f"{name}.yaml")
        t0 = time.perf_counter()
        plan = solve(config, baselines=False)
        solve_s = time.perf_counter() - t0
        durations = stage_durations([s.times for s in plan.stages], plan.resharding)
        free = dataclasses.replace(durations,
                                   activation_transfer=(0.0,) * len(durations.activation_transfer),
                                   gradient_transfer=(0.0,) * len(durations.gradient_transfer))
        m = plan.schedule.num_microbatches
        S = len(plan.stages)
        per_mb = [round(f + b, 4) for f, b in
                  zip(durations.forward, durations.backward, strict=True)]
        meshes = [s.mesh for s in plan.stages]
        print(f"\n{name}: {S} stages {meshes}, {m} micro-batches, per-micro-batch stage time "
              f"{per_mb} s, transfer per boundary "
              f"{[round(t, 4) for t in durations.activation_transfer]} s (solved in {solve_s:.1f} s)")
        print(f"  {'schedule':<12}{'overlap s':>11}{'no-overlap s':>14}{'signal s/r':>12}"
              f"{'bubble':>9}{'vs signal':>11}{'peak in-flight':>16}")
        for s in SCHEDULES:
            sched = make_schedule(s, S, m)
            ov = simulate(sched, durations, overlap=True)
            no = simulate(sched, durations, overlap=False)
            bound = simulate(sched, free, overlap=True)
            print(f"  {s:<12}{ov.makespan_s:>11.4f}{no.makespan_s:>14.4f}{bound.makespan_s:>12.4f}"
                  f"{ov.bubble_fraction:>9.1%}{bound.makespan_s / ov.makespan_s:>11.1%}"
                  f"{str(list(ov.peak_inflight)):>16}")


if __name__ == "__main__":
    main()
