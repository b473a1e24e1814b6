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


def test_a_solve_loads_only_its_own_verb(tmp_path):
    """``ilp-planner solve`` on a built-in model never imports torch (only ``run``'s executor
    and the importer need it): the command line registers just the verb it was given."""
    code = ("import sys; from ilp_planner.cli import main; "
            f"rc = main(['solve', 'configs/tiny-mlp-cpu.yaml', '-o', {str(tmp_path / 'p.json')!r}]); "
            "print('TORCH', 'torch' in sys.modules, rc)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=300).stdout
    assert "TORCH False 0" in out, out


def test_a_verb_not_known_gets_the_whole_parser(capsys):
    """A mistyped verb is answered with every verb's name, as before."""
    with pytest.raises(SystemExit):
        cli.main(["solv", "x.yaml"])
    assert "invalid choice: 'solv'" in capsys.readouterr().err


@pytest.mark.parametrize("verb", cli.VERBS)
def test_every_option_of_every_verb_has_help(verb):
    """``ilp-planner VERB --help`` explains each argument: none is listed bare."""
    sub = next(a for a in cli.build_parser()._actions
               if isinstance(a, argparse._SubParsersAction))
    bare = [a.option_strings[0] if a.option_strings else a.dest
            for a in sub.choices[verb]._actions
            if not isinstance(a, argparse._HelpAction) and not a.help]
    assert not bare, f"{verb}: no help for {bare}"
