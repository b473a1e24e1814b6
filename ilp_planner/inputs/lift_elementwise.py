"""Lifting the ops between the weighted layers: followers (activations, dropout), views and
splits, softmax, reductions, element-wise arithmetic, concatenation and losses — and the
values that do not depend on the inputs at all.

Most of these fold into the activation they act on (a step of its ``chain``) rather than
becoming IR ops: the builders count FLOPs only in linears and attention, and the chain is
what lets attention and a hand-written RMSNorm be recognised later. :data:`ELEMENTWISE_HANDLERS`
maps aten op names to the handlers for the walk's table (:mod:`ilp_planner.inputs.lifting`).
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import Any

from ilp_planner.inputs.lift_graph import DraftGraph, Handler
from ilp_planner.inputs.lift_layers import bias_table_of, lift_norm
from ilp_planner.inputs.lift_masks import OTHER, after_step
from ilp_planner.inputs.lift_values import (
    CASTS,
    CONCATS,
    COPIES,
    FOLLOWERS,
    LOSSES,
    REDUCTIONS,
    RESHAPES,
    SOFTMAXES,
    SPLITS,
    UNARY_FOLDS,
    VIEWS,
    Act,
    Call,
    Const,
    dtype_of,
    first_output,
    flatten,
    ir_shape,
    numel,
    param_name,
    tokens_major,
)
from ilp_planner.ir.graph import OpKind, elementwise_reads, position_table_attr


def lift_const(g: DraftGraph, call: Call) -> Any:
    """A value none of the model's inputs flows into; it remembers the parameters it came
    from, a position-table lookup and a weight's transpose (a tied head reads ``E.t()``)."""
    op, args, val = call.op, call.args, call.val
    if op == "embedding" and isinstance(args[0], Const) and args[0].params:
        return Const(args[0].params, int(g.param_shape[args[0].params[0]][0]))
    # each parameter once: ``x + x`` of a constant must not double its list (a ViT's
    # residual adds would otherwise grow it without bound)
    params = tuple(dict.fromkeys(p for a in flatten(args) if isinstance(a, Const)
                                 for p in a.params))
    if _swaps_2d(op, args[1:]) and isinstance(args[0], Const) and len(args[0].params) == 1 \
            and len(g.param_shape.get(args[0].params[0], ())) == 2:
        return Const(args[0].params, transposed=not args[0].transposed)
    if op in VIEWS and isinstance(args[0], Const):
        return args[0]  # a re-viewed (cast, sliced) table or transpose stays what it was
    if isinstance(val, (list, tuple)):
        return [Const(params) for _ in val]
    return Const(params)


def _swaps_2d(op: str, dims: list[Any]) -> bool:
    """Whether ``op`` with ``dims`` transposes a 2-D tensor: ``t``, ``.T`` (``numpy_T``),
    ``.mT``, ``transpose`` / ``swapaxes`` of its two dims, ``permute(1, 0)`` — not a
    ``transpose(0, 0)`` or ``permute(0, 1)``, which leave it as it is."""
    if op in ("t", "numpy_T", "numpy_mT", "mT", "adjoint"):
        return True
    if op in ("transpose", "swapaxes", "swapdims") and len(dims) == 2:
        return int(dims[0]) % 2 != int(dims[1]) % 2
    if op == "permute" and dims:
        return [int(d) % 2 for d in dims[0]] == [1, 0]
    return False


def _follower(kind: OpKind) -> Handler:
    """The handler of an element-wise op of one activation that stays an op of its own."""

    def lift_follower(g: DraftGraph, call: Call) -> Any:
        x, val = call.args[0], call.val
        out = first_output(val)
        identity = kind is OpKind.DROPOUT and not _drops(call)
        if isinstance(x, Act) and x.role:  # dropout on attention probabilities folds into
            # the attention, which prices it where it drops anything (``probs_dropout``)
            if kind is not OpKind.DROPOUT or identity:
                return x
            res = dataclasses.replace(x, parts=MappingProxyType({**x.parts,
                                                                 "dropout": call.node}))
            return [res, Const()] if isinstance(val, (list, tuple)) else res
        src = g.ir(call.node, x)
        d = g.drafts[src]
        shape = d.shape if numel(d.shape) == numel(out.shape) else ir_shape(out.shape,
                                                                             dtype_of(out))
        # a dropout that drops nothing stays an op (a module boundary ``parallelize`` may
        # run a program at) marked ``identity``: torch returns its input, so it costs and
        # holds nothing
        # a dropout under parallelize draws its whole mask on every rank
        # (runtime.local_dropout): priced so (``whole_mask``)
        marks = {"identity": 1} if identity else (
            {"whole_mask": 1} if kind is OpKind.DROPOUT and g.dtensor else {})
        act = g.add(call.node, kind, [src], shape, dtype_of(out),
                    flops=0.0 if identity else float(numel(out.shape)), **marks)
        res = Act(act.src, tuple(out.shape), act.dtype)
        return [res, Const()] if isinstance(val, (list, tuple)) else res

    return lift_follower


def _drops(call: Call) -> bool:
    """Whether a traced ``dropout(x, p, train)`` drops anything: p > 0 in training (an
    evaluated model, or p = 0, traces the call but runs an identity)."""
    p = call.args[1] if len(call.args) > 1 else call.kwargs.get("p", 0.5)
    train = call.args[2] if len(call.args) > 2 else call.kwargs.get("train", True)
    return isinstance(p, (int, float)) and p > 0 and train is not False


def lift_view(g: DraftGraph, call: Call) -> Any:
    """A re-view of one activation: a step of its chain."""
    x, val = call.args[0], call.val
    if not isinstance(x, Act):
        return Const()
    step = (call.op,) + tuple(a for a in call.args[1:] if isinstance(a, (int, list, tuple)))
    moves = copies(call) and not _fused_tokens_major(x, tuple(val.shape))
    steps = x.steps + (call.node,) if moves else x.steps
    return Act(x.src, tuple(val.shape), dtype_of(val), x.chain + (step,), x.role, x.parts,
               steps)


def _fused_tokens_major(x: Act, shape: tuple[int, ...]) -> bool:
    """Whether ``x`` is SDPA's output re-viewed tokens-major — ``(b, s, h, d)`` or
    ``(b, s, h·d)`` by transposes and views alone — which a fused kernel (flash,
    memory-efficient: what a GPU runs) already wrote in that order, so making it contiguous
    moves nothing; the export's meta may say otherwise where it traced the math fallback
    (a dropout or a mask on the CPU)."""
    if not x.chain or x.chain[0][:2] != ("heads_out", "fused"):
        return False
    b, h, s, d = x.chain[0][2]
    return all(step[0] in _LAYOUT_VIEWS for step in x.chain[1:]) and \
        shape in ((b, s, h, d), (b, s, h * d), (b * s, h * d))


# re-views that only reorder or regroup dims (no slice, no repeat, no cast)
_LAYOUT_VIEWS = frozenset({"transpose", "permute", "view", "_unsafe_view", "reshape",
                           "contiguous", "clone", "flatten", "unflatten"})


def copies(call: Call) -> bool:
    """Whether a folded re-view really moves bytes — a kernel of its own that reads its
    input and writes its output — as the exported program's meta (shapes, strides, dtypes)
    says: a clone, a repeat, a cast to another dtype, ``contiguous`` of a non-contiguous
    tensor, a reshape torch cannot express as a view (a transposed or expanded input: GQA's
    repeated key / value heads). Views, transposes and same-dtype casts are free (but
    ``_to_copy`` and ``to(copy=True)``, which copy whatever the dtype)."""
    src = call.node.args[0].meta.get("val") if call.node.args else None
    out = call.val
    if src is None or not hasattr(src, "stride") or not hasattr(out, "shape"):
        return False
    if call.op in COPIES:
        return True
    if call.op in CASTS:
        return src.dtype != out.dtype or _forced(call)
    if call.op == "contiguous":
        return not src.is_contiguous()
    if call.op in RESHAPES:
        return not viewable(tuple(src.shape), tuple(src.stride()), tuple(out.shape))
    return False


def _forced(call: Call) -> bool:
    """Whether a cast copies even to its input's dtype: ``_to_copy`` always allocates, and
    ``to(..., copy=True)`` asks it to (a plain ``to`` of the same dtype returns its input)."""
    if call.op == "_to_copy":
        return True
    schema = getattr(call.node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if "copy" not in names:
        return False
    i = names.index("copy")
    return (call.node.args[i] if i < len(call.node.args)
            else call.node.kwargs.get("copy", False)) is True


def viewable(shape: tuple[int, ...], stride: tuple[int, ...], new: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` / ``stride`` can be re-viewed as ``new`` without a copy
    (torch's own rule, ``at::detail::computeStride``: each run of dims contiguous with each
    other must map onto whole dims of the new shape)."""
    if not shape or numel(shape) == 0:
        return True
    view_d, base = len(new) - 1, stride[-1]
    tensor_numel = view_numel = 1
    for d in range(len(shape) - 1, -1, -1):
        tensor_numel *= shape[d]
        if d == 0 or (shape[d - 1] != 1 and stride[d - 1] != tensor_numel * base):
            while view_d >= 0 and (view_numel < tensor_numel or new[view_d] == 1):
                view_numel *= new[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return False
            if d > 0:
                base, tensor_numel, view_numel = stride[d - 1], 1, 1
    return view_d == -1


def lift_index(g: DraftGraph, call: Call) -> Any:
    """``x[..., [i], :]``: constant indices picking features of a ≥ 3-D activation, its
    batch and sequence dims (0, 1) whole — Falcon's key and value heads picked from its
    fused ``query_key_value`` — is a copy folded into the value (rows stay on their
    devices), priced with the op reading it; any other indexing is an opaque op."""
    x, idx = call.args[0], call.args[1] if len(call.args) > 1 else ()
    picks = [i for i, a in enumerate(idx) if a is not None]
    if not isinstance(x, Act) or len(x.shape) < 3 or not picks or min(picks) < 2 \
            or any(not isinstance(idx[i], Const) or idx[i].params for i in picks):
        return g.opaque(call.node, call.args, call.acts, call.val, call.op)
    return Act(x.src, tuple(call.val.shape), dtype_of(call.val),
               x.chain + (("index", *picks),), x.role, x.parts, x.steps + (call.node,))


def lift_split(g: DraftGraph, call: Call) -> list:
    """The parts of one activation, each remembering its dim, its index, how many equal
    parts there are (0 where they differ) and the split's node (whose module names a part
    op): q / k / v of a fused projection, gate and up of a fused MLP."""
    op, args = call.op, call.args
    x = args[0]
    dim = args[2] if len(args) > 2 else (args[1] if op == "unbind" and len(args) > 1 else 0)
    equal = len({tuple(v.shape) for v in call.val}) == 1
    return [Act(x.src, tuple(v.shape), dtype_of(v),
                x.chain + ((op, int(dim) % len(x.shape), i, len(call.val) if equal else 0,
                            call.node),),
                steps=x.steps)
            for i, v in enumerate(call.val)]


def lift_softmax(g: DraftGraph, call: Call) -> Act:
    """Softmax of attention scores (over the keys) makes them probabilities; any other is
    an op."""
    x, val = call.args[0], call.val
    if x.role == "scores":
        dim = call.args[1] if len(call.args) > 1 else call.kwargs.get("dim", -1)
        parts = MappingProxyType({**x.parts, "softmax": call.node}) \
            if int(dim) % len(x.shape) == len(x.shape) - 1 else \
            MappingProxyType({**x.parts, "mask": OTHER, "softmax": call.node})
        # its steps stay with it: the attention prices the copies among them (a cast)
        return Act(x.src, tuple(val.shape), dtype_of(val), x.chain, "probs", parts,
                   x.steps)
    src = g.ir(call.node, x)
    act = g.add(call.node, OpKind.SOFTMAX, [src], tokens_major(val.shape), dtype_of(val),
                flops=5.0 * numel(val.shape))
    return Act(act.src, tuple(val.shape), act.dtype)


def lift_reduction(g: DraftGraph, call: Call) -> Act:
    """A reduction to a scalar is the loss; over the last dim, a step a hand-written
    RMSNorm is recognised by."""
    x, val = call.args[0], call.val
    if not val.shape or numel(val.shape) == 1:  # a scalar: the loss
        return g.loss(call.node, x)
    dims = call.args[1] if len(call.args) > 1 else None
    last = isinstance(dims, (list, tuple)) and len(dims) == 1 and \
        int(dims[0]) % len(x.shape) == len(x.shape) - 1
    step = ("reduce_last",) if last else ("reduce",)
    return Act(x.src, tuple(val.shape), dtype_of(val), x.chain + (step,), x.role,
               _other_on_role(x), x.steps + (call.node,))


def lift_loss(g: DraftGraph, call: Call) -> Act:
    return g.loss(call.node, call.acts[0])


def lift_arithmetic(g: DraftGraph, call: Call) -> Act:
    """An element-wise op: folded into its activation's chain, a norm, or a binary op; one
    reading three activations (``where(x > 0, a, b)`` with both branches computed, as
    Apertus's xIELU does) an opaque op reading all three — before, the third was dropped,
    and the ops computing it were planned unused."""
    acts = call.acts
    if len(acts) == 1:
        return _fold_into(g, call, acts[0])
    if len(acts) > 2 and not any(a.role for a in acts):
        # (with attention scores among them, a mask from the inputs: as below, where the
        # scores keep their attention)
        return g.opaque(call.node, call.args, acts, call.val, call.op)
    return _combine(g, call, acts[0], acts[1])


def _fold_into(g: DraftGraph, call: Call, x: Act) -> Act:
    """One activation with constants: a gain after a last-dim mean is an RMSNorm, a
    position table added to an embedding folds into it, a bias / scale parameter belongs to
    the op it follows; the op itself becomes a step of the chain."""
    op, val = call.op, call.val
    shape, dtype = tuple(val.shape), dtype_of(val)
    consts = [a for a in call.args if isinstance(a, Const)]
    gain = next((param_name(c) for c in consts if param_name(c)), None)
    if gain is not None and op == "mul" and any(s[0] == "reduce_last" for s in x.chain) \
            and g.param_shape[gain] == (shape[-1],) and len(x.src) == 1:
        # its own steps' copies (HF's casts to float32 and back) run before it: its to price
        return lift_norm(g, call.node, Act(x.src, shape, dtype, x.chain, steps=x.steps), val,
                         OpKind.RMSNORM, [gain])
    pos = next((c for c in consts if c.table_of_positions), None)
    if pos is not None and op == "add" and len(x.src) == 1 \
            and g.drafts[x.src[0]].kind is OpKind.EMBEDDING and len({g.trains(p) for p in (
                *pos.params, *g.drafts[x.src[0]].source_params)}) == 1:
        # (a frozen table on a trained one — Marian's sinusoidal positions — is an op of
        # its own below: one op's parameters train alike)
        d = g.drafts[x.src[0]]
        if g.adopt(d, pos.params):
            d.attrs[position_table_attr(d.attrs)] = pos.table_of_positions
        return Act(x.src, shape, dtype)
    params = [p for c in consts for p in c.params if p not in g.owner]
    added = [p for c in consts for p in c.params]
    table = bias_table_of(g, added, shape) if x.role == "scores" and op == "add" else None
    if table is not None and set(added) == {table}:
        # a learned (buckets, heads) table added to hand-written scores (T5's, MPNet's
        # relative position bias): the attention reading these scores takes it, as SDPA's
        # mask (lift_layers._attention)
        parts = MappingProxyType({**x.parts, "bias_table": table,
                                  "mask": after_step(g.constants, call, x)})
        return Act(x.src, shape, dtype, x.chain + ((op,),), x.role, parts,
                   x.steps + (call.node,))
    if params and x.role:
        # on attention scores (another parameter than a bias table): the scores' one
        # producer takes it where it prices it; with two (q and k), or one that would not
        # price it (LeViT's qkv batch norm), no op owns it, and ``parallelize`` refuses the
        # table (an embedding's) or its first gradient
        d = g.drafts[x.src[0]] if len(x.src) == 1 else None
        if d is not None and _priced_by(g, d, op, params) and g.adopt(d, params) \
                and d.kind is OpKind.LINEAR:
            d.attrs["bias"] = 1
    elif params:
        d = g.drafts[x.src[0]] if len(x.src) == 1 else None
        if d is None or not _priced_by(g, d, op, params):
            # a parameter no role of the op before prices (ConvNeXt's layer scale, a
            # ``γ · x`` after its linear): an op of its own owns it, so it is priced and
            # placed, never dropped or handed to an op that would not price it
            return g.opaque(call.node, call.args, [x], val, op)
        g.adopt(d, params)
        if d.kind is OpKind.LINEAR:
            d.attrs["bias"] = 1
    parts = x.parts
    if x.role:  # a step on attention scores: a scale, a mask (lift_masks), or another
        mask = after_step(g.constants, call, x) if x.role == "scores" else OTHER
        parts = MappingProxyType({**x.parts, "mask": mask})
    # a step with a parameter (a bias, a gain) is the op's that owns it, priced there
    own = () if any(c.params for c in consts) else (call.node,)
    return Act(x.src, shape, dtype, x.chain + ((op,),), x.role, parts, x.steps + own)


def _priced_by(g: DraftGraph, d: Any, op: str, params: list[str]) -> bool:
    """Whether op ``d`` prices ``params`` applied to its output once it owns them: an
    opaque op prices whatever it owns (ViT's position table, added to its class token's
    ``cat``); a linear a bias added to it (one vector of its output width, where it has
    none yet) — for ``parallelize`` only its own module's: another module's (Qwen3.5's
    ``a + dt_bias`` after its linear ``in_proj_a``) is added by that module's code after
    the linear's boundary has converted the output for its readers, so the plan's bias,
    in the linear's layout before that conversion, is not what runs (the two met on
    different meshes) — an op of its own owns it."""
    if d.kind is OpKind.OPAQUE:
        return True
    return d.kind is OpKind.LINEAR and op == "add" and not d.attrs.get("bias") \
        and len(params) == 1 and g.param_shape[params[0]] == (d.shape[-1],) \
        and (not g.dtensor or _module_of(params[0]) in map(_module_of, d.source_params[:1]))


def _module_of(param: str) -> str:
    """The path of the module holding parameter ``param``."""
    return param.rpartition(".")[0]


def _combine(g: DraftGraph, call: Call, a: Act, b: Act) -> Act:
    """Two activations: steps of one tensor (rotary, normalisation), a mask on attention
    scores, or a sum / product that becomes an ``add`` / ``mul`` op."""
    op, val = call.op, call.val
    shape, dtype = tuple(val.shape), dtype_of(val)
    if a.role or b.role:  # a mask computed from the inputs (padding) on attention scores
        x, other = (a, b) if a.role else (b, a)
        if _floating(call, other) and g.carries([s for s in other.src if s not in x.src]):
            # a value from trained ops of its own (a learned gate on the probabilities) is
            # no mask: an opaque op reading both keeps its producer on the path to the loss
            return g.opaque(call.node, call.args, [a, b], val, op)
        return Act(x.src, shape, dtype, x.chain, x.role, _other_on_role(x),
                   _joined(x.steps, call.node))
    if set(a.src) == set(b.src) and (a.chain or b.chain):  # rotary, normalisation steps
        return Act(a.src, shape, dtype, a.chain + b.chain + ((op,),), a.role or b.role,
                   a.parts or b.parts, _joined(a.steps + b.steps, call.node))
    kind = OpKind.ADD if op in ("add", "sub", "rsub") else (
        OpKind.MUL if op in ("mul", "div", "true_divide") else OpKind.OPAQUE)
    srcs = [g.ir(call.node, a), g.ir(call.node, b)]
    image = all(len(g.drafts[s].shape) == 4 for s in srcs)
    out = shape if image else ir_shape(shape, dtype)
    if not all(elementwise_reads(g.drafts[s].shape, out) for s in srcs):
        # an image's per-channel statistic on its flattened tokens (ConvNeXt-V2's GRN
        # scaling (b·h·w, c) by (b, 1, 1, c)): no element-wise strategy lays that out
        kind = OpKind.OPAQUE
    act = g.add(call.node, kind, srcs, out, dtype, flops=float(numel(shape)),
                label=op if kind is OpKind.OPAQUE else None)
    return Act(act.src, shape, dtype)


def lift_new_empty(g: DraftGraph, call: Call) -> Act:
    """A fresh tensor shaped like an activation (``x.new_empty(shape)``), which the model
    then fills slice by slice (DeepSeek's MLA writes its key states, the heads' own part and
    the rotary part every head shares, into one): it stands for its template until written
    (:func:`write_into`), and remembers its node (``parts["buffer"]``)."""
    x, val = call.args[0], call.val
    return Act(x.src, tuple(val.shape), dtype_of(val), x.chain + (("new_empty",),),
               parts=MappingProxyType({"buffer": call.node.name}))


def write_into(g: DraftGraph, dest: Act, src: Any, node: Any) -> Any:
    """``dest.copy_(src)`` (``node``) into a slice of a :func:`lift_new_empty` buffer: the
    buffer now also derives from ``src`` — a concatenation, as ``cat`` of parts is — so its
    readers read the ops it was filled from, and price the copy (a step of the buffer's:
    MLA's shared rotary key written into every head's slice reads its stored elements once
    and writes them per head). Returns the buffer's new value."""
    name = dest.parts["buffer"]
    buf = g.values[name]
    if not isinstance(src, Act):
        return buf
    filled = Act(tuple(dict.fromkeys(buf.src + src.src)), buf.shape, buf.dtype,
                 buf.chain + src.chain + (("cat",),), parts=buf.parts,
                 steps=_joined(buf.steps + src.steps, node))
    g.values[name] = filled
    return filled


def _joined(steps: tuple[Any, ...], node: Any = None) -> tuple[Any, ...]:
    """Element-wise kernels of joined values, each once, then ``node``'s own."""
    return tuple(dict.fromkeys(steps + ((node,) if node is not None else ())))


def _floating(call: Call, x: Act) -> bool:
    """Whether argument ``x`` of ``call`` is a floating-point tensor (a boolean mask, even
    one compared from an activation, carries no gradient)."""
    i = next(i for i, arg in enumerate(call.args) if arg is x)
    val = getattr(call.node.args[i], "meta", {}).get("val")
    return bool(getattr(getattr(val, "dtype", None), "is_floating_point", False))


def _other_on_role(x: Act) -> Any:
    """``x``'s parts, its mask unknown where it is attention scores or probabilities: a
    step :mod:`ilp_planner.inputs.lift_masks` cannot prove to keep plain attention."""
    return MappingProxyType({**x.parts, "mask": OTHER}) if x.role else x.parts


def lift_concat(g: DraftGraph, call: Call) -> Any:
    """Parts of one tensor put back together (rotate-half) stay it; activations joined with
    parameters (a ViT's class token) or with each other become an opaque op that owns those
    parameters, so they are priced and applied rather than dropped as constants."""
    acts, val = call.acts, call.val
    with_params = any(isinstance(a, Const) and a.params for a in flatten(call.args))
    if len(set(a.src for a in acts)) == 1 and not with_params:
        a = acts[0]
        return Act(a.src, tuple(val.shape), dtype_of(val), a.chain + (("cat",),), a.role,
                   _other_on_role(a) if len(acts) > 1 else a.parts,
                   _joined(tuple(s for x in acts for s in x.steps), call.node))
    return g.opaque(call.node, call.args, acts, val, call.op)


ELEMENTWISE_HANDLERS: dict[str, Handler] = {
    **{op: _follower(kind) for op, kind in FOLLOWERS.items()},
    **dict.fromkeys(VIEWS, lift_view),
    **dict.fromkeys(SPLITS, lift_split),
    **dict.fromkeys(LOSSES, lift_loss),
    **dict.fromkeys(SOFTMAXES, lift_softmax),
    **dict.fromkeys(REDUCTIONS, lift_reduction),
    **dict.fromkeys(UNARY_FOLDS, lift_arithmetic),
    **dict.fromkeys(CONCATS, lift_concat),
    "new_empty": lift_new_empty,
    "index": lift_index,
}
