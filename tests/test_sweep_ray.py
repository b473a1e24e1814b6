"""The Ray backend of ``ilp-planner sweep`` on a real local Ray instance (2 CPUs): the same
rows and plans as the local backend, resume after an interrupted Ray sweep, a killed worker
retried, time-outs. The sweep is the shipped inter-bandwidth sweep (its zipped bandwidth /
latency pairs and plots) on a tiny GPT over 2 × 2 devices, so a point solves in about a
second. Skipped only where Ray is not installed; CI installs the ``ray`` extra."""

from __future__ import annotations

import io
import json
import os
import signal
import threading
from pathlib import Path

import pytest
import yaml

from ilp_planner import cli
from ilp_planner.sweeps.results import TIMING_COLUMNS, read_rows
from ilp_planner.sweeps.spec import load_sweep, parse_sweep
from ilp_planner.sweeps.sweep import sweep

ray = pytest.importorskip("ray", reason="ray is not installed; install the extra: "
                                        "pip install -e '.[dev,ray]' (CI does)")

ROOT = Path(__file__).resolve().parent.parent
TINY = {
    "name": "tiny-gpt-2x2",
    "model": {"kind": "gpt", "hidden": 32, "layers": 1, "heads": 2, "seq_len": 8, "vocab": 64,
              "batch": 4},
    "cluster": {"nodes": 2, "devices_per_node": 2, "memory_gib": 1, "peak_tflops": 0.05,
                "links": {"intra": {"latency_us": 30, "bandwidth_gbps": 20},
                          "inter": {"latency_us": 60, "bandwidth_gbps": 10}}},
    "solver": {"time_limit_s": 20},
}


def derived_sweep_doc(**solve) -> dict:
    """configs/sweeps/inter-bandwidth.yaml with the tiny base."""
    doc = yaml.safe_load((ROOT / "configs" / "sweeps" / "inter-bandwidth.yaml").read_text())
    doc["base"] = TINY
    doc["solve"] = {"baselines": True, **solve}
    return doc


def stable(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in TIMING_COLUMNS}


def untimed(doc):
    """A plan document without its solver timings (top level, per stage, statistics)."""
    if isinstance(doc, dict):
        return {k: untimed(v) for k, v in doc.items()
                if k not in ("build_s", "solve_s", "presolve_s", "search_s", "proof_s")}
    if isinstance(doc, list):
        return [untimed(v) for v in doc]
    return doc


@pytest.fixture(scope="module")
def local_rows(tmp_path_factory) -> tuple[Path, list[dict]]:
    """The derived sweep solved by the local backend in this process: the reference."""
    out = tmp_path_factory.mktemp("local")
    res = sweep(parse_sweep(derived_sweep_doc()), out, jobs=1, progress=False, plots=False)
    assert [r["status"] for r in res.rows] == ["optimal"] * 6
    return out, res.rows


def assert_same_as_local(out: Path, local: tuple[Path, list[dict]]) -> None:
    local_out, local_rows = local
    rows = read_rows(out / "results.jsonl")
    assert [stable(r) for r in rows] == [stable(r) for r in local_rows]
    for row in rows:
        got = json.loads((out / row["plan"]).read_text())
        assert untimed(got) == untimed(json.loads((local_out / row["plan"]).read_text()))


def test_cli_ray_backend_starts_ray_and_equals_the_local_backend(tmp_path, local_rows, capsys):
    # runs first in this module: the sweep itself starts (and stops) a 2-CPU local instance
    assert not ray.is_initialized()
    path = tmp_path / "inter-bandwidth.yaml"
    path.write_text(yaml.safe_dump(derived_sweep_doc()))
    out = tmp_path / "ray"
    assert cli.main(["sweep", str(path), "-o", str(out), "--backend", "ray", "-j", "2"]) == 0
    captured = capsys.readouterr()
    assert "6 solved now" in captured.out and "sweep 6/6" in captured.err
    assert not ray.is_initialized()  # the instance it started is gone
    assert_same_as_local(out, local_rows)
    assert {p.name for p in out.glob("*.png")} == {ps.filename for ps in load_sweep(path).plots}
    assert (out / "results.csv").read_text().count("\n") == 7


@pytest.fixture(scope="module")
def ray_instance():
    """One 2-CPU instance for the remaining tests (starting one costs seconds)."""
    ray.init(num_cpus=2)
    yield
    ray.shutdown()


class InterruptAfter(io.StringIO):
    """A progress stream that raises KeyboardInterrupt (as Ctrl-C would) once ``n`` points
    are done: deterministic, unlike a signal sent at some moment."""

    def __init__(self, n: int):
        super().__init__()
        self.marker = f"sweep {n}/"

    def write(self, text: str) -> int:
        if text.startswith(self.marker):
            raise KeyboardInterrupt
        return super().write(text)


def test_resume_after_an_interrupted_ray_sweep_solves_only_the_missing_points(
        tmp_path, local_rows, ray_instance):
    spec = parse_sweep(derived_sweep_doc())
    with pytest.raises(KeyboardInterrupt):
        sweep(spec, tmp_path, backend="ray", stream=InterruptAfter(2), plots=False)
    kept = sorted(read_rows(tmp_path / "results.jsonl"), key=lambda r: r["point"])
    assert len(kept) == 2
    again = sweep(spec, tmp_path, backend="ray", resume=True, progress=False, plots=False)
    assert again.skipped == 2 and again.solved == 4
    assert [r for r in again.rows if r["id"] in {k["id"] for k in kept}] == kept  # not re-solved
    assert_same_as_local(tmp_path, local_rows)


def _busy_ray_workers() -> list[int]:
    """Ray workers started by this process that are running a point (Ray titles a worker
    ``ray::<function>`` while it runs a task, ``ray::IDLE`` otherwise)."""
    parent: dict[int, int] = {}
    busy = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            title = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")[0]
        except OSError:
            continue
        parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
        if title == b"ray::solve_point":
            busy.append(int(entry))

    def ours(pid: int) -> bool:
        while pid in parent and pid != os.getpid():
            pid = parent[pid]
        return pid == os.getpid()

    return [pid for pid in busy if ours(pid)]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds Ray workers through /proc")
def test_a_killed_ray_worker_is_retried_and_every_point_is_recorded_once(
        tmp_path, local_rows, ray_instance):
    killed: list[int] = []
    done = threading.Event()

    def kill_one_busy_worker() -> None:
        while not done.is_set() and not killed:
            for pid in _busy_ray_workers():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                break
            done.wait(0.01)

    killer = threading.Thread(target=kill_one_busy_worker)
    killer.start()
    stream = io.StringIO()
    try:
        res = sweep(parse_sweep(derived_sweep_doc()), tmp_path, backend="ray", stream=stream,
                    plots=False)
    finally:
        done.set()
        killer.join()
    assert len(killed) == 1, "no Ray worker was seen running a point"
    notes = [line for line in stream.getvalue().splitlines() if "worker lost" in line]
    assert len(notes) == 1 and "WorkerCrashedError" in notes[0] and "retrying (1/2)" in notes[0]
    assert not res.failed
    lines = (tmp_path / "results.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["point"] for line in lines) == list(range(6))
    assert_same_as_local(tmp_path, local_rows)


def test_a_point_past_its_time_limit_is_a_time_out_on_ray(tmp_path, ray_instance):
    spec = parse_sweep(derived_sweep_doc(timeout_s=1e-6))
    res = sweep(spec, tmp_path, backend="ray", progress=False, plots=False)
    assert [r["status"] for r in res.rows] == ["timeout"] * 6
    assert all("timed out after 1e-06 s" in r["error"] for r in res.rows)


def test_an_already_connected_process_keeps_its_connection(tmp_path, ray_instance):
    from ilp_planner.errors import BackendError

    spec = parse_sweep(derived_sweep_doc())
    with pytest.raises(BackendError, match="already connected"):
        sweep(spec, tmp_path, backend="ray", jobs=2, progress=False)
    assert ray.is_initialized()
