"""``ilp-planner diff A B``: what differs between two plans (configuration keys, cost per
step, stages, per-layer strategies, collectives, baselines) and what it costs. YAML
configurations are solved first."""

from __future__ import annotations

import argparse

from ilp_planner.commands.explain import emit, load_plan_or_solve
from ilp_planner.reports.diff import diff


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "diff",
        help="compare two plans and what their differences cost",
        description="Compare plan A with plan B (JSON plans, or YAML configs solved first): "
                    "config keys, cost breakdown with changes and ratios, stages, layers whose "
                    "strategy changed, collective totals and baselines.",
    )
    p.add_argument("a", metavar="A", help="first plan JSON (or YAML config)")
    p.add_argument("b", metavar="B", help="second plan JSON (or YAML config)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    emit(diff(load_plan_or_solve(args.a), load_plan_or_solve(args.b)))
    return 0
