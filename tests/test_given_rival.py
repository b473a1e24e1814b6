"""The compared configurations as rivals of the plan (``ilp_planner/inter_op/given_rival.py``):
the plan is never predicted slower than a pipelined ``compare:`` configuration that fits
its space — also where the stage DP alone (no interleaving) is slower than it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ilp_planner.api import solve
from ilp_planner.inputs.config import load_config
from ilp_planner.plan.check import check_plan
from ilp_planner.plan.data import Plan
from ilp_planner.reports.stages import stage_lines

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny-gpt-cpu.yaml"
FAST = "megatron: tp=2 pp=2 vpp=2 mbs=2"  # 2 micro-batches; interleaving halves the bubble
ALSO = "megatron: tp=4 pp=2 vpp=2 mbs=4"
OTHER_M = "megatron: tp=2 pp=2 vpp=2 mbs=1"  # 4 micro-batches: not the config's 2


@pytest.fixture(scope="module")
def config():
    """8 blocks of h 256 on 2 × 4 devices, 2 stages of 1F1B over 2 micro-batches: the stage
    DP's best 1F1B pipeline is slower than the interleaved compared configurations."""
    return load_config(TINY).with_overrides({
        "model.layers": 8, "model.hidden": 256, "pipeline.stages": 2,
        "pipeline.microbatches": 2, "pipeline.schedule": "1f1b"})




def test_the_plan_is_never_slower_than_a_compared_configuration(config):
    alone = solve(config, baselines=False, compare=[])
    plan = solve(config, baselines=False, compare=[FAST, ALSO])
    steps = [b["pipeline_s"] for b in plan.baselines.values() if "given" in b]
    assert len(steps) == 2 and all(b["given"]["fits"] for b in plan.baselines.values() if "given" in b)
    assert alone.step_s > max(steps)  # without the rivals the plan WAS slower than both
    assert plan.step_s == pytest.approx(min(steps), rel=1e-9)
    assert plan.schedule.virtual_stages == 2 and len(plan.stages) == 4
    assert "kept the compared configuration" in plan.solver.message
    assert plan.solver.message.count("offered as the plan") == 1  # the slower rival, named
    fastest = min((b for b in plan.baselines.values() if "given" in b), key=lambda b: b["pipeline_s"])
    assert fastest["given"]["differs"] == []  # the plan is that configuration


def test_a_compared_configuration_outside_the_space_is_named_not_kept(config):
    plan = solve(config, baselines=False, compare=[OTHER_M, "megatron: tp=1 pp=4 mbs=2"])
    assert plan.schedule.virtual_stages == 1 and len(plan.stages) == 2
    assert "not offered as the plan (4 micro-batches, the config's pipeline.microbatches is 2)" \
        in plan.solver.message
    assert "not offered as the plan (4 stages, the config's pipeline.stages is 2)" \
        in plan.solver.message


def test_the_kept_plan_prints_its_stages_in_full(config):
    """stage_lines: the schedule, then each chunk's blocks, mesh and strategies; the four
    chunks cover blocks 0-7 in order, two on each 1 × 4 mesh."""
    plan = solve(config, baselines=False, compare=[FAST])
    lines = stage_lines(plan, config.graph)
    assert lines[0] == "schedule interleaved-1f1b, 2 micro-batches, 2 stage meshes × 2 chunks " \
                       "(chunk j on mesh j mod 2)"
    body = "\n".join(lines[1:])
    assert "blocks 0-1 + embedding" in body and "blocks 6-7 + head" in body
    assert body.count("mesh 1×4") >= 2 and "ms per micro-batch" in body
    covered = [b for ln in lines[1:] for b in ln.split("blocks ")[1].split(",")[0].split(" ")[0]
               .split("-")]
    assert covered[0] == "0" and covered[-1] == "7"


def test_a_plan_with_an_interleaved_compared_configuration_passes_its_check(config):
    """``check_plan`` re-resolves the micro-batch graph from the plan's config: its
    ``compare:`` entries, resolved against the whole batch (interleaving needs the
    micro-batches a multiple of pp), are dropped there, not re-checked on one micro-batch."""
    plan = solve(config, baselines=False, compare=[FAST])
    check_plan(Plan.from_dict(json.loads(json.dumps(plan.to_dict()))))
