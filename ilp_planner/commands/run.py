"""``ilp-planner run PLAN [PLAN2 …] --nproc-per-node N [options]``: train solved plans with
the torch runtime — torchrun's agent started in this process
(:func:`runtime.supervise.launch_ranks`, ``--standalone``, ``-m runtime.launch …``; gloo on
CPU, NCCL on GPU, chosen by the runtime). A YAML configuration is solved first.

Before any process starts, each plan is checked, its device count compared with
``--nproc-per-node``, its memory with this host's (:mod:`runtime.host_memory`), and it is
compiled as every rank will compile it (:class:`runtime.executor.Executor`, no process
group): a plan that cannot run ends with one error line. Once running, the ranks write their
stderr to ``rank{N}.log`` in the run folder (``--log-dir``; a temporary one, removed after a
clean run, by default) and a failed or stuck rank ends the run with one ``error:`` line naming
it and its log. For several nodes, call ``torchrun`` with your rendezvous options and
``-m runtime.launch`` directly.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from ilp_planner.api import solve
from ilp_planner.errors import ConfigError, PlanFormatError
from ilp_planner.inter_op.reprice_stages import check_prices
from ilp_planner.plan.check import check_plan
from ilp_planner.plan.data import Plan
from runtime.errors import RunFailedError
from runtime.executor import Executor, RunOptions
from runtime.host_memory import HOST_MEMORY_ENV, check_fits_host
from runtime.launch import add_training_options, check_training_options, forward_options, positive
from runtime.supervise import launch_ranks


def torchrun_command(nproc: int, module: str, module_args: list[str]) -> list[str]:
    """The single-node torchrun command line running ``python -m module`` on ``nproc`` ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "-m", module, *module_args]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="train a solved plan with torch.distributed (torchrun's agent)",
        description="Execute solved plans — the planner's lowered collective programs inside "
                    "stages, broadcast resharding between stages, the plan's pipeline schedule; "
                    "print the loss per step (--audit: planned vs executed collectives).",
    )
    p.add_argument("plans", nargs="+", metavar="PLAN",
                   help="plan JSON (or a YAML config to solve first)")
    p.add_argument("--nproc-per-node", type=positive(int), default=None,
                   help="processes to start (default: the plan's device count)")
    add_host_memory_option(p)
    p.add_argument("--log-dir", metavar="DIR", default=None,
                   help="run folder for the ranks' logs (rank{N}.log), failure accounts and "
                        "solved configs (default: a temporary folder, removed after a clean run)")
    add_training_options(p)
    p.set_defaults(func=run)


def add_host_memory_option(p: argparse.ArgumentParser) -> None:
    """``--host-memory-gib``, shared with ``check``."""
    p.add_argument("--host-memory-gib", type=positive(float), default=None,
                   help="memory the ranks on this host may use, in GiB (default: "
                        f"${HOST_MEMORY_ENV}, else MemAvailable of /proc/meminfo; on GPU each "
                        "device's free memory)")


def run(args: argparse.Namespace) -> int:
    folder = Path(args.log_dir or tempfile.mkdtemp(prefix="ilp-planner-run-"))
    folder.mkdir(parents=True, exist_ok=True)
    keep = args.log_dir is not None
    try:
        rc = check_and_launch(args, folder)
        keep |= rc != 0
        return rc
    except RunFailedError:
        keep = True  # its line names the logs in the folder
        raise
    finally:
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)


def check_and_launch(args: argparse.Namespace, folder: Path) -> int:
    """Solve the configurations, check every plan, then start the ranks."""
    check_training_options(args, len(args.plans))
    files = [plan_file(path, folder) for path in args.plans]
    n = args.nproc_per_node or Plan.load(files[0]).num_devices
    for path in files:
        check_runnable(Plan.load(path), str(path), n, args)
    return launch_ranks(n, "runtime.launch", [*map(str, files), *forward_options(args)], folder)


def plan_file(path: str, folder: Path) -> Path:
    """The plan file the ranks read: ``path`` itself, or a YAML configuration's plan solved
    (without baselines) and saved into the run folder."""
    if not path.endswith((".yaml", ".yml")):
        return Path(path)
    out = folder / f"{Path(path).stem}.json"
    solve(path, baselines=False).save(out)
    return out


def check_runnable(plan: Plan, path: str, n: int, args: argparse.Namespace) -> None:
    """Every check a rank would fail, here and once: device count, the plan's own check (and
    its stated figures against its layouts' prices, which the audit expects), this host's
    memory, and the compile each rank does (stages, entries, lowered schedule, edge
    programs; the ranks skip the strategy enumeration)."""
    if plan.num_devices != n:
        raise ConfigError(f"plan {path} is for {plan.num_devices} devices but --nproc-per-node "
                          f"is {n}; start {plan.num_devices} processes or re-solve the plan "
                          f"for {n}")
    checked = check_plan(plan, path, args.microbatches)
    check_prices(plan, path)  # what --audit expects and the host check reads
    check_fits_host(plan, n, args.host_memory_gib)
    try:
        Executor(plan, RunOptions(microbatches=args.microbatches), rank=0, world=n,
                 checked=checked)
    except PlanFormatError as exc:  # a listing contradicting its layers: name the file
        raise PlanFormatError(f"{path}: {exc}") from None
