"""Running multi-process test commands (torchrun, the CLI) without leaving strays."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run a command in its own session from the repository root, this checkout first on
    the path (a script's own folder comes first otherwise, and an installed copy of the
    project would answer its imports); on timeout kill the whole group (no strays) and fail
    the test with the output so far."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=path)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:6])}… hung for {timeout} s\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
