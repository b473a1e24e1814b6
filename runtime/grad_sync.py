"""Weight-gradient synchronisation of one stage: the plan's chunks, overlapped with the backward.

The parameters' ``.grad`` are slices of flat buffers (one per device group, in backward
order): autograd accumulates in place, one fp32 gradient per parameter, as the memory model
prices. A hook on every parameter counts, during the stage's last backward (``armed``), the
gradients each chunk still waits for; a chunk whose gradients are all accumulated is
AllReduced asynchronously right away, overlapped with the rest of the backward. The step
then waits for every chunk (:meth:`GradSync.reduced`).
"""

from __future__ import annotations

import torch

from ilp_planner.lowering.grad_buckets import GradBucket
from runtime import model
from runtime.comm import LVal, Report, all_reduce_async
from runtime.mesh import MeshRegistry
from runtime.recorder import Recorder


def last_backward(actions: list[tuple[str, int]]) -> int | None:
    """The micro-batch of a stage's last ``B`` action, in action order: a schedule may run
    its backwards out of micro-batch order, and only the last one completes the gradients."""
    return next((mb for kind, mb in reversed(actions) if kind == "B"), None)


Slot = tuple[int, int, int]  # (buffer, start, stop) of a parameter's gradient


def _slots(chunks: tuple[GradBucket, ...], params: dict[str, LVal]
           ) -> tuple[dict[int, int], dict[str, Slot]]:
    """Each flat buffer's size and each synchronised parameter's slice of it."""
    sizes: dict[int, int] = {}
    slots: dict[str, Slot] = {}
    for c in chunks:
        sizes[c.buffer] = max(sizes.get(c.buffer, 0), c.stop)
        for m in c.members:
            offset = m.start
            for role in m.roles:
                key = f"{m.layer}.{role}"
                n = params[key].t.numel()
                slots[key] = (c.buffer, offset, offset + n)
                offset += n
    return sizes, slots


class GradSync:
    """One stage's gradient chunks: flat buffers, readiness hooks, asynchronous AllReduces."""

    def __init__(self, chunks: tuple[GradBucket, ...], params: dict[str, LVal],
                 devices: tuple[int, ...], registry: MeshRegistry, recorder: Recorder,
                 device: torch.device):
        self.chunks = chunks
        self.params = params
        self.devices = devices
        self.registry = registry
        self.recorder = recorder
        sizes, self.slots = _slots(chunks, params)
        self.flat = {b: torch.zeros(n, device=device, dtype=model.DTYPE) for b, n in sizes.items()}
        self.views = {key: self.flat[b][lo:hi].view_as(params[key].t)
                      for key, (b, lo, hi) in self.slots.items()}
        self.chunks_of = {key: [i for i, c in enumerate(chunks)
                                if c.buffer == b and c.start < hi and c.stop > lo]
                          for key, (b, lo, hi) in self.slots.items()}
        self.needs = [sum(1 for key in self.slots if i in self.chunks_of[key])
                      for i in range(len(chunks))]
        self.armed = False  # set during the step's last backward (with overlap)
        self.waiting: list[int] = []
        self.work: dict[int, Report] = {}
        for key in self.slots:
            params[key].t.register_post_accumulate_grad_hook(lambda p, key=key: self._ready(key))

    def begin_step(self) -> None:
        """Empty the buffers and make their slices the parameters' ``.grad`` again."""
        for buf in self.flat.values():
            buf.zero_()
        for key, view in self.views.items():
            self.params[key].t.grad = view
        self.waiting = list(self.needs)
        self.work = {}

    def reduced(self) -> dict[str, torch.Tensor]:
        """Wait for the chunks launched during the backward (launching, in chunk order, any
        not launched: without overlap, or holding a parameter the step did not reach — its
        slice stays zero) and read each reduced gradient from its slice of the flat
        buffer. A chunk's recorded seconds are the time the step waited for it (its exposed
        part)."""
        for key in self.slots:
            self._check_in_buffer(key)
        for i in range(len(self.chunks)):
            if i not in self.work:
                self._launch(i)
        for chunk in self.work.values():
            chunk.value()
        return dict(self.views)

    def _ready(self, key: str) -> None:
        if not self.armed:
            return
        self._check_in_buffer(key)
        for i in self.chunks_of[key]:
            self.waiting[i] -= 1
            if self.waiting[i] == 0:
                self._launch(i)

    def _check_in_buffer(self, key: str) -> None:
        grad = self.params[key].t.grad
        if grad is None or grad.data_ptr() != self.views[key].data_ptr():
            raise RuntimeError(f"autograd replaced the gradient buffer of {key!r} instead of "
                               f"accumulating into it; its reduction would miss this step")

    def _launch(self, i: int) -> None:
        c = self.chunks[i]
        group = self.registry.axes_group(self.devices, c.fact, c.axes)
        self.work[i] = all_reduce_async(self.flat[c.buffer][c.start:c.stop], group,
                                        self.recorder, "backward", "grad_sync", c.launcher)
