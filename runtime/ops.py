"""Distributed ops: each computes on this rank's local blocks and returns its output block.

Every function takes the stage context, the op, its :class:`~ilp_planner.plan.data.LayerPlan`,
the input values already in the planned input layouts, and the op's parameters (local
leaf blocks in the layouts :func:`ilp_planner.lowering.strategies.param_layouts` gives), and returns
the output :class:`~runtime.comm.LVal` in ``LayerPlan.output``.

Gradients. Every op's local backward is plain autograd on local blocks; what its results
*mean* is fixed by the planner's tables, which the runtime shares rather than restates:
:func:`~ilp_planner.lowering.strategies.matmul_placements` (a matmul's output and gradient
placements), :func:`~ilp_planner.lowering.strategies.input_grad_layouts` (the layout each input's
gradient leaves in — the start of its edge's backward program) and
:func:`~ilp_planner.lowering.strategies.param_layouts` (each parameter's gradient layout, reduced by
:func:`~ilp_planner.lowering.strategies.grad_sync`). A bias (and an embedding's position table) on
a partial-sum output is added as a share by every device of the partial group
(:func:`bias_share`), so its gradient needs no reduction over that group — what Megatron
gets by adding a row-parallel layer's bias after the AllReduce.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ilp_planner.ir.graph import Graph, Op, OpKind, TensorSpec
from ilp_planner.ir.layouts import Layout
from ilp_planner.lowering.strategies import (
    conv_layouts,
    is_summa,
    loss_axes,
    matmul_placements,
    summa_programs,
)
from ilp_planner.plan.data import LayerPlan
from runtime import model, moe
from runtime.comm import Comm, LVal, Report
from runtime.errors import RuntimeSetupError


@dataclass
class StageContext:
    """What an op needs from its stage: devices, this rank, the communication layer."""

    index: int
    devices: tuple[int, ...]
    rank: int
    comm: Comm
    graph: Graph
    reports: list[Report] = field(default_factory=list)  # this step's loss values

    def spec(self, name: str) -> TensorSpec:
        return self.graph[name].output

    def region(self, layout: Layout, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        return self.comm.region(layout, shape)


# -- biases on partial sums ------------------------------------------------------------------


class _Share(torch.autograd.Function):
    """``b / p`` forward; the gradient passes through unscaled (see :func:`bias_share`)."""

    @staticmethod
    def forward(ctx, b: torch.Tensor, p: float) -> torch.Tensor:
        return b / p

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def bias_share(b: torch.Tensor, out: Layout) -> torch.Tensor:
    """The part of a bias-like parameter this device adds to a partial-sum output: each of
    the ``p`` devices of the partial group adds ``b / p``, so the reduced output holds ``b``
    once. The output's gradient is replicated over that group (the gradient of a reduction),
    so each device's local gradient of its share, taken unscaled, is already the full
    gradient of ``b``: no reduction over the partial axes
    (:func:`ilp_planner.lowering.strategies.param_layouts` prices none)."""
    p = math.prod(out.fact[a].size for a in out.partial_axes)
    return b if p == 1 else _Share.apply(b, float(p))


# -- matmul family ---------------------------------------------------------------------------


def _matmul_out(op: Op, lp: LayerPlan, x: Layout, w: Layout) -> Layout:
    try:
        out_pl, _, _ = matmul_placements(x, w, op.kind is OpKind.EMBEDDING)
    except Exception as exc:
        raise RuntimeSetupError(f"op {op.name!r}: {exc}") from exc
    out = Layout(x.fact, tuple(out_pl))
    if out != lp.output:
        raise RuntimeSetupError(f"op {op.name!r}: layouts {x} × {w} give {out}, the plan says "
                                f"{lp.output}")
    return out


def linear(ctx: StageContext, op: Op, lp: LayerPlan, xs: list[LVal], params: dict[str, LVal],
           data: dict) -> LVal:
    x, w = xs[0], params["weight"]
    assert op.weight is not None
    if is_summa(lp.strategy):
        x_prog, w_prog = summa_programs(lp.output.fact, ctx.spec(op.inputs[0]), op.master_spec,
                                        ctx.comm.cluster)
        x = ctx.comm.edge(x, x_prog, "activation", op.name)
        w = ctx.comm.edge(w, w_prog, "weight", op.name)  # the fp32 master, then cast
        w = LVal(w.t.to(x.t.dtype), w.layout)
    out = _matmul_out(op, lp, x.layout, w.layout)
    bias = params.get("bias")
    return LVal(model.linear(x.t, w.t, None if bias is None else bias_share(bias.t, out)), out)


def embedding(ctx: StageContext, op: Op, lp: LayerPlan, xs: list[LVal], params: dict[str, LVal],
              data: dict) -> LVal:
    ids, w, pos = xs[0], params["weight"], params.get("pos")
    assert op.weight is not None
    out = _matmul_out(op, lp, ids.layout, w.layout)
    (v0, _), _ = ctx.region(w.layout, op.weight.shape)
    (r0, r1), = ctx.region(ids.layout, (op.output.shape[0],))
    y = model.embedding(ids.t, w.t, v0, whole=w.t.shape[0] == op.weight.shape[0])
    if pos is not None:
        y = y + bias_share(pos.t, out)[model.positions(r0, r1 - r0, op.attr("seq_len"),
                                                       pos.t.device)]
    return LVal(y, out)


# -- convolutional ops -----------------------------------------------------------------------


def conv2d(ctx: StageContext, op: Op, lp: LayerPlan, xs: list[LVal], params: dict[str, LVal],
           data: dict) -> LVal:
    """The conv2d 3-D family (:func:`~ilp_planner.lowering.strategies.conv_layouts`): this rank's
    batch rows and input-channel block convolved with its weight block. The output is a
    partial sum over the input-channel axis (its bias added as shares, :func:`bias_share`);
    autograd of the local convolution leaves the input's gradient partial over the
    output-channel axis and the weight's over the batch axis — the layouts
    ``input_grad_layouts`` and ``param_layouts`` give, reduced by the edge program and the
    gradient buckets."""
    x, w, b = xs[0], params["weight"], params["bias"]
    want = conv_layouts(lp.output.fact)
    if (x.layout, w.layout, lp.output) != want:
        raise RuntimeSetupError(f"conv2d {op.name!r}: input {x.layout}, weight {w.layout} -> "
                                f"{lp.output} are not the conv family's {[str(v) for v in want]}")
    return LVal(model.conv2d(x.t, w.t, bias_share(b.t, lp.output)), lp.output)


def _whole_images(op: Op, lp: LayerPlan, xs: list[LVal]) -> Layout:
    """A pool or flatten runs on its local block alone: one partial-free layout in and out
    (the follower's), and the spatial dims whole on every device."""
    lay = _same_layout(op, lp, xs)
    if lay.split_degree(2) > 1 or lay.split_degree(3) > 1:
        raise RuntimeSetupError(f"{op.kind.value} {op.name!r} reads spatially split blocks {lay}; "
                                f"only batch and channel splits run locally")
    return lay


def pool(ctx: StageContext, op: Op, lp: LayerPlan, xs: list[LVal], params: dict[str, LVal],
         data: dict) -> LVal:
    """Max pooling (the IR's pool; VGG's): windows never cross a batch or channel block."""
    lay = _whole_images(op, lp, xs)
    return LVal(model.max_pool(xs[0].t, op.attr("kernel")), lay)


def flatten(ctx: StageContext, op: Op, lp: LayerPlan, xs: list[LVal], params: dict[str, LVal],
            data: dict) -> LVal:
    """Channel-major flatten: a block of whole channels is a block of columns of the
    flattened tensor, so the batch and channel splits carry over with no communication
    (:func:`ilp_planner.lowering.strategies.follow`)."""
    lay = _whole_images(op, lp, xs)
    return LVal(model.flatten(xs[0].t), lay)


# -- row-wise and elementwise ops ------------------------------------------------------------


def _same_layout(op: Op, lp: LayerPlan, xs: list[LVal]) -> Layout:
    lay = xs[0].layout
    if any(x.layout != lay for x in xs) or lp.output != lay:
        raise RuntimeSetupError(f"op {op.name!r} ({op.kind.value}) needs inputs and output in one "
                                f"layout; plan has {[str(x.layout) for x in xs]} -> {lp.output}")
    if lay.has_partial:
        raise RuntimeSetupError(f"op {op.name!r} ({op.kind.value}) cannot read partial sums {lay}")
    return lay


def layernorm(ctx: StageContext, op: Op, lp: LayerPlan, xs: list[LVal], params: dict[str, LVal],
              data: dict) -> LVal:
    lay = _same_layout(op, lp, xs)
    if lay.split_degree(1) > 1:
        raise RuntimeSetupError(f"layernorm {op.name!r} splits the normalised dim: {lay}")
    return LVal(model.layer_norm(xs[0].t, params["weight"].t, params["bias"].t), lay)


def rmsnorm(ctx: StageContext, op: Op, lp: LayerPlan, xs: list[LVal], params: dict[str, LVal],
            data: dict) -> LVal:
    lay = _same_layout(op, lp, xs)
    if lay.split_degree(1) > 1:
        raise RuntimeSetupError(f"rmsnorm {op.name!r} splits the normalised dim: {lay}")
    return LVal(model.rms_norm(xs[0].t, params["weight"].t), lay)


def attention(ctx: StageContext, op: Op, lp: LayerPlan, xs: list[LVal], params: dict[str, LVal],
              data: dict) -> LVal:
    lay = _same_layout(op, lp, xs)
    seq, heads = op.attr("seq_len"), op.attr("heads")
    k0, k1 = lay.split_degree(0), lay.split_degree(1)
    if (op.output.shape[0] // seq) % k0 or heads % k1 or op.attrs.get("kv_heads", heads) % k1:
        raise RuntimeSetupError(f"attention {op.name!r}: {lay} does not keep whole sequences and heads")
    kv = op.attrs.get("kv_heads", heads)
    return LVal(model.attention(xs[0].t, heads // k1, seq, op.attrs.get("rope_theta", 0),
                                kv // k1), lay)


def elementwise(ctx: StageContext, op: Op, lp: LayerPlan, xs: list[LVal], params: dict[str, LVal],
                data: dict) -> LVal:
    lay = _same_layout(op, lp, xs)
    return LVal(model.ELEMENTWISE[op.kind](xs[0].t), lay)


def add(ctx: StageContext, op: Op, lp: LayerPlan, xs: list[LVal], params: dict[str, LVal],
        data: dict) -> LVal:
    lay = _same_layout(op, lp, xs)
    return LVal(xs[0].t + xs[1].t, lay)


def mul(ctx: StageContext, op: Op, lp: LayerPlan, xs: list[LVal], params: dict[str, LVal],
        data: dict) -> LVal:
    """SwiGLU's product: both operands' blocks in the output's layout, none partial."""
    lay = _same_layout(op, lp, xs)
    return LVal(xs[0].t * xs[1].t, lay)


def loss(ctx: StageContext, op: Op, lp: LayerPlan, xs: list[LVal], params: dict[str, LVal],
         data: dict) -> LVal:
    """Mean cross-entropy, vocabulary-parallel when the class dim is split — the collectives
    of :func:`ilp_planner.lowering.strategies.loss_collectives`: the row max MAX-reduced,
    then the two per-row sums Σexp and the target logit in one AllReduce over the class
    axes (:class:`_CrossEntropy`); the mean over rows is a partial sum over the row axes,
    reduced asynchronously into the reported loss (``ctx.reports``) while autograd runs from
    this rank's part. None of these reductions has a backward collective."""
    (logits,) = xs
    lay = logits.layout
    if lay.has_partial:
        raise RuntimeSetupError(f"loss {op.name!r} reads partial sums {lay}")
    rows, classes = ctx.spec(op.inputs[0]).shape
    (r0, r1), (c0, c1) = ctx.region(lay, (rows, classes))
    targets = data[model.targets_key(op.name)][r0:r1]
    vocab, row_axes = loss_axes(lay)
    inside = (targets >= c0) & (targets < c1)
    idx = torch.where(inside, targets - c0, torch.zeros_like(targets))

    def reduce_max(m: torch.Tensor) -> torch.Tensor:
        return ctx.comm.all_reduce(m, lay, vocab, "forward", "loss", op.name,
                                   op=torch.distributed.ReduceOp.MAX) if vocab else m

    def reduce_sums(both: torch.Tensor) -> torch.Tensor:
        return ctx.comm.all_reduce(both, lay, vocab, "forward", "loss", op.name) if vocab else both

    part = _CrossEntropy.apply(logits.t, idx, inside, rows, reduce_max, reduce_sums)
    # the mean is a partial sum over the row axes; its gradient is replicated, so autograd
    # needs only this rank's part, and the AllReduce that completes the value only reports
    # it: launched now, waited at the step's end (no barrier between forward and backward)
    ctx.reports.append(ctx.comm.report(part, lay, row_axes, "forward", "loss", op.name)
                       if row_axes else Report(part.detach()))
    return LVal(part, lp.output)


class _CrossEntropy(torch.autograd.Function):
    """This rank's part of the mean cross-entropy over ``rows`` rows, from its block of
    logits (its rows, its classes), in float32, holding as little as Megatron-LM's
    vocabulary-parallel loss: ``e = exp(z − max)`` computed in place on one float32 copy of
    the logits and kept for the backward (4 bytes a logit), the logits themselves not kept;
    the backward turns ``e`` into the gradient in place — ``(e / Σe − onehot) · g / rows`` —
    and casts it to the logits' dtype. Passes over the logits: the copy, the max, ``− max``,
    ``exp``, the sum forward; one scaling and the cast backward (what
    :func:`ilp_planner.lowering.compute_model._loss_work` prices and
    :func:`ilp_planner.lowering.strategies.loss_memory` holds)."""

    @staticmethod
    def forward(ctx, logits, idx, inside, rows, reduce_max, reduce_sums):
        z = logits.float()
        if z.data_ptr() == logits.data_ptr():  # float32 logits: work on a copy
            z = z.clone()
        m = reduce_max(z.amax(dim=1))
        z.sub_(m[:, None])
        tgt = z.gather(1, idx[:, None]).squeeze(1) * inside.to(z.dtype)  # z_t − max, or 0
        z.exp_()
        both = reduce_sums(torch.stack([z.sum(dim=1), tgt]))
        se, tgt = both[0], both[1]
        ctx.save_for_backward(z, se, idx, inside)
        ctx.rows, ctx.dtype = rows, logits.dtype
        return ((torch.log(se) - tgt).sum() / rows).reshape(1)

    @staticmethod
    def backward(ctx, g):
        e, se, idx, inside = ctx.saved_tensors
        scale = g.reshape(()).float() / ctx.rows
        e.mul_(scale / se[:, None])  # the softmax, scaled
        hit = torch.arange(e.shape[0], device=e.device)
        e.index_put_((hit, idx), -scale * inside.to(e.dtype), accumulate=True)
        return e.to(ctx.dtype), None, None, None, None, None


OpFn = Callable[[StageContext, Op, LayerPlan, list[LVal], dict[str, LVal], dict], LVal]
OPS: dict[OpKind, OpFn] = {
    OpKind.LINEAR: linear,
    OpKind.EMBEDDING: embedding,
    OpKind.LAYERNORM: layernorm,
    OpKind.RMSNORM: rmsnorm,
    OpKind.SILU: elementwise,
    OpKind.MUL: mul,
    OpKind.ATTENTION: attention,
    OpKind.GELU: elementwise,
    OpKind.RELU: elementwise,
    OpKind.DROPOUT: elementwise,
    OpKind.ADD: add,
    OpKind.LOSS: loss,
    OpKind.CONV2D: conv2d,
    OpKind.POOL: pool,
    OpKind.FLATTEN: flatten,
    OpKind.MOE: moe.moe,
}
