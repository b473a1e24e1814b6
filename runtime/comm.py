"""Communication of the runtime: the lowered programs of :mod:`ilp_planner.lowering.redistribution`
executed step by step on local blocks.

A value inside a stage is an :class:`LVal` — this rank's local block (a plain tensor, the
``torch.chunk``-style region :meth:`~ilp_planner.ir.layouts.Layout.regions` gives) and the
planner :class:`~ilp_planner.ir.layouts.Layout` it is in. Nothing here re-derives a path:
:meth:`Comm.edge` takes the planner's :class:`~ilp_planner.lowering.redistribution.Redistribution`
(forward steps and the backward steps autograd will run) and executes exactly those, with
one c10d collective per priced step, every piece padded to the layout's largest block so
each rank moves the bytes the plan prices:

===========  ==============================================================
step         execution on this rank's block (axis ``a`` of size ``k``)
===========  ==============================================================
P→B          ``all_reduce`` (padded)
P→S(d)       chunk d into k pieces, pad, ``reduce_scatter_single``, unpad
S(d)→B       pad, ``all_gather_single``, unpad each piece, concatenate
S(i)→S(j)    chunk j into k pieces, pad, ``all_to_all_single``, concatenate i
B→S(d)       keep this rank's chunk of d (no communication)
re-view      nothing: the block is the same on the other factorisation
===========  ==============================================================

Each edge is a custom autograd function whose forward runs ``steps`` and whose backward
runs ``backward_steps`` on the incoming gradient (which arrives in the consumer's gradient
layout, see :func:`ilp_planner.lowering.strategies.input_grad_layouts`).
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ilp_planner.ir.cluster import Cluster, axis_coordinates
from ilp_planner.ir.graph import TensorSpec
from ilp_planner.ir.layouts import Broadcast, Layout, Partial, Split
from ilp_planner.ir.regions import chunk_bounds
from ilp_planner.lowering.redistribution import Redistribution, RedistStep, plan_redistribution
from runtime.mesh import MeshRegistry
from runtime.recorder import Recorder, tagged, timed


class Report:
    """An asynchronous AllReduce the step waits for only at its end (:meth:`value`): the
    loss value, a gradient chunk. Its recorded events are marked overlapped, their seconds
    that wait (the exposed part)."""

    def __init__(self, buf: torch.Tensor, work=None, events: list | None = None):
        self.buf, self.work, self.events = buf, work, events or []

    def value(self) -> torch.Tensor:
        if self.work is not None:
            t0 = time.perf_counter()
            self.work.wait()
            for ev in self.events:
                ev.seconds = time.perf_counter() - t0
                ev.overlapped = True
            self.work = None
        return self.buf


def all_reduce_async(buf: torch.Tensor, group, recorder: Recorder, phase: str, purpose: str,
                     where: str = "") -> Report:
    """AllReduce ``buf`` in place, asynchronously, tagged for the recorder."""
    first = len(recorder.events)
    with tagged(phase, purpose, where):
        work = dist.all_reduce(buf, group=group, async_op=True)
    return Report(buf, work, recorder.events[first:])


class LVal(NamedTuple):
    """A distributed value: this rank's block and the layout it is in."""

    t: torch.Tensor
    layout: Layout


def _pieces(n: int, k: int) -> list[tuple[int, int]]:
    """The ``torch.chunk``-style pieces of a length-``n`` dim split ``k`` ways (the geometry
    :meth:`Layout.regions` describes)."""
    return [chunk_bounds(n, k, j) for j in range(k)]


def _pad_to(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` padded with zeros to ``shape`` (one kernel), or ``t`` itself where it has that
    shape already (a view stays a view)."""
    if tuple(t.shape) == tuple(shape):
        return t
    pads: list[int] = []
    for have, want in zip(reversed(t.shape), reversed(shape), strict=True):
        pads += [0, want - have]
    return F.pad(t, pads)


def _slice(t: torch.Tensor, dim: int, lo: int, hi: int) -> torch.Tensor:
    """A local slice (``B → S``): this rank's piece of ``dim``, contiguous — a copy where
    the piece is strided (a dim before ``dim`` holds more than one element), a view
    otherwise."""
    return t.narrow(dim, lo, hi - lo).contiguous()


def _packed(t: torch.Tensor, bounds: list[tuple[int, int]], dim: int,
            piece: list[int]) -> torch.Tensor:
    """The send buffer of a ReduceScatter or AlltoAll: the ``k`` pieces ``bounds`` of
    ``dim``, each padded to ``piece``, one after another — ``t`` itself where they already
    lie so (no piece to pad, no dim before ``dim`` holding more than one element), else
    their stack (one kernel, and one a piece to pad)."""
    raw = [t.narrow(dim, lo, hi - lo) for lo, hi in bounds]
    if all(tuple(p.shape) == tuple(piece) for p in raw) and math.prod(t.shape[:dim]) == 1:
        return t.contiguous().view(-1)
    return torch.stack([_pad_to(p, tuple(piece)) for p in raw]).view(-1)


def _unpacked(out: torch.Tensor, sizes: list[list[int]], dim: int) -> torch.Tensor:
    """The ``k`` received blocks ``out[q]`` (each padded) joined along ``dim``, each cut to
    its ``sizes[q]`` — ``out`` itself, re-viewed, where they already lie so (no block cut,
    no dim before ``dim`` holding more than one element), else their concatenation (one
    kernel)."""
    block = list(out.shape[1:])
    if all(size == block for size in sizes) and math.prod(block[:dim]) == 1:
        whole = list(block)
        whole[dim] *= out.shape[0]
        return out.view(whole)
    return torch.cat([_narrow(out[q], size) for q, size in enumerate(sizes)], dim=dim)


def _narrow(t: torch.Tensor, shape) -> torch.Tensor:
    for d, n in enumerate(shape):
        if t.shape[d] != n:
            t = t.narrow(d, 0, n)
    return t


class Comm:
    """The collectives of one stage's devices: groups from the registry, programs from the
    planner (cached per edge)."""

    def __init__(self, registry: MeshRegistry, devices: tuple[int, ...], rank: int,
                 cluster: Cluster, recorder: Recorder | None = None):
        self.registry = registry
        self.devices = devices
        self.rank = rank
        self.cluster = cluster
        self.recorder = recorder
        self._programs: dict[tuple, Redistribution] = {}
        self._regions: dict[tuple, tuple[tuple[int, int], ...]] = {}

    # -- compile time (identical on every rank) ----------------------------------------------
    def program(self, src: Layout, dst: Layout, tensor: TensorSpec,
                grad_dst: Layout | None = None) -> Redistribution:
        key = (src, dst, tensor, grad_dst)
        if key not in self._programs:
            self._programs[key] = plan_redistribution(src, dst, tensor, self.cluster, grad_dst)
        return self._programs[key]

    def register(self, red: Redistribution) -> None:
        """Register every group the program's steps use."""
        for step in (*red.steps, *red.backward_steps):
            if step.collective is not None:
                self.registry.need_axes(self.devices, step.src.fact, (step.axis,))

    def register_axes(self, layout: Layout, axes: tuple[int, ...]) -> None:
        self.registry.need_axes(self.devices, layout.fact, axes)

    # -- run time ----------------------------------------------------------------------------
    @property
    def device_index(self) -> int:
        return self.devices.index(self.rank)

    def coord(self, layout: Layout, axis: int) -> int:
        return int(axis_coordinates(layout.fact)[self.device_index, axis])

    def group(self, layout: Layout, axes: tuple[int, ...]):
        return self.registry.axes_group(self.devices, layout.fact, axes)

    def region(self, layout: Layout, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        key = (layout, tuple(shape))
        if key not in self._regions:
            r = layout.regions(tuple(shape))[self.device_index]
            self._regions[key] = tuple((int(a), int(b)) for a, b in r)
        return self._regions[key]

    def block(self, full: torch.Tensor, layout: Layout) -> torch.Tensor:
        """This rank's block of a full tensor (a P layout keeps the value on coordinate 0
        of its partial axes and zeros elsewhere, so the blocks sum to it)."""
        rep = Layout(layout.fact, tuple(Broadcast() if isinstance(p, Partial) else p
                                        for p in layout.placements))
        idx = tuple(slice(a, b) for a, b in self.region(rep, tuple(full.shape)))
        out = full[idx]
        if layout.has_partial and not all(self.coord(layout, a) == 0 for a in layout.partial_axes):
            out = torch.zeros_like(out)
        return out.contiguous()

    def edge(self, v: LVal, red: Redistribution, purpose: str = "activation", where: str = "") -> LVal:
        """Move ``v`` along the edge program ``red`` (forward steps now, backward steps in
        autograd's backward)."""
        if not red.steps and not red.backward_steps:
            return LVal(v.t, red.dst)
        y = _Edge.apply(v.t, self, red, purpose, where)
        return LVal(y, red.dst)

    def run(self, t: torch.Tensor, steps: tuple[RedistStep, ...], tensor: TensorSpec, phase: str,
            purpose: str, where: str = "") -> torch.Tensor:
        """Execute ``steps`` on this rank's block ``t`` (no autograd)."""
        for step in steps:
            t = self._step(t, step, tensor, phase, purpose, where)
        return t

    def all_reduce(self, t: torch.Tensor, layout: Layout, axes: tuple[int, ...], phase: str,
                   purpose: str, where: str = "", op=dist.ReduceOp.SUM) -> torch.Tensor:
        """One AllReduce over the joint group of ``axes`` (on a copy: ``t`` may be shared)."""
        t = t.contiguous().clone()
        with tagged(phase, purpose, where), timed(self.recorder):
            dist.all_reduce(t, op=op, group=self.group(layout, axes))
        return t

    def report(self, t: torch.Tensor, layout: Layout, axes: tuple[int, ...], phase: str,
               purpose: str, where: str = "") -> Report:
        """:meth:`all_reduce` of a copy of ``t``, launched asynchronously."""
        return all_reduce_async(t.detach().contiguous().clone(), self.group(layout, axes),
                                self.recorder, phase, purpose, where)

    def _step(self, t: torch.Tensor, step: RedistStep, tensor: TensorSpec, phase: str,
              purpose: str, where: str) -> torch.Tensor:
        if step.is_view:
            return t
        src, dst, a = step.src, step.dst, step.axis
        k = src.fact[a].size
        cur, new = src.placements[a], dst.placements[a]
        shape = tensor.shape
        if isinstance(cur, Broadcast) and isinstance(new, Split):
            return _slice(t, new.dim, *_pieces(t.shape[new.dim], k)[self.coord(src, a)])
        group = self.group(src, (a,))
        # the local kernels around each collective are the ones
        # :func:`~ilp_planner.lowering.redistribution.step_local_work` prices
        with tagged(phase, purpose, where), timed(self.recorder):
            if isinstance(cur, Partial) and isinstance(new, Broadcast):
                # a fresh buffer (the value may feed other edges; the reduction is in place):
                # the padded copy, or a plain one
                padded = src.padded_shape(shape)
                buf = _pad_to(t, padded) if tuple(t.shape) != tuple(padded) else \
                    t.clone(memory_format=torch.contiguous_format)
                dist.all_reduce(buf, group=group)
                return _narrow(buf, t.shape).contiguous()  # a copy where it was padded
            if isinstance(cur, Partial) and isinstance(new, Split):
                d = new.dim
                piece = list(src.padded_shape(shape))
                piece[d] = dst.padded_shape(shape)[d]
                out = torch.empty(piece, dtype=t.dtype, device=t.device)
                dist.reduce_scatter_single(out.view(-1),
                                           _packed(t, _pieces(t.shape[d], k), d, piece),
                                           group=group)
                lo, hi = _pieces(t.shape[d], k)[self.coord(src, a)]
                mine = list(t.shape)
                mine[d] = hi - lo
                return _narrow(out, mine).contiguous()
            if isinstance(cur, Split) and isinstance(new, Broadcast):
                d = cur.dim
                pad = src.padded_shape(shape)
                out = torch.empty((k, *pad), dtype=t.dtype, device=t.device)
                dist.all_gather_single(out.view(-1), _pad_to(t, pad).contiguous().view(-1),
                                       group=group)
                parent = self.region(dst, shape)[d]
                sizes = []
                for lo, hi in _pieces(parent[1] - parent[0], k):
                    size = list(t.shape)
                    size[d] = hi - lo
                    sizes.append(size)
                return _unpacked(out, sizes, d)
            if isinstance(cur, Split) and isinstance(new, Split):
                i, j = cur.dim, new.dim
                piece = list(src.padded_shape(shape))
                piece[j] = dst.padded_shape(shape)[j]
                bounds_j = _pieces(t.shape[j], k)
                out = torch.empty((k, *piece), dtype=t.dtype, device=t.device)
                dist.all_to_all_single(out.view(-1), _packed(t, bounds_j, j, piece), group=group)
                parent = self.region(dst, shape)[i]
                lo_j, hi_j = bounds_j[self.coord(src, a)]
                sizes = []
                for lo, hi in _pieces(parent[1] - parent[0], k):
                    size = list(t.shape)
                    size[i] = hi - lo
                    size[j] = hi_j - lo_j
                    sizes.append(size)
                return _unpacked(out, sizes, i)
        raise ValueError(f"step {step} is not a layout change the runtime executes")


class _Edge(torch.autograd.Function):
    """One edge program: forward steps, and backward steps on the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Comm, red: Redistribution, purpose: str, where: str):
        ctx.comm, ctx.red, ctx.purpose, ctx.where = comm, red, purpose, where
        return comm.run(x.detach(), red.steps, red.tensor, "forward", purpose, where)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        red = ctx.red
        gx = ctx.comm.run(g.contiguous(), red.backward_steps, red.tensor, "backward", ctx.purpose,
                          ctx.where)
        return gx, None, None, None, None
