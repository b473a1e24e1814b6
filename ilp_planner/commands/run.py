"""``ilp-planner run PLAN.json [PLAN2.json …] --nproc-per-node N [options]``: train solved
plans with the torch runtime — a thin wrapper that spawns
``python -m torch.distributed.run --standalone --nproc-per-node N -m runtime.launch …``
(gloo on CPU, NCCL on GPU, chosen by the runtime) and returns its exit status.

The plan's device count is checked against ``--nproc-per-node`` here, and each plan is
compiled as every rank will compile it (:class:`runtime.executor.Executor`, no process group),
so an invalid plan ends with one error before any process starts. For several nodes, call
``torchrun`` with your rendezvous options and ``-m runtime.launch`` directly.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from ilp_planner.errors import ConfigError
from ilp_planner.plan.check import check_plan
from ilp_planner.plan.data import Plan
from runtime.executor import Executor, RunOptions
from runtime.launch import add_training_options, forward_options


def torchrun_command(nproc: int, module: str, module_args: list[str]) -> list[str]:
    """The single-node torchrun command line running ``python -m module`` on ``nproc`` ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "-m", module, *module_args]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="train a solved plan with torch.distributed (spawns torchrun)",
        description="Execute solved plans — the planner's lowered collective programs inside "
                    "stages, broadcast resharding between stages, the plan's pipeline schedule; "
                    "print the loss per step (--audit: planned vs executed collectives).",
    )
    p.add_argument("plans", nargs="+", metavar="PLAN.json")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes to start (default: the plan's device count)")
    add_training_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    plans = {path: Plan.load(path) for path in args.plans}
    n = args.nproc_per_node or next(iter(plans.values())).num_devices
    for path, plan in plans.items():
        if plan.num_devices != n:
            raise ConfigError(f"plan {path} is for {plan.num_devices} devices but --nproc-per-node "
                              f"is {n}; start {plan.num_devices} processes or re-solve the plan "
                              f"for {n}")
        # the whole check (the ranks skip the strategy enumeration), then the compile every
        # rank will do (pure: stages, entries, lowered schedule, edge programs): an invalid
        # plan fails here, once, before any rank starts
        checked = check_plan(plan, str(path), args.microbatches)
        Executor(plan, RunOptions(microbatches=args.microbatches), rank=0, world=n, checked=checked)
    return subprocess.call(torchrun_command(n, "runtime.launch",
                                           [*args.plans, *forward_options(args)]))
