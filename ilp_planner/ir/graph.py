"""Layer-graph IR: a DAG of ops, each producing one tensor.

Activations of MLPs and transformers are kept 2-D, ``(tokens, features)`` with
``tokens = batch * seq_len``: every linear is then a plain matmul ``I (M, K) × W (K, N)``
and the SBP strategies of AutoDDL §4.2.2 apply unchanged. Attention splits over batch
(dim 0, whole sequences) or heads (dim 1, heads are contiguous column blocks).
Convolutional activations are ``(N, C, H, W)``; ``pool`` is max pooling with stride equal to
``attrs.kernel`` (VGG's), or average pooling where ``attrs.avg`` is 1 (imported models).

Imported models (:mod:`ilp_planner.inputs.importer`) add ``silu``, ``mul`` (a binary elementwise
product, sharded like ``add``), ``rmsnorm`` (a layernorm with a gain only; a norm with
``attrs.group_width`` normalises each group of that many consecutive features on its own —
Qwen3's and Gemma-3's per-head q / k norms on their projection's ``(tokens, heads · head_dim)``
value, its gain ``group_width`` entries shared by every head — so its features may split in
whole groups; ``attrs.heads_dim``: where the module's input holds the heads, ``(b, s, heads,
d)`` or ``(b, heads, s, d)``), ``batchnorm``
(statistics over batch and space, so only channels split without communication) and
``opaque``: an op the planner cannot shard, kept replicated on every device (but a copy of
some of its producer's columns, ``attrs.rows_local``, may split the tokens; ``attrs.relayout``:
the copy a reader's code makes of a value, named in the reader's module). Attention may
read one fused QKV tensor or three tensors ``q, k, v``; ``attrs.kv_heads`` (grouped-query
attention) and ``attrs.qkv_major`` (a fused tensor laid out ``[q | k | v]``, whose column
blocks are not whole heads, so it may only split over batch) refine it;
``attrs.shared_input`` names the input every head reads whole (DeepSeek's multi-head latent
attention: ``q``, ``kv_b_proj``'s keys and values, the shared rotary key part), and the
output is ``(tokens, heads · v's head dim)``.

``attrs.functional`` (imported models) marks an op of the user's *functional* code — no
module call of its own, so no module boundary runs before it: every functional reader of
one producer reads the one value the producer's boundary hands out, whatever program turned
it into its layout. Such readers are a *shared read* (:meth:`Graph.shared_reads`): the
planner gives them one input layout and one gradient layout and prices the program once, on
the first of them (the runtime runs it once; autograd sums the readers' gradients, which
then run one backward program). ``attrs.functional_inputs`` (a bit per input index) marks
the inputs a module's op reads *through* functional code: element-wise steps the user's
code runs outside both modules on the output of a producer that functional code reads too
(Granite's ``inputs_embeds * embedding_multiplier`` before the first layer's norm and the
residual add), so the module receives a value computed from what the producer's boundary
converted for that code — that read is a functional read (:meth:`Op.reads_functionally`).

``part`` (imported models) is block ``attrs.part`` of the ``attrs.parts`` equal column blocks
a linear's output is cut into by the user's code (``chunk`` / ``split``: Phi-3's fused
``gate_up_proj``, gate then up); it follows the linear, whose own ``attrs.parts`` says its
columns are such blocks: a column split of it ``k`` ways hands device ``i`` the ``i``-th
``k``-th of every block (Megatron's interleaved fused weight; the runtime stores the weight's
columns in that order, :mod:`runtime.fused_parts`), so each part splits its columns as the
linear does, with no communication. Where another op also reads the linear whole
(``attrs.parts_read_whole``, marked at import) its columns stay whole.

``moe`` is a whole mixture-of-experts MLP on ``(tokens, hidden)``: router (gate matmul,
softmax or sigmoid, top-k), dispatch, experts and combine as one op, so that its strategies choose the
expert layout and the token exchange together (:mod:`ilp_planner.lowering.moe_strategies`).
Its attributes: ``experts`` (E), ``top_k``, ``ffn`` (each expert's hidden size),
``capacity_pct`` (100 × the capacity factor), ``swiglu`` (1: SwiGLU experts, 0: GELU),
``norm_topk`` (1: the top-k weights renormalised to sum to 1, as Mixtral and Qwen2-MoE;
0: as DeepSeek-V2), ``sigmoid`` (1: DeepSeek-V3's sigmoid scores, experts selected by
score plus a correction bias), ``route_scale`` (the routed scaling factor in thousandths,
default 1000), ``groups`` and ``topk_groups`` (group-limited selection: the top-k among the
``topk_groups`` best of ``groups`` expert groups; see :mod:`ilp_planner.inputs.moe_routing`),
``shared`` and
``shared_ffn`` (always-on shared experts, as Qwen-MoE and DeepSeek), ``hf_experts`` (an
imported Hugging Face block, its parameters in the module's orientation — 1: Mixtral's
tensors, 2: GPT-OSS's, with biases and a clamped GLU whose ``glu_alpha`` and ``glu_limit``
are in thousandths; :mod:`ilp_planner.lowering.moe_strategies`), ``dropless`` (1:
every token routed, variable-size exchanges instead of a capacity buffer). ``weight`` is the
experts' up projection ``(E, hidden, ffn)``.

The IR is torch-free and frozen: the planner, the cost model and the runtime all read it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType

from ilp_planner.errors import ConfigError

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4}
HALF_DTYPES = ("float16", "bfloat16")


class OpKind(str, Enum):
    """What an op computes; strategy generation dispatches on it."""

    INPUT = "input"
    LINEAR = "linear"
    MATMUL = "matmul"
    ATTENTION = "attention"
    LAYERNORM = "layernorm"
    SOFTMAX = "softmax"
    GELU = "gelu"
    RELU = "relu"
    ADD = "add"
    DROPOUT = "dropout"
    EMBEDDING = "embedding"
    CONV2D = "conv2d"
    POOL = "pool"
    FLATTEN = "flatten"
    LOSS = "loss"
    # Kinds that imported models (ilp_planner.inputs.importer) use; the runtime's own kernels run
    # silu, mul and rmsnorm (the MoE builder's Llama blocks), plans of graphs with the others run
    # through ``ilp_planner.parallelize`` on the user's module.
    SILU = "silu"
    MUL = "mul"
    RMSNORM = "rmsnorm"
    BATCHNORM = "batchnorm"
    OPAQUE = "opaque"
    MOE = "moe"
    # one of ``attrs.parts`` equal column blocks of a fused projection's output (Phi-3's
    # ``gate_up_proj`` chunked into gate and up), ``attrs.part`` its index: a view, no work
    PART = "part"

    @property
    def is_elementwise(self) -> bool:
        return self in (OpKind.GELU, OpKind.RELU, OpKind.ADD, OpKind.DROPOUT, OpKind.SILU,
                        OpKind.MUL)


@dataclass(frozen=True)
class TensorSpec:
    """Shape and dtype of one tensor (global, unsharded)."""

    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
        if not self.shape or any(int(d) <= 0 for d in self.shape):
            raise ConfigError(f"tensor shape must be non-empty and positive, got {self.shape}")

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def master(self) -> TensorSpec:
        """The spec of this parameter's master copy and gradient. Half-precision models
        train mixed-precision: fp32 master weights, and gradients reduced and exchanged in
        fp32 (a sum of many half-precision terms loses the small ones), while the forward
        and backward compute — and communicate activations — in the half type."""
        return TensorSpec(self.shape, "float32") if self.dtype in HALF_DTYPES else self


def elementwise_reads(shape: tuple[int, ...], out: tuple[int, ...]) -> bool:
    """Whether an element-wise op with output ``out`` can read an input of ``shape``: it
    broadcasts to ``out`` (right-aligned, each dim equal or 1) or is a view of as many
    elements — the two readings the element-wise strategies lay out."""
    return (len(shape) <= len(out) and all(a in (1, b) for a, b in zip(
        shape[::-1], out[::-1], strict=False))) or math.prod(shape) == math.prod(out)


def position_tables(attrs: Mapping[str, int]) -> dict[str, int]:
    """An embedding's tables looked up by constant ids and added to its output — positions,
    BERT's token types — as parameter role → rows: ``pos`` (``seq_len`` rows) first, then
    ``pos_1``, ``pos_2``, … (``pos_1_rows``, …), in the order the op owns them, so each
    table the module has is one parameter of the op."""
    out = {"pos": attrs["seq_len"]} if "seq_len" in attrs else {}
    while f"pos_{len(out)}_rows" in attrs:
        out[f"pos_{len(out)}"] = attrs[f"pos_{len(out)}_rows"]
    return out


def opaque_param_sizes(attrs: Mapping[str, int]) -> list[int]:
    """The sizes of the parameters an opaque op owns, in order, where it owns several
    (``param_0``, ``param_1``, …; an imported class token and position table read by one
    ``cat``): each is one parameter role. Empty where the op owns one flat ``weight``."""
    out: list[int] = []
    while f"param_{len(out)}" in attrs:
        out.append(attrs[f"param_{len(out)}"])
    return out


def position_table_attr(attrs: Mapping[str, int]) -> str:
    """The attribute that records the rows of the next table an embedding adopts."""
    n = len(position_tables(attrs))
    return "seq_len" if n == 0 else f"pos_{n}_rows"


def read_inside_its_module(reader: str, op: str) -> bool:
    """Whether op ``reader``, reading op ``op``'s value, is code ``op``'s own module runs
    after it (the importer names what a module's forward computes under its path:
    Qwen3.5's gated norm multiplying its normed value by a gate, ``norm.mul``). The module
    returns the later value, so ``parallelize`` has no boundary between the two to run a
    program at: the planner keeps ``op``'s layout for that code
    (:func:`ilp_planner.intra_op.problem._functional_edges`), the runtime runs the module on
    DTensors (:func:`runtime.applied_hooks.computes_past`)."""
    return reader.startswith(op + ".")


@dataclass(frozen=True)
class Op:
    """One node of the layer graph.

    ``weight`` is the op's main parameter tensor as the strategies shard it (a linear's
    ``(in, out)`` matrix, an embedding's ``(vocab, hidden)`` table); ``params`` counts every
    parameter including biases and norm gains. ``block``/``block_index`` mark repeated blocks:
    ops with the same ``block`` and the same ``name`` suffix after the block prefix may be
    tied to one strategy. ``attrs`` carries kind-specific integers (heads, kernel, seq_len).
    ``source_params`` names, for an op imported from an ``nn.Module``, the module's
    parameters the op owns (so a plan can be applied back to the module).
    """

    name: str
    kind: OpKind
    inputs: tuple[str, ...]
    output: TensorSpec
    weight: TensorSpec | None = None
    params: int = 0
    flops: float = 0.0
    block: str | None = None
    block_index: int | None = None
    attrs: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    source_params: tuple[str, ...] = ()

    def attr(self, key: str) -> int:
        if key not in self.attrs:
            raise KeyError(f"op {self.name!r} ({self.kind.value}) has no attribute {key!r}")
        return self.attrs[key]

    def reads_functionally(self, idx: int) -> bool:
        """Whether input ``idx`` reaches this op as functional code reads it — converted,
        if at all, at its producer's boundary, not at this op's: the op is functional code
        (``attrs.functional``), or a module reading that input through steps run outside it
        (``attrs.functional_inputs``)."""
        return bool(self.attrs.get("functional")) \
            or bool(self.attrs.get("functional_inputs", 0) >> idx & 1)

    @property
    def master_spec(self) -> TensorSpec:
        """The spec its parameters' gradients are reduced and exchanged in and their master
        copy kept in: a half-precision model trains mixed precision (fp32,
        :attr:`TensorSpec.master`), but parameters that train as they are
        (``attrs.own_precision``: an imported module's half-precision parameters, which
        ``parallelize`` leaves to the user's optimizer with no float32 copy) keep their own
        dtype."""
        spec = self.weight or self.output
        return spec if self.attrs.get("own_precision") else spec.master

    def grad_itemsize(self, role_index: int) -> int:
        """Bytes per element of parameter ``role_index``'s gradient (role order): the
        :attr:`master_spec`'s, or 4 for a role in ``attrs.float32_roles`` (a bit mask: a
        parameter kept in float32 in an op whose others train in half precision, as
        ``from_pretrained`` keeps HunYuan's router beside its bfloat16 experts)."""
        if self.attrs.get("float32_roles", 0) >> role_index & 1:
            return 4
        return self.master_spec.itemsize

    @property
    def mixed_precision(self) -> bool:
        """Its parameters keep a float32 master beside their half-precision compute copy
        (cast to the copy each step, each micro-batch's gradient cast back)."""
        return self.master_spec.dtype != (self.weight or self.output).dtype

    @property
    def frozen(self) -> bool:
        """Its parameters take no gradient (``attrs.frozen``: every one of them
        ``requires_grad=False`` in the imported module — a fine-tuning's frozen table or
        layer): they are held and read, never synchronised, updated or given optimizer
        state, and its backward computes no weight gradient."""
        return bool(self.attrs.get("frozen"))

    @property
    def unused(self) -> bool:
        """Its output reaches no loss (``attrs.unused``, marked at import: a head the
        model's forward computes and its loss never reads — CLIP's ``post_layernorm`` under
        image classification). It is :attr:`frozen` too: its parameters train in the
        module but take no gradient, so nothing is synchronised, updated or held for
        them, and no backward runs through it."""
        return bool(self.attrs.get("unused"))

    @property
    def no_grad(self) -> bool:
        """Its output takes no gradient (``attrs.no_grad``, marked at import where it is
        not one of the graph's :meth:`Graph.gradient_carriers`: a frozen base, an image
        padded in code): autograd runs none of its backward."""
        return bool(self.attrs.get("no_grad"))

    @property
    def is_identity(self) -> bool:
        """A dropout that drops nothing (``attrs.identity``: p = 0 or an evaluated module,
        kept by an import as a module boundary): torch returns its input, so it runs no
        kernel and holds no bytes of its own."""
        return self.kind is OpKind.DROPOUT and bool(self.attrs.get("identity"))

    @property
    def held_output_bytes(self) -> float:
        """The bytes of its output it holds, unsharded (none for :attr:`is_identity`)."""
        return 0.0 if self.is_identity else float(self.output.nbytes)

    @property
    def tie_key(self) -> str | None:
        """Key shared by the same op in every repetition of a block (None if not repeated)."""
        if self.block is None or self.block_index is None:
            return None
        prefix = f"{self.block}.{self.block_index}."
        suffix = self.name[len(prefix):] if self.name.startswith(prefix) else self.name
        return f"{self.block}.*.{suffix}"


class Graph:
    """A DAG of ops in topological order, addressed by name. ``replicated_ops`` (imported
    models): the aten ops the model's forward or backward dispatches that DTensor has no
    sharding rule for (:mod:`ilp_planner.inputs.dtensor_gaps`) — ``parallelize`` runs them on
    every rank's whole replicated values, as the plan's opaque ops are laid out."""

    def __init__(self, name: str, ops: Iterable[Op], replicated_ops: Iterable[str] = ()):
        self.name = name
        self.replicated_ops = tuple(replicated_ops)
        self._ops: dict[str, Op] = {}
        for op in ops:
            if op.name in self._ops:
                raise ConfigError(f"duplicate op name {op.name!r} in graph {name!r}")
            for src in op.inputs:
                if src not in self._ops:
                    raise ConfigError(
                        f"op {op.name!r} reads {src!r}, which is not defined before it "
                        f"(ops must be listed in topological order)"
                    )
            self._ops[op.name] = op
        if not self._ops:
            raise ConfigError(f"graph {name!r} has no ops")
        self._consumers: dict[str, list[str]] | None = None
        self._carriers: dict[frozenset[str], frozenset[str]] = {}
        self._shared: dict[str, tuple[tuple[str, int], ...]] | None = None

    @property
    def ops(self) -> list[Op]:
        return list(self._ops.values())

    def __getitem__(self, name: str) -> Op:
        return self._ops[name]

    def __contains__(self, name: str) -> bool:
        return name in self._ops

    def __len__(self) -> int:
        return len(self._ops)

    def gradient_carriers(self, imported: frozenset[str] = frozenset()) -> frozenset[str]:
        """The ops whose output takes a gradient in training: those owning parameters that
        train (a tied head or a shared table included; not :attr:`Op.frozen` ones) and
        every op reading one of them, in
        floating point — not model data, nor what is computed from it alone (an image's
        padding, a position count), whose edges' backward programs autograd never runs, nor
        an :attr:`Op.unused` one.
        ``imported``: a pipeline stage's inputs from an earlier stage, which take one."""
        hit = self._carriers.get(imported)
        if hit is None:
            out: set[str] = set()
            for op in self._ops.values():
                if op.unused:  # read by no loss: nothing comes back through it
                    continue
                owns = op.kind is not OpKind.INPUT and not op.frozen and (
                    op.params > 0 or bool(op.source_params) or bool(op.attrs.get("tied")))
                if (op.name in imported or owns or any(i in out for i in op.inputs)) \
                        and "float" in op.output.dtype:
                    out.add(op.name)
            hit = self._carriers[imported] = frozenset(out)
        return hit

    def edges(self) -> list[tuple[str, str]]:
        """(producer, consumer) pairs in topological order of the consumer."""
        return [(src, op.name) for op in self._ops.values() for src in op.inputs]

    def shared_reads(self) -> dict[str, tuple[tuple[str, int], ...]]:
        """Producer → its functional readers ``(consumer, input index)`` in graph order,
        where there are two or more (:meth:`Op.reads_functionally`): one value, one program —
        the first reader's, which the plan prices; the others read its result. A graph input is
        no producer here (each consumer loads its own block, nothing moves)."""
        if self._shared is None:
            readers: dict[str, list[tuple[str, int]]] = {}
            for op in self._ops.values():
                for idx, src in enumerate(op.inputs):
                    if op.reads_functionally(idx) and self._ops[src].kind is not OpKind.INPUT:
                        readers.setdefault(src, []).append((op.name, idx))
            self._shared = {src: tuple(rs) for src, rs in readers.items() if len(rs) > 1}
        return dict(self._shared)

    def consumers(self, name: str) -> list[str]:
        """Ops reading ``name``, in graph order (one pass builds the map for every op)."""
        if self._consumers is None:
            self._consumers = {n: [] for n in self._ops}
            for op in self._ops.values():
                for src in dict.fromkeys(op.inputs):
                    self._consumers[src].append(op.name)
        return list(self._consumers[name])

    def blocks(self) -> tuple[tuple[str, int], ...]:
        """The blocks ``(block, block_index)`` in graph order: the units of recomputation."""
        return tuple(dict.fromkeys((op.block, op.block_index) for op in self._ops.values()
                                   if op.block is not None and op.block_index is not None))

    @property
    def total_params(self) -> int:
        return sum(op.params for op in self._ops.values())

    @property
    def forward_flops(self) -> float:
        return sum(op.flops for op in self._ops.values())

    @property
    def step_flops(self) -> float:
        """Forward + backward FLOPs of one training step (backward ≈ 2 × forward)."""
        return 3.0 * self.forward_flops

    def summary(self) -> str:
        return (
            f"{self.name}: {len(self)} ops, {self.total_params:,} parameters, "
            f"{self.step_flops:.3e} FLOPs per step"
        )
