"""YAML configs: shipped files load and validate; malformed ones fail with the file name and
the key path; the memory lower bound against a hand computation."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from ilp_planner import cli
from ilp_planner.errors import ConfigError
from ilp_planner.inputs.config import apply_overrides, load_config, parse_config
from ilp_planner.inputs.config_keys import SECTIONS, reference_markdown
from ilp_planner.ir.cluster import Link
from ilp_planner.lowering.cost_model import MemorySpec
from ilp_planner.reports.summary import memory_lower_bound, model_summary

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
EXPECTED_PARAMS = {  # closed forms, see tests/test_models.py
    "mlp-autoddl-128": 613_416_960,
    "gpt-2.6b-2x4": 2_653_967_360,
    "gpt-6.7b-2x8": 6_662_266_880,
    "gpt-13b-2x8": 12_858_214_400,
    "gpt-13b-a100-2x8": 12_858_214_400,
    "llama-70b-16x8": 64_728_743_936,
    "transformer-autoddl-64": 3_649_486_848,
    "vgg13-2x8": 133_047_848,
    "u-transformer-2x4": 2_123_444_224,
    "tiny-gpt-cpu": 109_312,
    "tiny-gpt-bf16-cpu": 109_312,
    "tiny-moe-cpu": 48_192,  # closed forms in tests/test_moe.py
    "mixtral-8x7b-8x8": 46_702_792_704,  # Mixtral-8x7B's own count
    "deepseek-v2-lite-2x8": 15_787_866_112,  # Llama blocks: tests/test_moe_blocks.py
    # tiny-gpt-cpu with 4 blocks instead of 2: two more blocks of 12h² + 13h (h = 64)
    "tiny-gpt-interleaved-cpu": 109_312 + 2 * (12 * 64 * 64 + 13 * 64),
    "tiny-mlp-cpu": 32 * 64 + 64 + 64 * 64 + 64 + 64 * 16 + 16,
    # stem and head h² + h, two blocks 12h² + 13h, final layernorm 2h (h = 64)
    "tiny-utf-zero-cpu": 2 * (64 * 64 + 64) + 2 * (12 * 64 * 64 + 13 * 64) + 2 * 64,
    "tiny-vgg-cpu": sum(o * i * 9 + o for i, o in [(3, 8), (8, 8), (8, 16), (16, 16), (16, 16),
                                                   (16, 16), (16, 32), (32, 32), (32, 32), (32, 32)])
                    + 32 * 64 + 64 + 64 * 64 + 64 + 64 * 16 + 16,
}

BASE = {
    "name": "base",
    "model": {"kind": "gpt", "hidden": 64, "layers": 2, "heads": 4, "seq_len": 16,
              "vocab": 128, "batch": 8, "dtype": "float32"},
    "cluster": {"nodes": 2, "devices_per_node": 4, "memory_gib": 2, "peak_tflops": 0.05,
                "links": {"intra": {"latency_us": 30, "bandwidth_gbps": 20},
                          "inter": {"alpha": 6e-5, "beta": "8e-10"}}},
    "training": {"optimizer": "adam"},
    "solver": {"time_limit_s": 10, "tie_layers": True},
    "pipeline": {"stages": 2, "microbatches": 4, "schedule": "1f1b"},
}


def test_shipped_configs_are_all_known():
    assert {p.stem for p in CONFIGS} == set(EXPECTED_PARAMS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_config_loads(path):
    cfg = load_config(path)
    assert cfg.name == path.stem
    assert cfg.graph.total_params == EXPECTED_PARAMS[path.stem]
    assert cfg.source == str(path) and cfg.raw["model"] == cfg.model
    assert cfg.cluster.num_devices >= 8
    assert model_summary(cfg).startswith(cfg.name)


def test_validate_exits_zero_on_every_shipped_config(capsys):
    assert cli.main(["validate", *map(str, CONFIGS)]) == 0
    out = capsys.readouterr().out
    for p in CONFIGS:
        assert p.stem in out
    assert "2,653,967,360" in out and "lower bound" in out


def test_validate_exits_two_on_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {kind: gpt}\n")
    assert cli.main(["validate", str(CONFIGS[0]), str(bad)]) == 2
    captured = capsys.readouterr()
    assert "bad.yaml: cluster: missing required key" in captured.err
    assert CONFIGS[0].stem in captured.out  # the good one is still summarised


def test_parse_base_values():
    cfg = parse_config(copy.deepcopy(BASE), "base.yaml")
    assert cfg.cluster.memory_bytes == 2 * 2**30 and cfg.cluster.peak_flops == 0.05e12
    assert cfg.cluster.intra == Link.from_bandwidth(30, 20)
    assert cfg.cluster.inter == Link(6e-5, 8e-10)  # "8e-10" is a YAML string: accepted
    assert cfg.memory == MemorySpec(4, 4, 8)
    assert cfg.solver.time_limit_s == 10 and cfg.pipeline.stages == 2
    assert cfg.pipeline.microbatches == 4


def test_defaults_and_overrides():
    data = copy.deepcopy(BASE)
    for key in ("training", "solver", "pipeline", "name"):
        data.pop(key)
    data["model"]["dtype"] = "float16"
    cfg = parse_config(data)
    assert cfg.memory == MemorySpec.preset("adam_mixed")  # fp16 default
    assert cfg.pipeline.stages == 1 and cfg.cluster.efficiency == 0.5
    assert cfg.name == cfg.graph.name  # no file, no name: the graph's
    more = cfg.with_overrides({"cluster.nodes": 4, "training.bytes_per_param.optimizer": 0})
    assert more.cluster.num_devices == 16 and more.memory.optimizer_bytes == 0
    assert cfg.cluster.nodes == 2  # the original is untouched
    with pytest.raises(ConfigError, match="cluster.nodes"):
        cfg.with_overrides({"cluster.nodes": 0})
    with pytest.raises(ConfigError, match="not a mapping"):
        apply_overrides(BASE, {"name.x": 1})


def test_explicit_graph_config(tmp_path):
    f = tmp_path / "g.yaml"
    data = {k: BASE[k] for k in ("cluster", "training")}
    data["model"] = {"kind": "graph", "ops": [
        {"name": "x", "kind": "input", "shape": [8, 16]},
        {"name": "fc", "kind": "linear", "inputs": ["x"], "shape": [8, 4], "weight": [16, 4]},
        {"name": "loss", "kind": "loss", "inputs": ["fc"], "shape": [1]},
    ]}
    f.write_text(yaml.safe_dump(data))
    cfg = load_config(f)
    assert cfg.name == "g" and cfg.graph.total_params == 64


def test_memory_lower_bound_by_hand():
    cfg = parse_config(copy.deepcopy(BASE))
    g, spec = cfg.graph, cfg.memory
    total = sum(op.params * 16 + op.output.nbytes for op in g.ops)
    bound, dominant = memory_lower_bound(g, cfg.cluster, spec)
    assert bound == pytest.approx(total / 8)
    by_term: dict[str, float] = {}  # a repeated op summed over its blocks, as the solver ties them
    for op in g.ops:
        key = op.tie_key or op.name
        by_term[key] = by_term.get(key, 0.0) + op.params * 16 + op.output.nbytes
    assert dominant.name == max(by_term, key=by_term.get)
    untied = memory_lower_bound(g, cfg.cluster, spec, tie_layers=False)[1]
    assert untied.name == max(g.ops, key=lambda op: op.params * 16 + op.output.nbytes).name
    # twice the devices, half the bound; no optimizer state, a smaller one
    bigger = cfg.with_overrides({"cluster.nodes": 4})
    assert memory_lower_bound(g, bigger.cluster, spec)[0] == pytest.approx(bound / 2)
    assert memory_lower_bound(g, cfg.cluster, MemorySpec(4, 4, 0))[0] < bound


def test_validate_fails_a_config_that_exceeds_its_budget_naming_the_solver_s_term(
        tmp_path, capsys):
    """A config whose memory lower bound exceeds the budget is a failure of ``validate``
    (exit 2), and the dominant term it names is the one ``solve`` blames."""
    data = copy.deepcopy(BASE)
    data["cluster"]["memory_gib"] = 1e-4
    data.pop("pipeline")  # one mesh: the solve whose message names a term
    f = tmp_path / "small.yaml"
    f.write_text(yaml.safe_dump(data))
    assert cli.main(["validate", str(f)]) == 2
    out, err = capsys.readouterr()
    assert "EXCEEDS the budget" in out and err.count("error:") == 1 and str(f) in err
    validate_term = re.search(r"dominant  (\S+)", out).group(1)
    assert cli.main(["solve", str(f), "--no-baselines"]) == 2
    err = capsys.readouterr().err
    assert f"dominant term: {validate_term} " in err, err


def _set(path: str, value):
    return lambda d: apply_overrides(d, {path: value})


def _drop(path: str):
    def f(d):
        d = copy.deepcopy(d)
        *parents, last = path.split(".")
        node = d
        for p in parents:
            node = node[p]
        del node[last]
        return d
    return f


MALFORMED = [
    # (id, transform of BASE, key path in the message, phrase in the message)
    ("unknown-top", _set("colour", "red"), "colour", "unknown key 'colour'; allowed keys"),
    ("unknown-link-key", _set("cluster.links.inter.bandwith_gbps", 10),
     "cluster.links.inter.bandwith_gbps", "allowed keys: latency_us, bandwidth_gbps"),
    ("unknown-model-key", _set("model.dims", [1, 2]), "model.dims", "unknown key"),
    ("wrong-type-int", _set("cluster.nodes", "two"), "cluster.nodes",
     "expected a positive integer, got 'two'"),
    ("float-for-int", _set("model.hidden", 64.0), "model.hidden", "positive integer"),
    ("bool-for-int", _set("model.batch", True), "model.batch", "positive integer"),
    ("wrong-type-bool", _set("solver.tie_layers", "yes please"), "solver.tie_layers",
     "true or false"),
    ("wrong-type-mapping", _set("cluster.links", [1, 2]), "cluster.links", "expected a mapping"),
    ("negative-bandwidth", _set("cluster.links.intra.bandwidth_gbps", -10),
     "cluster.links.intra.bandwidth_gbps", "positive number"),
    ("negative-latency", _set("cluster.links.intra.latency_us", -1),
     "cluster.links.intra.latency_us", "non-negative"),
    ("zero-memory", _set("cluster.memory_gib", 0), "cluster.memory_gib", "positive number"),
    ("efficiency-above-one", _set("cluster.efficiency", 1.5), "cluster.efficiency", "<= 1"),
    ("negative-seed", _set("solver.seed", -1), "solver.seed", "integer"),
    ("huge-seed", _set("solver.seed", 10**30), "solver.seed", "<= 2147483646"),
    ("huge-max-axes", _set("solver.max_axes", 10**30), "solver.max_axes", "<= 16"),
    ("huge-threads", _set("solver.threads", 10**30), "solver.threads", "<= 1024"),
    ("huge-time-limit", _set("solver.time_limit_s", 1e308), "solver.time_limit_s", "<= 1e+07"),
    ("huge-stage-time-limit", _set("pipeline.stage_time_limit_s", 1e308),
     "pipeline.stage_time_limit_s", "<= 1e+07"),
    ("huge-max-units", _set("pipeline.max_units", 10**30), "pipeline.max_units", "<= 2147483647"),
    ("missing-top", _drop("cluster"), "cluster", "missing required key 'cluster'"),
    ("missing-model-key", _drop("model.vocab"), "model.vocab", "missing required key 'vocab'"),
    ("missing-link", _drop("cluster.links.inter"), "cluster.links.inter", "missing"),
    ("half-a-link", _drop("cluster.links.inter.beta"), "cluster.links.inter.beta", "missing"),
    ("mixed-link", _set("cluster.links.inter.latency_us", 3), "cluster.links.inter",
     "not both"),
    ("missing-kind", _drop("model.kind"), "model.kind", "missing required key 'kind'"),
    ("unknown-kind", _set("model.kind", "resnet"), "model.kind", "unknown model kind 'resnet'"),
    ("unknown-dtype", _set("model.dtype", "float8"), "model.dtype", "unknown dtype"),
    ("unknown-optimizer", _set("training.optimizer", "lion"), "training.optimizer",
     "unknown optimizer 'lion'"),
    ("unknown-schedule", _set("pipeline.schedule", "zero-bubble"), "pipeline.schedule",
     "unknown schedule"),
    ("unknown-fallback", _set("solver.fallback", "annealing"), "solver.fallback", "unknown"),
    ("unknown-milp", _set("solver.milp", "gurobi"), "solver.milp", "unknown MILP solver 'gurobi'"),
    ("bad-stages", _set("pipeline.stages", "many"), "pipeline.stages", "'auto'"),
    ("too-many-stages", _set("pipeline.stages", 9), "pipeline.stages", "cluster has 8"),
    ("microbatches-not-dividing", _set("pipeline.microbatches", 3), "pipeline.microbatches",
     "not divisible"),
    ("bad-submesh", _set("pipeline.submeshes", [[1, 4], [1, 3]]), "pipeline.submeshes[1]",
     "not usable"),
    ("submesh-count", _set("pipeline.submeshes", [[1, 4]]), "pipeline.submeshes",
     "1 sub-meshes given for 2 stages"),
    ("bad-submesh-space", _set("pipeline.submesh_space", "pow2"), "pipeline.submesh_space",
     "unknown sub-mesh space"),
    ("bad-max-units", _set("pipeline.max_units", 0), "pipeline.max_units", ""),
    ("bad-stage-time-limit", _set("pipeline.stage_time_limit_s", -1),
     "pipeline.stage_time_limit_s", "positive"),
    ("heads-not-dividing", _set("model.heads", 5), "model.heads", "not divisible"),
    ("odd-u-layers", lambda d: apply_overrides(d, {"model": {
        "kind": "u_transformer", "hidden": 64, "layers": 3, "heads": 4, "seq_len": 8,
        "batch": 8}}), "model.layers", "even"),
    ("graph-bad-input", lambda d: apply_overrides(d, {"model": {"kind": "graph", "ops": [
        {"name": "x", "kind": "input", "shape": [4, 4]},
        {"name": "y", "kind": "relu", "inputs": ["z"], "shape": [4, 4]}]}}),
     "model.ops[1].inputs", "'z' is not an op"),
    ("graph-bad-op-kind", lambda d: apply_overrides(d, {"model": {"kind": "graph", "ops": [
        {"name": "x", "kind": "inptu", "shape": [4, 4]}]}}), "model.ops[0].kind",
     "unknown op kind 'inptu'"),
]


@pytest.mark.parametrize("transform,key,phrase", [m[1:] for m in MALFORMED],
                         ids=[m[0] for m in MALFORMED])
def test_malformed_config(tmp_path, transform, key, phrase):
    f = tmp_path / "broken.yaml"
    f.write_text(yaml.safe_dump(transform(copy.deepcopy(BASE))))
    with pytest.raises(ConfigError) as info:
        load_config(f)
    msg = str(info.value)
    assert msg.startswith(f"{f}: {key}"), msg
    assert phrase in msg, msg
    assert info.value.source == str(f)


@pytest.mark.parametrize("text,phrase", [
    ("model: {kind: gpt\ncluster: 3\n", "invalid YAML: line"),
    ("model:\n  kind: gpt\n\tcluster: 1\n", "invalid YAML"),
    ("model: {kind: gpt}\nmodel: {kind: mlp}\n", "duplicate key 'model'"),
    ("", "empty"),
    ("- just\n- a list\n", "expected a mapping"),
])
def test_bad_yaml_names_the_file(tmp_path, text, phrase):
    f = tmp_path / "syntax.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(f)
    assert str(info.value).startswith(f"{f}: ") and phrase in str(info.value)


def test_missing_file():
    with pytest.raises(ConfigError, match="no-such.yaml: file not found"):
        load_config("no-such.yaml")


# -- the declared keys ---------------------------------------------------------------------------


@pytest.mark.parametrize("section", ["solver", "pipeline", "training", "cluster"])
def test_parser_allows_exactly_the_declared_keys(section):
    """The parser's allowed keys are the declaration's (one table, read by both)."""
    doc = apply_overrides(BASE, {f"{section}.zzz": 1})
    with pytest.raises(ConfigError) as exc:
        parse_config(doc)
    keys = SECTIONS[section]
    declared = [k for k, key in keys.items() if key.required] + \
        [k for k, key in keys.items() if not key.required]
    assert str(exc.value).endswith("allowed keys: " + ", ".join(declared))


def test_declared_defaults_are_the_parsers():
    """An empty section parses to the defaults the reference shows."""
    cfg = parse_config({**BASE, "solver": {}, "pipeline": {}})
    for section, options in (("solver", cfg.solver), ("pipeline", cfg.pipeline)):
        for name, key in SECTIONS[section].items():
            assert getattr(options, name) == key.default, (section, name)


def test_reference_markdown_has_a_row_per_declared_key():
    lines = reference_markdown().splitlines()
    assert lines[0] == "| section | key | type | default | description |"
    rows = [[c.strip() for c in line.strip("|").split(" | ")] for line in lines[2:]]
    assert [(r[0].replace("\\|", "|"), r[1]) for r in rows] == [
        (section, f"`{name}`") for section, keys in SECTIONS.items() for name in keys]
    assert all(len(r) == 5 and all(r) for r in rows)
    assert ["solver", "`milp`", "one of: scip, cbc", "scip"] == rows[
        [r[1] for r in rows].index("`milp`")][:4]
