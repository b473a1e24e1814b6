"""Why a run failed, in one line: each rank writes its own account of a failure into the
run folder, and the launching side picks the one that explains the others.

A rank's tracebacks go to ``rank{N}.log`` in the run folder (:data:`RUN_DIR_ENV`, set by
``ilp-planner run``); an exception leaving a rank, or a peer that stopped responding
(:mod:`runtime.heartbeat`), adds ``rank{N}.failure.json``: the rank it blames, the cause and
when. When one rank fails the others usually fail next, in a collective whose peer went
away; those secondary accounts are kept apart so the line names the first cause.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist

RUN_DIR_ENV = "ILP_PLANNER_RUN_DIR"
# Test hook: the rank named here raises an exception at its first training step, as a rank
# that runs out of memory would (runtime.launch reads it).
FAIL_RANK_ENV = "ILP_PLANNER_FAIL_RANK"
# Test hook: the rank named here stops itself (SIGSTOP) at its first training step, as a hung
# rank would (runtime.launch reads it; runtime.heartbeat notices).
STOP_RANK_ENV = "ILP_PLANNER_STOP_RANK"

EXCEPTION, STUCK, COMMUNICATION = "exception", "stuck", "communication"
CHECK_FAILED_STATUS = 1  # runtime.launch's exit status when an audit or reference check failed


@dataclass(frozen=True)
class Failure:
    """One rank's account: ``rank`` is the rank it blames (itself, or a stuck peer),
    ``reporter`` the rank that wrote it, ``kind`` one of :data:`EXCEPTION`, :data:`STUCK`,
    :data:`COMMUNICATION`."""

    rank: int
    reporter: int
    kind: str
    cause: str
    time: float


def run_dir() -> Path | None:
    """The run folder this rank reports into, if its launcher gave one."""
    value = os.environ.get(RUN_DIR_ENV)
    return Path(value) if value else None


def log_path(folder: Path, rank: int) -> Path:
    return folder / f"rank{rank}.log"


def redirect_stderr_to_log(rank: int) -> None:
    """Send this rank's stderr (tracebacks, warnings, faulthandler) to its log file, so the
    console keeps one line per failure; a no-op without a run folder."""
    folder = run_dir()
    if folder is None:
        return
    fd = os.open(log_path(folder, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stderr.flush()
    os.dup2(fd, sys.stderr.fileno())
    os.close(fd)


def report(failure: Failure) -> None:
    """Write ``failure`` into the run folder (nothing without one); the first account a
    rank writes is kept."""
    folder = run_dir()
    if folder is None:
        return
    path = folder / f"rank{failure.reporter}.failure.json"
    if not path.exists():
        path.write_text(json.dumps(asdict(failure)))


def report_exception(rank: int, exc: BaseException) -> None:
    """This rank's exception, marked secondary where it only says a peer went away."""
    kind = COMMUNICATION if _is_communication_error(exc) else EXCEPTION
    cause = f"{type(exc).__name__}: {_first_line(str(exc))}"
    report(Failure(rank, rank, kind, cause, time.time()))


def _is_communication_error(exc: BaseException) -> bool:
    """A collective that failed because its peer died or timed out (gloo, NCCL, the store)."""
    text = str(exc)
    return isinstance(exc, dist.DistError) or any(
        s in text for s in ("gloo", "Connection closed", "Connection reset", "NCCL", "timed out"))


def _first_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[0].strip() if lines else "(no message)"


def clear_failures(folder: Path) -> None:
    """Forget the accounts of an earlier run in the same folder (``--log-dir`` reused)."""
    for path in folder.glob("rank*.failure.json"):
        path.unlink()


def read_failures(folder: Path) -> list[Failure]:
    """Every account written into ``folder``, earliest first."""
    found = [Failure(**json.loads(p.read_text())) for p in folder.glob("rank*.failure.json")]
    return sorted(found, key=lambda f: f.time)


def explain_failure(folder: Path, exits: dict[int, int]) -> str | None:
    """The one line for a failed run, from the written accounts and the exit status of each
    rank the launcher saw fail (negative: killed by that signal). The cause, first to last
    resort: a rank's own exception; a rank that ended without one (a signal, the OOM killer,
    ``os._exit``); a stuck rank; a collective whose peer went away. None when the only
    failure is a check the ranks report themselves (exit :data:`CHECK_FAILED_STATUS`)."""
    accounts = read_failures(folder)
    own = [f for f in accounts if f.kind == EXCEPTION]
    if own:
        return _line(own[0], folder)
    abrupt = _abrupt_exits(accounts, exits)
    if abrupt:
        rank, status = abrupt[0]
        return f"rank {rank} {_exit_words(status)}; its log: {log_path(folder, rank)}"
    stuck = [f for f in accounts if f.kind == STUCK]
    if stuck or accounts:
        return _line((stuck or accounts)[0], folder)
    checks_only = all(s in (CHECK_FAILED_STATUS, -signal.SIGTERM) for s in exits.values())
    return None if exits and checks_only else f"the run failed; logs in {folder}"


def _abrupt_exits(accounts: list[Failure], exits: dict[int, int]) -> list[tuple[int, int]]:
    """Ranks that ended without an account of their own, leaving out those torchrun stopped
    (SIGTERM) after the first failure, those a check failed on, and stuck ranks (their
    watcher killed them)."""
    accounted = {f.reporter for f in accounts} | {f.rank for f in accounts if f.kind == STUCK}
    ignored = (CHECK_FAILED_STATUS, -signal.SIGTERM)
    return [(r, s) for r, s in sorted(exits.items()) if s not in ignored and r not in accounted]


def _line(f: Failure, folder: Path) -> str:
    if f.kind == STUCK:
        return (f"rank {f.rank} stopped responding ({f.cause}); noticed by rank {f.reporter}, "
                f"logs in {folder}")
    return f"rank {f.rank} failed: {f.cause}; its traceback: {log_path(folder, f.rank)}"


def _exit_words(status: int) -> str:
    if status == -signal.SIGKILL:
        return "was killed by SIGKILL (the kernel's out-of-memory killer sends it)"
    if status < 0:
        return f"was killed by {signal.Signals(-status).name}"
    return f"exited with status {status} without an exception"
