"""The command line's own behaviour: its version, and a reader that stops early."""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

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


# run.py and check.py are being rewritten on another branch, which adds their help texts


@pytest.mark.parametrize("verb", cli.VERBS)
def test_every_option_of_every_verb_has_help(verb):
    """``ilp-planner VERB --help`` explains each argument: none is listed bare."""
    sub = next(a for a in cli.build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    bare = [a.option_strings[0] if a.option_strings else a.dest
            for a in sub.choices[verb]._actions
            if not isinstance(a, argparse._HelpAction) and not a.help]
    assert not bare, f"{verb}: no help for {bare}"
