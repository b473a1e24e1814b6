"""The runtime's tiny models as ordinary ``nn.Module`` s — what a user would write.

They compute exactly what the runtime's kernels compute for the builders' graphs
(:mod:`runtime.model`: ``y = x W + b`` with ``W`` stored ``(in, out)``, head-major fused QKV,
a learned position table, GPT's head tied to the embedding table), so importing one
(:func:`ilp_planner.inputs.importer.from_module`) must give the graph the builder gives, and a plan
applied to it (:func:`ilp_planner.parallelize`) must train like the module in
one process. Parameters are drawn as ``nn.Linear`` / ``nn.LayerNorm`` / ``nn.Embedding``
draw theirs (seed torch identically on every rank).
"""

from __future__ import annotations

import torch
from torch import nn

from runtime import model


class Linear(nn.Module):
    """``y = x W (+ b)``, ``W`` of shape ``(in, out)`` as the planner shards it."""

    def __init__(self, k: int, n: int, bias: bool = True):
        super().__init__()
        bound = 1.0 / k**0.5
        self.weight = nn.Parameter(torch.empty(k, n).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(n).uniform_(-bound, bound)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return model.linear(x, self.weight, self.bias)


class LayerNorm(nn.Module):
    def __init__(self, h: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))
        self.bias = nn.Parameter(torch.zeros(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return model.layer_norm(x, self.weight, self.bias)


class Block(nn.Module):
    """Pre-LN transformer block on ``(tokens, hidden)`` activations."""

    def __init__(self, h: int, heads: int, seq_len: int):
        super().__init__()
        self.heads, self.seq_len = heads, seq_len
        self.ln1 = LayerNorm(h)
        self.attn = nn.ModuleDict({"qkv": Linear(h, 3 * h), "proj": Linear(h, h)})
        self.ln2 = LayerNorm(h)
        self.mlp = nn.ModuleDict({"fc1": Linear(h, 4 * h), "fc2": Linear(4 * h, h)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = model.attention(self.attn["qkv"](self.ln1(x)), self.heads, self.seq_len)
        x = x + self.attn["proj"](a)
        return x + self.mlp["fc2"](model.gelu(self.mlp["fc1"](self.ln2(x))))


class GPT(nn.Module):
    """:func:`ilp_planner.inputs.models.gpt` as a module: token ids ``(batch·seq_len,)`` → logits."""

    def __init__(self, hidden: int, layers: int, heads: int, seq_len: int, vocab: int):
        super().__init__()
        self.seq_len = seq_len
        self.embed = nn.ParameterDict({"weight": nn.Parameter(torch.randn(vocab, hidden) * 0.02),
                                       "pos": nn.Parameter(torch.randn(seq_len, hidden) * 0.02)})
        self.h = nn.ModuleList(Block(hidden, heads, seq_len) for _ in range(layers))
        self.ln_f = LayerNorm(hidden)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = model.positions(0, ids.shape[0], self.seq_len, ids.device)
        x = nn.functional.embedding(ids, self.embed["weight"]) + \
            nn.functional.embedding(pos, self.embed["pos"])
        for block in self.h:
            x = block(x)
        return model.linear(self.ln_f(x), self.embed["weight"].t())


class MLP(nn.Module):
    """:func:`ilp_planner.inputs.models.mlp` as a module."""

    def __init__(self, dims: list[int], bias: bool = False):
        super().__init__()
        self.fc = nn.ModuleList(Linear(k, n, bias) for k, n in zip(dims[:-1], dims[1:],
                                                                   strict=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, fc in enumerate(self.fc):
            x = fc(x)
            if i < len(self.fc) - 1:
                x = model.relu(x)
        return x
