"""Strategy generation: AutoDDL's 3-D family contains data parallel and both Megatron
layouts, SUMMA exists, layernorm keeps the hidden dim whole, attention splits heads only
by divisors of the head count and batch only by whole sequences, the p0 cap holds, and the
costs and memory of known members match their closed forms."""

from __future__ import annotations

import dataclasses
import math

import pytest

from ilp_planner.inputs import models
from ilp_planner.ir.cluster import Cluster, Link, MeshAxis, mesh_factorisations
from ilp_planner.ir.graph import OpKind, TensorSpec
from ilp_planner.ir.layouts import B, P, Split
from ilp_planner.lowering.cost_model import CollectiveKind, MemorySpec, collective_time
from ilp_planner.lowering.strategies import Strategy, StrategyContext, op_strategies

K = CollectiveKind
INTRA = Link.from_bandwidth(5, 2400)
INTER = Link.from_bandwidth(10, 100)
ADAM = MemorySpec.preset("adam")


def ctx(nodes: int = 2, local: int = 4, cap: int | None = None) -> StrategyContext:
    cluster = Cluster(nodes, local, memory_bytes=40 * 2**30, peak_flops=312e12, intra=INTRA,
                      inter=INTER)
    return StrategyContext(cluster, nodes, local, ADAM, cap)


MLP = models.mlp([256, 512, 128], batch=64)
FC1 = MLP["fc1"]  # I (64, 256) × W (256, 512)


def linear_strategies(c: StrategyContext | None = None) -> list[Strategy]:
    return op_strategies(FC1, [MLP["input"].output], c or ctx())


def sizes(s: Strategy) -> tuple[int, ...]:
    return tuple(a.size for a in s.fact)


def three_d(strats: list[Strategy]) -> list[Strategy]:
    return [s for s in strats if s.label.startswith("3d")]


def test_linear_3d_family_covers_every_factorisation():
    # every ordered (p0, p1, p2) of the 2 × 4 mesh, each axis a (nodes, local) split
    assert len(three_d(linear_strategies())) == len(mesh_factorisations(2, 4, 3)) == 3 * 6


def test_linear_contains_data_parallel():
    dp = [s for s in three_d(linear_strategies()) if sizes(s)[1:] == (1, 1)]
    assert [s.fact[0] for s in dp] == [MeshAxis(2, 4)]
    s = dp[0]
    assert s.inputs[0].split_degree(0) == 8 and s.inputs[0].split_degree(1) == 1
    assert s.weight.replica_degree == 8  # weight replicated on all devices
    assert s.output.split_degree(0) == 8 and not s.output.partial_axes[1:]
    # weight-gradient AllReduce of the whole weight over 8 devices across nodes
    (g,) = s.collectives
    assert (g.kind, g.group_size, g.link, g.phase, g.purpose) == (K.ALL_REDUCE, 8, "inter",
                                                                   "backward", "grad_sync")
    assert g.bytes == FC1.params * 4
    assert g.seconds == pytest.approx(collective_time(K.ALL_REDUCE, 8, FC1.params * 4, INTER))
    assert s.state_bytes == FC1.params * 16  # adam: 16 B per parameter, nothing sharded


def test_linear_contains_megatron_column_and_row():
    strats = three_d(linear_strategies())
    column = [s for s in strats if sizes(s) == (1, 8, 1)]
    row = [s for s in strats if sizes(s) == (1, 1, 8)]
    assert column and row
    for s in column:  # W split by output columns, output split by columns, no reduction
        assert s.weight.split_degree(1) == 8 and s.weight.split_degree(0) == 1
        assert s.output.split_degree(1) == 8 and s.output.partial_axes == (2,)
        assert s.output.fact[2].size == 1 and s.inputs[0].replica_degree == 8
        assert s.collectives == ()  # no weight replication, no gradient sync
        assert s.state_bytes == FC1.params * 16 / 8
    for s in row:  # W split by input rows, input split by columns, output a partial sum
        assert s.weight.split_degree(0) == 8 and s.weight.split_degree(1) == 1
        assert s.inputs[0].split_degree(1) == 8
        assert s.output.placements[2] == P and s.output.fact[2].size == 8
        assert s.collectives == ()


def test_row_parallel_bias_needs_no_gradient_reduction():
    """Megatron's row-parallel layer with a bias: the bias gradient is complete on every
    device of the partial group (each adds a share, ``runtime.ops.bias_share``), so only the
    batch axis reduces it — and the shares sum to the bias once, each share's gradient
    being the full one."""
    import torch

    from runtime.ops import bias_share

    mlp = models.mlp([256, 512, 128], batch=64, bias=True)
    strats = three_d(op_strategies(mlp["fc1"], [mlp["input"].output], ctx()))
    row = next(s for s in strats if sizes(s) == (1, 1, 8))
    assert row.output.partial_axes == (2,) and row.collectives == ()
    mixed = next(s for s in strats if sizes(s) == (2, 1, 4))  # batch over 2, rows over 4
    (sync,) = mixed.collectives
    assert sync.group_size == 2 and sync.bytes == 256 * 512 * 4 / 4 + 512 * 4
    b = torch.randn(512, requires_grad=True)
    g = torch.randn(64, 512)
    shares = [bias_share(b, row.output) for _ in range(8)]
    assert torch.allclose(sum(shares), b, rtol=1e-6)
    (grad,) = torch.autograd.grad((shares[3] * g).sum(), b)
    assert torch.equal(grad, g.sum(0))


def test_linear_3d_member_matches_autoddl_layouts():
    s = next(s for s in three_d(linear_strategies()) if sizes(s) == (2, 2, 2))
    assert s.inputs[0].placements == (Split(0), B, Split(1))
    assert s.weight.placements == (B, Split(1), Split(0))
    assert s.output.placements == (Split(0), Split(1), P)
    assert s.compute_s == pytest.approx(3 * FC1.flops / 8 / (312e12 * 0.5))
    assert s.output.local_bytes(FC1.output) == FC1.output.nbytes / 4  # 2 × 2 split, P whole


def test_summa_strategies_exist():
    summa = [s for s in linear_strategies() if s.label.startswith("summa")]
    assert summa
    for s in summa:
        r, c = sizes(s)
        assert r > 1 and c > 1 and r * c == 8
        for lay in (*s.inputs, s.weight, s.output):
            assert lay.placements == (Split(0), Split(1))
        # gathers forward, reduce-scatters back (a gather across nodes may be split into
        # an intra-node and an inter-node step through a re-view when that is cheaper)
        kinds = {(x.kind.value, x.phase, x.purpose) for x in (*s.collectives, *s.input_backward)}
        assert kinds == {("all_gather", "forward", "activation"), ("all_gather", "forward", "weight"),
                         ("reduce_scatter", "backward", "activation"),
                         ("reduce_scatter", "backward", "weight")}


def test_summa_is_not_offered_on_an_input_read_as_it_lies():
    """A linear reading a 3-D value as it lies (an opaque op's ``(b, t, c)`` output, GPT-OSS's
    sink attention): SUMMA's ``(S0, S1)`` on it would split the sequence, not K. Before, its
    program was built anyway — on 2 × 4 the 4-way split of a batch of 2 raised and the whole
    solve crashed; on 2 × 2 it was priced as a gather it is not. The other strategies stay."""
    rows = TensorSpec((4, 16, 256), MLP["input"].output.dtype)  # the same 64 rows of 256
    strats = op_strategies(FC1, [rows], ctx())
    assert strats and not [s for s in strats if s.label.startswith("summa")]
    assert {s.label for s in strats} == {s.label for s in linear_strategies()
                                         if not s.label.startswith("summa")}


def test_max_weight_replication_caps_p0():
    free = three_d(linear_strategies())
    assert max(sizes(s)[0] for s in free) == 8
    for cap in (1, 2, 4):
        capped = three_d(linear_strategies(ctx(cap=cap)))
        assert capped and max(sizes(s)[0] for s in capped) == cap
        assert {s.label for s in capped} == {s.label for s in free if sizes(s)[0] <= cap}


def test_3d_family_skips_factorisations_that_do_not_divide():
    g = models.mlp([6, 10], batch=4)  # M = 4, K = 6, N = 10 on 8 devices
    strats = op_strategies(g["fc1"], [g["input"].output], ctx())
    for s in three_d(strats):
        p0, p1, p2 = sizes(s)
        assert 4 % p0 == 0 and 10 % p1 == 0 and 6 % p2 == 0
    assert {sizes(s) for s in three_d(strats)} == {(2, 2, 2), (4, 2, 1), (4, 1, 2)}


GPT = models.gpt(hidden=48, layers=1, heads=6, seq_len=8, vocab=64, batch=4)


def test_layernorm_never_splits_hidden():
    ln = GPT["h.0.ln1"]
    strats = op_strategies(ln, [GPT["embed"].output], ctx())
    assert strats
    for s in strats:
        for lay in (*s.inputs, s.output):
            assert lay.split_degree(1) == 1 and not lay.partial_axes
    # tokens split over every divisor of the 8 devices, replication included
    assert {s.output.split_degree(0) for s in strats} == {1, 2, 4, 8}


def test_attention_splits_heads_by_divisors_of_heads_and_batch_by_sequences():
    attn = GPT["h.0.attn.core"]
    assert attn.attr("heads") == 6 and attn.output.shape == (32, 48)
    strats = op_strategies(attn, [GPT["h.0.attn.qkv"].output], ctx())
    heads_split = {s.output.split_degree(1) for s in strats}
    batch_split = {s.output.split_degree(0) for s in strats}
    # 48 columns would allow 4 and 8, but 6 heads only 1, 2 (3, 6 do not divide the mesh)
    assert heads_split == {1, 2}
    # 32 tokens would allow 8, but 4 sequences only 1, 2, 4
    assert batch_split == {1, 2, 4}
    for s in strats:
        assert 6 % s.output.split_degree(1) == 0 and 4 % s.output.split_degree(0) == 0
        assert all(lay == s.output for lay in s.inputs)


def test_attention_with_enough_heads_uses_the_whole_mesh():
    g = models.gpt(hidden=64, layers=1, heads=8, seq_len=4, vocab=64, batch=1)
    strats = op_strategies(g["h.0.attn.core"], [g["h.0.attn.qkv"].output], ctx())
    assert {s.output.split_degree(1) for s in strats} == {1, 2, 4, 8}
    assert {s.output.split_degree(0) for s in strats} == {1}  # one sequence: no batch split


def test_conv_family_contains_data_parallel():
    g = models.vgg13(batch=8, image=32)
    conv = g["conv2"]
    strats = op_strategies(conv, [g["conv1"].output], ctx())
    dp = [s for s in strats if sizes(s)[1:] == (1, 1)]
    assert len(dp) == 1 and dp[0].output.split_degree(0) == 8
    for s in strats:
        p0, p1, p2 = sizes(s)
        assert 8 % p0 == 0 and conv.weight.shape[0] % p1 == 0 and conv.weight.shape[1] % p2 == 0


@pytest.mark.parametrize("kind", [OpKind.LINEAR, OpKind.LAYERNORM, OpKind.ATTENTION])
def test_memory_is_state_plus_output_shard(kind):
    op = next(o for o in GPT.ops if o.kind is kind)
    inputs = [GPT[i].output for i in op.inputs]
    for s in op_strategies(op, inputs, ctx()):
        held = s.output.local_bytes(op.output)
        if s.label.startswith("summa"):  # and the gathered I[i, :], W[:, j], per micro-batch
            r, c = sizes(s)
            held += inputs[0].nbytes / r + op.weight.nbytes / c
        assert s.activation_bytes == pytest.approx(held)
        assert s.state_bytes <= op.params * 16 + 1e-9
        assert math.isclose(s.memory_bytes, s.state_bytes + s.activation_bytes)


def test_partial_conv_outputs_resolve_onto_channels_not_spatial_dims():
    """A conv's partial-sum output (S0, S1, P) is reduce-scattered onto channels (or the
    batch), never onto H or W, so pooling and flatten see a layout they can carry."""
    from ilp_planner.ir.cluster import MeshAxis
    from ilp_planner.ir.graph import TensorSpec
    from ilp_planner.ir.layouts import Layout, P, S
    from ilp_planner.lowering.strategies import resolve_partial

    fact = (MeshAxis(1, 2), MeshAxis(1, 2), MeshAxis(1, 2))
    fmap = TensorSpec((8, 64, 14, 14))
    out = resolve_partial(Layout(fact, (S(0), S(1), P)), fmap)
    assert out.placements == (S(0), S(1), S(1))
    odd = TensorSpec((8, 3, 14, 14))  # channels cannot take another split: batch does
    assert resolve_partial(Layout(fact, (S(0), P, P)), odd).placements == (S(0), S(0), S(0))


def test_tied_exchange_price_is_its_programs_collectives():
    """The ILP's edge price of a tied table's exchange (fast, no step lists) equals the
    seconds of the collectives the plan lists and the runtime runs, for every pair of the
    embedding's and the head's weight layouts."""
    from ilp_planner.ir.graph import TensorSpec
    from ilp_planner.lowering.strategies import tied_exchange_collectives, tied_exchange_seconds

    c = ctx()
    g = models.gpt(64, 2, 4, 16, 128, 8)
    emb, head = g["embed"], g["lm_head"]
    table = TensorSpec(emb.weight.shape, emb.weight.dtype)
    ew = {s.weight for s in op_strategies(emb, [g[i].output for i in emb.inputs], c)}
    hw = {s.weight for s in op_strategies(head, [g[i].output for i in head.inputs], c)}
    assert len(ew) > 3 and len(hw) > 3
    ew, hw = sorted(ew, key=str), sorted(hw, key=str)
    priced = tied_exchange_seconds(ew, hw, table, c.cluster)
    for i, a in enumerate(ew):
        for j, b in enumerate(hw):
            colls, local = tied_exchange_collectives(a, b, table, c.cluster)
            listed = sum(x.seconds for x in colls) + local
            assert priced[i, j] == pytest.approx(listed, rel=1e-9, abs=1e-13)


def _batchnorm(shape: tuple[int, ...] = (8, 16, 6, 6)):
    from ilp_planner.ir.graph import Op, TensorSpec

    return Op("bn", OpKind.BATCHNORM, ("conv",), TensorSpec(shape), params=2 * shape[1],
              flops=8.0 * math.prod(shape))


def test_batchnorm_splits_batch_and_channels_with_synchronised_statistics():
    """Synchronised batch norm: every batch split (8 images over 1, 2, 4, 8 devices) and
    channel split, alone or together; the forward AllReduces [Σx, Σx²] and the input's
    backward [Σdy, Σdy·x̂] — 2 × the local channels in float64 — over exactly the axes
    splitting the batch; the gains' and offsets' gradients (2 × local channels) are
    AllReduced over the same axes by weight-gradient synchronisation; none of it where the
    batch is whole."""
    bn = _batchnorm()
    c = ctx()
    strats = op_strategies(bn, [bn.output], c)
    assert {s.output.split_degree(0) for s in strats} == {1, 2, 4, 8}
    assert {(s.output.split_degree(0), s.output.split_degree(1)) for s in strats} >= {
        (2, 4), (4, 2), (8, 1), (1, 8)}
    for s in strats:
        out = s.output
        assert all(out.split_degree(d) == 1 for d in (2, 3)) and not out.has_partial
        axes = tuple(a for a in out.split_axes(0) if out.fact[a].size > 1)
        local_c = 16 // out.split_degree(1)
        stats = [x for x in s.collectives if x.purpose == "batchnorm"]
        sync = [x for x in s.collectives if x.purpose == "grad_sync"]
        if not axes:
            assert not stats and not sync and not s.input_backward
            continue
        group = out.split_degree(0)
        link = "inter" if any(out.fact[a].nodes > 1 for a in axes) else "intra"
        (fwd,), (bwd,) = stats, s.input_backward
        for x, phase in ((fwd, "forward"), (bwd, "backward")):
            assert (x.kind, x.group_size, x.bytes, x.phase, x.link) == (
                K.ALL_REDUCE, group, 2 * local_c * 8, phase, link)
            assert x.seconds == pytest.approx(collective_time(
                K.ALL_REDUCE, group, 2 * local_c * 8, INTER if link == "inter" else INTRA))
        (g,) = sync
        assert (g.kind, g.group_size, g.bytes) == (K.ALL_REDUCE, group, 2 * local_c * 4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float64"])
def test_batchnorm_statistics_are_reduced_in_float64(dtype):
    """[Σx, Σx²] in float64 whatever the model's dtype — as the runtime's batch norm forms
    and reduces them (:mod:`runtime.local_batchnorm`): in float32, ``E[x²] − E[x]²`` lost
    the variance of channels whose mean is large beside their spread, and a float32 cast
    of a float64 model's statistics made its MobileNetV2 drift from one process."""
    from ilp_planner.ir.graph import TensorSpec

    bn = dataclasses.replace(_batchnorm(), output=TensorSpec((8, 16, 6, 6), dtype))
    split = [s for s in op_strategies(bn, [bn.output], ctx()) if s.output.split_degree(0) > 1]
    assert split
    for s in split:
        (fwd,) = [x for x in s.collectives if x.purpose == "batchnorm"]
        assert fwd.bytes == 2 * (16 // s.output.split_degree(1)) * 8
