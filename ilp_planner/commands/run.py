"""``ilp-planner run PLAN.json [PLAN2.json …] --nproc-per-node N [options]``: train solved
plans with the torch runtime — a thin wrapper that spawns
``python -m torch.distributed.run --standalone --nproc-per-node N -m runtime.launch …``
(gloo on CPU, NCCL on GPU, chosen by the runtime) and returns its exit status.

The plan's device count is checked against ``--nproc-per-node`` here, before any process
starts. For several nodes, call ``torchrun`` with your rendezvous options and
``-m runtime.launch`` directly.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

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
    from ilp_planner.errors import ConfigError
    from ilp_planner.plan import Plan

    counts = {path: Plan.load(path).num_devices for path in args.plans}
    n = args.nproc_per_node or next(iter(counts.values()))
    for path, k in counts.items():
        if k != n:
            raise ConfigError(f"plan {path} is for {k} devices but --nproc-per-node is {n}; "
                              f"start {k} processes or re-solve the plan for {n}")
    return subprocess.call(torchrun_command(n, "runtime.launch",
                                           [*args.plans, *forward_options(args)]))
