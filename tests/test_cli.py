"""The command line's own behaviour: its version, and a reader that stops early."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

from ilp_planner import cli

ROOT = Path(__file__).resolve().parent.parent


def test_version_names_the_installed_package(capsys):
    try:
        cli.main(["--version"])
    except SystemExit as stop:
        assert stop.code == 0
    assert capsys.readouterr().out.strip() == f"ilp-planner {version('ilp-planner')}"


def test_a_closed_pipe_ends_quietly():
    """``ilp-planner validate configs/*.yaml | head -1`` ends without a traceback."""
    configs = sorted(str(p) for p in (ROOT / "configs").glob("*.yaml"))
    proc = subprocess.Popen([sys.executable, "-m", "ilp_planner.cli", "validate", *configs],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()  # the reader goes away after one line
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert first
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
