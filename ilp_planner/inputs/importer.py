"""Plan the user's own PyTorch model: ``nn.Module`` → layer graph, through ``torch.export``.

The exported (training-IR) graph is walked node by node and lifted to the planner's IR
(:mod:`ilp_planner.ir.graph`), whose activations are ``(tokens, features)`` (leading dims
folded into tokens) or ``(N, C, H, W)`` for convolutional ones:

* ``linear`` (and ``x @ W`` with a parameter ``W``) → ``linear`` with the weight as
  ``(in, out)``; ``embedding`` → ``embedding`` (a position table looked up with constant
  ids and added to it folds into it, as the builders' GPT); ``layer_norm`` / ``rms_norm``
  (and a hand-written RMSNorm: a last-dim mean, then a product with a 1-D gain) →
  ``layernorm`` / ``rmsnorm``; ``conv2d``, ``batch_norm``, pooling, ``flatten``;
* ``scaled_dot_product_attention`` and hand-written attention (``q @ kᵀ``, mask, softmax,
  ``· v``) → one ``attention`` op reading the projections its q, k, v come from (one fused
  tensor or three), with heads, sequence length, grouped-query ``kv_heads`` and the fused
  layout (``[q | k | v]`` blocks are not whole heads: ``qkv_major``, batch splits only).
  Views, transposes, splits, casts, rotary embeddings and masks between a projection and
  the attention are folded into it;
* element-wise ops of one activation (``gelu``, ``relu``, ``silu``, ``dropout``) become
  followers, others (scales, casts, biases) fold into the op they follow — with no FLOPs of
  their own, as the builders count only matmuls in linears and attention; a sum /
  difference / product of two activations → ``add`` / ``mul``;
* the loss: ``loss_fn(output)`` traced with the model, or (without ``loss_fn``) the mean
  cross-entropy of the output over its last dim, the runtime's convention.

An op the planner cannot shard becomes ``opaque``: kept replicated, its inputs gathered,
listed by ``validate`` (:func:`ilp_planner.reports.summary.unsharded_summary`). Repeated blocks —
children ``i`` of a
``ModuleList`` / ``Sequential`` of one class whose ops have the same signature — are marked
``block`` / ``block_index`` so tying applies. Op names are the user's module paths
(``transformer.h.3.attn.c_attn``; functional ops inside a module get ``<path>.<kind>``), and
each op lists the parameters it owns (``Op.source_params``) so a plan can be applied back to
the module (:mod:`ilp_planner.parallelize`).

``torch.fx`` symbolic tracing is the fallback where ``torch.export`` fails: the traced
``GraphModule`` (whose Python control flow tracing has resolved) is exported again; where
neither works the error names both failures.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ilp_planner.errors import ConfigError
from ilp_planner.ir.graph import Graph, Op, OpKind, TensorSpec

_DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
           "float64": "float64", "int64": "int64", "int32": "int32"}

# aten ops that only re-view, copy, cast or pick parts of one tensor
_VIEWS = frozenset({
    "view", "_unsafe_view", "reshape", "transpose", "permute", "contiguous", "clone", "t",
    "expand", "unsqueeze", "squeeze", "alias", "detach", "to", "_to_copy", "type_as",
    "repeat_interleave", "repeat", "select", "slice", "narrow", "flatten", "lift_fresh_copy",
    "view_as", "reshape_as", "expand_as", "float", "half", "bfloat16", "unflatten",
})
_SPLITS = frozenset({"split", "split_with_sizes", "chunk", "unbind", "tensor_split"})
_UNARY_FOLD = frozenset({
    "neg", "mul", "div", "add", "sub", "pow", "rsqrt", "sqrt", "exp", "tanh", "sigmoid",
    "masked_fill", "where", "clamp", "abs", "log", "log_softmax", "scale", "true_divide",
    "reciprocal", "cos", "sin", "erf", "rsub",
})
_FOLLOWERS = {"gelu": OpKind.GELU, "relu": OpKind.RELU, "relu_": OpKind.RELU,
              "silu": OpKind.SILU, "silu_": OpKind.SILU, "dropout": OpKind.DROPOUT,
              "native_dropout": OpKind.DROPOUT, "feature_dropout": OpKind.DROPOUT}
_REDUCTIONS = frozenset({"mean", "sum", "var", "amax", "std"})
_LOSSES = frozenset({"cross_entropy_loss", "nll_loss", "mse_loss", "l1_loss",
                     "binary_cross_entropy_with_logits", "smooth_l1_loss", "huber_loss",
                     "nll_loss_nd"})
_IGNORED = frozenset({  # checks and in-place buffer updates (BatchNorm's batch counter)
    "_assert_tensor_metadata", "_assert_scalar", "sym_size", "sym_constrain_range_for_size",
    "add_", "copy_",
})
_IMAGE_KINDS = (OpKind.CONV2D, OpKind.POOL, OpKind.BATCHNORM)


@dataclass(frozen=True)
class _Const:
    """A value not derived from the model's inputs: parameters (``params``), buffers,
    masks, position ids, rotary tables."""

    params: tuple[str, ...] = ()
    table_of_positions: int = 0  # rows of a position table looked up by constant ids
    transposed: bool = False  # a 2-D parameter's transpose (``x @ E.t()``: a tied head)


@dataclass(frozen=True)
class _Act:
    """A tensor derived from the model's inputs: the IR ops it derives from (``src``), its
    real shape and the view / fold steps since (``chain``)."""

    src: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    chain: tuple[tuple, ...] = ()
    role: str = ""  # "scores" / "probs": the two halves of hand-written attention
    parts: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


@dataclass
class _Draft:
    """An IR op under construction (ops are frozen once the walk is over)."""

    name: str
    kind: OpKind
    inputs: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    weight: tuple[int, ...] | None = None
    params: int = 0
    flops: float = 0.0
    attrs: dict[str, int] = field(default_factory=dict)
    source_params: tuple[str, ...] = ()
    scope: tuple[tuple[str, str], ...] = ()


def _dtype(t: Any) -> str:
    name = str(t.dtype).removeprefix("torch.")
    return _DTYPES.get(name, "float32")


def _opname(target: Any) -> str:
    if target is operator.getitem:
        return "getitem"
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def _numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def _tokens_major(shape: Sequence[int]) -> tuple[int, ...]:
    """Leading dims folded into tokens: ``(B, T, C) → (B·T, C)``."""
    shape = tuple(int(d) for d in shape)
    if len(shape) <= 2:
        return shape or (1,)
    return (_numel(shape[:-1]), shape[-1])


class _Lifter:
    """One walk over an exported graph, building the IR ops."""

    def __init__(self, module: Any, strip: str = "", dtensor: bool = True):
        self.module = module
        self.strip = strip
        self.dtensor = dtensor
        self.drafts: dict[str, _Draft] = {}
        self.values: dict[str, Any] = {}
        self.param_of: dict[str, str] = {}  # placeholder name -> parameter FQN
        self.param_shape: dict[str, tuple[int, ...]] = {}
        self.owner: dict[str, str] = {}  # parameter FQN -> first op using it
        self.counters: dict[str, int] = {}

    # -- naming --------------------------------------------------------------------------

    def _scope(self, node: Any) -> tuple[tuple[str, str], ...]:
        stack = node.meta.get("nn_module_stack") or {}
        out = []
        for path, cls in stack.values():
            path = path.removeprefix(self.strip) if path != self.strip.rstrip(".") else ""
            if path:
                out.append((path, cls if isinstance(cls, str) else getattr(cls, "__name__", "")))
        return tuple(out)

    def _name(self, node: Any, label: str, main: bool) -> str:
        """The module path for a leaf module's own op (``main``); ``<path>.<kind>[_i]``
        otherwise — counted per scope, so repeated blocks get the same suffixes."""
        scope = self._scope(node)
        path = scope[-1][0] if scope else ""
        if main and path and path not in self.drafts and self._is_leaf(path):
            return path
        base = f"{path}.{label}" if path else label
        n = self.counters.get(base, 0)
        self.counters[base] = n + 1
        name = base if n == 0 else f"{base}_{n}"
        while name in self.drafts:
            n += 1
            self.counters[base] = n + 1
            name = f"{base}_{n}"
        return name

    def _is_leaf(self, path: str) -> bool:
        try:
            sub = self.module.get_submodule(path)
        except AttributeError:
            return False
        return not any(True for _ in sub.children())

    # -- building ------------------------------------------------------------------------

    def add(self, node: Any, kind: OpKind, inputs: Sequence[str], shape: Sequence[int],
            dtype: str, *, weight: tuple[int, ...] | None = None, params: Sequence[str] = (),
            flops: float = 0.0, main: bool = True, label: str | None = None,
            **attrs: int) -> _Act:
        name = self._name(node, label or kind.value, main)
        owned = tuple(p for p in params if p not in self.owner)
        for p in owned:
            self.owner[p] = name
        shape = tuple(int(d) for d in shape)
        self.drafts[name] = _Draft(
            name, kind, tuple(dict.fromkeys(inputs)), shape, dtype, weight,
            sum(_numel(self.param_shape[p]) for p in owned), float(flops), dict(attrs), owned,
            self._scope(node))
        return _Act((name,), shape, dtype)

    def ir(self, node: Any, x: Any) -> str:
        """The IR op whose output ``x`` is (re-viewed); materialise one if it is not."""
        if isinstance(x, _Act) and len(x.src) == 1:
            d = self.drafts[x.src[0]]
            if _numel(d.shape) == _numel(x.shape):
                if d.kind is OpKind.INPUT:
                    return d.name
                if d.kind in _IMAGE_KINDS or self._is_image(d):
                    if len(x.shape) == 4:
                        return d.name
                    if len(x.shape) == 2 and x.shape[0] == d.shape[0]:
                        act = self.add(node, OpKind.FLATTEN, [d.name], x.shape, x.dtype,
                                       main=False)
                        return act.src[0]
                elif x.shape[-1] == d.shape[-1] or len(x.shape) == 1:
                    return d.name
        if not isinstance(x, _Act):
            raise _Unsupported(node, "reads a value that does not depend on the model's inputs")
        act = self.add(node, OpKind.OPAQUE, list(x.src), _tokens_major(x.shape), x.dtype,
                       flops=float(_numel(x.shape)), main=False)
        return act.src[0]

    def _is_image(self, d: _Draft) -> bool:
        return len(d.shape) == 4 and d.kind is not OpKind.INPUT

    # -- the walk ------------------------------------------------------------------------

    def lift(self, ep: Any) -> None:
        sig = ep.graph_signature
        params = dict(sig.inputs_to_parameters)
        buffers = dict(sig.inputs_to_buffers)
        consts = dict(getattr(sig, "inputs_to_lifted_tensor_constants", {}) or {})
        for node in ep.graph.nodes:
            if node.op == "placeholder":
                val = node.meta.get("val")
                if node.name in params:
                    fqn = params[node.name].removeprefix(self.strip)
                    self.param_of[node.name] = fqn
                    self.param_shape[fqn] = tuple(val.shape)
                    self.values[node.name] = _Const((fqn,))
                elif node.name in buffers or node.name in consts:
                    self.values[node.name] = _Const()
                elif hasattr(val, "shape"):
                    self.values[node.name] = self._input(node, val)
                else:
                    self.values[node.name] = _Const()
            elif node.op == "call_function":
                self.values[node.name] = self.visit(node)
            elif node.op == "output":
                self.outputs = [self.values.get(getattr(a, "name", ""), _Const())
                                for a in _flat(node.args)]

    def _input(self, node: Any, val: Any) -> _Act:
        shape = tuple(int(d) for d in val.shape)
        dtype = _dtype(val)
        spec_shape = shape if len(shape) == 4 else (
            (_numel(shape),) if dtype.startswith("int") else _tokens_major(shape))
        self.drafts[node.name] = _Draft(node.name, OpKind.INPUT, (), spec_shape, dtype)
        return _Act((node.name,), shape, dtype)

    def arg(self, a: Any) -> Any:
        name = getattr(a, "name", None)
        return self.values.get(name, _Const()) if name is not None else a

    def visit(self, node: Any) -> Any:
        op = _opname(node.target)
        args = [self.arg(a) for a in node.args]
        kwargs = {k: self.arg(v) for k, v in node.kwargs.items()}
        val = node.meta.get("val")
        acts = [a for a in _flat(args) + list(kwargs.values()) if isinstance(a, _Act)]
        if op == "getitem":
            seq, idx = args[0], args[1]
            return seq[idx] if isinstance(seq, (list, tuple)) else _Const()
        if op in _IGNORED or val is None:
            return _Const()
        if not acts:  # nothing here depends on the inputs
            return self._const(op, args, val)
        handler = getattr(self, f"_op_{op}", None)
        if handler is not None:
            return handler(node, args, kwargs, val)
        if op in _FOLLOWERS:
            return self._follower(node, _FOLLOWERS[op], args[0], val)
        if op in _VIEWS:
            return self._view(node, op, args, val)
        if op in _SPLITS:
            return self._split(node, op, args, val)
        if op in _LOSSES:
            return self._loss(node, acts[0], val)
        if op in ("softmax", "_softmax", "_safe_softmax"):
            return self._softmax(node, args[0], val)
        if op in _REDUCTIONS:
            return self._reduce(node, op, args, val)
        if op in _UNARY_FOLD:
            return self._fold(node, op, args, acts, val)
        if op in ("cat", "stack"):
            return self._cat(node, acts, val)
        return self._opaque(node, acts, val, op)

    def _const(self, op: str, args: list, val: Any) -> Any:
        if op == "embedding" and isinstance(args[0], _Const) and args[0].params:
            return _Const(args[0].params, int(self.param_shape[args[0].params[0]][0]))
        params = tuple(p for a in _flat(args) if isinstance(a, _Const) for p in a.params)
        if op in ("t", "transpose", "permute") and isinstance(args[0], _Const) \
                and len(args[0].params) == 1 and len(self.param_shape[args[0].params[0]]) == 2:
            return _Const(args[0].params, transposed=not args[0].transposed)
        if op in _VIEWS and isinstance(args[0], _Const) and args[0].transposed:
            return args[0]
        if isinstance(val, (list, tuple)):
            return [_Const(params) for _ in val]
        return _Const(params)

    # -- handlers ----------------------------------------------------------------------

    def _param(self, c: Any) -> str | None:
        return c.params[0] if isinstance(c, _Const) and len(c.params) == 1 else None

    def _op_linear(self, node, args, kwargs, val) -> _Act:
        x, w = args[0], args[1]
        b = args[2] if len(args) > 2 else kwargs.get("bias")
        wname = self._param(w)
        if wname is None or not isinstance(x, _Act):
            return self._opaque(node, [a for a in (x, w) if isinstance(a, _Act)], val, "linear")
        n, k = self.param_shape[wname]
        return self._linear(node, x, wname, self._param(b), k, n, val, stored_t=True)

    def _linear(self, node, x: _Act, wname: str, bname: str | None, k: int, n: int,
                val, stored_t: bool = False) -> _Act:
        """``x (tokens, k) × W (k, n)``; a weight an embedding already owns is its tied head."""
        src = self.ir(node, x)
        tokens = _numel(val.shape) // n
        tied = wname in self.owner and self.drafts[self.owner[wname]].kind is OpKind.EMBEDDING
        owned = [p for p in (wname, bname) if p is not None]
        # ``weight_t``: the module stores the weight (out, in), as nn.Linear does
        act = self.add(node, OpKind.LINEAR, [src], (tokens, n), _dtype(val), weight=(k, n),
                       params=owned, flops=2.0 * tokens * k * n, bias=int(bname is not None),
                       tied=int(tied), **({"weight_t": 1} if stored_t else {}))
        if tied:
            d = self.drafts[act.src[0]]
            d.source_params = (wname,) + d.source_params
        return _Act(act.src, tuple(val.shape), act.dtype)

    def _matmul(self, node, args, kwargs, val) -> _Act:
        a, b = args[0], args[1]
        if isinstance(a, _Act) and isinstance(b, _Const) and self._param(b) \
                and len(self.param_shape[self._param(b)]) == 2:
            w = self._param(b)
            k, n = self.param_shape[w][::-1] if b.transposed else self.param_shape[w]
            return self._linear(node, a, w, None, k, n, val)
        if isinstance(a, _Act) and isinstance(b, _Act):
            if a.role == "probs":
                return self._attention(node, a.parts["q"], a.parts["k"], b, val)
            if len(a.shape) == 4 and len(b.shape) == 4:
                return _Act(tuple(dict.fromkeys(a.src + b.src)), tuple(val.shape), _dtype(val),
                            role="scores",
                            parts=MappingProxyType({"q": a, "k": b}))
        acts = [x for x in (a, b) if isinstance(x, _Act)]
        return self._opaque(node, acts, val, _opname(node.target))

    _op_matmul = _op_bmm = _op_mm = _matmul

    def _op_scaled_dot_product_attention(self, node, args, kwargs, val) -> _Act:
        return self._attention(node, args[0], args[1], args[2], val)

    def _attention(self, node, q: _Act, k: _Act, v: _Act, val) -> _Act:
        batch, heads, seq, hd = (int(d) for d in q.shape)
        srcs = list(dict.fromkeys(q.src + k.src + v.src))
        if not all(isinstance(x, _Act) and len(x.src) == 1 for x in (q, k, v)) \
                or any(self.drafts[s].kind is OpKind.INPUT for s in srcs):
            return self._opaque(node, [q, k, v], val, "attention")
        # grouped-query attention repeats k / v heads after the projection: count them there
        kv_heads = self.drafts[k.src[0]].shape[-1] // hd if len(srcs) == 3 else heads
        # the user's attention runs under DTensor (Plan.parallelize), whose 4-D matmul
        # cannot merge a batch split with a head split: one or the other
        attrs: dict[str, int] = {"heads": heads, "seq_len": seq}
        if self.dtensor:
            attrs["one_split"] = 1
        if kv_heads != heads:
            attrs["kv_heads"] = kv_heads
        if len(srcs) == 1 and not _head_major(q.chain):
            attrs["qkv_major"] = 1
        tokens = batch * seq
        flops = 4.0 * tokens * seq * heads * hd  # the two matmuls, as the builders count
        act = self.add(node, OpKind.ATTENTION, srcs, (tokens, heads * hd), _dtype(val),
                       flops=flops, **attrs)
        # the output is (batch, heads, seq, d): re-viewed to (tokens, h) before use
        return _Act(act.src, tuple(val.shape), act.dtype, chain=(("heads_out",),))

    def _op_embedding(self, node, args, kwargs, val) -> _Act:
        w, ids = args[0], args[1]
        wname = self._param(w)
        if wname is None or not isinstance(ids, _Act):
            return self._opaque(node, [a for a in (w, ids) if isinstance(a, _Act)], val,
                                "embedding")
        vocab, h = self.param_shape[wname]
        src = self.ir(node, ids)
        tokens = _numel(val.shape) // h
        act = self.add(node, OpKind.EMBEDDING, [src], (tokens, h), _dtype(val), weight=(vocab, h),
                       params=[wname], flops=float(tokens * h), vocab=vocab)
        return _Act(act.src, tuple(val.shape), act.dtype)

    def _op_layer_norm(self, node, args, kwargs, val) -> _Act:
        x = args[0]
        w = self._param(args[2]) if len(args) > 2 else None
        b = self._param(args[3]) if len(args) > 3 else None
        return self._norm(node, x, val, OpKind.LAYERNORM, [p for p in (w, b) if p],
                          **({} if b is not None else {"bias": 0}))

    def _op_rms_norm(self, node, args, kwargs, val) -> _Act:
        w = self._param(args[2]) if len(args) > 2 else None
        return self._norm(node, args[0], val, OpKind.RMSNORM, [w] if w else [])

    def _norm(self, node, x, val, kind: OpKind, params: list[str], **attrs: int) -> _Act:
        src = self.ir(node, x)
        shape = _tokens_major(val.shape)
        act = self.add(node, kind, [src], shape, _dtype(val), params=params,
                       flops=8.0 * _numel(shape), **attrs)
        return _Act(act.src, tuple(val.shape), act.dtype)

    def _op_batch_norm(self, node, args, kwargs, val) -> Any:
        x = args[0]
        params = [p for p in (self._param(args[1]), self._param(args[2])) if p]
        src = self.ir(node, x)
        out = val[0] if isinstance(val, (list, tuple)) else val
        act = self.add(node, OpKind.BATCHNORM, [src], tuple(out.shape), _dtype(out),
                       params=params, flops=8.0 * _numel(out.shape))
        res = _Act(act.src, tuple(out.shape), act.dtype)
        return [res, _Const(), _Const(), _Const(), _Const()] if isinstance(val, (list, tuple)) \
            else res

    _op__native_batch_norm_legit_functional = _op__native_batch_norm_legit = _op_batch_norm
    _op__native_batch_norm_legit_no_training = _op_batch_norm

    def _op_conv2d(self, node, args, kwargs, val) -> _Act:
        x, w = args[0], args[1]
        wname = self._param(w)
        b = self._param(args[2]) if len(args) > 2 else None
        if wname is None:
            return self._opaque(node, [x], val, "conv2d")
        src = self.ir(node, x)
        c_out, c_in, kh, kw = self.param_shape[wname]
        act = self.add(node, OpKind.CONV2D, [src], tuple(val.shape), _dtype(val),
                       weight=(c_out, c_in, kh, kw), params=[p for p in (wname, b) if p],
                       flops=2.0 * _numel(val.shape) * c_in * kh * kw, kernel=int(kw))
        return _Act(act.src, tuple(val.shape), act.dtype)

    _op_convolution = _op_conv2d

    def _pool(self, node, args, val, avg: bool) -> Any:
        out = val[0] if isinstance(val, (list, tuple)) else val
        src = self.ir(node, args[0])
        kernel = max(1, int(self.drafts[src].shape[-1]) // int(out.shape[-1]))
        attrs = {"kernel": kernel, **({"avg": 1} if avg else {})}
        act = self.add(node, OpKind.POOL, [src], tuple(out.shape), _dtype(out),
                       flops=float(_numel(self.drafts[src].shape)), **attrs)
        res = _Act(act.src, tuple(out.shape), act.dtype)
        return [res, _Const()] if isinstance(val, (list, tuple)) else res

    def _op_max_pool2d(self, node, args, kwargs, val) -> Any:
        return self._pool(node, args, val, avg=False)

    _op_max_pool2d_with_indices = _op_max_pool2d

    def _op_avg_pool2d(self, node, args, kwargs, val) -> Any:
        return self._pool(node, args, val, avg=True)

    _op_adaptive_avg_pool2d = _op__adaptive_avg_pool2d = _op_avg_pool2d

    def _follower(self, node, kind: OpKind, x: Any, val) -> Any:
        out = val[0] if isinstance(val, (list, tuple)) else val
        if isinstance(x, _Act) and x.role:
            return x  # dropout on attention probabilities folds into the attention
        src = self.ir(node, x)
        d = self.drafts[src]
        shape = d.shape if _numel(d.shape) == _numel(out.shape) else _tokens_major(out.shape)
        act = self.add(node, kind, [src], shape, _dtype(out), flops=float(_numel(out.shape)))
        res = _Act(act.src, tuple(out.shape), act.dtype)
        return [res, _Const()] if isinstance(val, (list, tuple)) else res

    def _view(self, node, op: str, args, val) -> Any:
        x = args[0]
        if not isinstance(x, _Act):
            return _Const()
        step = (op,) + tuple(a for a in args[1:] if isinstance(a, (int, list, tuple)))
        return _Act(x.src, tuple(val.shape), _dtype(val), x.chain + (step,), x.role, x.parts)

    def _split(self, node, op: str, args, val) -> list:
        x = args[0]
        dim = args[2] if len(args) > 2 else (args[1] if op == "unbind" and len(args) > 1 else 0)
        return [_Act(x.src, tuple(v.shape), _dtype(v), x.chain + ((op, int(dim) % len(x.shape),
                                                                    i),))
                for i, v in enumerate(val)]

    def _softmax(self, node, x: _Act, val) -> _Act:
        if x.role == "scores":
            return _Act(x.src, tuple(val.shape), _dtype(val), x.chain, "probs", x.parts)
        return self._layerwise(node, OpKind.SOFTMAX, x, val)

    def _layerwise(self, node, kind: OpKind, x: _Act, val) -> _Act:
        src = self.ir(node, x)
        act = self.add(node, kind, [src], _tokens_major(val.shape), _dtype(val),
                       flops=5.0 * _numel(val.shape))
        return _Act(act.src, tuple(val.shape), act.dtype)

    def _reduce(self, node, op: str, args, val) -> _Act:
        x = args[0]
        if not val.shape or _numel(val.shape) == 1:  # a scalar: the loss
            return self._loss(node, x, val)
        dims = args[1] if len(args) > 1 else None
        last = isinstance(dims, (list, tuple)) and len(dims) == 1 and \
            int(dims[0]) % len(x.shape) == len(x.shape) - 1
        step = ("reduce_last",) if last else ("reduce",)
        return _Act(x.src, tuple(val.shape), _dtype(val), x.chain + (step,), x.role, x.parts)

    def _loss(self, node, x: _Act, val) -> _Act:
        src = self.ir(node, x)
        n = _numel(self.drafts[src].shape)
        # the user's loss code runs on the output as DTensor sees it: no vocabulary-parallel
        # loss, so the plan gathers split classes before it (strategies.follower_inputs)
        act = self.add(node, OpKind.LOSS, [src], (1,), "float32", flops=3.0 * n,
                       **({"whole_classes": 1} if self.dtensor else {}))
        return act

    def _fold(self, node, op: str, args, acts: list[_Act], val) -> _Act:
        """An element-wise op: folded into its activation's chain, a norm, or a binary op."""
        shape, dtype = tuple(val.shape), _dtype(val)
        consts = [a for a in args if isinstance(a, _Const)]
        if len(acts) == 1:
            x = acts[0]
            gain = next((self._param(c) for c in consts if self._param(c)), None)
            if gain is not None and op == "mul" and any(s[0] == "reduce_last" for s in x.chain) \
                    and self.param_shape[gain] == (shape[-1],) and len(x.src) == 1:
                return self._norm(node, _Act(x.src, shape, dtype), val, OpKind.RMSNORM, [gain])
            pos = next((c for c in consts if c.table_of_positions), None)
            if pos is not None and op == "add" and len(x.src) == 1 \
                    and self.drafts[x.src[0]].kind is OpKind.EMBEDDING:
                d = self.drafts[x.src[0]]
                d.attrs["seq_len"] = pos.table_of_positions
                new = tuple(p for p in pos.params if p not in self.owner)
                for p in new:
                    self.owner[p] = d.name
                d.source_params += new
                d.params += sum(_numel(self.param_shape[p]) for p in new)
                return _Act(x.src, shape, dtype)
            for c in consts:  # a bias or scale parameter belongs to the op it follows
                for p in c.params:
                    if p not in self.owner and len(x.src) == 1:
                        d = self.drafts[x.src[0]]
                        self.owner[p] = d.name
                        d.source_params += (p,)
                        d.params += _numel(self.param_shape[p])
                        if d.kind is OpKind.LINEAR and self.param_shape[p] == (d.shape[-1],):
                            d.attrs["bias"] = 1
            return _Act(x.src, shape, dtype, x.chain + ((op,),), x.role, x.parts)
        a, b = acts[0], acts[1]
        if set(a.src) == set(b.src) and (a.chain or b.chain):  # rotary, normalisation steps
            role = a.role or b.role
            parts = a.parts or b.parts
            return _Act(a.src, shape, dtype, a.chain + b.chain + ((op,),), role, parts)
        if a.role or b.role:  # an additive mask on attention scores
            x = a if a.role else b
            return _Act(x.src, shape, dtype, x.chain, x.role, x.parts)
        kind = OpKind.ADD if op in ("add", "sub", "rsub") else (
            OpKind.MUL if op in ("mul", "div", "true_divide") else OpKind.OPAQUE)
        srcs = [self.ir(node, a), self.ir(node, b)]
        image = all(len(self.drafts[s].shape) == 4 for s in srcs)
        out = shape if image else _tokens_major(shape)
        act = self.add(node, kind, srcs, out, dtype, flops=float(_numel(shape)),
                       label=op if kind is OpKind.OPAQUE else None)
        return _Act(act.src, shape, dtype)

    def _cat(self, node, acts: list[_Act], val) -> _Act:
        srcs = tuple(dict.fromkeys(s for a in acts for s in a.src))
        if len(set(a.src for a in acts)) == 1:  # rotate-half style: parts of one tensor
            a = acts[0]
            return _Act(a.src, tuple(val.shape), _dtype(val), a.chain + (("cat",),), a.role,
                        a.parts)
        return self._opaque(node, [_Act(srcs, tuple(val.shape), _dtype(val))], val, "cat")

    def _opaque(self, node, acts: list, val, op: str) -> Any:
        out = val[0] if isinstance(val, (list, tuple)) else val
        srcs = [self.ir(node, a) for a in acts if isinstance(a, _Act)]
        shape = tuple(out.shape)
        spec = shape if len(shape) == 4 else _tokens_major(shape)
        params = [p for a in _flat([self.arg(x) for x in node.args]) if isinstance(a, _Const)
                  for p in a.params]
        act = self.add(node, OpKind.OPAQUE, srcs, spec, _dtype(out), params=params,
                       flops=float(_numel(shape)), label=op)
        res = _Act(act.src, shape, act.dtype)
        return [res] + [_Const() for _ in val[1:]] if isinstance(val, (list, tuple)) else res


class _Unsupported(Exception):
    def __init__(self, node: Any, why: str):
        super().__init__(f"op {node.name!r} ({_opname(node.target)}): {why}")


def _flat(xs: Any) -> list:
    out = []
    for x in xs:
        if isinstance(x, (list, tuple)):
            out.extend(_flat(x))
        else:
            out.append(x)
    return out


def _head_major(chain: tuple[tuple, ...]) -> bool:
    """Whether q reaches a fused projection by picking, per head, one of q / k / v — the
    projection is ``[head0: q k v | head1: …]`` — rather than one ``[q | k | v]`` third."""
    for step in chain:
        if step[0] in _SPLITS and step[1] is not None:
            return False  # split first along the features: [q | k | v] blocks
        if step[0] in ("view", "_unsafe_view", "reshape") and len(step) > 1:
            shape = step[1]
            return isinstance(shape, (list, tuple)) and len(shape) >= 4
    return False


# -- blocks -----------------------------------------------------------------------------


def _block_of(scope: tuple[tuple[str, str], ...]) -> tuple[str, int] | None:
    """The outermost ``<container>.<i>`` module on the op's scope."""
    for path, _ in scope:
        head, _, last = path.rpartition(".")
        if last.isdigit():
            return head or "", int(last)
    return None


def _mark_blocks(drafts: list[_Draft]) -> dict[str, tuple[str, int]]:
    """Blocks of one container whose ops have the majority signature; others stay untied."""
    members: dict[tuple[str, int], list[_Draft]] = {}
    for d in drafts:
        b = _block_of(d.scope)
        if b is not None:
            members.setdefault(b, []).append(d)
    sigs: dict[tuple[str, int], tuple] = {}
    for (block, i), ds in members.items():
        prefix = f"{block}.{i}." if block else f"{i}."
        sigs[(block, i)] = tuple(
            (d.name.removeprefix(prefix), d.kind, d.shape, d.weight, tuple(sorted(d.attrs.items())),
             tuple(_rel(x, prefix) for x in d.inputs)) for d in ds)
    out: dict[str, tuple[str, int]] = {}
    by_block: dict[str, list[int]] = {}
    for block, i in members:
        by_block.setdefault(block, []).append(i)
    for block, idx in by_block.items():
        counts: dict[tuple, int] = {}
        for i in idx:
            counts[sigs[(block, i)]] = counts.get(sigs[(block, i)], 0) + 1
        best, n = max(counts.items(), key=lambda kv: kv[1])
        if n < 2:
            continue
        for i in idx:
            if sigs[(block, i)] == best:
                for d in members[(block, i)]:
                    out[d.name] = (block or "blocks", i)
    return out


def _rel(name: str, prefix: str) -> str:
    return name.removeprefix(prefix) if name.startswith(prefix) else "<outside>"


# -- entry point ------------------------------------------------------------------------


def from_module(module: Any, example_inputs: Any, *,
                loss_fn: Callable[[Any], Any] | None = None, name: str | None = None,
                dtensor: bool = True) -> Graph:
    """The layer graph of ``module`` run on ``example_inputs`` (a tensor, a tuple of them, or
    a mapping of keyword arguments), through ``torch.export``; ``torch.fx`` symbolic tracing
    where export fails. ``loss_fn(output) → scalar`` is traced with the model; without it the
    loss is the mean cross-entropy over the output's last dim. Tensors may live on the
    ``meta`` device (a 1B-parameter model imports without allocating it).

    ``dtensor`` (default): the plan will run on this module under ``Plan.parallelize``,
    where the user's own code runs on DTensors — so attention splits the batch or the heads,
    not both (DTensor's 4-D matmul cannot merge the two splits: ``attrs.one_split``), and the
    user's loss reads its logits with whole classes (``attrs.whole_classes``). False gives
    the bare graph, as the builders would (the runtime's own executor runs it)."""
    import torch

    args, kwargs = _split_inputs(example_inputs)
    root, strip = module, ""
    if loss_fn is not None:
        root, strip = _WithLoss(module, loss_fn), "model."
    ep = _export(root, args, kwargs, torch)
    lifter = _Lifter(module, strip, dtensor)
    try:
        lifter.lift(ep)
    except _Unsupported as exc:
        raise ConfigError(f"cannot import {type(module).__name__}: {exc}") from None
    outs = [o for o in lifter.outputs if isinstance(o, _Act)]
    if not outs:
        raise ConfigError(f"cannot import {type(module).__name__}: its output does not depend "
                          f"on the example inputs")
    last = lifter.drafts[outs[0].src[0]]
    if last.kind is not OpKind.LOSS:
        node = _Synthetic("loss")
        lifter._loss(node, outs[0], None)
    drafts = list(lifter.drafts.values())
    blocks = _mark_blocks(drafts)
    ops = []
    for d in drafts:
        block, index = blocks.get(d.name, (None, None))
        weight = TensorSpec(d.weight, d.dtype) if d.weight is not None else None
        ops.append(Op(d.name, d.kind, d.inputs, TensorSpec(d.shape, d.dtype), weight, d.params,
                      d.flops, block, index, MappingProxyType(dict(d.attrs)),
                      source_params=d.source_params))
    return Graph(name or type(module).__name__, ops)


class _Synthetic:
    """A stand-in node for ops the importer adds itself (the default loss)."""

    def __init__(self, name: str):
        self.name = name
        self.target = name
        self.meta: dict = {}
        self.args: tuple = ()


def _split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (list, tuple)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _export(root: Any, args: tuple, kwargs: dict, torch: Any) -> Any:
    try:
        return torch.export.export(root, args, kwargs, strict=False)
    except Exception as export_error:  # noqa: BLE001 - any export failure: try fx next
        try:
            traced = torch.fx.symbolic_trace(root)
            return torch.export.export(traced, args, kwargs, strict=False)
        except Exception as fx_error:  # noqa: BLE001 - report both
            raise ConfigError(
                f"cannot import {type(root).__name__}: torch.export failed ({_first_line(export_error)}) "
                f"and torch.fx symbolic tracing failed too ({_first_line(fx_error)})") from None


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _with_loss_class() -> type:
    import torch

    class WithLoss(torch.nn.Module):
        """The user's module followed by their loss, so both trace as one program."""

        def __init__(self, model: Any, loss_fn: Callable[[Any], Any]):
            super().__init__()
            self.model = model
            self.loss_fn = loss_fn

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return self.loss_fn(self.model(*args, **kwargs))

    return WithLoss


def _WithLoss(model: Any, loss_fn: Callable[[Any], Any]) -> Any:  # noqa: N802 - a factory
    return _with_loss_class()(model, loss_fn)
