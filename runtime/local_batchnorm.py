"""Synchronised batch norm on this rank's blocks, for :mod:`runtime.apply`.

The planner splits a batch norm's (N, C, …) activation over the batch, the channels or both
(:func:`ilp_planner.lowering.strategies.batchnorm_collectives`). DTensor's own batch-norm
rule shards channels only, so :class:`LocalBatchNorm` runs ``F.batch_norm`` on the local
blocks instead, as ``torch.nn.SyncBatchNorm`` computes it: the per-channel [Σx, Σx²] of the
local rows (formed from each block's mean and variance) are AllReduced over the mesh axes
splitting the batch (one AllReduce of 2·C_local values in float64: in float32,
``E[x²] − E[x]²`` lost the variance of channels whose mean is large beside their spread),
giving the whole batch's mean and biased variance; autograd's backward of
that AllReduce is the AllReduce of their gradients — SyncBatchNorm's [Σdy, Σdy·x̂] — issued
only where the input needs a gradient, as the plan prices it. The gains' and offsets'
gradients leave partial over the batch axes, for the plan's weight-gradient buckets.
Running statistics (``running_mean``, ``running_var`` with the unbiased variance of the whole
batch) are updated on this rank's channels, in place in the module's buffers: each rank's
channel block equals one process's. Both collectives are tagged ``batchnorm`` for the
dispatch-level recorder, so the audit compares them with the plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.overrides import TorchFunctionMode

from ilp_planner.ir.graph import Graph, OpKind
from ilp_planner.ir.layouts import Layout
from ilp_planner.plan.data import LayerPlan
from runtime.comm import Comm
from runtime.dtensors import DimMap, Meshes, placements
from runtime.recorder import tagged

PURPOSE = "batchnorm"


def batch_axes(layout: Layout) -> tuple[int, ...]:
    """The mesh axes (size > 1) splitting a batch norm's batch: its statistics' group."""
    return tuple(a for a in layout.split_axes(0) if layout.fact[a].size > 1)


def register_batchnorms(graph: Graph, layers: dict[str, LayerPlan], comm: Comm
                        ) -> list[tuple[str, Layout]]:
    """Every batch norm of the plan with its output layout; the groups of those splitting
    the batch are registered (before the registry creates its groups)."""
    out = []
    for op in graph.ops:
        if op.kind is OpKind.BATCHNORM:
            lay = layers[op.name].output
            if batch_axes(lay):
                comm.register_axes(lay, batch_axes(lay))
            out.append((op.name, lay))
    return out


@dataclass(frozen=True)
class StatsGroup:
    """Where a batch-split block's statistics are summed: the process group of the axes
    splitting the batch, None where the batch is whole."""

    group: Any


StatsGroups = dict[tuple[int, tuple], StatsGroup]


def stats_groups(graph: Graph, norms: list[tuple[str, Layout]], comm: Comm,
                 meshes: Meshes) -> StatsGroups:
    """Per (DeviceMesh id, DTensor placements) a planned batch norm's input takes: its
    statistics' group."""
    out = {}
    for name, lay in norms:
        shape = graph[name].output.shape
        pls = placements(lay, DimMap(shape, len(shape)), name)
        axes = batch_axes(lay)
        out[(id(meshes.of(lay)), pls)] = StatsGroup(comm.group(lay, axes) if axes else None)
    return out


class _SumOverBatch(torch.autograd.Function):
    """AllReduce of the local statistics over the batch axes; its backward AllReduces their
    gradients over the same group (a sum's gradient reaches every summand)."""

    @staticmethod
    def forward(ctx, sums: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        out = sums.detach().contiguous().clone()
        with tagged("forward", PURPOSE):
            dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.contiguous().clone()
        with tagged("backward", PURPOSE):
            dist.all_reduce(out, group=ctx.group)
        return out, None


class LocalBatchNorm(TorchFunctionMode):
    """While a forward of the applied module runs: ``F.batch_norm`` on a planned batch
    norm's DTensor input computes on the local blocks (see the module docstring)."""

    def __init__(self, groups: StatsGroups):
        super().__init__()
        self.groups = groups

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.batch_norm and isinstance(args[0], DTensor):
            x = args[0]
            found = self.groups.get((id(x.device_mesh), tuple(x.placements)))
            if found is not None:
                return _local_batch_norm(found, *args, **kwargs)
        return func(*args, **kwargs)


def _local_batch_norm(found: StatsGroup, x: DTensor, running_mean: Any, running_var: Any,
                      weight: Any = None, bias: Any = None, training: bool = False,
                      momentum: float | None = 0.1, eps: float = 1e-5) -> DTensor:
    """``F.batch_norm`` of the whole batch, computed on this rank's block of ``x``."""
    pls = tuple(x.placements)
    shape, offset = compute_local_shape_and_global_offset(x.shape, x.device_mesh, pls)
    lo, hi = offset[1], offset[1] + shape[1]
    # statistics in float32 at least, as one process's batch norm keeps them (float64 stays)
    xl = x.to_local(grad_placements=pls).to(torch.promote_types(x.dtype, torch.float32))
    dims = (0, *range(2, xl.dim()))
    view = (1, -1) + (1,) * (xl.dim() - 2)
    count = x.shape[0] * math.prod(x.shape[2:])
    if training:
        mean, var = _batch_statistics(found, xl, dims, count)
        _update_running(running_mean, running_var, mean, var, (lo, hi), count, momentum)
    else:
        mean, var = running_mean[lo:hi].to(xl.dtype), running_var[lo:hi].to(xl.dtype)
    y = (xl - mean.view(view)) * torch.rsqrt(var + eps).view(view)
    batch_split = [type(p) is Shard and p.dim == 0 for p in pls]
    if weight is not None:
        y = y * _local_param(weight, batch_split).to(xl.dtype).view(view)
    if bias is not None:
        y = y + _local_param(bias, batch_split).to(xl.dtype).view(view)
    return DTensor.from_local(y.to(x.dtype), x.device_mesh, pls, run_check=False,
                              shape=x.shape, stride=x.stride())


def _batch_statistics(found: StatsGroup, xl: torch.Tensor, dims: tuple[int, ...],
                      count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch's per-channel mean and biased variance, in ``xl``'s dtype. Each
    rank's block gives its mean and squared deviations (``var_mean``, as one process's
    batch norm computes them); the sums [Σx, Σx²] = [n·μ, n·(σ² + μ²)] are formed and
    reduced in float64, so ``E[x²] − E[x]²`` cancels nothing a float32 model can see (in
    float32 it lost the variance of channels whose mean is large beside their spread —
    LeViT's and MobileNet's — which the next layers amplified)."""
    local_var, local_mean = torch.var_mean(xl, dims, correction=0)
    n = xl.numel() // xl.shape[1]  # this rank's rows
    mean64 = local_mean.double()
    sums = torch.cat([n * mean64, n * (local_var.double() + mean64 * mean64)])
    if found.group is not None:
        sums = _SumOverBatch.apply(sums, found.group)
    mean, sq = (sums / count).split(xl.shape[1])
    return mean.to(xl.dtype), (sq - mean * mean).clamp_min(0).to(xl.dtype)


def _local_param(p: Any, batch_split: list[bool]) -> torch.Tensor:
    """A gain's or offset's local block; its gradient partial over the batch axes (the
    rows this rank holds), as the plan's gradient buckets expect."""
    if not isinstance(p, DTensor):
        return p
    grad = tuple(Partial() if split else pl for split, pl in zip(batch_split, p.placements,
                                                                  strict=True))
    return p.to_local(grad_placements=grad)


def _update_running(running_mean: Any, running_var: Any, mean: torch.Tensor,
                    var: torch.Tensor, rows: tuple[int, int], count: int,
                    momentum: float | None) -> None:
    """Running statistics of this rank's channels, as one process updates them (unbiased
    variance of the whole batch)."""
    if running_mean is None or momentum is None:
        return
    lo, hi = rows
    with torch.no_grad():
        unbiased = var * (count / max(count - 1, 1))
        for buf, new in ((running_mean, mean), (running_var, unbiased)):
            block = buf._local_tensor if isinstance(buf, DTensor) else buf[lo:hi]
            block.mul_(1 - momentum).add_(new.detach().to(block.dtype), alpha=momentum)
