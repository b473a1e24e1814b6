"""The model side of the runtime: local kernels per op kind, deterministic parameters and
synthetic data, all derived from the same IR graph the planner solved.

Kernels work on local tensors (a shard or the whole tensor): the distributed executor calls
them on shards, the single-process reference on full tensors, so both compute the same
arithmetic. Conventions (those of :mod:`ilp_planner.inputs.models`):

* activations are 2-D ``(tokens, features)``; a linear is ``y = x W (+ b)`` with ``W`` of
  shape ``(in, out)`` — the weight layout the planner shards;
* convolutional activations are ``(N, C, H, W)``: a conv2d has a ``(C_out, C_in, k, k)``
  weight and a ``(C_out,)`` bias, stride 1 and padding ``k // 2`` (odd ``k``: the output
  keeps the input's size, as VGG's); a pool is a ``k × k`` *max* pool with stride ``k``
  (``attrs.kernel``; the IR has no pooling mode and VGG max-pools); flatten reshapes
  ``(N, C, H, W)`` to ``(N, C·H·W)``, channel-major — so a block of whole channels is a
  contiguous block of columns;
* attention reads the fused QKV projection ``(tokens, 3h)`` whose columns are head-major
  (``[head0: q k v | head1: q k v | …]``), runs causal softmax attention per sequence of
  ``seq_len`` tokens as one fused kernel (``scaled_dot_product_attention``: FlashAttention on
  a GPU, the kernel the compute model prices) and writes ``(tokens, h)`` with heads
  contiguous — so a shard holding whole heads and whole sequences computes its part alone;
* an embedding is a lookup in a ``(vocab, hidden)`` table plus a learned ``(seq_len, hidden)``
  position table (token ``t`` has position ``t mod seq_len``); a shard of the table covering
  rows ``[v0, v1)`` returns zeros for ids outside it (the masked lookup whose partial sums
  over vocabulary shards give the full result);
* a linear marked ``tied`` (GPT's head) has no parameter of its own: it uses the transpose
  of the graph's embedding table;
* the loss is the mean cross-entropy of the last op's output rows against integer labels,
  for every model (GPT: next-token-style labels drawn at random; MLP: class labels in
  ``[0, out_features)``) — one code path, and the vocabulary-parallel form splits it;
* a dropout that drops is refused (:func:`check_supported`): runs are deterministic, each
  checked against one process; an imported one marked ``identity`` (p = 0) returns its
  input;
* Llama-style blocks (``kind: moe, block: llama``): ``rmsnorm`` has a gain only, ``silu``
  and ``mul`` (SwiGLU's product) are elementwise, an embedding without ``seq_len`` has no
  position table and its attention turns queries and keys by rotary positions
  (``attrs.rope_theta``, positions within each sequence);
* a mixture of experts (``moe``) runs in :mod:`runtime.moe`, its parameters the roles of
  :func:`~ilp_planner.lowering.moe_strategies.moe_param_shapes` (matrices ``(…, in, out)``).

Initialisation: parameter ``name`` is drawn from a generator seeded by
``crc32(f"{seed}:{name}")``; weights ~ N(0, σ²) (σ = 1/√in for linears, √(2/fan_in) for
convolutions — He, so ten ReLU layers keep the signal's scale —, 0.02 for tables, 1/√in
for an MoE's router and expert matrices);
biases and layernorm gains/offsets get small random values (not 0/1), so that a bias added
twice or a gain gradient lost would change the loss at once.

Precision: the graph's dtype is the compute dtype (float32, or bfloat16 / float16 for mixed
precision). Parameters are float32 masters; each forward casts them to the compute dtype
(autograd casts their gradients back, so gradients accumulate, are reduced and update in
float32 — :attr:`ilp_planner.ir.graph.TensorSpec.master`); activations and their gradients,
hence every activation collective, are in the compute dtype; the loss statistics are
float32 (``strategies.LOSS_ITEMSIZE``). float16 adds a static loss scale
(:func:`loss_scale`) so small gradients do not underflow, and a non-finite gradient after
unscaling is an error, not a skipped step.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ilp_planner.ir.graph import Graph, Op, OpKind
from ilp_planner.lowering.moe_strategies import moe_param_shapes
from runtime.errors import RuntimeSetupError

DTYPE = torch.float32  # parameters (masters), their gradients and optimizer state
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
FP16_LOSS_SCALE = 1024.0
LN_EPS = 1e-5
SUPPORTED_KINDS = frozenset({
    OpKind.INPUT, OpKind.LINEAR, OpKind.EMBEDDING, OpKind.LAYERNORM, OpKind.ATTENTION,
    OpKind.GELU, OpKind.RELU, OpKind.DROPOUT, OpKind.ADD, OpKind.LOSS,
    OpKind.CONV2D, OpKind.POOL, OpKind.FLATTEN, OpKind.MOE, OpKind.RMSNORM, OpKind.SILU,
    OpKind.MUL,
})


# -- parameters ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor of an op: full shape and the role it plays in the kernel."""

    op: str
    role: str  # "weight" | "bias" | "pos"
    shape: tuple[int, ...]
    kind: OpKind = OpKind.LINEAR

    @property
    def name(self) -> str:
        return f"{self.op}.{self.role}"


IMPORTED_ONLY: dict[tuple[OpKind, str], str] = {
    (OpKind.EMBEDDING, "tied"): "a lookup in an earlier embedding's table (T5's decoder), "
                                "where the runtime would give it a table of its own",
    (OpKind.EMBEDDING, "pos_1_rows"): "a second added table (BERT's token types), which the "
                                      "runtime's embedding does not add",
    (OpKind.ATTENTION, "bias_table"): "a learned bias added to its scores (T5's relative "
                                      "positions), which the runtime's kernel does not add",
    (OpKind.ATTENTION, "bias_buckets"): "the learned attention-bias table (T5's relative "
                                        "positions), which the runtime does not hold",
    (OpKind.ATTENTION, "qkv_major"): "q, k and v fused as [q | k | v] blocks, where the "
                                     "runtime's kernel reads head-major columns",
    (OpKind.POOL, "avg"): "average pooling, where the runtime max-pools",
    (OpKind.ATTENTION, "not_plain_causal"): "attention given a mask or no causal flag (BERT's "
                                            "and ViT's bidirectional attention, an explicit "
                                            "mask), where the runtime's kernel runs plain "
                                            "causal attention",
    (OpKind.ATTENTION, "input_steps"): "element-wise steps on its q, k or v before it (the "
                                       "module's own rotary positions, a scale), which the "
                                       "runtime's kernel does not apply",
    **{(kind, "group_width"): "a norm over each head's columns apart (Qwen3's q / k norms), "
                              "where the runtime's kernel normalises whole rows"
       for kind in (OpKind.RMSNORM, OpKind.LAYERNORM)},
}
"""Attributes the importer sets (:mod:`ilp_planner.inputs.importer`) for what a user's module
computes and the runtime's kernels do not: a plan carrying one is refused before any rank
starts (:func:`check_supported`), since the executor would run another model than the one
priced. ``plan.parallelize`` runs those ops in the user's own module."""


def check_supported(graph: Graph) -> None:
    """Raise naming the first op the runtime cannot execute, or cannot execute as the
    graph means it (a dropout, :data:`IMPORTED_ONLY`, attention reading separate q, k,
    v)."""
    for op in graph.ops:
        _check_no_dropout(op)
    for op in graph.ops:
        if op.kind not in SUPPORTED_KINDS:
            raise RuntimeSetupError(
                f"op {op.name!r} is a {op.kind.value}; the runtime executes "
                f"{sorted(k.value for k in SUPPORTED_KINDS)}")
        _check_not_imported_only(op)
    compute_dtype(graph)
    for op in graph.ops:
        if op.kind is OpKind.LOSS and graph[op.inputs[0]].output.rank != 2:
            raise RuntimeSetupError(f"loss {op.name!r} needs a 2-D (rows, classes) input")
        if op.kind is OpKind.LINEAR and op.attrs.get("tied"):
            tied_source(graph, op)
        if op.kind in _SHAPE_RULES:
            _SHAPE_RULES[op.kind](op, graph[op.inputs[0]].output.shape)


def _check_no_dropout(op: Op) -> None:
    """Refuse a dropout that drops (a dropout op not marked ``identity``, an attention's
    ``probs_dropout``: p > 0): the executor's runs are deterministic, each checked against
    one process, so it runs none and would run another model than the one priced."""
    if (op.kind is OpKind.DROPOUT and not op.is_identity) or (
            op.kind is OpKind.ATTENTION and op.attrs.get("probs_dropout")):
        what = "drops" if op.kind is OpKind.DROPOUT else "drops its probabilities"
        raise RuntimeSetupError(
            f"{op.kind.value} {op.name!r} {what} (p > 0), where the runtime's executor runs "
            f"no dropout (its runs are deterministic and checked against one process): set "
            f"model.dropout: 0 for a built-in model, or train an imported module, its "
            f"dropouts included, with plan.parallelize(module)")


def _check_not_imported_only(op: Op) -> None:
    """Refuse an imported op the executor would silently run as another computation."""
    instead = ("; the runtime's executor runs the planner's own models: train the module it "
               "was imported from with plan.parallelize(module) instead")
    for key in op.attrs:
        why = IMPORTED_ONLY.get((op.kind, "pos_1_rows" if key.startswith("pos_") else key))
        if why is not None and op.attrs[key]:
            raise RuntimeSetupError(f"{op.kind.value} {op.name!r} has attrs.{key}: {why}"
                                    f"{instead}")
    if op.kind is OpKind.ATTENTION and len(op.inputs) != 1:
        raise RuntimeSetupError(f"attention {op.name!r} reads {len(op.inputs)} projections "
                                f"({', '.join(op.inputs)}), where the runtime's kernel reads "
                                f"one fused head-major q, k, v tensor{instead}")


def _conv_shapes(op: Op, x: tuple[int, ...]) -> None:
    assert op.weight is not None
    cout, cin, kh, kw = op.weight.shape
    if kh != kw or kh % 2 == 0:
        raise RuntimeSetupError(f"conv2d {op.name!r}: the runtime runs odd square kernels "
                                f"(stride 1, padding k // 2), got {kh}×{kw}")
    if len(x) != 4 or x[1] != cin or op.output.shape != (x[0], cout, x[2], x[3]):
        raise RuntimeSetupError(f"conv2d {op.name!r}: input {x} and weight {op.weight.shape} "
                                f"give {(x[0], cout) + tuple(x[2:])} with padding {kh // 2}, "
                                f"the graph says {op.output.shape}")


def _pool_shapes(op: Op, x: tuple[int, ...]) -> None:
    k = op.attrs.get("kernel", 0)
    want = (x[0], x[1], x[2] // k, x[3] // k) if len(x) == 4 and k > 0 else None
    if op.output.shape != want:
        raise RuntimeSetupError(f"pool {op.name!r}: the runtime max-pools (N, C, H, W) by "
                                f"attrs.kernel = k (stride k) to (N, C, H // k, W // k); the graph "
                                f"maps {x} to {op.output.shape} with kernel {k or 'missing'}")


def _flatten_shapes(op: Op, x: tuple[int, ...]) -> None:
    if len(x) != 4 or op.output.shape != (x[0], x[1] * x[2] * x[3]):
        raise RuntimeSetupError(f"flatten {op.name!r}: the runtime flattens (N, C, H, W) to "
                                f"(N, C·H·W); the graph maps {x} to {op.output.shape}")


_SHAPE_RULES = {OpKind.CONV2D: _conv_shapes, OpKind.POOL: _pool_shapes,
                OpKind.FLATTEN: _flatten_shapes}


def compute_dtype(graph: Graph) -> torch.dtype:
    """The one floating dtype every activation of the graph is computed and communicated
    in (a plan priced in one dtype must not run in another)."""
    specs = [op.output for op in graph.ops] + [op.weight for op in graph.ops if op.weight]
    floats = {t.dtype for t in specs} - {"int64", "int32"}
    if len(floats) != 1 or not floats <= set(COMPUTE_DTYPES):
        raise RuntimeSetupError(
            f"the graph's tensors are {sorted(floats)}; the runtime computes in exactly one of "
            f"{list(COMPUTE_DTYPES)} (set model.dtype)")
    return getattr(torch, floats.pop())


def loss_scale(graph: Graph) -> float:
    """Static loss scale: float16's narrow exponent needs one, bfloat16 and float32 do not."""
    return FP16_LOSS_SCALE if compute_dtype(graph) == torch.float16 else 1.0


def unscale(grads: dict[str, torch.Tensor], scale: float) -> None:
    """Divide loss-scaled gradients by the scale in place; an overflow is an error (a
    step taken on infinite gradients would be silently wrong)."""
    for name, g in grads.items():
        g.div_(scale)
        if not bool(torch.isfinite(g).all()):
            raise FloatingPointError(
                f"gradient of {name!r} is not finite under the float16 loss scale {scale:g}; "
                f"the model overflows float16 (use model.dtype: bfloat16)")


def tied_source(graph: Graph, op: Op) -> Op:
    """The embedding whose table a tied linear uses (transposed)."""
    assert op.weight is not None
    for cand in graph.ops:
        if cand.kind is OpKind.EMBEDDING and cand.weight is not None \
                and cand.weight.shape == op.weight.shape[::-1]:
            return cand
    raise RuntimeSetupError(f"tied linear {op.name!r} (weight {op.weight.shape}) has no "
                            f"embedding with a {op.weight.shape[::-1]} table to share")


def param_specs(op: Op) -> list[ParamSpec]:
    """The parameters an op owns (a tied linear owns none)."""
    if op.kind is OpKind.LINEAR:
        if op.attrs.get("tied"):
            return []
        assert op.weight is not None
        out = [ParamSpec(op.name, "weight", op.weight.shape, op.kind)]
        if op.attrs.get("bias"):
            out.append(ParamSpec(op.name, "bias", (op.weight.shape[1],), op.kind))
        return out
    if op.kind is OpKind.EMBEDDING:  # a learned position table where it has a seq_len
        assert op.weight is not None
        return [ParamSpec(op.name, "weight", op.weight.shape, op.kind)] + (
            [ParamSpec(op.name, "pos", (op.attr("seq_len"), op.weight.shape[1]), op.kind)]
            if "seq_len" in op.attrs else [])
    if op.kind is OpKind.RMSNORM:
        return [ParamSpec(op.name, "weight", (op.output.shape[-1],), op.kind)]
    if op.kind is OpKind.LAYERNORM:
        h = op.output.shape[-1]
        return [ParamSpec(op.name, "weight", (h,), op.kind),
                ParamSpec(op.name, "bias", (h,), op.kind)]
    if op.kind is OpKind.CONV2D:
        assert op.weight is not None
        return [ParamSpec(op.name, "weight", op.weight.shape, op.kind),
                ParamSpec(op.name, "bias", (op.weight.shape[0],), op.kind)]
    if op.kind is OpKind.MOE:  # router, experts, shared experts (moe_strategies)
        return [ParamSpec(op.name, role, shape, op.kind)
                for role, shape in moe_param_shapes(op).items()]
    return []


def graph_param_specs(graph: Graph) -> list[ParamSpec]:
    return [p for op in graph.ops for p in param_specs(op)]


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))


def init_param(spec: ParamSpec, seed: int) -> torch.Tensor:
    """Deterministic initial value of one parameter (the same on every rank)."""
    g = _generator(seed, spec.name)
    if spec.kind is OpKind.EMBEDDING:  # token and position tables
        return torch.randn(spec.shape, generator=g, dtype=DTYPE) * 0.02
    if spec.role == "weight" and spec.kind is OpKind.LINEAR:
        return torch.randn(spec.shape, generator=g, dtype=DTYPE) / math.sqrt(spec.shape[0])
    if spec.kind is OpKind.MOE and spec.role == "score_bias":  # on the sigmoid scores' scale
        return 0.05 * torch.randn(spec.shape, generator=g, dtype=DTYPE)
    if spec.kind is OpKind.MOE:  # router and expert matrices: (…, in, out)
        return torch.randn(spec.shape, generator=g, dtype=DTYPE) / math.sqrt(spec.shape[-2])
    if spec.role == "weight" and spec.kind is OpKind.CONV2D:
        fan_in = math.prod(spec.shape[1:])
        return torch.randn(spec.shape, generator=g, dtype=DTYPE) * math.sqrt(2.0 / fan_in)
    if spec.role == "weight":  # layernorm gain
        return 1.0 + 0.1 * torch.randn(spec.shape, generator=g, dtype=DTYPE)
    return 0.05 * torch.randn(spec.shape, generator=g, dtype=DTYPE)  # biases


def init_params(graph: Graph, seed: int) -> dict[str, torch.Tensor]:
    return {p.name: init_param(p, seed) for p in graph_param_specs(graph)}


# -- data ------------------------------------------------------------------------------------


def targets_key(loss: str) -> str:
    return f"{loss}.targets"


def make_batch(graph: Graph, seed: int) -> dict[str, torch.Tensor]:
    """The full batch every optimizer step trains on: every input op's tensor and every
    loss's integer labels (``"<loss>.targets"``), drawn from ``seed``. One fixed batch, so
    the loss falls step by step as the model fits it."""
    out: dict[str, torch.Tensor] = {}
    for op in graph.ops:
        g = _generator(seed, f"data:{op.name}")
        if op.kind is OpKind.INPUT:
            if op.output.dtype in ("int64", "int32"):
                consumers = [graph[c] for c in graph.consumers(op.name)]
                vocab = min((c.attrs.get("vocab", c.weight.shape[0] if c.weight else 2)
                             for c in consumers), default=2)
                out[op.name] = torch.randint(0, vocab, op.output.shape, generator=g)
            else:  # drawn in float32 (the same values whatever the compute dtype), then cast
                out[op.name] = torch.randn(op.output.shape, generator=g, dtype=DTYPE).to(
                    getattr(torch, op.output.dtype))
        elif op.kind is OpKind.LOSS:
            rows, classes = graph[op.inputs[0]].output.shape
            out[targets_key(op.name)] = torch.randint(0, classes, (rows,), generator=g)
    return out


def split_microbatches(batch: dict[str, torch.Tensor], m: int) -> list[dict[str, torch.Tensor]]:
    """Cut every tensor of a batch into ``m`` equal row blocks (whole sequences for token
    tensors, since tokens are sequence-major)."""
    for k, v in batch.items():
        if v.shape[0] % m:
            raise RuntimeSetupError(f"{k}: {v.shape[0]} rows do not split into {m} micro-batches")
    chunks = {k: v.chunk(m, dim=0) for k, v in batch.items()}
    return [{k: c[i] for k, c in chunks.items()} for i in range(m)]


# -- local kernels ---------------------------------------------------------------------------


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w + b`` with ``w`` stored (in, out): one kernel with the bias (``addmm``: the
    bias in the matmul's epilogue, as the compute model prices a linear's forward); its
    backward sums the output gradient's rows for the bias in a kernel of its own."""
    return x @ w if b is None else F.linear(x, w.t(), b)


def embedding(ids: torch.Tensor, table: torch.Tensor, vocab_offset: int = 0,
              whole: bool = True) -> torch.Tensor:
    """Masked lookup in rows ``[vocab_offset, vocab_offset + len(table))`` of the table; a
    ``whole`` table (every id inside it) is looked up directly, one kernel as priced."""
    if whole:
        return F.embedding(ids, table)
    local = ids - vocab_offset
    inside = (local >= 0) & (local < table.shape[0])
    rows = F.embedding(torch.where(inside, local, torch.zeros_like(local)), table)
    return rows * inside.unsqueeze(-1).to(rows.dtype)


def positions(first_token: int, count: int, seq_len: int, device=None) -> torch.Tensor:
    return torch.arange(first_token, first_token + count, device=device) % seq_len


def layer_norm(x: torch.Tensor, gain: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), gain, offset, LN_EPS)


def rms_norm(x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
    """``x / √(mean(x²) + ε) · gain`` over the last dim, the statistic in float32."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + LN_EPS)).to(x.dtype) * gain


def rotary(x: torch.Tensor, theta: int) -> torch.Tensor:
    """Rotary positions (RoPE, Llama's ``rotate_half`` form) on ``(batch, heads, seq, d)``:
    position ``t`` of a sequence turns the pairs ``(x_i, x_{i+d/2})`` by ``t · θ^(−2i/d)``."""
    seq, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    ang = torch.outer(torch.arange(seq, dtype=torch.float32, device=x.device), inv)
    cos, sin = torch.cat([ang, ang], -1).cos().to(x.dtype), torch.cat([ang, ang], -1).sin().to(x.dtype)
    half = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + half * sin


def attention(qkv: torch.Tensor, heads: int, seq_len: int, rope_theta: int = 0,
              kv_heads: int = 0) -> torch.Tensor:
    """Causal attention on head-major fused QKV → ``(tokens, heads·d)``, queries and keys
    turned by :func:`rotary` where ``rope_theta`` is given. Grouped-query (``kv_heads`` <
    ``heads``): the columns are group-major, ``[group0: q … q k v | group1: …]`` with
    ``heads / kv_heads`` query heads per key/value head (``(tokens, (heads + 2·kv_heads)·d)``),
    so a block of whole groups computes its part alone; ``kv_heads = heads`` (or 0) is the
    plain ``[head0: q k v | …]``."""
    tokens, width = qkv.shape
    kv = kv_heads or heads
    r = heads // kv
    d = width // (kv * (r + 2))
    x = qkv.reshape(tokens // seq_len, seq_len, kv, r + 2, d)
    # one split: its backward writes the fused gradient in one ``cat`` (three slices would
    # each write a zero-filled copy, then two additions merge them)
    q, k, v = x.split([r, 1, 1], dim=3)
    q = q.reshape(tokens // seq_len, seq_len, heads, d).transpose(1, 2)
    k, v = (t.squeeze(3).transpose(1, 2) for t in (k, v))  # (batch, kv, seq, d)
    if rope_theta:
        q, k = rotary(q, rope_theta), rotary(k, rope_theta)
    if r > 1:
        k, v = k.repeat_interleave(r, dim=1), v.repeat_interleave(r, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # fused: flash on a GPU
    return out.transpose(1, 2).reshape(tokens, heads * d)


def conv2d(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """Stride 1, padding ``k // 2``: the output keeps the input's spatial size."""
    return F.conv2d(x, w, b, padding=w.shape[-1] // 2)


def max_pool(x: torch.Tensor, kernel: int) -> torch.Tensor:
    return F.max_pool2d(x, kernel, stride=kernel)


def flatten(x: torch.Tensor) -> torch.Tensor:
    """``(N, C, H, W) → (N, C·H·W)``, channel-major."""
    return x.reshape(x.shape[0], -1)


def gelu(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x)


def relu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in float32 whatever the logits' dtype (mixed precision)."""
    return F.cross_entropy(logits.float(), targets)


ELEMENTWISE = {
    OpKind.GELU: gelu,
    OpKind.RELU: relu,
    OpKind.SILU: F.silu,
    OpKind.DROPOUT: lambda x: x,  # ``attrs.identity`` only (:func:`check_supported`)
}
