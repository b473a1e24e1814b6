"""``ilp-planner explain PLAN``: a readable report of a plan file — stages and devices,
each layer's strategy in SBP and DTensor notation, the collectives with bytes and predicted
seconds, memory per device and the baselines. A YAML configuration is solved first."""

from __future__ import annotations

import argparse
import os
import sys

from ilp_planner.api import solve
from ilp_planner.inter_op.reprice_stages import check_prices
from ilp_planner.plan.check import load_checked
from ilp_planner.reports.explain import explain


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "explain",
        help="print a readable report of a plan",
        description="Explain a plan JSON (or solve a YAML config and explain its plan): "
                    "stages, per-layer SBP / DTensor layouts, collectives, memory, baselines.",
    )
    p.add_argument("plan", metavar="PLAN", help="plan JSON (or a YAML config to solve first)")
    p.add_argument("--no-collectives", action="store_true",
                   help="leave out the per-layer collective lines (totals are kept)")
    p.set_defaults(func=run)


def load_plan_or_solve(path: str):
    """A plan file (checked), or the plan of a YAML configuration (solved with its
    baselines)."""

    if path.endswith((".yaml", ".yml")):

        return solve(path)
    plan = load_checked(path)
    check_prices(plan, path)  # the figures it reports are its layouts' prices
    return plan


def emit(text: str) -> None:
    """Print a report; a reader that stops early (``| head``) is not an error."""
    try:
        print(text)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def run(args: argparse.Namespace) -> int:
    emit(explain(load_plan_or_solve(args.plan), collectives=not args.no_collectives))
    return 0
