"""``ilp-planner check PLAN [PLAN …]``: check plan files without running anything — the
checks every verb and every rank run before reading a plan as a program
(:mod:`ilp_planner.plan.check`), a single-mesh plan's stated figures against its layouts
priced again (:mod:`ilp_planner.intra_op.reprice`) — and say whether the torch runtime can execute each one
here (supported ops, even splits, float32, and with ``--for-host``, the default, whether this
host's memory holds its ranks: ``run`` refuses exactly the plans this says it cannot run)."""

from __future__ import annotations

import argparse

from ilp_planner.commands.run import add_host_memory_option
from ilp_planner.errors import PlanFormatError, PlannerError
from ilp_planner.inter_op.reprice_stages import check_prices
from ilp_planner.plan.check import check_plan
from ilp_planner.plan.data import Plan
from runtime.executor import Executor, RunOptions
from runtime.host_memory import available_host_bytes, check_fits_host


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "check",
        help="check plan files (structure, layouts, strategies, schedule, transfers)",
        description="Check plan files as every verb and the runtime do before using them; exit 2 "
                    "with one error naming the file and the place in it on the first bad plan.",
    )
    p.add_argument("plans", nargs="+", metavar="PLAN.json", help="plan files to check")
    p.add_argument("--for-host", action=argparse.BooleanOptionalAction, default=True,
                   help="also check that this host's memory holds the plan's ranks, as `run` "
                        "does (default: on)")
    add_host_memory_option(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.for_host:  # a malformed limit in the environment is an input error, said once
        available_host_bytes(args.host_memory_gib)
    for path in args.plans:
        plan = Plan.load(path)
        checked = check_plan(plan, str(path))
        check_prices(plan, str(path))  # the figures it states are its layouts' prices
        try:
            Executor(plan, RunOptions(), rank=0, world=plan.num_devices, checked=checked)
            if args.for_host:
                check_fits_host(plan, plan.num_devices, args.host_memory_gib)
            runtime = "the runtime can execute it"
        except PlanFormatError as exc:  # the file contradicts itself: no host runs it
            raise PlanFormatError(f"{path}: {exc}") from None
        except PlannerError as exc:
            runtime = f"valid, but the runtime cannot execute it here: {exc}"
        stages = max(1, len(plan.stages))
        print(f"{path}: ok — {len(plan.layers)} layers, {stages} stage(s), "
              f"{plan.num_devices} devices; {runtime}")
    return 0
