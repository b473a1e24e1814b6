"""The torch runtime against the single-process reference, on gloo with real processes.

Equivalence with one process: for a tiny MLP and a tiny GPT, on 4 and on 8 processes, (a) a pure
intra-op plan with AutoDDL's 3-D family and partial sums, (b) a 2-stage pipelined plan under
eager-1F1B and (c) the same under 1F1B must give the loss of every step and the final
parameters of one process running the unsharded model, within 1e-4 relative, over 3
optimizer steps. Extra variants ride along in the same launches (GPipe, SUMMA, data parallel
with gradient accumulation, the planner's own plans of ``configs/tiny-gpt-cpu.yaml`` —
single-mesh and 2-stage eager-1F1B, and ``configs/tiny-gpt-bf16-cpu.yaml`` in mixed precision,
solved and pipelined, at the bfloat16 tolerance under SGD). One launch per world size keeps
process start-up (the slow part on 2 cores) to two.

Optimizers: both models train with Adam. Adam gives an element whose true gradient is zero
(GPT's key biases) an O(lr) step of random sign from rounding noise; the comparison
(:func:`runtime.reference.compare`, the same one ``--check-reference`` uses) leaves exactly
those elements out and compares the rest at the usual tolerance.

Failure modes: plan/world-size mismatch and corrupted plans fail before any process group
exists (in-process, no torchrun needed); a rank that dies mid-step ends the job with an error.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from formulations.schedules import schedule_actions
from ilp_planner import cli
from ilp_planner.api import solve
from ilp_planner.inputs.config import load_config, parse_config
from ilp_planner.intra_op.baselines import data_parallel_filter, summa_filter
from ilp_planner.ir.cluster import MeshAxis, SubMesh
from ilp_planner.ir.graph import TensorSpec
from ilp_planner.ir.layouts import B, Layout, S
from ilp_planner.ir.regions import layout_blocks
from ilp_planner.plan.data import Plan
from ilp_planner.testing import greedy_unit_tasks, pipelined_plan, restricted_plan, three_d_filter
from runtime import launch
from runtime.executor import Executor, RunOptions
from runtime.optim import OptimizerSpec
from runtime.reference import compare, run_reference, tolerance
from tests.helpers.procs import run

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = ROOT / "configs"
STEPS = 3
RTOL = 1e-4
BF16_RTOL = 1e-2
CHUNK_MB = 0.004
# bfloat16 GPT trains with SGD, which checks it at the dtype's tolerance alone: under Adam a
# half-precision run matches the losses, and its parameters only within the reference's
# own drift from float32 (runtime.reference, DRIFT_MULTIPLE)
OPT = {"gpt": ("adam", 0.01), "mlp": ("adam", 0.01), "utf": ("adam", 0.01),
       "gpt-bf16": ("sgd", 0.1)}
REQUIRED = [(n, m, v) for n in (4, 8) for m in ("mlp", "gpt") for v in ("3d", "eager-1f1b", "1f1b")]
EXTRA = [(4, "mlp", "gpipe"), (4, "mlp", "summa"), (4, "mlp", "dp-accum"), (4, "mlp", "chunks"),
         (4, "mlp", "rowwise"),
         (8, "mlp", "gpipe"),
         (8, "gpt", "gpipe"), (8, "gpt", "solved"),
         (8, "gpt", "solved-pp"), (8, "gpt", "pp-sharded-tied"), (8, "utf", "solved-pp"),
         (4, "gpt-bf16", "eager-1f1b"), (8, "gpt-bf16", "solved")]
# The shipped U-Transformer config (2.1 B parameters) scaled down to CPU size: same structure,
# stages, schedule and long skip edges crossing the stage boundary.
SMALL_UTF = {"model.hidden": 64, "model.layers": 6, "model.heads": 4, "model.seq_len": 16,
             "model.batch": 8, "pipeline.microbatches": 4}


def config(model: str, n: int):
    if model == "utf":
        return load_config(CONFIGS / "u-transformer-2x4.yaml").with_overrides(SMALL_UTF)
    c = load_config(CONFIGS / f"tiny-{model}-cpu.yaml")
    return c if n == 8 else c.with_overrides({"cluster.nodes": 1, "cluster.devices_per_node": 4})


def build_plan(n: int, model: str, variant: str) -> Plan:
    c = config(model, n)
    name = f"{model}{n}-{variant}"
    if variant == "3d":
        sizes = (2, 2, 2) if n == 8 else ((1, 2, 2) if model == "gpt" else (2, 1, 2))
        return restricted_plan(c, three_d_filter(sizes), name=name)
    if variant == "chunks":  # 4 KiB gradient buckets: several chunks, launched during the backward
        return restricted_plan(c.with_overrides({"training.grad_bucket_mb": CHUNK_MB}),
                               three_d_filter((2, 1, 2)), name=name)
    if variant == "rowwise":  # every linear row-parallel: the relus read reduce-scattered
        return restricted_plan(c, three_d_filter((1, 1, 4)), name=name)  # sums, the loss all-reduced
    if variant in ("eager-1f1b", "1f1b", "gpipe"):
        return pipelined_plan(c, stages=2, schedule=variant, microbatches=4, name=name)
    if variant == "pp-sharded-tied":  # stage ILP optimum: the tied table is sharded, so its
        # two copies differ in layout and are exchanged across stages
        return pipelined_plan(c, stages=2, schedule="1f1b", microbatches=2, name=name)
    if variant == "summa":
        return restricted_plan(c, summa_filter(MeshAxis(1, 2), MeshAxis(1, 2)), name=name)
    if variant == "dp-accum":
        c = c.with_overrides({"pipeline.microbatches": 2})
        return restricted_plan(c, data_parallel_filter(MeshAxis(1, 4)), name=name)
    if variant in ("solved", "solved-pp"):  # the planner's own plans (pipelined: stage DP,
        if variant == "solved-pp" and model != "utf":  # CP-SAT resharding order, eager-1F1B)
            c = c.with_overrides({"pipeline": {"stages": 2, "microbatches": 4,
                                               "schedule": "eager-1f1b"}})
        plan = solve(c, baselines=False)
        plan.name = name
        return plan
    raise ValueError(variant)


def _launch(n: int, tmp: Path) -> dict:
    """Build this world size's plans, train them all in one launch, return results by name."""
    cases = [c for c in REQUIRED + EXTRA if c[0] == n]
    files, opts, lrs = [], [], []
    for _, model, variant in cases:
        path = tmp / f"{model}{n}-{variant}.json"
        build_plan(n, model, variant).save(path)
        files.append(str(path))
        opts.append(OPT[model][0])
        lrs.append(str(OPT[model][1]))
    common = ["--steps", str(STEPS), "--optimizer", ",".join(opts), "--lr", ",".join(lrs),
              "--results", str(tmp / "results.json"), "--save-params", str(tmp / "params"),
              "--timings", str(tmp / "timings.csv"), "--quiet", "--audit", "--check-reference"]
    if n == 4:  # through the CLI wrapper
        cmd = [sys.executable, "-m", "ilp_planner.cli", "run", *files, "--nproc-per-node", "4", *common]
    else:  # torchrun directly
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               "8", "-m", "runtime.launch", *files, *common]
    res = run(cmd, timeout=420)
    assert res.returncode == 0, f"launch failed:\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    out = {Path(r["file"]).stem: r for r in json.loads((tmp / "results.json").read_text())}
    for stem in out:
        out[stem]["params"] = torch.load(tmp / "params" / f"{stem}.pt")
        out[stem]["plan"] = Plan.load(tmp / f"{stem}.json")
    out["__stdout__"] = res.stdout
    out["__timings__"] = (tmp / "timings.csv").read_text()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("n,model,variant", REQUIRED + EXTRA,
                         ids=[f"{n}-{m}-{v}" for n, m, v in REQUIRED + EXTRA])
def test_executed_collectives_equal_the_planned_ones(runs, n: int, model: str, variant: str) -> None:
    """A plan is a program: on every rank and every step, the collectives the dispatch-level
    recorder saw (count and bytes per kind and purpose: forward, autograd backward, weight-
    gradient sync, tied exchange, pipeline transfers) equal what the plan prices (--audit)."""
    r = runs[n][f"{model}{n}-{variant}"]
    assert r["audit_ok"] is True
    assert "planned vs executed collectives per rank (OK)" in runs[n]["__stdout__"]
    assert "MISMATCH" not in runs[n]["__stdout__"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, dict]:
    return {n: _launch(n, tmp_path_factory.mktemp(f"world{n}")) for n in (4, 8)}


_REFS: dict[tuple, object] = {}


def reference(plan: Plan, model: str, microbatches: int):
    key = (json.dumps(plan.config["model"], sort_keys=True), microbatches, model)
    if key not in _REFS:
        opt, lr = OPT[model]
        _REFS[key] = run_reference(parse_config(plan.config).graph, steps=STEPS, seed=0,
                                   optimizer=OptimizerSpec(opt, lr), microbatches=microbatches)
    return _REFS[key]


@pytest.mark.slow
@pytest.mark.parametrize("n,model,variant", REQUIRED + EXTRA,
                         ids=[f"{n}-{m}-{v}" for n, m, v in REQUIRED + EXTRA])
def test_matches_single_process(runs, n: int, model: str, variant: str) -> None:
    r = runs[n][f"{model}{n}-{variant}"]
    plan = r["plan"]
    ex = Executor(plan, RunOptions(), rank=0, world=n)  # pure: how many micro-batches
    ref = reference(plan, model, ex.compiled.microbatches)
    rtol = tolerance(ex.compiled.graph)
    assert rtol == (RTOL if model != "gpt-bf16" else BF16_RTOL)
    assert len(r["losses"]) == STEPS
    for step, (got, want) in enumerate(zip(r["losses"], ref.losses, strict=True)):
        assert abs(got - want) <= rtol * abs(want), f"step {step}: loss {got} vs {want}"
    assert r["losses"][-1] < r["losses"][0]  # the optimizer steps did train
    assert set(r["params"]) == set(ref.params)
    cmp = compare(r["losses"], r["params"], ref)
    assert cmp.ok(rtol), f"parameter {cmp.worst_param}: rel err {cmp.param_rel_err:.2e}"
    assert r["reference"]["param_rel_err"] <= rtol  # --check-reference said OK on rank 0 too


@pytest.mark.slow
def test_adam_leaves_out_only_the_gradient_free_key_biases(runs) -> None:
    """Under Adam, the elements left out of the comparison are the GPT's key biases (zero
    gradient in exact arithmetic: softmax ignores them) and nothing else."""
    r = runs[8]["gpt8-solved"]
    ex = Executor(r["plan"], RunOptions(), rank=0, world=8)
    ref = reference(r["plan"], "gpt", ex.compiled.microbatches)
    heads = r["plan"].config["model"]["heads"]
    left_out = {k: m for k, m in ref.undetermined.items() if m.any()}
    assert left_out and all(k.endswith("qkv.bias") for k in left_out)
    for m in left_out.values():  # per head (q, k, v) blocks, as runtime.model.attention reads them
        qkv = m.reshape(heads, 3, -1)
        assert qkv[:, 1].all() and not qkv[:, 0].any() and not qkv[:, 2].any()


@pytest.mark.slow
def test_gradient_chunks_are_reduced_during_the_backward(runs) -> None:
    """Rank 0's first step in recorded order: chunks of the later layers' gradients are
    AllReduced before the backward reaches the first layer (whose input gradient's
    collective comes after them), and all inside the backward."""
    r = runs[4]["mlp4-chunks"]
    order = r["order"]
    planned = [c for ly in r["plan"].layers for c in ly.collectives if c.purpose == "grad_sync"]
    syncs = [i for i, x in enumerate(order) if x.startswith("backward/grad_sync:")]
    assert len(syncs) == len(planned) >= 3
    into_fc1 = order.index("backward/activation:relu1")  # dX of fc2, on its way to fc1
    assert syncs[0] < into_fc1 < syncs[-1] < order.index("backward_end:0"), order
    assert order[syncs[0]] != "backward/grad_sync:fc1"


@pytest.mark.slow
def test_overlapped_gradient_sync_equals_the_sequential_one(runs, tmp_path) -> None:
    """The same plan with its chunks reduced after the backward (``--no-overlap``) trains to
    bit-identical losses and parameters."""
    path = tmp_path / "mlp4-chunks.json"
    build_plan(4, "mlp", "chunks").save(path)
    res = run([sys.executable, "-m", "ilp_planner.cli", "run", str(path), "--nproc-per-node", "4",
                "--steps", str(STEPS), "--optimizer", OPT["mlp"][0], "--lr", str(OPT["mlp"][1]),
                "--results", str(tmp_path / "r.json"), "--save-params", str(tmp_path / "p"),
                "--quiet", "--no-overlap"], timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    seq = json.loads((tmp_path / "r.json").read_text())[0]
    over = runs[4]["mlp4-chunks"]
    assert seq["losses"] == over["losses"]
    params = torch.load(tmp_path / "p" / "mlp4-chunks.pt")
    assert all(torch.equal(params[k], over["params"][k]) for k in params)


@pytest.mark.slow
def test_runs_print_losses_and_write_timings(runs) -> None:
    out = runs[4]["__stdout__"]
    assert "plan mlp4-eager-1f1b" in out and "2 stage(s), 4 micro-batch(es)" in out
    rows = runs[8]["__timings__"].splitlines()
    assert rows[0] == "collective,group_size,bytes,link,seconds"
    kinds = {row.split(",")[0] for row in rows[1:]}
    assert {"all_reduce", "all_gather", "reduce_scatter", "broadcast"} <= kinds


# -- the plans are what they claim -------------------------------------------------------------


@pytest.mark.parametrize("n", [4, 8])
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_3d_plans_have_three_axes_and_partial_sums(n: int, model: str) -> None:
    plan = build_plan(n, model, "3d")
    mm = [lp for lp in plan.layers if lp.kind in ("linear", "embedding")]
    assert mm and all(lp.strategy.startswith("3d") and lp.output.has_partial for lp in mm)
    if n == 8:
        assert all([a.size for a in lp.output.fact] == [2, 2, 2] for lp in mm)


def test_rowwise_plan_reduces_partial_sums_both_ways() -> None:
    """The row-parallel variant exercises both resolutions of partial sums a follower can
    read: reduce-scattered (the relus) and all-reduced to replicated (the loss)."""
    plan = build_plan(4, "mlp", "rowwise")
    reads = {lp.name: lp.inputs[0] for lp in plan.layers if lp.strategy.startswith("follows")}
    assert reads["relu1"].split_degree(1) == 4 and reads["loss"].split_degree(1) == 1
    assert not reads["loss"].has_partial


@pytest.mark.parametrize("schedule", ["eager-1f1b", "1f1b"])
def test_pipelined_plans_cut_two_stages(schedule: str) -> None:
    plan = build_plan(8, "gpt", schedule)
    assert [s.devices for s in plan.stages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert plan.schedule.to_dict()["actions"] == schedule_actions(schedule, 2, 4)
    assert {lp.stage for lp in plan.layers} == {0, 1} and plan.resharding
    warm = {"eager-1f1b": 3, "1f1b": 2}[schedule]
    assert list(plan.schedule.actions[0][:warm + 1]) == [f"F{k}" for k in range(warm)] + ["B0"]


# -- failure modes -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plan4(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plans") / "mlp4.json"
    build_plan(4, "mlp", "1f1b").save(path)
    return path


def _main_as_rank(monkeypatch, argv: list[str], world: int) -> int:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world))
    return launch.main(argv)


def test_world_size_mismatch_fails_before_any_collective(monkeypatch, capsys, plan4) -> None:
    assert _main_as_rank(monkeypatch, [str(plan4)], world=2) == 2
    err = capsys.readouterr().err
    assert "is for 4 devices but the world has 2 processes" in err and "--nproc-per-node 4" in err
    assert not torch.distributed.is_initialized()


def test_run_verb_checks_nproc_before_spawning(capsys, plan4) -> None:
    assert cli.main(["run", str(plan4), "--nproc-per-node", "3"]) == 2
    assert "is for 4 devices but --nproc-per-node is 3" in capsys.readouterr().err


def _corrupt(plan4: Path, tmp_path: Path, edit) -> Path:
    d = json.loads(plan4.read_text())
    edit(d)
    out = tmp_path / "bad.json"
    out.write_text(json.dumps(d))
    return out


CORRUPTIONS = {
    "truncated": (None, "not valid JSON"),
    "no-schema": (lambda d: d.pop("schema"), "not an ilp_planner plan"),
    "layer-missing-strategy": (lambda d: d["layers"][0].pop("strategy"),
                               "layers[0].strategy: missing"),
    "sender-not-holder": (lambda d: d["resharding"][0]["tasks"][0].update(sender=3),
                          "is not a holder"),
    "task-dropped": (lambda d: d["resharding"][0]["tasks"].pop(), "receives 0 of the"),
    "backward-before-forward": (lambda d: d["schedule"]["actions"].update({"1": ["B0", "F0"] + [
        a for a in d["schedule"]["actions"]["1"] if a not in ("F0", "B0")]}), "B0"),
    "stage-missing-layer": (lambda d: d["stages"][1]["layers"].pop(), "each layer in exactly one"),
    # stage 1 runs micro-batches 0 and 1 in the other order: every dependency holds, but the
    # transfers on link 0→1 would hand it micro-batch 0's activations as micro-batch 1's
    "microbatches-swapped": (lambda d: d["schedule"]["actions"].update({"1": [
        {"F0": "F1", "F1": "F0", "B0": "B1", "B1": "B0"}.get(a, a)
        for a in d["schedule"]["actions"]["1"]]}), "messages on one link are matched in order"),
    "bogus-label": (lambda d: d["layers"][0]["strategy"].update(label="bogus"), "label 'bogus'"),
    "relu-reads-partial-sums": (lambda d: d["layers"][1]["strategy"]["inputs"][0].update(
        placements=["S(0)", "P", "P"]), "partial sums resolved"),
    "layouts-not-the-strategy's": (lambda d: d["layers"][0]["strategy"]["weight"].update(
        placements=["S(0)", "B", "B"]), "are not those of strategy"),
    "nan-seconds": (lambda d: d["layers"][4]["collectives"][0].update(seconds=float("nan")),
                    "layers[4].collectives[0].seconds: expected a finite number"),
    "negative-compute": (lambda d: d["layers"][0].update(compute_s=-1.0),
                         "layers[0].compute_s: expected a non-negative number"),
    "bool-microbatches": (lambda d: d["schedule"].update(num_microbatches=True),
                          "expected a positive integer"),
    "split-dim-out-of-range": (lambda d: d["layers"][0]["strategy"]["output"].update(
        placements=["S(7)", "B", "B"]), "layers[0] (fc1).strategy.output"),
    "stage-devices-swapped-in": (lambda d: d["stages"][1].update(devices=[0, 1]),
                                 "overlap or lie outside"),
    "layer-dropped-from-config": (lambda d: d["config"]["model"].update(
        dims=d["config"]["model"]["dims"][:-1]), "do not match the config's graph"),
    "config-dims-edited": (lambda d: d["config"]["model"].update(
        dims=[2 * x for x in d["config"]["model"]["dims"]]), "the config was edited"),
}


# a rank skips the strategy enumeration (``check`` and ``run`` ran it): a label no strategy has
# compiles on a rank; layouts no strategy has are refused by the rank's own lowering instead
ENUMERATION_ONLY = {"bogus-label"}
RANK_MESSAGES = {"layouts-not-the-strategy's": "a matmul runs the 3-D family"}


@pytest.mark.parametrize("case", sorted(set(CORRUPTIONS) - ENUMERATION_ONLY))
def test_corrupted_plan_fails_fast(monkeypatch, capsys, tmp_path, plan4, case: str) -> None:
    edit, message = CORRUPTIONS[case]
    message = RANK_MESSAGES.get(case, message)
    if edit is None:
        bad = tmp_path / "bad.json"
        bad.write_text(plan4.read_text()[:500])
    else:
        bad = _corrupt(plan4, tmp_path, edit)
    assert _main_as_rank(monkeypatch, [str(bad)], world=4) == 2
    assert message in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_check_verb_names_what_is_wrong(capsys, tmp_path, plan4, case: str) -> None:
    edit, message = CORRUPTIONS[case]
    if edit is None:
        bad = tmp_path / "bad.json"
        bad.write_text(plan4.read_text()[:500])
    else:
        bad = _corrupt(plan4, tmp_path, edit)
    assert cli.main(["check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(bad) in err.splitlines()[0] and "Traceback" not in err


@pytest.mark.parametrize("case", sorted(ENUMERATION_ONLY))
def test_a_rank_leaves_the_strategy_enumeration_to_the_verbs(monkeypatch, capsys, tmp_path,
                                                             plan4, case: str) -> None:
    """A rank's check enumerates no strategy (the check and run verbs do, in full), so a
    plan only the enumeration refuses compiles on a rank and is refused by both verbs."""
    from ilp_planner.plan import layer_check

    edit, message = CORRUPTIONS[case]
    bad = _corrupt(plan4, tmp_path, edit)
    plan = Plan.load(bad)

    def enumerated(*_):
        raise AssertionError("a rank enumerated strategies")

    monkeypatch.setattr(layer_check, "op_strategies", enumerated)
    Executor(plan, RunOptions(), rank=0, world=4)
    monkeypatch.undo()
    assert cli.main(["check", str(bad)]) == 2 and message in capsys.readouterr().err
    assert cli.main(["run", str(bad), "--nproc-per-node", "4"]) == 2
    assert message in capsys.readouterr().err


def test_check_verb_accepts_a_valid_plan_and_says_if_it_runs_here(capsys, plan4) -> None:
    assert cli.main(["check", str(plan4)]) == 0
    assert "ok" in capsys.readouterr().out


def test_binary_plan_file_is_a_format_error(monkeypatch, capsys, tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe\x00\x81 not a plan")
    assert _main_as_rank(monkeypatch, [str(bad)], world=4) == 2
    err = capsys.readouterr().err
    assert "not UTF-8" in err and "Traceback" not in err


def test_run_verb_refuses_an_invalid_plan_before_any_rank_starts(monkeypatch, capsys, tmp_path,
                                                                 plan4) -> None:
    """`ilp-planner run` compiles every plan in the parent as the ranks would: one error
    (a schedule error carries its grid below), exit 2, and torchrun never spawned."""
    from ilp_planner.commands import run as run_verb

    def spawn(*_args, **_kwargs):
        raise AssertionError("torchrun was spawned for an invalid plan")

    monkeypatch.setattr(run_verb, "launch_ranks", spawn)
    bad = _corrupt(plan4, tmp_path, CORRUPTIONS["microbatches-swapped"][0])
    assert cli.main(["run", str(bad), "--nproc-per-node", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "matched in order" in err.splitlines()[0]
    assert "Traceback" not in err and "rank" not in err


@pytest.mark.slow
def test_crashed_rank_ends_the_job(tmp_path) -> None:
    c = load_config(CONFIGS / "tiny-mlp-cpu.yaml").with_overrides(
        {"cluster.nodes": 1, "cluster.devices_per_node": 2})
    path = tmp_path / "dp2.json"
    restricted_plan(c, data_parallel_filter(MeshAxis(1, 2))).save(path)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "runtime.launch", str(path), "--steps", "3", "--timeout", "20",
           "--crash-rank", "1", "--crash-step", "1"]
    res = run(cmd, timeout=180)
    assert res.returncode != 0
    assert "crashing on purpose at step 1" in res.stderr


# -- pure helpers ------------------------------------------------------------------------------


def _fact(*sizes: int):
    return tuple(MeshAxis(1, s) for s in sizes)


@pytest.mark.parametrize("src,dst", [
    (Layout(_fact(2, 2), (S(0), S(1))), Layout(_fact(4), (S(1),))),
    (Layout(_fact(2, 2), (S(0), B)), Layout(_fact(2, 2), (S(1), S(0)))),
    (Layout(_fact(4), (S(0),)), Layout(_fact(2, 2), (S(0), S(0)))),
])
def test_unit_tasks_deliver_every_element_once(src: Layout, dst: Layout) -> None:
    shape = (8, 12)
    src_mesh, dst_mesh = SubMesh(0, 1, 0, 4, 8), SubMesh(0, 1, 4, 4, 8)
    src_dev, dst_dev = src_mesh.device_ids(), dst_mesh.device_ids()
    tasks = greedy_unit_tasks(TensorSpec(shape), src_mesh, src, dst_mesh, dst)
    src_reg = dict(zip(src_dev, layout_blocks(src, shape), strict=True))
    dst_reg = dict(zip(dst_dev, layout_blocks(dst, shape), strict=True))
    got = {d: torch.zeros(shape, dtype=torch.int64) for d in dst_dev}
    for t in tasks:
        assert t.sender in t.holders
        sl = tuple(slice(a, b) for a, b in t.region)
        for h in t.holders:
            assert all(a >= lo and b <= hi for (a, b), (lo, hi) in zip(t.region, src_reg[h], strict=True))
        for r in t.receivers:
            got[r][sl] += 1
    for d in dst_dev:
        want = torch.zeros(shape, dtype=torch.int64)
        want[tuple(slice(a, b) for a, b in dst_reg[d])] = 1
        assert torch.equal(got[d], want)


def test_run_verb_forwards_exactly_the_launcher_options():
    """`ilp-planner run` declares the launcher's own options and hands them over verbatim."""
    from ilp_planner.cli import build_parser as cli_parser
    from runtime.launch import build_parser as launch_parser
    from runtime.launch import forward_options

    args = cli_parser().parse_args(
        ["run", "p.json", "--nproc-per-node", "4", "--steps", "5", "--optimizer", "sgd",
         "--check-reference", "--timings", "t.csv", "--audit"])
    launched = launch_parser().parse_args([*args.plans, *forward_options(args)])
    for key, value in vars(launched).items():
        if key not in ("crash_rank", "crash_step"):
            assert getattr(args, key) == value, key
    assert launched.steps == 5 and launched.check_reference and launched.audit
