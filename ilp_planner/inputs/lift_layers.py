"""Lifting the ops that carry the model's weights: linear (and ``x @ W``), attention (fused
and hand-written), embedding, norms, convolution, batch norm and pooling.

Each handler reads one :class:`~ilp_planner.inputs.lift_values.Call` and returns the node's
value; :data:`LAYER_HANDLERS` maps aten op names to them for the walk's dispatch table
(:mod:`ilp_planner.inputs.lifting`). An op whose weight is not a parameter, or whose inputs
the planner cannot read, becomes opaque.
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import Any

from ilp_planner.inputs.lift_graph import DraftGraph, Handler, head_group
from ilp_planner.inputs.lift_masks import CAUSAL, NO_MASK, sdpa_mask
from ilp_planner.inputs.lift_values import (
    SPLITS,
    Act,
    Call,
    Const,
    dtype_of,
    first_output,
    numel,
    param_name,
    tokens_major,
)
from ilp_planner.ir.graph import OpKind


def lift_linear(g: DraftGraph, call: Call) -> Any:
    args = call.args
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else call.kwargs.get("bias")
    wname = param_name(w)
    if wname is None or not isinstance(x, Act):
        return g.opaque(call.node, call.args, [a for a in (x, w) if isinstance(a, Act)],
                        call.val, "linear")
    # F.linear reads W as (out, in): the parameter itself, or stored (in, out) and
    # transposed in the call (``F.linear(x, W.t())``)
    n, k = g.param_shape[wname][::-1] if w.transposed else g.param_shape[wname]
    return _linear(g, call.node, x, wname, param_name(b), k, n, call.val,
                   stored_t=not w.transposed)


def _linear(g: DraftGraph, node: Any, x: Act, wname: str, bname: str | None, k: int, n: int,
            val: Any, stored_t: bool = False) -> Act:
    """``x (tokens, k) × W (k, n)``; a weight an embedding already owns is its tied head."""
    src = g.ir(node, x)
    tokens = numel(val.shape) // n
    tied = wname in g.owner and g.drafts[g.owner[wname]].kind is OpKind.EMBEDDING
    owned = [p for p in (wname, bname) if p is not None]
    # ``weight_t``: the module stores the weight (out, in), as nn.Linear does
    act = g.add(node, OpKind.LINEAR, [src], (tokens, n), dtype_of(val), weight=(k, n),
                params=owned, flops=2.0 * tokens * k * n, bias=int(bname is not None),
                tied=int(tied), **({"weight_t": 1} if stored_t else {}))
    if tied:
        d = g.drafts[act.src[0]]
        d.source_params = (wname,) + d.source_params
    return Act(act.src, tuple(val.shape), act.dtype)


def lift_matmul(g: DraftGraph, call: Call) -> Any:
    """``x @ W`` with a parameter is a linear; ``q @ kᵀ`` then ``probs @ v`` are the two
    halves of hand-written attention (the first only marks its result ``scores``); the
    attention is marked ``not_plain_causal`` unless its scores were provably masked
    causally (:mod:`ilp_planner.inputs.lift_masks`)."""
    a, b, val = call.args[0], call.args[1], call.val
    w = param_name(b)
    if isinstance(a, Act) and isinstance(b, Const) and w and len(g.param_shape[w]) == 2:
        k, n = g.param_shape[w][::-1] if b.transposed else g.param_shape[w]
        return _linear(g, call.node, a, w, None, k, n, val, stored_t=b.transposed)
    if isinstance(a, Act) and isinstance(b, Act):
        if a.role == "probs":
            out = _attention(g, call, a.parts["q"], a.parts["k"], b, sdpa=False, probs=a)
            _mark_causal(g, out, a.parts.get("mask", NO_MASK) == CAUSAL)
            return out
        if len(a.shape) == 4 and len(b.shape) == 4 and not (a.role or b.role):
            # (scores that no softmax made probabilities, times values — MiniMax's
            # lightning attention — are no attention: an opaque op, whose output is no
            # scores, so what the code combines with it later stays its own value)
            # ``qk``: the product's node, priced where the scores become no attention
            # (:meth:`~ilp_planner.inputs.lift_graph.DraftGraph.ir`)
            return Act(tuple(dict.fromkeys(a.src + b.src)), tuple(val.shape), dtype_of(val),
                       role="scores", parts=MappingProxyType({"q": a, "k": b,
                                                              "qk": call.node}))
    acts = [x for x in (a, b) if isinstance(x, Act)]
    return g.opaque(call.node, call.args, acts, val, call.op)


def lift_addmm(g: DraftGraph, call: Call) -> Any:
    """``bias + x @ W``: Hugging Face's ``Conv1D`` stores ``W`` as ``(in, out)`` — the IR's
    own layout, so no ``weight_t`` — and ``nn.Linear`` traced to ``addmm(b, x, W.t())``
    stores it ``(out, in)``; either is a linear owning its weight and bias."""
    b, x, w = call.args[0], call.args[1], call.args[2]
    wname = param_name(w)
    if wname is None or not isinstance(x, Act) or len(g.param_shape[wname]) != 2:
        return g.opaque(call.node, call.args, call.acts, call.val, call.op)
    k, n = g.param_shape[wname][::-1] if w.transposed else g.param_shape[wname]
    return _linear(g, call.node, x, wname, param_name(b), k, n, call.val,
                   stored_t=w.transposed)


def lift_sdpa(g: DraftGraph, call: Call) -> Any:
    out = _attention(g, call, call.args[0], call.args[1], call.args[2], sdpa=True)
    _mark_causal(g, out, _sdpa_causal(g, call))
    p = call.args[4] if len(call.args) > 4 else call.kwargs.get("dropout_p", 0.0)
    op = _attention_op(g, out)
    if op is not None and isinstance(p, (int, float)) and p > 0:
        op.attrs["probs_dropout"] = 1  # SDPA drops its probabilities (priced; the executor
        # refuses it); under parallelize each rank draws the whole mask and runs SDPA's math
        # kernel on its blocks with its block of it (runtime.local_dropout)
        if g.dtensor:
            op.attrs.update(unfused=1, whole_mask=1)
    return out


def _attention_op(g: DraftGraph, out: Any) -> Any:
    """The attention op ``out`` comes from, or None."""
    op = g.drafts[out.src[0]] if isinstance(out, Act) and out.src else None
    return op if op is not None and op.kind is OpKind.ATTENTION else None


def _mark_causal(g: DraftGraph, out: Any, causal: bool) -> None:
    """Mark the attention op ``out`` comes from ``attrs.not_plain_causal`` unless it is
    proven plain causal: the runtime's executor, which runs only that, refuses it."""
    op = _attention_op(g, out)
    if not causal and op is not None:
        op.attrs["not_plain_causal"] = 1


def _sdpa_causal(g: DraftGraph, call: Call) -> bool:
    """Whether SDPA runs plain causal attention — ``is_causal=True`` and no mask, or no
    flag and a constant mask proven the lower triangle (Hugging Face's export hands SDPA
    its causal mask, :func:`ilp_planner.inputs.lift_masks.sdpa_mask`): what the runtime's
    executor computes; anything else (a padding mask, bidirectional attention as in BERT
    or ViT) is marked ``attrs.not_plain_causal`` for the executor to refuse."""
    def arg(i: int, name: str, default: Any) -> Any:
        return call.args[i] if len(call.args) > i else call.kwargs.get(name, default)
    causal, mask = bool(arg(5, "is_causal", False)), arg(3, "attn_mask", None)
    if mask is None:
        return causal
    node = call.node.args[3] if len(call.node.args) > 3 else call.node.kwargs.get("attn_mask")
    q, k = call.args[0], call.args[1]
    shape = tuple(q.shape[:-1]) + (int(k.shape[-2]),)
    return not causal and isinstance(mask, Const) and \
        sdpa_mask(g.constants, node, shape, call.val.dtype) == CAUSAL


def _attention(g: DraftGraph, call: Call, q: Act, k: Act, v: Act, sdpa: bool,
               probs: Any = None) -> Any:
    val = call.val
    batch, heads, seq, hd = (int(d) for d in q.shape)
    dv = int(first_output(val).shape[-1])  # v's head dim (MLA's differs from q's and k's)
    shared = _shared_key(q, k, v, heads)
    srcs = list(dict.fromkeys(q.src + k.src + v.src))
    if not (shared or all(isinstance(x, Act) and len(x.src) == 1 for x in (q, k, v))) \
            or any(g.drafts[s].kind is OpKind.INPUT for s in srcs):
        return g.opaque(call.node, call.args, [q, k, v], val, "attention")
    # grouped-query attention repeats k / v heads after the projection: count them there
    kv_heads = g.drafts[k.src[0]].shape[-1] // hd if len(srcs) == 3 and not shared else heads
    # under ``ilp_planner.parallelize`` SDPA runs on each rank's blocks, whatever mix of
    # batch and head splits (runtime.local_attention); hand-written attention runs on
    # DTensors, whose 4-D matmul cannot always merge the two: one or the other; and it runs
    # as written — its s × s scores written and read by separate kernels, never fused
    # (``unfused``: priced so whatever ``cluster.compute.attention`` says)
    attrs: dict[str, int] = {"heads": heads, "seq_len": seq}
    if g.dtensor and not sdpa:
        attrs.update(one_split=1, unfused=1)
    if isinstance(probs, Act) and probs.parts.get("dropout"):
        attrs["probs_dropout"] = 1  # its code drops probabilities (p > 0, training)
        if g.dtensor:  # each rank draws the whole mask (runtime.local_dropout)
            attrs["whole_mask"] = 1
    if kv_heads != heads:
        attrs["kv_heads"] = kv_heads
    if len(srcs) == 1 and not _head_major(q.chain, heads, numel(g.drafts[srcs[0]].shape)):
        attrs["qkv_major"] = 1
    if shared:
        attrs["shared_input"] = srcs.index(shared)
    attrs.update(input_steps(g, (q, k, v), probs, bool(attrs.get("unfused"))))
    table = _bias_table(g, call, tuple(q.shape)) if sdpa else \
        probs.parts.get("bias_table") if isinstance(probs, Act) else None
    if table is not None:
        attrs["bias_table"] = 1
    tokens = batch * seq
    # the two matmuls, as the builders count: q kᵀ over q's head dim, p v over v's
    flops = 2.0 * tokens * seq * heads * (hd + dv)
    act = g.add(call.node, OpKind.ATTENTION, srcs, (tokens, heads * dv), dtype_of(val),
                flops=flops, **attrs)
    if table is not None and g.adopt(g.drafts[act.src[0]], [table]):
        g.drafts[act.src[0]].attrs["bias_buckets"] = g.param_shape[table][0]
    # the output is (batch, heads, seq, d): re-viewed to (tokens, h) before use; SDPA's
    # fused kernels write it (batch, seq, heads, d) in memory (lift_elementwise.lift_view)
    return Act(act.src, tuple(val.shape), act.dtype,
               chain=(("heads_out", "fused", tuple(val.shape)) if sdpa else ("heads_out",),))


def input_steps(g: DraftGraph, acts: tuple[Any, ...], probs: Any = None,
                unfused: bool = False) -> dict[str, int]:
    """What the element-wise steps folded into q, k and v since their projections cost —
    rotary positions (``x·cos + rotate_half(x)·sin``, DeepSeek's complex products), a scale,
    folded copies (GQA's repeated key / value heads, a cast, ``contiguous``, rotate-half's
    ``cat``: :func:`ilp_planner.inputs.lift_elementwise.copies`) — and the copies folded
    into hand-written attention's ``probs`` (a cast after a float32 softmax) — with, where
    it runs as written (``unfused``), its scores' element-wise steps (a scale, an added or
    filled mask: the unfused formula prices only the matmuls, the softmax and a dropout) —,
    which run as kernels of their own before or inside the attention: ``attrs.input_*``
    (:func:`ilp_planner.inputs.lift_graph.folded_steps`), priced with the attention
    (:func:`ilp_planner.lowering.compute_model.folded_work`) and named by ``explain``."""
    steps = [s for a in acts if isinstance(a, Act) for s in a.steps]
    # a hand-written attention priced as written (``unfused``) runs its scores' scale and
    # mask as kernels of their own; one standing for the runtime's kernel has them inside
    nodes = g.steps_to_price(steps) + (
        g.steps_to_price(probs.steps, copies_only=not unfused) if isinstance(probs, Act)
        else [])
    return g.folded(nodes) if nodes else {}


def _shared_key(q: Any, k: Any, v: Any, heads: int) -> str | None:
    """DeepSeek's multi-head latent attention: each head's key is its own part (from the
    projection ``v`` comes from, ``kv_b_proj``) joined to a rotary part every head shares
    (from ``kv_a_proj_with_mqa``, before the low-rank up-projection). The op that shared
    part comes from, when ``k`` is built so (``attrs.shared_input``: that input is read
    whole by every head, :func:`ilp_planner.lowering.strategies.shared_input_layouts`)."""
    if not all(isinstance(x, Act) for x in (q, k, v)) or len(q.src) != 1 \
            or len(v.src) != 1 or len(k.src) != 2 or v.src[0] not in k.src \
            or q.src[0] in k.src or int(k.shape[1]) != heads:
        return None
    return next(s for s in k.src if s != v.src[0])


def _bias_table(g: DraftGraph, call: Call, shape: tuple[int, ...]) -> str | None:
    """The learned table an SDPA's additive mask looks up (T5's relative position bias:
    ``(buckets, heads)`` rows at constant bucket ids, computed by a stack's first layer and
    reused by the others), if its mask derives from exactly one (:func:`bias_table_of`;
    ``shape``: q's). The first attention to read it owns it (``attrs.bias_buckets``); every
    reader is marked ``bias_table``
    (:func:`ilp_planner.lowering.strategies.bias_table_layouts`)."""
    mask = call.args[3] if len(call.args) > 3 else call.kwargs.get("attn_mask")
    return bias_table_of(g, list(mask.params), shape) if isinstance(mask, Const) else None


def bias_table_of(g: DraftGraph, params: list[str], shape: tuple[int, ...]) -> str | None:
    """The one parameter among ``params`` that is a ``(buckets, heads)`` bias table for
    4-D attention scores (or q) of ``shape`` — what an SDPA mask or a hand-written
    ``scores + bias`` adds (:mod:`ilp_planner.inputs.lift_elementwise`) — if exactly one
    is. A square table is none: its heads could be its rows (LeViT's ``attention_biases``,
    ``(heads, offsets)``, indexed ``[:, idxs]``, with as many offsets as heads), which the
    table's owner would split as its rows."""
    tables = [p for p in dict.fromkeys(params)
              if len(shape) == 4 and len(g.param_shape[p]) == 2
              and g.param_shape[p][1] == shape[1] != g.param_shape[p][0]]
    return tables[0] if len(tables) == 1 else None


def _head_major(chain: tuple[tuple, ...], heads: int, total: int) -> bool:
    """Whether q reaches a fused projection by picking, per head, one of q / k / v — the
    projection is ``[head0: q k v | head1: …]``, viewed ``(B, T, heads, …)`` — rather than
    one ``[q | k | v]`` third (GPT-2's ``split``, Phi-3's slices ``qkv[..., :q_end]``:
    blocks of features first; Falcon's multi-query ``(B, T, heads + 2, D)``: q's heads,
    then one key and one value head). ``total``: the projection's elements, which a ``-1``
    in the view stands for the rest of (GPT-NeoX's ``view(B, T, -1, 3·D)``)."""
    for step in chain:
        if step[0] in SPLITS and step[1] is not None:
            return False  # split first along the features: [q | k | v] blocks
        if step[0] in ("slice", "narrow") and len(step) > 1:
            return False  # a slice of the features first: [q | k | v] blocks
        if step[0] in ("view", "_unsafe_view", "reshape") and len(step) > 1:
            shape = step[1]
            if not isinstance(shape, (list, tuple)) or len(shape) < 4:
                return False
            known = [int(d) for d in shape]
            if known.count(-1) == 1:
                known[known.index(-1)] = total // -math.prod(known)
            return known[2] == heads
    return False


def lift_embedding(g: DraftGraph, call: Call) -> Any:
    w, ids = call.args[0], call.args[1]
    wname = param_name(w)
    if wname is None or not isinstance(ids, Act):
        return g.opaque(call.node, call.args, [a for a in (w, ids) if isinstance(a, Act)],
                        call.val, "embedding")
    vocab, h = g.param_shape[wname]
    src = g.ir(call.node, ids)
    tokens = numel(call.val.shape) // h
    # a table an earlier embedding owns (T5's decoder looks up its encoder's): a tied copy
    tied = wname in g.owner and g.drafts[g.owner[wname]].kind is OpKind.EMBEDDING
    act = g.add(call.node, OpKind.EMBEDDING, [src], (tokens, h), dtype_of(call.val),
                weight=(vocab, h), params=[wname], flops=float(tokens * h), vocab=vocab,
                **({"tied": 1} if tied else {}))
    if tied:
        d = g.drafts[act.src[0]]
        d.source_params = (wname,) + d.source_params
    return Act(act.src, tuple(call.val.shape), act.dtype)


def lift_layer_norm(g: DraftGraph, call: Call) -> Act:
    args = call.args
    w = param_name(args[2]) if len(args) > 2 else None
    b = param_name(args[3]) if len(args) > 3 else None
    return lift_norm(g, call.node, args[0], call.val, OpKind.LAYERNORM, [p for p in (w, b) if p],
                     last_only=_over_last_dim(args[1]),
                     **({} if w is not None else {"gain": 0}),
                     **({} if b is not None else {"bias": 0}))


def lift_rms_norm(g: DraftGraph, call: Call) -> Act:
    w = param_name(call.args[2]) if len(call.args) > 2 else None
    return lift_norm(g, call.node, call.args[0], call.val, OpKind.RMSNORM, [w] if w else [],
                     last_only=_over_last_dim(call.args[1]),
                     **({} if w is not None else {"gain": 0}))


def _over_last_dim(normalized_shape: Any) -> bool:
    """Whether torch's norm normalises the last dim alone (``normalized_shape`` of one)."""
    return not isinstance(normalized_shape, (list, tuple)) or len(normalized_shape) == 1


def lift_norm(g: DraftGraph, node: Any, x: Any, val: Any, kind: OpKind, params: list[str],
              last_only: bool = True, **attrs: int) -> Act:
    """A layer / RMS norm over the last dim, owning its gain (and bias): ``attrs.gain`` /
    ``attrs.bias`` 0 for a norm without one (OLMo's parameter-free layer norm), so the op
    holds exactly the module's parameters. On a projection's value viewed per head
    (:func:`~ilp_planner.inputs.lift_graph.head_group`) it is a norm on the projection's own
    ``(tokens, heads · head_dim)`` value, each head normalised apart (``attrs.group_width``):
    no copy to another shape, and its features split in whole heads."""
    group = head_group(g.drafts[x.src[0]], x) if isinstance(x, Act) and x.src \
        and last_only else None
    # a gain of one head's width, shared by every head (Cohere's per-head gains are not)
    if group is not None and all(g.param_shape[p] == (group[0],) for p in params):
        d = g.drafts[x.src[0]]
        src = g.ir(node, Act(x.src, d.shape, x.dtype, steps=x.steps))
        shape: tuple[int, ...] = d.shape
        attrs = {**attrs, "group_width": group[0], "heads_dim": group[1]}
    else:
        src = g.ir(node, x)
        shape = tokens_major(val.shape)
    act = g.add(node, kind, [src], shape, dtype_of(val), params=params,
                flops=8.0 * numel(shape), **attrs)
    return Act(act.src, tuple(val.shape), act.dtype)


def lift_batch_norm(g: DraftGraph, call: Call) -> Any:
    args, val = call.args, call.val
    params = [p for p in (param_name(args[1]), param_name(args[2])) if p]
    src = g.ir(call.node, args[0])
    out = first_output(val)
    act = g.add(call.node, OpKind.BATCHNORM, [src], tuple(out.shape), dtype_of(out),
                params=params, flops=8.0 * numel(out.shape))
    res = Act(act.src, tuple(out.shape), act.dtype)
    return [res, Const(), Const(), Const(), Const()] if isinstance(val, (list, tuple)) else res


def lift_conv2d(g: DraftGraph, call: Call) -> Any:
    args, val = call.args, call.val
    x, wname = args[0], param_name(args[1])
    b = param_name(args[2]) if len(args) > 2 else None
    if wname is None:
        return g.opaque(call.node, call.args, [x], val, "conv2d")
    # aten.conv2d(x, w, b, stride, padding, dilation, groups); aten.convolution(x, w, b,
    # stride, padding, dilation, transposed, output_padding, groups)
    full = call.op == "convolution"
    if full and len(args) > 6 and args[6] is True:  # a transposed convolution: no family
        return g.opaque(call.node, call.args, [x], val, "conv_transpose2d")
    at = 8 if full else 6
    groups = int(args[at]) if len(args) > at and isinstance(args[at], int) else 1
    src = g.ir(call.node, x, image=True)
    c_out, c_in, kh, kw = g.param_shape[wname]
    # ``bias``: 0 for a bias-free convolution (ResNet's, before a batch norm), so the
    # op owns and is priced with exactly the module's parameters
    act = g.add(call.node, OpKind.CONV2D, [src], tuple(val.shape), dtype_of(val),
                weight=(c_out, c_in, kh, kw), params=[p for p in (wname, b) if p],
                flops=2.0 * numel(val.shape) * c_in * kh * kw, kernel=int(kw),
                **({} if b is not None else {"bias": 0}),
                **({"groups": groups} if groups > 1 else {}))
    return Act(act.src, tuple(val.shape), act.dtype)


def _pool(avg: bool) -> Handler:
    """The handler of max (``avg`` False) or average pooling; its kernel is read off the
    input and output widths, which adaptive pooling has no argument for."""

    def lift_pool(g: DraftGraph, call: Call) -> Any:
        out = first_output(call.val)
        src = g.ir(call.node, call.args[0])
        kernel = max(1, int(g.drafts[src].shape[-1]) // int(out.shape[-1]))
        attrs = {"kernel": kernel, **({"avg": 1} if avg else {})}
        act = g.add(call.node, OpKind.POOL, [src], tuple(out.shape), dtype_of(out),
                    flops=float(numel(g.drafts[src].shape)), **attrs)
        res = Act(act.src, tuple(out.shape), act.dtype)
        return [res, Const()] if isinstance(call.val, (list, tuple)) else res

    return lift_pool


LAYER_HANDLERS: dict[str, Handler] = {
    "linear": lift_linear,
    "addmm": lift_addmm,
    "matmul": lift_matmul, "bmm": lift_matmul, "mm": lift_matmul,
    "scaled_dot_product_attention": lift_sdpa,
    "embedding": lift_embedding,
    "layer_norm": lift_layer_norm,
    "rms_norm": lift_rms_norm,
    "batch_norm": lift_batch_norm, "_native_batch_norm_legit_functional": lift_batch_norm,
    "_native_batch_norm_legit": lift_batch_norm,
    "_native_batch_norm_legit_no_training": lift_batch_norm,
    "conv2d": lift_conv2d, "convolution": lift_conv2d,
    "max_pool2d": _pool(avg=False), "max_pool2d_with_indices": _pool(avg=False),
    "avg_pool2d": _pool(avg=True), "adaptive_avg_pool2d": _pool(avg=True),
    "_adaptive_avg_pool2d": _pool(avg=True),
}
