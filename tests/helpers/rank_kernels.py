"""The kernels each rank of a multi-rank plan issues in one training step, counted at
dispatch — ``python -m tests.helpers.rank_kernels PLAN OUT WORLD`` (gloo ranks spawned here,
rank r's counts written to ``OUT.r`` as JSON ``{"op @ where": count}``).

What is counted is what :func:`runtime.measure_dispatch.count_dispatched` counts (aten ops
below autograd but views and allocations), with each op's innermost frame in ``runtime/``
(``file:function``; ``?`` for none). Left out: the collectives themselves (``c10d`` ops,
priced by the α–β model) and every kernel the backend issues for them — inside a ``c10d`` op
or while a ``Work`` is waited on: gloo copies its results there, which NCCL does not."""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

from runtime.measure_dispatch import _NO_KERNEL


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.inside = 0  # within a collective or its wait: the backend's own kernels

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.inside += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.inside -= 1
        name = func.__name__.split(".")[0]
        if not self.inside and not func.is_view and name not in _NO_KERNEL:
            self.ops[f"{func.namespace}::{name} @ {_where()}"] += 1
        return func(*args, **(kwargs or {}))


def _where() -> str:
    """The op's innermost frame in ``runtime/``, or ``tied.py:exchange`` for every op of a
    tied table's gradient exchange (its programs' slices included), which is priced as one."""
    frame = sys._getframe(2)
    inner = None
    while frame is not None:
        path, name = frame.f_code.co_filename, frame.f_code.co_name
        if path.endswith("/runtime/tied.py") and name == "exchange":
            return "tied.py:exchange"
        if inner is None and "/runtime/" in path:
            inner = f"{path.split('/runtime/')[-1]}:{name}"
        frame = frame.f_back
    return inner or "?"


def _waits_inside(mode: _Count) -> None:
    wait = dist.Work.wait

    def counted(self, *args, **kwargs):
        mode.inside += 1
        try:
            return wait(self, *args, **kwargs)
        finally:
            mode.inside -= 1

    dist.Work.wait = counted


def _rank(rank: int, world: int, plan: str, out: str) -> None:
    from ilp_planner.plan.data import Plan
    from runtime.executor import Executor, RunOptions

    dist.init_process_group("gloo", store=dist.FileStore(f"{out}.store", world), rank=rank,
                            world_size=world)
    try:
        ex = Executor(Plan.load(plan), RunOptions(record=False), rank=rank, world=world)
        ex.setup()
        ex.train_step(0)
        mode = _Count()
        _waits_inside(mode)
        with mode:
            ex.train_step(1)
        Path(f"{out}.{rank}").write_text(json.dumps(dict(mode.ops)))
        # no rank tears its group down while another still talks to it (gloo aborts the
        # process then: "terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    plan_path, out_path, ranks = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mp.spawn(_rank, args=(ranks, plan_path, out_path), nprocs=ranks)
