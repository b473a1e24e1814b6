"""``ilp-planner`` command line: one verb per module in :mod:`ilp_planner.commands`."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from importlib.metadata import PackageNotFoundError, version

from ilp_planner.errors import PlannerError

MAX_ERROR_CHARS = 4000

# Verb modules, in the order ``--help`` lists them.
VERBS = [
    "validate",
    "solve",
    "simulate",
    "calibrate",
    "reshard",
    "sweep",
    "explain",
    "diff",
    "check",
    "run",
]


def build_parser(verbs: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser over ``verbs`` (every verb by default). Each verb module is imported to
    register its arguments, so naming the one verb a command line asks for keeps the others'
    imports out: ``ilp-planner solve`` does not load torch for ``run``'s executor."""
    parser = argparse.ArgumentParser(
        prog="ilp-planner",
        description="Auto-parallel planner: SBP ILP, pipeline stage DP, cross-mesh resharding.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb in verbs or VERBS:
        importlib.import_module(f"ilp_planner.commands.{verb}").register(sub)
    return parser


def _version() -> str:
    try:
        return version("ilp-planner")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "(not installed)"


def _asked_verb(argv: list[str]) -> list[str] | None:
    """``[verb]`` when the command line's first word is a verb, else ``None`` (every verb:
    ``--help``, ``--version`` and mistakes get the whole parser and its messages)."""
    return [argv[0]] if argv and argv[0] in VERBS else None


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()  # before the verbs (and their solvers) are imported
    args = build_parser(_asked_verb(sys.argv[1:] if argv is None else argv)).parse_args(argv)
    args.started = started  # a verb that reports its wall time counts the imports too
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # the reader went away (``… | head``): stop quietly, as a Unix filter does; stdout is
        # pointed at /dev/null so the interpreter's final flush cannot raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except PlannerError as exc:
        text = str(exc)
        if len(text) > MAX_ERROR_CHARS:  # never echo a huge input back
            text = text[:MAX_ERROR_CHARS] + f" … ({len(text) - MAX_ERROR_CHARS} more characters)"
        print(f"error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
