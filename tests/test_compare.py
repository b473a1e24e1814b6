"""Pricing a configuration the user already runs (``solve --compare``, ``compare:``).

The parser reads both engines' notations back from their canonical text and refuses each
kind of nonsense in one line; a compared configuration is priced as the planner's own
problem restricted to exactly its layout (checked against brute force over that
restriction, against closed forms, and against the Megatron baseline on the same mesh); the
plan is never slower than a configuration of its own space; and the CLI, the config key and
the sweep key carry it to the plan's report.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from formulations.sbp_ilp import SbpIlp
from formulations.schedules import INTERLEAVED, make_schedule
from formulations.simulator import StageDurations, simulate, simulate_named
from ilp_planner import cli
from ilp_planner.api import solve
from ilp_planner.errors import ConfigError
from ilp_planner.inputs.config import load_config
from ilp_planner.inputs.given_config import (
    GivenConfig,
    ModelFacts,
    engine_flags,
    parse_given,
    resolve_given,
)
from ilp_planner.inter_op.assembly import stage_durations
from ilp_planner.inter_op.given_price import (
    _given_pipeline,
    interleaved_inflight,
    model_flops,
    price_given,
)
from ilp_planner.intra_op.baselines import megatron_filter, restrict
from ilp_planner.intra_op.problem import build_problem
from ilp_planner.intra_op.realise import realise
from ilp_planner.ir.cluster import MeshAxis
from ilp_planner.plan.data import CostBreakdown, Plan
from ilp_planner.reports.explain import explain, summary
from ilp_planner.reports.given import baseline_given
from ilp_planner.sweeps.points import plan_row
from ilp_planner.sweeps.spec import parse_sweep

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TINY = CONFIGS / "tiny-gpt-cpu.yaml"  # GPT: 2 layers, 4 heads, batch 8, 2 nodes × 4 devices


@pytest.fixture(scope="module")
def tiny():
    return load_config(TINY)


@pytest.fixture(scope="module")
def tiny_plan(tiny):
    return solve(tiny, baselines=False)


def _facts(config) -> ModelFacts:
    c = config.cluster
    return ModelFacts.of(config.graph, c.nodes, c.devices_per_node, config.model.get("batch"))


def _given(config, text: str) -> GivenConfig:
    return resolve_given(parse_given(text), _facts(config))


# -- the parser ------------------------------------------------------------------------------


def test_both_notations_parse_into_the_dataclass():
    assert parse_given("megatron: tp=8 pp=8 dp=16 vpp=2 mbs=1 recompute=full sp=true") == \
        GivenConfig("megatron", tp=8, pp=8, vpp=2, replicate=16, shard=1, mbs=1,
                    recompute="full", sp=True)
    assert parse_given("torchtitan: fsdp=32, tp=8, pp=1, ac=selective") == \
        GivenConfig("torchtitan", tp=8, pp=1, replicate=1, shard=32, recompute="selective")
    # a degree left out is the one that fills the devices
    assert parse_given("megatron: tp=2").replicate is None
    assert parse_given("torchtitan: ddp=4").shard is None


@pytest.mark.parametrize("text", [
    "megatron: tp=8 pp=8 dp=16 vpp=2 mbs=1 recompute=full sp=true",
    "megatron: tp=2",
    "megatron: recompute=selective sp=false",
    "megatron: tp=2 distopt=true",
    "torchtitan: fsdp=32 tp=8 pp=1 ac=selective",
    "torchtitan: ddp=4 tp=2 pp=2 vpp=2 mbs=4 ac=full",
])
def test_canonical_text_round_trips(text):
    g = parse_given(text)
    assert parse_given(g.text()) == g
    assert g.label().startswith(f"given {g.engine}(")


@pytest.mark.parametrize("text", ["megatron: tp=2 dp=4", "megatron: tp=2 pp=2 sp=true recompute=full",
                                  "torchtitan: fsdp=4 tp=2 ac=selective", "torchtitan: ddp=8"])
def test_resolved_configurations_read_back_the_same(tiny, text):
    g = _given(tiny, text)
    assert resolve_given(parse_given(g.text()), _facts(tiny)) == g
    assert g.dp * g.tp * g.pp == tiny.cluster.num_devices


@pytest.mark.parametrize("text, fragment", [
    ("deepspeed: tp=2", "unknown engine 'deepspeed'"),
    ("megatron tp=2", "expected 'ENGINE: key=value"),
    ("megatron: tp=2 zero=3", "unknown megatron key 'zero'"),
    ("torchtitan: sp=true", "unknown torchtitan key 'sp'"),
    ("megatron: tp=2 tp=4", "tp is given twice"),
    ("megatron: tp=two", "tp: expected a positive integer, got 'two'"),
    ("megatron: tp=0", "tp: expected a positive integer"),
    ("megatron: sp=maybe", "sp: expected true or false"),
    ("megatron: recompute=some", "recompute: expected one of none, full, selective"),
    ("megatron: tp 2", "cannot read 'tp'"),
    ("megatron: tp=8", "tp=8 does not divide the model's 4 attention heads"),
    ("megatron: tp=2 dp=2", "tp × pp × data parallel = 4 is not the 8 devices"),
    ("megatron: tp=3", "does not divide the 8 devices"),
    ("megatron: tp=2 vpp=2", "vpp=2 (interleaving) needs pp > 1"),
    ("megatron: tp=1 pp=4", "2 layers do not split evenly into pp × vpp = 4 chunks"),
    ("megatron: tp=1 pp=2 vpp=2", "2 layers do not split evenly into pp × vpp = 4 chunks"),
    ("megatron: tp=2 dp=4 mbs=3", "global batch 8 is not divisible by data parallel × "
                                  "micro-batch size = 4 × 3"),
    ("megatron: tp=1 dp=8 sp=true", "sequence parallelism needs tp > 1"),
    ("torchtitan: ddp=2 fsdp=4", "HSDP (ddp > 1 and fsdp > 1) is not in the planner's space"),
])
def test_nonsense_is_refused_in_one_line(tiny, text, fragment):
    with pytest.raises(ConfigError) as err:
        resolve_given(parse_given(text), _facts(tiny))
    message = str(err.value)
    assert fragment in message
    assert "\n" not in message and message.startswith("--compare: ")


def test_interleaving_needs_a_multiple_of_pp_micro_batches():
    facts = ModelFacts(nodes=2, local=4, layers=8, heads=4, batch=3)
    with pytest.raises(ConfigError, match="interleaving needs the 3 micro-batches to be a "
                                          "multiple of pp=2"):
        resolve_given(parse_given("megatron: tp=4 pp=2 vpp=2 mbs=1"), facts)


def test_stage_meshes_must_tile_the_nodes():
    facts = ModelFacts(nodes=3, local=4, layers=6, heads=4, batch=12)
    with pytest.raises(ConfigError, match="stages of 6 devices do not tile nodes of 4"):
        resolve_given(parse_given("megatron: tp=2 pp=2 dp=3"), facts)


def test_engine_flags_reproduce_the_configuration():
    facts = ModelFacts(nodes=128, local=8, layers=96, heads=96, batch=1536)
    g = resolve_given(parse_given("megatron: tp=8 pp=8 dp=16 vpp=2 mbs=1 recompute=full sp=true"),
                      facts)
    assert engine_flags(g, 1536, 96) == (
        "--tensor-model-parallel-size 8 --pipeline-model-parallel-size 8 "
        "--num-layers-per-virtual-pipeline-stage 6 --micro-batch-size 1 --global-batch-size 1536 "
        "--sequence-parallel --recompute-granularity full --recompute-method uniform "
        "--recompute-num-layers 1")
    facts = ModelFacts(nodes=32, local=8, layers=32, heads=32, batch=256)
    t = resolve_given(parse_given("torchtitan: fsdp=32 tp=8 pp=1 ac=selective"), facts)
    assert t.sp and t.fsdp and t.mbs == 8
    assert engine_flags(t, 256, 32) == (
        "--parallelism.data_parallel_replicate_degree 1 --parallelism.data_parallel_shard_degree 32 "
        "--parallelism.tensor_parallel_degree 8 --parallelism.pipeline_parallel_degree 1 "
        "--training.local_batch_size 8 --training.global_batch_size 256 "
        "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 2")
    p = resolve_given(parse_given("torchtitan: fsdp=32 tp=8 pp=4 vpp=2 ac=full"),
                      ModelFacts(nodes=128, local=8, layers=32, heads=32, batch=256))
    assert ("--parallelism.pipeline_parallel_degree 4 --parallelism.pipeline_parallel_schedule "
            "Interleaved1F1B --parallelism.pipeline_parallel_microbatch_size 1 "
            "--parallelism.pipeline_parallel_layers_per_stage 4") in engine_flags(p, 256, 32)


# -- pricing ---------------------------------------------------------------------------------


def _mlp_config() -> object:
    return load_config({
        "model": {"kind": "mlp", "dims": [64, 32, 32, 16], "batch": 16},
        "cluster": {"nodes": 2, "devices_per_node": 4, "memory_gib": 1, "peak_tflops": 1,
                    "links": {"intra": {"latency_us": 5, "bandwidth_gbps": 100},
                              "inter": {"latency_us": 20, "bandwidth_gbps": 10}}},
        "training": {"grad_bucket_mb": 0},
    })


@pytest.mark.parametrize("tp", [2, 4])
def test_megatron_price_is_the_brute_force_optimum_of_its_layout(tp):
    """On an MLP every member of Megatron's dp × tp restriction is enumerated: the compared
    configuration's price is the cheapest of them, realised."""
    config = _mlp_config()
    g = _given(config, f"megatron: tp={tp}")
    plan = solve(config, baselines=False)
    block = price_given(config, g, plan)[g.label()]
    gp = build_problem(config.graph, config.cluster, 2, 4, config.memory)
    sub, allowed = restrict(gp, megatron_filter(MeshAxis(2, 4 // tp), MeshAxis(1, tp)))
    sizes = [len(a) for a in allowed]
    assert 8 <= int(np.prod(sizes)) <= 50_000
    best = min(sub.objective(list(c)) for c in itertools.product(*(range(n) for n in sizes)))
    assert block["total_s"] == pytest.approx(best, rel=1e-9)
    assert block["given"]["step_s"] == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("tp, sp", [(2, False), (4, False), (2, True)])
def test_megatron_price_equals_the_megatron_baseline_on_that_mesh(tiny, tiny_plan, tp, sp):
    g = _given(tiny, f"megatron: tp={tp} sp={str(sp).lower()}")
    block = price_given(tiny, g, tiny_plan)[g.label()]
    gp = build_problem(tiny.graph, tiny.cluster, 2, 4, tiny.memory,
                       grad_bucket_bytes=tiny.grad_bucket_bytes)
    sub, allowed = restrict(gp, megatron_filter(MeshAxis(2, 4 // tp), MeshAxis(1, tp), sp))
    out = SbpIlp(sub).solve(time_limit_s=30)
    choice = [int(allowed[k][i]) for k, i in enumerate(out.choice)]
    assert block["total_s"] == pytest.approx(realise(gp, choice)[1].total_s, rel=1e-9)


def test_data_parallel_closed_form(tiny, tiny_plan):
    """Megatron with tp = 1 on 8 devices: every op's FLOPs split 8 ways, and every
    gradient (the tied head's copy too) all-reduced once: its bytes are the parameters'."""
    g = _given(tiny, "megatron: tp=1")
    block = price_given(tiny, g, tiny_plan)[g.label()]
    graph, cl = tiny.graph, tiny.cluster
    assert block["compute_s"] == pytest.approx(graph.step_flops / 8 / (cl.peak_flops * cl.efficiency),
                                               rel=1e-9)
    tied = sum(op.weight.numel for op in graph.ops if op.attrs.get("tied"))
    assert block["grad_sync_bytes"] == pytest.approx((graph.total_params + tied) * 4)


@pytest.mark.parametrize("text", ["megatron: tp=1", "megatron: tp=2", "megatron: tp=4",
                                  "megatron: tp=2 sp=true", "megatron: tp=4 sp=true",
                                  "torchtitan: ddp=8", "torchtitan: ddp=4 tp=2",
                                  "torchtitan: ddp=2 tp=4"])
def test_the_plan_is_never_slower_than_a_configuration_in_its_space(tiny, tiny_plan, text):
    g = _given(tiny, text)
    given = price_given(tiny, g, tiny_plan)[g.label()]["given"]
    assert given["speedup"] >= 1 - 1e-9
    assert given["step_s"] >= tiny_plan.step_s * (1 - 1e-9)


def test_pipelined_configuration_is_assembled_and_simulated(tiny, tiny_plan):
    g = _given(tiny, "megatron: tp=2 pp=2 mbs=1 recompute=full sp=true")
    block = price_given(tiny, g, tiny_plan)[g.label()]
    assert block["pipeline_s"] == block["given"]["step_s"] > 0
    assert block["given"]["fits"]
    assert "stages: plan 1, given 2" in block["given"]["differs"]
    assert "micro-batches: plan 1, given 4" in block["given"]["differs"]
    assert "recomputed blocks: plan 0, given 2" in block["given"]["differs"]
    # a stage's compute per micro-batch is a quarter of the recomputing forward + backward
    CostBreakdown.from_dict(block)


def test_interleaved_simulation_is_the_closed_form_without_transfers():
    """Uniform chunks, no transfers: the simulated interleaved 1F1B makespan is SC'21's
    closed form ``(m + (p − 1)/v)·(t_f + t_b)`` of the stage times (1F1B's
    ``(m + p − 1)(t_f + t_b)`` at v = 1); any transfer between chunks makes it longer."""
    p, m, f, b = 4, 8, 1.0, 2.0
    sim = simulate(make_schedule("1f1b", p, m), StageDurations.make(p, f, b))
    assert sim.makespan_s == pytest.approx((m + p - 1) * (f + b))
    for v in (2, 4):
        plain = simulate_named(INTERLEAVED, p, m, f / v, b / v, virtual_stages=v)
        assert plain.makespan_s == pytest.approx((m + (p - 1) / v) * (f + b))
        sent = simulate_named(INTERLEAVED, p, m, f / v, b / v, virtual_stages=v,
                              activation_transfer=0.05)
        assert sent.makespan_s > plain.makespan_s + 1e-9


def test_interleaved_configuration_is_simulated_with_its_transfers(tiny):
    """A ``vpp`` configuration's step is interleaved 1F1B simulated on its ``pp·vpp`` chunks
    with the resharding the assembly priced between them (wrap-around included) plus the
    exposed gradient tail — longer than the closed form on the same chunk times."""
    deeper = tiny.with_overrides({"model.layers": 4})
    g = _given(deeper, "megatron: tp=2 pp=2 vpp=2 mbs=1")
    m = 4
    cfg = deeper.with_overrides({"pipeline.microbatches": m, "pipeline.stages": 2,
                                 "pipeline.schedule": "1f1b", "pipeline.submeshes": None})
    pipe = _given_pipeline(g, cfg, cfg.microbatch_graph(), m)
    times = [s.times for s in pipe.stages]
    assert len(times) == 4 and pipe.schedule.virtual_stages == 2
    assert {r.dst_stage for r in pipe.resharding} == {1, 2, 3}
    durations = stage_durations(times, pipe.resharding)
    fwd, bwd = [t.forward_s for t in times], [t.backward_s for t in times]
    tail = max(times[r].grad_sync_exposed_s + times[r + 2].grad_sync_exposed_s for r in (0, 1))
    sent = simulate_named(INTERLEAVED, 2, m, fwd, bwd, virtual_stages=2,
                          activation_transfer=durations.activation_transfer,
                          gradient_transfer=durations.gradient_transfer)
    assert pipe.step_s == pytest.approx(sent.makespan_s + tail)
    free = simulate_named(INTERLEAVED, 2, m, fwd, bwd, virtual_stages=2)
    assert pipe.step_s > free.makespan_s + tail
    block = price_given(deeper, g, solve(deeper, baselines=False))[g.label()]
    assert block["pipeline_s"] == pytest.approx(pipe.step_s)


def test_interleaved_ranks_hold_megatrons_warm_up():
    """Megatron's warm-up: (p − r − 1)·2 + (v − 1)·p micro-chunks, one more in flight, each
    1/v of the rank's layers; all m·v chunks when m = p."""
    assert interleaved_inflight(4, 0, 8, 2) == (6 + 4 + 1) / 2
    assert interleaved_inflight(4, 3, 8, 2) == (0 + 4 + 1) / 2
    assert interleaved_inflight(4, 0, 4, 2) == 4
    assert interleaved_inflight(2, 0, 2, 4) == 2


def test_interleaved_configuration_holds_more_and_says_how_it_was_priced(tiny):
    deeper = tiny.with_overrides({"model.layers": 4})
    plan = solve(deeper, baselines=False)
    plain = _given(deeper, "megatron: tp=2 pp=2 mbs=1")
    inter = _given(deeper, "megatron: tp=2 pp=2 vpp=2 mbs=1")
    a = price_given(deeper, plain, plan)[plain.label()]
    b = price_given(deeper, inter, plan)[inter.label()]
    assert b["peak_memory_bytes"] > a["peak_memory_bytes"]
    assert b["compute_s"] == pytest.approx(a["compute_s"])
    assert any("simulated on 4 chunks" in n for n in b["given"]["notes"])
    assert "--num-layers-per-virtual-pipeline-stage 1" in b["given"]["flags"]


def test_megatron_model_flops_formula(tiny):
    """96·B·s·l·h²·(1 + s/6h + V/16lh) with full recomputation, 72·…·(1 + s/6h + V/12lh)
    without (Narayanan et al., SC'21)."""
    B, s, L, h, V = 8, 16, 2, 64, 128
    assert model_flops(tiny, L) == pytest.approx(
        96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)))
    assert model_flops(tiny, 0) == pytest.approx(
        72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h)))


def test_distributed_optimizer_shards_optimizer_state(tiny, tiny_plan):
    """``distopt=true`` is Megatron's ``--use-distributed-optimizer``: ZeRO-1 on every op
    the planner offers it for, the rest as without it; less memory per device."""
    plain, dist = _given(tiny, "megatron: tp=2"), _given(tiny, "megatron: tp=2 distopt=true")
    assert dist.zero == 1 and "--use-distributed-optimizer" in engine_flags(dist, 8, 2)
    a = price_given(tiny, plain, tiny_plan)[plain.label()]
    b = price_given(tiny, dist, tiny_plan)[dist.label()]
    assert b["peak_memory_bytes"] < a["peak_memory_bytes"]
    assert b["compute_s"] == pytest.approx(a["compute_s"])
    assert any("+zero1" in d for d in b["given"]["differs"])


def test_fsdp_is_zero3_over_the_shard_degree(tiny, tiny_plan):
    """torchtitan's FSDP shards weights, gradients and optimizer state (ZeRO-3) where the
    planner offers it, so its peak (gathered weights included) is below DDP's; the
    embedding, which has no ZeRO-3 strategy, keeps replicated state."""
    ddp, fsdp = _given(tiny, "torchtitan: ddp=8"), _given(tiny, "torchtitan: fsdp=8")
    a = price_given(tiny, ddp, tiny_plan)[ddp.label()]
    b = price_given(tiny, fsdp, tiny_plan)[fsdp.label()]
    assert b["peak_memory_bytes"] < a["peak_memory_bytes"]
    assert any("+zero3" in d for d in b["given"]["differs"])
    assert any("ZeRO-3" in n for n in b["given"]["notes"])


def test_a_configuration_that_does_not_fit_says_by_how_much(tiny, tiny_plan):
    small = tiny.with_overrides({"cluster.memory_gib": 0.0005})
    g = _given(small, "megatron: tp=1")
    block = price_given(small, g, tiny_plan)[g.label()]
    given = block["given"]
    assert not given["fits"] and given["peak_memory_bytes"] > given["budget_bytes"] == 0.0005 * 2**30
    plan = Plan.from_dict(json.loads(json.dumps({**tiny_plan.to_dict(), "baselines": {g.label(): block}})))
    text = summary(plan)
    assert "DOES NOT FIT: needs" in text and "over by" in text


def test_baseline_rows_name_their_engine_configuration(tiny):
    assert baseline_given("megatron(dp=2x2,tp=2)", 8, 1) == resolve_given(
        parse_given("megatron: tp=2 dp=4 mbs=2"), _facts(tiny))
    assert baseline_given("megatron_sp(dp=2,tp=4)", 8, 2) == GivenConfig(
        "megatron", tp=4, replicate=2, mbs=2, sp=True)
    assert baseline_given("torchtitan(fsdp=2x2,tp=2,sp,ac=selective)", 8, 1) == resolve_given(
        parse_given("torchtitan: fsdp=4 tp=2 mbs=2 ac=selective"), _facts(tiny))
    assert baseline_given("summa(4x2)", 8, 1) is None
    assert baseline_given("torchtitan(pp=2; ddp=4,tp=1,ac=none)", 8, 1) is None
    plan = solve(tiny)
    text = summary(plan)
    assert "engine flags of the baselines:" in text
    assert any(line.startswith("- megatron(") and "--tensor-model-parallel-size" in line
               for line in text.splitlines())


# -- surfaces --------------------------------------------------------------------------------


def test_cli_compare_end_to_end(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert cli.main(["solve", str(TINY), "--no-baselines", "-o", str(out),
                     "--compare", "megatron: tp=2 dp=4", "--compare",
                     "torchtitan: fsdp=4 tp=2 ac=selective"]) == 0
    printed = capsys.readouterr().out
    assert "given megatron(tp=2,pp=1,vpp=1,dp=4,mbs=2,recompute=none,sp=false)" in printed
    assert "flags: --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1" in printed
    assert "--parallelism.data_parallel_shard_degree 4" in printed
    assert "TFLOP/s per GPU" in printed and "plan speed-up" in printed
    plan = Plan.load(out)
    names = [n for n in plan.baselines if n.startswith("given ")]
    assert len(names) == 2
    assert all("given" in plan.baselines[n] for n in names)
    assert "configurations compared" in explain(plan, collectives=False)
    assert plan.config["compare"] == ["megatron: tp=2 dp=4", "torchtitan: fsdp=4 tp=2 ac=selective"]


def test_cli_refuses_a_bad_compare_naming_the_option(capsys):
    assert cli.main(["solve", str(TINY), "--no-baselines", "--compare", "megatron: tp=8"]) == 2
    err = capsys.readouterr().err
    assert "--compare: megatron: tp=8" in err and "4 attention heads" in err


def _write(tmp_path: Path, compare) -> Path:
    doc = yaml.safe_load(TINY.read_text())
    doc["compare"] = compare
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_config_compare_errors_name_the_key_path(tmp_path):
    path = _write(tmp_path, ["megatron: tp=2", "megatron: tp=2 dp=3"])
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(f"{path}: compare[1]: megatron: tp=2 pp=1")
    with pytest.raises(ConfigError, match=r"compare\[0\]: unknown engine 'alpa'"):
        load_config(_write(tmp_path, ["alpa: tp=2"]))
    with pytest.raises(ConfigError, match="compare: expected a list"):
        load_config(_write(tmp_path, {"megatron": "tp=2"}))


def test_config_compare_is_priced_with_the_plan(tmp_path):
    config = load_config(_write(tmp_path, "megatron: tp=4"))
    assert [g.tp for g in config.compare] == [4]
    plan = solve(config, baselines=False)
    assert "given megatron(tp=4,pp=1,vpp=1,dp=2,mbs=4,recompute=none,sp=false)" in plan.baselines


def test_solve_takes_compare_as_a_keyword(tiny):
    plan = solve(tiny, compare=["megatron: tp=2", "torchtitan: ddp=8"], baselines=False)
    assert {n for n in plan.baselines} == {
        "given megatron(tp=2,pp=1,vpp=1,dp=4,mbs=2,recompute=none,sp=false)",
        "given torchtitan(tp=1,pp=1,vpp=1,ddp=8,fsdp=1,mbs=1,ac=none)"}
    with pytest.raises(ConfigError, match=r"compare\[1\]: megatron: tp=16"):
        solve(tiny, compare=["megatron: tp=2", "megatron: tp=16"])


def test_compare_is_a_sweep_key(tmp_path):
    spec = parse_sweep({"base": str(TINY), "grid": {"compare": ["megatron: tp=2", "megatron: tp=4"]}},
                       str(tmp_path / "s.yaml"))
    assert spec.keys == ("compare",)
    configs = [load_config(spec.base).with_overrides(p.overrides) for p in spec.points()]
    assert [c.compare[0].tp for c in configs] == [2, 4]
    row = plan_row(solve(configs[1], baselines=False))
    assert row["ratio_given_megatron"] >= 1 - 1e-9  # the sweep's table gets its ratio column
