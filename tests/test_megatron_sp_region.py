"""Megatron-SP splits the tokens over TP outside the tensor-parallel region only: a gated MLP's
product (SwiGLU's ``silu(w1 x) * w3 x``) and an activation between a column- and a
row-parallel linear run on the columns the column-parallel linears leave, as Megatron-SP
runs them — not regathered into token blocks and split back into columns, a relayout each
way the engine never issues. Norms and residual adds still split their tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ilp_planner.inputs.config import load_config
from ilp_planner.inputs.importer import from_module
from ilp_planner.intra_op.baselines import megatron_filter
from ilp_planner.ir.cluster import MeshAxis
from ilp_planner.ir.graph import OpKind
from ilp_planner.testing import restricted_plan

CLUSTER = {"nodes": 1, "devices_per_node": 4, "memory_gib": 1, "peak_tflops": 0.05,
           "efficiency": 0.5, "links": {"intra": {"latency_us": 30, "bandwidth_gbps": 20},
                                        "inter": {"latency_us": 60, "bandwidth_gbps": 10}}}


class GatedBlock(nn.Module):
    """A pre-norm block with a SwiGLU MLP, as Llama writes it."""

    def __init__(self, h: int = 64, ffn: int = 128) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(h)
        self.w1 = nn.Linear(h, ffn, bias=False)
        self.w3 = nn.Linear(h, ffn, bias=False)
        self.w2 = nn.Linear(ffn, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Model(nn.Module):
    def __init__(self, vocab: int = 128, h: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, h)
        self.blocks = nn.Sequential(GatedBlock(h), GatedBlock(h))
        self.head = nn.Linear(h, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


@pytest.fixture(scope="module")
def config():
    graph = from_module(Model(), (torch.randint(0, 128, (8, 16)),))
    return load_config({"model": graph, "cluster": CLUSTER})


def test_the_gated_product_stays_on_the_tensor_parallel_columns(config):
    tp = MeshAxis(1, 2)
    sp = restricted_plan(config, megatron_filter(MeshAxis(1, 2), tp, sequence_parallel=True))
    layers = {ly.name: ly for ly in sp.layers}
    graph = config.graph
    products = [op for op in graph.ops if op.kind is OpKind.MUL]
    assert len(products) == 2
    for op in products:
        mul = layers[op.name]
        assert mul.output.split_degree(1) == tp.size, (op.name, mul.output)  # its columns
        down = next(graph[c] for c in graph.consumers(op.name))
        assert down.kind is OpKind.LINEAR
        # read as it is: nothing moves inside the region, the product and the row-parallel
        # linear's input issue no program (its partial sums are reduce-scattered at the add)
        assert layers[down.name].inputs[0].canonical_key() == mul.output.canonical_key()
        assert not mul.collectives
        assert not [c for c in layers[down.name].collectives if c.purpose == "activation"]
    for op in graph.ops:  # outside the region the tokens split over TP
        if op.kind in (OpKind.LAYERNORM, OpKind.ADD):
            assert layers[op.name].output.split_degree(0) == 4, op.name
