"""``python -m runtime.measure_dispatch PLAN --output dispatch.csv``: the runtime's host time
a kernel (``ComputeFit.dispatch_s``) on this machine — the first GPU when there is one, else
the CPU — as one ``dispatch`` row of ``calibrate``'s kernel format
(:mod:`ilp_planner.inputs.compute_calibration`); ``calibrate --measure`` runs it with a small
GPT's one-device plan (:func:`ilp_planner.commands.calibrate.dispatch_plan`).

The plan's training step runs on one process (:class:`runtime.executor.Executor`, a gloo
group of one); its kernels are counted at dispatch (:func:`count_dispatched`: every aten op
below autograd but views and allocations) and the fastest of a few steps is timed. The plan
is chosen so that its kernels take microseconds: the step's time is then the host's issuing
them — Python, the executor, the dispatcher, autograd — which the device waits for, and
``seconds / kernels`` is what each kernel costs the host.

``count_dispatched`` is also how the tests compare the kernels a plan prices with those the
executor issues.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from ilp_planner.inputs.compute_calibration import KernelTiming, write_kernel_csv
from ilp_planner.plan.data import Plan
from runtime.executor import Executor, RunOptions

# what no kernel runs for: allocations, a view the schema does not mark as one (after a
# reshape's copy), and reading a scalar back (the loss's report)
_NO_KERNEL = frozenset({"empty", "empty_strided", "empty_like", "new_empty", "_unsafe_view",
                        "new_empty_strided", "lift_fresh", "_local_scalar_dense"})


class _Count(TorchDispatchMode):
    """Counts the aten ops that launch a kernel (views and :data:`_NO_KERNEL` aside)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.__name__.split(".")[0] not in _NO_KERNEL:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def count_dispatched(step: Callable[[], object]) -> int:
    """Kernels ``step()`` issues, counted at dispatch."""
    with _Count() as mode:
        step()
    return mode.ops


def measure_dispatch(plan: Plan, device: torch.device | None = None,
                     repeats: int = 5) -> KernelTiming:
    """``plan``'s (one device) training step: its kernels counted, the fastest of
    ``repeats`` steps timed (waiting for the device), as a ``dispatch`` row."""
    device = device or (torch.device("cuda", 0) if torch.cuda.is_available()
                        else torch.device("cpu"))
    ex = Executor(plan, RunOptions(record=False), rank=0, world=1, device=device)
    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ex.setup()
        for step in range(2):  # warm-up: allocations, kernel selection
            ex.train_step(step)
        kernels = count_dispatched(lambda: ex.train_step(2))
        secs = min(_timed(lambda: ex.train_step(3), device) for _ in range(repeats))
    finally:
        if own_group:
            dist.destroy_process_group()
    return KernelTiming("dispatch", kernels, 0, 0, 0.0, secs)


def _timed(step: Callable[[], object], device: torch.device) -> float:
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m runtime.measure_dispatch")
    p.add_argument("plan", help="a one-device plan JSON whose kernels take microseconds")
    p.add_argument("--output", required=True, metavar="CSV")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (default 1, as torchrun's ranks run)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    row = measure_dispatch(Plan.load(args.plan), repeats=args.repeats)
    write_kernel_csv([row], args.output)
    print(f"{row.m} kernels a step, {row.seconds / row.m * 1e6:.3g} us of host time each; "
          f"wrote {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
