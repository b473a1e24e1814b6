"""``ilp-planner`` command line: one verb per module in :mod:`ilp_planner.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys

from ilp_planner.errors import PlannerError

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
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
