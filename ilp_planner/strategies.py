"""Per-op sharding strategies: layouts of inputs, weight and output on a mesh, plus the
compute time, intra-op collectives and per-device memory each implies.

Linear / matmul / embedding use AutoDDL's 3-D family (§4.2.2) on every ordered
factorisation ``p0·p1·p2`` of the mesh, each axis a (nodes, local) pair (§4.2.3)::

    I (S0:p0, B:p1, S1:p2) × W (B:p0, S1:p1, S0:p2) → O (S0:p0, S1:p1, P:p2)

Data parallel is ``p1 = p2 = 1``; Megatron column-parallel ``p2 = 1``, row-parallel
``p1 = 1``. The weight gradient is partial over axis 0 (rows of I are split there), so it
is AllReduced over p0 in the backward pass (AutoDDL §4.4.1). A linear also has 2-D SUMMA
strategies on an ``r × c`` mesh: I, W, O all ``(S0:r, S1:c)``; forward AllGathers I along
c and W along r, backward ReduceScatters dI along c and dW along r.

Other ops: layernorm / softmax keep the last dim whole (tokens split or replicated);
attention splits over batch (dim 0, whole sequences) and heads (dim 1); add takes any
partial-free layout for both inputs; conv2d is the 3-D family over (batch, out-channels,
in-channels); elementwise ops, pooling, flatten and the loss *follow* their producer (they
are merged into it before solving, see :mod:`formulations.sbp_problem`).

Every op's activation memory is its output shard (what its consumers keep for backward);
state memory is its parameter shard × bytes per parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ilp_planner.cluster import Cluster, Factorisation, fact_str, mesh_factorisations
from ilp_planner.cost_model import (
    Collective,
    CollectiveKind,
    MemorySpec,
    compute_time,
    make_collective,
)
from ilp_planner.graph import Op, OpKind, TensorSpec
from ilp_planner.layouts import B, Layout, P, Placement, Split

FOLLOWER_KINDS = frozenset(
    {OpKind.GELU, OpKind.RELU, OpKind.DROPOUT, OpKind.POOL, OpKind.FLATTEN, OpKind.LOSS}
)


@dataclass(frozen=True)
class Strategy:
    """One way to run an op: layouts, costs and the collectives issued inside the op."""

    label: str
    fact: Factorisation
    inputs: tuple[Layout, ...]
    weight: Layout | None
    output: Layout
    compute_s: float
    collectives: tuple[Collective, ...]
    state_bytes: float
    activation_bytes: float

    @property
    def comm_s(self) -> float:
        return sum(c.seconds for c in self.collectives)

    @property
    def cost_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def memory_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes

    def describe(self) -> str:
        ins = ", ".join(str(x) for x in self.inputs)
        w = f" W{self.weight}" if self.weight is not None else ""
        return f"{self.label} on {fact_str(self.fact)}: I[{ins}]{w} -> O{self.output}"


@dataclass(frozen=True)
class StrategyContext:
    """What strategy generation needs besides the op: the mesh shape, the cluster's links
    and speeds, bytes per parameter, and the AutoDDL p0 cap."""

    cluster: Cluster
    nodes: int
    local: int
    memory: MemorySpec
    max_weight_replication: int | None = None

    @property
    def devices(self) -> int:
        return self.nodes * self.local


def _three_axis(ctx: StrategyContext) -> tuple[Factorisation, ...]:
    return mesh_factorisations(ctx.nodes, ctx.local, 3)


def _two_axis(ctx: StrategyContext) -> tuple[Factorisation, ...]:
    return mesh_factorisations(ctx.nodes, ctx.local, 2)


def _compute(op: Op, split: float, ctx: StrategyContext) -> float:
    """Forward + backward (≈ 3 × forward FLOPs) on ``1/split`` of the work."""
    return compute_time(3.0 * op.flops / split, ctx.cluster)


def _coll(kind: CollectiveKind, fact: Factorisation, axes: tuple[int, ...], nbytes: float,
          ctx: StrategyContext, phase: str, purpose: str) -> Collective:
    size = math.prod(fact[a].size for a in axes)
    spans = any(fact[a].nodes > 1 for a in axes)
    return make_collective(kind, size, nbytes, ctx.cluster, spans, axes, phase, purpose)


def _grad_sync(op: Op, fact: Factorisation, axes: tuple[int, ...], local_params: float,
               ctx: StrategyContext) -> tuple[Collective, ...]:
    """AllReduce of a weight gradient over the axes where the weight is replicated."""
    axes = tuple(a for a in axes if fact[a].size > 1)
    if not axes or local_params <= 0:
        return ()
    itemsize = op.weight.itemsize if op.weight is not None else op.output.itemsize
    return (_coll(CollectiveKind.ALL_REDUCE, fact, axes, local_params * itemsize, ctx,
                  "backward", "grad_sync"),)


def _matmul_family(op: Op, inputs: list[TensorSpec], ctx: StrategyContext) -> list[Strategy]:
    """AutoDDL's 3-D family and the SUMMA strategies for ``I (M,K) × W (K,N)``.

    For an embedding, I is the (tokens, vocab) one-hot matrix: the token ids are split like
    I's rows and the vocabulary split (p2) yields a partial-sum output (masked lookup).
    For a matmul of two activations, W is the second input: no parameters, no gradient
    synchronisation, and W's layout becomes an input layout.
    """
    weight = inputs[1] if op.kind is OpKind.MATMUL else op.weight
    assert weight is not None
    m = op.output.shape[0]
    k, n = weight.shape[0], weight.shape[1]
    is_embedding = op.kind is OpKind.EMBEDDING
    is_matmul = op.kind is OpKind.MATMUL
    out: list[Strategy] = []
    for fact in _three_axis(ctx):
        p0, p1, p2 = (a.size for a in fact)
        if m % p0 or k % p2 or n % p1:
            continue
        if ctx.max_weight_replication is not None and p0 > ctx.max_weight_replication:
            continue
        if is_embedding:
            i_layout = Layout(fact, (Split(0), B, B))
        else:
            i_layout = Layout(fact, (Split(0), B, Split(1)))
        w_layout = Layout(fact, (B, Split(1), Split(0)))
        o_layout = Layout(fact, (Split(0), Split(1), P))
        local_params = op.params / (p1 * p2)
        colls = () if op.attrs.get("tied") else _grad_sync(op, fact, (0,), local_params, ctx)
        ins = (i_layout, w_layout) if is_matmul else (i_layout,)
        out.append(Strategy(
            f"3d(p0={fact[0]},p1={fact[1]},p2={fact[2]})", fact, ins,
            None if is_matmul else w_layout, o_layout,
            _compute(op, p0 * p1 * p2, ctx), colls,
            local_params * ctx.memory.bytes_per_param,
            o_layout.local_bytes(op.output),
        ))
    if not is_embedding and not is_matmul:
        out.extend(_summa(op, inputs[0], ctx))
    return out


def _summa(op: Op, in_tensor: TensorSpec, ctx: StrategyContext) -> list[Strategy]:
    assert op.weight is not None
    m = op.output.shape[0]
    k, n = op.weight.shape
    out = []
    for fact in _two_axis(ctx):
        r, c = (a.size for a in fact)
        if r == 1 or c == 1 or m % r or k % c or k % r or n % c:
            continue
        lay = Layout(fact, (Split(0), Split(1)))
        i_bytes = in_tensor.nbytes / r  # I[i, :] after the row AllGather
        w_bytes = op.weight.nbytes / c  # W[:, j] after the column AllGather
        colls = (
            _coll(CollectiveKind.ALL_GATHER, fact, (1,), i_bytes, ctx, "forward", "activation"),
            _coll(CollectiveKind.ALL_GATHER, fact, (0,), w_bytes, ctx, "forward", "activation"),
            _coll(CollectiveKind.REDUCE_SCATTER, fact, (1,), i_bytes, ctx, "backward", "activation"),
            _coll(CollectiveKind.REDUCE_SCATTER, fact, (0,), w_bytes, ctx, "backward", "grad_sync"),
        )
        local_params = op.params / (r * c)
        out.append(Strategy(
            f"summa({fact[0]}x{fact[1]})", fact, (lay,), lay, lay, _compute(op, r * c, ctx), colls,
            local_params * ctx.memory.bytes_per_param + (i_bytes + w_bytes),
            lay.local_bytes(op.output),
        ))
    return out


def _conv_family(op: Op, ctx: StrategyContext) -> list[Strategy]:
    """3-D family for conv2d: batch split p0, output channels p1, input channels p2."""
    assert op.weight is not None
    nb, cin = op.output.shape[0], op.weight.shape[1]
    cout = op.weight.shape[0]
    out = []
    for fact in _three_axis(ctx):
        p0, p1, p2 = (a.size for a in fact)
        if nb % p0 or cout % p1 or cin % p2:
            continue
        if ctx.max_weight_replication is not None and p0 > ctx.max_weight_replication:
            continue
        i_layout = Layout(fact, (Split(0), B, Split(1)))
        w_layout = Layout(fact, (B, Split(0), Split(1)))
        o_layout = Layout(fact, (Split(0), Split(1), P))
        local_params = op.params / (p1 * p2)
        out.append(Strategy(
            f"conv3d(p0={fact[0]},p1={fact[1]},p2={fact[2]})", fact, (i_layout,), w_layout,
            o_layout, _compute(op, p0 * p1 * p2, ctx),
            _grad_sync(op, fact, (0,), local_params, ctx),
            local_params * ctx.memory.bytes_per_param, o_layout.local_bytes(op.output),
        ))
    return out


def _unique(layouts: list[Layout]) -> list[Layout]:
    """Drop layouts holding exactly the same data per device as an earlier one."""
    seen: dict[tuple, Layout] = {}
    for lay in layouts:
        seen.setdefault(lay.canonical_key(), lay)
    return list(seen.values())


def candidate_layouts(tensor: TensorSpec, ctx: StrategyContext, dims: tuple[int, ...],
                      divisors: dict[int, int] | None = None) -> list[Layout]:
    """Partial-free layouts on two-axis factorisations splitting only ``dims`` (each split
    degree must divide ``divisors[d]``, default the tensor's size along d)."""
    opts: list[Placement] = [B] + [Split(d) for d in dims]
    out = []
    for fact in _two_axis(ctx):
        for a in opts:
            for b in opts:
                lay = Layout(fact, (a, b))
                if all((divisors or {}).get(d, tensor.shape[d]) % lay.split_degree(d) == 0
                       for d in range(tensor.rank)):
                    out.append(lay)
    return _unique(out)


def _layout_strategies(op: Op, layouts: list[Layout], n_inputs: int,
                       ctx: StrategyContext) -> list[Strategy]:
    """Ops whose inputs and output share one layout (attention maps (T,3h) to (T,h) with
    the same placements)."""
    out = []
    for lay in layouts:
        split = math.prod(lay.split_degree(d) for d in range(op.output.rank))
        state = op.params * ctx.memory.bytes_per_param
        colls: tuple[Collective, ...] = ()
        if op.params:
            token_axes = tuple(i for i, pl in enumerate(lay.placements) if pl == Split(0))
            colls = _grad_sync(op, lay.fact, token_axes, op.params, ctx)
        out.append(Strategy(
            lay.sbp(), lay.fact, tuple(lay for _ in range(n_inputs)), None, lay,
            _compute(op, split, ctx), colls, state, lay.local_bytes(op.output),
        ))
    return out


def op_strategies(op: Op, inputs: list[TensorSpec], ctx: StrategyContext) -> list[Strategy]:
    """All strategies of a non-follower op on the context's mesh."""
    kind = op.kind
    if kind in (OpKind.LINEAR, OpKind.EMBEDDING, OpKind.MATMUL):
        return _matmul_family(op, inputs, ctx)
    if kind is OpKind.CONV2D:
        return _conv_family(op, ctx)
    if kind in (OpKind.LAYERNORM, OpKind.SOFTMAX):
        return _layout_strategies(op, candidate_layouts(op.output, ctx, (0,)), 1, ctx)
    if kind is OpKind.ATTENTION:
        seq = op.attr("seq_len")
        divs = {0: op.output.shape[0] // seq, 1: op.attr("heads")}
        return _layout_strategies(op, candidate_layouts(op.output, ctx, (0, 1), divs),
                                  len(op.inputs), ctx)
    if kind is OpKind.ADD:
        return _layout_strategies(
            op, candidate_layouts(op.output, ctx, tuple(range(op.output.rank))), len(op.inputs), ctx)
    raise ValueError(f"op {op.name!r} of kind {kind.value} has no standalone strategies")


def follow(op: Op, in_tensor: TensorSpec, in_layout: Layout,
           ctx: StrategyContext) -> tuple[Layout, tuple[Collective, ...], float]:
    """A follower's (output layout, collectives, compute seconds) given its producer's
    partial-free output layout, which is also the follower's input layout.

    Elementwise, pooling: same layout. Flatten (N,C,H,W)→(N,C·H·W): batch and channel
    splits carry over (channels are the major part of the flattened dim). Loss: a split
    class dim needs the softmax statistics AllReduced over those axes (vocab-parallel
    cross-entropy, two floats per row).
    """
    split = math.prod(in_layout.split_degree(d) for d in range(in_tensor.rank))
    if op.kind is OpKind.LOSS:
        colls: tuple[Collective, ...] = ()
        axes = tuple(a for a in in_layout.split_axes(in_tensor.rank - 1) if in_layout.fact[a].size > 1)
        if axes:
            rows = in_layout.local_shape(in_tensor.shape)[0]
            colls = (_coll(CollectiveKind.ALL_REDUCE, in_layout.fact, axes, 2.0 * rows * 4, ctx,
                           "forward", "activation"),)
        return Layout.replicated(in_layout.fact), colls, _compute(op, split, ctx)
    if op.kind is OpKind.FLATTEN:
        if any(isinstance(pl, Split) and pl.dim > 1 for pl in in_layout.placements):
            raise ValueError(f"flatten {op.name!r} cannot follow a spatially split layout "
                             f"{in_layout}; only batch and channel splits carry over")
        return in_layout, (), 0.0
    return in_layout, (), _compute(op, split, ctx)


def resolve_partial(layout: Layout, tensor: TensorSpec) -> Layout:
    """The layout a follower sees: each partial axis reduce-scattered onto the feature dim
    (the last dim of a 2-D activation, the channel dim of an (N, C, H, W) feature map, then
    the batch dim) when it still divides, else all-reduced — the cheapest reduction that
    keeps the data split, never splitting the spatial dims no strategy accepts."""
    if not layout.has_partial:
        return layout
    order = (1, 0) if tensor.rank > 2 else tuple(reversed(range(tensor.rank)))
    pls = list(layout.placements)
    for a in layout.partial_axes:
        cur = Layout(layout.fact, tuple(pls))
        target: Placement = B
        for d in order:
            if tensor.shape[d] % (cur.split_degree(d) * layout.fact[a].size) == 0:
                target = Split(d)
                break
        pls[a] = target
    return Layout(layout.fact, tuple(pls))
