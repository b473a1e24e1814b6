"""Sweeps: grid expansion (product and zip), sweep-file validation naming the bad key,
failing points recorded while the sweep goes on, resume, worker processes equal to a
serial run, result files, plots, the progress line and backend options (the Ray backend
itself runs in test_sweep_ray.py)."""

from __future__ import annotations

import copy
import csv
import io
import json
import sys
from pathlib import Path

import pytest
import yaml

from ilp_planner import cli
from ilp_planner.errors import BackendError, ConfigError
from ilp_planner.plan.data import Plan
from ilp_planner.sweeps.backends import RayBackend
from ilp_planner.sweeps.points import Point, PointTask
from ilp_planner.sweeps.progress import Progress, format_progress
from ilp_planner.sweeps.results import TIMING_COLUMNS, read_rows
from ilp_planner.sweeps.spec import PlotSpec, load_sweep, parse_sweep
from ilp_planner.sweeps.sweep import default_output, sweep

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted((ROOT / "configs" / "sweeps").glob("*.yaml"))

BASE = {
    "name": "t",
    "model": {"kind": "gpt", "hidden": 32, "layers": 1, "heads": 2, "seq_len": 8, "vocab": 64,
              "batch": 4},
    "cluster": {"nodes": 1, "devices_per_node": 2, "memory_gib": 1, "peak_tflops": 0.05,
                "links": {"intra": {"latency_us": 30, "bandwidth_gbps": 20},
                          "inter": {"latency_us": 60, "bandwidth_gbps": 10}}},
    "solver": {"time_limit_s": 20},
}


def spec_of(grid=None, zip_=None, **extra):
    doc = {"base": copy.deepcopy(BASE), **extra}
    if grid is not None:
        doc["grid"] = grid
    if zip_ is not None:
        doc["zip"] = zip_
    return parse_sweep(doc, None)


def stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in TIMING_COLUMNS}


def plan_stable(path: Path) -> dict:
    d = json.loads(path.read_text())
    for k in ("build_s", "solve_s"):
        d["solver"].pop(k)
    for k in ("build_s", "presolve_s", "search_s", "proof_s"):  # solver statistics' timings
        d["solver"]["stats"].pop(k)
    return d


# -- grid expansion ----------------------------------------------------------------------------


def test_grid_is_a_cartesian_product_with_the_last_key_fastest():
    spec = spec_of(grid={"model.layers": [1, 2], "cluster.nodes": [1, 2, 4]})
    points = spec.points()
    assert [p.overrides for p in points] == [
        {"model.layers": a, "cluster.nodes": b} for a in (1, 2) for b in (1, 2, 4)]
    assert [p.index for p in points] == list(range(6))
    assert spec.keys == ("model.layers", "cluster.nodes")


def test_zip_advances_together_and_multiplies_the_grid():
    spec = spec_of(grid={"model.layers": [1, 2]},
                   zip_={"cluster.links.inter.bandwidth_gbps": [10, 25, 100],
                         "cluster.links.inter.latency_us": [20, 10, 5]})
    got = [p.overrides for p in spec.points()]
    assert len(got) == 6
    assert got[:3] == [
        {"model.layers": 1, "cluster.links.inter.bandwidth_gbps": bw,
         "cluster.links.inter.latency_us": lat} for bw, lat in ((10, 20), (25, 10), (100, 5))]
    assert {p["model.layers"] for p in got[3:]} == {2}


def test_zip_alone_and_no_axes():
    assert len(spec_of(zip_={"cluster.nodes": [1, 2]}).points()) == 2
    only = spec_of().points()
    assert len(only) == 1 and only[0].overrides == {} and only[0].label == "base"


def test_point_identity_ignores_position_and_files_are_distinct():
    a, b = Point(0, {"x.y": 1, "z": [1, 2]}), Point(7, {"z": [1, 2], "x.y": 1})
    assert a.id == b.id
    assert Point(0, {"a.n": "p q"}).filename != Point(0, {"a.n": "p_q"}).filename


# -- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["model.layerz", "cluster.linkz.inter.bandwidth_gbps",
                                 "solver.time_limit", "cluster.nodes.count", "pipline.stages"])
def test_unknown_override_key_is_rejected_naming_it(key):
    with pytest.raises(ConfigError) as err:
        spec_of(grid={"model.layers": [1], key: [3]})
    assert err.value.key == f"grid.{key}"
    assert repr(key) in str(err.value)


def test_unknown_zip_key_is_named_under_zip(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"base": BASE, "zip": {"cluster.bandwith_gbps": [1, 2]}}))
    with pytest.raises(ConfigError) as err:
        load_sweep(path)
    assert str(err.value).startswith(f"{path}: zip.cluster.bandwith_gbps: ")


def test_key_valid_only_under_another_swept_value_is_accepted():
    # model.dims exists for kind mlp only: checked with the first point's other overrides
    spec = spec_of(grid={"model.kind": ["mlp"], "model.dims": [[16, 16]]})
    assert len(spec.points()) == 1


@pytest.mark.parametrize("doc, key, words", [
    ({"grid": {"model.layers": []}}, "grid.model.layers", "at least 1"),
    ({"grid": {"model.layers": 3}}, "grid.model.layers", "expected a list"),
    ({"grid": {"model layers": [1]}}, "grid.model layers", "dotted configuration key"),
    ({"zip": {"model.layers": [1, 2], "cluster.nodes": [1]}}, "zip", "equal lengths"),
    ({"grid": {"model.layers": [1]}, "zip": {"model.layers": [2]}}, "zip.model.layers", "both"),
    ({"solve": {"timeout_s": 0}}, "solve.timeout_s", "positive"),
    ({"solve": {"baseline": True}}, "solve.baseline", "unknown key"),
    ({"solve": {"memory_gib": 0}}, "solve.memory_gib", "positive"),
    ({"solve": {"timeout_s": 1e308}}, "solve.timeout_s", "<= 1e+07"),
    ({"solve": {"memory_gib": 1e308}}, "solve.memory_gib", "<= 1e+09"),
    ({"plot": {"metric": "speed", "x": "model.layers"}, "grid": {"model.layers": [1]}},
     "plot.metric", "unknown metric"),
    ({"plot": {"x": "cluster.nodes"}, "grid": {"model.layers": [1]}}, "plot.x", "not a swept key"),
    ({"grids": {}}, "grids", "unknown key"),
    ({"base": 3}, "base", "configuration"),
])
def test_malformed_sweep_files(doc, key, words):
    full = {"base": copy.deepcopy(BASE), **doc}
    with pytest.raises(ConfigError) as err:
        parse_sweep(full, "s.yaml")
    assert err.value.key == key and words in str(err.value)


def test_base_path_is_relative_to_the_sweep_file(tmp_path):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "b.yaml").write_text(yaml.safe_dump(BASE))
    (tmp_path / "sw").mkdir()
    path = tmp_path / "sw" / "s.yaml"
    path.write_text("base: ../cfg/b.yaml\ngrid:\n  model.layers: [1, 2]\n")
    spec = load_sweep(path)
    assert spec.name == "s" and spec.base["model"]["hidden"] == 32
    assert spec.base_source == str(tmp_path / "sw" / "../cfg/b.yaml")
    bad = tmp_path / "sw" / "bad.yaml"
    bad.write_text("base: ../cfg/missing.yaml\n")
    with pytest.raises(ConfigError, match="missing.yaml: file not found"):
        load_sweep(bad)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.stem)
def test_shipped_sweeps_load(path):
    spec = load_sweep(path)
    assert 4 <= len(spec.points()) <= 16 and spec.plots
    for ps in spec.plots:
        assert ps.x in spec.keys


def test_shipped_sweeps_exist():
    assert {p.stem for p in SHIPPED} >= {"gpt-size-x-devices", "inter-bandwidth"}


# -- running -----------------------------------------------------------------------------------


def test_failing_points_are_recorded_and_the_sweep_goes_on(tmp_path):
    spec = spec_of(grid={"model.layers": [1, 0], "cluster.memory_gib": [1, 1e-9]},
                   solve={"baselines": False})
    res = sweep(spec, tmp_path, jobs=1, progress=False)
    by = {(r["overrides"]["model.layers"], r["overrides"]["cluster.memory_gib"]): r for r in res.rows}
    assert by[(1, 1)]["status"] == "optimal" and by[(1, 1)]["error"] is None
    assert by[(1, 1e-9)]["status"] == "infeasible" and "budget" in by[(1, 1e-9)]["error"]
    for mem in (1, 1e-9):
        bad = by[(0, mem)]
        assert bad["status"] == "config_error"
        assert bad["error"].startswith("bad override: model.layers: expected a positive integer")
        assert "plan" not in bad and bad.get("step_s") is None
    assert len(res.failed) == 3 and res.solved == 4
    # every row reached the files, the failures with their errors
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert [r["status"] for r in rows] == ["optimal", "infeasible", "config_error", "config_error"]
    assert rows[2]["error"].startswith("bad override: model.layers") and rows[2]["step_s"] == ""
    assert len(read_rows(tmp_path / "results.jsonl")) == 4


def test_a_point_past_its_time_limit_fails_alone(tmp_path):
    spec = spec_of(grid={"model.layers": [1, 2]}, solve={"baselines": False, "timeout_s": 1e-6})
    res = sweep(spec, tmp_path, jobs=1, progress=False)
    assert [r["status"] for r in res.rows] == ["timeout", "timeout"]
    assert "timed out after 1e-06 s" in res.rows[0]["error"]
    # the alarm is disarmed afterwards: the next sweep in this process is unaffected
    ok = sweep(spec_of(grid={"model.layers": [1]}, solve={"baselines": False}), tmp_path / "b",
               jobs=1, progress=False)
    assert ok.rows[0]["status"] == "optimal"


def test_resume_skips_points_already_in_the_results(tmp_path):
    first = sweep(spec_of(grid={"cluster.nodes": [1, 2]}, solve={"baselines": False}), tmp_path,
                  jobs=1, progress=False)
    assert first.solved == 2 and first.skipped == 0
    grown = spec_of(grid={"cluster.nodes": [1, 2, 4]}, solve={"baselines": False})
    again = sweep(grown, tmp_path, jobs=1, resume=True, progress=False)
    assert again.solved == 1 and again.skipped == 2
    # kept rows are the earlier rows themselves (timings included: nothing was re-solved)
    assert again.rows[:2] == first.rows
    assert [r["overrides"]["cluster.nodes"] for r in again.rows] == [1, 2, 4]
    assert len(read_rows(tmp_path / "results.jsonl")) == 3
    # a changed base invalidates the earlier rows; no --resume re-solves everything
    base = copy.deepcopy(BASE)
    base["solver"]["seed"] = 1
    changed = parse_sweep({"base": base, "grid": {"cluster.nodes": [1, 2, 4]},
                           "solve": {"baselines": False}})
    assert sweep(changed, tmp_path, jobs=1, resume=True, progress=False).solved == 3
    assert sweep(grown, tmp_path, jobs=1, progress=False).solved == 3


def test_resume_keeps_failures_unless_asked_and_resolves_lost_plans(tmp_path):
    spec = spec_of(grid={"model.layers": [1, 0]}, solve={"baselines": False})
    first = sweep(spec, tmp_path, jobs=1, progress=False)
    assert sweep(spec, tmp_path, jobs=1, resume=True, progress=False).solved == 0
    assert sweep(spec, tmp_path, jobs=1, resume=True, retry_failed=True, progress=False).solved == 1
    (tmp_path / first.rows[0]["plan"]).unlink()
    assert sweep(spec, tmp_path, jobs=1, resume=True, progress=False).solved == 1


def test_resume_survives_a_torn_last_line(tmp_path):
    spec = spec_of(grid={"cluster.nodes": [1, 2]}, solve={"baselines": False})
    sweep(spec, tmp_path, jobs=1, progress=False)
    jsonl = tmp_path / "results.jsonl"
    lines = jsonl.read_text().splitlines()
    jsonl.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # killed mid-write
    again = sweep(spec, tmp_path, jobs=1, resume=True, progress=False)
    assert again.solved == 1 and again.skipped == 1


def test_worker_processes_give_the_serial_results(tmp_path):
    spec = spec_of(grid={"model.layers": [1, 2], "cluster.nodes": [1, 2]}, solve={"baselines": True})
    serial = sweep(spec, tmp_path / "serial", jobs=1, progress=False)
    pooled = sweep(spec, tmp_path / "pool", jobs=2, progress=False)
    assert [stable(r) for r in pooled.rows] == [stable(r) for r in serial.rows]
    assert all(r["status"] == "optimal" for r in serial.rows)
    # on two devices Megatron has no two-axis mesh: its ratio is empty, its reason kept
    assert [r["ratio_megatron"] is None for r in serial.rows] == [True, False, True, False]
    assert "two-axis mesh" in serial.rows[0]["baselines"]["megatron"]
    for r in serial.rows:
        assert plan_stable(tmp_path / "serial" / r["plan"]) == plan_stable(tmp_path / "pool" / r["plan"])


def test_result_files_plots_and_plans(tmp_path):
    spec = spec_of(grid={"model.layers": [1, 2], "cluster.nodes": [1, 2]}, solve={"baselines": True},
                   plot=[{"metric": "step_s", "x": "cluster.nodes", "series": "model.layers"},
                         {"metric": "ratio_megatron", "x": "model.layers"}])
    res = sweep(spec, tmp_path, jobs=1, progress=False)
    header = next(csv.reader((tmp_path / "results.csv").open()))
    assert header[:3] == ["point", "model.layers", "cluster.nodes"]
    for col in ("status", "error", "gap", "solve_s", "step_s", "compute_s", "grad_sync_s",
                "stages", "layout", "ratio_data_parallel", "ratio_megatron", "ratio_summa", "plan"):
        assert col in header
    row = res.rows[3]
    assert row["stages"] == 1 and row["devices"] == 4 and row["layout"]
    plan = res.load_plan(row)
    assert plan.cost.total_s == pytest.approx(row["step_s"])
    assert plan.config["model"]["layers"] == 2 and plan.config["cluster"]["nodes"] == 2
    assert plan.name == "t[model.layers=2, cluster.nodes=2]"
    ratio = min(b for n, b in row["baselines"].items() if n.startswith("megatron"))
    assert row["ratio_megatron"] == pytest.approx(ratio) and ratio >= 1 - 1e-9
    assert len(res.plots) == 2
    for p in res.plots:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "results.md").read_text().splitlines()
    assert md[0].startswith("| # | layers | nodes | status") and len(md) == 2 + 4
    assert "layers" in res.table().splitlines()[0]


def test_plots_can_be_chosen_or_turned_off(tmp_path):
    spec = spec_of(grid={"cluster.nodes": [1, 2]}, solve={"baselines": False},
                   plot={"metric": "step_s", "x": "cluster.nodes"})
    assert sweep(spec, tmp_path / "a", jobs=1, progress=False, plots=False).plots == []
    got = sweep(spec, tmp_path / "b", jobs=1, progress=False,
                plots=[PlotSpec("comm_s", "cluster.nodes", logx=False)]).plots
    assert [p.name for p in got] == ["comm_s_vs_cluster.nodes.png"]


def test_python_api_exposes_sweep():
    import ilp_planner.sweeps.sweep

    assert ilp_planner.sweep is sweep and callable(ilp_planner.sweep)
    assert ilp_planner.load_sweep is load_sweep


# -- backends ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, words", [
    ({"backend": "dask"}, "unknown sweep backend 'dask'; expected one of: local, ray"),
    ({"address": "auto"}, "'auto' is for the ray backend"),
    ({"backend": "ray", "address": "auto", "jobs": 2}, "pass one or the other"),
    ({"jobs": 0}, "jobs (-j): expected a positive integer, got 0"),
])
def test_backend_options_are_checked_before_anything_runs(tmp_path, kwargs, words):
    with pytest.raises(ConfigError) as err:
        sweep(spec_of(), tmp_path / "out", progress=False, **kwargs)
    assert words in str(err.value) and not (tmp_path / "out").exists()


def test_the_ray_backend_without_ray_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    with pytest.raises(BackendError, match=r"pip install 'ilp-planner\[ray\]'"):
        sweep(spec_of(), tmp_path, backend="ray", progress=False)


def test_points_a_local_ray_instance_cannot_hold_fail_alone():
    def task(i, cpus, mem):
        return PointTask(i, {"solver.threads": cpus}, BASE, None, "t", False, None,
                         f"plans/{i}.json", "f", cpus, mem)

    recorded = []
    fits = RayBackend._fail_oversized([task(0, 1, 1.0), task(1, 4, None), task(2, 1, 64.0)],
                                      {"CPU": 2.0, "memory": 8 * 2**30}, recorded.append)
    assert [t.index for t in fits] == [0]
    assert [o.row["point"] for o in recorded] == [1, 2]
    assert "needs 4 CPUs (solver.threads) but the local Ray instance has 2; raise -j" in \
        recorded[0].row["error"]
    assert "needs 64 GiB (solve.memory_gib)" in recorded[1].row["error"]


# -- progress ----------------------------------------------------------------------------------


def test_format_progress():
    line = format_progress(3, 12, 1, 65, 130, width=12)
    assert line == "sweep  3/12 [###---------]  25%  1 failed  elapsed 1:05  ETA 2:10"
    assert format_progress(0, 4, 0, 0, None, width=4).endswith("ETA ?")
    assert "1:00:01" in format_progress(4, 4, 0, 3601, 0)


def test_progress_writes_one_line_per_point_off_a_terminal():
    buf = io.StringIO()
    bar = Progress(3, done=1, failed=1, stream=buf)
    bar.update(failed=False)
    bar.update(failed=True)
    bar.close()
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("sweep 1/3") and "1 failed" in lines[0]
    assert lines[-1].startswith("sweep 3/3") and "2 failed" in lines[-1] and "100%" in lines[-1]


def test_progress_redraws_in_place_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    buf = Tty()
    bar = Progress(2, stream=buf)
    bar.update(failed=False)
    bar.update(failed=False)
    bar.close()
    assert buf.getvalue().count("\r") == 3 and buf.getvalue().endswith("\n")
    assert "\n" not in buf.getvalue()[:-1]


def test_progress_notes_go_between_progress_lines():
    buf = io.StringIO()
    bar = Progress(2, stream=buf)
    bar.note("point 1 (x=2): worker lost; retrying (1/2)")
    assert buf.getvalue().splitlines()[-1] == "point 1 (x=2): worker lost; retrying (1/2)"

    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty = Tty()
    bar = Progress(2, stream=tty)
    bar.note("lost")
    # the note overwrites the bar on its own line, then the bar is drawn again below it
    before, redrawn = tty.getvalue().split("\n")
    note_line = before.rsplit("\r", 1)[1]
    assert note_line.startswith("lost ") and len(note_line) == len(bar.line())
    assert redrawn == "\r" + bar.line()


# -- command line ------------------------------------------------------------------------------


def test_cli_sweep_prints_the_table_and_resumes(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"base": BASE, "grid": {"cluster.nodes": [1, 2]},
                                    "solve": {"baselines": False}}))
    out = tmp_path / "out"
    assert cli.main(["sweep", str(path), "-o", str(out), "-j", "1", "--plot",
                     "step_s:cluster.nodes"]) == 0
    captured = capsys.readouterr()
    assert "nodes" in captured.out and "2 solved now" in captured.out
    assert "sweep 2/2" in captured.err
    assert (out / "step_s_vs_cluster.nodes.png").is_file()
    assert cli.main(["sweep", str(path), "-o", str(out), "-q", "--resume"]) == 0
    captured = capsys.readouterr()
    assert "0 solved now, 2 kept" in captured.out and "sweep 2/2" not in captured.err
    plans = sorted((out / "plans").glob("*.json"))
    assert len(plans) == 2 and Plan.load(plans[0]).layers


def test_cli_sweep_whose_every_point_is_a_config_error_exits_two(tmp_path, capsys):
    """Every point failing with a configuration error is an error of the sweep: its rows are
    written, and the exit status says it produced nothing."""
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"base": BASE, "grid": {"model.layers": [0, -1]},
                                    "solve": {"baselines": False}}))
    out = tmp_path / "out"
    assert cli.main(["sweep", str(path), "-o", str(out), "-q", "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "all 2 point(s) failed with configuration errors" in err
    assert len(read_rows(out / "results.jsonl")) == 2
    path.write_text(yaml.safe_dump({"base": BASE, "grid": {"model.layers": [0, 1]},
                                    "solve": {"baselines": False}}))
    assert cli.main(["sweep", str(path), "-o", str(out), "-q", "--no-plots"]) == 0


@pytest.mark.parametrize("name", ["..", ".", "/", "../.."])
def test_a_sweep_name_never_places_results_outside_sweep_results(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    spec = spec_of(name=name)
    assert default_output(spec).resolve().parent == (tmp_path / "sweep-results").resolve()


def test_cli_sweep_reports_a_bad_key_and_exits_two(tmp_path, capsys):
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump({"base": BASE, "grid": {"model.layerz": [1]}}))
    assert cli.main(["sweep", str(path), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert f"{path}: grid.model.layerz: 'model.layerz' is not a configuration key" in err
    assert cli.main(["sweep", str(path).replace("s.yaml", "none.yaml")]) == 2
    path.write_text(yaml.safe_dump({"base": BASE, "grid": {"model.layers": [1]}}))
    assert cli.main(["sweep", str(path), "--plot", "step_s:cluster.nodes"]) == 2
    assert "not a swept key" in capsys.readouterr().err
    assert cli.main(["sweep", str(path), "--address", "auto"]) == 2
    assert "is for the ray backend; pass backend='ray' (--backend ray)" in capsys.readouterr().err


@pytest.mark.parametrize("edit", [
    lambda row: row.update(step_s="abc"),
    lambda row: row.update(step_s=float("nan")),
    lambda row: row.update(plan="../../../../etc/passwd"),
    lambda row: row.update(plan=None),
])
def test_resume_re_solves_rows_it_cannot_trust(tmp_path, edit):
    spec = spec_of(grid={"cluster.nodes": [1, 2]}, solve={"baselines": False})
    sweep(spec, tmp_path, jobs=1, progress=False)
    jsonl = tmp_path / "results.jsonl"
    rows = [json.loads(x) for x in jsonl.read_text().splitlines()]
    edit(rows[0])
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    again = sweep(spec, tmp_path, jobs=1, resume=True, progress=False)
    assert again.solved == 1 and again.skipped == 1
    assert all(isinstance(r["step_s"], float) for r in again.rows)


def _children(pid: int) -> set[int]:
    """Processes whose parent is ``pid`` (Linux /proc)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for a reaper."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


DRIVER = """
import sys
from tests.test_sweep import spec_of
from ilp_planner.sweeps.sweep import sweep
spec = spec_of(grid={"model.layers": list(range(1, 9)), "cluster.nodes": [1, 2]})
sweep(spec, sys.argv[1], jobs=2, progress=False)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_and_resource_tracker_die_with_a_killed_driver(tmp_path):
    """SIGKILL to a sweep's driver (no cleanup runs) takes its pool workers and
    multiprocessing's resource tracker with it within seconds."""
    import os
    import signal
    import subprocess
    import time

    driver = subprocess.Popen([sys.executable, "-c", DRIVER, str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while len(children := _children(driver.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)  # two workers and the resource tracker
        assert len(children) >= 3, f"the sweep started {len(children)} processes"
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 10
        while any(map(_alive, children)) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = [pid for pid in children if _alive(pid)]
        for pid in left:  # do not leave them to the next test
            os.kill(pid, signal.SIGKILL)
        assert left == []
    finally:
        driver.kill()
