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


def torchrun_command(nproc: int, module: str, module_args: list[str]) -> list[str]:
    """The single-node torchrun command line running ``python -m module`` on ``nproc`` ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "-m", module, *module_args]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="train a solved plan with torch.distributed (spawns torchrun)",
        description="Execute solved plans with DTensor inside stages, broadcast resharding "
                    "between stages and the plan's pipeline schedule; print the loss per step.",
    )
    p.add_argument("plans", nargs="+", metavar="PLAN.json")
    p.add_argument("--nproc-per-node", type=int, default=None,
                   help="processes to start (default: the plan's device count)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--optimizer", default="adam", help="sgd or adam (comma list: one per plan)")
    p.add_argument("--lr", default="1e-2", help="learning rate (comma list: one per plan)")
    p.add_argument("--microbatches", type=int, help="gradient accumulation of single-stage plans")
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    p.add_argument("--timings", metavar="CSV", help="per-collective timings (calibration format)")
    p.add_argument("--results", metavar="JSON", help="per-plan losses, step and comm times")
    p.add_argument("--save-params", metavar="DIR", help="save the final parameters here")
    p.add_argument("--check-reference", action="store_true",
                   help="compare losses and parameters with a single-process run")
    p.add_argument("--rtol", type=float, default=1e-4)
    p.add_argument("--grad-buckets", choices=("stage", "op", "none"), default="stage",
                   help="gradient AllReduce per stage-wide bucket, per op, or per tensor")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=run)


def launch_args(args: argparse.Namespace) -> list[str]:
    out = [*args.plans, "--steps", str(args.steps), "--seed", str(args.seed),
           "--optimizer", args.optimizer, "--lr", str(args.lr), "--timeout", str(args.timeout),
           "--rtol", str(args.rtol)]
    for flag, value in (("--microbatches", args.microbatches), ("--timings", args.timings),
                        ("--results", args.results), ("--save-params", args.save_params)):
        if value is not None:
            out += [flag, str(value)]
    if args.check_reference:
        out.append("--check-reference")
    if args.quiet:
        out.append("--quiet")
    out += ["--grad-buckets", args.grad_buckets]
    return out


def run(args: argparse.Namespace) -> int:
    from ilp_planner.errors import ConfigError
    from ilp_planner.plan import Plan

    counts = {path: Plan.load(path).num_devices for path in args.plans}
    n = args.nproc_per_node or next(iter(counts.values()))
    for path, k in counts.items():
        if k != n:
            raise ConfigError(f"plan {path} is for {k} devices but --nproc-per-node is {n}; "
                              f"start {k} processes or re-solve the plan for {n}")
    return subprocess.call(torchrun_command(n, "runtime.launch", launch_args(args)))
