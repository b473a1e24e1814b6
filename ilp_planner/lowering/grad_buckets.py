"""Weight-gradient buckets: which gradients the runtime reduces together, and how much of
that communication the backward hides.

Each op's gradient synchronisation is one or more :class:`~ilp_planner.lowering.strategies.SyncBucket`
(the parameters partial over the same mesh axes). Like ``DistributedDataParallel``, the
runtime fuses them: the gradients reduced over the same device groups (whatever mesh
factorisation names them) in the same dtype are one flat buffer, laid out in backward
order, and with a cap of ``cap`` bytes it is reduced in ``⌈bytes / cap⌉`` equal chunks,
each launched (asynchronously) as soon as every gradient overlapping it is ready, while
the backward goes on. ``cap = 0`` keeps one AllReduce per op and set of axes.

A chunk count of ⌈bytes / cap⌉ is what makes the ILP exact: the bandwidth terms are linear
in the bytes, and the latency terms are ``α_j · ⌈Σ bytes / cap⌉`` per buffer j, one
integer variable each (:mod:`formulations.sbp_ilp`). The planner (the collectives a plan
lists, hence what ``--audit`` counts) and the executor both take their chunks from
:func:`fill_buckets`, so they cannot disagree.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import numpy as np

from formulations.problem import chunk_count
from ilp_planner.ir.cluster import Factorisation, axis_coordinates
from ilp_planner.lowering.cost_model import ONCE_PER_STEP, Collective, CollectiveKind
from ilp_planner.lowering.strategies import StrategyContext, SyncBucket, coll

DDP_BUCKET_MB = 25.0  # DistributedDataParallel's bucket_cap_mb default


@dataclass(frozen=True)
class Member:
    """One op's gradients in a device group's flat buffer: ``[start, stop)`` elements."""

    layer: str
    roles: tuple[str, ...]
    start: int
    stop: int


@dataclass(frozen=True)
class GradBucket:
    """One chunk ``[start, stop)`` of a device group's flat gradient buffer, reduced by one
    AllReduce once every member overlapping it is ready; ``members`` in backward order, the
    last one completes it (its ``launcher``). ``buffer`` is the device group's index."""

    buffer: int
    start: int
    stop: int
    members: tuple[Member, ...]
    fact: Factorisation
    axes: tuple[int, ...]
    collective: Collective

    @property
    def launcher(self) -> str:
        return self.members[-1].layer


@cache
def device_groups(fact: Factorisation, axes: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """The partition of the mesh's devices (mesh order) into the groups a collective over
    ``axes`` of ``fact`` runs in — what decides whether two reductions can share a buffer.
    Cached: the problem build asks for it once per strategy of every layer."""
    coords = axis_coordinates(fact)
    keep = [a for a in range(len(fact)) if a not in axes]
    # devices with the same coordinates off ``axes`` form a group (listed in mesh order)
    key = (np.ravel_multi_index(tuple(coords[:, keep].T), [fact[a].size for a in keep])
           if keep else np.zeros(len(coords), dtype=np.int64))
    order = np.argsort(key, kind="stable")
    groups = np.split(order, np.flatnonzero(np.diff(key[order])) + 1)
    return tuple(sorted(tuple(g.tolist()) for g in groups))


def buffer_key(sb: SyncBucket) -> tuple:
    """The flat buffer ``sb``'s gradients join: its device groups (:func:`device_groups`)
    and element size — like ``DistributedDataParallel``'s buckets, one dtype each."""
    return device_groups(sb.fact, sb.axes), sb.collective.bytes / sb.numel


def fill_buckets(syncs: Sequence[tuple[str, SyncBucket]], cap_bytes: float,
                 ctx: StrategyContext) -> tuple[GradBucket, ...]:
    """The chunks the runtime reduces (see the module docstring). ``syncs`` lists (layer,
    its :class:`SyncBucket`) in forward (graph) order; buffers are numbered in order of
    their first gradient in backward order, chunks listed buffer by buffer."""
    if cap_bytes < 0:
        raise ValueError(f"bucket cap must be >= 0 bytes, got {cap_bytes}")
    if cap_bytes == 0:
        return tuple(_bucket(i, [(layer, sb)], cap_bytes, ctx)[0]
                     for i, (layer, sb) in enumerate(reversed(syncs)))
    buffers: dict[tuple, list[tuple[str, SyncBucket]]] = {}
    for layer, sb in reversed(syncs):
        buffers.setdefault(buffer_key(sb), []).append((layer, sb))
    return tuple(b for i, members in enumerate(buffers.values())
                 for b in _bucket(i, members, cap_bytes, ctx))


def _bucket(index: int, syncs: list[tuple[str, SyncBucket]], cap: float,
            ctx: StrategyContext) -> list[GradBucket]:
    """Lay one device group's gradients out in a flat buffer and cut it into chunks."""
    itemsize = {sb.collective.bytes / sb.numel for _, sb in syncs}
    if len(itemsize) != 1:
        raise ValueError(f"gradients of one device group mix element sizes {sorted(itemsize)}")
    size = itemsize.pop()
    members, offset = [], 0
    for layer, sb in syncs:
        members.append(Member(layer, sb.roles, offset, offset + sb.numel))
        offset += sb.numel
    n = int(chunk_count(offset * size, cap)) if cap > 0 else 1
    first = syncs[0][1]
    out = []
    first_member = 0  # members are laid out in order: the chunks' overlaps only move forward
    for c in range(n):
        lo, hi = offset * c // n, offset * (c + 1) // n
        while members[first_member].stop <= lo:
            first_member += 1
        mine = tuple(itertools.takewhile(lambda m, hi=hi: m.start < hi,
                                         itertools.islice(members, first_member, None)))
        out.append(GradBucket(index, lo, hi, mine, first.fact, first.axes,
                              coll(CollectiveKind.ALL_REDUCE, first.fact, first.axes,
                                   (hi - lo) * size, ctx, "backward", "grad_sync")))
    return out


def exposed_grad_sync(layers: Sequence) -> float:
    """Seconds of once-per-step communication a step waits for after its last backward,
    from plan layers in forward order (each bucket's AllReduce is listed on its launcher):
    the backward runs the layers in reverse, ``2/3`` of each layer's compute plus its
    backward activation collectives; a bucket starts when its launcher's backward is done
    and the previous bucket has finished (one channel); tied-weight exchanges run after
    every bucket, unhidden. State sharding: a ZeRO-1 gradient ReduceScatter overlaps like a
    bucket; the AllGather of updated weights follows the optimizer step, unhidden. A
    recomputed layer's backward also runs its forward again (``3/4`` of its compute)."""
    t = channel = 0.0
    for ly in reversed(layers):
        t += (0.75 if ly.recompute else 2 / 3) * ly.compute_s + sum(
            c.seconds for c in ly.collectives
            if c.phase != "forward" and c.purpose not in ONCE_PER_STEP)
        for c in ly.collectives:
            if c.purpose in ("grad_sync", "shard_grad_sync"):
                channel = max(channel, t) + c.seconds
    tail = sum(c.seconds for ly in layers for c in ly.collectives
               if c.purpose in ("tied_weight", "weight_allgather"))
    return max(0.0, channel - t) + tail
