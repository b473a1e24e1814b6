"""Distributed ops: each computes on local shards and wraps its output in the planned layout.

Every function takes the op, its :class:`~ilp_planner.plan.LayerPlan`, the input values
already in the planned input layouts, and the op's parameters (DTensors in their planned
layouts), and returns the output :class:`~runtime.comm.DVal` in ``LayerPlan.output``.

Gradient placements. ``DTensor.to_local(grad_placements=…)`` states what the local gradient
of a shard *means*. For ``Y = X W`` the per-axis rule is (AutoDDL §4.2.2 and SUMMA)::

    X      W      → Y      dX     dW
    S(0)   B        S(0)   S(0)   P     rows split: W's gradient is a partial sum
    B      S(1)     S(1)   P      S(1)  columns split: X's gradient is a partial sum
    S(1)   S(0)     P      S(1)   S(0)  contraction split: Y is a partial sum
    B      B        B      B      B

so a weight replicated over p0 gets a partial gradient there, synchronised (AllReduce)
before the optimizer step — AutoDDL §4.4.1's weight-gradient synchronisation. A bias (and an
embedding's position table) is added by one device per partial-sum group only (coordinate 0
on every P axis; the others add it times 0 so every rank runs the same autograd graph); its
gradient is partial over the row-splitting and the P axes. Layernorm gains are replicated
and their gradients partial over the axes splitting tokens.

Size-1 mesh axes carry no data distribution: gradients keep the forward placement there, so
no collective over a one-rank group is ever issued.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor import Partial as TPartial

from ilp_planner.cluster import axis_coordinates
from ilp_planner.graph import Graph, Op, OpKind, TensorSpec
from ilp_planner.layouts import B, Broadcast, Layout, P, Partial, Split
from ilp_planner.plan import LayerPlan
from runtime import model
from runtime.comm import Comm, DVal, settle
from runtime.errors import RuntimeSetupError
from runtime.plans import device_regions


@dataclass
class StageContext:
    """What an op needs from its stage: devices, this rank, the communication layer."""

    index: int
    devices: tuple[int, ...]
    rank: int
    comm: Comm
    graph: Graph

    def spec(self, name: str) -> TensorSpec:
        return self.graph[name].output

    @property
    def device_index(self) -> int:
        return self.devices.index(self.rank)

    def coords(self, layout: Layout) -> np.ndarray:
        return axis_coordinates(layout.fact)[self.device_index]

    def first_on(self, layout: Layout, axes: tuple[int, ...]) -> bool:
        c = self.coords(layout)
        return all(int(c[a]) == 0 for a in axes)

    def region(self, layout: Layout, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
        return device_regions(layout, shape)[self.device_index]

    def wrap(self, local: torch.Tensor, layout: Layout, shape: tuple[int, ...]) -> DTensor:
        return DTensor.from_local(local, self.comm.mesh(layout), tuple(layout.to_dtensor()),
                                  run_check=False, shape=torch.Size(shape), stride=_stride(shape))


def _stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def _dt(pl) -> object:
    if isinstance(pl, Split):
        return Shard(pl.dim)
    if isinstance(pl, Broadcast):
        return Replicate()
    return TPartial()


def _grads(layout: Layout, placements: list) -> tuple:
    """DTensor gradient placements; on size-1 axes the forward placement (never P) is kept."""
    out = []
    for i, pl in enumerate(placements):
        if layout.fact[i].size == 1:
            fw = layout.placements[i]
            out.append(Shard(fw.dim) if isinstance(fw, Split) else Replicate())
        else:
            out.append(_dt(pl))
    return tuple(out)


def _local(v: DVal, grad: list | None = None) -> torch.Tensor:
    """The local shard of ``v``; ``grad`` says what its gradient means (default: the
    layout's placements, partial sums read as replicas)."""
    settle(v.dt)
    pls = grad if grad is not None else [B if isinstance(p, Partial) else p
                                         for p in v.layout.placements]
    return v.dt.to_local(grad_placements=_grads(v.layout, pls))


def _param_local(p: DTensor, layout: Layout, grad: list) -> torch.Tensor:
    return p.to_local(grad_placements=_grads(layout, grad))


# -- matmul family ---------------------------------------------------------------------------


def matmul_placements(op: Op, x: Layout, w: Layout) -> tuple[list, list, list]:
    """Per-axis (output, dX, dW) placements of ``X W`` (table in the module docstring).
    For an embedding, X is the (tokens,) id vector standing for the one-hot matrix."""
    out, gx, gw = [], [], []
    ids = op.kind is OpKind.EMBEDDING
    for a, (pi, pw) in enumerate(zip(x.placements, w.placements, strict=True)):
        rows = pi == Split(0)
        cols = pi == Split(1) if not ids else False
        if rows and pw == B:
            out.append(Split(0)); gx.append(pi); gw.append(P)  # noqa: E702
        elif pi == B and pw == Split(1):
            out.append(Split(1)); gx.append(P); gw.append(pw)  # noqa: E702
        elif (cols or (ids and pi == B)) and pw == Split(0):
            out.append(P); gx.append(pi); gw.append(pw)  # noqa: E702
        elif pi == B and pw == B:
            out.append(B); gx.append(B); gw.append(B)  # noqa: E702
        else:
            raise RuntimeSetupError(
                f"op {op.name!r}: mesh axis {a} pairs input {pi} with weight {pw}; the runtime "
                f"executes the 3-D family (S0,B)/(B,S1)/(S1,S0) and SUMMA only")
    return out, gx, gw


def bias_layout(out: Layout, dim: int = 0) -> Layout:
    """A bias-like vector along the output's last dim: split where the output columns are."""
    return Layout(out.fact, tuple(Split(dim) if pl == Split(1) else B for pl in out.placements))


def _bias_grads(out: Layout, dim: int = 0) -> list:
    return [P if (pl == Split(0) or isinstance(pl, Partial)) else
            (Split(dim) if pl == Split(1) else B) for pl in out.placements]


def is_summa(lp: LayerPlan) -> bool:
    return lp.strategy.startswith("summa")


def summa_compute_layouts(lp: LayerPlan) -> tuple[Layout, Layout]:
    """SUMMA gathers I along the column axis and W along the row axis before multiplying."""
    f = lp.output.fact
    return Layout(f, (Split(0), B)), Layout(f, (B, Split(1)))


def linear(ctx: StageContext, op: Op, lp: LayerPlan, xs: list[DVal], params: dict[str, DVal],
           data: dict) -> DVal:
    x, w = xs[0], params["weight"]
    assert op.weight is not None
    if is_summa(lp):
        xc, wc = summa_compute_layouts(lp)
        x = ctx.comm.to_layout(x, xc, ctx.spec(op.inputs[0]), op.name)
        w = ctx.comm.redistribute(w, wc, op.name, "activation")
    out_pl, gx, gw = matmul_placements(op, x.layout, w.layout)
    out = Layout(x.layout.fact, tuple(out_pl))
    if out != lp.output:
        raise RuntimeSetupError(f"op {op.name!r}: layouts {x.layout} × {w.layout} give {out}, "
                                f"the plan says {lp.output}")
    y = _local(x, gx) @ _param_local(w.dt, w.layout, gw)
    if "bias" in params:
        b = params["bias"]
        keep = 1.0 if ctx.first_on(out, out.partial_axes) else 0.0
        y = y + _param_local(b.dt, b.layout, _bias_grads(out)) * keep
    return DVal(ctx.wrap(y, out, op.output.shape), out)


def embedding(ctx: StageContext, op: Op, lp: LayerPlan, xs: list[DVal], params: dict[str, DVal],
              data: dict) -> DVal:
    ids, w, pos = xs[0], params["weight"], params["pos"]
    out_pl, _, gw = matmul_placements(op, ids.layout, w.layout)
    out = Layout(ids.layout.fact, tuple(out_pl))
    if out != lp.output:
        raise RuntimeSetupError(f"op {op.name!r}: layouts give {out}, the plan says {lp.output}")
    (v0, _), _ = ctx.region(w.layout, op.weight.shape)
    (r0, r1), = ctx.region(ids.layout, (op.output.shape[0],))
    y = model.embedding(_local(ids), _param_local(w.dt, w.layout, gw), v0)
    keep = 1.0 if ctx.first_on(out, out.partial_axes) else 0.0
    table = _param_local(pos.dt, pos.layout, _bias_grads(out, 1))
    y = y + table[model.positions(r0, r1 - r0, op.attr("seq_len"), table.device)] * keep
    return DVal(ctx.wrap(y, out, op.output.shape), out)


# -- row-wise and elementwise ops ------------------------------------------------------------


def _same_layout(op: Op, lp: LayerPlan, xs: list[DVal]) -> Layout:
    lay = xs[0].layout
    if any(x.layout != lay for x in xs) or lp.output != lay:
        raise RuntimeSetupError(f"op {op.name!r} ({op.kind.value}) needs inputs and output in one "
                                f"layout; plan has {[str(x.layout) for x in xs]} -> {lp.output}")
    if lay.has_partial:
        raise RuntimeSetupError(f"op {op.name!r} ({op.kind.value}) cannot read partial sums {lay}")
    return lay


def layernorm(ctx: StageContext, op: Op, lp: LayerPlan, xs: list[DVal], params: dict[str, DVal],
              data: dict) -> DVal:
    lay = _same_layout(op, lp, xs)
    if lay.split_degree(1) > 1:
        raise RuntimeSetupError(f"layernorm {op.name!r} splits the normalised dim: {lay}")
    g = [P if pl == Split(0) else B for pl in lay.placements]
    y = model.layer_norm(_local(xs[0]), _param_local(params["weight"].dt, params["weight"].layout, g),
                         _param_local(params["bias"].dt, params["bias"].layout, g))
    return DVal(ctx.wrap(y, lay, op.output.shape), lay)


def attention(ctx: StageContext, op: Op, lp: LayerPlan, xs: list[DVal], params: dict[str, DVal],
              data: dict) -> DVal:
    lay = _same_layout(op, lp, xs)
    seq, heads = op.attr("seq_len"), op.attr("heads")
    k0, k1 = lay.split_degree(0), lay.split_degree(1)
    if (op.output.shape[0] // seq) % k0 or heads % k1:
        raise RuntimeSetupError(f"attention {op.name!r}: {lay} does not keep whole sequences and heads")
    y = model.attention(_local(xs[0]), heads // k1, seq)
    return DVal(ctx.wrap(y, lay, op.output.shape), lay)


def elementwise(ctx: StageContext, op: Op, lp: LayerPlan, xs: list[DVal], params: dict[str, DVal],
                data: dict) -> DVal:
    lay = _same_layout(op, lp, xs)
    y = model.ELEMENTWISE[op.kind](_local(xs[0]))
    return DVal(ctx.wrap(y, lay, op.output.shape), lay)


def add(ctx: StageContext, op: Op, lp: LayerPlan, xs: list[DVal], params: dict[str, DVal],
        data: dict) -> DVal:
    lay = _same_layout(op, lp, xs)
    y = _local(xs[0]) + _local(xs[1])
    return DVal(ctx.wrap(y, lay, op.output.shape), lay)


def loss(ctx: StageContext, op: Op, lp: LayerPlan, xs: list[DVal], params: dict[str, DVal],
         data: dict) -> DVal:
    """Mean cross-entropy, vocabulary-parallel when the class dim is split: the row max
    (detached) and then the two per-row sums Σexp and the target logit are reduced over the
    class-splitting axes in one AllReduce; the mean over rows is a partial sum over the
    row-splitting axes, reduced into the replicated scalar."""
    (logits,) = xs
    lay = logits.layout
    if lay.has_partial:
        raise RuntimeSetupError(f"loss {op.name!r} reads partial sums {lay}")
    rows, classes = ctx.spec(op.inputs[0]).shape
    (r0, r1), (c0, c1) = ctx.region(lay, (rows, classes))
    targets = data[model.targets_key(op.name)][r0:r1]
    z = _local(logits)
    mesh = ctx.comm.mesh(lay)
    vocab_axes = tuple(a for a in lay.split_axes(1) if lay.fact[a].size > 1)
    row_axes = tuple(a for a in lay.split_axes(0) if lay.fact[a].size > 1)
    m = z.detach().amax(dim=1)
    for a in vocab_axes:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=mesh.get_group(a))
    se = torch.exp(z - m[:, None]).sum(dim=1)
    inside = (targets >= c0) & (targets < c1)
    idx = torch.where(inside, targets - c0, torch.zeros_like(targets))
    tgt = z.gather(1, idx[:, None]).squeeze(1) * inside.to(z.dtype)
    if vocab_axes:
        both = torch.stack([se, tgt])  # (2, local rows): one AllReduce for both sums
        pl = tuple(P if a in vocab_axes else (Split(1) if a in row_axes else B)
                   for a in range(len(lay.fact)))
        sl = Layout(lay.fact, pl)
        dv = DVal(ctx.wrap(both, sl, (2, rows)), sl)
        red = Layout(lay.fact, tuple(B if a in vocab_axes else p for a, p in enumerate(pl)))
        both = _local(ctx.comm.redistribute(dv, red, op.name, "activation"))
        se, tgt = both[0], both[1]
    part = ((torch.log(se) + m - tgt).sum() / rows).reshape(1)
    pl = tuple(P if a in row_axes else B for a in range(len(lay.fact)))
    sl = Layout(lay.fact, pl)
    out = DVal(ctx.wrap(part, sl, (1,)), sl)
    if row_axes:
        out = ctx.comm.redistribute(out, lp.output, op.name, "loss")
    elif out.layout != lp.output:
        out = DVal(out.dt, lp.output)
    return out


OpFn = Callable[[StageContext, Op, LayerPlan, list[DVal], dict[str, DVal], dict], DVal]
OPS: dict[OpKind, OpFn] = {
    OpKind.LINEAR: linear,
    OpKind.EMBEDDING: embedding,
    OpKind.LAYERNORM: layernorm,
    OpKind.ATTENTION: attention,
    OpKind.GELU: elementwise,
    OpKind.RELU: elementwise,
    OpKind.DROPOUT: elementwise,
    OpKind.ADD: add,
    OpKind.LOSS: loss,
}


def param_layouts(op: Op, lp: LayerPlan) -> dict[str, Layout]:
    """Planned layout of each parameter of ``op`` (by role)."""
    if op.kind is OpKind.LINEAR:
        assert lp.weight is not None
        out = {"weight": lp.weight}
        if op.attrs.get("bias"):
            out["bias"] = bias_layout(lp.output)
        return out
    if op.kind is OpKind.EMBEDDING:
        assert lp.weight is not None
        return {"weight": lp.weight, "pos": bias_layout(lp.output, 1)}
    if op.kind is OpKind.LAYERNORM:
        rep = Layout.replicated(lp.inputs[0].fact)
        return {"weight": rep, "bias": rep}
    return {}
