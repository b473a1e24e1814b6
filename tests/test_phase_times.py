"""The solve's time split (``PhaseTimes``: what ``ilp-planner solve`` prints as solving and
baselines) is the solver's own report on every path: on a pipelined plan, interleaved
1F1B included, solving is the report's build plus solve seconds (less any pipelined grid
it priced), and the single-mesh baselines priced beside it count as baselines — not
solving, as an interleaved solve's once did (``baselines 0.00 s``)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from ilp_planner.api import solve
from ilp_planner.intra_op.request import PhaseTimes

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.mark.parametrize("name", ["tiny-gpt-interleaved-cpu", "tiny-gpt-cpu"])
def test_the_split_follows_the_solvers_report(name):
    times = PhaseTimes()
    t0 = time.perf_counter()
    plan = solve(CONFIGS / f"{name}.yaml", times=times)
    wall = time.perf_counter() - t0
    assert plan.baselines and times.baselines_s > 0
    assert times.solve_s + times.baselines_s <= wall
    if plan.stages:  # pipelined: the report's own total is the solving
        report = plan.solver
        grid = report.stages.timings.get("grid_s", 0.0) if report.stages else 0.0
        assert times.solve_s == pytest.approx(report.build_s + report.solve_s - grid)


def test_without_baselines_everything_is_solving():
    times = PhaseTimes()
    plan = solve(CONFIGS / "tiny-gpt-interleaved-cpu.yaml", baselines=False, times=times)
    assert not plan.baselines
    assert times.baselines_s == 0 and times.solve_s > 0
