"""Dropout on this rank's blocks, drawn as one process draws it, for :mod:`runtime.apply`.

A dropout on a DTensor would run torch's on each rank's block: every rank draws a mask of
its block's shape from its own generator. Ranks seeded alike then give every block of a
split activation the same mask (the masks of a tensor-parallel layer's shards are one
pattern repeated), and ranks seeded apart give the summands of a partial sum different
masks, which is no dropout at all — both silent. On a CUDA mesh DTensor's own random-op
tracker would instead broadcast rank 0's generator state at the first draw: a collective
the plan does not have.

:class:`LocalDropout` draws instead, on every rank, the whole tensor's mask from the default
generator — the draw one process makes for that tensor (on the CPU bit for bit: the same
Bernoulli draw, then the same scaling) — and keeps its block
(:func:`~torch.distributed.tensor._utils.compute_local_shape_and_global_offset`): replicas
and the summands of a partial sum get the same mask, the blocks of a split tensor their own
parts of it, and every rank's generator advances alike. The planner prices the whole draw
for an imported model's dropouts (``attrs.whole_mask``:
:func:`ilp_planner.lowering.compute_model.op_work`). SDPA's dropout on split blocks
(:mod:`runtime.local_attention`) takes its mask from :func:`dropout_block` too.

Every rank's generator must start alike: :func:`runtime.rank_agreement.check_generators`
compares them when the plan drops anything (:func:`dropping_ops`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.overrides import TorchFunctionMode

from ilp_planner.ir.graph import Graph, OpKind
from runtime.errors import FidelityError

_DROPOUTS = frozenset({F.dropout, torch.dropout, torch.dropout_})


def dropout_block(shape: torch.Size, p: float, dt: DTensor) -> torch.Tensor:
    """This rank's block of the keep mask (boolean) one process would draw for a tensor of
    ``shape`` dropped with probability ``p``: the whole mask drawn, the block of it ``dt``
    holds kept (``dt`` has as many dims; the dims it splits are the mask's too — SDPA's
    probabilities ``(b, h, s, s)`` beside its ``q``, ``(b, h, s, d)``, split over b and h)."""
    keep = torch.empty(shape, dtype=torch.bool, device=dt.to_local().device).bernoulli_(1 - p)
    local, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh,
                                                          dt.placements)
    for d, (size, start) in enumerate(zip(local, offset, strict=True)):
        if size != dt.shape[d]:
            keep = keep.narrow(d, start, size)
    return keep.contiguous()  # the whole mask freed


def _dropped(x: DTensor, p: float) -> DTensor:
    """``F.dropout(x, p)`` in training, as one process computes it, on this rank's block."""
    local = x.to_local(grad_placements=x.placements)
    if p == 1.0:  # torch's dropout with p = 1 zeroes everything, drawing nothing
        out = local * 0.0
    else:
        out = local * dropout_block(x.shape, p, x).to(local.dtype).div_(1 - p)
    return DTensor.from_local(out, x.device_mesh, x.placements, run_check=False,
                              shape=x.shape, stride=x.stride())


class LocalDropout(TorchFunctionMode):
    """While a forward of the applied module runs: ``F.dropout`` (``nn.Dropout``'s too) of a
    DTensor in training draws its mask as one process does and keeps this rank's block
    (module docstring); other random draws on a DTensor are refused (each rank would draw
    its block from its own generator)."""

    _OTHER = frozenset({torch.rand_like, torch.randn_like, torch.randint_like, torch.bernoulli,
                        torch.Tensor.bernoulli_, torch.Tensor.uniform_, torch.Tensor.normal_,
                        torch.Tensor.exponential_, torch.Tensor.random_, torch.alpha_dropout,
                        torch.feature_dropout, torch.feature_alpha_dropout, F.alpha_dropout,
                        F.feature_alpha_dropout, F.dropout1d, F.dropout2d, F.dropout3d})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else kwargs.get("input")
        if isinstance(x, DTensor):
            if func in _DROPOUTS:
                p, train, inplace = _dropout_args(func, args, kwargs)
                if train and p > 0:
                    out = _dropped(x, float(p))
                    return x.copy_(out) if inplace else out  # in place: the caller's x
            elif func in self._OTHER and _drawing(func, args, kwargs):
                raise FidelityError(
                    f"{getattr(func, '__name__', func)} draws random values on a DTensor: each "
                    f"rank would draw its block from its own generator, unlike one process; "
                    f"parallelize runs dropout (F.dropout, nn.Dropout) as one process draws "
                    f"it, no other random op on a sharded value")
        return func(*args, **kwargs)


def _dropout_args(func: Any, args: tuple, kwargs: dict) -> tuple[float, bool, bool]:
    """(p, training, in place) of a call of ``F.dropout(input, p=0.5, training=True,
    inplace=False)``, ``torch.dropout(input, p, train)`` or ``torch.dropout_`` (in place)."""
    names = ("p", "training", "inplace") if func is F.dropout else ("p", "train")
    defaults = (0.5, True, False)
    got = [args[i + 1] if len(args) > i + 1 else kwargs.get(n, d)
           for i, (n, d) in enumerate(zip(names, defaults, strict=False))]
    return float(got[0]), bool(got[1]), bool(got[2]) if len(got) > 2 else func is torch.dropout_


_TRAINING_ARG = {F.alpha_dropout: ("training", False), F.feature_alpha_dropout: ("training", False),
                 F.dropout1d: ("training", True), F.dropout2d: ("training", True),
                 F.dropout3d: ("training", True), torch.alpha_dropout: ("train", True),
                 torch.feature_dropout: ("train", True),
                 torch.feature_alpha_dropout: ("train", True)}
"""The refused dropouts' training argument (third, after the input and ``p``): its name
and default (aten's ``torch.*_dropout(input, p, train)`` take it positionally)."""


def _drawing(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a refused random function draws anything (a dropout in evaluation or with
    p = 0 returns its input)."""
    if func not in _TRAINING_ARG:
        return True
    name, default = _TRAINING_ARG[func]
    p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
    train = args[2] if len(args) > 2 else kwargs.get(name, default)
    return bool(train) and p > 0


def dropping_ops(graph: Graph) -> list[str]:
    """The ops of ``graph`` that draw a dropout mask: dropouts that drop (p > 0 in
    training) and attentions dropping their probabilities."""
    return [op.name for op in graph.ops if (op.kind is OpKind.DROPOUT and not op.is_identity)
            or (op.kind is OpKind.ATTENTION and op.attrs.get("probs_dropout"))]
