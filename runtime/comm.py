"""Communication of the runtime: layout changes inside a stage, and the collective recorder.

A value inside a stage is a :class:`DVal` — a ``DTensor`` and the planner's
:class:`~ilp_planner.layouts.Layout` it has (the layout knows the factorisation, hence which
mesh the DTensor lives on). :meth:`Comm.to_layout` moves a value to another layout by
executing the planner's own redistribution path (:func:`ilp_planner.redistribution.
plan_redistribution`, Dijkstra over layouts) step by step:

1. *one mesh axis changes* — ``DTensor.redistribute`` on that step's mesh (P→B AllReduce,
   P→S ReduceScatter, S→B AllGather, S→S AlltoAll, B→S / B→P local);
2. *re-view* — two layouts on different factorisations holding the same block per device:
   ``to_local`` then ``from_local`` on the other mesh, no communication;
3. *reshuffle* (same shard shape, other devices) — executed as gather-to-replicated on the
   source mesh, re-view, local slice on the destination mesh. This is where the runtime's
   path differs from the planner's (one AlltoAll in the cost model).

Each step is a custom autograd function whose backward moves the gradient back (the dual
path: AllGather ↔ ReduceScatter, AllReduce stays) and whose forward and backward are timed
and recorded as :class:`CommEvent` rows (kind, group size, bytes n of the cost formula,
link level, seconds). DTensor's own deviations are recorded as they happen: on gloo an
AlltoAll is an AllGather plus a local slice, and gathering the major axis of a dim split by
several axes is done by DTensor with more than one AllGather (the planner counts one).

Gradient rule. The backward of a step normalises the gradient to the step's source
placements with partial sums turned into replicas — DTensor's own rule: the gradient of a
partial value is the (replicated) gradient of its sum.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import Partial as TPartial

from ilp_planner.cluster import Cluster
from ilp_planner.graph import TensorSpec
from ilp_planner.layouts import Layout, drop_unit_axes
from ilp_planner.redistribution import RedistStep, plan_redistribution


class DVal(NamedTuple):
    """A distributed value: the DTensor and the planner layout it is in."""

    dt: DTensor
    layout: Layout


@dataclass
class CommEvent:
    """One collective the runtime issued. ``bytes`` follows the cost model (n = output size
    per device; input size for ReduceScatter; the slice for a broadcast, whose group_size is
    the number of receivers). ``kind`` is ``mixed`` when one call moved several axes."""

    kind: str
    group_size: int
    bytes: float
    link: str
    seconds: float
    phase: str  # forward | backward | step
    purpose: str  # activation | grad_sync | resharding | loss | tied_weight
    where: str = ""


@dataclass
class Recorder:
    """Collects :class:`CommEvent` rows while ``enabled``."""

    enabled: bool = True
    events: list[CommEvent] = field(default_factory=list)

    def add(self, ev: CommEvent) -> None:
        if self.enabled:
            self.events.append(ev)

    def take(self) -> list[CommEvent]:
        out, self.events = self.events, []
        return out


def settle(t: torch.Tensor) -> torch.Tensor:
    """Wait for a functional collective behind ``t`` (so a timer can stop)."""
    local = t._local_tensor if isinstance(t, DTensor) else t
    if isinstance(local, AsyncCollectiveTensor):
        local.trigger_wait()
    return t


def grad_placements(placements) -> tuple:
    """DTensor's gradient placements of a value: partial sums become replicas."""
    return tuple(Replicate() if isinstance(p, TPartial) else p for p in placements)


def _classify(src, dst, sizes: tuple[int, ...], local_bytes: float,
              cpu: bool = False) -> tuple[str, int, float, tuple[int, ...]]:
    """(kind, group size, bytes, axes) of a placement change done in one redistribute call."""
    axes = tuple(i for i, (a, b) in enumerate(zip(src, dst, strict=True)) if a != b and sizes[i] > 1)
    comm_axes = tuple(i for i in axes if not (isinstance(src[i], Replicate)
                                              or (isinstance(dst[i], TPartial))))
    if not comm_axes:
        return "local", 1, 0.0, ()
    p = 1
    for i in comm_axes:
        p *= sizes[i]
    if len(comm_axes) > 1:
        return "mixed", p, local_bytes, comm_axes
    a, b = src[comm_axes[0]], dst[comm_axes[0]]
    if isinstance(a, TPartial):
        return ("all_reduce" if isinstance(b, Replicate) else "reduce_scatter"), p, local_bytes, comm_axes
    if isinstance(a, Shard) and isinstance(b, Replicate):
        return "all_gather", p, local_bytes * p, comm_axes
    if cpu:  # DTensor on gloo: AlltoAll = AllGather + local chunk
        return "all_gather", p, local_bytes * p, comm_axes
    return "all_to_all", p, local_bytes, comm_axes


def _local_bytes(t: DTensor) -> float:
    return float(t._local_tensor.numel() * t._local_tensor.element_size())


class Comm:
    """Layout changes of one stage: meshes from the registry, paths from the planner."""

    def __init__(self, registry, devices: tuple[int, ...], cluster: Cluster, recorder: Recorder):
        self.registry = registry
        self.devices = devices
        self.cluster = cluster
        self.recorder = recorder
        self._paths: dict[tuple, tuple[RedistStep, ...]] = {}

    # -- compile time (every rank, every stage) ----------------------------------------------
    def path(self, src: Layout, dst: Layout, tensor: TensorSpec) -> tuple[RedistStep, ...]:
        """The planner's steps from ``src`` to ``dst`` (unit axes dropped), cached."""
        key = (src, dst, tensor)
        if key not in self._paths:
            a, b = drop_unit_axes(src), drop_unit_axes(dst)
            self._paths[key] = () if a == b else plan_redistribution(a, b, tensor, self.cluster).steps
        return self._paths[key]

    def register(self, src: Layout, dst: Layout, tensor: TensorSpec) -> None:
        """Register every mesh ``to_layout(src → dst)`` will touch."""
        for lay in (src, dst, drop_unit_axes(src), drop_unit_axes(dst)):
            self.registry.need_mesh(self.devices, lay.fact)
        for step in self.path(src, dst, tensor):
            self.registry.need_mesh(self.devices, step.src.fact)
            self.registry.need_mesh(self.devices, step.dst.fact)

    # -- run time ----------------------------------------------------------------------------
    def mesh(self, layout: Layout):
        return self.registry.mesh(self.devices, layout.fact)

    def spans_nodes(self, layout: Layout, axes: tuple[int, ...]) -> bool:
        return any(layout.fact[a].nodes > 1 for a in axes)

    def to_layout(self, v: DVal, dst: Layout, tensor: TensorSpec, where: str = "",
                  purpose: str = "activation") -> DVal:
        if v.layout == dst:
            return v
        cur = v
        a = drop_unit_axes(v.layout)
        if a != v.layout:
            cur = self.view(cur, a, where)
        for step in self.path(v.layout, dst, tensor):
            if step.src.fact == step.dst.fact:
                cur = self.redistribute(cur, step.dst, where, purpose, step)
            elif step.collective is None:
                cur = self.view(cur, step.dst, where)
            else:
                cur = self.reshuffle(cur, step.dst, where, purpose)
        if cur.layout != dst:
            cur = self.view(cur, dst, where)
        return cur

    def redistribute(self, v: DVal, dst: Layout, where: str = "", purpose: str = "activation",
                     step: RedistStep | None = None) -> DVal:
        """One DTensor redistribute on ``v``'s mesh (same factorisation), timed both ways."""
        if dst.fact != v.layout.fact:
            raise ValueError(f"redistribute needs one factorisation: {v.layout} -> {dst}")
        y = _Redistribute.apply(v.dt, tuple(dst.to_dtensor()), self, v.layout, dst, where, purpose, step)
        return DVal(y, dst)

    def view(self, v: DVal, dst: Layout, where: str = "") -> DVal:
        """Re-view: the same per-device data seen on another factorisation's mesh."""
        y = _View.apply(v.dt, self.mesh(dst), tuple(dst.to_dtensor()))
        return DVal(y, dst)

    def reshuffle(self, v: DVal, dst: Layout, where: str, purpose: str) -> DVal:
        src_r = Layout.replicated(v.layout.fact)
        dst_r = Layout.replicated(dst.fact)
        full = self.redistribute(v, src_r, where, purpose)
        return self.redistribute(self.view(full, dst_r, where), dst, where, purpose)

    def record(self, kind: str, p: int, nbytes: float, spans: bool, seconds: float, phase: str,
               purpose: str, where: str) -> None:
        self.recorder.add(CommEvent(kind, p, nbytes, "inter" if spans else "intra", seconds,
                                    phase, purpose, where))


class _Redistribute(torch.autograd.Function):
    """Timed ``DTensor.redistribute`` with a timed backward."""

    @staticmethod
    def forward(ctx, x: DTensor, placements: tuple, comm: Comm, src: Layout, dst: Layout,
                where: str, purpose: str, step: RedistStep | None):
        ctx.comm, ctx.src, ctx.dst, ctx.where, ctx.purpose = comm, src, dst, where, purpose
        ctx.src_placements = x.placements
        sizes = tuple(a.size for a in src.fact)
        kind, p, nbytes, axes = _classify(x.placements, placements, sizes, _local_bytes(x),
                                          x.device_mesh.device_type == "cpu")
        t0 = time.perf_counter()
        y = settle(x.redistribute(x.device_mesh, placements))
        secs = time.perf_counter() - t0
        if kind != "local":
            comm.record(kind, p, nbytes, comm.spans_nodes(src, axes), secs, "forward", purpose, where)
        return y

    @staticmethod
    def backward(ctx, g: DTensor):
        if g is None:
            return (None,) * 8
        target = grad_placements(ctx.src_placements)
        if tuple(g.placements) == target:
            return g, None, None, None, None, None, None, None
        sizes = tuple(a.size for a in ctx.src.fact)
        kind, p, nbytes, axes = _classify(g.placements, target, sizes, _local_bytes(g),
                                          g.device_mesh.device_type == "cpu")
        t0 = time.perf_counter()
        gx = settle(g.redistribute(g.device_mesh, target))
        secs = time.perf_counter() - t0
        if kind != "local":
            ctx.comm.record(kind, p, nbytes, ctx.comm.spans_nodes(ctx.src, axes), secs, "backward",
                            ctx.purpose, ctx.where)
        return gx, None, None, None, None, None, None, None


class _View(torch.autograd.Function):
    """Re-view a DTensor on another mesh with the same local data (no communication)."""

    @staticmethod
    def forward(ctx, x: DTensor, mesh, placements: tuple):
        ctx.src_mesh, ctx.src_placements = x.device_mesh, x.placements
        ctx.dst_placements = grad_placements(placements)
        ctx.shape, ctx.stride = x.shape, x.stride()
        local = settle(x)._local_tensor
        if isinstance(local, AsyncCollectiveTensor):
            local = local.elem
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=x.shape,
                                  stride=x.stride())

    @staticmethod
    def backward(ctx, g: DTensor):
        if g is None:
            return None, None, None
        if tuple(g.placements) != ctx.dst_placements:
            g = settle(g.redistribute(g.device_mesh, ctx.dst_placements))
        local = g._local_tensor
        if isinstance(local, AsyncCollectiveTensor):
            local = local.trigger_wait()
        gx = DTensor.from_local(local, ctx.src_mesh, grad_placements(ctx.src_placements),
                                run_check=False, shape=ctx.shape, stride=ctx.stride)
        return gx, None, None


def timed_all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> float:
    t0 = time.perf_counter()
    dist.all_reduce(t, op=op, group=group)
    return time.perf_counter() - t0
