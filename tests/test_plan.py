"""Plan files: save / load is lossless (single-stage and pipelined, a re-save is
byte-identical), and foreign, older, newer, corrupt or unreadable files are rejected with a
PlanFormatError that says which file and what is wrong."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from ilp_planner.api import solve
from ilp_planner.errors import PlanFormatError
from ilp_planner.plan.data import PLAN_SCHEMA, PLAN_VERSION, Plan

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny-gpt-cpu.yaml"


@pytest.fixture(scope="module")
def plan() -> Plan:
    return solve(TINY)


def two_stage(plan: Plan) -> Plan:
    half = len(plan.layers) // 2
    return dataclasses.replace(
        plan,
        layers=[dataclasses.replace(x, stage=int(i >= half)) for i, x in enumerate(plan.layers)],
        stages=[{"index": 0, "devices": [0, 1, 2, 3], "mesh": [[1, 4]], "layers": 14},
                {"index": 1, "devices": [4, 5, 6, 7], "mesh": [[1, 4]], "layers": 14}],
        schedule={"name": "eager-1f1b", "num_microbatches": 8, "makespan_s": 0.1,
                  "bubble_fraction": 1 / 3},
        resharding=[{"tensor": "h.0.mlp.residual", "bytes": 1e6, "seconds": 2.5e-4}],
    )


@pytest.mark.parametrize("shape", ["single", "pipelined"])
def test_save_load_is_lossless(plan, shape, tmp_path):
    p = plan if shape == "single" else two_stage(plan)
    path = tmp_path / "plan.json"
    p.save(path)
    loaded = Plan.load(path)
    assert loaded == p  # every field, floats exactly (JSON keeps repr precision)
    assert loaded.layers[-1].stage == (0 if shape == "single" else 1)
    again = tmp_path / "again.json"
    loaded.save(again)
    assert again.read_bytes() == path.read_bytes()


def test_file_carries_schema_and_version(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(path)
    d = json.loads(path.read_text())
    assert d["schema"] == PLAN_SCHEMA and d["version"] == PLAN_VERSION
    assert list(d)[:2] == ["schema", "version"]


@pytest.mark.parametrize("version", [0, PLAN_VERSION + 1, "1", None])
def test_other_schema_versions_are_rejected_clearly(plan, version, tmp_path):
    d = plan.to_dict()
    d["version"] = version
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanFormatError) as err:
        Plan.load(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: plan schema version {version!r} is not supported")
    assert f"reads version {PLAN_VERSION}" in msg and "re-solve" in msg


@pytest.mark.parametrize("content, words", [
    (json.dumps({"layers": []}), "not an ilp_planner plan"),
    (json.dumps({"schema": "other.tool", "version": 1}), "not an ilp_planner plan"),
    (json.dumps([1, 2]), "not an ilp_planner plan"),
    ("{not json", "not valid JSON"),
])
def test_foreign_files_are_rejected(content, words, tmp_path):
    path = tmp_path / "x.json"
    path.write_text(content)
    with pytest.raises(PlanFormatError, match=words) as err:
        Plan.load(path)
    assert str(err.value).startswith(str(path))


def test_corrupt_and_missing_files_are_rejected(plan, tmp_path):
    d = plan.to_dict()
    del d["layers"][0]["strategy"]["output"]
    path = tmp_path / "corrupt.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanFormatError, match=r"corrupt plan \(KeyError"):
        Plan.load(path)
    d = plan.to_dict()
    d["layers"][0]["strategy"]["output"]["placements"] = ["Q"]
    path.write_text(json.dumps(d))
    with pytest.raises(PlanFormatError, match="corrupt plan.*cannot parse placement 'Q'"):
        Plan.load(path)
    with pytest.raises(PlanFormatError, match="file not found"):
        Plan.load(tmp_path / "missing.json")
