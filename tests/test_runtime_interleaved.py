"""Interleaved 1F1B end to end: the planner's plan of ``configs/tiny-gpt-interleaved-cpu.yaml``
(a 4-block GPT, 2 stage meshes of 4 devices × 2 chunks each), its check, and — slow — the
CLI's ``solve`` then ``run --audit --check-reference`` on 8 gloo processes: every rank runs
its mesh's two chunks in the schedule's order, executes exactly the planned collectives, and
matches one process running the unsharded model."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from ilp_planner.api import solve
from ilp_planner.errors import ConfigError, InfeasibleError, PlanFormatError
from ilp_planner.inputs.config import load_config
from ilp_planner.plan.check import check_plan
from ilp_planner.plan.data import Plan
from tests.helpers.procs import run

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "tiny-gpt-interleaved-cpu.yaml"


@pytest.fixture(scope="module")
def plan() -> Plan:
    return solve(load_config(CONFIG), baselines=False)


def test_plan_records_chunks_and_their_meshes(plan: Plan) -> None:
    """4 chunks (the plan's stages), chunk j on the devices of mesh j mod 2; each mesh's
    action row interleaves its two chunks, checked and lowered with the wrap-around."""
    assert plan.schedule is not None and plan.schedule.name == "interleaved-1f1b"
    assert plan.schedule.virtual_stages == 2 and len(plan.schedule.actions) == 2
    assert [s.devices for s in plan.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)] * 2
    assert [len(s.layers) > 0 for s in plan.stages] == [True] * 4
    assert plan.stages[0].layers[0] == "embed" and plan.stages[3].layers[-1] == "loss"
    checked = check_plan(plan)
    assert {stage for stage, _, _ in checked.mesh_actions[0]} == {0, 2}
    assert ("RF", 0) in checked.actions[2]  # chunk 2 receives from chunk 1 on the other mesh
    assert [(e.src_stage, e.dst_stage) for e in checked.entries] == [(0, 1), (1, 2), (2, 3)]
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.schedule == plan.schedule


def test_check_rejects_a_chunk_off_its_mesh(plan: Plan) -> None:
    bad = Plan.from_dict(plan.to_dict())
    bad.stages[2] = dataclasses.replace(bad.stages[2], devices=(4, 5, 6, 7))
    with pytest.raises(PlanFormatError, match=r"stages\[2\] is chunk 2 .* expected the devices"):
        check_plan(bad)


def test_check_rejects_virtual_stages_that_do_not_divide_the_stages(plan: Plan) -> None:
    d = plan.to_dict()
    d["schedule"]["virtual_stages"] = 3
    with pytest.raises(PlanFormatError, match="virtual_stages is 3 but the plan has 4 stages"):
        check_plan(Plan.from_dict(d))


@pytest.mark.parametrize("edit, match", [
    ({"name": "1f1b"}, "virtual stages .* go with 'interleaved-1f1b' and only with it"),
    ({"virtual_stages": 0}, r"schedule.virtual_stages: expected a positive integer"),
])
def test_check_rejects_a_schedule_record_at_odds_with_its_chunks(plan: Plan, edit, match) -> None:
    d = plan.to_dict()
    d["schedule"].update(edit)
    with pytest.raises(PlanFormatError, match=match):
        check_plan(Plan.from_dict(d))


@pytest.mark.parametrize("pipeline, key, match", [
    ({"virtual_stages": 2}, "pipeline.virtual_stages", "need pipeline.schedule: interleaved-1f1b"),
    ({"virtual_stages": 1}, "pipeline.virtual_stages", "needs 2 or more model chunks"),
    ({"stages": 1}, "pipeline.stages", "needs 2 or more stages"),
    ({"virtual_stages": "two"}, "pipeline.virtual_stages", "positive integer or 'auto'"),
])
def test_config_errors_name_the_key(pipeline, key, match) -> None:
    base = {"stages": 2, "microbatches": 4, "schedule": "interleaved-1f1b", "virtual_stages": 2}
    if pipeline.get("virtual_stages") == 2:
        base["schedule"] = "1f1b"
    with pytest.raises(ConfigError, match=match) as err:
        load_config(CONFIG).with_overrides({"pipeline": {**base, **pipeline}})
    assert key in str(err.value)


def test_microbatches_must_be_rounds_of_the_stages() -> None:
    c = load_config(CONFIG).with_overrides({"pipeline.microbatches": 1, "model.batch": 8})
    with pytest.raises(InfeasibleError, match="must be a multiple of the stages"):
        solve(c, baselines=False)


@pytest.mark.slow
def test_cli_solves_runs_audits_and_matches_one_process(tmp_path: Path) -> None:
    """The done-when: ``ilp-planner solve`` then ``ilp-planner run --audit
    --check-reference --steps 2`` on 8 gloo ranks (each mesh 4 devices, sharded inside a
    chunk). The same launch runs a second plan: 2 micro-batches (as many as stages: every
    mesh runs all its chunk forwards first) with every block recomputed, trained by SGD:
    under Adam a near-zero-gradient element of a zero-initialised bias steps by the ratio
    of its two steps' rounding-level gradients, which its summation order moves by more
    than the tolerance (``h.3.ln2.bias`` 1.6e-4 on a 2-core machine, its losses within
    5e-8), while SGD compares every gradient's effect (3e-8 there)."""
    plan_file = tmp_path / "p.json"
    res = run([sys.executable, "-m", "ilp_planner.cli", "solve", str(CONFIG), "-o", str(plan_file)],
              timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    other = solve(load_config(CONFIG).with_overrides(
        {"pipeline.microbatches": 2, "solver.recompute": "always"}), baselines=False)
    assert any(ly.recompute for ly in other.layers)
    other.name = "recompute-m2"
    other.save(tmp_path / "q.json")
    results = tmp_path / "results.json"
    res = run([sys.executable, "-m", "ilp_planner.cli", "run", str(plan_file), str(tmp_path / "q.json"),
               "--audit", "--check-reference", "--steps", "2", "--optimizer", "adam,sgd",
               "--results", str(results)], timeout=420)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert "MISMATCH" not in out
    entries = json.loads(results.read_text())
    assert len(entries) == 2
    for entry in entries:
        assert entry["audit_ok"] is True and entry["stages"] == 4 and entry["world"] == 8
        ref = entry["reference"]
        assert ref["loss_rel_err"] <= 1e-4 and ref["param_rel_err"] <= 1e-4
    assert out.count("-> OK") == 2  # --check-reference's verdicts on rank 0
