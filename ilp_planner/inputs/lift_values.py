"""What the importer's walk knows about a traced value, and the aten vocabulary it reads.

Every node of an exported graph evaluates to a :class:`Const` (nothing the model's inputs
flow into: parameters, buffers, masks, position ids) or an :class:`Act` (an activation: the
IR ops it derives from plus the view / fold steps since). The handlers decide from these two
alone, so they are defined once here for the draft graph, the handlers and the walk.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ilp_planner.ir.graph import OpKind

DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
          "float64": "float64", "int64": "int64", "int32": "int32"}

# aten ops that only re-view, copy, cast or pick parts of one tensor
VIEWS = frozenset({
    "view", "_unsafe_view", "reshape", "transpose", "permute", "contiguous", "clone", "t",
    "numpy_T",  # ``W.T`` (Falcon's ``FalconLinear``: ``x @ self.weight.T``)
    "expand", "unsqueeze", "squeeze", "alias", "detach", "to", "_to_copy", "type_as",
    "repeat_interleave", "repeat", "select", "slice", "narrow", "flatten", "lift_fresh_copy",
    "view_as", "reshape_as", "expand_as", "float", "half", "bfloat16", "unflatten",
    "view_as_complex", "view_as_real",  # DeepSeek-V2's rotary turns pairs into complex numbers
})
# the folded re-views that may move bytes (lift_elementwise.copies decides from the meta)
COPIES = frozenset({"clone", "repeat_interleave", "repeat", "lift_fresh_copy"})
CASTS = frozenset({"to", "_to_copy", "type_as", "float", "half", "bfloat16"})
RESHAPES = frozenset({"reshape", "flatten", "reshape_as", "unflatten"})
SPLITS = frozenset({"split", "split_with_sizes", "chunk", "unbind", "tensor_split"})
UNARY_FOLDS = frozenset({
    "neg", "mul", "div", "add", "sub", "pow", "rsqrt", "sqrt", "exp", "tanh", "sigmoid",
    "masked_fill", "where", "clamp", "abs", "log", "log_softmax", "scale", "true_divide",
    "reciprocal", "cos", "sin", "erf", "rsub",
})
FOLLOWERS = {"gelu": OpKind.GELU, "relu": OpKind.RELU, "relu_": OpKind.RELU,
             "silu": OpKind.SILU, "silu_": OpKind.SILU, "dropout": OpKind.DROPOUT,
             "native_dropout": OpKind.DROPOUT, "feature_dropout": OpKind.DROPOUT}
SOFTMAXES = frozenset({"softmax", "_softmax", "_safe_softmax"})
REDUCTIONS = frozenset({"mean", "sum", "var", "amax", "std"})
LOSSES = frozenset({"cross_entropy_loss", "nll_loss", "mse_loss", "l1_loss",
                    "binary_cross_entropy_with_logits", "smooth_l1_loss", "huber_loss",
                    "nll_loss_nd"})
CONCATS = frozenset({"cat", "stack"})
IGNORED = frozenset({  # checks, and copies into buffers (a cache, running statistics)
    "_assert_tensor_metadata", "_assert_scalar", "sym_size", "sym_constrain_range_for_size",
    "copy_",
})


@dataclass(frozen=True)
class Const:
    """A value not derived from the model's inputs: parameters (``params``), buffers,
    masks, position ids, rotary tables."""

    params: tuple[str, ...] = ()
    table_of_positions: int = 0  # rows of a position table looked up by constant ids
    transposed: bool = False  # a 2-D parameter's transpose (``x @ E.t()``: a tied head)


@dataclass(frozen=True)
class Act:
    """A tensor derived from the model's inputs: the IR ops it derives from (``src``), its
    real shape and the view / fold steps since (``chain``)."""

    src: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: str
    chain: tuple[tuple, ...] = ()
    role: str = ""  # "scores" / "probs": the two halves of hand-written attention
    parts: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # the element-wise kernels and copies folded into it since its op (their nodes): rotary
    # on q / k, a hand-written GELU or norm, a cast — priced by the op reading it
    # (DraftGraph.ir, lift_layers.input_steps)
    steps: tuple[Any, ...] = ()


@dataclass
class Draft:
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


@dataclass(frozen=True)
class Call:
    """One ``call_function`` node with its arguments already lifted to values: what every
    handler of :mod:`ilp_planner.inputs.lifting`'s table reads."""

    node: Any
    op: str
    args: list[Any]
    kwargs: dict[str, Any]
    val: Any  # the node's fake tensor(s): real shapes and dtypes

    @property
    def acts(self) -> list[Act]:
        """The activations among the arguments, in order."""
        return [a for a in flatten(self.args) + list(self.kwargs.values()) if isinstance(a, Act)]


class Unsupported(Exception):
    """A node the importer cannot lift even as an opaque op (it names the node)."""

    def __init__(self, node: Any, why: str):
        super().__init__(f"op {node.name!r} ({op_name(node.target)}): {why}")


def dtype_of(t: Any) -> str:
    """The IR dtype of a fake tensor (float32 for those the IR does not name)."""
    name = str(t.dtype).removeprefix("torch.")
    return DTYPES.get(name, "float32")


def op_name(target: Any) -> str:
    """The aten op's name without overload (``aten.linear.default`` → ``linear``)."""
    if target is operator.getitem:
        return "getitem"
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def numel(shape: Sequence[int]) -> int:
    return math.prod(int(d) for d in shape)


def tokens_major(shape: Sequence[int]) -> tuple[int, ...]:
    """Leading dims folded into tokens: ``(B, T, C) → (B·T, C)``."""
    shape = tuple(int(d) for d in shape)
    if len(shape) <= 2:
        return shape or (1,)
    return (numel(shape[:-1]), shape[-1])


def ir_shape(shape: Sequence[int], dtype: str) -> tuple[int, ...]:
    """The shape the IR gives a value of ``shape`` that is no image: integers flat — token
    ids ``(B, T) → (B·T,)``, as an embedding reads them, whether they are a model input or
    computed from one (RoBERTa's position ids: a cumulative sum of the padding mask) —
    anything else tokens-major (:func:`tokens_major`)."""
    return (numel(shape),) if dtype.startswith("int") else tokens_major(shape)


def flatten(xs: Any) -> list:
    """Nested lists / tuples of arguments as one flat list."""
    out = []
    for x in xs:
        if isinstance(x, (list, tuple)):
            out.extend(flatten(x))
        else:
            out.append(x)
    return out


def param_name(c: Any) -> str | None:
    """The parameter a value is, when it is exactly one (a weight, a bias, a gain)."""
    return c.params[0] if isinstance(c, Const) and len(c.params) == 1 else None


def first_output(val: Any) -> Any:
    """The main output of an op that may also return extras (indices, running stats)."""
    return val[0] if isinstance(val, (list, tuple)) else val
