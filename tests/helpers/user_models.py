"""Models written the way users write them (nanoGPT, a Llama block, a small ResNet), for the
importer's tests and examples. They are plain ``nn.Module`` s with no planner conventions."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runtime import modules


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention: one fused ``c_attn`` laid out ``[q | k | v]``, SDPA."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head
        self.causal = True  # False: bidirectional, as an encoder's
        self.attn_mask: torch.Tensor | None = None  # an explicit mask instead of the flag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(c, dim=2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        mask = self.attn_mask
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                           is_causal=self.causal and mask is None)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class NanoBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT: token + position embeddings, blocks ``transformer.h.i``, tied ``lm_head``."""

    def __init__(self, vocab: int = 64, block_size: int = 8, n_embd: int = 16, n_head: int = 2,
                 n_layer: int = 2):
        super().__init__()
        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab, n_embd),
            "wpe": nn.Embedding(block_size, n_embd),
            "h": nn.ModuleList(NanoBlock(n_embd, n_head) for _ in range(n_layer)),
            "ln_f": nn.LayerNorm(n_embd),
        })
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer["wte"].weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer["wte"](idx) + self.transformer["wpe"](pos)
        for block in self.transformer["h"]:
            x = block(x)
        return self.lm_head(self.transformer["ln_f"](x))


class RMSNorm(nn.Module):
    """Llama's hand-written RMSNorm."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return norm * self.weight


def split_heads(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """A fused ``(b, t, 3c)`` projection as q, k and v, each ``(b, heads, t, c / heads)``."""
    b, t, c3 = qkv.shape
    c = c3 // 3
    return tuple(y.view(b, t, heads, c // heads).transpose(1, 2) for y in qkv.split(c, dim=2))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class LlamaBlock(nn.Module):
    """A Llama decoder block: RMSNorm, rotary q/k, grouped-query attention, SwiGLU."""

    def __init__(self, dim: int = 32, n_heads: int = 4, n_kv_heads: int = 2, hidden: int = 64,
                 seq_len: int = 8):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.attention_norm = RMSNorm(dim)
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = RMSNorm(dim)
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim))
        freqs = torch.outer(torch.arange(seq_len).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.attention_norm(x)
        q = self.wq(h).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(h).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(h).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q = q * self.cos + rotate_half(q) * self.sin
        k = k * self.cos + rotate_half(k) * self.sin
        rep = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, -1))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, n_layers: int = 2, seq_len: int = 8):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, seq_len=seq_len) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


class BasicBlock(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + x)


class ResNet(nn.Module):
    """A small ResNet: stem, two basic blocks, global average pool, classifier."""

    def __init__(self, width: int = 8, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = nn.Sequential(BasicBlock(width), BasicBlock(width))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer1(x)
        return self.fc(torch.flatten(self.pool(x), 1))


class MaskedBlock(modules.Block):
    """The runtime GPT's block with its attention written out — ``q @ kᵀ``, a mask,
    softmax, ``@ v`` on the runtime's head-major fused QKV — the mask chosen by ``mask``:
    ``causal`` (a lower-triangular buffer, ``masked_fill`` with −∞: nanoGPT's), ``none``
    (bidirectional), ``padding`` (keys masked where the input says: computed from the
    inputs), ``alibi`` (a constant additive bias by distance)."""

    def __init__(self, h: int, heads: int, seq_len: int, mask: str):
        super().__init__(h, heads, seq_len)
        self.mask = mask
        self.register_buffer("tril", torch.tril(torch.ones(seq_len, seq_len)), persistent=False)
        pos = torch.arange(seq_len)
        self.register_buffer("bias", -0.5 * (pos[:, None] - pos[None, :]).abs().float(),
                             persistent=False)

    def attention(self, qkv: torch.Tensor) -> torch.Tensor:
        tokens, width = qkv.shape
        s, d = self.seq_len, width // (3 * self.heads)
        x = qkv.reshape(tokens // s, s, self.heads, 3, d)
        q, k, v = (x[:, :, :, i].transpose(1, 2) for i in range(3))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        if self.mask == "causal":
            scores = scores.masked_fill(self.tril == 0, float("-inf"))
        elif self.mask == "padding":
            scores = scores.masked_fill((qkv[:, :1] < -3).reshape(tokens // s, 1, 1, s),
                                        float("-inf"))
        elif self.mask == "alibi":
            scores = scores + self.bias
        out = torch.softmax(scores, dim=-1) @ v
        return out.transpose(1, 2).reshape(tokens, self.heads * d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn["proj"](self.attention(self.attn["qkv"](self.ln1(x))))
        return x + self.mlp["fc2"](F.gelu(self.mlp["fc1"](self.ln2(x))))


class MaskedGPT(modules.GPT):
    """The runtime's tiny GPT (:class:`runtime.modules.GPT`, the executor's computation)
    with hand-written attention masked as ``mask`` says (:class:`MaskedBlock`)."""

    def __init__(self, hidden: int, layers: int, heads: int, seq_len: int, vocab: int,
                 mask: str):
        super().__init__(hidden, layers, heads, seq_len, vocab)
        self.h = nn.ModuleList(MaskedBlock(hidden, heads, seq_len, mask) for _ in range(layers))


class TwinFollowers(nn.Module):
    """``proj``'s output read by two followers in functional code, ``relu`` and ``silu``:
    both fuse into ``proj``'s node and read one shared value (converted once at ``proj``'s
    boundary), whose product feeds ``out``."""

    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.proj, self.out = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.proj(x)
        return self.out(torch.relu(p) * F.silu(p))


class ResidualColumns(nn.Module):
    """An MLP's residual branch added to the module's own float input ``(b, t, c)``: a plan
    splitting the add's columns reads the input split on its features (the real tensor's
    last dim)."""

    def __init__(self, dim: int = 16, hidden: int = 32, classes: int = 8) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.down(torch.relu(self.up(x))))


class CodedLinear(nn.Module):
    """A linear applied in functional code (``F.linear`` on a parameter) and a ReLU on its
    output, between two linear modules: the ReLU follows the functional linear inside one
    planner node, with no module boundary between them."""

    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.w = nn.Parameter(torch.randn(hidden, hidden) / math.sqrt(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(F.linear(self.inp(x), self.w)))


class TransposedHead(nn.Module):
    """Token embeddings, a linear, and a head in the module's own code on a parameter
    stored (vocab, dim) and transposed there with ``.T`` (``h @ head.T``)."""

    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.wte, self.body = nn.Embedding(vocab, dim), nn.Linear(dim, dim)
        self.head = nn.Parameter(torch.randn(vocab, dim) / math.sqrt(dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(self.wte(ids))) @ self.head.T


def rotary_table(head_dim: int, positions: int, theta: float = 10000.0) -> torch.Tensor:
    """torchtitan's rotary table: ``e^{i·t·θ_j}`` per position ``t`` and pair ``j``."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(positions).float(), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def rotate_complex(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``x`` (batch, seq, heads, head_dim) turned as complex pairs, torchtitan's way."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    turned = torch.view_as_real(pairs * table.view(1, pairs.shape[1], 1, pairs.shape[-1]))
    return turned.flatten(3).type_as(x)


class TitanAttention(nn.Module):
    """torchtitan's attention: ``wq``, ``wk``, ``wv``, ``wo``; key / value heads repeated by
    ``repeat_interleave`` for grouped-query attention, SDPA."""

    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = rotate_complex(self.wq(x).view(b, s, -1, self.head_dim), table)
        k = rotate_complex(self.wk(x).view(b, s, -1, self.head_dim), table)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        rep = self.heads // self.kv_heads
        k, v = (t.repeat_interleave(rep, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))


class TitanFeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) · w3 x)``."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, hidden: int):
        super().__init__()
        self.attention = TitanAttention(dim, heads, kv_heads)
        self.feed_forward = TitanFeedForward(dim, hidden)
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), table)
        return h + self.feed_forward(self.ffn_norm(h))


class TitanLlama(nn.Module):
    """A Llama written the way torchtitan's is: complex rotary positions (a non-persistent
    buffer), the blocks in a ``ModuleDict``, an untied ``output`` head."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, kv_heads: int,
                 hidden: int, max_seq: int):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.register_buffer("rotary", rotary_table(dim // heads, 2 * max_seq), persistent=False)
        self.layers = nn.ModuleDict({str(i): TitanBlock(dim, heads, kv_heads, hidden)
                                     for i in range(layers)})
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        table = self.rotary[: tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h, table)
        return self.output(self.norm(h))


class EncoderLM(nn.Module):
    """PyTorch's own ``nn.TransformerEncoderLayer`` (its ``nn.MultiheadAttention`` runs
    ``F.linear`` on the block's input, which its residual add also reads) between an
    embedding and a head."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0,
                                                batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.emb(ids)))


class WeightNormed(nn.Module):
    """A linear under ``torch.nn.utils.parametrizations.weight_norm`` (its weight computed
    from a direction and a gain: the planner keeps it an opaque op, replicated), then a
    ReLU and a plain linear the plan may split. DTensor has no rule for weight norm's
    backward (``aten._weight_norm_interface_backward``)."""

    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.normed = nn.utils.parametrizations.weight_norm(nn.Linear(dim, hidden))
        self.out = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.normed(x)))


class ReLU6MLP(nn.Module):
    """An MLP block with ``nn.ReLU6`` (MobileNetV2's activation) between two linears the
    plan splits: DTensor runs its backward (``aten.hardtanh_backward``) by no rule of its
    own, so the runtime registers an element-wise one."""

    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.embed, self.up = nn.Embedding(vocab, dim), nn.Linear(dim, 2 * dim)
        self.act, self.down = nn.ReLU6(), nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        return self.head(x + self.down(self.act(self.up(x))))


class SequenceToImage(nn.Module):
    """Segformer's spatial reduction, reduced: tokens ``(B, H·W, C)`` normalised, turned
    into an image by ``transpose(1, 2).reshape(B, C, H, W)`` and read by a convolution
    (the importer took the image for ``(B·C·H, W)`` rows, and the runtime split its width
    where the plan split its channels)."""

    def __init__(self, channels: int = 16, side: int = 8) -> None:
        super().__init__()
        self.side = side
        self.embed, self.norm = nn.Linear(3, channels), nn.LayerNorm(channels)
        self.reduce = nn.Conv2d(channels, channels, kernel_size=2, stride=2)
        self.head = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.embed(x))
        b, _, c = h.shape
        image = h.transpose(1, 2).reshape(b, c, self.side, self.side)
        return self.head(self.reduce(image).flatten(2).mean(-1))


class PaddedConv(nn.Module):
    """An image padded in the module's code before its first convolution (MobileNetV2's
    "same" padding): the pad reads model data only, so no gradient comes back through the
    edge to the convolution, and autograd runs none of its backward program."""

    def __init__(self, channels: int = 8) -> None:
        super().__init__()
        self.conv, self.act = nn.Conv2d(3, channels, kernel_size=3), nn.ReLU()
        self.pool, self.flat = nn.AdaptiveAvgPool2d(1), nn.Flatten()
        self.head = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.conv(nn.functional.pad(x, (1, 1, 1, 1))))
        return self.head(self.flat(self.pool(h)))


class FrozenBase(nn.Module):
    """A fine-tuning's frozen base (``requires_grad=False``): an embedding table and a
    projection, under a trained adapter and head. Nothing below the adapter takes a
    gradient, so the adapter computes no input gradient either."""

    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.embed, self.base = nn.Embedding(vocab, dim), nn.Linear(dim, 4 * dim)
        self.act, self.adapter = nn.GELU(), nn.Linear(4 * dim, dim)
        self.head = nn.Linear(dim, vocab)
        for p in (*self.embed.parameters(), *self.base.parameters()):
            p.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.adapter(self.act(self.base(self.embed(ids)))))


class LoRALinear(nn.Module):
    """PEFT's LoRA on a linear: the base frozen, ``B·A·x`` scaled by ``alpha / r`` added,
    A and B trained (B drawn small, not zero as PEFT starts it, so that A's gradient is
    not zero at the first step either)."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, r, bias=False)
        self.lora_B = nn.Linear(r, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.02)
        self.scaling = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


class ChecksItsLengths(nn.Module):
    """XLM's forward asserts ``lengths.max().item() <= slen``: a 0-d value computed from
    the ids, read off as a Python number (torch proves the bound: no guard)."""

    def __init__(self, vocab: int = 64, hidden: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _, slen = ids.size()
        lengths = (ids != 2).sum(dim=1).long()
        assert lengths.max().item() <= slen
        return self.head(self.emb(ids))


class DropoutOnConstants(nn.Module):
    """One dropout module called on the embeddings, then on a table made in the forward
    from ``arange`` (XLNet's relative position encodings: folded into a constant, no op of
    the plan), then on the last hidden state."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.dropout = nn.Dropout(0.0)
        self.up = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.dropout(self.wte(ids))
        steps = torch.arange(ids.shape[1], dtype=h.dtype)[:, None]
        positions = self.dropout(torch.sin(steps / (1 + torch.arange(h.shape[-1]))))
        return self.head(self.dropout(self.up(h + positions)))


class NoGradScaled(nn.Module):
    """Token features scaled by a statistic computed under ``torch.no_grad()`` (kept out of
    autograd, as a user normalises by a detached norm): ``torch.export`` keeps that block as
    one ``wrap_with_set_grad_enabled`` region."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.up = nn.Linear(hidden, 2 * hidden)
        self.down = nn.Linear(2 * hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.up(self.wte(ids))
        with torch.no_grad():
            scale = h.pow(2).mean(-1, keepdim=True).add(1.0).rsqrt()
        return self.head(self.down(F.gelu(h) * scale))


class TableInAttention(nn.Module):
    """Swin's window attention written the older way: the relative position bias table is a
    bare parameter of the attention module itself, beside its q / k / v projections,
    indexed at constant positions and added in SDPA's mask."""

    def __init__(self, hidden: int, heads: int, seq: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.table = nn.Parameter(0.1 * torch.randn(2 * seq - 1, heads))
        steps = torch.arange(seq)
        self.register_buffer("index", (steps[None, :] - steps[:, None] + seq - 1).flatten(),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = split_heads(self.qkv(x), self.heads)
        bias = self.table[self.index].view(t, t, self.heads).permute(2, 0, 1).unsqueeze(0)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class TableInAttentionLM(nn.Module):
    """A one-layer language model around :class:`TableInAttention`."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, seq: int = 8):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.attn = TableInAttention(hidden, heads, seq)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        return self.head(h + self.attn(h))


class GatedLinearAttention(nn.Module):
    """MiniMax's lightning attention in miniature: ``q @ kᵀ`` decayed and multiplied by
    ``v`` with no softmax (no attention, for the importer), gated by a projection of the
    block's input."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4, seq: int = 8):
        super().__init__()
        self.heads = heads
        self.wte = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.gate = nn.Linear(hidden, hidden, bias=False)
        self.head = nn.Linear(hidden, vocab)
        steps = torch.arange(seq, dtype=torch.float32)
        self.register_buffer("decay", torch.exp(-(steps[:, None] - steps[None, :]).clamp(min=0)),
                             persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        b, t, c = h.shape
        q, k, v = split_heads(F.silu(self.qkv(h)), self.heads)
        y = (((q @ k.transpose(-1, -2)) * self.decay) @ v).transpose(1, 2).reshape(b, t, c)
        return self.head(torch.sigmoid(self.gate(h)) * y)


class SinkAttention(nn.Module):
    """GPT-OSS's attention in miniature: a learned per-head sink logit joins each row of the
    scores before the softmax and is dropped after it, so the probabilities sum to less than
    one; the product with the values, re-viewed ``(b, t, c)``, feeds the output projection."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.wte = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.sinks = nn.Parameter(torch.randn(heads))
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        b, t, c = h.shape
        q, k, v = split_heads(self.qkv(h), self.heads)
        scores = q @ k.transpose(-1, -2)
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, t, -1)
        logits = torch.cat([scores, sinks], dim=-1)
        probs = F.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
        y = (probs @ v).transpose(1, 2).reshape(b, t, c)
        return self.head(h + self.proj(y))


class GatedProbabilities(nn.Module):
    """Hand-written attention whose probabilities each head scales by a learned gate of the
    token (a projection of the block's input) before they weigh the values."""

    def __init__(self, vocab: int = 64, hidden: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.wte = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.gate = nn.Linear(hidden, heads)
        self.proj = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        b, t, c = h.shape
        q, k, v = split_heads(self.qkv(h), self.heads)
        p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(c // self.heads), dim=-1)
        p = p * torch.sigmoid(self.gate(h)).transpose(1, 2).unsqueeze(-1)
        y = (p @ v).transpose(1, 2).reshape(b, t, c)
        return self.head(h + self.proj(y))
