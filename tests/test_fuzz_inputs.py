"""Every input checked: malformed plans, configs, sweeps and results files thrown
at the CLI entry points, in process. For each: exit 0 (the input was still valid) or exit 2
with exactly one ``error:`` naming the file — never an exception escaping, never unbounded
output. The cases are generated deterministically from valid inputs: every field of a
pipelined and a single-stage plan, of a config and of a sweep, replaced by values of the
wrong type, out of range, non-finite, huge, or removed."""

from __future__ import annotations

import argparse
import copy
import json
import random
import shutil
from pathlib import Path

import pytest
import yaml

from ilp_planner import cli
from ilp_planner.api import solve
from ilp_planner.inputs.config import load_config
from ilp_planner.inputs.config_keys import SECTIONS, model_section
from ilp_planner.testing import pipelined_plan

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TINY_MLP = CONFIGS / "tiny-mlp-cpu.yaml"
MAX_OUTPUT = 10_000

BAD_VALUES = [None, "abc", -1, 0, 1.5, float("nan"), float("inf"), True, [], {}, 10**30, [[-1]]]
DROP = object()


def _paths(d, prefix=()):
    """Every (path) to a value in a nested dict/list document."""
    if isinstance(d, dict):
        for k, v in d.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))
    elif isinstance(d, list):
        for i, v in enumerate(d[:3]):  # the first few items stand for the rest
            yield (*prefix, i)
            yield from _paths(v, (*prefix, i))


def _mutated(doc, path, value):
    out = copy.deepcopy(doc)
    node = out
    for k in path[:-1]:
        node = node[k]
    if value is DROP:
        if isinstance(node, dict):
            del node[path[-1]]
        else:
            node.pop(path[-1])
    else:
        node[path[-1]] = value
    return out


def _cases(doc, n: int, seed: int):
    """``n`` deterministic (path, value) mutations spread over every path of ``doc``."""
    rng = random.Random(seed)
    paths = list(_paths(doc))
    rng.shuffle(paths)
    out = []
    for i in range(n):
        path = paths[i % len(paths)]
        value = rng.choice([DROP, *BAD_VALUES])
        out.append((path, value))
    return out


def _run(capsys, argv, bad: Path) -> int:
    """Run the CLI: exit 0, or 2 with one ``error:`` naming ``bad``; bounded output."""
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert len(out) + len(err) < MAX_OUTPUT
    assert code in (0, 2), (code, err)
    if code == 2:
        assert err.count("error:") == 1 and str(bad) in err, err
    return code


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    mlp = load_config(TINY_MLP).with_overrides({"cluster.nodes": 1, "cluster.devices_per_node": 4})
    piped = mlp.with_overrides({"pipeline.stages": 2, "pipeline.microbatches": 2})
    return {"pipelined": pipelined_plan(mlp, stages=2, schedule="1f1b", microbatches=2).to_dict(),
            "single": solve(mlp, baselines=False).to_dict(),
            "solved-pipelined": solve(piped).to_dict()}


PLAN_CASES = [(kind, i) for kind in ("pipelined", "single") for i in range(90)]


@pytest.mark.parametrize("kind, i", PLAN_CASES, ids=[f"{k}-{i}" for k, i in PLAN_CASES])
def test_malformed_plans(capsys, tmp_path, plans, kind, i):
    doc = plans[kind]
    path, value = _cases(doc, 90, seed=1 if kind == "pipelined" else 2)[i]
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(_mutated(doc, path, value)))
    _run(capsys, ["check", str(bad)], bad)


def _mistyped(value):
    """A value of another JSON type than ``value``."""
    if isinstance(value, bool) or value is None or isinstance(value, int | float):
        return "x"
    return {str: 1, list: {"x": 1}, dict: [1]}[type(value)]


def _get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


@pytest.mark.parametrize("kind", ["single", "solved-pipelined"])
def test_every_plan_field_deleted_or_mistyped(capsys, tmp_path, plans, kind):
    """Each field of a solved plan (outside its embedded config, which the config cases
    cover), deleted and then given a value of another type: ``check`` answers with one
    error line or calls the plan runnable, never a traceback."""
    doc = plans[kind]
    bad = tmp_path / "plan.json"
    for path in _paths(doc):
        if path[0] == "config":
            continue
        for value in (DROP, _mistyped(_get(doc, path))):
            bad.write_text(json.dumps(_mutated(doc, path, value)))
            _run(capsys, ["check", str(bad)], bad)


@pytest.mark.parametrize("edit, phrase", [
    (lambda d: d["schedule"].update(name="zb-v"), "schedule.name: unknown pipeline schedule"),
    (lambda d: d["schedule"].pop("name"), "schedule.name: missing"),
    (lambda d: d["stages"][0].pop("dp_time_s"), "stages[0].dp_time_s: missing"),
    (lambda d: d["stages"][0].update(dp_time_s="slow"), "stages[0].dp_time_s: expected"),
    (lambda d: [ly["strategy"].update(mesh=[[1, 64]]) for ly in d["layers"]],
     "layers[0].strategy.mesh: [[1, 64]] is not the mesh of its layouts"),
    (lambda d: d.update(solver="x"), "solver: expected a mapping"),
    (lambda d: d.update(baselines=[1]), "baselines: expected a mapping"),
    (lambda d: d["resharding"][0].update(makespan_s="x"), "resharding[0].makespan_s: expected"),
    (lambda d: d.update(name=1), "name: expected a string"),
    (lambda d: d["layers"][0]["strategy"]["output"].update(sbp=1),
     "layers[0].strategy.output.sbp: expected a string"),
], ids=["unknown-schedule", "no-schedule-name", "no-dp-time", "slow-dp-time", "mesh-64",
        "solver-x", "baselines-list", "makespan-x", "name-int", "sbp-int"])
@pytest.mark.parametrize("verb", ["check", "explain", "simulate", "diff"])
def test_plans_once_accepted_or_crashing_are_refused(capsys, tmp_path, plans, verb, edit, phrase):
    """Plans every verb once ran (or crashed on): each verb now refuses them naming the field."""
    doc = copy.deepcopy(plans["solved-pipelined"])
    edit(doc)
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(doc))
    argv = [verb, str(bad), str(bad)] if verb == "diff" else [verb, str(bad)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert phrase in err and err.count("error:") == 1, err


@pytest.mark.parametrize("m", ["0", "-3"])
def test_simulate_refuses_a_microbatch_count_below_one(capsys, tmp_path, plans, m):
    """``--microbatches 0`` is an error, not the plan's own count silently used."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(plans["solved-pipelined"]))
    assert cli.main(["simulate", str(plan), "--microbatches", m]) == 2
    assert f"--microbatches: expected a positive integer, got {m}" in capsys.readouterr().err


CONFIG_DOC = yaml.safe_load(TINY_MLP.read_text())
CONFIG_CASES = _cases(CONFIG_DOC, 100, seed=3)


@pytest.mark.parametrize("i", range(len(CONFIG_CASES)))
def test_malformed_configs(capsys, tmp_path, i):
    path, value = CONFIG_CASES[i]
    bad = tmp_path / "config.yaml"
    bad.write_text(yaml.safe_dump(_mutated(CONFIG_DOC, path, value)))
    _run(capsys, ["validate", str(bad)], bad)


SWEEP_DOC = {"base": str(TINY_MLP), "grid": {"solver.seed": [0]},
             "solve": {"baselines": False, "timeout_s": 30}}
SWEEP_CASES = _cases(SWEEP_DOC, 40, seed=4)


@pytest.mark.parametrize("i", range(len(SWEEP_CASES)))
def test_malformed_sweeps(capsys, tmp_path, i):
    path, value = SWEEP_CASES[i]
    bad = tmp_path / "sweep.yaml"
    bad.write_text(yaml.safe_dump(_mutated(SWEEP_DOC, path, value)))
    _run(capsys, ["sweep", str(bad), "--max-points", "3", "-q", "--no-plots",
                  "-o", str(tmp_path / "out")], bad)


ROW_VALUES = [None, "abc", -1, float("nan"), True, [], {}, "../../../../etc/passwd", 10**30]


@pytest.mark.parametrize("i", range(24))
def test_malformed_results_files(capsys, tmp_path, i):
    """A resumed sweep re-solves rows it cannot trust and never crashes on them."""
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump(SWEEP_DOC))
    out = tmp_path / "out"
    assert cli.main(["sweep", str(sweep), "-q", "--no-plots", "-o", str(out)]) == 0
    capsys.readouterr()
    jsonl = out / "results.jsonl"
    row = json.loads(jsonl.read_text().splitlines()[0])
    rng = random.Random(i)
    key = rng.choice(sorted(row))
    if i % 6 == 5:
        jsonl.write_bytes(b"\xff\xfe" + jsonl.read_bytes())
    else:
        row[key] = rng.choice(ROW_VALUES)
        jsonl.write_text(json.dumps(row) + "\n")
    _run(capsys, ["sweep", str(sweep), "-q", "--no-plots", "--resume", "-o", str(out)], jsonl)


def _numeric_keys():
    """(section path in the tiny MLP config, key, huge value) for every number and integer
    option :data:`SECTIONS` declares for it."""
    places = {"solver": ("solver",), "pipeline": ("pipeline",), "training": ("training",),
              "training.bytes_per_param": ("training", "bytes_per_param"),
              "cluster": ("cluster",), "cluster.links.<intra|inter>": ("cluster", "links", "intra"),
              model_section("mlp"): ("model",)}
    for section, where in places.items():
        for name, key in SECTIONS[section].items():
            if key.type in ("integer", "number"):
                yield where, name, 10**30 if key.type == "integer" else 1e308


HUGE_CASES = list(_numeric_keys())


@pytest.mark.parametrize("where, name, value", HUGE_CASES,
                         ids=[".".join((*w, n)) for w, n, _ in HUGE_CASES])
def test_huge_numbers_in_every_numeric_option(capsys, tmp_path, where, name, value):
    """A huge number in any option is refused naming its bound, or solved — never an
    overflow deep in a solver, never accepted and silently ignored."""
    doc = copy.deepcopy(CONFIG_DOC)
    node = doc
    for k in where:
        node = node.setdefault(k, {})
    if name in ("alpha", "beta"):  # a fitted link gives both instead of latency and bandwidth
        node.clear()
        node.update(alpha=1e-5, beta=1e-9)
    node[name] = value
    bad = tmp_path / "config.yaml"
    bad.write_text(yaml.safe_dump(doc))
    _run(capsys, ["solve", str(bad)], bad)


@pytest.fixture(scope="module")
def solved_sweep(tmp_path_factory):
    """A sweep file and the results folder of its run, to copy and break."""
    root = tmp_path_factory.mktemp("sweep")
    sweep = root / "sweep.yaml"
    sweep.write_text(yaml.safe_dump(SWEEP_DOC))
    assert cli.main(["sweep", str(sweep), "-q", "--no-plots", "-o", str(root / "out")]) == 0
    return sweep, root / "out"


@pytest.mark.parametrize("key", ["id", "overrides", "fingerprint", "plan", "status", "error"])
@pytest.mark.parametrize("value", [[], ["a", 1], {"a": [1]}, 7, None])
def test_every_results_row_key_malformed_on_resume(capsys, tmp_path, solved_sweep, key, value):
    """Each key of a recorded row given a value of another shape: ``--resume`` solves the
    point again (or keeps it, where the value is harmless) and never crashes on the row."""
    sweep, done = solved_sweep
    out = tmp_path / "out"
    shutil.copytree(done, out)
    jsonl = out / "results.jsonl"
    row = json.loads(jsonl.read_text().splitlines()[0])
    row[key] = value
    jsonl.write_text(json.dumps(row) + "\n")
    _run(capsys, ["sweep", str(sweep), "-q", "--no-plots", "--resume", "-o", str(out)], jsonl)
    kept = json.loads((out / "results.jsonl").read_text().splitlines()[0])
    assert isinstance(kept["id"], str) and isinstance(kept["overrides"], dict)


SWEEP_OUTPUTS = ["plans", "results.jsonl", "results.csv", "results.md",
                 "solve_s_vs_solver.seed.png"]


@pytest.mark.parametrize("name", SWEEP_OUTPUTS)
def test_sweep_outputs_confused_file_and_folder(capsys, tmp_path, name):
    """A file where the sweep writes a folder, or a folder where it writes a file: one
    error naming it, before any point is solved."""
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({**SWEEP_DOC, "plot": [
        {"metric": "solve_s", "x": "solver.seed"}]}))
    out = tmp_path / "out"
    out.mkdir()
    if name == "plans":
        (out / name).write_text("in the way")
    else:
        (out / name).mkdir()
    argv = ["sweep", str(sweep), "-q", "-o", str(out)]
    _run(capsys, argv, out / name)
    assert not (out / "results.csv").is_file()


RESHARD = ["reshard", "--shape", "64,64", "--src-mesh", "1x2", "--src-spec", "S0R",
           "--dst-mesh", "1x2", "--dst-spec", "RS0", "--algo", "naive,load_balance,cpsat",
           "--no-compare"]


def _numeric_flags():
    """(verb's argv, flag, value) for every int and float option of the verbs that run in
    seconds, each given a huge, a negative, a zero and (floats) a non-finite value."""
    sub = next(a for a in cli.build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    base = {"reshard": RESHARD, "simulate": ["simulate", "{plan}"],
            "solve": ["solve", str(TINY_MLP), "--no-baselines"],
            "sweep": ["sweep", "{sweep}", "-q", "--no-plots", "-j", "1", "-o", "{out}"]}
    for verb, argv in base.items():
        for action in sub.choices[verb]._actions:
            if action.type not in (int, float) or not action.option_strings:
                continue
            if verb == "sweep" and action.dest == "jobs":
                continue  # a worker count is capped by the points to solve (backends)
            values = [str(10**30), "-5", "0"] + (["1e308", "nan"] if action.type is float else [])
            for value in values:
                yield argv, action.option_strings[-1], value


FLAG_CASES = list(_numeric_flags())


@pytest.mark.parametrize("argv, flag, value", FLAG_CASES,
                         ids=[f"{a[0]}{f}={v}" for a, f, v in FLAG_CASES])
def test_huge_and_odd_numbers_in_every_numeric_flag(capsys, tmp_path, plans, argv, flag, value):
    """A command-line number out of range is one error naming the flag, or a valid run."""
    plan, sweep = tmp_path / "plan.json", tmp_path / "sweep.yaml"
    plan.write_text(json.dumps(plans["solved-pipelined"]))
    sweep.write_text(yaml.safe_dump(SWEEP_DOC))
    full = [a.format(plan=plan, sweep=sweep, out=tmp_path / "out") for a in argv] + [flag, value]
    code = cli.main(full)
    out, err = capsys.readouterr()
    assert len(out) + len(err) < MAX_OUTPUT
    assert code in (0, 2), (code, err)
    if code == 2:
        assert err.count("error:") == 1, err


OUTPUTS = {  # verb argv with {out} for its output: a file it writes (or, for sweep, a folder)
    "solve -o": ["solve", str(TINY_MLP), "--no-baselines", "-o", "{out}"],
    "simulate --plot": ["simulate", "{plan}", "--plot", "{out}"],
    "calibrate -o": ["calibrate", "{csv}", "-o", "{out}"],
    "reshard --dump-model": [*RESHARD, "--dump-model", "{out}"],
    "sweep -o": ["sweep", "{sweep}", "-q", "--no-plots", "-j", "1", "-o", "{out}"],
}


@pytest.mark.parametrize("confusion", ["folder-for-file", "file-in-the-path"])
@pytest.mark.parametrize("output", sorted(OUTPUTS))
def test_every_output_confused_file_and_folder(capsys, tmp_path, plans, output, confusion):
    """Each verb's output given a folder where it writes a file (a file where the sweep
    writes its folder), or a path through a file: one error naming that output."""
    plan, sweep, csv = tmp_path / "plan.json", tmp_path / "sweep.yaml", tmp_path / "t.csv"
    plan.write_text(json.dumps(plans["solved-pipelined"]))
    sweep.write_text(yaml.safe_dump(SWEEP_DOC))
    csv.write_text("collective,group_size,bytes,link,seconds\n" + "".join(
        f"all_reduce,{p},{n},{link},{1e-5 + n * p * 1e-10}\n"
        for link in ("intra", "inter") for p in (2, 4) for n in (1e3, 1e6)))
    blocker = tmp_path / "blocker"
    if confusion == "file-in-the-path":
        blocker.write_text("a file")
        out = blocker / "sub" / "out.x"
    elif output == "sweep -o":
        blocker.write_text("a file")
        out = blocker
    else:
        blocker.mkdir()
        out = blocker
    argv = [a.format(plan=plan, sweep=sweep, csv=csv, out=out) for a in OUTPUTS[output]]
    assert _run(capsys, argv, out) == 2


@pytest.mark.parametrize("key", ["timeout_s", "memory_gib"])
@pytest.mark.parametrize("value", [1e308, 10**30])
def test_huge_numbers_in_every_sweep_option(capsys, tmp_path, key, value):
    """A sweep's own numbers are bounded like a config's: refused naming the key, never
    an overflow in each point's alarm clock recorded as that point's failure."""
    bad = tmp_path / "sweep.yaml"
    bad.write_text(yaml.safe_dump({**SWEEP_DOC, "solve": {**SWEEP_DOC["solve"], key: value}}))
    argv = ["sweep", str(bad), "-q", "--no-plots", "-j", "1", "-o", str(tmp_path / "out")]
    assert _run(capsys, argv, bad) == 2
