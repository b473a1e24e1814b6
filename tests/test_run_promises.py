"""`check` and `run` keep their promises: a plan this host cannot hold is refused by both
before any rank starts; a rank that raises, or stops, ends the run with one ``error:`` line
naming it and its log; a clean run prints nothing on stderr; a YAML configuration runs as
its solved plan. The multi-process cases use two ranks of the tiny MLP (one launch each) and
one launch of the tiny GPT."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from ilp_planner import cli
from ilp_planner.commands import run as run_verb
from ilp_planner.inputs.config import load_config
from ilp_planner.intra_op.baselines import data_parallel_filter
from ilp_planner.ir.cluster import MeshAxis
from ilp_planner.plan.data import Plan
from ilp_planner.testing import pipelined_plan, restricted_plan
from runtime import failures, host_memory
from runtime.errors import RuntimeSetupError
from runtime.failures import COMMUNICATION, EXCEPTION, STUCK, Failure, explain_failure
from runtime.host_memory import HOST_MEMORY_ENV, peak_bytes_per_rank
from tests.helpers.procs import run

ROOT = Path(__file__).resolve().parent.parent
TINY_MLP = ROOT / "configs" / "tiny-mlp-cpu.yaml"


@pytest.fixture(scope="module")
def dp2(tmp_path_factory) -> Path:
    """Data parallel over two ranks of the tiny MLP."""
    c = load_config(TINY_MLP).with_overrides({"cluster.nodes": 1, "cluster.devices_per_node": 2})
    path = tmp_path_factory.mktemp("plans") / "dp2.json"
    restricted_plan(c, data_parallel_filter(MeshAxis(1, 2))).save(path)
    return path


def _no_launch(monkeypatch) -> None:
    def launch(*_args, **_kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(run_verb, "launch_ranks", launch)


# -- host memory -------------------------------------------------------------------------------


def test_run_refuses_a_plan_the_host_cannot_hold_before_any_rank(monkeypatch, capsys, dp2):
    _no_launch(monkeypatch)
    assert cli.main(["run", str(dp2), "--host-memory-gib", "0.0001"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: plan tiny-mlp-cpu needs ")
    assert "on this host (2 ranks" in err and "but 0.1 MiB is available" in err


def test_the_host_limit_may_come_from_the_environment(monkeypatch, capsys, dp2):
    _no_launch(monkeypatch)
    monkeypatch.setenv(HOST_MEMORY_ENV, "0.0001")
    assert cli.main(["run", str(dp2)]) == 2
    assert "but 0.1 MiB is available" in capsys.readouterr().err


@pytest.mark.parametrize("option", [
    ["--steps", "0"], ["--steps", "-2"], ["--microbatches", "0"], ["--timeout", "-5"],
    ["--rtol", "0"], ["--rtol", "nan"], ["--heartbeat-s", "-1"], ["--nproc-per-node", "0"],
    ["--host-memory-gib", "-1"], ["--host-memory-gib", "nan"]])
def test_run_refuses_a_count_or_limit_out_of_range_before_any_rank(monkeypatch, capsys, dp2,
                                                                    option):
    _no_launch(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", str(dp2), *option])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option[0]}: expected a " in err and repr(option[1]) in err


@pytest.mark.parametrize("option,says", [
    (["--optimizer", "adamw"], "unknown optimizer 'adamw'"),
    (["--lr", "-1"], "learning rate must be positive"),
    (["--lr", "abc"], "--lr: could not convert"),
    (["--optimizer", "sgd,adam"], "--optimizer lists 2 values for 1 plans")])
def test_run_refuses_the_per_plan_lists_before_any_rank(monkeypatch, capsys, dp2, option, says):
    _no_launch(monkeypatch)
    assert cli.main(["run", str(dp2), *option]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err


def test_a_host_limit_in_the_environment_must_be_a_positive_number(monkeypatch, capsys, dp2):
    for text in ("abc", "-1"):
        monkeypatch.setenv(HOST_MEMORY_ENV, text)
        assert cli.main(["check", str(dp2)]) == 2
        assert f"${HOST_MEMORY_ENV}: expected a positive number of GiB, got {text!r}" in \
            capsys.readouterr().err


def test_check_says_what_run_will_do_about_host_memory(capsys, dp2):
    assert cli.main(["check", str(dp2), "--host-memory-gib", "0.0001"]) == 0
    out = capsys.readouterr().out
    assert "the runtime cannot execute it here: plan tiny-mlp-cpu needs" in out
    assert cli.main(["check", str(dp2), "--host-memory-gib", "0.0001", "--no-for-host"]) == 0
    assert "the runtime can execute it" in capsys.readouterr().out
    assert cli.main(["check", str(dp2), "--host-memory-gib", "64"]) == 0
    assert "the runtime can execute it" in capsys.readouterr().out


def test_on_gpu_each_rank_is_held_against_its_own_device(monkeypatch, dp2):
    """No GPU here: the device figures are stubbed, as ``nvidia-smi`` would give them."""
    monkeypatch.setattr(host_memory.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(host_memory, "free_gpu_bytes", lambda: [1e12, 1e3])
    with pytest.raises(RuntimeSetupError, match=r"rank 1 needs .* but its GPU has 0\.0 MiB free"):
        host_memory.check_fits_host(Plan.load(dp2), 2)
    monkeypatch.setattr(host_memory, "free_gpu_bytes", lambda: [1e12, 1e12])
    host_memory.check_fits_host(Plan.load(dp2), 2)


def test_a_pipelined_plan_counts_each_stage_s_own_peak():
    c = load_config(TINY_MLP).with_overrides({"cluster.nodes": 1, "cluster.devices_per_node": 4})
    plan = pipelined_plan(c, stages=2, schedule="1f1b", microbatches=4)
    peaks = peak_bytes_per_rank(plan)
    for stage in plan.stages:
        assert {peaks[d] for d in stage.devices} == {stage.times.cost.peak_memory_bytes}


# -- YAML --------------------------------------------------------------------------------------


def test_run_solves_a_yaml_config_first(monkeypatch, tmp_path):
    launched = {}

    def launch(nproc, module, args, folder):
        launched.update(nproc=nproc, module=module, args=args, folder=folder)
        return 0

    monkeypatch.setattr(run_verb, "launch_ranks", launch)
    assert cli.main(["run", str(TINY_MLP), "--log-dir", str(tmp_path), "--steps", "1"]) == 0
    plan_file = tmp_path / "tiny-mlp-cpu.json"
    assert launched["args"][0] == str(plan_file) and launched["nproc"] == 8
    assert Plan.load(plan_file).name == "tiny-mlp-cpu"


# -- which failure the line names --------------------------------------------------------------


def _write(folder: Path, *accounts: Failure) -> None:
    for f in accounts:
        (folder / f"rank{f.reporter}.failure.json").write_text(json.dumps(f.__dict__))


def test_a_rank_s_own_exception_explains_its_peers_communication_errors(tmp_path):
    _write(tmp_path, Failure(0, 0, COMMUNICATION, "DistBackendError: Connection closed", 1.0),
           Failure(1, 1, EXCEPTION, "RuntimeError: out of memory", 2.0))
    line = explain_failure(tmp_path, {0: 1, 1: 1})
    assert line.startswith("rank 1 failed: RuntimeError: out of memory")
    assert str(tmp_path / "rank1.log") in line


def test_a_rank_that_ended_without_an_exception_is_named_not_the_ranks_torchrun_stopped(tmp_path):
    _write(tmp_path, Failure(0, 0, COMMUNICATION, "DistBackendError: Connection closed", 1.0))
    assert explain_failure(tmp_path, {0: -15, 1: -9, 2: -15}).startswith(
        "rank 1 was killed by SIGKILL (the kernel's out-of-memory killer")
    assert explain_failure(tmp_path, {1: 13}).startswith("rank 1 exited with status 13")


def test_a_stuck_rank_is_named_by_its_watcher(tmp_path):
    _write(tmp_path, Failure(1, 0, STUCK, "no heartbeat for 3.1 s", 1.0))
    line = explain_failure(tmp_path, {0: 4, 1: -9})
    assert line.startswith("rank 1 stopped responding (no heartbeat for 3.1 s); noticed by rank 0")


def test_a_failed_check_is_left_to_the_ranks_own_report(tmp_path):
    assert explain_failure(tmp_path, {0: 1, 1: -15}) is None


# -- real ranks --------------------------------------------------------------------------------


def _cli_run(plan: Path, *extra: str, timeout: float = 180):
    """``ilp-planner run`` in a process of its own, and how long it took."""
    t0 = time.monotonic()
    res = run([sys.executable, "-m", "ilp_planner.cli", "run", str(plan), *extra], timeout)
    return res, time.monotonic() - t0


@pytest.mark.slow
def test_a_rank_that_raises_ends_the_run_with_one_line(monkeypatch, dp2, tmp_path):
    monkeypatch.setenv(failures.FAIL_RANK_ENV, "1")
    res, _ = _cli_run(dp2, "--steps", "3", "--log-dir", str(tmp_path))
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith(
        f"error: rank 1 failed: RuntimeError: injected failure ({failures.FAIL_RANK_ENV}=1); "
        f"its traceback: {tmp_path / 'rank1.log'}")
    assert "Traceback" in (tmp_path / "rank1.log").read_text()


@pytest.mark.slow
def test_a_stopped_rank_is_named_within_a_few_heartbeats(monkeypatch, dp2, tmp_path):
    monkeypatch.setenv(failures.STOP_RANK_ENV, "1")
    res, seconds = _cli_run(dp2, "--steps", "3", "--heartbeat-s", "1", "--log-dir", str(tmp_path))
    assert res.returncode == 2
    assert res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("error: rank 1 stopped responding (no heartbeat for ")
    assert seconds < 45  # the collective time-out (60 s) never came into it


@pytest.mark.slow
def test_running_the_tiny_gpt_config_prints_nothing_on_stderr(tmp_path):
    res, _ = _cli_run(ROOT / "configs" / "tiny-gpt-cpu.yaml", "--steps", "2",
                      "--log-dir", str(tmp_path), timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    assert "plan tiny-gpt-cpu" in res.stdout and "step 1: loss" in res.stdout
    for log in tmp_path.glob("rank*.log"):  # not even in the ranks' own logs
        assert "Warning" not in log.read_text(), log
