"""The bridge between the IR's layouts and DTensor, for :mod:`runtime.apply`.

An IR layout on its mesh is a tuple of DTensor placements on a ``DeviceMesh`` without the
size-1 axes (:func:`rank_grid`, :func:`placements`); the IR's ``(tokens, features)`` dims
sit in the user's real tensor as :class:`DimMap` says. :class:`Wrap` and :class:`Unwrap`
turn a local block into a DTensor and back without communicating, and check on the way
back that the gradient arrives in the placements the plan's backward program starts from.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ilp_planner.ir.cluster import Factorisation, axis_coordinates
from ilp_planner.ir.layouts import Layout, Split
from ilp_planner.ir.layouts import Partial as IRPartial
from runtime.errors import FidelityError, RuntimeSetupError
from runtime.mesh import world_cache


def rank_grid(fact: Factorisation, world: int) -> np.ndarray:
    """The ranks laid out on a layout's mesh, size-1 axes dropped: entry ``[c0, c1, …]`` is
    the rank at those axis coordinates. A factorisation that interleaves nodes and devices
    (the solver offers ``[devices, nodes]`` meshes too) is not a row-major view of the ranks;
    DeviceMesh takes any such array, so every mesh the solver offers can run."""
    kept = [i for i, a in enumerate(fact) if a.size > 1]
    sizes = [fact[i].size for i in kept] or [1]
    if math.prod(sizes) != world:
        raise RuntimeSetupError(f"a layout's mesh covers {math.prod(sizes)} ranks, not {world}")
    coords = axis_coordinates(fact)[:, kept] if kept else np.zeros((world, 1), dtype=np.int64)
    grid = np.empty(sizes, dtype=np.int64)
    grid[tuple(coords.T)] = np.arange(world)
    return grid


@dataclass(frozen=True)
class DimMap:
    """How the IR's tensor dims sit in the real tensor: IR ``(tokens, features)`` is the
    real ``(batch, …, features)`` (tokens split only over the batch dim), a linear's
    ``(in, out)`` weight may be stored ``(out, in)`` (``transposed``); a per-head norm's
    value (``attrs.group_width``) is viewed ``(batch, …, heads, head_dim)`` with the heads
    at real dim ``heads`` (``attrs.heads_dim``: Gemma-3 hands its norm ``(b, heads, s,
    d)``), its features split over them."""

    real_shape: tuple[int, ...]
    ir_rank: int
    transposed: bool = False
    heads: int | None = None

    def real_dim(self, d: int) -> int:
        if self.transposed:
            return 1 - d
        if self.ir_rank == len(self.real_shape):
            return d
        if self.heads is not None:
            return 0 if d == 0 else self.heads
        return 0 if d == 0 else len(self.real_shape) - 1

    def ir_block(self, local: torch.Tensor) -> torch.Tensor:
        """A real block as the IR's tokens-major ``(rows, features)`` block."""
        if local.dim() == self.ir_rank:
            return local
        if self.heads is None:
            return local.reshape(-1, local.shape[-1])
        local = local.movedim(self.heads, -2)
        return local.reshape(-1, local.shape[-2] * local.shape[-1])

    def real_block(self, y: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """An IR block back in the real block's ``shape`` (:meth:`ir_block`'s inverse)."""
        if self.heads is None or len(shape) == self.ir_rank:
            return y.reshape(shape)
        moved = [n for i, n in enumerate(shape) if i != self.heads]
        moved.insert(len(moved) - 1, shape[self.heads])
        return y.reshape(moved).movedim(-2, self.heads)


def placements(layout: Layout, dims: DimMap, where: str) -> tuple:
    """The DTensor placements of an IR layout on its mesh (:func:`mesh_shape`)."""
    out: list[Any] = []
    split_of: dict[int, int] = {}
    for axis, pl in zip(layout.fact, layout.placements, strict=True):
        if axis.size == 1:
            continue
        if isinstance(pl, IRPartial):
            out.append(Partial())
        elif isinstance(pl, Split):
            real = dims.real_dim(pl.dim)
            out.append(Shard(real))
            split_of[real] = split_of.get(real, 1) * axis.size
        else:
            out.append(Replicate())
    for real, k in split_of.items():
        if dims.real_shape[real] % k:
            raise RuntimeSetupError(
                f"{where}: {layout} splits dim {real} of the module's tensor "
                f"{tuple(dims.real_shape)} {k} ways; parallelize needs even splits of the real "
                f"dims (tokens split over the batch dim only)")
    return tuple(out) or (Replicate(),)


def dtensor_spec(mesh: DeviceMesh, pls: tuple, like: torch.Tensor | DTensor,
          shape: tuple[int, ...]) -> DTensorSpec:
    stride = tuple(torch.empty(shape, device="meta").stride())
    return DTensorSpec(mesh, tuple(pls), tensor_meta=TensorMeta(torch.Size(shape), stride,
                                                                like.dtype))


class Wrap(torch.autograd.Function):
    """A local block as a DTensor (no communication); its gradient must come back in the
    placements the plan's backward program starts from."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec, grad_pls: tuple, where: str):
        ctx.grad_pls, ctx.where = grad_pls, where
        return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx, grad: DTensor):
        if tuple(grad.placements) != tuple(ctx.grad_pls):
            raise FidelityError(f"{ctx.where}: the gradient arrives as {grad.placements}, the "
                                f"plan's backward program expects {ctx.grad_pls}")
        return grad._local_tensor, None, None, None


class Unwrap(torch.autograd.Function):
    """A DTensor's local block; its gradient returns as a DTensor in ``grad_spec``."""

    @staticmethod
    def forward(ctx, x: DTensor, grad_spec: DTensorSpec):
        ctx.grad_spec = grad_spec
        return x._local_tensor.view_as(x._local_tensor)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return DTensor(g.contiguous(), ctx.grad_spec, requires_grad=False), None


class Meshes:
    """One DeviceMesh per rank grid (:func:`rank_grid`) the plan's layouts use (each op's
    operands share its strategy's mesh), created in one order on every rank. Two meshes of
    one shape that order the ranks differently are two DeviceMeshes."""

    def __init__(self, layouts: Iterable[Layout], device_type: str, world: int):
        grids = {_grid_key(rank_grid(lay.fact, world)) for lay in layouts}
        made = world_cache("device_meshes")  # one process's earlier plans' (runtime.mesh)
        for key in sorted(grids):
            if (device_type, key) not in made:
                made[(device_type, key)] = DeviceMesh(device_type, torch.tensor(_grid(key)))
        self.by_grid = {key: made[(device_type, key)] for key in sorted(grids)}
        self.world = world

    def of(self, layout: Layout) -> DeviceMesh:
        return self.by_grid[_grid_key(rank_grid(layout.fact, self.world))]


GridKey = tuple[tuple[int, ...], tuple[int, ...]]  # (shape, ranks in row-major order)


def _grid_key(grid: np.ndarray) -> GridKey:
    return tuple(grid.shape), tuple(int(r) for r in grid.ravel())


def _grid(key: GridKey) -> np.ndarray:
    return np.array(key[1], dtype=np.int64).reshape(key[0])


class ContextStack:
    """Context managers entered by one hook and left by a later one (the forward's
    pre-hook opens, the output hook or the gradient reduction closes)."""

    def __init__(self) -> None:
        self._open: list[Any] = []

    def __bool__(self) -> bool:
        return bool(self._open)

    def enter(self, ctx: Any) -> None:
        ctx.__enter__()
        self._open.append(ctx)

    def leave(self) -> None:
        while self._open:
            self._open.pop().__exit__(None, None, None)
