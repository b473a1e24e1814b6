"""explain / diff: the report carries every layer's SBP and DTensor layouts, its collectives
with bytes and seconds, memory and baselines; repeated blocks fold only when identical;
pipelined plans show stages, schedule and resharding; diff names what changed and what it
costs; both verbs work on the plan of every shipped configuration."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from formulations.schedules import schedule_actions
from ilp_planner import cli
from ilp_planner.api import solve
from ilp_planner.inputs.config import load_config
from ilp_planner.ir.cluster import MeshAxis
from ilp_planner.ir.layouts import B, Layout, P, S
from ilp_planner.lowering.cost_model import ONCE_PER_STEP
from ilp_planner.plan.data import (
    PLAN_VERSION,
    PipelineSchedule,
    Plan,
    ReshardingEntry,
    Simulated,
    Stage,
    StageDP,
    Transfer,
)
from ilp_planner.reports.diff import diff
from ilp_planner.reports.explain import (
    collective_totals,
    dtensor_placements,
    explain,
    layout_summary,
    stage_count,
    step_seconds,
    summary,
)
from ilp_planner.sweeps.points import plan_row
from tests.helpers.shipped import shipped_plan
from tests.test_torchtitan_baseline import SLOW as TORCHTITAN_SLOW

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny-gpt-cpu.yaml"


@pytest.fixture(scope="module")
def tiny() -> Plan:
    return solve(TINY)


def pipelined(plan: Plan) -> Plan:
    """The tiny plan dressed as a two-stage pipeline (stages, schedule, resharding) with
    the records the pipeline planner writes: stage 0 chosen by the DP, a simulated schedule,
    one solved transfer."""
    half = len(plan.layers) // 2
    layers = [dataclasses.replace(x, stage=0 if i < half else 1) for i, x in enumerate(plan.layers)]
    names = tuple(x.name for x in layers)
    sent, reader = layers[half - 1], layers[half]
    actions = schedule_actions("1f1b", 2, 4)
    return dataclasses.replace(
        plan, layers=layers,
        stages=[Stage(0, (0, 1, 2, 3), (1, 4), names[:half],
                      StageDP("1x4@n0d0", (0, 1), 6e-3, 0.0, 2**20, 2, None, plan.solver)),
                Stage(1, (4, 5, 6, 7), (1, 4), names[half:])],
        schedule=PipelineSchedule("1f1b", 4, (tuple(actions["0"]), tuple(actions["1"])),
                                  Simulated(0.0125, 0.2, (2, 1), True, 0.012, 0.013)),
        resharding=[ReshardingEntry(
            0, 1, sent.name, reader.name, sent.output_shape, "float32", sent.output,
            reader.inputs[0], (), (),
            Transfer("S^0", "S^0", "cpsat", "optimal", 1.5e-4, 1.5e-4, {"cpsat": 1.5e-4},
                     1e-4, 1e-4))],
    )


# -- notation ------------------------------------------------------------------------------------


def test_dtensor_notation_matches_layout_to_dtensor():
    from torch.distributed.tensor import Partial, Replicate, Shard

    layout = Layout((MeshAxis(1, 2), MeshAxis(2, 1), MeshAxis(1, 2)), (S(1), B, P))
    assert dtensor_placements(layout) == "[Shard(1), Replicate(), Partial()]"
    kinds = layout.to_dtensor()
    assert isinstance(kinds[0], Shard) and kinds[0].dim == 1
    assert isinstance(kinds[1], Replicate) and isinstance(kinds[2], Partial)


# -- explain -------------------------------------------------------------------------------------


def test_explain_reports_every_section(tiny):
    text = explain(tiny)
    assert text.startswith(f"plan {tiny.name} (schema v{PLAN_VERSION})")
    assert "status optimal" in text and "stages: 1" in text
    st = tiny.solver.stats
    # the engine that proved it: SCIP's sizes, or the elimination's (no integer variables
    # or constraints, nor a separate build and presolve)
    stats = re.search(r"\n  stats     ([\d,]+) variables \(([\d,]+|n/a) integer\), ([\d,]+|n/a) "
                      r"constraints, (\d+) nodes; build (?:\S+ m?s|n/a), presolve (?:\S+ m?s|n/a), "
                      r"search \S+ [mµ]?s, proof \S+ [mµ]?s \[(?:SCIP|elimination)", text)
    assert stats, text[:600]
    assert [None if x == "n/a" else int(x.replace(",", "")) for x in stats.groups()] == [
        st.variables, st.integer_variables, st.constraints, st.nodes]
    assert "solver stats: " in summary(tiny)
    assert "one stage on all 8 devices" in text
    assert re.search(r"memory per device:\n  [\d.]+ [KM]iB of 2\.00 GiB", text)
    for name in tiny.baselines:
        assert name in text
    # every layer appears (possibly folded) with SBP and DTensor layouts
    for layer in tiny.layers:
        folded = re.sub(r"\.\d+\.", ".[0,1].", layer.name)
        assert f"  {layer.name} [" in text or f"  {folded} [" in text, layer.name
    assert "weight (B:1, S(1):2x4, S(0):1)" in text or "weight (" in text
    assert "[Shard(0), Shard(1), Partial()]" in text and "Replicate()" in text
    # collectives with bytes and predicted time, and the per-step totals table
    assert re.search(r"- all_gather fwd activation: group 2 \((intra|inter), axes \d\), "
                     r"[\d.]+ KiB, [\d.]+ µs", text)
    assert "collectives per step (predicted by the α–β model):" in text
    assert explain(tiny, collectives=False).count("        - ") == 0
    assert explain(tiny) == text


def test_collective_totals_add_up_to_the_cost_breakdown(tiny):
    totals = collective_totals(tiny)
    act = sum(s for (_, _, purpose), (_, _, s) in totals.items() if purpose != "grad_sync")
    grad = sum(s for (_, _, purpose), (_, _, s) in totals.items() if purpose == "grad_sync")
    assert act == pytest.approx(tiny.cost.activation_comm_s)
    assert grad == pytest.approx(tiny.cost.grad_sync_s)


def test_collective_totals_count_micro_batches():
    plan = solve(load_config(TINY).with_overrides({"pipeline.microbatches": 4}), baselines=False)
    act_bytes = sum(b for (_, _, p), (_, b, _) in collective_totals(plan).items()
                    if p not in ONCE_PER_STEP)
    assert act_bytes == pytest.approx(plan.cost.activation_comm_bytes)
    assert "cost per step (4 micro-batches)" in explain(plan)


def test_repeated_blocks_fold_only_when_identical(tiny):
    text = explain(tiny)
    assert "h.[0,1].attn.qkv [linear]" in text and "×2" in text
    target = tiny.layer("h.1.attn.qkv")
    other = tiny.layer("lm_head")
    changed = [dataclasses.replace(x, strategy=other.strategy, weight=other.weight)
               if x.name == target.name else x for x in tiny.layers]
    text = explain(dataclasses.replace(tiny, layers=changed))
    assert "  h.0.attn.qkv [linear]" in text and "  h.1.attn.qkv [linear]" in text
    assert "h.[0,1].attn.proj" in text  # the others still fold


def test_explain_pipelined_plan(tiny):
    plan = pipelined(tiny)
    text = explain(plan)
    assert "stages: 2" in text
    assert "stage 0: devices 0-3, mesh 1 × 4" in text and "stage 1: devices 4-7" in text
    assert re.search(r"stage 0: .*\n    ILP optimal: [\d,]+ variables", text)  # stage stats
    assert "schedule 1f1b: 4 micro-batches, makespan 12.5 ms, bubble 20.0%" in text
    assert ("step time 13 ms (schedule makespan 12.5 ms + exposed gradient synchronisation)"
            in text)
    assert "cross-mesh resharding (1 transfers):" in text and "makespan_s 150 µs" in text
    assert "  stage 1 " in text or "stage 1" in text
    assert stage_count(plan) == 2 and stage_count(tiny) == 1
    assert step_seconds(plan) == 0.013 and step_seconds(tiny) == tiny.cost.total_s
    assert layout_summary(plan).startswith("2 stages (4+4 devices, 1f1b): ")
    row = plan_row(plan)
    assert row["stages"] == 2 and row["step_s"] == 0.013 and row["bubble_fraction"] == 0.2
    assert row["microbatches"] == 4


def test_layout_summary_counts_deciding_layers(tiny):
    text = layout_summary(tiny, top=2)
    count = text.split("×", 1)[1].split(",", 1)[0]  # labels may hold ", " (mesh shapes)
    deciding = [x for x in tiny.layers if not x.strategy.startswith("follows ")]
    assert int(count) == max(sum(1 for x in deciding if x.strategy == y.strategy
                                 and x.output.fact == y.output.fact) for y in deciding)
    assert text.endswith("more")


# -- diff ----------------------------------------------------------------------------------------


def test_diff_of_a_plan_with_itself_is_empty(tiny):
    text = diff(tiny, tiny)
    assert "configuration: 0 key(s) differ" in text
    assert f"layers: 0 of {len(tiny.layers)} common ops changed strategy" in text
    assert "equal step time" in text and "collectives per step: identical" in text


def test_diff_names_the_changed_keys_layers_and_costs(tiny):
    slow = solve(load_config(TINY).with_overrides({"cluster.links.inter.bandwidth_gbps": 0.01}))
    text = diff(tiny, slow)
    assert "cluster.links.inter.bandwidth_gbps: 10 → 0.01" in text
    assert "name: 'tiny-gpt-cpu'" not in text  # same name: not a difference
    ratio = slow.cost.total_s / tiny.cost.total_s
    assert f"{ratio:.3f}" in text
    assert f"B is {ratio:.3g}× slower per step" in text
    moved = [x.name for x in tiny.layers if (x.strategy, x.output) !=
             (slow.layer(x.name).strategy, slow.layer(x.name).output)]
    assert moved, "a 1000× slower inter link must change some strategy"
    assert re.search(rf"layers: {len(moved)} of {len(tiny.layers)} common ops changed strategy", text)
    reverse = diff(slow, tiny, names=("slow", "fast"))
    assert f"fast is {ratio:.3g}× faster per step" in reverse


def test_diff_across_pipelined_and_single_stage(tiny):
    text = diff(tiny, pipelined(tiny))
    assert "stages: 1 → 2" in text and "step (makespan + exposed sync)" in text
    assert "(stage 0 → 1)" in text
    assert "cross-mesh resharding: 0 → 1 transfers" in text


def test_diff_prices_the_solved_transfers_forward_and_backward(tiny):
    """The transfers' seconds are their solved makespans (150 µs forward + 100 µs for the
    gradient back), not a key no entry carries."""
    text = diff(tiny, pipelined(tiny))
    assert "cross-mesh resharding: 0 → 1 transfers, 0 s → 250 µs per micro-batch" in text


def test_diff_shows_schedule_fractions_as_percentages(tiny):
    plan = pipelined(tiny)
    sim = dataclasses.replace(plan.schedule.simulated, bubble_fraction=0.3648805365323905)
    other = dataclasses.replace(plan, schedule=dataclasses.replace(plan.schedule, simulated=sim))
    text = diff(plan, other)
    assert "bubble_fraction 20.0%" in text and "bubble_fraction 36.5%" in text
    assert "0.3648805365323905" not in text


# -- every shipped configuration, and the verbs ----------------------------------------------------


SLOW_SOLVES = ("llama-70b-16x8", "u-transformer-2x4", "tiny-utf-zero-cpu")
WITH_BASELINES = frozenset(TORCHTITAN_SLOW)


@pytest.mark.parametrize("path", [pytest.param(p, marks=pytest.mark.slow)
                                  if p.stem in SLOW_SOLVES else p
                                  for p in CONFIGS], ids=lambda p: p.stem)
def test_every_shipped_config_explains_diffs_and_compiles_for_the_runtime(path, tiny, tmp_path):
    """Every shipped config's plan compiles for the runtime (each edge lowered, each crossing
    tensor with its entry, the schedule validated): conv, pooling and half precision
    included, sharded state and recomputation too."""
    from runtime.executor import Executor, RunOptions

    # the solve test_torchtitan_baseline checks (with baselines, as the CLI solves by
    # default) where that test solves the config too: one solve of each per session
    plan = shipped_plan(path.stem, baselines=path.stem in WITH_BASELINES)
    plan.save(tmp_path / "p.json")
    loaded = Plan.load(tmp_path / "p.json")
    text = explain(loaded)
    assert f"plan {plan.name}" in text
    assert ("(none priced: solved with baselines off)" in text) == (not plan.baselines)
    assert all(name in text for name in plan.baselines)
    assert f"stages: {stage_count(plan)}" in text
    d = diff(tiny, loaded)
    assert "cost per step:" in d and "configuration:" in d
    if any(ly.zero or ly.recompute for ly in loaded.layers):
        assert "ZeRO" in text or "recomputed" in text
    ex = Executor(loaded, RunOptions(), rank=0, world=loaded.num_devices)
    assert len(ex.compiled.entries) == len(loaded.resharding)


def test_explain_and_diff_verbs(tiny, tmp_path, capsys):
    a = tmp_path / "a.json"
    tiny.save(a)
    b = tmp_path / "b.json"  # a real pipelined plan: the verbs check plans before reading them
    from ilp_planner.testing import pipelined_plan

    pipelined_plan(load_config(TINY), stages=2, schedule="1f1b", microbatches=4).save(b)
    assert cli.main(["explain", str(a)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan tiny-gpt-cpu") and "DTensor" in out
    assert cli.main(["diff", str(a), str(b)]) == 0
    assert "stages: 1 → 2" in capsys.readouterr().out
    assert cli.main(["explain", "--no-collectives", str(TINY)]) == 0  # a config: solved first
    assert "        - " not in capsys.readouterr().out


def test_explain_verb_rejects_foreign_and_old_files(tmp_path, capsys):
    foreign = tmp_path / "f.json"
    foreign.write_text(json.dumps({"hello": 1}))
    assert cli.main(["explain", str(foreign)]) == 2
    assert "not an ilp_planner plan" in capsys.readouterr().err
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"schema": "ilp_planner.plan", "version": 0}))
    assert cli.main(["diff", str(old), str(old)]) == 2
    assert "plan schema version 0 is not supported" in capsys.readouterr().err


def test_solve_summary_explains_its_table_in_units_that_fit(tiny):
    """The ratio is explained above the table; a tiny plan's memory is in KiB or MiB, not
    ``0.00 GiB``; a long baseline name widens its column instead of pushing the others."""
    long_name = "torchtitan(pp=2; ddp=2,tp=1,ac=none | ddp=1,tp=2,ac=none)"
    plan = dataclasses.replace(tiny, baselines={**tiny.baselines,
                                                long_name: tiny.cost.to_dict()})
    lines = summary(plan).splitlines()
    head = next(i for i, line in enumerate(lines) if line.split()[:2] == ["plan", "step"])
    assert lines[head - 1].strip().startswith("ratio = a plan's step time / ilp_planner's")
    table = [line for line in lines[head:] if line.startswith("  ")]
    assert len({len(line) for line in table}) == 1  # right-aligned columns: one width
    ours = next(line for line in table if line.split()[0] == "ilp_planner")
    assert re.search(r"\d (KiB|MiB) +1\.00$", ours), ours
    assert any(line.split()[0].startswith("torchtitan(pp=2;") for line in table)


def test_solve_prints_a_wall_time_whose_parts_add_up(capsys):
    assert cli.main(["solve", str(TINY)]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.fullmatch(r"took ([\d.]+) s: loading the planner ([\d.]+) s, config and graph "
                     r"([\d.]+) s, solving ([\d.]+) s, baselines ([\d.]+) s, plan and report "
                     r"([\d.]+) s", line)
    assert m, line
    total, *parts = (float(x) for x in m.groups())
    assert sum(parts) == pytest.approx(total, abs=0.03) and float(m.group(6)) >= 0
    assert float(m.group(5)) > 0  # the baselines' time is counted, not hidden


def test_an_uncounted_opaque_op_on_a_flat_cluster_is_said_to_be_free() -> None:
    """An op the planner does not understand is priced by the FLOPs torch counts; where it
    counts none and the cluster has no compute model to price bytes, explain says the op's
    compute is free there and how to price it — never silently."""
    ops = [{"name": "x", "kind": "input", "shape": [8, 16]},
           {"name": "fc", "kind": "linear", "inputs": ["x"], "shape": [8, 16],
            "weight": [16, 16]},
           {"name": "fft", "kind": "opaque", "inputs": ["fc"], "shape": [8, 16], "flops": 0},
           {"name": "loss", "kind": "loss", "inputs": ["fft"], "shape": [1]}]
    link = {"latency_us": 1, "bandwidth_gbps": 10}
    flat = {"nodes": 1, "devices_per_node": 2, "memory_gib": 1, "peak_tflops": 1,
            "links": {"intra": link, "inter": link}}
    text = explain(solve({"kind": "graph", "name": "u", "ops": ops}, cluster=flat,
                         baselines=False))
    assert "torch counts none for fft, so their compute is free here" in text
    priced = dict(flat, compute={"hbm_gbps": 1000})
    assert "compute is free" not in explain(
        solve({"kind": "graph", "name": "u", "ops": ops}, cluster=priced, baselines=False))
