"""The mixture-of-experts configs solved beside their baselines, in one run: per config the
solve's status and wall time, the plan's step, the expert layout it chose for its MoE layers
(expert data-parallel × expert-parallel (or expert-sliced) × expert tensor-parallel degrees,
and the ZeRO level), the predicted share of the step spent in the dispatch and combine
AllToAlls, and each baseline's ratio (baseline step / plan step; > 1: the plan is faster).

Run: python benchmarks/moe_plans.py
"""

from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path

from ilp_planner.api import solve
from ilp_planner.lowering.cost_model import ONCE_PER_STEP
from ilp_planner.lowering.moe_strategies import COMBINE, DISPATCH
from ilp_planner.plan.data import Plan
from ilp_planner.reports.explain import step_seconds

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ("mixtral-8x7b-8x8", "deepseek-v2-lite-2x8", "tiny-moe-cpu")


def expert_layouts(plan: Plan) -> str:
    """The MoE layers' strategies, most common first: ``dp×ep×etp+zeroN (count)``."""
    seen: Counter[str] = Counter()
    for ly in plan.layers:
        m = re.match(r"moe\(dp=([\dx]+),(ep|xp)=([\dx]+),etp=([\dx]+)\)(\+zero\d)?", ly.strategy)
        if m:
            dp, role, ep, etp, zero = m.groups()
            seen[f"dp {dp}, {role} {ep}, etp {etp}{' ' + zero[1:] if zero else ''}"] += 1
    return "; ".join(f"{k} ({n})" for k, n in seen.most_common())


def all_to_all_seconds(plan: Plan, microbatches: int) -> float:
    """Predicted seconds of the dispatch and combine AllToAlls in one step."""
    return sum(c.seconds * (1 if c.purpose in ONCE_PER_STEP else microbatches)
               for ly in plan.layers for c in ly.collectives if c.purpose in (DISPATCH, COMBINE))


def main() -> None:
    for name in CONFIGS:
        t0 = time.perf_counter()
        plan = solve(ROOT / "configs" / f"{name}.yaml")
        wall = time.perf_counter() - t0
        step = step_seconds(plan)
        microbatches = plan.config.get("pipeline", {}).get("microbatches", 1)
        share = all_to_all_seconds(plan, microbatches) / step
        print(f"{name}: {plan.solver.status}, solved in {wall:.1f} s; step {step:.4g} s; "
              f"AllToAll {100 * share:.1f}% of the step")
        print(f"  experts: {expert_layouts(plan)}")
        for b, v in plan.baselines.items():
            print(f"  {b:<44}" + (f"n/a — {v['error']}" if "error" in v
                                  else f"{v['total_s'] / step:.2f}×"))


if __name__ == "__main__":
    main()
