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
from ilp_planner.plan.data import (
    PLAN_SCHEMA,
    PLAN_VERSION,
    PipelineSchedule,
    Plan,
    ReshardingEntry,
    Simulated,
    SolverReport,
    Stage,
    StageDP,
    StageTimes,
    Transfer,
    UnitTask,
)

TINY = Path(__file__).resolve().parent.parent / "configs" / "tiny-gpt-cpu.yaml"


@pytest.fixture(scope="module")
def plan() -> Plan:
    return solve(TINY)


def two_stage(plan: Plan) -> Plan:
    """``plan`` with the pipelined parts a file may carry: stages, a simulated schedule and a
    solved transfer, so saving and loading covers every typed record."""
    half = len(plan.layers) // 2
    names = tuple(x.name for x in plan.layers)
    sent, reader = plan.layers[half - 1], plan.layers[half]
    stage_solver = SolverReport("optimal", 0.05, "grid point torchtitan(dp=4)")
    task = UnitTask(((0, 2), (0, 8)), 0, (0, 1), (4,), 0.0, 64)
    return dataclasses.replace(
        plan,
        layers=[dataclasses.replace(x, stage=int(i >= half)) for i, x in enumerate(plan.layers)],
        stages=[Stage(0, (0, 1, 2, 3), (1, 4), names[:half],
                      StageDP("1x4@n0d0", (0, 1), 0.05, 1e-3, 2**30, 8, 4, stage_solver)),
                Stage(1, (4, 5, 6, 7), (1, 4), names[half:], None,
                      StageTimes(0.01, 0.02, 1e-3, 0.0, plan.cost))],
        schedule=PipelineSchedule("eager-1f1b", 8, (("F0", "B0"), ("F0", "B0")),
                                  Simulated(0.1, 1 / 3, (2, 1), True, 0.09, 0.11)),
        resharding=[ReshardingEntry(0, 1, sent.name, reader.name, sent.output_shape, "float32",
                                    sent.output, reader.inputs[0], (task,), (),
                                    Transfer("S^0", "S^1", "cpsat", "optimal", 2.5e-4, 2e-4,
                                             {"naive": 3e-4, "cpsat": 2.5e-4}, 2.5e-4, 2e-4))],
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
    # the format's name saved plans carry, whatever module reads them (plans written before
    # the package was regrouped load)
    assert PLAN_SCHEMA == "ilp_planner.plan"


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
    with pytest.raises(PlanFormatError, match=r"layers\[0\]\.strategy\.output: missing"):
        Plan.load(path)
    d = plan.to_dict()
    d["layers"][0]["strategy"]["output"]["placements"] = ["Q"]
    path.write_text(json.dumps(d))
    with pytest.raises(PlanFormatError, match=r"output: not a layout .*cannot parse placement 'Q'"):
        Plan.load(path)
    with pytest.raises(PlanFormatError, match="file not found"):
        Plan.load(tmp_path / "missing.json")
    # a top-level field missing, a collective of no known kind: named where they are
    for key in ("layers", "cost", "solver"):
        d = plan.to_dict()
        del d[key]
        path.write_text(json.dumps(d))
        with pytest.raises(PlanFormatError, match=rf"corrupt.json: {key}: missing$"):
            Plan.load(path)
    d = plan.to_dict()
    i, ly = next((i, ly) for i, ly in enumerate(d["layers"]) if ly["collectives"])
    ly["collectives"][0]["kind"] = "all_scatter"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanFormatError, match=rf"layers\[{i}\]\.collectives\[0\]\.kind: "
                                              r"'all_scatter' is not a collective"):
        Plan.load(path)


_DROP = object()


def _set(*path_value):
    """An edit of a plan document: the value at ``path`` set, or dropped (``_DROP``)."""
    *path, value = path_value

    def edit(d: dict) -> None:
        for k in path[:-1]:
            d = d[k]
        if value is _DROP:
            del d[path[-1]]
        else:
            d[path[-1]] = value
    return edit


MALFORMED = {
    "negative-device": (_set("stages", 1, "devices", 0, -1),
                        "stages[1].devices[0]: expected a non-negative integer, got -1"),
    "task-without-sender": (_set("resharding", 0, "tasks", 0, "sender", _DROP),
                            "resharding[0].tasks[0].sender: missing"),
    "negative-makespan": (_set("schedule", "makespan_s", -0.1),
                          "schedule.makespan_s: expected a non-negative number"),
    "nan-gap": (_set("solver", "gap", float("nan")), "solver.gap: expected a finite number"),
    "stage-objective-text": (_set("stages", 0, "solver", "objective", "fast"),
                             "stages[0].solver.objective: expected a finite number"),
    "transfer-time-text": (_set("resharding", 0, "algorithms", "naive", "slow"),
                           "resharding[0].algorithms.naive: expected a finite number"),
    "actions-keyed-by-name": (_set("schedule", "actions", {"first": ["F0"]}),
                              "schedule.actions: expected one list per stage"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_fields_name_their_json_path(plan, case, tmp_path):
    edit, message = MALFORMED[case]
    d = two_stage(plan).to_dict()
    edit(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(PlanFormatError) as err:
        Plan.load(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value)
