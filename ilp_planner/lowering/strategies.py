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
attention splits over batch (dim 0, whole sequences) and heads (dim 1), both at once
(Megatron's DP × TP) but where ``attrs.one_split`` is set (an imported model's hand-written
attention: it runs under DTensor, whose 4-D matmul cannot always merge a batch split with a
head split; imported SDPA runs on each rank's blocks, :mod:`runtime.local_attention`). An
attention adding a learned position bias (``attrs.bias_table``: T5's relative position
buckets, one table per stack read by every layer of it) splits the batch or the heads on every
mesh axis, so the devices' blocks partition (batch × heads) and the table's replicated
gradient is exact after one AllReduce over all of them; the op owning the table
(``attrs.bias_buckets``: its rows) holds it as the parameter ``rel_bias``. Add
takes any
partial-free layout for both inputs; conv2d is the 3-D family over (batch, out-channels,
in-channels); batch norm splits its batch, its channels or both (synchronised batch norm
over the batch axes, :func:`batchnorm_collectives`); elementwise ops, pooling, flatten and
the loss *follow* their producer (they are merged into it before solving, see
:mod:`ilp_planner.intra_op.problem`).

Every op's activation memory is its output shard (what its consumers keep for backward);
state memory is its parameter shard × bytes per parameter. Compute is priced on the local
shard (:func:`_compute`): the 3-D family's matmul is ``(m/p0) × (k/p2) × (n/p1)`` per device,
SUMMA's ``(m/r) × k × (n/c)`` after its gathers — what the roofline's size curve reads.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ilp_planner.errors import ConfigError, LayoutError
from ilp_planner.ir.cluster import Cluster, Factorisation, MeshAxis, fact_str, mesh_factorisations
from ilp_planner.ir.graph import (
    Op,
    OpKind,
    TensorSpec,
    opaque_param_sizes,
    position_tables,
)
from ilp_planner.ir.layouts import B, Layout, P, Partial, Placement, Split
from ilp_planner.lowering.compute_model import (
    LOSS_ITEMSIZE,
    MASTER_ITEMSIZE,
    GemmShape,
    PhaseWork,
    op_times_replayed,
    phase_seconds,
)
from ilp_planner.lowering.cost_model import (
    Collective,
    CollectiveKind,
    MemorySpec,
    compute_time,
    make_collective,
)
from ilp_planner.lowering.moe_strategies import (
    expert_parallel,
    moe_activation_bytes,
    moe_candidates,
    moe_collectives,
    moe_flops,
    moe_label,
    moe_layouts,
    moe_param_layouts,
    moe_param_shapes,
)
from ilp_planner.lowering.redistribution import Redistribution, plan_redistribution, planner_for

FOLLOWER_KINDS = frozenset(
    {OpKind.GELU, OpKind.RELU, OpKind.SILU, OpKind.DROPOUT, OpKind.POOL, OpKind.FLATTEN,
     OpKind.LOSS, OpKind.PART}
)
NORM_KINDS = (OpKind.LAYERNORM, OpKind.RMSNORM)


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
    input_grads: tuple[Layout, ...] = ()
    input_backward: tuple[Collective, ...] = ()  # op-internal, only if input 0 needs a gradient
    zero: int = 0  # state sharding level over the gradient-sync group (:func:`state_sharded`)
    transient_bytes: float = 0.0  # held only while the op runs (gathered weights, full grads)
    # ZeRO-3 (memory-model bytes, n·w): the weights the forward gathers, and those the
    # backward gathers again for the input's gradient (that gather is in ``input_backward``)
    # — what a recomputed op keeps from its recomputation's gather instead
    # (:func:`ilp_planner.intra_op.problem.recomputed`)
    gathered_bytes: float = 0.0
    regathered_bytes: float = 0.0
    # what a recomputation runs again: the forward (its share of ``compute_s``) with the
    # replay's host time (``ComputeFit.replay_s``); None: a third of ``compute_s``
    # (backward = 2 × forward FLOPs), the flat model's split
    replay_s: float | None = None
    # parameters of the local optimizer-state shard: what one optimizer step updates
    update_params: float = 0.0

    def __hash__(self) -> int:
        # once per strategy: the build caches key every member's options by strategy
        h = self.__dict__.get("_hash")
        if h is None:
            h = self.__dict__["_hash"] = hash(tuple(
                getattr(self, f.name) for f in dataclasses.fields(self)))
        return h

    @property
    def replay_compute_s(self) -> float:
        return self.compute_s / 3 if self.replay_s is None else self.replay_s

    @property
    def grads_of_inputs(self) -> tuple[Layout, ...]:
        """The layout the op's backward hands each input's gradient back in (partial
        where its local backward yields partial sums); the edge programs start there."""
        return self.input_grads or self.inputs

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
    and speeds, bytes per parameter, and the AutoDDL p0 cap. ``facts``: the only three-axis
    factorisations a matmul, embedding or convolution is enumerated on (None: all) — a
    baseline member's build, which drops every other (on 128 × 8 devices, 2 of 360); each
    strategy is made on its own factorisation, so the list is the whole one's filtered."""

    cluster: Cluster
    nodes: int
    local: int
    memory: MemorySpec
    max_weight_replication: int | None = None
    zero_levels: tuple[int, ...] = (0,)
    facts: frozenset[Factorisation] | None = None

    @property
    def devices(self) -> int:
        return self.nodes * self.local


def _three_axis(ctx: StrategyContext) -> tuple[Factorisation, ...]:
    every = mesh_factorisations(ctx.nodes, ctx.local, 3)
    return every if ctx.facts is None else tuple(f for f in every if f in ctx.facts)


def _two_axis(ctx: StrategyContext) -> tuple[Factorisation, ...]:
    return mesh_factorisations(ctx.nodes, ctx.local, 2)


def _compute(op: Op, split: float, ctx: StrategyContext, gemm: GemmShape | None = None,
             read: TensorSpec | None = None) -> float:
    """Forward + backward seconds on ``1/split`` of the work: ``3 × FLOPs`` at the flat
    rate, or the roofline (:mod:`~ilp_planner.lowering.compute_model`) where the cluster
    names a device — ``gemm`` the local matmul sizes under the strategy, ``read`` the
    tensor the op reads where it is not its output's shape."""
    return _priced(op, split, ctx, gemm, read)["compute_s"]


def _priced(op: Op, split: float, ctx: StrategyContext, gemm: GemmShape | None = None,
            read: TensorSpec | None = None) -> dict[str, float]:
    """:class:`Strategy` keywords ``compute_s`` (:func:`_compute`) and ``replay_s``."""
    if ctx.cluster.device is None and not (op.frozen or op.no_grad):
        total = compute_time(3.0 * op.flops / split, ctx.cluster)  # the flat model, bit for bit
        return {"compute_s": total, "replay_s": total / 3}
    fwd, bwd, replay = op_times_replayed(op, split, ctx.cluster, gemm, read)
    return {"compute_s": fwd + bwd, "replay_s": replay}


def _plus(priced: dict[str, float], compute_s: float, replay_s: float) -> dict[str, float]:
    """``priced`` (:func:`_priced`'s keywords) with seconds a strategy runs beside its op's
    kernels: ``compute_s`` a micro-batch, ``replay_s`` of them again in a recomputation."""
    return {**priced, "compute_s": priced["compute_s"] + compute_s,
            "replay_s": priced["replay_s"] + replay_s}


def _with_bias_share(priced: dict[str, float], op: Op, label: str, ins: tuple[Layout, ...],
                     weight: Layout | None, output: Layout, ctx: StrategyContext
                     ) -> dict[str, float]:
    """``priced`` (:func:`_priced`'s keywords) with the runtime's bias share: where the
    output is a partial sum over ``p > 1`` devices, each bias-like parameter (a bias, a
    position table) is added as ``b / p`` (:func:`runtime.ops.bias_share`) — one kernel a
    forward, again in a recomputation, reading and writing its local block. Nothing on a
    flat cluster, which prices no kernel."""
    device = ctx.cluster.device
    if device is None or not any(output.fact[a].size > 1 for a in output.partial_axes):
        return priced
    shapes = param_shapes(op)
    lays = param_layouts(op, label, ins, weight, output)
    shares = [r for r in shapes if r == "bias" or r.startswith("pos")]
    if not shares:
        return priced
    moved = sum(2 * math.prod(lays[r][0].padded_shape(shapes[r])) for r in shares) \
        * op.output.itemsize
    work = PhaseWork(0.0, float(moved), len(shares))
    dtype = op.output.dtype
    return _plus(priced, phase_seconds(work, device, dtype),
                 phase_seconds(work, device, dtype, replayed=True))


# a local id of a vocabulary-split lookup (int64): made local (sub: 8 + 8), tested against
# the block (ge, lt: 8 + 1 each), the tests combined (and: 2 + 1), the masked ids (zeros_like:
# 8; where: 1 + 8 + 8, write 8)
VOCAB_MASK_ID_BYTES = 16 + 9 + 9 + 3 + 8 + 25


def _with_vocab_mask(priced: dict[str, float], op: Op, weight: Layout, output: Layout,
                     ctx: StrategyContext) -> dict[str, float]:
    """``priced`` (:func:`_priced`'s keywords) with an embedding's masked lookup where its
    table's rows (the vocabulary) are split (:func:`runtime.model.embedding`, not
    ``whole``): forward 8 kernels more — the ids made local and masked
    (:data:`VOCAB_MASK_ID_BYTES` a local id), the mask cast to the rows' dtype, and the rows
    of ids outside the block zeroed (read and write the local output, read the mask) —
    again in a recomputation; backward 1 (the same product on the output's gradient).
    Nothing for another op, a table whose rows are whole, or on a flat cluster."""
    device = ctx.cluster.device
    if device is None or op.kind is not OpKind.EMBEDDING or weight.split_degree(0) == 1:
        return priced
    it = op.output.itemsize
    local = output.padded_shape(op.output.shape)  # (its ids, the hidden block)
    ids, rows = local[0], math.prod(local) * it  # rows: the bytes the mask zeroes
    fwd = PhaseWork(0.0, ids * (VOCAB_MASK_ID_BYTES + 1 + 2 * it) + 2 * rows, 8)
    bwd = PhaseWork(0.0, ids * it + 2 * rows, 1)
    dtype = op.output.dtype
    return _plus(priced, phase_seconds(fwd, device, dtype) + phase_seconds(bwd, device, dtype),
                 phase_seconds(fwd, device, dtype, replayed=True))


def summa_cast_seconds(op: Op, cols: int, cluster: Cluster, replayed: bool = False) -> float:
    """One cast of SUMMA's gathered weight block (K × N/``cols`` elements) between its
    float32 master and the half compute dtype: the runtime gathers the master
    (:func:`summa_programs`) and casts the block every forward (again in a recomputation:
    ``replayed``), and the backward casts its gradient back to float32 for the
    ReduceScatter — one kernel, (4 + w) bytes an element, each. 0 in float32 (nothing to
    cast) or on a flat cluster (it never priced kernels)."""
    assert op.weight is not None
    if cluster.device is None or not op.mixed_precision:
        return 0.0
    numel = op.weight.numel // cols
    work = PhaseWork(0.0, float((MASTER_ITEMSIZE + op.weight.itemsize) * numel), 1)
    return phase_seconds(work, cluster.device, "float32", replayed)


def _with_summa_casts(priced: dict[str, float], op: Op, cols: int,
                      ctx: StrategyContext) -> dict[str, float]:
    """``priced`` (:func:`_priced`'s keywords) with SUMMA's weight casts
    (:func:`summa_cast_seconds`): the forward's and the backward's in a micro-batch's
    compute, the forward's again in a recomputation."""
    cast = summa_cast_seconds(op, cols, ctx.cluster)
    if not cast:
        return priced
    return _plus(priced, 2 * cast, summa_cast_seconds(op, cols, ctx.cluster, True))


def local_gemm(op: Op, weight: TensorSpec, fact: Factorisation,
               summa: bool = False) -> tuple[int, GemmShape]:
    """(devices sharing the work, local (m, n, k)) of a matmul-like op's strategy on
    ``fact``: the 3-D family's ``(m/p0, n/p1, k/p2)``; SUMMA's ``(m/r, n/c, k)`` after its
    gathers; a convolution's implicit GEMM ``(N·H·W/p0, Cout/p1, Cin·kh·kw/p2)``.
    ``weight`` is the op's weight, a matmul's second input."""
    sizes = [a.size for a in fact]
    if op.kind is OpKind.CONV2D:
        m = op.output.shape[0] * math.prod(op.output.shape[2:])
        n, k = weight.shape[0], weight.shape[1] * math.prod(weight.shape[2:])
    else:
        m, (k, n) = op.output.shape[0], weight.shape[:2]
    if summa:
        r, c = sizes
        return r * c, (m / r, n / c, k)
    p0, p1, p2 = sizes
    return p0 * p1 * p2, (m / p0, n / p1, k / p2)


def _gemm_priced(op: Op, weight: TensorSpec, fact: Factorisation, ctx: StrategyContext,
                 summa: bool = False) -> dict[str, float]:
    """:func:`_priced` of a matmul-like op's strategy on ``fact`` (:func:`local_gemm`)."""
    split, gemm = local_gemm(op, weight, fact, summa)
    return _priced(op, split, ctx, gemm)


def replay_seconds(op: Op, in_tensor: TensorSpec, in_layout: Layout,
                   ctx: StrategyContext) -> float:
    """What a recomputation of a follower runs again (:attr:`Strategy.replay_s`)."""
    split = math.prod(in_layout.split_degree(d) for d in range(in_tensor.rank))
    if op.kind in (OpKind.FLATTEN, OpKind.PART):
        return 0.0
    read = in_tensor if op.kind is OpKind.LOSS else None
    return _priced(op, split, ctx, read=read)["replay_s"]


def coll(kind: CollectiveKind, fact: Factorisation, axes: tuple[int, ...], nbytes: float,
          ctx: StrategyContext, phase: str, purpose: str) -> Collective:
    size = math.prod(fact[a].size for a in axes)
    nodes = math.prod(fact[a].nodes for a in axes)
    return make_collective(kind, size, nbytes, ctx.cluster, nodes > 1, axes, phase, purpose,
                           nodes)


def param_shapes(op: Op) -> dict[str, tuple[int, ...]]:
    """Parameters each op holds on its devices, by role. A tied head holds its own copy of
    the embedding table (transposed), with gradients and optimizer state: the runtime
    trains both copies and exchanges their gradients (:func:`tied_exchange`)."""
    if op.kind is OpKind.LINEAR:
        assert op.weight is not None
        out = {"weight": op.weight.shape}
        if op.attrs.get("bias"):
            out["bias"] = (op.weight.shape[1],)
        return out
    if op.kind is OpKind.EMBEDDING:
        assert op.weight is not None
        out = {"weight": op.weight.shape}
        # learned position (and token-type) tables; imported models may have none
        for role, rows in position_tables(op.attrs).items():
            out[role] = (rows, op.weight.shape[1])
        return out
    if op.kind is OpKind.ATTENTION:
        rows = op.attrs.get("bias_buckets", 0)
        return {"rel_bias": (rows, op.attr("heads"))} if rows else {}
    if op.kind in NORM_KINDS:  # an imported norm may lack its gain or bias (attrs 0)
        h = op.attrs.get("group_width", op.output.shape[-1])  # a per-head norm: one head's
        roles = ["weight"] * bool(op.attrs.get("gain", 1)) + ["bias"] * bool(
            op.kind is OpKind.LAYERNORM and op.attrs.get("bias", 1))
        return {role: (h,) for role in roles}
    if op.kind is OpKind.BATCHNORM:
        c = op.output.shape[1]
        return {"weight": (c,), "bias": (c,)}
    if op.kind is OpKind.OPAQUE and op.params:
        sizes = opaque_param_sizes(op.attrs) or [op.params]  # one role per parameter owned
        return {("weight" if i == 0 else f"weight_{i}"): (n,) for i, n in enumerate(sizes)}
    if op.kind is OpKind.MOE:
        return moe_param_shapes(op)
    if op.kind is OpKind.CONV2D:
        assert op.weight is not None
        if not op.attrs.get("bias", 1):  # an imported bias-free convolution
            return {"weight": op.weight.shape}
        return {"weight": op.weight.shape, "bias": (op.weight.shape[0],)}
    return {}


def matmul_placements(x: Layout, w: Layout, ids: bool = False) -> tuple[list, list, list]:
    """Per mesh axis, (output, dX, dW) placements of ``Y = X W`` with local operands —
    AutoDDL §4.2.2 and SUMMA's compute step::

        X      W      → Y      dX     dW
        S(0)   B        S(0)   S(0)   P     rows split: W's gradient is a partial sum
        B      S(1)     S(1)   P      S(1)  columns split: X's gradient is a partial sum
        S(1)   S(0)     P      S(1)   S(0)  contraction split: Y is a partial sum
        B      B        B      B      B

    For an embedding (``ids``) X is the token-id vector standing for the one-hot matrix: a
    replicated id vector against a vocabulary-split table gives partial sums."""
    out: list[Placement] = []
    gx: list[Placement] = []
    gw: list[Placement] = []
    for a, (pi, pw) in enumerate(zip(x.placements, w.placements, strict=True)):
        cols = pi == Split(1) if not ids else False
        if pi == Split(0) and pw == B:
            out.append(Split(0)); gx.append(pi); gw.append(P)  # noqa: E702
        elif pi == B and pw == Split(1):
            out.append(Split(1)); gx.append(P); gw.append(pw)  # noqa: E702
        elif (cols or (ids and pi == B)) and pw == Split(0):
            out.append(P); gx.append(pi); gw.append(pw)  # noqa: E702
        elif pi == B and pw == B:
            out.append(B); gx.append(B); gw.append(B)  # noqa: E702
        else:
            raise LayoutError(f"mesh axis {a} pairs input {pi} with weight {pw}; a matmul runs "
                              f"the 3-D family (S0,B)/(B,S1)/(S1,S0)/(B,B) per axis only")
    return out, gx, gw


def bias_layout(out: Layout, dim: int = 0) -> Layout:
    """A bias-like parameter along the output's last dim (``dim`` of the parameter): split
    where the output's columns are, replicated elsewhere."""
    return Layout(out.fact, tuple(Split(dim) if pl == Split(1) else B for pl in out.placements))


def _bias_grad(out: Layout, dim: int = 0) -> Layout:
    """Partial over the axes splitting rows (each device sums its own rows); complete over
    the output's partial axes, where every device adds a share of the bias and its
    gradient is the row sum of the replicated output gradient (``runtime.ops.bias_share``:
    no reduction, as Megatron's row-parallel bias added after the AllReduce)."""
    return Layout(out.fact, tuple(P if pl == Split(0) else (Split(dim) if pl == Split(1) else B)
                                  for pl in out.placements))


def is_summa(label: str) -> bool:
    return label.startswith("summa")


def summa_compute_layouts(fact: Factorisation) -> tuple[Layout, Layout]:
    """SUMMA gathers I along the column axis and W along the row axis, then multiplies."""
    return Layout(fact, (Split(0), B)), Layout(fact, (B, Split(1)))


def input_grad_layouts(op: Op, label: str, inputs: tuple[Layout, ...],
                       weight: Layout | None) -> tuple[Layout, ...]:
    """The layout each input's gradient leaves the op's backward in — where edge backward
    programs start. Partial where the op's local backward yields partial sums (a matmul
    input replicated against column-split weights; a conv input against output-channel
    splits); the input layout itself otherwise (SUMMA's own gathers reduce-scatter back)."""
    if op.kind in (OpKind.LINEAR, OpKind.MATMUL) and not is_summa(label):
        w = inputs[1] if op.kind is OpKind.MATMUL else weight
        assert w is not None
        _, gx, gw = matmul_placements(inputs[0], w)
        grads = (Layout(inputs[0].fact, tuple(gx)),)
        return grads + ((Layout(w.fact, tuple(gw)),) if op.kind is OpKind.MATMUL else ())
    if op.kind is OpKind.MOE:
        return (moe_layouts(inputs[0].fact, expert_parallel(inputs[0]))[2],)
    if op.kind is OpKind.CONV2D and not op.attrs.get("groups"):  # grouped: whole
        x = inputs[0]
        return (Layout(x.fact, tuple(P if (pl == B and x.fact[a].size > 1 and a == 1) else pl
                                     for a, pl in enumerate(x.placements))),)
    i = op.attrs.get("shared_input") if op.kind is OpKind.ATTENTION else None
    if i is not None:  # each device's heads give their share of the shared input's gradient
        heads, x = inputs[0], inputs[i]
        grad = Layout(x.fact, tuple(P if h == Split(1) else pl
                                    for h, pl in zip(heads.placements, x.placements, strict=True)))
        return inputs[:i] + (grad,) + inputs[i + 1:]
    return inputs


def param_layouts(op: Op, label: str, inputs: tuple[Layout, ...], weight: Layout | None,
                  output: Layout) -> dict[str, tuple[Layout, Layout]]:
    """Per parameter role: (layout it is stored in, layout its gradient leaves the op's
    backward in). Where the two differ, weight-gradient synchronisation reduces the partial
    axes (:func:`grad_sync`). One place for both the cost model and the runtime."""
    out: dict[str, tuple[Layout, Layout]] = {}
    if op.kind in (OpKind.LINEAR, OpKind.EMBEDDING):
        assert weight is not None
        if is_summa(label):
            out["weight"] = (weight, weight)  # its gather's backward ReduceScatter lands it
        else:
            _, _, gw = matmul_placements(inputs[0], weight, op.kind is OpKind.EMBEDDING)
            out["weight"] = (weight, Layout(weight.fact, tuple(gw)))
        if op.kind is OpKind.EMBEDDING:
            for role in position_tables(op.attrs):
                out[role] = (bias_layout(output, 1), _bias_grad(output, 1))
        elif op.attrs.get("bias"):
            out["bias"] = (bias_layout(output), _bias_grad(output))
    elif op.kind is OpKind.CONV2D:
        assert weight is not None
        x = inputs[0]
        # the weight's gradient sums over the batch rows this device holds
        out["weight"] = (weight, Layout(weight.fact, tuple(
            P if x.placements[a] == Split(0) and pl == B else pl
            for a, pl in enumerate(weight.placements))))
        if op.attrs.get("bias", 1):
            out["bias"] = (bias_layout(output), _bias_grad(output))
    elif op.kind in NORM_KINDS:
        # whole on every device; its gradient sums over the rows, and a per-head norm's
        # over the heads (attrs.group_width), each device holds: partial over those axes
        lay = inputs[0]
        rep = Layout.replicated(lay.fact)
        g = Layout(lay.fact, tuple(P if isinstance(pl, Split) else B for pl in lay.placements))
        out = {role: (rep, g) for role in param_shapes(op)}
    elif op.kind is OpKind.BATCHNORM:
        # each device holds its channels' gains and offsets; their gradients sum over the
        # batch rows it holds, so they are partial over the batch-splitting axes
        # (synchronised batch norm, :func:`batchnorm_collectives`)
        lay = Layout(output.fact, tuple(Split(0) if pl == Split(1) else B
                                        for pl in output.placements))
        grad = Layout(output.fact, tuple(P if pl == Split(0) else q
                                         for pl, q in zip(output.placements, lay.placements,
                                                          strict=True)))
        out = {"weight": (lay, grad), "bias": (lay, grad)}
    elif op.kind is OpKind.OPAQUE and op.params:
        rep = Layout.replicated(output.fact)
        out = {role: (rep, rep) for role in param_shapes(op)}
    elif op.kind is OpKind.MOE:
        out = moe_param_layouts(op, inputs[0])
    elif op.kind is OpKind.ATTENTION and op.attrs.get("bias_buckets"):
        # every axis splits the batch or the heads (bias_table_layouts): each device's
        # gradient of the whole table is its blocks' share
        out["rel_bias"] = (Layout.replicated(output.fact),
                           Layout(output.fact, tuple(P for _ in output.placements)))
    return out


@dataclass(frozen=True)
class SyncBucket:
    """One weight-gradient AllReduce: the parameter roles whose gradients are partial over
    exactly ``axes``, flattened into one buffer."""

    roles: tuple[str, ...]
    fact: Factorisation
    axes: tuple[int, ...]
    collective: Collective
    numel: int  # elements of the local gradient blocks (padded), in role order


def grad_sync(op: Op, label: str, inputs: tuple[Layout, ...], weight: Layout | None,
              output: Layout, ctx: StrategyContext) -> tuple[SyncBucket, ...]:
    """The op's weight-gradient synchronisation (AutoDDL §4.4.1), exactly as the runtime
    issues it: per distinct set of partial axes, one AllReduce of those parameters' local
    shards over the joint group of those axes. None for a :attr:`~ilp_planner.ir.graph.Op.frozen`
    op: its weights take no gradient."""
    if op.frozen:
        return ()
    shapes = param_shapes(op)
    lays = param_layouts(op, label, inputs, weight, output)
    # fp32 reduction under mixed precision; a role kept in float32 beside half-precision
    # ones reduces apart (buffers hold one dtype)
    index = {role: i for i, role in enumerate(shapes)}
    by_axes: dict[tuple[tuple[int, ...], int], list[str]] = {}
    for role, (_, grad) in lays.items():
        axes = tuple(a for a in grad.partial_axes if grad.fact[a].size > 1)
        if axes:
            by_axes.setdefault((axes, op.grad_itemsize(index[role])), []).append(role)
    out = []
    for (axes, itemsize), roles in by_axes.items():
        fact = lays[roles[0]][0].fact
        numel = sum(math.prod(lays[r][0].padded_shape(shapes[r])) for r in roles)
        out.append(SyncBucket(tuple(roles), fact, axes,
                              coll(CollectiveKind.ALL_REDUCE, fact, axes, numel * itemsize, ctx,
                                   "backward", "grad_sync"), numel))
    return tuple(out)


def _local_params(op: Op, label: str, inputs: tuple[Layout, ...], weight: Layout | None,
                  output: Layout) -> float:
    shapes = param_shapes(op)
    return float(sum(math.prod(lay.padded_shape(shapes[r])) for r, (lay, _) in
                     param_layouts(op, label, inputs, weight, output).items()))


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
        label = f"3d(p0={fact[0]},p1={fact[1]},p2={fact[2]})"
        ins = (i_layout, w_layout) if is_matmul else (i_layout,)
        grads = input_grad_layouts(op, label, ins, None if is_matmul else w_layout)
        if is_matmul:
            colls: tuple[Collective, ...] = ()
            local = 0.0
        else:
            colls = tuple(b.collective for b in grad_sync(op, label, ins, w_layout, o_layout, ctx))
            local = _local_params(op, label, ins, w_layout, o_layout)
        out.append(Strategy(
            label, fact, ins, None if is_matmul else w_layout, o_layout,
            collectives=colls, state_bytes=local * ctx.memory.bytes_per_param,
            activation_bytes=o_layout.local_bytes(op.output), input_grads=grads,
            update_params=local, **_with_vocab_mask(_with_bias_share(
                _gemm_priced(op, weight, fact, ctx), op, label, ins,
                None if is_matmul else w_layout, o_layout, ctx), op, w_layout, o_layout, ctx),
        ))
    if not is_embedding and not is_matmul:
        out.extend(_summa(op, inputs[0], ctx))
    return out


def summa_programs(fact: Factorisation, in_tensor: TensorSpec, master: TensorSpec,
                   cluster: Cluster) -> tuple[Redistribution, Redistribution]:
    """SUMMA's two gathers as lowered edge programs: I (S0,S1) → (S0,B) with its gradient
    (partial over the column axis) reduce-scattered back; W (S0,S1) → (B,S1) likewise over
    the row axis. Executed per micro-batch by the runtime. W is gathered from its master
    (``master``: :attr:`~ilp_planner.ir.graph.Op.master_spec`, fp32 under mixed precision,
    cast after the gather) so that the backward reduce-scatter sums weight gradients in
    fp32."""
    lay = Layout(fact, (Split(0), Split(1)))
    xc, wc = summa_compute_layouts(fact)
    _, gx, gw = matmul_placements(xc, wc)
    return (plan_redistribution(lay, xc, in_tensor, cluster, Layout(fact, tuple(gx))),
            plan_redistribution(lay, wc, master, cluster, Layout(fact, tuple(gw))))


def summa_fits(op: Op, r: int, c: int) -> bool:
    """Whether a linear runs as SUMMA on an ``r × c`` mesh: both axes real, and I (M, K),
    W (K, N) and O (M, N) all split evenly ``(S0:r, S1:c)``."""
    assert op.weight is not None
    m = op.output.shape[0]
    k, n = op.weight.shape[:2]
    return r > 1 and c > 1 and not (m % r or k % c or k % r or n % c)


def _summa(op: Op, in_tensor: TensorSpec, ctx: StrategyContext) -> list[Strategy]:
    assert op.weight is not None
    if in_tensor.rank != 2:
        # an input read as it lies, not as (M, K) rows (an opaque op's (b, t, c) output):
        # its (S0, S1) would split the sequence, not K — SUMMA's gathers do not apply
        return []
    out = []
    for fact in _two_axis(ctx):
        r, c = (a.size for a in fact)
        if not summa_fits(op, r, c) or (ctx.facts is not None and fact not in ctx.facts):
            continue
        lay = Layout(fact, (Split(0), Split(1)))
        label = f"summa({fact[0]}x{fact[1]})"
        x_prog, w_prog = summa_programs(fact, in_tensor, op.master_spec, ctx.cluster)
        colls = (*x_prog.forward, *(c.with_phase("forward", "weight") for c in w_prog.forward),
                 *(c.with_phase("backward", "weight") for c in w_prog.backward),
                 *(b.collective for b in grad_sync(op, label, (lay,), lay, lay, ctx)))
        # I[i, :] and W[:, j] (cast to the compute dtype) gathered: the local matmul saves
        # both for its backward, so each micro-batch in flight holds its own, and a
        # recomputed block gathers them again
        gathered = in_tensor.nbytes / r + op.weight.nbytes / c
        local = _local_params(op, label, (lay,), lay, lay)
        out.append(Strategy(
            label, fact, (lay,), lay, lay, collectives=colls,
            state_bytes=local * ctx.memory.bytes_per_param,
            activation_bytes=lay.local_bytes(op.output) + gathered,
            input_backward=tuple(x_prog.backward),
            update_params=local,
            **_with_summa_casts(_gemm_priced(op, op.weight, fact, ctx, True), op, c, ctx),
        ))
    return out


def conv_layouts(fact: Factorisation) -> tuple[Layout, Layout, Layout]:
    """(input, weight, output) layouts of the conv2d 3-D family on ``fact = (p0, p1, p2)``::

        I (N,Cin,H,W) (S0:p0, B:p1, S1:p2) ⊛ W (Cout,Cin,k,k) (B:p0, S0:p1, S1:p2)
            → O (N,Cout,H,W) (S0:p0, S1:p1, P:p2)

    Each device convolves its batch rows and input-channel block with its (output-channel,
    input-channel) weight block: the output sums over the p2 input-channel blocks. The
    spatial dims are never split, so the convolution's halo stays local. One table for the
    strategies and the runtime, which checks a plan's layouts against it."""
    return (Layout(fact, (Split(0), B, Split(1))), Layout(fact, (B, Split(0), Split(1))),
            Layout(fact, (Split(0), Split(1), P)))


def _conv_family(op: Op, ctx: StrategyContext) -> list[Strategy]:
    """3-D family for conv2d (:func:`conv_layouts`): batch split p0, output channels p1,
    input channels p2. The input's gradient is partial over p1 (each output-channel block
    contributes). A grouped convolution: :func:`_grouped_conv_family`."""
    assert op.weight is not None
    if op.attrs.get("groups", 1) > 1:
        return _grouped_conv_family(op, ctx)
    nb, cin = op.output.shape[0], op.weight.shape[1]
    cout = op.weight.shape[0]
    out = []
    for fact in _three_axis(ctx):
        p0, p1, p2 = (a.size for a in fact)
        if nb % p0 or cout % p1 or cin % p2:
            continue
        if ctx.max_weight_replication is not None and p0 > ctx.max_weight_replication:
            continue
        i_layout, w_layout, o_layout = conv_layouts(fact)
        out.append(_conv_strategy(op, f"conv3d(p0={fact[0]},p1={fact[1]},p2={fact[2]})",
                                  i_layout, w_layout, o_layout, fact, ctx))
    return out


def _conv_strategy(op: Op, label: str, x: Layout, w: Layout, o: Layout,
                   priced_on: Factorisation, ctx: StrategyContext) -> Strategy:
    """A convolution's strategy reading ``x`` with weight ``w`` into ``o``, its local GEMM
    that of ``priced_on`` (:func:`local_gemm`)."""
    assert op.weight is not None
    colls = tuple(b.collective for b in grad_sync(op, label, (x,), w, o, ctx))
    local = _local_params(op, label, (x,), w, o)
    return Strategy(label, x.fact, (x,), w, o, collectives=colls,
                    state_bytes=local * ctx.memory.bytes_per_param,
                    activation_bytes=o.local_bytes(op.output),
                    input_grads=input_grad_layouts(op, label, (x,), w), update_params=local,
                    **_with_bias_share(_gemm_priced(op, op.weight, priced_on, ctx), op, label,
                                       (x,), w, o, ctx))


def _grouped_conv_family(op: Op, ctx: StrategyContext) -> list[Strategy]:
    """A grouped convolution (``attrs.groups``: ConvNeXt's depthwise ones) on the 3-D
    family's factorisations, its batch split over p0 and its work replicated over p1 and
    p2 (``(S0, B, B)`` in and out, the weight whole): a block of its output channels reads
    only its own groups' input channels, which the family's channel splits do not express,
    nor the runtime's call of the module with its ``groups``. Its weight's gradient sums
    over the batch axis; its input's is whole (:func:`input_grad_layouts`). Every device
    holds its (small: C·k·k) weight whole, so ``solver.max_weight_replication`` does not
    apply: under it the op would have no strategy at all."""
    one = MeshAxis(1, 1)
    out = []
    for fact in _three_axis(ctx):
        if op.output.shape[0] % fact[0].size:
            continue
        x = Layout(fact, (Split(0), B, B))
        out.append(_conv_strategy(
            op, f"conv3d-grouped(p0={fact[0]},p1={fact[1]},p2={fact[2]})", x,
            Layout.replicated(fact), x, (fact[0], one, one), ctx))  # the GEMM split p0 ways
    return out


def _moe_family(op: Op, ctx: StrategyContext) -> list[Strategy]:
    """The MoE op's strategies (:mod:`ilp_planner.lowering.moe_strategies`): expert data,
    expert or expert-sliced, and expert tensor parallel degrees on every three-axis
    factorisation, priced at capacity."""
    out = []
    for x in moe_candidates(op, _three_axis(ctx)):
        _, o, grad = moe_layouts(x.fact, expert_parallel(x))
        label = moe_label(x)
        colls = moe_collectives(op, x, ctx.cluster) + tuple(
            b.collective for b in grad_sync(op, label, (x,), None, o, ctx))
        local = _local_params(op, label, (x,), None, o)
        per_device = dataclasses.replace(op, flops=moe_flops(op, x))
        priced = _priced(per_device, 1, ctx)
        # its experts' and router's local parameters: the optimizer's update, the master
        # passes and the float16 unscale run over them like any op's
        out.append(Strategy(label, x.fact, (x,), None, o, priced["compute_s"], colls,
                            local * ctx.memory.bytes_per_param, moe_activation_bytes(op, x, o),
                            (grad,), update_params=local, replay_s=priced["replay_s"]))
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
        ins = tuple(lay for _ in range(n_inputs))
        local = _local_params(op, lay.sbp(), ins, None, lay)
        colls = tuple(b.collective for b in grad_sync(op, lay.sbp(), ins, None, lay, ctx))
        out.append(Strategy(
            lay.sbp(), lay.fact, ins, None, lay, collectives=colls,
            state_bytes=local * ctx.memory.bytes_per_param,
            activation_bytes=lay.local_bytes(op.output), update_params=local,
            **_priced(op, split, ctx),
        ))
    return out


BN_STAT_ITEMSIZE = 8  # batch-norm statistics are reduced in float64 (runtime.local_batchnorm)


def batchnorm_collectives(op: Op, layout: Layout, ctx: StrategyContext
                          ) -> tuple[tuple[Collective, ...], tuple[Collective, ...]]:
    """(forward, input-backward) collectives of a batch norm whose (N, C, H, W) output is in
    ``layout`` — synchronised batch norm (``torch.nn.SyncBatchNorm``: exact statistics of
    the whole batch) over the axes splitting the batch. Forward: one AllReduce of the local
    per-channel [Σx, Σx²] (2·C_local values in float64, formed from each block's mean and
    variance so that the variance survives a large mean; the count is known from the
    shapes);
    backward, where autograd reaches the input: one AllReduce of [Σdy, Σdy·x̂] (the
    gradients of those sums), the same size. None where the batch is whole."""
    axes = tuple(a for a in layout.split_axes(0) if layout.fact[a].size > 1)
    if not axes:
        return (), ()
    nbytes = 2 * layout.padded_shape(op.output.shape)[1] * BN_STAT_ITEMSIZE
    return ((coll(CollectiveKind.ALL_REDUCE, layout.fact, axes, nbytes, ctx, "forward",
                  "batchnorm"),),
            (coll(CollectiveKind.ALL_REDUCE, layout.fact, axes, nbytes, ctx, "backward",
                  "batchnorm"),))


def _batchnorm_family(op: Op, ctx: StrategyContext) -> list[Strategy]:
    """Batch norm on its channels split, its batch split (synchronised batch norm: exact
    whole-batch statistics, :func:`batchnorm_collectives`) or both, over any mesh axes;
    spatial dims stay whole. Compute is priced on the local block as for any norm; the
    gains' and offsets' gradients are partial over the batch axes (:func:`param_layouts`)
    and reduced by weight-gradient synchronisation."""
    out = []
    for s in _layout_strategies(op, candidate_layouts(op.output, ctx, (0, 1)), 1, ctx):
        fwd, bwd = batchnorm_collectives(op, s.output, ctx)
        out.append(dataclasses.replace(s, collectives=fwd + s.collectives, input_backward=bwd))
    return out


def op_strategies(op: Op, inputs: list[TensorSpec], ctx: StrategyContext) -> list[Strategy]:
    """All strategies of a non-follower op on the context's mesh, each with its state-sharded
    variants (:func:`state_sharded`) for the levels ``ctx.zero_levels`` allows; an op
    marked ``attrs.row_items`` (whole examples in its rows) splits them by its divisors only."""
    return with_state_sharding(op, _whole_items(op, _held_only(
        op, _base_strategies(op, inputs, ctx), ctx)), ctx)


def _held_only(op: Op, strategies: list[Strategy], ctx: StrategyContext) -> list[Strategy]:
    """A :attr:`~ilp_planner.ir.graph.Op.frozen` op's strategies: its local parameters
    (every family's ``update_params``) held as weights only — no gradient, optimizer state
    or update (its gradient synchronisation is already none: :func:`grad_sync`; nor is
    any state sharding offered, having no bucket to shard)."""
    if not op.frozen:
        return strategies
    return [dataclasses.replace(s, state_bytes=s.update_params * ctx.memory.held_per_param(op),
                                update_params=0.0) for s in strategies]


def _whole_items(op: Op, strategies: list[Strategy]) -> list[Strategy]:
    """The strategies whose output and inputs split their rows (dim 0) by a divisor of
    ``attrs.row_items``: an imported module's batch (``parallelize`` splits the tokens over
    its batch dim only) or an opaque op's images."""
    items = op.attrs.get("row_items")
    if not items:
        return strategies
    return [s for s in strategies
            if all(items % lay.split_degree(0) == 0 for lay in (s.output, *s.inputs))]


def with_state_sharding(op: Op, base: list[Strategy], ctx: StrategyContext) -> list[Strategy]:
    """``base`` (an op's strategies without state sharding, :func:`op_strategies` under
    ``zero_levels=(0,)``), each followed by its state-sharded variants for the levels
    ``ctx.zero_levels`` allows: :func:`op_strategies` under ``ctx``, for a caller that
    already holds the base list (a build offering FSDP beside one that does not)."""
    levels = tuple(z for z in ctx.zero_levels if z)
    if not levels:
        return base
    return [v for s in base for v in (s, *state_sharded(op, s, levels, ctx))]


ZERO_LEVELS = (0, 1, 2, 3)
"""State sharding over the group a weight's gradient is synchronised in: 0 none (DDP),
1 optimizer state (ZeRO-1), 2 + gradients (ZeRO-2), 3 + weights (ZeRO-3 / FSDP)."""


def input_grad_roles(op: Op) -> frozenset[str]:
    """The parameter roles an op's backward reads to compute the gradient of its *input*.
    The weight gradient itself never needs the weight (a matmul's ``dW = Xᵀ·dY``, a norm's
    ``dγ = Σ dY·x̂``, a bias's ``Σ dY``), so a ZeRO-3 op gathers its weights in the backward
    only for these roles, and only when autograd reaches the input (:func:`state_sharded`).
    Matmul-like ops (``dX = dY·Wᵀ``), convolutions (the transposed convolution with W) and
    norms (``dX`` scales by γ) read their weight; an embedding's input is token ids, so its
    table is only indexed, never read backwards; biases never. An opaque op is assumed to
    read all its parameters (nothing says otherwise)."""
    if op.kind is OpKind.OPAQUE:
        return frozenset(param_shapes(op)) if op.params else frozenset({"weight"})
    if op.kind is OpKind.MOE:  # dX reads the router and every expert matrix
        return frozenset(param_shapes(op))
    if op.kind in (OpKind.LINEAR, OpKind.CONV2D, OpKind.BATCHNORM, *NORM_KINDS):
        return frozenset({"weight"})
    return frozenset()



def backward_reads(op: Op, roles: tuple[str, ...], input_reached: bool) -> bool:
    """Whether a ZeRO-3 op's backward reads the weights of a bucket holding ``roles``: some
    role is read for the input's gradient (:func:`input_grad_roles`) and autograd reaches
    the input — exactly when the bucket's backward gather is listed (``input_backward``)
    and the runtime gathers again (:mod:`runtime.zero`)."""
    return input_reached and bool(input_grad_roles(op).intersection(roles))

def state_sharded(op: Op, base: Strategy, levels: Sequence[int],
                  ctx: StrategyContext) -> list[Strategy]:
    """The ZeRO variants of ``base``: every set of parameters whose gradient ``base``
    AllReduces over a group of p devices (its :class:`SyncBucket`) is instead kept as one
    flat buffer padded to a multiple of p and sharded 1/p per device (FSDP's flat
    parameter). With n local elements, s = ⌈n/p⌉, bytes per parameter w, g, o::

        level  state per device      collectives                                  per
        1      n(w+g) + s·o          ReduceScatter grads, AllGather new weights     step
        2      n·w + s(g+o)          ReduceScatter grads                        micro-batch
                                     AllGather new weights                          step
        3      s(w+g+o)              AllGather weights (forward),               micro-batch
                                     again (backward) if the input's gradient
                                     reads them, ReduceScatter grads

    ZeRO-3's backward gather is FSDP's re-unshard, needed only where the backward reads
    the weights: for the input's gradient (:func:`input_grad_roles`: a matmul's
    ``dY·Wᵀ``, a norm's γ), not for the weight's own gradient. So a bucket holding no such
    role (an embedding's tables, a bias alone) has none, and a bucket that does lists it in
    ``input_backward``, which the problem adds only where autograd reaches the op's input
    (not for the first layer reading the data). A recomputed ZeRO-3 op gathers twice per
    micro-batch, forward and recompute: its backward reuses the recomputation's buffer
    (:func:`ilp_planner.intra_op.problem.recomputed`).

    ReduceScatter moves gradients in the master dtype (fp32 under mixed precision), the
    AllGathers move weights in the compute dtype (each device updates its shard of the
    fp32 master and casts it). ``transient_bytes`` is what a level holds only while the op
    runs: the op's full gradient before it is scattered (2, 3) and, at 3, its gathered
    weights — in the forward all of them, in the backward the full gradient and the
    weights gathered again (the larger of the two; an op whose input is not reached
    gathers nothing in the backward, which this per-strategy figure, not knowing, still
    counts). No variant without a gradient reduction: nothing is replicated there to
    shard."""
    syncs = grad_sync(op, base.label, base.inputs, base.weight, base.output, ctx)
    if not syncs:
        return []
    w, g, o = ctx.memory.weight_bytes, ctx.memory.grad_bytes, ctx.memory.optimizer_bytes
    w_item = (op.weight or op.output).itemsize
    kept = tuple(c for c in base.collectives if c.purpose != "grad_sync")
    reads = input_grad_roles(op)
    out = []
    for z in levels:
        state, updated = base.state_bytes, base.update_params
        colls: list[Collective] = []
        again: list[Collective] = []  # ZeRO-3's backward gathers, if the input is reached
        gathered = grads = regathered = 0.0
        for sb in syncs:
            n = sb.numel
            p = sb.collective.group_size
            s = -(-n // p)
            grad_item = sb.collective.bytes / n
            state -= n * (w + g + o)
            state += {1: n * (w + g) + s * o, 2: n * w + s * (g + o), 3: s * (w + g + o)}[z]
            updated += s - n  # each device steps its shard of the bucket
            grads += n * g if z > 1 else 0.0
            rs = coll(CollectiveKind.REDUCE_SCATTER, sb.fact, sb.axes, s * p * grad_item, ctx,
                      "backward", "shard_grad_sync" if z == 1 else "shard_grad")
            ag = functools.partial(coll, CollectiveKind.ALL_GATHER, sb.fact, sb.axes,
                                   s * p * w_item, ctx)
            if z == 3:
                colls += [ag("forward", "fsdp_gather"), rs]
                gathered += n * w
                if reads.intersection(sb.roles):
                    again.append(ag("backward", "fsdp_gather"))
                    regathered += n * w
            else:
                colls += [rs, ag("step", "weight_allgather")]
        transient = max(gathered, grads + regathered)
        out.append(dataclasses.replace(base, label=f"{base.label}+zero{z}",
                                       collectives=kept + tuple(colls), state_bytes=state,
                                       input_backward=base.input_backward + tuple(again),
                                       zero=z, transient_bytes=transient, update_params=updated,
                                       gathered_bytes=gathered, regathered_bytes=regathered))
    return out


def _base_strategies(op: Op, inputs: list[TensorSpec], ctx: StrategyContext) -> list[Strategy]:
    kind = op.kind
    if kind in (OpKind.LINEAR, OpKind.EMBEDDING, OpKind.MATMUL):
        return head_column_strategies(op, fused_parts_strategies(op, _matmul_family(op, inputs, ctx)))
    if kind is OpKind.CONV2D:
        return _conv_family(op, ctx)
    if kind is OpKind.MOE:
        return _moe_family(op, ctx)
    if kind in NORM_KINDS and "group_width" in op.attrs:
        return _layout_strategies(op, grouped_norm_layouts(op, ctx), 1, ctx)
    if kind in (OpKind.LAYERNORM, OpKind.RMSNORM, OpKind.SOFTMAX):
        return _layout_strategies(op, candidate_layouts(op.output, ctx, (0,)), 1, ctx)
    if kind is OpKind.BATCHNORM:
        return _batchnorm_family(op, ctx)
    if kind is OpKind.OPAQUE:  # whole items (images) only where it says how many: _whole_items
        return _layout_strategies(op, candidate_layouts(op.output, ctx, opaque_dims(op)),
                                  len(op.inputs), ctx)
    if kind is OpKind.ATTENTION:
        divs = {0: op.output.shape[0] // op.attr("seq_len"), 1: head_splits(op)}
        layouts = candidate_layouts(op.output, ctx, (0, 1), divs)
        if op.attrs.get("one_split"):  # see the module docstring
            layouts = [lay for lay in layouts
                       if lay.split_degree(0) == 1 or lay.split_degree(1) == 1]
        if op.attrs.get("bias_table"):
            layouts = bias_table_layouts(op, layouts)
        return shared_input_layouts(op, _layout_strategies(op, layouts, len(op.inputs), ctx))
    if kind in (OpKind.ADD, OpKind.MUL):
        # images split over batch and channels only, as convolutions, pooling and flatten do;
        # a dim an operand broadcasts (a routing weight (T, 1) times an expert's (T, h)) is
        # never split: the operand has no such split to be given
        dims = tuple(d for d in ((0, 1) if op.output.rank == 4 else range(op.output.rank))
                     if all(x.rank == op.output.rank and x.shape[d] == op.output.shape[d]
                            for x in inputs))
        return _layout_strategies(op, candidate_layouts(op.output, ctx, dims), len(op.inputs), ctx)
    if kind.is_elementwise:  # one reading a model input: any layout of it
        dims = (0, 1) if op.output.rank == 4 else tuple(range(op.output.rank))
        return _layout_strategies(op, candidate_layouts(op.output, ctx, dims), 1, ctx)
    # a pool, flatten, part or loss is laid out as the op producing its input
    raise ConfigError(f"op {op.name!r} ({kind.value}) reads a model input directly; the "
                      f"planner lays a {kind.value} out as the op producing its input — put an "
                      f"op before it (a convolution, a linear, a norm) or plan the module "
                      f"around it")


def grouped_norm_layouts(op: Op, ctx: StrategyContext) -> list[Layout]:
    """A per-head norm's layouts (``attrs.group_width``: each group of that many columns
    normalised on its own): rows split as any norm's, columns only in whole groups — a
    divisor of their count (a k norm's: its key/value heads') —, never cutting one."""
    groups, rest = divmod(op.output.shape[1], op.attr("group_width"))
    if rest:
        raise ValueError(f"norm {op.name!r}: attrs.group_width {op.attr('group_width')} does "
                         f"not divide its {op.output.shape[1]} features")
    return candidate_layouts(op.output, ctx, (0, 1), {1: groups})


def head_column_strategies(op: Op, strategies: list[Strategy]) -> list[Strategy]:
    """A projection a per-head norm reads (``attrs.whole_heads``: its heads, marked at
    import) through the module's own ``view(b, s, heads, d)``: its columns split only by a
    divisor of its heads, so that the view of a column-split block keeps whole heads
    (another split makes that view fail on the rank's uneven block before any boundary
    could convert it)."""
    heads = op.attrs.get("whole_heads")
    if not heads:
        return strategies
    return [s for s in strategies if heads % s.output.split_degree(1) == 0]


def fused_parts_strategies(op: Op, strategies: list[Strategy]) -> list[Strategy]:
    """A linear whose output the user's code cuts into ``attrs.parts`` equal column blocks
    (``part`` ops, :mod:`ilp_planner.ir.graph`): its column split must divide every block
    (device ``i`` holds the ``i``-th ``k``-th of each, the runtime's interleaved weight), and
    its output is never partial — resolving partial sums onto its columns would hand a
    device contiguous columns, not its blocks' shares. Its other strategies are refused,
    not priced; none left is an error naming the op."""
    parts = op.attrs.get("parts") if op.kind is OpKind.LINEAR else None
    if not parts:
        return strategies
    width = op.output.shape[1] // parts
    # an op other than its parts reading the output whole (``attrs.parts_read_whole``) would
    # gather the interleaved blocks out of order: the columns stay whole then
    most = 1 if op.attrs.get("parts_read_whole") else width
    kept = [s for s in strategies if most % s.output.split_degree(1) == 0
            and all(s.output.fact[a].size == 1 for a in s.output.partial_axes)]
    if not kept:
        raise ValueError(f"linear {op.name!r} computes {parts} fused column blocks of "
                         f"{width}; none of its strategies on this mesh splits its columns "
                         f"by a divisor of {width} without partial sums")
    return kept


def bias_table_layouts(op: Op, layouts: list[Layout]) -> list[Layout]:
    """The layouts of an attention adding a learned position bias (see the module
    docstring): no mesh axis replicates it; none at all is an error naming the op."""
    kept = [lay for lay in layouts if all(ax.size == 1 or pl != B
                                          for ax, pl in zip(lay.fact, lay.placements, strict=True))]
    if not kept:
        raise ValueError(f"attention {op.name!r} adds a learned position bias (a table its "
                         f"stack shares), whose gradient is exact only where every mesh axis "
                         f"splits the batch ({op.output.shape[0] // op.attr('seq_len')}) or "
                         f"the heads ({head_splits(op)}); no layout on this mesh does")
    return kept


def opaque_dims(op: Op) -> tuple[int, ...]:
    """The dims an opaque op may split: none (kept replicated), but the tokens of a copy of
    some of its producer's columns (``attrs.rows_local``: row-local by construction)."""
    return (0,) if op.attrs.get("rows_local") else ()


def shared_input_layouts(op: Op, strategies: list[Strategy]) -> list[Strategy]:
    """An attention whose input ``attrs.shared_input`` is read whole by every head (DeepSeek
    MLA's rotary key part, from ``kv_a_proj_with_mqa``: its features are no heads) reads it
    with the head splits replicated, the batch splits kept; its gradient, each head group's
    share, leaves the backward partial over those axes."""
    i = op.attrs.get("shared_input")
    if i is None:
        return strategies
    out = []
    for s in strategies:
        lay = s.inputs[i]
        whole = Layout(lay.fact, tuple(B if pl == Split(1) else pl for pl in lay.placements))
        inputs = s.inputs[:i] + (whole,) + s.inputs[i + 1:]
        out.append(dataclasses.replace(s, inputs=inputs, input_grads=input_grad_layouts(
            op, s.label, inputs, s.weight)))
    return out


def head_splits(op: Op) -> int:
    """The most ways an attention op's heads split (any divisor of it): all of them, the
    key/value heads' count under grouped-query attention, 1 — batch splits only — where it
    reads a fused tensor laid out ``[q | k | v]``, whose column blocks are not whole heads."""
    if op.attrs.get("qkv_major"):
        return 1
    return math.gcd(op.attr("heads"), op.attrs.get("kv_heads", 0))


def follow(op: Op, in_tensor: TensorSpec, in_layout: Layout,
           ctx: StrategyContext) -> tuple[Layout, tuple[Collective, ...], float]:
    """A follower's (output layout, collectives, compute seconds) given its producer's
    partial-free output layout, which is also the follower's input layout.

    Elementwise, pooling: same layout. Flatten (N,C,H,W)→(N,C·H·W): batch and channel
    splits carry over (channels are the major part of the flattened dim). Loss: see
    :func:`loss_collectives`.
    """
    split = math.prod(in_layout.split_degree(d) for d in range(in_tensor.rank))
    if op.kind is OpKind.LOSS:
        colls = loss_collectives(in_tensor, in_layout, ctx)
        return (Layout.replicated(in_layout.fact), colls,
                _compute(op, split, ctx, read=in_tensor) + _loss_copies_seconds(colls, ctx))
    if op.kind is OpKind.FLATTEN:
        if any(isinstance(pl, Split) and pl.dim > 1 for pl in in_layout.placements):
            raise ValueError(f"flatten {op.name!r} cannot follow a spatially split layout "
                             f"{in_layout}; only batch and channel splits carry over")
        return in_layout, (), 0.0
    return in_layout, (), _compute(op, split, ctx)


def _loss_copies_seconds(colls: tuple[Collective, ...], ctx: StrategyContext) -> float:
    """The copies the loss's reductions run on (``Comm.all_reduce`` and ``Comm.report``
    reduce a clone of their input, which autograd may still hold): one kernel each,
    reading and writing its bytes. 0 without a reduction or on a flat cluster."""
    if ctx.cluster.device is None or not colls:
        return 0.0
    work = PhaseWork(0.0, 2.0 * sum(c.bytes for c in colls), len(colls))
    return phase_seconds(work, ctx.cluster.device, "float32")


def tied_source(graph, op: Op) -> Op | None:
    """The embedding whose table a tied op uses: a linear head (transposed), or a later
    embedding looking up the same table (T5's decoder reads its encoder's); or None."""
    if op.weight is None:
        return None
    shape = op.weight.shape[::-1] if op.kind is OpKind.LINEAR else op.weight.shape
    for cand in graph.ops:
        if cand is not op and cand.kind is OpKind.EMBEDDING and cand.weight is not None \
                and not cand.attrs.get("tied") and cand.weight.shape == shape:
            return cand
    return None


def tie_transposes(op: Op) -> bool:
    """Whether a tied op sees the table transposed (a head ``x @ Eᵀ``; a second embedding
    looks it up as it is)."""
    return op.kind is OpKind.LINEAR


def transposed(layout: Layout) -> Layout:
    """A 2-D layout seen on the transposed tensor (S(0) ↔ S(1))."""
    swap = {Split(0): Split(1), Split(1): Split(0)}
    return Layout(layout.fact, tuple(swap.get(pl, pl) for pl in layout.placements))


def tied_exchange(emb_weight: Layout, head_weight: Layout, table: TensorSpec,
                  cluster: Cluster, transpose: bool = True
                  ) -> tuple[Redistribution, Redistribution]:
    """A tied table's gradient exchange on one device set, as the runtime runs it after
    weight-gradient synchronisation: the head's gradient (transposed, unless the tied op
    is an embedding: :func:`tie_transposes`) is brought to the embedding's layout, the two
    are added, and the sum is brought back to the head's layout. Both copies then take the
    same update. Gradients move in the master dtype: ``table`` is the embedding's
    :attr:`~ilp_planner.ir.graph.Op.master_spec`."""
    head_t = transposed(head_weight) if transpose else head_weight
    return (plan_redistribution(head_t, emb_weight, table, cluster),
            plan_redistribution(emb_weight, head_t, table, cluster))


def tied_passes_seconds(emb_weight: Layout, head_weight: Layout, table: TensorSpec,
                        cluster: Cluster, transpose: bool = True) -> float:
    """The runtime's own passes of a head's tied exchange on one stage beside its two
    programs (:meth:`runtime.tied.TiedWeights._on_one_stage`, float32 gradients): the
    head's gradient copied transposed and contiguous (read, write its block ``h``), added to
    the embedding's (read two blocks ``e``, write one), the sum brought back copied
    transposed again — 3 kernels, ``4 · (4h + 3e)`` bytes. 0 on a flat cluster, and for a
    tied embedding (no transpose), which the runtime does not exchange this way."""
    if cluster.device is None or not transpose:
        return 0.0
    h = math.prod(head_weight.padded_shape(table.shape[::-1]))
    e = math.prod(emb_weight.padded_shape(table.shape))
    work = PhaseWork(0.0, float(MASTER_ITEMSIZE * (4 * h + 3 * e)), 3)
    return phase_seconds(work, cluster.device, "float32")


def cross_stage_tied_passes_seconds(layout: Layout, table: TensorSpec, head: bool,
                                    devices: int, cluster: Cluster) -> float:
    """The runtime's own passes of one side of a tied table's exchange across two stages
    beside its collectives (:meth:`runtime.tied.TiedWeights._across_stages`, float32, ``T``
    the table's elements): on every device of the stage but its first, its contribution
    zeroed (one fill, ``4T`` bytes written) — priced for those, the stage's slowest, where
    the stage has more than one device; the head's side (``head``: its gradient seen as
    ``table``, the embedding's shape transposed) made contiguous in the embedding's
    orientation (one copy, ``8T``) and its block cut back from the sum's transpose (one copy
    of its block ``b``, ``8b``, unless that block holds one vocabulary entry); the
    embedding's block cut where it splits the table's columns (``8b``, unless it holds one
    row). 0 on a flat cluster."""
    if cluster.device is None:
        return 0.0
    whole = math.prod(table.shape)
    local = layout.padded_shape(table.shape)
    block = math.prod(local)
    kernels, moved = 0, 0.0
    if devices > 1:
        kernels, moved = 1, 4.0 * whole
    if head:
        kernels, moved = kernels + 1, moved + 8.0 * whole
        cut = local[1] > 1
    else:
        cut = local[0] > 1 and local[1] < table.shape[1]
    if cut:
        kernels, moved = kernels + 1, moved + 8.0 * block
    if not kernels:
        return 0.0
    return phase_seconds(PhaseWork(0.0, moved, kernels), cluster.device, "float32")


def tied_exchange_seconds(emb_weights: Sequence[Layout], head_weights: Sequence[Layout],
                          table: TensorSpec, cluster: Cluster, transpose: bool = True
                          ) -> np.ndarray:
    """Seconds of :func:`tied_exchange` for every (embedding weight, head weight) pair,
    without building step lists (the ILP's edge matrix between the two layers), with
    :func:`tied_passes_seconds`."""
    heads_t = [transposed(h) if transpose else h for h in head_weights]
    planner = planner_for(heads_t[0], cluster)
    passes = np.array([[tied_passes_seconds(e, h, table, cluster, transpose)
                        for h in head_weights] for e in emb_weights]).reshape(
                            len(emb_weights), len(head_weights))
    return (planner.forward_costs(heads_t, emb_weights, table).T
            + planner.forward_costs(emb_weights, heads_t, table) + passes)


def tied_exchange_collectives(emb_weight: Layout, head_weight: Layout, table: TensorSpec,
                              cluster: Cluster, transpose: bool = True
                              ) -> tuple[tuple[Collective, ...], float]:
    """:func:`tied_exchange`'s collectives, once a step, and the seconds of its slices'
    copies (:attr:`~ilp_planner.lowering.redistribution.RedistStep.local_s`) and of the
    runtime's passes around them (:func:`tied_passes_seconds`)."""
    to_emb, back = tied_exchange(emb_weight, head_weight, table, cluster, transpose)
    return (tuple(c.with_phase("step", "tied_weight") for c in to_emb.forward + back.forward),
            to_emb.local_forward_s + back.local_forward_s
            + tied_passes_seconds(emb_weight, head_weight, table, cluster, transpose))




def loss_axes(layout: Layout, rank: int = 2) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(class-splitting axes, row-splitting axes) of the logits layout, size-1 axes aside."""
    vocab = tuple(a for a in layout.split_axes(rank - 1) if layout.fact[a].size > 1)
    rows = tuple(a for a in layout.split_axes(0) if layout.fact[a].size > 1)
    return vocab, rows


def loss_memory(logits: TensorSpec, layout: Layout) -> float:
    """Bytes the runtime's cross-entropy (:func:`runtime.ops.loss`) holds on the local block
    of ``logits`` beyond what the memory model's convention charges (every op's output held,
    the logits as their producer's): one float32 copy of the logits, turned into
    ``exp(z − max)`` in place and kept for the backward, which turns it into the gradient in
    place — 4 bytes a logit at the forward's end (the logits still referenced) and at the
    backward's start (the logits freed, the gradient's cast to their dtype allocated). The
    loss this replaced (``z − max`` and its ``exp`` both kept, two float32 gradients summed)
    put a 124M GPT's peak on an H200 4.12 GiB above the model without a loss term, about 10.7
    bytes a logit (``benchmarks/gpu_check.py``)."""
    return LOSS_ITEMSIZE * layout.local_bytes(logits) / logits.itemsize


def follower_held_bytes(op: Op, read: TensorSpec, read_layout: Layout, out: Layout) -> float:
    """What a follower holds per micro-batch: its output's local block (none for an
    identity dropout, whose output is its input), and for a loss its float32 statistics
    (:func:`loss_memory`) — the one rule the ILP's memory row and the plan's per-layer
    memory both use."""
    if op.is_identity:
        return 0.0
    held = out.local_bytes(op.output)
    return held + loss_memory(read, read_layout) if op.kind is OpKind.LOSS else held


def loss_collectives(logits: TensorSpec, layout: Layout, ctx: StrategyContext) -> tuple[Collective, ...]:
    """Mean cross-entropy on sharded logits, as the runtime issues it: with the class dim
    split (vocab-parallel), a MAX AllReduce of the row maxima and one AllReduce of the two
    per-row sums (Σexp, target logit) over the class axes; with rows split, the scalar
    mean is a partial sum AllReduced over the row axes. No backward collective: the
    gradient of each statistic is replicated."""
    vocab, rows = loss_axes(layout, logits.rank)
    local_rows = layout.padded_shape(logits.shape)[0]
    out = []
    if vocab:
        for n in (local_rows, 2 * local_rows):
            out.append(coll(CollectiveKind.ALL_REDUCE, layout.fact, vocab, n * LOSS_ITEMSIZE, ctx,
                             "forward", "loss"))
    if rows:
        out.append(coll(CollectiveKind.ALL_REDUCE, layout.fact, rows, LOSS_ITEMSIZE, ctx,
                         "forward", "loss"))
    return tuple(out)


def follower_inputs(op: Op, layout: Layout, tensor: TensorSpec) -> tuple[Layout, ...]:
    """The layouts a follower may read its producer's output in: one of
    :func:`partial_resolutions`; a loss marked ``whole_classes`` (the user's own loss code,
    imported models) reads its logits with the class dim gathered, since only a vocabulary-
    parallel loss the runtime writes itself can work on split classes."""
    if op.kind is OpKind.LOSS and op.attrs.get("whole_classes"):
        return (Layout(layout.fact, tuple(B if isinstance(pl, Partial) or pl == Split(1) else pl
                                          for pl in layout.placements)),)
    return partial_resolutions(layout, tensor)


def partial_resolutions(layout: Layout, tensor: TensorSpec) -> tuple[Layout, ...]:
    """The layouts a follower may read a partial-sum output in: reduce-scattered
    (:func:`resolve_partial`), all-reduced to replicated on the partial axes, or, for a 2-D
    activation, reduce-scattered onto its tokens (Megatron's sequence parallelism: the
    row-parallel linear's output lands split over the sequence). None is cheaper in
    general — a vocabulary-parallel loss wants its logits reduce-scattered, a small head's
    loss wants them all-reduced (one collective, none in the loss) — so the ILP chooses."""
    if not layout.has_partial:
        return (layout,)
    scattered = resolve_partial(layout, tensor)
    reduced = Layout(layout.fact, tuple(B if isinstance(pl, Partial) else pl
                                        for pl in layout.placements))
    out = [scattered, reduced]
    if tensor.rank == 2:  # Megatron-SP: reduce-scattered onto the tokens (sequence parallel)
        out.append(resolve_partial(layout, tensor, order=(0,)))
    return tuple(dict.fromkeys(out))


def resolve_partial(layout: Layout, tensor: TensorSpec,
                    order: tuple[int, ...] | None = None) -> Layout:
    """Partial sums resolved by reduce-scatter (what a stage export sends; one of a
    follower's :func:`partial_resolutions`): each partial axis reduce-scattered onto the
    feature dim (the last dim of a 2-D activation, the channel dim of an (N, C, H, W)
    feature map, then the batch dim) when it still divides, else all-reduced — keeping the
    data split, never splitting the spatial dims no strategy accepts."""
    if not layout.has_partial:
        return layout
    if order is None:
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
