"""One stage's sharded optimizer state (``LayerPlan.zero``), around :mod:`runtime.zero`'s buckets.

A sharded layer's gradient buckets (the planner's
:func:`~ilp_planner.lowering.strategies.grad_sync`) are not AllReduced but kept as flat
buffers sharded over the bucket's group; the optimizer updates each rank's fp32 shard.
ZeRO-1/2 keep the full blocks in the compute dtype and add each micro-batch's gradient to a
flat fp32 buffer, as the planner prices them; ZeRO-1 reduce-scatters it once, after the
step's last backward (during it, with overlap), ZeRO-2 after every micro-batch's backward;
both all-gather the updated shards into the full blocks after the update. ZeRO-3 keeps only
the shard and gathers it in the op's forward (:func:`runtime.zero.gather`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ilp_planner.ir.layouts import Layout
from ilp_planner.lowering.strategies import is_summa, param_shapes
from runtime.comm import LVal, Report
from runtime.compiled import CompiledPlan
from runtime.mesh import MeshRegistry
from runtime.recorder import Recorder, tagged
from runtime.zero import ZeroBucket


class ZeroState:
    """The stage's :class:`~runtime.zero.ZeroBucket` s and their per-step collectives."""

    def __init__(self, compiled: CompiledPlan, devices: tuple[int, ...], registry: MeshRegistry,
                 recorder: Recorder, device: torch.device):
        self.compiled = compiled
        self.devices = devices
        self.registry = registry
        self.recorder = recorder
        self.device = device
        self.buckets: list[ZeroBucket] = []
        self.of: dict[str, list[ZeroBucket]] = {}  # layer -> its buckets
        self.full: dict[str, tuple[ZeroBucket, str]] = {}  # ZeRO-1/2 full block -> bucket, role
        self.armed = False  # set during the step's last backward (with overlap)
        self.waiting: dict[str, int] = {}
        self.work: dict[str, Report] = {}

    def shard_layer(self, name: str, blocks: dict[str, torch.Tensor],
                    layouts: dict[str, tuple[Layout, Layout]]) -> set[str]:
        """Shard ``name``'s buckets from its full local ``blocks``; return the roles kept
        only as a shard (ZeRO-3). ZeRO-1/2 blocks stay full, in the compute dtype (the
        planner's w bytes; the fp32 master is the shard), refreshed by the all-gather after
        each update, never updated themselves — but SUMMA gathers its weight from the
        master's dtype (as priced) and casts it itself."""
        c = self.compiled
        op, lp = c.graph[name], c.layers[name]
        shard_only: set[str] = set()
        for i, sync in enumerate(c.zero_syncs.get(name, ())):
            zb = ZeroBucket(name, i, lp.zero, sync,
                            {r: tuple(blocks[r].shape) for r in sync.roles},
                            {r: math.prod(layouts[r][0].padded_shape(param_shapes(op)[r]))
                             for r in sync.roles},
                            c.compute_dtype)
            zb.init(blocks, self.registry.axes_group(self.devices, sync.fact, sync.axes),
                    self.device)
            zb.backward_reads = c.zero3_backward_reads(op, sync)
            zb.recomputed = lp.recompute
            self.buckets.append(zb)
            self.of.setdefault(name, []).append(zb)
            if lp.zero == 3:
                shard_only |= set(sync.roles)
                continue
            for role in sync.roles:
                if not (role == "weight" and is_summa(lp.strategy)):
                    blocks[role] = blocks[role].to(c.compute_dtype)
        return shard_only

    def hook(self, params: dict[str, LVal]) -> None:
        """After every parameter exists: route each ZeRO-1/2 full block's gradient into its
        bucket's flat fp32 buffer, and reduce-scatter a ZeRO-1 bucket once the last
        backward completes it."""
        self.full = {f"{zb.layer}.{r}": (zb, r) for zb in self.buckets
                     if zb.level < 3 for r in zb.sync.roles}
        for zb in self.buckets:
            if zb.level == 3:
                continue
            for role, view in zb.views(zb.full_grad).items():
                t = params[f"{zb.layer}.{role}"].t
                t.register_post_accumulate_grad_hook(
                    lambda p, view=view: self._accumulate(p, view))
                if zb.level == 1:
                    t.register_post_accumulate_grad_hook(lambda p, zb=zb: self._level1_ready(zb))

    def begin_step(self) -> None:
        for zb in self.buckets:
            if zb.level == 3:
                zb.master.grad = None
                continue
            zb.full_grad.zero_()
            zb.grad_shard.zero_()
        self.waiting = {zb.key: len(zb.sync.roles) for zb in self.buckets}
        self.work = {}

    @staticmethod
    def _accumulate(p: torch.Tensor, view: torch.Tensor) -> None:
        """ZeRO-1/2: a full block's gradient (in the block's compute dtype) joins the flat
        fp32 buffer the reduce-scatter reads, and leaves the block — gradients accumulate
        in fp32, as the planner prices them (its g bytes), whatever the block's dtype."""
        view.add_(p.grad)
        p.grad = None

    def _level1_ready(self, zb: ZeroBucket) -> None:
        """During the step's last backward (with overlap): once every role of a ZeRO-1
        bucket has its final gradient, reduce-scatter it asynchronously, as a gradient
        chunk is AllReduced (the plan prices it overlapped with the rest of the backward)."""
        if not self.armed:
            return
        self.waiting[zb.key] -= 1
        if self.waiting[zb.key] == 0:
            out = torch.empty(zb.s, device=self.device, dtype=torch.float32)
            first = len(self.recorder.events)
            with tagged("backward", "shard_grad_sync", zb.layer):
                work = dist.reduce_scatter_single(out, zb.full_grad, group=zb.group, async_op=True)
            self.work[zb.key] = Report(out, work, self.recorder.events[first:])

    def after_microbatch(self) -> None:
        """ZeRO-2: after each micro-batch's backward, every flat gradient is reduce-scattered
        into its shard (which accumulates) and the full buffer is emptied for the next."""
        for zb in self.buckets:
            if zb.level == 2:
                zb.grad_shard += zb.reduce_scatter(zb.full_grad, "shard_grad", self.recorder)
                zb.full_grad.zero_()

    def shard_grads(self) -> dict[str, torch.Tensor]:
        """Each bucket's reduced shard gradient (a ZeRO-1 bucket's reduce-scatter launched
        during the last backward is waited, or issued now)."""
        out = {}
        for zb in self.buckets:
            if zb.level == 1:
                if zb.key not in self.work:
                    zb.grad_shard += zb.reduce_scatter(zb.full_grad, "shard_grad_sync",
                                                       self.recorder)
                else:
                    zb.grad_shard += self.work[zb.key].value()
            out[zb.key] = zb.shard_grad()
        return out

    def masters(self) -> dict[str, torch.Tensor]:
        """The fp32 master shards the optimizer updates."""
        return {zb.key: zb.master.data for zb in self.buckets}

    def gather_updated(self, params: dict[str, LVal]) -> None:
        """ZeRO-1/2: all-gather each updated shard (in the compute dtype, as priced) into the
        full local blocks the next forward reads."""
        for zb in self.buckets:
            if zb.level < 3:
                full = zb.all_gather(zb.master.detach().to(self.compiled.compute_dtype), "step",
                                     "weight_allgather", self.recorder)
                with torch.no_grad():
                    for role, view in zb.views(full).items():
                        params[f"{zb.layer}.{role}"].t.copy_(view)

    def full_masters(self) -> dict[str, torch.Tensor]:
        """Every sharded block's full fp32 master (untagged gathers, for results)."""
        return {f"{zb.layer}.{r}": t for zb in self.buckets for r, t in zb.full_master().items()}
