"""Every input checked (issue 17): malformed plans, configs, sweeps and results files thrown
at the CLI entry points, in process. For each: exit 0 (the input was still valid) or exit 2
with exactly one ``error:`` naming the file — never an exception escaping, never unbounded
output. The cases are generated deterministically from valid inputs: every field of a
pipelined and a single-stage plan, of a config and of a sweep, replaced by values of the
wrong type, out of range, non-finite, huge, or removed."""

from __future__ import annotations

import copy
import json
import random
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


def _run(capsys, argv, bad: Path) -> None:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert len(out) + len(err) < MAX_OUTPUT
    assert code in (0, 2), (code, err)
    if code == 2:
        assert err.count("error:") == 1 and str(bad) in err, err


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    mlp = load_config(TINY_MLP).with_overrides({"cluster.nodes": 1, "cluster.devices_per_node": 4})
    return {"pipelined": pipelined_plan(mlp, stages=2, schedule="1f1b", microbatches=2).to_dict(),
            "single": solve(mlp, baselines=False).to_dict()}


PLAN_CASES = [(kind, i) for kind in ("pipelined", "single") for i in range(90)]


@pytest.mark.parametrize("kind, i", PLAN_CASES, ids=[f"{k}-{i}" for k, i in PLAN_CASES])
def test_malformed_plans(capsys, tmp_path, plans, kind, i):
    doc = plans[kind]
    path, value = _cases(doc, 90, seed=1 if kind == "pipelined" else 2)[i]
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(_mutated(doc, path, value)))
    _run(capsys, ["check", str(bad)], bad)


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
