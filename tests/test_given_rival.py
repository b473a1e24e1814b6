"""The compared configurations as rivals of the plan (``ilp_planner/inter_op/given_rival.py``):
the plan is never predicted slower than a ``compare:`` configuration that fits its space —
pipelined (where the stage DP alone, no interleaving, is slower than it; under the
interleaved schedule) or on one mesh (with its own micro-batch count) — and a solve prices
each compared configuration once."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ilp_planner.api import solve
from ilp_planner.errors import InfeasibleError
from ilp_planner.inputs.config import load_config
from ilp_planner.inter_op import given_price
from ilp_planner.inter_op.given_price import price_given
from ilp_planner.plan.check import check_plan
from ilp_planner.plan.data import Plan
from ilp_planner.reports.stages import stage_lines
from runtime.reference import tolerance
from tests.helpers.procs import run

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


def _roundtrip_checked(plan: Plan) -> None:
    """``plan`` written and read back passes ``plan check``."""
    check_plan(Plan.from_dict(json.loads(json.dumps(plan.to_dict()))))


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
    _roundtrip_checked(plan)


INTERLEAVED_RIVAL = "megatron: tp=2 pp=2 vpp=2 mbs=1"  # 4 micro-batches, uniform chunks


def test_the_interleaved_schedule_keeps_a_faster_compared_configuration(config):
    """``schedule: interleaved-1f1b`` (2 stages × 2 chunks, 4 micro-batches): the planner's
    min–max chunk cut simulates slower than Megatron's uniform TP-2 chunks; the plan keeps
    the compared configuration, its step the compared one's, and passes its check."""
    inter = config.with_overrides({"pipeline.microbatches": 4,
                                   "pipeline.schedule": "interleaved-1f1b",
                                   "pipeline.virtual_stages": 2})
    alone = solve(inter, baselines=False, compare=[])
    plan = solve(inter, baselines=False, compare=[INTERLEAVED_RIVAL])
    (given,) = [b for b in plan.baselines.values() if "given" in b]
    assert alone.step_s > given["pipeline_s"]  # without the rival the plan WAS slower
    assert plan.step_s == pytest.approx(given["pipeline_s"], rel=1e-9)
    assert "kept the compared configuration" in plan.solver.message
    assert plan.schedule.virtual_stages == 2 and given["given"]["differs"] == []
    _roundtrip_checked(plan)


def test_the_interleaved_schedule_names_a_one_f_one_b_compared_configuration(config):
    inter = config.with_overrides({"pipeline.microbatches": 4,
                                   "pipeline.schedule": "interleaved-1f1b",
                                   "pipeline.virtual_stages": 2})
    plan = solve(inter, baselines=False, compare=["megatron: tp=2 pp=2 mbs=1"])
    assert "not offered as the plan (1F1B without interleaving, the config's " \
           "pipeline.schedule is interleaved-1f1b)" in plan.solver.message


@pytest.fixture(scope="module")
def one_mesh():
    """4 blocks of h 128, batch 32 × seq 128 on 2 × 4 devices, one mesh, recomputation
    allowed, 0.02 GiB a device: the plan's one micro-batch must recompute; Megatron's DP 8
    with mbs 1 (4 micro-batches) fits without and is faster."""
    return load_config(TINY).with_overrides({
        "model.layers": 4, "model.hidden": 128, "model.batch": 32, "model.seq_len": 128,
        "solver.recompute": "auto", "cluster.memory_gib": 0.02})


ONE_MESH = "megatron: tp=1 pp=1 mbs=1"


def test_a_faster_one_mesh_compared_configuration_is_the_plan(one_mesh):
    alone = solve(one_mesh, baselines=False, compare=[])
    plan = solve(one_mesh, baselines=False, compare=[ONE_MESH, "megatron: tp=2 pp=1 mbs=1"])
    givens = [b for b in plan.baselines.values() if "given" in b]
    fits = [b["total_s"] for b in givens if b["given"]["fits"]]
    assert alone.step_s > min(fits)  # without the rival the plan WAS slower
    assert plan.step_s == pytest.approx(min(fits), rel=1e-9) and not plan.stages
    assert plan.config["pipeline"]["microbatches"] == 4  # the compared configuration's own
    assert "on one mesh, 4 micro-batch(es)" in plan.solver.message
    assert "kept the compared configuration" in plan.solver.message
    assert plan.solver.message.count("offered as the plan: ") == 1  # the slower one, named
    fastest = min(givens, key=lambda b: b["total_s"] if b["given"]["fits"] else 1e9)
    assert fastest["given"]["differs"] == []  # the plan is that configuration
    _roundtrip_checked(plan)


def test_a_one_mesh_compared_configuration_keeps_a_written_microbatch_count(one_mesh):
    """``pipeline.microbatches`` written in the config is the user's: a compared
    configuration with another count is named, not kept."""
    fixed = one_mesh.with_overrides({"pipeline.microbatches": 2})
    plan = solve(fixed, baselines=False, compare=[ONE_MESH])
    assert "not offered as the plan (4 micro-batches, the config's pipeline.microbatches " \
           "is 2)" in plan.solver.message
    assert plan.config["pipeline"]["microbatches"] == 2


def test_a_kept_one_mesh_configuration_reports_no_bound_of_another_problem(one_mesh):
    """The kept configuration's report is that of a priced configuration: no bound or gap
    of the planner's solve (another micro-batch count, another problem) beside it."""
    plan = solve(one_mesh, baselines=False, compare=[ONE_MESH])
    assert "kept the compared configuration" in plan.solver.message
    assert plan.solver.bound is None and plan.solver.gap is None
    assert plan.solver.method.startswith("given configuration megatron: tp=1 pp=1 ")
    _roundtrip_checked(plan)


@pytest.mark.parametrize("overrides, compare, why", [
    # ZeRO-1 (Megatron's distributed optimizer) where the config offers no state sharding
    ({"cluster.memory_gib": 0.022}, "megatron: tp=1 pp=1 mbs=1 distopt=true",
     "outside the config's strategies: its plan: layers["),
    # data parallel 8 replicates every weight 8 times: over the config's cap of 4
    ({"cluster.memory_gib": 0.024, "solver.max_weight_replication": 4}, ONE_MESH,
     "outside the config's strategies: its plan: layers["),
    # the config recomputes every block; the configuration none
    ({"solver.recompute": "always"}, ONE_MESH,
     "recompute=none, the config's solver.recompute is always"),
])
def test_a_faster_configuration_outside_the_configs_space_is_named_not_kept(
        one_mesh, overrides, compare, why):
    """A compared configuration using what the config's solver options leave out is not
    kept, however fast: ``plan check`` refuses such layers in the planner's own plans."""
    config = one_mesh.with_overrides(overrides)
    plan = solve(config, baselines=False, compare=[compare])
    assert why in plan.solver.message
    assert "kept the compared configuration" not in plan.solver.message
    _roundtrip_checked(plan)


def test_a_solve_prices_each_compared_configuration_once(config, one_mesh, monkeypatch):
    """A rival and its price beside the plan are one pricing (``priced_once``): one
    pipeline assembled for a pipelined configuration, one restricted whole-cluster solve
    for a one-mesh one; the printed block is the one an uncached pricing gives."""
    calls = []
    for name in ("_given_pipeline", "solve_given_layout"):
        real = getattr(given_price, name)
        monkeypatch.setattr(given_price, name,
                            lambda *a, _real=real, _n=name, **k: calls.append(_n) or _real(*a, **k))
    plan = solve(config, baselines=False, compare=[FAST])
    assert calls.count("_given_pipeline") == 1
    (g,) = config.with_overrides({"compare": [FAST]}).compare
    assert plan.baselines == price_given(config, g, plan)  # outside a solve: priced again
    assert calls.count("_given_pipeline") == 2
    calls.clear()
    solve(one_mesh, baselines=False, compare=[ONE_MESH])
    assert calls == ["solve_given_layout"]


@pytest.mark.slow
def test_a_kept_one_mesh_compared_configuration_trains_as_planned(one_mesh, tmp_path):
    """The kept one-mesh plan (Megatron's DP 8, its 4 micro-batches in the plan's config)
    runs under ``torchrun`` on 8 gloo ranks, audited, matching one process."""
    plan = solve(one_mesh, baselines=False, compare=[ONE_MESH])
    assert "kept the compared configuration" in plan.solver.message
    path = tmp_path / "kept.json"
    plan.save(str(path))
    res = run([sys.executable, "-m", "ilp_planner.cli", "run", str(path), "--nproc-per-node",
               "8", "--steps", "2", "--results", str(tmp_path / "results.json"), "--quiet",
               "--audit", "--check-reference"], timeout=540)
    assert res.returncode == 0, f"launch failed:\n{res.stdout[-5000:]}\n{res.stderr[-3000:]}"
    (r,) = json.loads((tmp_path / "results.json").read_text())
    rtol = tolerance(one_mesh.graph)
    assert r["audit_ok"] is True
    assert r["reference"]["loss_rel_err"] <= rtol and r["reference"]["param_rel_err"] <= rtol


def test_an_interleaved_refusal_names_why_each_compared_configuration_was_not_kept(config):
    """``schedule: interleaved-1f1b`` where no interleaved pipeline fits memory and the one
    compared configuration is not interleaved: the refusal keeps the rival's note (it was
    lost when no rival was kept)."""
    inter = config.with_overrides({"pipeline.microbatches": 4,
                                   "pipeline.schedule": "interleaved-1f1b",
                                   "pipeline.virtual_stages": 2, "cluster.memory_gib": 1e-6})
    with pytest.raises(InfeasibleError, match="no interleaved 1F1B pipeline fits: .*not offered "
                                              "as the plan \\(1F1B without interleaving"):
        solve(inter, baselines=False, compare=["megatron: tp=2 pp=2 mbs=1"])
