"""Cross-mesh transfers between pipeline stages (Zhuang et al.), as the plan's unit tasks.

Forward: the boundary tensor is brought (inside its source stage, by its export program,
once per tensor) to the entries' ``src_layout``, then each unit task, in the plan's order, is
one ``dist.broadcast`` from its sender within the group ``{sender} ∪ receivers``; receivers
assemble their block of ``dst_layout`` as a leaf. Backward: the plan's ``backward_tasks``
(their own solved schedule) move the leaf's gradient the other way, from devices holding a
slice of it to the devices of the source stage, who assemble the gradient of their
``src_layout`` block and run autograd from there. Sends are asynchronous (waited at the end
of the step) and receives block, so no schedule that respects its own dependencies can
deadlock; forward and backward transfers use distinct groups because a 1F1B stage
interleaves the two directions differently from its neighbour.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ilp_planner.ir.graph import Graph
from ilp_planner.ir.layouts import Layout
from ilp_planner.ir.regions import layout_blocks
from ilp_planner.plan.data import ReshardingEntry, Stage, UnitTask
from runtime.comm import LVal
from runtime.mesh import MeshRegistry
from runtime.recorder import Recorder, tagged, timed

Region = tuple[tuple[int, int], ...]  # per dim (start, stop)

_GROUP_TAG = {"forward": "fwd", "backward": "bwd"}  # transfer groups, one set per direction


def transfer_group(direction: str, t: UnitTask, e: ReshardingEntry, per_boundary: bool) -> tuple:
    """The registry key of task ``t``'s group: one per direction and rank set; with
    ``per_boundary`` (interleaved 1F1B) also one per pair of chunks, so each chunk link is
    its own in-order channel (two meshes exchange several chunks' tensors, in each
    direction, in orders the schedule validates per link, not across links)."""
    if per_boundary:
        return (_GROUP_TAG[direction], e.src_stage, e.dst_stage, t.group)
    return (_GROUP_TAG[direction], t.group)


def _relative(task_region: Region, mine: Region) -> tuple[slice, ...]:
    """A task's region as slices of this rank's block ``mine``."""
    return tuple(slice(a - m0, b - m0) for (a, b), (m0, _) in zip(task_region, mine, strict=True))


def _shape(region: Region) -> list[int]:
    return [b - a for a, b in region]


class Transfers:
    """This rank's part of every cross-mesh transfer; :meth:`wait_sends` ends a step."""

    def __init__(self, rank: int, device: torch.device, registry: MeshRegistry,
                 recorder: Recorder, stages: Sequence[Stage], entries: Sequence[ReshardingEntry],
                 graph: Graph, per_boundary: bool = False):
        self.rank = rank
        self.device = device
        self.registry = registry
        self.recorder = recorder
        self.stages = stages
        self.entries = entries
        self.graph = graph
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []  # sends not yet waited
        self.per_boundary = per_boundary  # interleaved 1F1B: a group per chunk link (transfer_group)

    def send_forward(self, e: ReshardingEntry, v: LVal) -> None:
        """Post the forward tasks this rank sends of entry ``e``'s tensor ``v``."""
        mine = self._region(e.src_layout, e, e.src_stage)
        self._send(e.tasks, v.t.detach(), mine, "forward", e)

    def recv_forward(self, e: ReshardingEntry) -> LVal:
        """This rank's block of ``e``'s ``dst_layout``, as a view of a leaf that requires
        its gradient (received: the blocking receives' time is the transfer's)."""
        mine = self._region(e.dst_layout, e, e.dst_stage)
        local = torch.empty(_shape(mine), device=self.device, dtype=self._dtype(e.tensor))
        with timed(self.recorder):
            posted = self._post_receives(e.tasks, "forward", e)
            for _, _, work in posted:
                work.wait()
        for t, buf, _ in posted:
            local[_relative(t.region, mine)] = buf
        # read through a view of the leaf: its gradient reaches the leaf as a new view, which
        # autograd keeps as it is, where the leaf itself would be handed one its reader
        # shares (an add's, passed to both operands) and copy it
        return LVal(local.requires_grad_(True).view_as(local), e.dst_layout)

    def send_backward(self, e: ReshardingEntry, leaf: LVal) -> None:
        """Post the backward tasks this rank sends of the gradient of ``leaf`` (a view of
        the received leaf, :meth:`recv_forward`; zeros when autograd did not reach it)."""
        g = leaf.t._base.grad
        if g is None:
            g = torch.zeros_like(leaf.t)
        mine = self._region(e.dst_layout, e, e.dst_stage)
        self._send(e.backward_tasks, g, mine, "backward", e)

    def recv_backward(self, sent: dict[int, LVal]) -> dict[int, torch.Tensor]:
        """Post every receive of the gradients of the ``sent`` entries, then wait for them;
        their recorded seconds share the wait."""
        out = {}
        posted = []
        first = len(self.recorder.events)
        t0 = time.perf_counter()
        for idx in sent:
            e = self.entries[idx]
            mine = self._region(e.src_layout, e, e.src_stage)
            out[idx] = torch.zeros(_shape(mine), device=self.device, dtype=self._dtype(e.tensor))
            posted += [(idx, t, buf, work, mine)
                       for t, buf, work in self._post_receives(e.backward_tasks, "backward", e)]
        for _, _, _, work, _ in posted:
            work.wait()
        received = self.recorder.events[first:]
        for ev in received:
            ev.seconds = (time.perf_counter() - t0) / len(received)
        for idx, t, buf, _, mine in posted:
            out[idx][_relative(t.region, mine)] = buf
        return out

    def wait_sends(self) -> None:
        """Wait for every send posted this step."""
        for work, _ in self.pending:
            work.wait()
        self.pending = []

    def _region(self, layout: Layout, e: ReshardingEntry, stage: int) -> Region:
        devices = self.stages[stage].devices
        return layout_blocks(layout, e.shape)[devices.index(self.rank)]

    def _dtype(self, tensor: str) -> torch.dtype:
        return getattr(torch, self.graph[tensor].output.dtype)

    def _group(self, direction: str, t: UnitTask, e: ReshardingEntry):
        return self.registry.group(transfer_group(direction, t, e, self.per_boundary))

    def _send(self, tasks: tuple[UnitTask, ...], local: torch.Tensor, mine: Region, direction: str,
              e: ReshardingEntry) -> None:
        """Post (asynchronously) every task this rank sends, a slice of its block ``local``
        (whose region is ``mine``); waited at the end of the step."""
        for t in tasks:
            if t.sender == self.rank:
                buf = local[_relative(t.region, mine)].contiguous()
                with tagged(direction, "resharding", e.tensor):
                    work = dist.broadcast(buf, src=t.sender, async_op=True,
                                          group=self._group(direction, t, e))
                self.pending.append((work, buf))

    def _post_receives(self, tasks: tuple[UnitTask, ...], direction: str, e: ReshardingEntry
                       ) -> list[tuple[UnitTask, torch.Tensor, dist.Work]]:
        posted = []
        for t in tasks:
            if self.rank in t.receivers:
                buf = torch.empty(_shape(t.region), device=self.device, dtype=self._dtype(e.tensor))
                with tagged(direction, "resharding", e.tensor):
                    work = dist.broadcast(buf, src=t.sender, async_op=True,
                                          group=self._group(direction, t, e))
                posted.append((t, buf, work))
        return posted
