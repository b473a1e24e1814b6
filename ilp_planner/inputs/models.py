"""Model builders: MLP, GPT, mixture-of-experts decoders (GPT or Llama blocks), VGG13,
U-Transformer as layer graphs.

Transformer activations are 2-D ``(tokens, hidden)`` with ``tokens = batch · seq_len``
(see :mod:`ilp_planner.ir.graph`). The fused QKV projection's output columns are laid out
head-major (``[head0: q k v | head1: q k v | …]``) so that splitting them over mesh devices
keeps whole heads together, as Megatron does.

GPT parameter count (tied input/output embedding, learned positions)::

    12·L·h² + 13·L·h + V·h + s·h   (+ 2h for the final layernorm)
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ilp_planner.errors import ConfigError
from ilp_planner.inputs.schema import Key, Reader, join
from ilp_planner.ir.graph import DTYPE_BYTES, Graph, Op, OpKind, TensorSpec, elementwise_reads
from ilp_planner.lowering.moe_strategies import ROUTE_SCALE_UNIT, moe_params


def _attrs(**kw: int) -> MappingProxyType:
    return MappingProxyType(dict(kw))


def _positive(**kw: int) -> None:
    for k, v in kw.items():
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"expected a positive integer, got {v!r}", key=k)


class _Builder:
    """Appends ops in topological order, tracking the current block for tying."""

    def __init__(self, dtype: str):
        self.dtype = dtype
        self.ops: list[Op] = []
        self.block: str | None = None
        self.block_index: int | None = None

    def t(self, *shape: int) -> TensorSpec:
        return TensorSpec(tuple(shape), self.dtype)

    def add(self, name: str, kind: OpKind, inputs: list[str], out: TensorSpec, *,
            weight: TensorSpec | None = None, params: int = 0, flops: float = 0.0,
            **attrs: int) -> str:
        self.ops.append(Op(name, kind, tuple(inputs), out, weight, params, float(flops),
                           self.block, self.block_index, _attrs(**attrs)))
        return name

    def linear(self, name: str, x: str, tokens: int, k: int, n: int, bias: bool = True,
               tied: bool = False) -> str:
        params = 0 if tied else k * n + (n if bias else 0)
        return self.add(name, OpKind.LINEAR, [x], self.t(tokens, n), weight=self.t(k, n),
                        params=params, flops=2.0 * tokens * k * n, bias=int(bias), tied=int(tied))

    def layernorm(self, name: str, x: str, tokens: int, h: int) -> str:
        return self.add(name, OpKind.LAYERNORM, [x], self.t(tokens, h), params=2 * h,
                        flops=8.0 * tokens * h)

    def rmsnorm(self, name: str, x: str, tokens: int, h: int) -> str:
        """A gain-only norm: mean square, scale, gain (about 4 FLOPs per element)."""
        return self.add(name, OpKind.RMSNORM, [x], self.t(tokens, h), params=h,
                        flops=4.0 * tokens * h)

    def elementwise(self, name: str, kind: OpKind, xs: list[str], tokens: int, h: int) -> str:
        return self.add(name, kind, xs, self.t(tokens, h), flops=float(tokens * h))


def mlp(dims: list[int], batch: int, bias: bool = False, dtype: str = "float32") -> Graph:
    """A chain of linear layers ``dims[0] → dims[1] → …`` with ReLU between and a loss."""
    if len(dims) < 2:
        raise ConfigError("an MLP needs at least two dims", key="model.dims")
    _positive(batch=batch, **{f"dims[{i}]": d for i, d in enumerate(dims)})
    b = _Builder(dtype)
    x = b.add("input", OpKind.INPUT, [], b.t(batch, dims[0]))
    for i, (k, n) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        x = b.linear(f"fc{i + 1}", x, batch, k, n, bias)
        if i < len(dims) - 2:
            x = b.elementwise(f"relu{i + 1}", OpKind.RELU, [x], batch, n)
    b.add("loss", OpKind.LOSS, [x], b.t(1), flops=float(3 * batch * dims[-1]))
    return Graph(f"mlp{len(dims) - 1}", b.ops)


def _dropped(b: _Builder, name: str, x: str, tokens: int, h: int, dropout: float) -> str:
    """``x`` through a dropout op where ``dropout`` (its probability) drops anything; at
    p = 0 a dropout is the identity (torch returns its input: no kernel, no mask), so the
    graph has none."""
    return b.elementwise(name, OpKind.DROPOUT, [x], tokens, h) if dropout > 0 else x


def _attention_half(b: _Builder, prefix: str, x: str, tokens: int, h: int, heads: int,
                    seq: int, dropout: float = 0.0) -> str:
    """x + dropout(proj(attn(qkv(ln1(x))))): the first half of a pre-LN block; with
    ``dropout`` > 0 the attention drops its probabilities too (``attrs.probs_dropout``)."""
    ln1 = b.layernorm(f"{prefix}ln1", x, tokens, h)
    qkv = b.linear(f"{prefix}attn.qkv", ln1, tokens, h, 3 * h)
    attn = b.add(f"{prefix}attn.core", OpKind.ATTENTION, [qkv], b.t(tokens, h),
                 flops=4.0 * tokens * seq * h, heads=heads, seq_len=seq,
                 **({"probs_dropout": 1} if dropout > 0 else {}))
    proj = b.linear(f"{prefix}attn.proj", attn, tokens, h, h)
    d1 = _dropped(b, f"{prefix}attn.dropout", proj, tokens, h, dropout)
    return b.elementwise(f"{prefix}attn.residual", OpKind.ADD, [x, d1], tokens, h)


def _transformer_block(b: _Builder, prefix: str, x: str, tokens: int, h: int, heads: int,
                       seq: int, skip: str | None = None, ffn: int | None = None,
                       dropout: float = 0.0) -> str:
    """Pre-LN block: x + dropout(proj(attn(qkv(ln1(x))))), then
    + dropout(fc2(gelu(fc1(ln2(.))))), the MLP's hidden size ``ffn`` (4h by default), the
    dropouts only where ``dropout`` > 0 (:func:`_dropped`)."""
    ffn = 4 * h if ffn is None else ffn
    if skip is not None:
        x = b.elementwise(f"{prefix}skip_add", OpKind.ADD, [x, skip], tokens, h)
    r1 = _attention_half(b, prefix, x, tokens, h, heads, seq, dropout)
    ln2 = b.layernorm(f"{prefix}ln2", r1, tokens, h)
    fc1 = b.linear(f"{prefix}mlp.fc1", ln2, tokens, h, ffn)
    act = b.elementwise(f"{prefix}mlp.gelu", OpKind.GELU, [fc1], tokens, ffn)
    fc2 = b.linear(f"{prefix}mlp.fc2", act, tokens, ffn, h)
    d2 = _dropped(b, f"{prefix}mlp.dropout", fc2, tokens, h, dropout)
    return b.elementwise(f"{prefix}mlp.residual", OpKind.ADD, [r1, d2], tokens, h)


def _check_dropout(dropout: float) -> None:
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or \
            not 0 <= dropout < 1:
        raise ConfigError(f"expected a dropout probability in [0, 1), got {dropout!r}",
                          key="model.dropout")


def _check_heads(hidden: int, heads: int) -> None:
    if hidden % heads:
        raise ConfigError(f"hidden size {hidden} is not divisible by {heads} heads",
                          key="model.heads")


def gpt(hidden: int, layers: int, heads: int, seq_len: int, vocab: int, batch: int,
        dtype: str = "float32", dropout: float = 0.0) -> Graph:
    """GPT (pre-LN decoder): embedding, ``layers`` blocks ``h.{i}.*``, final LN, tied head.
    ``dropout``: the probability of the blocks' residual and attention dropouts (Megatron-LM
    trains with 0.1; none at 0, as most pretraining now runs)."""
    _positive(hidden=hidden, layers=layers, heads=heads, seq_len=seq_len, vocab=vocab, batch=batch)
    _check_heads(hidden, heads)
    _check_dropout(dropout)
    b = _Builder(dtype)
    tokens = batch * seq_len
    x = _gpt_embedding(b, tokens, hidden, seq_len, vocab)
    for i in range(layers):
        b.block, b.block_index = "h", i
        x = _transformer_block(b, f"h.{i}.", x, tokens, hidden, heads, seq_len,
                               dropout=dropout)
    b.block = b.block_index = None
    _gpt_head(b, x, tokens, hidden, vocab)
    return Graph(f"gpt-L{layers}-h{hidden}", b.ops)


def _gpt_embedding(b: _Builder, tokens: int, hidden: int, seq_len: int, vocab: int) -> str:
    """GPT's stem, shared by its dense and MoE builders: token ids, then the word and
    learned position tables as one embedding op."""
    ids = b.add("tokens", OpKind.INPUT, [], TensorSpec((tokens,), "int64"))
    return b.add("embed", OpKind.EMBEDDING, [ids], b.t(tokens, hidden), weight=b.t(vocab, hidden),
                 params=vocab * hidden + seq_len * hidden, flops=float(tokens * hidden),
                 vocab=vocab, seq_len=seq_len)


def _gpt_head(b: _Builder, x: str, tokens: int, hidden: int, vocab: int) -> None:
    """GPT's tail: the final layernorm, the head tied to the embedding, the loss."""
    x = b.layernorm("ln_f", x, tokens, hidden)
    x = b.linear("lm_head", x, tokens, hidden, vocab, bias=False, tied=True)
    b.add("loss", OpKind.LOSS, [x], b.t(1), flops=float(3 * tokens * vocab))


ROPE_THETA = 10_000
"""Rotary base of the Llama-style blocks' attention (``attrs.rope_theta``, Llama 2's)."""
ROUTERS = ("softmax", "sigmoid")
"""How an MoE router scores experts: Mixtral's / DeepSeek-V2's softmax, DeepSeek-V3's sigmoid."""


def moe(hidden: int, layers: int, heads: int, seq_len: int, vocab: int, batch: int,
        experts: int, top_k: int, expert_ffn: int, capacity_factor: float = 1.25,
        dropless: bool = False, moe_every: int = 1, first_dense: int = 0,
        shared_experts: int = 0, shared_ffn: int = 0, activation: str = "swiglu",
        norm_topk: bool = True, router: str = "softmax", routed_scale: float = 1.0,
        expert_groups: int = 1, topk_groups: int = 1, block: str = "gpt",
        kv_heads: int | None = None, dense_ffn: int | None = None,
        dtype: str = "float32", dropout: float = 0.0) -> Graph:
    """A decoder whose every ``moe_every``-th block (blocks ``moe_every − 1``,
    ``2·moe_every − 1``, …), past the first ``first_dense`` (DeepSeek's
    ``first_k_dense_replace``), has a mixture-of-experts MLP (:data:`OpKind.MOE
    <ilp_planner.ir.graph.OpKind>`): ``experts`` experts of hidden size ``expert_ffn``,
    ``top_k`` of them per token, at ``capacity_factor`` (or ``dropless``: every routed
    token computed); ``shared_experts`` always-on experts of ``shared_ffn`` (DeepSeek,
    Qwen-MoE); a ``softmax`` or ``sigmoid`` router (DeepSeek-V3: selection by scores plus a
    correction bias), choosing among the experts of its ``topk_groups`` best of
    ``expert_groups`` groups (DeepSeek's n_group / topk_group), its weights scaled by
    ``routed_scale`` (:mod:`ilp_planner.inputs.moe_routing`). The other blocks keep a
    dense MLP of ``dense_ffn`` (4·hidden by default).

    ``block: gpt`` — layernorm, GELU dense MLP, learned positions, the head tied to the
    embedding; ``block: llama`` — RMSNorm, SwiGLU dense MLP, rotary positions (no table), no
    biases, an untied head, grouped-query attention with ``kv_heads`` key/value heads
    (:func:`_llama_block`). Parameters, with ``a = 2h² + 2h·kv·h/heads`` (4h² without
    grouped queries)::

        gpt:    V·h + s·h + L·(4h² + 8h) + 2h + D·(2h·f_d + f_d + h) + M·moe
        llama:  2V·h + L·(a + 2h) + h + D·3h·f_d + M·moe

    with ``D`` dense and ``M`` MoE blocks and ``moe`` = h·E (+ E correction biases for a
    sigmoid router) + m·h·(E·f + S·f_s), m = 3 (SwiGLU) or 2 (GELU) matrices per expert.
    ``dropout`` (``block: gpt`` only): as :func:`gpt`'s, after the attention and every MLP,
    dense or MoE (as Megatron-LM drops them)."""
    _positive(hidden=hidden, layers=layers, heads=heads, seq_len=seq_len, vocab=vocab,
              batch=batch, experts=experts, top_k=top_k, expert_ffn=expert_ffn,
              moe_every=moe_every, **({} if dense_ffn is None else {"dense_ffn": dense_ffn}))
    _check_heads(hidden, heads)
    _check_dropout(dropout)
    is_moe = _moe_blocks(layers, moe_every, first_dense)
    attrs = _moe_attrs(experts, top_k, expert_ffn, capacity_factor, dropless, shared_experts,
                       shared_ffn, activation, norm_topk, router, routed_scale)
    attrs.update(_expert_groups(experts, top_k, expert_groups, topk_groups))
    if block not in ("gpt", "llama"):
        raise ConfigError(f"expected block 'gpt' or 'llama', got {block!r}", key="model.block")
    llama = block == "llama"
    if llama and dropout:
        raise ConfigError(f"block: llama has no dropout (Llama trains without), got dropout "
                          f"{dropout}", key="model.dropout")
    kv = _kv_heads(heads, kv_heads, llama)
    ffn = 4 * hidden if dense_ffn is None else dense_ffn
    b = _Builder(dtype)
    tokens = batch * seq_len
    x = _llama_embedding(b, tokens, hidden, vocab) if llama else _gpt_embedding(
        b, tokens, hidden, seq_len, vocab)
    for i in range(layers):
        b.block, b.block_index = "h", i
        args = (b, f"h.{i}.", x, tokens, hidden, heads, seq_len)
        if llama:
            x = _llama_block(*args, kv, ffn, attrs if is_moe[i] else None)
        elif not is_moe[i]:
            x = _transformer_block(*args, ffn=ffn, dropout=dropout)
        else:
            r1 = _attention_half(*args, dropout)
            ln2 = b.layernorm(f"h.{i}.ln2", r1, tokens, hidden)
            y = _moe_op(b, f"h.{i}.moe", ln2, tokens, hidden, attrs)
            y = _dropped(b, f"h.{i}.mlp.dropout", y, tokens, hidden, dropout)
            x = b.elementwise(f"h.{i}.mlp.residual", OpKind.ADD, [r1, y], tokens, hidden)
    b.block = b.block_index = None
    if llama:
        _llama_head(b, x, tokens, hidden, vocab)
    else:
        _gpt_head(b, x, tokens, hidden, vocab)
    name = f"moe-L{layers}-h{hidden}-e{experts}k{top_k}"
    return Graph(f"{name}-llama" if llama else name, b.ops)


def _moe_blocks(layers: int, moe_every: int, first_dense: int) -> list[bool]:
    """Whether each block's MLP is an MoE; at least one must be."""
    if isinstance(first_dense, bool) or not isinstance(first_dense, int) or first_dense < 0:
        raise ConfigError(f"expected a non-negative integer, got {first_dense!r}",
                          key="model.first_dense")
    if first_dense > layers:
        raise ConfigError(f"first_dense {first_dense} exceeds the {layers} layers",
                          key="model.first_dense")
    out = [i >= first_dense and (i + 1) % moe_every == 0 for i in range(layers)]
    if not any(out):
        raise ConfigError(f"no block has an MoE MLP: {layers} layers, the first {first_dense} "
                          f"dense, every {moe_every}-th an MoE", key="model.first_dense")
    return out


def _moe_attrs(experts: int, top_k: int, ffn: int, capacity_factor: float, dropless: bool,
               shared: int, shared_ffn: int, activation: str, norm_topk: bool, router: str,
               routed_scale: float) -> dict[str, int]:
    """The MoE op's integer attributes (:mod:`ilp_planner.ir.graph`), checked."""
    if top_k > experts:
        raise ConfigError(f"top_k {top_k} exceeds the {experts} experts", key="model.top_k")
    if not capacity_factor > 0:
        raise ConfigError(f"expected a positive capacity factor, got {capacity_factor!r}",
                          key="model.capacity_factor")
    if shared and shared_ffn <= 0:
        raise ConfigError("shared experts need a positive shared_ffn", key="model.shared_ffn")
    if router not in ROUTERS:
        raise ConfigError(f"expected one of {list(ROUTERS)}, got {router!r}", key="model.router")
    scale = round(ROUTE_SCALE_UNIT * routed_scale) if routed_scale > 0 else 0
    if scale <= 0 or abs(scale - ROUTE_SCALE_UNIT * routed_scale) > 1e-6:
        raise ConfigError(f"expected a positive multiple of 0.001, got {routed_scale!r}",
                          key="model.routed_scale")
    attrs = {"experts": experts, "top_k": top_k, "ffn": ffn,
             "capacity_pct": max(1, round(100 * capacity_factor)),
             "swiglu": int(activation == "swiglu"), "norm_topk": int(norm_topk),
             "shared": shared, "shared_ffn": shared_ffn if shared else 0}
    if dropless:
        attrs["dropless"] = 1
    if router == "sigmoid":
        attrs["sigmoid"] = 1
    if scale != ROUTE_SCALE_UNIT:
        attrs["route_scale"] = scale
    return attrs


def _expert_groups(experts: int, top_k: int, groups: int, keep: int) -> dict[str, int]:
    """Group-limited routing's attributes (none where every group is kept), checked."""
    _positive(expert_groups=groups, topk_groups=keep)
    if experts % groups:
        raise ConfigError(f"{groups} expert groups do not divide the {experts} experts",
                          key="model.expert_groups")
    if keep > groups:
        raise ConfigError(f"topk_groups {keep} exceeds the {groups} expert groups",
                          key="model.topk_groups")
    if keep * (experts // groups) < top_k:
        raise ConfigError(f"{keep} groups of {experts // groups} experts hold fewer than "
                          f"top_k {top_k}", key="model.topk_groups")
    return {"groups": groups, "topk_groups": keep} if keep < groups else {}


def _llama_embedding(b: _Builder, tokens: int, hidden: int, vocab: int) -> str:
    """Token ids, then the word table alone: rotary positions live in attention."""
    ids = b.add("tokens", OpKind.INPUT, [], TensorSpec((tokens,), "int64"))
    return b.add("embed", OpKind.EMBEDDING, [ids], b.t(tokens, hidden), weight=b.t(vocab, hidden),
                 params=vocab * hidden, flops=float(tokens * hidden), vocab=vocab)


def _kv_heads(heads: int, kv_heads: int | None, llama: bool) -> int:
    """Key/value heads: ``heads`` by default; fewer (grouped-query) only in Llama blocks,
    dividing ``heads``."""
    if kv_heads is None:
        return heads
    _positive(kv_heads=kv_heads)
    if not llama:
        raise ConfigError("grouped-query attention (kv_heads) needs block: llama",
                          key="model.kv_heads")
    if heads % kv_heads:
        raise ConfigError(f"kv_heads {kv_heads} does not divide the {heads} heads",
                          key="model.kv_heads")
    return kv_heads


def _llama_block(b: _Builder, prefix: str, x: str, tokens: int, h: int, heads: int, seq: int,
                 kv: int, ffn: int, moe_attrs: dict[str, int] | None) -> str:
    """Pre-norm Llama block: x + o(attn(rope(qkv(rms1(x))))), then + the MLP of rms2(.) —
    SwiGLU ``down(silu(gate(.)) ⊙ up(.))`` or, given ``moe_attrs``, an MoE. No biases, no
    dropout (Llama trains without). ``kv`` key/value heads: the fused QKV is group-major
    (:func:`runtime.model.attention`), ``h + 2·kv·h/heads`` wide."""
    n1 = b.rmsnorm(f"{prefix}norm1", x, tokens, h)
    qkv = b.linear(f"{prefix}attn.qkv", n1, tokens, h, h + 2 * kv * (h // heads), bias=False)
    gqa = {"kv_heads": kv} if kv != heads else {}
    attn = b.add(f"{prefix}attn.core", OpKind.ATTENTION, [qkv], b.t(tokens, h),
                 flops=4.0 * tokens * seq * h, heads=heads, seq_len=seq, rope_theta=ROPE_THETA,
                 **gqa)
    proj = b.linear(f"{prefix}attn.proj", attn, tokens, h, h, bias=False)
    r1 = b.elementwise(f"{prefix}attn.residual", OpKind.ADD, [x, proj], tokens, h)
    n2 = b.rmsnorm(f"{prefix}norm2", r1, tokens, h)
    if moe_attrs is not None:
        y = _moe_op(b, f"{prefix}moe", n2, tokens, h, moe_attrs)
    else:
        gate = b.linear(f"{prefix}mlp.gate", n2, tokens, h, ffn, bias=False)
        up = b.linear(f"{prefix}mlp.up", n2, tokens, h, ffn, bias=False)
        act = b.elementwise(f"{prefix}mlp.silu", OpKind.SILU, [gate], tokens, ffn)
        prod = b.elementwise(f"{prefix}mlp.mul", OpKind.MUL, [act, up], tokens, ffn)
        y = b.linear(f"{prefix}mlp.down", prod, tokens, ffn, h, bias=False)
    return b.elementwise(f"{prefix}mlp.residual", OpKind.ADD, [r1, y], tokens, h)


def _llama_head(b: _Builder, x: str, tokens: int, hidden: int, vocab: int) -> None:
    """The final RMSNorm, an untied head, the loss."""
    x = b.rmsnorm("norm_f", x, tokens, hidden)
    x = b.linear("lm_head", x, tokens, hidden, vocab, bias=False)
    b.add("loss", OpKind.LOSS, [x], b.t(1), flops=float(3 * tokens * vocab))


def _moe_op(b: _Builder, name: str, x: str, tokens: int, h: int, attrs: dict[str, int]) -> str:
    """One MoE op; its forward FLOPs count the work of routed tokens (router, ``top_k``
    experts and the shared ones per token), not the empty capacity slots the strategies
    also price."""
    m = 3 if attrs["swiglu"] else 2
    per_token = 2.0 * h * (attrs["experts"] + m * (attrs["top_k"] * attrs["ffn"]
                                                    + attrs["shared"] * attrs["shared_ffn"]))
    return b.add(name, OpKind.MOE, [x], b.t(tokens, h),
                 weight=b.t(attrs["experts"], h, attrs["ffn"]), params=moe_params(attrs, h),
                 flops=per_token * tokens, **attrs)


def gpt_params_closed_form(hidden: int, layers: int, vocab: int, seq_len: int) -> int:
    """12·L·h² + 13·L·h + V·h + s·h (without the final layernorm's 2h)."""
    return 12 * layers * hidden**2 + 13 * layers * hidden + vocab * hidden + seq_len * hidden


def u_transformer(hidden: int, layers: int, heads: int, seq_len: int, batch: int,
                  dtype: str = "float32", dropout: float = 0.0) -> Graph:
    """U-shaped transformer (Zhuang et al. §5.2): ``layers`` blocks where the output of block i
    also feeds block ``layers − 1 − i`` (i < layers/2) through a long skip edge, as U-Net's
    i-th layer feeds the i-th layer from last. Input and output are ``(tokens, hidden)``
    feature maps; a linear stem and head frame the blocks; ``dropout`` as :func:`gpt`'s."""
    _positive(hidden=hidden, layers=layers, heads=heads, seq_len=seq_len, batch=batch)
    _check_heads(hidden, heads)
    _check_dropout(dropout)
    if layers % 2:
        raise ConfigError(f"a U-Transformer needs an even number of layers, got {layers}",
                          key="model.layers")
    b = _Builder(dtype)
    tokens = batch * seq_len
    x = b.add("input", OpKind.INPUT, [], b.t(tokens, hidden))
    x = b.linear("stem", x, tokens, hidden, hidden)
    outs: list[str] = []
    for i in range(layers):
        b.block, b.block_index = "u", i
        skip = outs[layers - 1 - i] if i >= layers // 2 else None
        x = _transformer_block(b, f"u.{i}.", x, tokens, hidden, heads, seq_len, skip,
                               dropout=dropout)
        outs.append(x)
    b.block = b.block_index = None
    x = b.layernorm("ln_f", x, tokens, hidden)
    x = b.linear("head", x, tokens, hidden, hidden)
    b.add("loss", OpKind.LOSS, [x], b.t(1), flops=float(3 * tokens * hidden))
    return Graph(f"u-transformer-L{layers}-h{hidden}", b.ops)


VGG13_WIDTHS = (64, 128, 256, 512, 512)
"""Output channels of VGG13's five blocks (two 3×3 convolutions, then a 2×2 max-pool each)."""
VGG13_HIDDEN = 4096
"""Width of VGG13's two hidden dense layers."""


def vgg13(batch: int, image: int = 224, classes: int = 1000, dtype: str = "float32",
          channels: tuple[int, ...] | list[int] = VGG13_WIDTHS, hidden: int = VGG13_HIDDEN) -> Graph:
    """VGG13: ten 3×3 convolutions (stride 1, padding 1) with ReLU, five 2×2 max-pools
    (stride 2), three dense layers. ``channels`` (one width per block) and ``hidden`` scale
    it down for CPU runs of the runtime with the same structure (defaults: the paper's)."""
    _positive(batch=batch, image=image, classes=classes, hidden=hidden,
              **{f"channels[{i}]": c for i, c in enumerate(channels)})
    if len(channels) != len(VGG13_WIDTHS):
        raise ConfigError(f"VGG13 has {len(VGG13_WIDTHS)} blocks: expected {len(VGG13_WIDTHS)} "
                          f"widths, got {len(channels)}", key="model.channels")
    if image % 32:
        raise ConfigError(f"VGG13 needs an image size divisible by 32, got {image}",
                          key="model.image")
    b = _Builder(dtype)
    c, hw = 3, image
    x = b.add("input", OpKind.INPUT, [], b.t(batch, c, hw, hw))
    conv_i = 0
    for block, cout in enumerate(channels):
        for _ in range(2):
            conv_i += 1
            x = b.add(f"conv{conv_i}", OpKind.CONV2D, [x], b.t(batch, cout, hw, hw),
                      weight=b.t(cout, c, 3, 3), params=cout * c * 9 + cout,
                      flops=2.0 * batch * hw * hw * cout * c * 9, kernel=3)
            x = b.add(f"relu_c{conv_i}", OpKind.RELU, [x], b.t(batch, cout, hw, hw),
                      flops=float(batch * cout * hw * hw))
            c = cout
        hw //= 2
        x = b.add(f"pool{block + 1}", OpKind.POOL, [x], b.t(batch, c, hw, hw),
                  flops=float(batch * c * hw * hw * 4), kernel=2)
    feat = c * hw * hw
    x = b.add("flatten", OpKind.FLATTEN, [x], b.t(batch, feat))
    for i, (k, n) in enumerate([(feat, hidden), (hidden, hidden), (hidden, classes)]):
        x = b.linear(f"fc{i + 1}", x, batch, k, n)
        if i < 2:
            x = b.elementwise(f"relu_f{i + 1}", OpKind.RELU, [x], batch, n)
    b.add("loss", OpKind.LOSS, [x], b.t(1), flops=float(3 * batch * classes))
    return Graph("vgg13", b.ops)


# -- explicit graphs ----------------------------------------------------------------------

GRAPH_KEYS: dict[str, Key] = {
    "kind": Key("choice", "the explicit form (optional where the caller knows it)", "graph",
                choices=("graph",)),
    "ops": Key("list", "the layer graph's ops in topological order (see model.ops[i])"),
    "replicated_ops": Key("list", "aten ops DTensor has no sharding rule of its own for, "
                                  "run under the runtime's (an import records them)", ()),
    "name": Key("string", "the graph's name", "graph"),
    "dtype": Key("choice", "default dtype of every op's tensors", "float32",
                 choices=tuple(DTYPE_BYTES), noun="dtype"),
}
"""Keys of the explicit-graph YAML form (``model: {kind: graph, ops: [...]}``)."""

GRAPH_OP_KEYS: dict[str, Key] = {
    "name": Key("string", "the op's name"),
    "kind": Key("choice", "what the op computes", choices=tuple(k.value for k in OpKind),
                noun="op kind"),
    "shape": Key("list", "global output shape (positive integers)"),
    "inputs": Key("list", "names of earlier ops it reads (none for an input)", ()),
    "dtype": Key("choice", "dtype of its tensors", None, choices=tuple(DTYPE_BYTES),
                 noun="dtype", default_text="the graph's dtype"),
    "weight": Key("list", "main parameter shape as strategies shard it (a linear's (in, out))",
                  None, null=True),
    "params": Key("integer", "parameter count", None, nonneg=True,
                  default_text="the weight's elements"),
    "flops": Key("number", "forward FLOPs", None, nonneg=True,
                 default_text="as the builders count"),
    "block": Key("string", "repeated block it belongs to (with block_index)", None),
    "block_index": Key("integer", "its repetition of the block", None, nonneg=True),
    "attrs": Key("mapping", "integer attributes (attention: heads, seq_len)", None,
                 default_text="none"),
    "source_params": Key("list", "the module parameters it owns", ()),
}
"""Keys of one op of the explicit-graph form."""


def _default_flops(kind: OpKind, out: TensorSpec, weight: TensorSpec | None,
                   in_shapes: list[tuple[int, ...]], attrs: dict[str, int]) -> float:
    """Forward FLOPs when an explicit op gives none, with the builders' conventions:
    2·out·K for matmuls/linears (K = weight rows or the first input's last dim),
    2·out·(C_in·k·k) for convolutions, 4·tokens·seq·h for attention, 8·out for layernorm,
    2·out·(E + m·(top_k·f + S·f_s)) for an MoE (m = 3 SwiGLU, 2 GELU matrices),
    0 for inputs, flatten and an identity dropout, one FLOP per output element otherwise."""
    n = float(out.numel)
    if kind in (OpKind.LINEAR, OpKind.MATMUL):
        k = weight.shape[0] if weight is not None else (in_shapes[0][-1] if in_shapes else 1)
        return 2.0 * n * k
    if kind is OpKind.CONV2D and weight is not None:
        fan_in = 1
        for d in weight.shape[1:]:
            fan_in *= d
        return 2.0 * n * fan_in
    if kind is OpKind.ATTENTION:
        return 4.0 * n * attrs.get("seq_len", 1)
    if kind is OpKind.LAYERNORM:
        return 8.0 * n
    if kind is OpKind.MOE and out.rank == 2:  # router, top_k experts and shared ones per token
        m = 3 if attrs.get("swiglu", 1) else 2
        return 2.0 * n * (attrs["experts"] + m * (attrs["top_k"] * attrs["ffn"] + attrs.get(
            "shared", 0) * attrs.get("shared_ffn", 0)))
    if kind in (OpKind.INPUT, OpKind.FLATTEN) or (kind is OpKind.DROPOUT
                                                   and attrs.get("identity")):
        return 0.0
    return n


def graph_from_spec(spec: Mapping[str, Any], source: str | None = None, *,
                    key: str = "model") -> Graph:
    """Build a :class:`Graph` from the explicit YAML form::

        model:
          kind: graph
          name: my-net                    # optional
          dtype: float32                  # optional default dtype of every op's tensors
          ops:
            - {name: x, kind: input, shape: [64, 512]}
            - {name: fc1, kind: linear, inputs: [x], shape: [64, 1024], weight: [512, 1024]}
            - {name: act, kind: relu, inputs: [fc1], shape: [64, 1024]}
            - {name: loss, kind: loss, inputs: [act], shape: [1]}

    Ops come in topological order. ``kind`` is an :class:`OpKind` value; ``shape`` the
    global output shape; ``weight`` the main parameter tensor as strategies shard it;
    ``params`` defaults to the weight's element count (add biases yourself); ``flops``
    (forward) defaults as in :func:`_default_flops`; ``block``/``block_index`` mark repeated
    blocks for tying; ``attrs`` are integers. Attention needs ``attrs: {heads, seq_len}``;
    a linear's weight is ``(in, out)`` and must match its input's and output's last dims.

    Every error names ``source`` and the key path (``model.ops[3].inputs[0]``) — checked
    here, before :class:`Graph` sees the ops, so the messages can say where.
    """
    r = Reader(source)
    spec = r.section(spec, key, GRAPH_KEYS)
    if "kind" in spec and spec["kind"] != "graph":
        r.fail(join(key, "kind"), f"expected 'graph' for an explicit graph, got {spec['kind']!r}")
    name = r.read(GRAPH_KEYS["name"], spec.get("name", GRAPH_KEYS["name"].default), join(key, "name"))
    dtype = r.read(GRAPH_KEYS["dtype"], spec.get("dtype", GRAPH_KEYS["dtype"].default),
                   join(key, "dtype"))
    raw_ops = r.sequence(spec["ops"], join(key, "ops"), min_len=1)

    # All names first, so a forward reference can be told apart from a typo.
    all_names = {
        o.get("name"): i for i, o in enumerate(raw_ops)
        if isinstance(o, Mapping) and isinstance(o.get("name"), str)
    }
    ops: list[Op] = []
    seen: dict[str, int] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for i, raw in enumerate(raw_ops):
        path = join(join(key, "ops"), i)
        d = r.section(raw, path, GRAPH_OP_KEYS)
        op_name = r.string(d["name"], join(path, "name"))
        if op_name in seen:
            r.fail(join(path, "name"),
                   f"duplicate op name {op_name!r} (first defined at {key}.ops[{seen[op_name]}])")
        kind = OpKind(r.read(GRAPH_OP_KEYS["kind"], d["kind"], join(path, "kind")))
        if kind is OpKind.INPUT and d.get("inputs"):
            r.fail(join(path, "inputs"), "an input op reads no other op")
        inputs = _spec_inputs(r, d, path, key, seen, all_names)
        if kind in _FOLLOWING:
            given = [j for j, src in enumerate(inputs) if ops[seen[src]].kind is OpKind.INPUT]
            if given:
                r.fail(join(join(path, "inputs"), given[0]),
                       f"a {kind.value} op follows the op producing its input, not a model "
                       f"input ({inputs[given[0]]!r}); put an op between them")
        op = _spec_op(r, d, path, op_name, kind, inputs, [shapes[s] for s in inputs], dtype)
        ops.append(op)
        seen[op_name] = i
        shapes[op_name] = op.output.shape
    replicated = tuple(r.string(x, join(join(key, "replicated_ops"), j)) for j, x in
                       enumerate(r.sequence(spec.get("replicated_ops", []),
                                            join(key, "replicated_ops"))))
    try:
        return Graph(name, ops, replicated)
    except ConfigError as exc:  # defensive: the checks above should have caught it
        raise ConfigError(str(exc), source=source, key=join(key, "ops")) from exc


def _spec_inputs(r: Reader, d: Mapping[str, Any], path: str, key: str, seen: Mapping[str, int],
                 all_names: Mapping[str, int]) -> list[str]:
    """The op's ``inputs``, each an earlier op: a later one is named as an ordering error,
    not as a typo, since both read alike in a long list."""
    inputs = r.sequence(d.get("inputs", []), join(path, "inputs"))
    for j, src in enumerate(inputs):
        ipath = join(join(path, "inputs"), j)
        r.string(src, ipath)
        if src in seen:
            continue
        if src in all_names:
            r.fail(ipath, f"{src!r} is defined later (at {key}.ops[{all_names[src]}]); "
                          f"ops must be listed in topological order")
        r.fail(ipath, f"{src!r} is not an op of this graph; an input must name an "
                      f"earlier op")
    return inputs


def _spec_op(r: Reader, d: Mapping[str, Any], path: str, op_name: str, kind: OpKind,
             inputs: list[str], in_shapes: list[tuple[int, ...]], dtype: str) -> Op:
    """One op of the explicit form, its kind and inputs already read; defaults (params,
    flops, a linear's bias / tied) are derived here from the fields the user gave."""
    if kind is OpKind.INPUT and inputs:
        r.fail(join(path, "inputs"), "an input op reads no other op")
    if kind is not OpKind.INPUT and not inputs:
        r.fail(join(path, "inputs"), f"a {kind.value} op needs at least one input")
    op_dtype = r.read(GRAPH_OP_KEYS["dtype"], d.get("dtype", dtype), join(path, "dtype"))
    out = TensorSpec(r.shape(d["shape"], join(path, "shape")), op_dtype)
    weight = None
    if d.get("weight") is not None:
        weight = TensorSpec(r.shape(d["weight"], join(path, "weight")), op_dtype)
    attrs = _spec_attrs(r, d.get("attrs", {}), join(path, "attrs"))
    _check_explicit_op(r, path, kind, out, weight, in_shapes, attrs)
    params = (r.nonneg_int(d["params"], join(path, "params")) if "params" in d
              else moe_params(attrs, out.shape[-1]) if kind is OpKind.MOE
              else (weight.numel if weight is not None else 0))
    if kind is OpKind.LINEAR and weight is not None:
        attrs.setdefault("bias", int(params == weight.numel + weight.shape[1]))
        attrs.setdefault("tied", int(params == 0))
    flops = (r.number(d["flops"], join(path, "flops"), nonneg=True) if "flops" in d
             else _default_flops(kind, out, weight, in_shapes, attrs))
    block, block_index = _spec_block(r, d, path)
    source_params = tuple(r.string(x, join(join(path, "source_params"), j)) for j, x in
                          enumerate(r.sequence(d.get("source_params", []),
                                               join(path, "source_params"))))
    return Op(op_name, kind, tuple(inputs), out, weight, params, float(flops),
              block, block_index, _attrs(**attrs), source_params)


def _spec_attrs(r: Reader, raw: Any, path: str) -> dict[str, int]:
    """``attrs``: a mapping of string names to integers."""
    if not isinstance(raw, Mapping):
        r.fail(path, f"expected a mapping of integers, got {raw!r}")
    attrs: dict[str, int] = {}
    for k, v in raw.items():
        if not isinstance(k, str):
            r.fail(path, f"attribute names must be strings, got {k!r}")
        attrs[k] = r.integer(v, join(path, k))
    return attrs


def _spec_block(r: Reader, d: Mapping[str, Any], path: str) -> tuple[str | None, int | None]:
    """``block`` / ``block_index``: both or neither, since tying needs the pair."""
    block, block_index = d.get("block"), d.get("block_index")
    if (block is None) != (block_index is None):
        r.fail(join(path, "block_index" if block_index is None else "block"),
               "block and block_index must be given together")
    if block is None:
        return None, None
    return r.string(block, join(path, "block")), r.nonneg_int(block_index, join(path, "block_index"))


def graph_to_spec(graph: Graph) -> dict[str, Any]:
    """The explicit ``kind: graph`` form of ``graph`` (every field spelled out), which
    :func:`graph_from_spec` reads back to an equal graph: how a plan records a model given as
    an object (an imported ``nn.Module``)."""
    ops = []
    for op in graph.ops:
        d: dict[str, Any] = {"name": op.name, "kind": op.kind.value, "inputs": list(op.inputs),
                             "shape": list(op.output.shape), "dtype": op.output.dtype,
                             "params": op.params, "flops": op.flops}
        if op.weight is not None:
            d["weight"] = list(op.weight.shape)
        if op.block is not None:
            d["block"], d["block_index"] = op.block, op.block_index
        if op.attrs:
            d["attrs"] = dict(op.attrs)
        if op.source_params:
            d["source_params"] = list(op.source_params)
        ops.append(d)
    out: dict[str, Any] = {"kind": "graph", "name": graph.name, "ops": ops}
    if graph.replicated_ops:
        out["replicated_ops"] = list(graph.replicated_ops)
    return out


_FOLLOWING = frozenset({OpKind.POOL, OpKind.FLATTEN, OpKind.LOSS, OpKind.PART})
"""Kinds laid out as the op producing their input (strategies.FOLLOWER_KINDS but the
element-wise ones, which also stand alone): a model input is not one."""


def _check_explicit_op(r: Reader, path: str, kind: OpKind, out: TensorSpec,
                       weight: TensorSpec | None, in_shapes: list[tuple[int, ...]],
                       attrs: dict[str, int]) -> None:
    """Shape rules the strategy generators rely on, checked per kind."""
    if kind.is_elementwise:  # an imported op may read a view of its output's elements
        for j, shape in enumerate(in_shapes):
            if not elementwise_reads(shape, out.shape):
                r.fail(join(join(path, "inputs"), j),
                       f"a {kind.value} op's input of shape {list(shape)} neither broadcasts "
                       f"to its output's {list(out.shape)} nor holds as many elements")
    if kind is OpKind.LINEAR:
        if weight is None or weight.rank != 2:
            r.fail(join(path, "weight"), "a linear op needs a 2-D weight [in, out]")
        if out.shape[-1] != weight.shape[1]:
            r.fail(join(path, "shape"), f"last dim {out.shape[-1]} != weight out-features "
                                        f"{weight.shape[1]}")
        if in_shapes and in_shapes[0][-1] != weight.shape[0]:
            r.fail(join(path, "weight"), f"in-features {weight.shape[0]} != the input's last "
                                         f"dim {in_shapes[0][-1]}")
    elif kind is OpKind.EMBEDDING:
        if weight is None or weight.rank != 2:
            r.fail(join(path, "weight"), "an embedding op needs a 2-D weight [vocab, hidden]")
        attrs.setdefault("vocab", weight.shape[0])
    elif kind is OpKind.CONV2D:
        if weight is None or weight.rank != 4:
            r.fail(join(path, "weight"), "a conv2d op needs a 4-D weight [c_out, c_in, k, k]")
        attrs.setdefault("kernel", weight.shape[-1])
    elif kind is OpKind.ATTENTION:
        for a in ("heads", "seq_len"):
            if a not in attrs:
                r.fail(join(path, "attrs"), f"an attention op needs attrs.{a}")
        if out.shape[-1] % attrs["heads"]:
            r.fail(join(join(path, "attrs"), "heads"),
                   f"hidden size {out.shape[-1]} is not divisible by {attrs['heads']} heads")
    elif kind is OpKind.MOE:
        for a in ("experts", "top_k", "ffn"):
            if a not in attrs:
                r.fail(join(path, "attrs"), f"a moe op needs attrs.{a} (see ilp_planner/ir/graph.py)")
    elif kind is OpKind.POOL and "kernel" not in attrs:
        if out.rank == 4 and in_shapes and len(in_shapes[0]) == 4:
            attrs["kernel"] = max(1, in_shapes[0][-1] // out.shape[-1])
