"""Importing users' ``nn.Module`` s: the runtime's own tiny models import to the
builders' graphs exactly (same plan, same cost); nanoGPT, a Llama block and a small ResNet
import with their parameters, attention, norms and repeated blocks; every API path (solve,
load_config, ``kind: torch``, plan round trip) takes an imported graph."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch import nn

import ilp_planner
from ilp_planner.errors import ConfigError
from ilp_planner.inputs import models
from ilp_planner.inputs.config import load_config
from ilp_planner.inputs.importer import from_module
from ilp_planner.intra_op.problem import build_problem
from ilp_planner.ir.cluster import Cluster, Link
from ilp_planner.ir.graph import Graph, OpKind
from ilp_planner.ir.layouts import drop_unit_axes
from ilp_planner.lowering.compute_model import op_work
from ilp_planner.lowering.shared_reads import riders
from ilp_planner.lowering.strategies import StrategyContext, op_strategies
from ilp_planner.plan.data import Plan
from ilp_planner.reports.summary import model_summary
from ilp_planner.testing import _choose
from runtime.modules import GPT, MLP
from tests.helpers.user_models import Llama, MaskedGPT, NanoGPT, ResNet, TitanLlama

CLUSTER = {"nodes": 2, "devices_per_node": 2, "memory_gib": 16, "peak_tflops": 10,
           "links": {"intra": {"latency_us": 5, "bandwidth_gbps": 100},
                     "inter": {"latency_us": 10, "bandwidth_gbps": 10}}}


def _ids(*shape: int) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.long)


# what an imported graph adds for running on the user's module (DTensor): hand-written
# attention splits batch or heads and runs unfused, the user's loss reads whole classes, a
# weight stored (out, in), an op of functional code (its readers share one value), the batch
# its rows hold (splits by its divisors only)
_EXECUTION_ATTRS = ("one_split", "unfused", "whole_classes", "weight_t", "functional",
                    "row_items")


def _attrs(op) -> dict:
    """``op``'s attrs but those for running on the user's module and the figures of the
    copies its inputs fold (the runtime's hand-written attention writes its output back as
    (tokens, hidden), a copy its projection prices:
    ``test_runtime_gpt_module_imports_to_the_builders_graph_and_plan``)."""
    return {k: v for k, v in op.attrs.items() if k not in _EXECUTION_ATTRS and k not in _folded(op)}


def _folded(op) -> dict:
    """The figures of the copies and steps folded into ``op``'s inputs."""
    return {k: v for k, v in op.attrs.items() if k.startswith("input_")}


def _same_ops(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a.ops, b.ops, strict=True):
        assert (x.kind, x.output, x.weight, x.params, x.flops, _attrs(x)) == \
            (y.kind, y.output, y.weight, y.params, y.flops, _attrs(y)), (x.name, y.name)
        assert (x.block is None) == (y.block is None) and x.block_index == y.block_index
        assert [a.ops.index(a[i]) for i in x.inputs] == [b.ops.index(b[i]) for i in y.inputs]


def test_runtime_gpt_module_imports_to_the_builders_graph_and_plan():
    hidden, layers, heads, seq, vocab, batch = 16, 2, 2, 8, 64, 4
    imported = from_module(GPT(hidden, layers, heads, seq, vocab), (_ids(batch * seq),),
                           dtensor=False)
    built = models.gpt(hidden, layers, heads, seq, vocab, batch)
    # the runtime's attention is one fused kernel (scaled_dot_product_attention) whose
    # (batch, heads, seq, d) output goes back to (tokens, hidden) as the builders' attention
    # writes it: the import folds nothing into any op, and its graph is the builders'
    assert {op.name: _folded(op) for op in imported.ops if _folded(op)} == {}
    _same_ops(imported, built)
    assert [_attrs(op) for op in imported.ops] == [dict(op.attrs) for op in built.ops]
    p_imp = ilp_planner.solve(imported, cluster=CLUSTER)
    p_built = ilp_planner.solve(dict(kind="gpt", hidden=hidden, layers=layers, heads=heads,
                                     seq_len=seq, vocab=vocab, batch=batch), cluster=CLUSTER)
    assert p_imp.cost.total_s == pytest.approx(p_built.cost.total_s, rel=1e-12)
    assert [ly.strategy.split(" ")[0] for ly in p_imp.layers] == \
        [ly.strategy.split(" ")[0] for ly in p_built.layers]
    assert [ly.output for ly in p_imp.layers] == [ly.output for ly in p_built.layers]


def test_runtime_mlp_module_imports_to_the_builders_graph():
    imported = from_module(MLP([8, 16, 4], bias=True), (torch.zeros(4, 8),))
    _same_ops(imported, models.mlp([8, 16, 4], 4, bias=True))


def test_nanogpt_import():
    model = NanoGPT()
    g = from_module(model, (_ids(2, 8),))
    assert g.total_params == sum(p.numel() for p in model.parameters())
    emb = g["transformer.wte"]
    assert emb.kind is OpKind.EMBEDDING and emb.attrs["seq_len"] == 8  # wpe folded in
    head = g["lm_head"]
    assert head.attrs["tied"] == 1 and head.params == 0  # nanoGPT ties wte and lm_head
    attn = g["transformer.h.0.attn.attention"]
    assert attn.inputs == ("transformer.h.0.attn.c_attn",)
    assert dict(attn.attrs) == {"heads": 2, "seq_len": 8, "qkv_major": 1, "functional": 1,
                                "row_items": 2}  # the batch: its rows split by divisors of 2
    assert attn.flops == 4.0 * 16 * 8 * 16
    assert g["transformer.h.1.mlp.0"].block == "transformer.h"
    assert g["transformer.h.1.mlp.0"].block_index == 1
    assert g["transformer.h.1.mlp.0"].tie_key == g["transformer.h.0.mlp.0"].tie_key
    assert g["transformer.h.0.attn.c_attn"].source_params == (
        "transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias")
    # [q | k | v] column blocks are not whole heads: attention may only split the batch
    cluster = load_config({"model": g, "cluster": CLUSTER}).cluster
    ctx = StrategyContext(cluster, 2, 2, load_config({"model": g, "cluster": CLUSTER}).memory)
    strategies = op_strategies(attn, [g[i].output for i in attn.inputs], ctx)
    assert strategies and all(s.output.split_degree(1) == 1 for s in strategies)
    text = ilp_planner.explain(ilp_planner.solve(g, cluster=CLUSTER, baselines=False))
    assert "transformer.h.[0,1].attn.c_attn" in text and "transformer.wte [embedding]" in text


def test_llama_import():
    model = Llama()
    g = from_module(model, (_ids(2, 8),))
    assert g.total_params == sum(p.numel() for p in model.parameters())
    attn = g["layers.0.attention"]
    assert attn.inputs == ("layers.0.wq", "layers.0.wk", "layers.0.wv")
    # its rotary, x·cos + rotate_half(x)·sin on q (n = 2·4·8·8) and k (n/2), as 5 kernels
    # each (mul, neg, cat, mul, add) with (10n + 2·64) × 4 bytes and 3.5n FLOPs, the cos and
    # sin rows (8, 8); then GQA's repeat_interleave of k and v (each reads k's n/2
    # elements, writes n: copies, no FLOPs). Backward, as autograd runs it: each
    # repeat_interleave sums its gradient's repeats (reads n, writes n/2, n/2 adds); per
    # tensor, dy·sin, the negation of a half, the chunk's cat of the halves' gradients,
    # dy·cos and the sum of the two paths' gradients (5 kernels, the forward's bytes and
    # FLOPs); then q's, k's and v's gradients, transposed views, copied back to their
    # projections' (tokens, features) layout (each read and written once)
    q, k = 2 * 4 * 8 * 8, 2 * 2 * 8 * 8
    forward = (10 * (q + k) + 4 * 64 + 2 * 3 * k) * 4
    cats = 2 * (q + k) * 4  # each reads its two halves and writes the whole
    back = forward + 2 * (q + 2 * k) * 4
    assert dict(attn.attrs) == {"heads": 4, "seq_len": 8, "kv_heads": 2, "input_steps": 12,
                                "input_steps_bytes": forward,
                                "input_steps_flops": int(3.5 * (q + k)), "functional": 1,
                                "input_steps_bwd": 15, "input_steps_bwd_bytes": back,
                                "input_steps_bwd_flops": int(3.5 * (q + k)) + 2 * k,
                                "input_copies": 4, "input_copies_bytes": 2 * 3 * k * 4 + cats,
                                "input_copies_concat": 2, "input_copies_repeat": 2,
                                "input_copies_bwd_bytes": 2 * 3 * k * 4,
                                "row_items": 2}  # the batch: rows split by its divisors
    assert g["layers.0.attention_norm"].kind is OpKind.RMSNORM  # hand-written RMSNorm
    assert g["layers.0.attention_norm"].params == 32
    assert g["norm"].kind is OpKind.RMSNORM
    assert g["layers.0.silu"].kind is OpKind.SILU
    swiglu = g["layers.0.mul"]
    assert swiglu.kind is OpKind.MUL and swiglu.inputs == ("layers.0.silu", "layers.0.w3")
    assert "seq_len" not in g["tok_embeddings"].attrs  # rotary: no position table
    assert not any(op.kind is OpKind.OPAQUE for op in g.ops)
    plan = ilp_planner.solve(g, cluster=CLUSTER)
    assert plan.solver.status == "optimal"
    assert all(plan.cost.total_s <= b["total_s"] + 1e-15
               for b in plan.baselines.values() if b.get("total_s") is not None)


def test_a_torchtitan_style_llama_imports_whole():
    """torchtitan's way of writing a Llama: rotary positions as complex products
    (``view_as_complex`` of q and k times a ``polar`` table, ``view_as_real`` back), GQA by
    ``repeat_interleave``, the blocks in a ``ModuleDict``. Every parameter is an op's, no op
    is opaque, and the rotary's kernels and the repeats are the attention's input steps and
    copies: each repeat reads k's (or v's) 2·2·8·8 elements and writes twice as many."""
    model = TitanLlama(64, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, max_seq=8)
    g = from_module(model, (_ids(2, 8),))
    assert g.total_params == sum(p.numel() for p in model.parameters())
    assert not any(op.kind is OpKind.OPAQUE for op in g.ops)
    attn = g["layers.0.attention.attention"]
    assert attn.kind is OpKind.ATTENTION
    assert attn.inputs == tuple(f"layers.0.attention.{w}" for w in ("wq", "wk", "wv"))
    assert (attn.attr("heads"), attn.attr("kv_heads")) == (4, 2)
    assert attn.attr("input_steps") > 0 and attn.attr("input_steps_bwd") > 0  # the rotary
    k = 2 * 2 * 8 * 8
    assert attn.attr("input_copies_repeat") == 2
    assert attn.attr("input_copies_bytes") == 2 * (k + 2 * k) * 4
    swiglu = g["layers.0.feed_forward.mul"]
    assert swiglu.inputs == ("layers.0.feed_forward.silu", "layers.0.feed_forward.w3")
    plan = ilp_planner.solve(g, cluster=CLUSTER)
    assert plan.solver.status == "optimal"


def test_resnet_import_and_solve():
    model = ResNet()
    g = from_module(model, (torch.zeros(4, 3, 8, 8),))
    assert g.total_params == sum(p.numel() for p in model.parameters())
    kinds = [op.kind for op in g.ops]
    assert kinds.count(OpKind.CONV2D) == 5 and kinds.count(OpKind.BATCHNORM) == 5
    assert g["pool"].attrs["avg"] == 1 and g["pool"].output.shape == (4, 8, 1, 1)
    assert g["fc"].kind is OpKind.LINEAR and g["fc"].inputs == ("fc.flatten",)
    assert g["layer1.1.add"].inputs == ("layer1.1.bn2", "layer1.0.relu_1")
    plan = ilp_planner.solve(g, cluster=CLUSTER)
    assert plan.solver.status == "optimal"
    # batch norm splits its batch (synchronised), so a CNN has data-parallel and Megatron-SP
    # layouts, and the plan is no slower than any baseline
    for name in ("data_parallel", "megatron_sp"):
        block = next(b for k, b in plan.baselines.items() if k.startswith(name))
        assert block.get("total_s") is not None, (name, block)
        assert plan.cost.total_s <= block["total_s"] + 1e-15

def test_sdpa_other_than_plain_causal_is_marked_and_the_executor_refuses_it():
    """The runtime's executor runs plain causal attention: an imported SDPA with
    ``is_causal=True`` and no mask is left unmarked; a bidirectional one (an encoder's) is
    marked ``attrs.not_plain_causal``, and a graph carrying the mark is refused before any
    rank starts, naming the op (the built-in GPT, which the executor does run, marked so)."""
    from runtime.errors import RuntimeSetupError
    from runtime.model import check_supported

    causal = from_module(NanoGPT(), (_ids(2, 8),))
    attn = [op for op in causal.ops if op.kind is OpKind.ATTENTION]
    assert attn and not any(op.attrs.get("not_plain_causal") for op in attn)
    model = NanoGPT()
    for block in model.transformer["h"]:
        block.attn.causal = False
    both_ways = from_module(model, (_ids(2, 8),))
    attn = [op for op in both_ways.ops if op.kind is OpKind.ATTENTION]
    assert attn and all(op.attrs.get("not_plain_causal") == 1 for op in attn)
    assert not any(op.attrs.get("unfused") for op in attn)  # SDPA's kernel is fused
    own = models.gpt(hidden=16, layers=1, heads=2, seq_len=8, vocab=64, batch=2)
    check_supported(own)
    marked = Graph(own.name, [dataclasses.replace(op, attrs={**op.attrs, "not_plain_causal": 1})
                              if op.kind is OpKind.ATTENTION else op for op in own.ops])
    with pytest.raises(RuntimeSetupError, match=r"attention '.*' has attrs\.not_plain_causal"):
        check_supported(marked)


@pytest.mark.parametrize("mask,plain", [
    (torch.ones(8, 8, dtype=torch.bool).tril(), True),
    (torch.zeros(8, 8).masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), -math.inf), True),
    (torch.ones(8, 8, dtype=torch.bool).tril() & ~torch.ones(8, 8, dtype=torch.bool).tril(-3),
     False),  # a sliding window of 3
    (torch.ones(8, 8, dtype=torch.bool), False),  # bidirectional
    (torch.zeros(8, 8).masked_fill(~torch.ones(8, 8, dtype=torch.bool).tril(), -1e4), False),
])
def test_sdpa_with_an_explicit_mask_is_plain_causal_only_where_it_is_the_lower_triangle(
        mask, plain):
    """SDPA handed a constant ``attn_mask`` (as Hugging Face's export does): a boolean lower
    triangle or its additive form (0 / −∞) is plain causal attention; a sliding window,
    an all-True mask or a finite penalty (which leaves the masked keys some weight) is not."""
    model = NanoGPT()
    for block in model.transformer["h"]:
        block.attn.attn_mask = mask
    graph = from_module(model, (_ids(2, 8),))
    attn = [op for op in graph.ops if op.kind is OpKind.ATTENTION]
    assert len(attn) == 2
    assert all(bool(op.attrs.get("not_plain_causal")) is not plain for op in attn)


@pytest.mark.parametrize("mask", ["causal", "none", "padding", "alibi"])
def test_hand_written_attention_is_marked_unless_its_mask_is_provably_causal(mask):
    """Hand-written attention (``q @ kᵀ``, a mask, softmax, ``@ v``): the importer evaluates
    the constant it is masked with. A lower-triangular buffer with ``masked_fill(−∞)`` is
    the executor's plain causal attention — the import is the builder's GPT, op for op and
    attribute for attribute, and the executor accepts it; no mask (bidirectional), a mask
    computed from the inputs (padding) or an additive bias (ALiBi-like) is marked
    ``attrs.not_plain_causal`` and the executor refuses it, naming the op."""
    from runtime.errors import RuntimeSetupError
    from runtime.model import check_supported

    args = dict(hidden=16, layers=2, heads=2, seq_len=8, vocab=64)
    # under parallelize the user's code runs as written: batch or heads, unfused
    applied = from_module(MaskedGPT(**args, mask=mask), (_ids(4 * 8),))
    assert all(op.attrs["one_split"] == op.attrs["unfused"] == 1
               for op in applied.ops if op.kind is OpKind.ATTENTION)
    imported = from_module(MaskedGPT(**args, mask=mask), (_ids(4 * 8),), dtensor=False)
    attn = [op for op in imported.ops if op.kind is OpKind.ATTENTION]
    assert len(attn) == 2
    if mask == "causal":
        _same_ops(imported, models.gpt(**args, batch=4))
        assert [_attrs(op) for op in attn] == [{"heads": 2, "seq_len": 8}] * 2
        check_supported(imported)
    else:
        assert all(op.attrs.get("not_plain_causal") == 1 for op in attn)
        # the padding mask's comparison is itself an op the executor lacks (opaque, first)
        refusal = r"attention 'h\.0\.attention' has attrs\.not_plain_causal" \
            if mask != "padding" else r"op 'h\.0\.opaque' is a opaque"
        with pytest.raises(RuntimeSetupError, match=refusal):
            check_supported(imported)


def test_scores_times_values_without_softmax_are_no_attention_and_drop_nothing():
    """``(q @ kᵀ · decay) @ v`` with no softmax (MiniMax's lightning attention) is no
    attention. Before, its output kept the scores' mark, and the gate multiplied into it
    later was taken for a mask on scores and dropped: the gate's linear reached no loss
    and was planned unused (``parallelize`` then refused its gradient). Now the product
    is an opaque op, and the gate is a linear whose output the ``mul`` reads."""
    from tests.helpers.user_models import GatedLinearAttention

    graph = from_module(GatedLinearAttention(), (torch.randint(0, 64, (4, 8)),))
    assert not [op for op in graph.ops if op.kind is OpKind.ATTENTION or op.unused]
    assert graph["gate"].kind is OpKind.LINEAR
    (mul,) = [op for op in graph.ops if op.kind is OpKind.MUL]
    assert "gate" in mul.inputs and len(mul.inputs) == 2
    assert graph["head"].inputs == (mul.name,)


def test_a_learned_gate_on_attention_probabilities_is_no_mask():
    """Attention probabilities scaled by a learned per-head gate: before, the gate was
    taken for a mask computed from the inputs and dropped, its linear planned unused.
    A value from trained ops of its own combined with scores or probabilities is now an
    opaque op reading both."""
    from tests.helpers.user_models import GatedProbabilities

    graph = from_module(GatedProbabilities(), (torch.randint(0, 64, (4, 8)),))
    assert not [op for op in graph.ops if op.unused]
    assert graph["gate"].kind is OpKind.LINEAR
    assert [op.name for op in graph.ops if "gate" in op.inputs] != []


@pytest.mark.parametrize("model", ["GatedLinearAttention", "GatedProbabilities"])
def test_scores_no_attention_reads_are_priced_as_their_product(model):
    """Scores read by an op other than an attention (MiniMax's ``(q kᵀ · decay) v``; the
    probabilities a learned gate scales) are an op of their own priced as torch counts the
    product ``q kᵀ`` — 2·b·h·t·t·d FLOPs forward, twice that backward (dq and dk) — with
    the softmax, scale and mask since as its folded steps. Before, a relayout copy stood
    for them, priced at no FLOPs."""
    from tests.helpers import user_models

    graph = from_module(getattr(user_models, model)(), (torch.randint(0, 64, (4, 8)),))
    (scores,) = [op for op in graph.ops if op.name.endswith("scores")]
    b, heads, t, d = 4, 4, 8, 8
    assert scores.kind is OpKind.OPAQUE and scores.output.shape == (b, heads, t, t)
    assert scores.flops == 2 * b * heads * t * t * d
    assert scores.attrs["bwd_flops"] == 2 * scores.flops
    assert scores.attrs["bytes_written"] == b * heads * t * t * 4
    # the softmax and the scale (GatedProbabilities), the decay (GatedLinearAttention)
    assert scores.attrs["input_steps"] == (2 if model == "GatedProbabilities" else 1)
    assert scores.inputs == (("qkv",) if model == "GatedProbabilities" else ("silu",))


class _BothBranches(nn.Module):
    """An activation computing both of its branches and picking per element (Apertus's
    xIELU): ``where(x > 0, a·x², …)`` with a learned scale on each branch."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.pos = nn.Parameter(torch.tensor([0.7]))
        self.neg = nn.Parameter(torch.tensor([0.3]))
        self.down = nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        return self.down(torch.where(h > 0, self.pos * h * h, (torch.expm1(h) - h) * self.neg))


def test_an_element_wise_op_of_three_values_reads_all_three():
    """``where(cond, a, b)`` with the condition and both branches computed from the
    activations: before, the third value was dropped — the ops computing the negative
    branch, with their parameter, were planned unused, and ``parallelize`` refused the
    gradient that parameter took. Now one opaque op reads all three, and every op reaches
    the loss."""
    graph = from_module(_BothBranches(), (torch.randn(4, 16),))
    assert not [op.name for op in graph.ops if op.unused]
    (pick,) = [op for op in graph.ops if op.name.endswith("where")]
    assert pick.kind is OpKind.OPAQUE and len(pick.inputs) == 3
    owners = {p for op in graph.ops for p in op.source_params}
    assert {"pos", "neg"} <= owners


def test_a_product_of_probabilities_no_attention_made_is_read_as_tokens_by_a_linear():
    """GPT-OSS's attention with sinks: the softmax over scores joined to a learned sink is
    no attention, so the product with the values is priced as an op of its own
    (:func:`~ilp_planner.inputs.lift_graph.scores_op`). Before, that op took the value's
    shape as re-viewed for the output projection, ``(b, t, c)``, where every op a linear
    reads is ``(tokens, features)``: the linear's strategies read its dim 1 as features —
    on 2 × 4 SUMMA's program split the batch of 4 eight ways and the solve crashed; under
    ``parallelize`` a row-parallel projection got the sequence split instead of its
    features. Now it is tokens-major, and the model solves."""
    from tests.helpers.user_models import SinkAttention

    graph = from_module(SinkAttention(), (torch.randint(0, 64, (4, 8)),))
    (proj_input,) = graph["proj"].inputs
    assert graph[proj_input].kind is OpKind.OPAQUE
    assert graph[proj_input].output.shape == (4 * 8, 32)
    cluster = {"nodes": 2, "devices_per_node": 4, "memory_gib": 16, "peak_tflops": 10,
               "intra": "nvlink3", "inter": "ib-hdr200"}
    plan = ilp_planner.solve(graph, cluster=cluster, baselines=False)
    assert {ly.name for ly in plan.layers} >= {"proj", proj_input}


def test_an_accepted_hand_written_causal_module_trains_like_the_executors_attention():
    """What makes the causal mark sound: the hand-written module the importer accepts
    computes what the executor's kernel (:func:`runtime.model.attention`, which
    :class:`runtime.modules.GPT` runs) computes — same losses and parameters over three SGD
    steps from the same parameters and data, in one process."""
    args = dict(hidden=16, layers=2, heads=2, seq_len=8, vocab=64)
    torch.manual_seed(0)
    reference = GPT(**args)
    written = MaskedGPT(**args, mask="causal")
    written.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 64, (4 * 8,))
    labels = torch.randint(0, 64, (4 * 8,))
    losses = []
    for module in (reference, written):
        opt = torch.optim.SGD(module.parameters(), lr=0.1)
        run = []
        for _ in range(3):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(module(ids), labels)
            loss.backward()
            opt.step()
            run.append(loss.item())
        losses.append(run)
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)
    for (name, a), b in zip(reference.named_parameters(), written.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_loss_fn_is_traced_with_the_model():
    def loss_fn(logits):
        return logits.float().pow(2).mean()
    g = from_module(NanoGPT(), (_ids(2, 8),), loss_fn=loss_fn)
    assert g.ops[-1].kind is OpKind.LOSS and g.ops[-1].inputs == ("lm_head",)
    assert "lm_head" in g  # module paths keep the user's names under the loss wrapper


class _Cumsum(nn.Module):
    """An opaque op between two linears. Two modules, not one called twice: a second call
    is functional code, and on 4 devices every linear strategy moves the replicated
    ``cumsum`` value into or out of it with no module boundary to run the program — a plan
    ``parallelize`` cannot run, which the solve refuses."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.head(torch.cumsum(self.fc(x), dim=-1))


def test_unshardable_ops_are_kept_replicated_and_listed():
    g = from_module(_Cumsum(), (torch.zeros(4, 8),))
    opaque = [op for op in g.ops if op.kind is OpKind.OPAQUE]
    assert [op.name for op in opaque] == ["cumsum"]
    config = load_config({"model": g, "cluster": CLUSTER})
    text = model_summary(config)
    assert "unsharded 1 op(s) kept replicated (opaque): 0 of" in text
    assert "cumsum: 0 FLOPs, 0.1 KiB read, 0.1 KiB written" in text  # torch counts no FLOPs
    plan = ilp_planner.solve(config)
    layer = next(ly for ly in plan.layers if ly.name == "cumsum")
    assert not layer.output.has_partial
    assert all(layer.output.split_degree(d) == 1 for d in range(2))  # replicated


def test_graph_objects_round_trip_through_the_plan():
    g = from_module(NanoGPT(), (_ids(2, 8),))
    plan = ilp_planner.solve(g, cluster=CLUSTER, baselines=False)
    text = json.dumps(plan.to_dict())
    again = Plan.from_dict(json.loads(text))
    rebuilt = load_config(again.config).graph
    assert [(op.name, op.kind, op.output, op.params, op.source_params, op.block_index)
            for op in rebuilt.ops] == \
        [(op.name, op.kind, op.output, op.params, op.source_params, op.block_index)
         for op in g.ops]


def test_sections_as_objects():
    g = from_module(MLP([8, 8]), (torch.zeros(4, 8),))
    link = Link(5e-6, 1e-10)
    cluster = Cluster(1, 4, 16 * 2**30, 1e13, link, link)
    a = ilp_planner.solve(g, cluster=cluster, solver={"time_limit_s": 5})
    b = ilp_planner.solve(g, cluster={"nodes": 1, "devices_per_node": 4, "memory_gib": 16,
                                      "peak_tflops": 10, "links": {
                                          "intra": {"alpha": 5e-6, "beta": 1e-10},
                                          "inter": {"alpha": 5e-6, "beta": 1e-10}}})
    assert a.cost.total_s == pytest.approx(b.cost.total_s)
    with pytest.raises(ConfigError, match="no cluster given"):
        ilp_planner.solve(g)


def test_config_kind_torch(tmp_path):
    path = tmp_path / "gpt.yaml"
    path.write_text(
        "model:\n  kind: torch\n  module: runtime.modules:GPT\n"
        "  kwargs: {hidden: 16, layers: 2, heads: 2, seq_len: 8, vocab: 64}\n"
        "  example_inputs: {ids: {shape: [32], dtype: int64, high: 64}}\n"
        "cluster:\n  nodes: 1\n  devices_per_node: 4\n  memory_gib: 16\n  peak_tflops: 10\n"
        "  links: {intra: {latency_us: 5, bandwidth_gbps: 100}, "
        "inter: {latency_us: 10, bandwidth_gbps: 10}}\n")
    config = load_config(path)
    _same_ops(config.graph, models.gpt(16, 2, 2, 8, 64, 4))
    assert config.model["kind"] == "torch"  # sweeps override kwargs and re-import
    bad = path.read_text().replace("runtime.modules:GPT", "runtime.modules:Nope")
    path.write_text(bad)
    with pytest.raises(ConfigError, match=r"model\.module.*cannot import"):
        load_config(path)


def test_one_billion_parameter_model_on_meta_device():
    with torch.device("meta"):
        model = NanoGPT(vocab=50304, block_size=1024, n_embd=2048, n_head=16, n_layer=20)
        ids = torch.zeros(4, 1024, dtype=torch.long)
    g = from_module(model, (ids,))
    n = sum(p.numel() for p in model.parameters())
    assert g.total_params == n and n > 1e9
    assert len({op.tie_key for op in g.ops if op.tie_key}) == 10  # one block's ops, tied
    assert math.isclose(g["lm_head"].flops, 2.0 * 4 * 1024 * 2048 * 50304)


def test_export_and_fx_failure_names_both():
    class ThroughNumpy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(torch.from_numpy(x.numpy() * 2))

    with pytest.raises(ConfigError, match="torch.export failed.*symbolic tracing failed"):
        from_module(ThroughNumpy(), (torch.randn(2, 4),))


def test_a_branch_on_the_data_is_named_at_its_line():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            return y if float(y.sum()) > 0 else -y

    with pytest.raises(ConfigError, match=r"computed at run time at test_importer.py:\d+ "
                                          r"\('return y if float\(y.sum\(\)\) > 0"):
        from_module(DataDependent(), (torch.randn(2, 4),))


def test_a_random_layer_skip_is_named_at_its_line():
    """LayerDrop (M2M100's default 0.05): the forward skips a layer on a random draw. The
    error names the model's line, not only torch's data-dependent guard."""
    class LayerDrop(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if torch.rand([]) < 0.1:  # the skip
                return x
            return self.fc(x)

    with pytest.raises(ConfigError) as err:
        from_module(LayerDrop(), (torch.randn(2, 4),))
    assert "test_importer.py:" in str(err.value)
    assert "'if torch.rand([]) < 0.1:  # the skip'" in str(err.value)
    assert "layerdrop" in str(err.value)


def test_an_unrecognised_moe_block_is_named_as_one():
    """An experts module looping over the experts its tokens were routed to (DBRX's form:
    no gate_up_proj / down_proj) branches on the routing; the error says it is a
    mixture-of-experts block the importer does not lift, not a LayerDrop to turn off."""
    class ToyExperts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 4, 4))

        def forward(self, x, chosen):
            out = torch.zeros_like(x)
            for e in torch.unique(chosen):  # the experts some token chose
                out = out + (chosen == e)[:, None] * (x @ self.w[e])
            return out

    class ToyBlock(nn.Module):
        def __init__(self):
            super().__init__()
            self.router = nn.Linear(4, 3)
            self.experts = ToyExperts()

        def forward(self, x):
            return self.experts(x, self.router(x).argmax(-1))

    with pytest.raises(ConfigError) as err:
        from_module(ToyBlock(), (torch.randn(5, 4),))
    text = str(err.value)
    assert "ToyExperts loops over the experts its tokens were routed to at test_importer.py:" \
        in text
    assert "mixture-of-experts block the importer does not recognise" in text
    assert "layerdrop" not in text.lower()


class _UnusedHead(nn.Module):
    """A model computing a second head its output never returns (CLIP's ``post_layernorm``
    under image classification): a linear trained in the module, reached by no loss."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.spare = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.body(x)
        self.last_spare = self.spare(h)
        return self.head(h)


def test_an_op_no_loss_reads_takes_no_gradient_and_none_is_priced():
    """Autograd gives the spare head's parameters no gradient: the import marks it unused
    (frozen, no backward), so its plan synchronises nothing for it, while the ops the loss
    reads train as before."""
    graph = from_module(_UnusedHead(), (torch.randn(4, 8),))
    spare, body = graph["spare"], graph["body"]
    assert spare.unused and spare.frozen and spare.no_grad
    assert spare.kind is OpKind.OPAQUE and spare.params == 8 * 8 + 8  # computed whole
    assert not (body.unused or body.frozen or body.no_grad)
    from ilp_planner.lowering.strategies import grad_sync

    link = {"latency_us": 5, "bandwidth_gbps": 10}
    cluster = {"nodes": 1, "devices_per_node": 4, "memory_gib": 1, "peak_tflops": 1,
               "links": {"intra": link, "inter": link}}
    config = load_config({"model": graph, "cluster": cluster})
    ctx = StrategyContext(config.cluster, 1, 4, config.memory)

    def syncs(op):
        return [b for s in op_strategies(op, [graph[i].output for i in op.inputs], ctx)
                for b in grad_sync(op, s.label, s.inputs, s.weight, s.output, ctx)]

    assert not syncs(spare) and syncs(body)
    assert ilp_planner.solve(config, baselines=False).solver.status == "optimal"


class _PooledBesideUnused(nn.Module):
    """SigLIP's image classifier: the tokens' mean feeds the loss while an attention-pooling
    head's functional ``F.linear`` reads the same tokens and reaches nothing."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.probe = nn.Parameter(torch.randn(8, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.body(x)
        self.pooled = nn.functional.linear(h, self.probe).softmax(-1)
        return self.head(h.mean(dim=1))


def test_an_unused_reader_of_a_shared_value_leaves_the_live_one_its_layouts():
    """Two pieces of functional code read ``body``'s output: the unused one is computed
    whole, carries none of the shared program (the live reader does) and is coupled to
    it by the input layout alone (it hands no gradient back), so the model solves (before:
    infeasible, no linear reading it replicated)."""
    x = torch.randn(4, 6, 8)
    link = {"latency_us": 5, "bandwidth_gbps": 10}
    cluster = {"nodes": 1, "devices_per_node": 4, "memory_gib": 1, "peak_tflops": 1,
               "links": {"intra": link, "inter": link}}
    graph = from_module(_PooledBesideUnused(), (x,))
    assert [op.name for op in graph.ops if op.unused] == ["linear", "softmax"]
    # the live reader carries the one program: its backward is the one autograd runs
    assert riders(graph) == {("linear", 0): ("head.opaque", 0)}
    plan = ilp_planner.solve(graph, cluster=cluster, baselines=False)
    assert plan.solver.status == "optimal"
    rows = {ly.name: ly for ly in plan.layers}
    assert not [c for c in rows["linear"].collectives + rows["softmax"].collectives
                if c.phase == "backward"]
    from ilp_planner.reports.explain import explain

    assert "2 of them unused (no loss reads their output" in explain(plan)


def test_an_assert_on_the_data_is_named_as_one():
    """I-BERT asserts on its activations' ranges: named as a check at its line."""
    class Checks(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            torch._assert(bool(y.isnan().sum() == 0), "nan")  # the check
            return y

    with pytest.raises(ConfigError, match=r"the forward asserts on a value computed at run "
                                          r"time at test_importer\.py:\d+ \(.torch\._assert"):
        from_module(Checks(), (torch.randn(2, 4),))


def test_a_number_read_off_the_data_only_to_check_it_imports():
    """The number is no op of the plan (before: the import failed on the 0-d value with an
    IndexError, then on the number with an AttributeError)."""
    from tests.helpers.user_models import ChecksItsLengths  # its assert not pytest's

    graph = from_module(ChecksItsLengths(), (_ids(4, 8),))
    assert [op.kind for op in graph.ops if not op.unused] == [
        OpKind.INPUT, OpKind.EMBEDDING, OpKind.LINEAR, OpKind.LOSS]
    # the lengths (computed from the ids, read by no loss) are unused and cost no backward
    assert all(op.kind is OpKind.OPAQUE and op.no_grad for op in graph.ops if op.unused)


def test_an_opaque_op_owning_several_parameters_prices_one_role_each():
    """A class token and a position table read by one ``cat`` (ViT's embeddings): the plan
    prices each as its own replicated parameter, as ``parallelize`` places them."""
    from ilp_planner.lowering.strategies import param_layouts, param_shapes

    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.cls = nn.Parameter(torch.zeros(1, 1, 8))
            self.pos = nn.Parameter(torch.zeros(1, 5, 8))

        def forward(self, x):
            x = self.proj(x)
            return torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos

    graph = from_module(Tokens(), (torch.randn(2, 4, 8),))
    (op,) = [op for op in graph.ops if op.kind is OpKind.OPAQUE and op.params]
    assert op.source_params == ("cls", "pos")
    assert param_shapes(op) == {"weight": (8,), "weight_1": (40,)}
    config = load_config({"model": graph, "cluster": CLUSTER})
    ctx = StrategyContext(config.cluster, 2, 2, config.memory)
    for st in op_strategies(op, [graph[i].output for i in op.inputs], ctx):
        assert set(param_layouts(op, st.label, st.inputs, st.weight, st.output)) == {
            "weight", "weight_1"}


class _FoldedCopies(nn.Module):
    """Attention whose q / k / v pass folded re-views before SDPA: a bf16 → fp32 cast of
    q, a transpose made contiguous (a real copy), GQA's ``repeat_interleave`` of k / v
    heads, and a view of contiguous data (free)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(16, 16, bias=False)
        self.kv = nn.Linear(16, 16, bias=False)
        self.out = nn.Linear(16, 16, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, 4, 4).transpose(1, 2).contiguous()  # (b, 4, s, 4): a copy
        q = q.to(torch.bfloat16).float()  # two casts, each a read and a write
        k, v = self.kv(x).view(b, s, 2, 8).transpose(1, 2).split(4, dim=-1)  # views
        k = k.repeat_interleave(2, dim=1)  # GQA: (b, 2, s, 4) → (b, 4, s, 4)
        v = v.repeat_interleave(2, dim=1)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, 16))


def test_folded_copies_are_priced_by_the_bytes_they_move():
    b, s = 2, 8
    g = from_module(_FoldedCopies(), (torch.randn(b, s, 16),), loss_fn=lambda y: y.sum())
    attn = next(op for op in g.ops if op.kind is OpKind.ATTENTION)
    n = b * s * 16  # q's elements; k and v hold half before their repeat
    # contiguous: n fp32 read + written; to(bf16): n fp32 read, n bf16 written; float():
    # back; each repeat_interleave reads n/2 fp32 (its strided half of kv) and writes n
    bytes_ = 2 * n * 4 + (n * 4 + n * 2) * 2 + 2 * (n // 2 * 4 + n * 4)
    assert (attn.attrs["input_steps"], attn.attrs["input_steps_bytes"],
            attn.attrs["input_steps_flops"]) == (5, bytes_, 0)
    assert (attn.attrs["input_copies"], attn.attrs["input_copies_bytes"]) == (5, bytes_)
    # priced with the attention: memory-bound kernels, a quarter each phase on 4 devices;
    # backward, as autograd runs it: contiguous passes its gradient as a view (nothing),
    # each cast casts it back (its forward's bytes), each repeat_interleave sums the
    # repeats (reads n, writes n/2: its forward's bytes, n/2 adds) — and three copies the
    # views between run: q's gradient, a transposed view, copied back to its projection's
    # layout (n read and written), the split's cat of k's and v's gradients (reads n,
    # writes n) and that copied back to kv's layout (n read and written)
    fwd, bwd = op_work(attn, 4.0)
    assert fwd.stream_bytes == bytes_ / 4 and (fwd.kernels, bwd.kernels) == (1 + 5, 2 + 7)
    back = bytes_ - 2 * n * 4 + 3 * (2 * n * 4)
    assert (bwd.stream_bytes, bwd.stream_flops) == (back / 4, n / 4)
    text = ilp_planner.explain(ilp_planner.solve(g, cluster=dict(CLUSTER, gpu="a100-80gb"),
                                                 baselines=False))
    assert f"{attn.name}: 5 kernels" in text
    assert "(of which 5 copies (2 cast, 2 repeat, 1 layout):" in text


def test_a_view_of_contiguous_data_stays_free():
    class Free(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(x).reshape(b, s, 3, 4, 4).permute(2, 0, 3, 1, 4).unbind(0)
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return y.transpose(1, 2).contiguous().view(b, s, 16)

    g = from_module(Free(), (torch.randn(2, 8, 16),), loss_fn=lambda y: y.sum())
    attn = next(op for op in g.ops if op.kind is OpKind.ATTENTION)
    assert "input_steps" not in attn.attrs


class _Depthwise(nn.Module):
    """A depthwise convolution written as ``torch.convolution`` (``groups`` its 9th
    argument, ``transposed`` its 7th) or as ``F.conv2d`` (``groups`` its 7th)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.w = nn.Parameter(torch.randn(8, 1, 3, 3))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "convolution":
            y = torch.convolution(x, self.w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 8)
        else:
            y = nn.functional.conv2d(x, self.w, None, 1, 1, 1, 8)
        return self.head(y.mean((2, 3)))


@pytest.mark.parametrize("how", ["convolution", "conv2d"])
def test_a_grouped_convolution_is_grouped_however_it_is_called(how):
    """``torch.convolution`` names ``transposed`` where ``conv2d`` names ``groups``: both
    import as one convolution of 8 groups (read as a dense one, its channel splits would
    break the groups)."""
    graph = from_module(_Depthwise(how), (torch.randn(4, 8, 6, 6),))
    convs = [op for op in graph.ops if op.kind is OpKind.CONV2D]
    assert len(convs) == 1 and convs[0].attrs.get("groups") == 8


class _Transposed(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8, 3, 3))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.convolution(x, self.w, None, [1, 1], [0, 0], [1, 1], True, [0, 0], 1)
        return self.head(y.mean((2, 3)))


def test_a_transposed_convolution_is_kept_whole_not_read_as_a_convolution():
    """No layout family here is a transposed convolution's: it is an opaque op owning its
    weight (priced by torch's count), not a convolution of the wrong shape."""
    graph = from_module(_Transposed(), (torch.randn(4, 8, 6, 6),))
    assert not [op for op in graph.ops if op.kind is OpKind.CONV2D]
    owner = [op for op in graph.ops if op.source_params == ("w",)]
    assert len(owner) == 1 and owner[0].kind is OpKind.OPAQUE


class _TransposedHead(nn.Module):
    """An embedding, a linear, and a head computed in the module's own code from a
    parameter transposed there, written as ``how`` says."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(64, 32)
        self.body = nn.Linear(32, 32)
        self.out_in = nn.Parameter(torch.randn(64, 32))  # stored (out, in), as nn.Linear
        self.in_out = nn.Parameter(torch.randn(32, 64))  # stored (in, out)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.body(self.emb(ids))
        heads = {"t": lambda: h @ self.out_in.t(), "T": lambda: h @ self.out_in.T,
                 "mT": lambda: h @ self.out_in.mT,
                 "permute": lambda: h @ self.out_in.permute(1, 0),
                 "transpose": lambda: h @ self.out_in.transpose(-1, -2),
                 "linear_T": lambda: nn.functional.linear(h, self.in_out.T),
                 "tied_T": lambda: h @ self.emb.weight.T}
        return heads[self.how]()


@pytest.mark.parametrize("how", ["T", "mT", "permute", "transpose", "linear_T", "tied_T"])
def test_a_head_on_a_transposed_parameter_is_a_linear_however_the_transpose_is_written(how):
    """``W.T``, ``W.mT``, ``W.permute(1, 0)``, ``W.transpose(-1, -2)`` and ``F.linear(x,
    W.T)`` are the linear ``x @ W.t()`` is: (tokens, vocab) out, 2·tokens·32·64 FLOPs, the
    weight stored as the module stores it (``weight_t`` for (out, in)), no relayout after it;
    on the embedding's table it is the tied head. ``.T`` once read as no transpose at all: a
    (64, 32) output, twice the FLOPs, and a replicated copy of the logits after it."""
    ids = (torch.randint(0, 64, (4, 8)),)
    want = from_module(_TransposedHead("t"), ids).ops
    got = from_module(_TransposedHead(how), ids).ops
    head = got[3]
    assert [op.kind for op in got] == [op.kind for op in want]  # no opaque op
    assert head.kind is OpKind.LINEAR and head.output.shape == (32, 64)
    assert head.flops == 2.0 * 32 * 32 * 64 and head.weight.shape == (32, 64)
    assert head.attrs.get("weight_t", 0) == (0 if how == "linear_T" else 1)
    assert head.attrs["tied"] == (how == "tied_T")


def test_a_permute_or_transpose_that_leaves_a_weight_as_it_is_is_no_transpose():
    class Same(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(32, 64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w.permute(0, 1) @ self.w.transpose(0, 0).t()

    g = from_module(Same(), (torch.randn(8, 32),))
    first, second = [op for op in g.ops if op.kind is OpKind.LINEAR]
    assert first.output.shape == (8, 64) and "weight_t" not in first.attrs
    assert second.output.shape == (8, 32) and second.attrs["weight_t"] == 1


class _SoftCappedHead(nn.Module):
    """A head in the module's own code (``h @ W.T``) whose logits are soft-capped there
    too (Gemma-2's ``cap · tanh(logits / cap)``) before the module returns them."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.body = nn.Embedding(64, 32), nn.Linear(32, 32)
        self.head = nn.Parameter(torch.randn(64, 32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return 30.0 * torch.tanh((self.body(self.emb(ids)) @ self.head.T) / 30.0)


def test_nothing_moves_between_a_functional_head_and_the_steps_the_code_runs_on_it():
    """The head has no module, and the soft-capping runs on its output before the module
    returns it: no boundary can convert the head's partial sums before the ``tanh``
    (``parallelize`` refused such a plan with a FidelityError), so the planner keeps the
    edge still — a choice with the head's partial sums is named unrunnable; the optimum
    reads the head's output as produced."""
    g = from_module(_SoftCappedHead(), (torch.randint(0, 64, (4, 8)),))
    assert g["loss"].attrs["input_steps"] and g["linear"].attrs["functional"]
    link = {"latency_us": 1, "bandwidth_gbps": 10}
    config = load_config({"model": g, "cluster": {
        "nodes": 1, "devices_per_node": 4, "memory_gib": 16, "peak_tflops": 1,
        "links": {"intra": link, "inter": link}}})
    c = config.cluster
    gp = build_problem(config.microbatch_graph(), c, c.nodes, c.devices_per_node, config.memory)
    forced, _ = _choose(gp, lambda op, s: op.name != "linear"
                        or drop_unit_axes(s.output).has_partial, 30.0)
    assert "changes between two pieces of functional code (before 'loss'" in \
        gp.unrunnable(forced)
    plan = ilp_planner.solve(config, baselines=False)
    layers = {ly.name: ly for ly in plan.layers}
    assert drop_unit_axes(layers["loss"].inputs[0]) == drop_unit_axes(layers["linear"].output)


class _ChunkedAndWhole(nn.Module):
    """A linear's output cut into gate and up by ``chunk`` and also read whole (``side``),
    or cut two ways (``chunk(2)`` and ``chunk(4)``) where ``twice``."""

    def __init__(self, twice: bool = False):
        super().__init__()
        self.twice = twice
        self.fc, self.out = nn.Linear(64, 256), nn.Linear(128, 64)
        self.side = nn.Linear(64 if twice else 256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        a, b = h.chunk(2, dim=-1)
        other = h.chunk(4, dim=-1)[0] if self.twice else h
        return self.out(a * nn.functional.silu(b)) + self.side(other)


def test_a_fused_output_also_read_whole_keeps_its_columns_whole():
    """``parallelize`` cannot hand a whole reader the interleaved blocks of a column split,
    so the planner never prices one (it once did, and the runtime refused the plan)."""
    g = from_module(_ChunkedAndWhole(), (torch.randn(8, 64),))
    fc = g["fc"]
    assert fc.attrs["parts"] == 2 and fc.attrs["parts_read_whole"] == 1
    config = load_config({"model": g, "cluster": CLUSTER})
    ctx = StrategyContext(config.cluster, 2, 2, config.memory)
    assert {s.output.split_degree(1) for s in op_strategies(fc, [g["x"].output], ctx)} == {1}
    unmarked = dataclasses.replace(fc, attrs={k: v for k, v in fc.attrs.items()
                                              if k != "parts_read_whole"})
    assert 2 in {s.output.split_degree(1) for s in op_strategies(unmarked, [g["x"].output], ctx)}


def test_one_linear_cut_two_ways_keeps_one_cut_as_parts():
    """``chunk(2)`` and ``chunk(4)`` of one output: the second cut is a relayout, not a
    ``part`` op of the first cut's width read by a linear expecting a quarter."""
    g = from_module(_ChunkedAndWhole(twice=True), (torch.randn(8, 64),))
    parts = [op for op in g.ops if op.kind is OpKind.PART]
    assert {op.attrs["parts"] for op in parts} == {2}
    assert all(op.output.shape == (8, 128) for op in parts)
    assert g[g["side"].inputs[0]].output.shape == (8, 64)



class _EncoderDecoderIds(nn.Module):
    """Two tables looking up two id inputs (an encoder's and a decoder's), one head."""

    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = nn.Embedding(64, 16), nn.Embedding(64, 16)
        self.head = nn.Linear(16, 64)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(src) + self.dec(tgt))


@pytest.mark.parametrize("as_keywords", [False, True])
def test_one_tensor_passed_as_two_inputs_gives_two_inputs_each_read_by_its_own(as_keywords):
    """The same ids handed to the encoder and the decoder (BART trained to reconstruct):
    ``torch.export`` made one placeholder of the one tensor object, so the first input had
    no reader and ``parallelize`` no layout for it; each input is its own now."""
    ids = torch.randint(0, 64, (4, 8))
    graph = from_module(_EncoderDecoderIds(),
                        {"src": ids, "tgt": ids} if as_keywords else (ids, ids))
    inputs = [op.name for op in graph.ops if op.kind is OpKind.INPUT]
    assert len(inputs) == 2
    assert [graph.consumers(n) for n in inputs] == [["enc"], ["dec"]]


class SequenceReduction(nn.Module):
    """Tokens ``(b, n, c)`` laid back out as an image for a strided convolution, then
    flattened to tokens again: PVT's spatial reduction (``permute(0, 2, 1)``) or, with
    ``swapped``, an image whose height and width are swapped too (MobileViT folds its
    patches back by several such steps)."""

    def __init__(self, c: int = 16, side: int = 4, swapped: bool = False):
        super().__init__()
        self.side, self.swapped = side, swapped
        self.proj = nn.Linear(c, c)
        self.sr = nn.Conv2d(c, c, kernel_size=2, stride=2)
        self.head = nn.Linear(c, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        h = self.proj(x).permute(0, 2, 1).reshape(b, c, self.side, self.side)
        if self.swapped:
            h = h.transpose(2, 3)
        return self.head(self.sr(h).flatten(2).transpose(1, 2))


@pytest.mark.parametrize("swapped", [False, True])
def test_a_convolution_reading_tokens_laid_out_as_an_image_reads_the_image(swapped):
    """The relayout between tokens and the convolution keeps the image's ``(b, c, h, w)``
    shape: before, it was recorded tokens-major ``(b·c·h, w)``, and a plan splitting the
    convolution's channels read it in a layout it cannot take (PVT's and MobileViT's solves
    stopped with a LayoutError). PVT's ``permute(0, 2, 1)`` is Segformer's
    ``transpose(1, 2)``: whole images stay on their devices (``rows_local``)."""
    torch.manual_seed(0)
    graph = from_module(SequenceReduction(swapped=swapped), (torch.randn(4, 16, 16),))
    conv = next(op for op in graph.ops if op.kind is OpKind.CONV2D)
    (src,) = conv.inputs
    assert graph[src].kind is OpKind.OPAQUE and graph[src].output.shape == (4, 16, 4, 4)
    assert graph[src].attrs.get("rows_local") == (None if swapped else 1)
    plan = ilp_planner.solve(graph, cluster=CLUSTER, baselines=False)
    assert plan.solver.status == "optimal"
