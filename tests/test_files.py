"""Inputs read and outputs written with errors a user can act on (the I/O part):
every case ends in one ``error:`` line naming the file, exit 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from ilp_planner import cli
from ilp_planner.commands import solve as solve_verb
from ilp_planner.errors import ConfigError, PlanFormatError
from ilp_planner.inputs.files import read_input

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
TINY = CONFIGS / "tiny-mlp-cpu.yaml"


def _fails(capsys, argv: list[str], *needles: str) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err
    for n in needles:
        assert n in err, err
    return err


def test_special_files_and_oversized_inputs_are_refused(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="not a regular file"):
        read_input("/dev/zero")
    big = tmp_path / "big.yaml"
    big.write_text("x" * 100)
    monkeypatch.setenv("ILP_PLANNER_MAX_INPUT_BYTES", "10")
    with pytest.raises(PlanFormatError, match="ILP_PLANNER_MAX_INPUT_BYTES"):
        read_input(big, PlanFormatError)


@pytest.mark.parametrize("content, needle", [
    (b"model: {kind: mlp}\n\xff\xfe", "not UTF-8"),
    (b"[" * 20000, "YAML"),
    (b"", "empty"),
])
def test_bad_config_bytes_are_config_errors(capsys, tmp_path, content, needle):
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(content)
    _fails(capsys, ["validate", str(bad)], str(bad), needle)


def test_plan_nested_too_deeply_is_a_format_error(capsys, tmp_path):
    bad = tmp_path / "deep.json"
    bad.write_text("[" * 100000 + "]" * 100000)
    _fails(capsys, ["explain", str(bad)], str(bad))


def test_outputs_create_their_folders_or_say_why_not(capsys, tmp_path):
    out = tmp_path / "missing" / "dir" / "plan.json"
    assert cli.main(["solve", str(TINY), "-o", str(out)]) == 0
    assert out.is_file()
    capsys.readouterr()
    _fails(capsys, ["solve", str(TINY), "-o", str(tmp_path)], "is a folder")
    blocker = tmp_path / "file"
    blocker.write_text("")
    _fails(capsys, ["solve", str(TINY), "-o", str(blocker / "plan.json")], "a file of that name")
    sweep = CONFIGS / "sweeps" / "inter-bandwidth.yaml"
    _fails(capsys, ["sweep", str(sweep), "-o", str(blocker)], "is a file")


def test_validate_on_a_sweep_file_says_it_is_one(capsys):
    sweep = CONFIGS / "sweeps" / "inter-bandwidth.yaml"
    _fails(capsys, ["validate", str(sweep)], "this is a sweep file", "ilp-planner sweep")


@pytest.mark.parametrize("key, value", [("cluster.memory_gib", 1e308),
                                        ("cluster.links.inter.bandwidth_gbps", 1e308),
                                        ("cluster.peak_tflops", 1e300)])
def test_absurd_cluster_figures_name_their_key(capsys, tmp_path, key, value):
    import yaml

    data = yaml.safe_load(TINY.read_text())
    node = data
    *parents, last = key.split(".")
    for k in parents:
        node = node[k]
    node[last] = value
    bad = tmp_path / "absurd.yaml"
    bad.write_text(yaml.safe_dump(data))
    _fails(capsys, ["validate", str(bad)], key, "<= 1e+09")


def test_a_yaml_alias_bomb_gets_a_short_error(capsys, tmp_path):
    """Nine levels of nine aliases: a 1 KB file whose value has 9^9 leaves. The error echoes
    a bounded excerpt (PyYAML shares aliased nodes, so reading it is cheap)."""
    levels = ["&a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    levels += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text(f"model:\n  kind: mlp\n  dims: [4, 4]\n  batch: [{', '.join(levels)}]\n"
                    + TINY.read_text().split("cluster:", 1)[1].join(["cluster:", ""]))
    err = _fails(capsys, ["validate", str(bomb)], "model.batch")
    assert len(err) < 1000


@pytest.mark.parametrize("key, value, limit", [
    ("model.dims", [4] * 5000, "ILP_PLANNER_MAX_LAYERS"),
    ("cluster.nodes", 10**9, "ILP_PLANNER_MAX_DEVICES"),
    ("model.batch", 2**40, "ILP_PLANNER_MAX_DIM"),
])
def test_problem_size_is_bounded_before_anything_is_built(capsys, tmp_path, key, value, limit):
    import yaml

    data = yaml.safe_load(TINY.read_text())
    section, name = key.split(".")
    data[section][name] = value
    bad = tmp_path / "huge.yaml"
    bad.write_text(yaml.safe_dump(data))
    _fails(capsys, ["validate", str(bad)], key, limit)


def test_sweep_points_are_bounded_and_the_bound_can_be_raised(capsys, tmp_path):
    import yaml

    sweep = tmp_path / "big.yaml"
    sweep.write_text(yaml.safe_dump({"base": str(TINY), "grid": {
        "solver.seed": list(range(200)), "cluster.links.inter.latency_us": list(range(1, 101))}}))
    _fails(capsys, ["sweep", str(sweep), "-o", str(tmp_path / "out")], "20000", "above the limit")
    _fails(capsys, ["sweep", str(sweep), "--max-points", "10", "-o", str(tmp_path / "o")],
           "--max-points")


def test_validate_estimates_the_solve_size(capsys, tmp_path):
    import yaml

    assert cli.main(["validate", str(TINY)]) == 0
    assert "within reach" in capsys.readouterr().out
    data = yaml.safe_load((CONFIGS / "gpt-6.7b-2x8.yaml").read_text())
    data["cluster"]["nodes"] = 64
    data["solver"] = {**(data.get("solver") or {}), "tie_layers": False}
    big = tmp_path / "big.yaml"
    big.write_text(yaml.safe_dump(data))
    assert cli.main(["validate", str(big)]) == 0
    assert "likely minutes or more" in capsys.readouterr().out


def test_simulate_bounds_its_micro_batch_override(capsys, tmp_path):
    from ilp_planner.inputs.config import load_config
    from ilp_planner.testing import pipelined_plan

    plan = tmp_path / "pp.json"
    pipelined_plan(load_config(TINY), stages=2, schedule="1f1b", microbatches=2).save(plan)
    _fails(capsys, ["simulate", str(plan), "--microbatches", str(10**9)], "ILP_PLANNER_MAX_MICROBATCHES")
    _fails(capsys, ["simulate", str(plan), "--microbatches", "-3"], "positive integer")
    # a chart format no backend writes: refused before the work, not by matplotlib after it
    _fails(capsys, ["simulate", str(plan), "--plot", str(tmp_path / "out.txt")],
           "out.txt: expected a file ending in one of", ".png")


def test_validate_refuses_more_stages_than_layer_units_as_solve_does(capsys, tmp_path):
    import yaml

    doc = yaml.safe_load((CONFIGS / "tiny-gpt-cpu.yaml").read_text())
    doc["pipeline"] = {"stages": 3, "microbatches": 4}
    bad = tmp_path / "pp3.yaml"
    bad.write_text(yaml.safe_dump(doc))
    for verb in ("validate", "solve"):
        _fails(capsys, [verb, str(bad)], f"{bad}: pipeline.stages: 3 stages requested but the "
                                         f"model has only 2 layer units")


def test_solve_refuses_a_folder_for_its_plan_before_solving(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(solve_verb, "solve", lambda *a, **k: pytest.fail("solved first"))
    _fails(capsys, ["solve", str(TINY), "-o", str(tmp_path)], str(tmp_path), "is a folder")


RESHARD = ["reshard", "--shape", "64,64", "--src-mesh", "1x2", "--src-spec", "S0R",
           "--dst-mesh", "1x2", "--dst-spec", "RS0", "--no-compare"]


def test_reshard_dump_model_is_written_or_refused(capsys, tmp_path):
    """``--dump-model`` creates its folders and writes the model, says so, and is refused
    (before solving) where it cannot be written or no CP-SAT model is built."""
    model = tmp_path / "out" / "m2" / "model.txt"
    assert cli.main([*RESHARD, "--dump-model", str(model)]) == 0
    assert model.is_file() and model.stat().st_size > 0
    assert f"wrote {model}" in capsys.readouterr().out
    _fails(capsys, [*RESHARD, "--dump-model", str(tmp_path)], "is a folder")
    _fails(capsys, [*RESHARD, "--algo", "naive", "--dump-model", str(model)],
           "does not run cpsat")
