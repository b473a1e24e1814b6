"""Every shipped config solved with its baselines, side by side in one run: the plan's step
time, each baseline's ratio (baseline time / plan time, > 1 means the plan is faster), the
solver status, the wall time of the solve and how it splits between the plan and the
baselines, with their ratio (baselines s / plan s: issue 33 asks for at most 1). All
figures come from the lowered programs (what the runtime executes), so these are the
honest-price ratios. Every family either prices or says why not (below the table:
the member each family's price comes from, or the memory it lacks).

Run: python benchmarks/shipped_configs.py [CONFIG ...] (config names, e.g. llama-70b-16x8:
those rows only; default every shipped config)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from ilp_planner.api import solve
from ilp_planner.intra_op.request import PhaseTimes
from ilp_planner.reports.explain import step_seconds

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
BASELINES = ("ilp_single_mesh", "data_parallel", "megatron", "megatron_sp", "summa", "torchtitan")


def main(names: list[str]) -> None:
    configs = [p for p in CONFIGS if not names or p.stem in names]
    if names and len(configs) != len(set(names)):
        sys.exit(f"unknown config in {names}; expected names of {[p.stem for p in CONFIGS]}")
    head = f"{'config':<26}{'stages':>7}{'step s':>11}" + "".join(f"{b:>17}" for b in BASELINES) \
        + f"{'status':>10}{'solve s':>9}{'plan s':>8}{'base s':>8}{'base/plan':>10}"
    print(head)
    print("-" * len(head))
    notes: list[str] = []
    for path in configs:
        times = PhaseTimes()
        t0 = time.perf_counter()
        plan = solve(path, times=times)
        wall = time.perf_counter() - t0
        mine = step_seconds(plan)
        cells = []
        for family in BASELINES:
            hits = [(k, v) for k, v in plan.baselines.items()
                    if k.split("(", 1)[0] == family and "pp=" not in k]
            if not hits:
                cells.append("—")
                continue
            k, v = hits[0]
            cells.append("n/a" if "error" in v else f"{v['total_s'] / mine:.2f}×")
            notes.append(f"  {path.stem} {family}: {v['error'] if 'error' in v else k}")
        print(f"{path.stem:<26}{max(1, len(plan.stages)):>7}{mine:>11.4g}"
              + "".join(f"{c:>17}" for c in cells)
              + f"{plan.solver.status:>10}{wall:>9.1f}{times.solve_s:>8.2f}"
              f"{times.baselines_s:>8.2f}{times.baselines_s / times.solve_s:>10.2f}",
              flush=True)
    for line in notes:
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
