"""Per-head q / k norms (Qwen3, Gemma-3: ``attrs.group_width``): a norm on the projection's
``(tokens, heads · head_dim)`` value whose columns split only in whole heads, its gain
(``head_dim`` entries) whole on every device with its gradient summed over every axis the
rows or the heads are split on, priced by its bytes like any norm — against closed forms."""

from __future__ import annotations

import math
from types import MappingProxyType

import pytest
import torch
from torch import nn

from ilp_planner.inputs.importer import from_module
from ilp_planner.intra_op.baselines import megatron_filter
from ilp_planner.ir.cluster import Cluster, Link, MeshAxis
from ilp_planner.ir.device import device_spec
from ilp_planner.ir.graph import Op, OpKind, TensorSpec
from ilp_planner.ir.layouts import Layout, Split
from ilp_planner.lowering.cost_model import CollectiveKind, MemorySpec, collective_time
from ilp_planner.lowering.strategies import (
    StrategyContext,
    op_strategies,
    param_layouts,
    param_shapes,
)
from runtime.dtensors import DimMap

A100 = device_spec("a100-80gb")
HBM = 2039e9 * A100.fit.memory_efficiency  # achieved bytes/s
FLOOR = A100.fit.kernel_floor_s
INTRA, INTER = Link.from_bandwidth(5, 2400), Link.from_bandwidth(10, 100)
TOKENS, HEAD = 8192, 128


def ctx(nodes: int = 2, local: int = 4) -> StrategyContext:
    cluster = Cluster(nodes, local, 80 * 2**30, 312e12, INTRA, INTER, 0.5, "a100", A100)
    return StrategyContext(cluster, nodes, local, MemorySpec.preset("adam"))


def norm(heads: int, grouped: bool = True) -> Op:
    """An RMSNorm over ``(8192 tokens, heads · 128)`` bf16, per head where ``grouped``."""
    h = heads * HEAD
    attrs = {"group_width": HEAD, "heads_dim": 2} if grouped else {}
    return Op("q_norm", OpKind.RMSNORM, ("q_proj",), TensorSpec((TOKENS, h), "bfloat16"),
              params=HEAD if grouped else h, flops=8.0 * TOKENS * h,
              attrs=MappingProxyType(attrs))


def _strategies(op: Op, c: StrategyContext | None = None):
    return op_strategies(op, [op.output], c or ctx())


@pytest.mark.parametrize("heads,splits", [(32, {1, 2, 4, 8}), (2, {1, 2}), (4, {1, 2, 4})])
def test_columns_split_only_in_whole_heads(heads, splits):
    """On 2 × 4 devices the columns split by every divisor of the heads up to 8 — 2 key /
    value heads: 1 or 2, never 4 although their 256 columns divide by 4 (a split that cuts
    a head) —; a whole-row norm never splits its columns."""
    got = {s.output.split_degree(1) for s in _strategies(norm(heads))}
    assert got == splits
    assert {s.output.split_degree(1) for s in _strategies(norm(heads, grouped=False))} == {1}
    for s in _strategies(norm(heads)):
        assert s.inputs == (s.output,)  # a norm reads its input in its output's layout


def test_gain_is_one_heads_width_and_whole_on_every_device():
    op = norm(32)
    assert param_shapes(op) == {"weight": (HEAD,)}
    for s in _strategies(op):
        stored, _ = param_layouts(op, s.label, s.inputs, s.weight, s.output)["weight"]
        assert stored == Layout.replicated(s.output.fact)
        assert s.update_params == HEAD  # each device updates the whole gain


def test_gain_gradient_is_summed_over_the_row_and_head_axes():
    """One AllReduce of the fp32 gain (128 × 4 bytes) over exactly the axes splitting the
    rows or the heads — the head axis counted like the row axis —, over the nodes' link
    where one of them spans nodes; none where nothing is split."""
    op = norm(32)
    seen_heads = False
    for s in _strategies(op):
        axes = [a for a, pl in enumerate(s.output.placements)
                if isinstance(pl, Split) and s.output.fact[a].size > 1]
        sync = [c for c in s.collectives if c.purpose == "grad_sync"]
        if not axes:
            assert not sync
            continue
        seen_heads |= any(s.output.placements[a] == Split(1) for a in axes)
        group = math.prod(s.output.fact[a].size for a in axes)
        link = INTER if any(s.output.fact[a].nodes > 1 for a in axes) else INTRA
        (c,) = sync
        assert (c.kind, c.group_size, c.bytes) == (CollectiveKind.ALL_REDUCE, group, HEAD * 4)
        assert c.seconds == pytest.approx(collective_time(CollectiveKind.ALL_REDUCE, group,
                                                          HEAD * 4, link))
    assert seen_heads


def test_priced_by_its_bytes_on_the_local_block():
    """Forward reads x and writes y (2 · 2 bytes · N / split), backward reads x and dy and
    writes dx (3 · 2 · N / split) in two kernels, at the achieved HBM bandwidth — the same
    as a whole-row norm's of its size, the head split dividing it as the row split does."""
    op = norm(32)
    n = TOKENS * 32 * HEAD
    for s in _strategies(op):
        split = s.output.split_degree(0) * s.output.split_degree(1)
        fwd = 4 * n / split / HBM + FLOOR
        bwd = 6 * n / split / HBM + 2 * FLOOR
        assert s.replay_compute_s == pytest.approx(fwd, rel=1e-12)
        assert s.compute_s == pytest.approx(fwd + bwd, rel=1e-12)


def test_a_group_width_not_dividing_the_features_is_named():
    op = Op("k_norm", OpKind.RMSNORM, ("k",), TensorSpec((64, 100), "float32"), params=8,
            attrs=MappingProxyType({"group_width": 8, "heads_dim": 2}))
    with pytest.raises(ValueError, match="k_norm.*group_width 8 does not divide its 100"):
        _strategies(op)


class _PerHead(nn.Module):
    """A projection viewed ``(b, s, 4 heads, 8)`` and normalised by ``norm``."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x).view(2, 8, 4, 8)).flatten(2)


@pytest.mark.parametrize("norm,grouped", [
    (nn.RMSNorm(8), True),  # torch's rms_norm over each head's 8 columns
    (nn.LayerNorm(8), True),
    (nn.LayerNorm([4, 8]), False),  # over all the heads at once: not per head
    (nn.LayerNorm(8, elementwise_affine=False), True),
])
def test_torch_norms_over_one_heads_columns_are_grouped(norm, grouped):
    """torch's own norms on a per-head view import as per-head norms on the projection,
    and only where they normalise the last dim alone with a gain of its width."""
    graph = from_module(_PerHead(norm), (torch.randn(2, 8, 32),))
    op = graph["norm"]
    assert ("group_width" in op.attrs) is grouped
    if grouped:
        assert (op.inputs, op.output.shape, op.attrs["group_width"], op.attrs["heads_dim"]) \
            == (("proj",), (16, 32), 8, 2)
        assert not [o for o in graph.ops if o.kind is OpKind.OPAQUE]


@pytest.mark.parametrize("heads_dim", [2, 1])
def test_a_real_per_head_block_is_the_ir_block_and_back(heads_dim):
    """A rank's block of the module's ``(b, s, heads, d)`` value (Gemma-3's ``(b, heads, s,
    d)`` where ``heads_dim`` is 1), half the batch and half the heads, viewed as the IR's
    tokens-major block — rows of its sequences, columns of its heads — and back: what an
    edge program at a per-head norm's boundary runs on (:class:`runtime.dtensors.DimMap`)."""
    b, s, h, d = 4, 3, 4, 5
    x = torch.arange(b * s * h * d, dtype=torch.float32).reshape(b, s, h, d)
    ir = x.reshape(b * s, h * d)
    real = x if heads_dim == 2 else x.transpose(1, 2)
    dims = DimMap(tuple(real.shape), 2, heads=heads_dim)
    assert (dims.real_dim(0), dims.real_dim(1)) == (0, heads_dim)
    for i in range(2):
        for j in range(2):
            local = real[i * 2:(i + 1) * 2].narrow(heads_dim, j * 2, 2)
            block = ir[i * 2 * s:(i + 1) * 2 * s, j * 2 * d:(j + 1) * 2 * d]
            assert torch.equal(dims.ir_block(local), block)
            assert torch.equal(dims.real_block(block, tuple(local.shape)), local)


def test_megatron_sp_keeps_a_per_head_norm_on_its_tensor_parallel_heads():
    """Megatron-SP splits token-wise ops' tokens over TP, but a per-head q / k norm runs
    on the heads its rank holds (Megatron-Core's ``qk_layernorm``, between the
    column-parallel projection and the attention): the filter keeps tokens over DP and
    heads over TP for it (with Megatron's other layouts) and never the token split over TP,
    which a whole-row norm takes alone."""
    dp, tp = MeshAxis(2, 1), MeshAxis(1, 4)
    keep = megatron_filter(dp, tp, sequence_parallel=True)
    heads = Layout((dp, tp), (Split(0), Split(1))).canonical_key()
    tokens = Layout((dp, tp), (Split(0), Split(0))).canonical_key()
    kept = {s.output.canonical_key() for s in _strategies(norm(32)) if keep(norm(32), s)}
    assert heads in kept and tokens not in kept
    plain = norm(32, grouped=False)
    assert {s.output.canonical_key() for s in _strategies(plain) if keep(plain, s)} == {tokens}


def test_a_projection_a_per_head_norm_reads_splits_its_columns_in_whole_heads():
    """The module views the projection ``(b, s, heads, d)`` before the norm's boundary, so
    a column split cutting a head (4 ways over 2 key / value heads, although their 256
    columns divide by 4) would fail in that view on the rank's block: only divisors of its
    heads are offered (``attrs.whole_heads``, marked at import beside the norm)."""
    def k_proj(marked: bool) -> Op:
        return Op("k_proj", OpKind.LINEAR, ("x",), TensorSpec((TOKENS, 2 * HEAD), "bfloat16"),
                  TensorSpec((1024, 2 * HEAD), "bfloat16"), 1024 * 2 * HEAD,
                  2.0 * TOKENS * 1024 * 2 * HEAD,
                  attrs=MappingProxyType({"bias": 0, **({"whole_heads": 2} if marked else {})}))
    x = TensorSpec((TOKENS, 1024), "bfloat16")
    assert {s.output.split_degree(1) for s in op_strategies(k_proj(True), [x], ctx())} <= {1, 2}
    assert 4 in {s.output.split_degree(1) for s in op_strategies(k_proj(False), [x], ctx())}
    torch.manual_seed(0)
    hf = pytest.importorskip("transformers")
    model = hf.Qwen3ForCausalLM(hf.Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=64, use_cache=False))
    g = from_module(model, (torch.randint(0, 64, (2, 8)),))
    assert g["model.layers.0.self_attn.q_proj"].attrs["whole_heads"] == 4
    assert g["model.layers.0.self_attn.k_proj"].attrs["whole_heads"] == 2
    assert "whole_heads" not in g["model.layers.0.self_attn.v_proj"].attrs
