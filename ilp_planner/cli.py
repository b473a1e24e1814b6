"""``ilp-planner`` command line: one verb per module in :mod:`ilp_planner.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ilp-planner",
        description="Auto-parallel planner: SBP ILP, pipeline stage DP, cross-mesh resharding.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb in VERBS:
        importlib.import_module(f"ilp_planner.commands.{verb}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except PlannerError as exc:
        text = str(exc)
        if len(text) > MAX_ERROR_CHARS:  # never echo a huge input back
            text = text[:MAX_ERROR_CHARS] + f" … ({len(text) - MAX_ERROR_CHARS} more characters)"
        print(f"error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
