"""Fused projections whose output the user's code cuts into equal column blocks (Phi-3's
``gate, up = gate_up_proj(x).chunk(2, dim=-1)``), for :mod:`runtime.apply`.

The plan splits such a linear's columns ``k`` ways (``attrs.parts``, the ``part`` ops of
:mod:`ilp_planner.ir.graph`) so that device ``i`` holds the ``i``-th ``k``-th of every block
— its gate columns and the matching up columns — as Megatron interleaves a fused weight.
Here the parameter's output columns (and its bias) are stored in that order
(:func:`interleaved`): the ``k`` contiguous blocks of the stored tensor are ``[gate_i |
up_i]``, so the module's own matmul, on blocks or on DTensors, leaves each device
``[gate_i | up_i]``. The user's ``chunk`` of that value runs on each rank's block
(:class:`LocalParts`, no communication; DTensor would gather a split dim before splitting
it) and hands back the parts as DTensors in the same placements, whose gradients come back
in them. The module's parameter (and its optimizer state) keeps this order while it
trains, and ``state_dict`` holds it so (resuming on the same plan needs nothing else);
:func:`runtime.apply.full_state_dict` gives the whole state in the module's own order (what
one process would save), :func:`runtime.apply.load_full_state_dict` takes one back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from ilp_planner.ir.graph import Graph, Op, OpKind
from ilp_planner.plan.data import LayerPlan
from runtime.errors import FidelityError, RuntimeSetupError

_SPLITS = frozenset({torch.Tensor.chunk, torch.chunk, torch.Tensor.split, torch.split,
                     torch.Tensor.split_with_sizes, torch.Tensor.tensor_split,
                     torch.tensor_split})


def _order(n: int, parts: int, k: int) -> torch.Tensor:
    """Column ``j`` of the interleaved order is column ``_order[j]`` of the natural one:
    for each of the ``k`` blocks, its share of part 0, then of part 1, …"""
    return torch.arange(n).view(parts, k, n // (parts * k)).transpose(0, 1).reshape(-1)


def interleaved(full: torch.Tensor, parts: int, k: int, dim: int) -> torch.Tensor:
    """``full`` with its ``dim`` (a fused weight's output columns, its bias) reordered so
    that each of ``k`` contiguous blocks holds that block's share of every part."""
    if parts <= 1 or k <= 1:
        return full
    return full.index_select(dim, _order(full.shape[dim], parts, k))


def natural_order(full: torch.Tensor, parts: int, k: int, dim: int) -> torch.Tensor:
    """The inverse of :func:`interleaved`: a trained fused weight in the module's order."""
    if parts <= 1 or k <= 1:
        return full
    return full.index_select(dim, torch.argsort(_order(full.shape[dim], parts, k)))


def fused_degree(graph: Graph, op: Op, ly: LayerPlan) -> int:
    """How many ways ``op``'s fused columns split under its strategy (1: not fused, or not
    split), refusing a split its code could not cut on each rank: a reader of the whole
    output, or blocks not dividing the parts."""
    parts = op.attrs.get("parts", 0) if op.kind is OpKind.LINEAR else 0
    k = ly.output.split_degree(1) if parts else 1
    if k == 1:
        return 1
    whole = [c for c in graph.consumers(op.name) if graph[c].kind is not OpKind.PART]
    width = op.output.shape[1] // parts
    if whole or width % k:
        raise RuntimeSetupError(
            f"op {op.name!r} computes {parts} fused column blocks split {k} ways, but "
            + (f"{whole[0]!r} reads its output whole" if whole
               else f"{k} does not divide a block of {width}")
            + "; parallelize runs such a split only where each part is read on its own")
    return k


class LocalParts(TorchFunctionMode):
    """While a forward of the applied module runs: a split of a fused output
    (:meth:`mark`) into its equal parts along its last dim runs on this rank's block."""

    def __init__(self) -> None:
        super().__init__()
        self.fused: dict[int, tuple[DTensor, int]] = {}

    def mark(self, out: Any, parts: int) -> None:
        """``out`` (a DTensor) is a fused output of ``parts`` equal column blocks."""
        if isinstance(out, DTensor):
            self.fused[id(out)] = (out, parts)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = self.fused.get(id(args[0])) if args and func in _SPLITS else None
        if hit is None or hit[0] is not args[0]:
            return func(*args, **kwargs)
        x, parts = hit
        whole = func(torch.empty(x.shape, device="meta"), *args[1:], **kwargs)
        part = (*x.shape[:-1], x.shape[-1] // parts)
        if len(whole) != parts or any(tuple(p.shape) != part for p in whole):
            raise FidelityError(f"a fused output of {parts} column blocks {tuple(x.shape)} "
                                f"is split into {[tuple(p.shape) for p in whole]}, not the "
                                f"plan's parts")
        pls = tuple(x.placements)
        local = x.to_local(grad_placements=pls).chunk(parts, dim=-1)
        stride = torch.empty(part, device="meta").stride()
        return tuple(DTensor.from_local(p, x.device_mesh, pls, run_check=False,
                                        shape=torch.Size(part), stride=stride) for p in local)
