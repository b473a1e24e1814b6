"""Scaled dot-product attention on this rank's blocks, for :mod:`runtime.apply`.

Attention is independent per sequence and per head, so where the user's SDPA reads ``q``,
``k`` and ``v`` split over the batch (dim 0) and the heads (dim 1) — any mix over the mesh
axes, Megatron's DP × TP among them — each rank's SDPA on its blocks is its block of the
result: :class:`LocalAttention` runs it so, with no communication, and hands the result back
as a DTensor in the same placements (the gradients come back in them too). DTensor's own
propagation cannot always do this: its 4-D matmul flattens ``(batch, heads)`` and refuses
some split pairs (a batch of 2 over 2 devices with 4 heads over 4 raises "would reshape
sharded dimension 0"). Any other placement (a split sequence, a partial sum) is left to
DTensor, whose collectives the audit would count.

Hand-written attention adds a learned bias to its scores (T5's and MPNet's relative position
bias, looked up in this rank's whole table: :mod:`runtime.applied_bias`) — a plain tensor
beside DTensor scores. DTensor would replicate it, and its backward gather the bias's
gradient back to a replica: a collective the plan does not have. :class:`LocalAttention`
adds this rank's block of it instead (:func:`bias_block`), so its gradient is this rank's
blocks' share, which the table's planned AllReduce completes, as with SDPA's mask.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.overrides import TorchFunctionMode

from runtime.errors import FidelityError
from runtime.local_dropout import dropout_block

_SDPA_ARGS = inspect.signature(
    lambda query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
    enable_gqa=False: None)


def blockwise(q: Any, k: Any, v: Any) -> bool:
    """Whether ``q``, ``k`` and ``v`` are DTensors on one mesh in the same placements, each
    replicated or split over the batch or the heads."""
    xs = (q, k, v)
    if not all(isinstance(x, DTensor) and x.dim() == 4 for x in xs):
        return False
    pls = tuple(q.placements)
    if any(x.device_mesh != q.device_mesh or tuple(x.placements) != pls for x in (k, v)):
        return False
    return all(type(pl) is Replicate or (type(pl) is Shard and pl.dim in (0, 1)) for pl in pls)


def on_mesh_of(mask: Any, like: Any) -> Any:
    """``mask`` re-viewed onto ``like``'s mesh where it is a replicated DTensor taking no
    gradient on another mesh of the same devices (a mask built from an opaque op's output —
    DeepSeek-V3.2's indexer's top-k — lives on that op's flattened mesh): every rank holds
    the whole value on either, so the re-view moves nothing. Anything else as it is."""
    if not (isinstance(mask, DTensor) and isinstance(like, DTensor)) or mask.requires_grad \
            or mask.device_mesh == like.device_mesh \
            or mask.device_mesh.device_type != like.device_mesh.device_type \
            or any(type(pl) is not Replicate for pl in mask.placements) \
            or sorted(mask.device_mesh.mesh.flatten().tolist()) != \
            sorted(like.device_mesh.mesh.flatten().tolist()):
        return mask
    return DTensor.from_local(mask.to_local(), like.device_mesh,
                              [Replicate()] * like.device_mesh.ndim, run_check=False,
                              shape=mask.shape, stride=mask.stride())


def one_mesh(a: Any, b: Any, in_place: bool) -> tuple[Any, Any] | None:
    """``(a, b)`` on one mesh where one of them :func:`on_mesh_of` can re-view onto the
    other's (None where neither moves): the one that cannot move stays — scores taking a
    gradient or split —, and between two that could (replicated scores in ``no_grad``),
    the one on the mesh of fewer dims moves (an opaque op's is flat, a planned op's the
    grid of its layout). ``in_place``: ``a`` is written, so only ``b`` may move."""
    a_moves, b_moves = on_mesh_of(a, b) is not a, on_mesh_of(b, a) is not b
    if b_moves and (in_place or not a_moves or b.device_mesh.ndim <= a.device_mesh.ndim):
        return a, on_mesh_of(b, a)
    if a_moves and not in_place:
        return on_mesh_of(a, b), b
    return None


def local_mask(mask: Any, q: DTensor) -> Any:
    """The block of a mask (broadcast over batch and heads where its dims are 1) matching
    this rank's block of ``q``; None for a mask split another way (DTensor runs that)."""
    if mask is None:
        return None
    if isinstance(mask, DTensor):
        if any(type(pl) is not Replicate for pl in mask.placements):
            return None
        mask = mask.to_local()
    shape, offset = compute_local_shape_and_global_offset(q.shape, q.device_mesh, q.placements)
    lead = 4 - mask.dim()
    for d in (0, 1):
        real = d - lead
        if real >= 0 and mask.size(real) > 1:
            mask = mask.narrow(real, offset[d], shape[d])
    return mask


_ADDS = frozenset({torch.add, torch.Tensor.add, torch.Tensor.add_, torch.Tensor.__add__,
                   torch.Tensor.__iadd__})
_SUMS = frozenset({torch.add, torch.Tensor.add, torch.Tensor.__add__})  # not in place


def learned_bias(x: Any) -> bool:
    """A plain tensor taking a gradient: inside the applied module, only a bias table's
    lookup makes one (every other trained parameter is a DTensor, or refused)."""
    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor) and x.requires_grad \
        and 0 < x.dim() <= 4


def split_scores(x: Any) -> bool:
    """4-D DTensor scores every mesh axis of which splits the batch or the heads."""
    return isinstance(x, DTensor) and x.dim() == 4 and all(
        type(pl) is Shard and pl.dim in (0, 1) or size == 1
        for pl, size in zip(x.placements, x.device_mesh.shape, strict=True))


def bias_block(bias: torch.Tensor, scores: DTensor) -> DTensor:
    """This rank's block of ``bias`` broadcast to ``scores``, as a DTensor in their
    placements: adding it is local, and its gradient this rank's blocks' share."""
    block = local_mask(bias.expand(scores.shape), scores)
    return DTensor.from_local(block, scores.device_mesh, scores.placements, run_check=False,
                              shape=scores.shape, stride=scores.stride())


class LocalAttention(TorchFunctionMode):
    """While a forward of the applied module runs: ``F.scaled_dot_product_attention`` on
    :func:`blockwise` DTensors computes on their local blocks, and a learned bias added to
    split hand-written scores is added blockwise (see the module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ADDS and len(args) >= 2:
            a, b = args[0], args[1]
            if split_scores(a) and learned_bias(b):
                return func(a, bias_block(b, a), *args[2:], **kwargs)
            if split_scores(b) and learned_bias(a) and func in _SUMS:
                return func(bias_block(a, b), b, *args[2:], **kwargs)
            moved = one_mesh(a, b, in_place=func not in _SUMS)
            if moved is not None:  # eager attention's scores + such a mask
                return func(*moved, *args[2:], **kwargs)
        if func is F.scaled_dot_product_attention:
            bound = _SDPA_ARGS.bind(*args, **kwargs)
            bound.apply_defaults()
            a = dict(bound.arguments)
            q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
            a["attn_mask"] = on_mesh_of(a["attn_mask"], q)
            if blockwise(q, k, v):
                mask = local_mask(a["attn_mask"], q)
                if mask is not None or a["attn_mask"] is None:
                    a["attn_mask"] = mask
                    return _local_sdpa(q, k, v, a)
            if a["dropout_p"] > 0 and isinstance(q, DTensor):
                raise FidelityError(
                    f"SDPA drops its probabilities (dropout_p={a['dropout_p']}) on q, k, v in "
                    f"{tuple(q.placements)}: only on blocks split over the batch and the heads "
                    f"does each rank draw its block of one process's mask "
                    f"(runtime.local_dropout); DTensor would draw each block from the rank's "
                    f"own generator")
            return func(q, k, v, **a)
        return func(*args, **kwargs)


def _local_sdpa(q: DTensor, k: DTensor, v: DTensor, rest: dict) -> DTensor:
    """SDPA of the local blocks, as a DTensor of the global result in ``q``'s placements."""
    pls = tuple(q.placements)
    local = [x.to_local(grad_placements=pls) for x in (q, k, v)]
    if rest["dropout_p"] > 0:  # one process's mask, this rank's block of it
        keep = dropout_block(q.shape[:2] + (q.shape[2], k.shape[2]), rest["dropout_p"], q)
        with warnings.catch_warnings():  # torch calls a given mask a testing aid
            warnings.filterwarnings("ignore", message="Dropout mask should only be used")
            out = torch.ops.aten._scaled_dot_product_attention_math(
                *local, rest["attn_mask"], rest["dropout_p"], rest["is_causal"], keep,
                scale=rest["scale"], enable_gqa=rest["enable_gqa"])[0]
    else:
        out = F.scaled_dot_product_attention(*local, **rest)
    shape = (q.shape[0], q.shape[1], q.shape[2], v.shape[3])
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(out, q.device_mesh, pls, run_check=False, shape=torch.Size(shape),
                              stride=stride)
