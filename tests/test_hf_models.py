"""The models users bring: Hugging Face models (tiny configs, random weights, no download)
import with every matmul, linear and convolution lifted (none opaque), each op owning
exactly its module's parameters, repeated blocks tied whatever their names, and solve on a
2 × 4 cluster; a mixture of experts imports with its experts replicated and priced by
torch's own FLOP count."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from types import MappingProxyType
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import ilp_planner
from ilp_planner.errors import ConfigError, LayoutError
from ilp_planner.inputs.config import load_config, parse_cluster
from ilp_planner.inputs.importer import from_module
from ilp_planner.inputs.lift_elementwise import lift_const
from ilp_planner.inputs.lift_graph import DraftGraph, NodeCost
from ilp_planner.inputs.lift_moe import correction_bias, hf_router, routed_as_one_op
from ilp_planner.inputs.lift_values import Call, Const
from ilp_planner.intra_op.baselines import solve_exact
from ilp_planner.intra_op.problem import build_problem
from ilp_planner.ir.graph import Graph, Op, OpKind, TensorSpec
from ilp_planner.ir.layouts import drop_unit_axes
from ilp_planner.lowering.cost_model import MemorySpec
from ilp_planner.lowering.moe_strategies import HF_INTERLEAVED, expert_parallel
from ilp_planner.lowering.strategies import (
    StrategyContext,
    grad_sync,
    head_splits,
    input_grad_layouts,
    op_strategies,
    param_shapes,
)
from ilp_planner.reports.explain import OPAQUE_WARN_SHARE, opaque_share
from ilp_planner.reports.summary import unsharded_summary
from runtime.applied_moe import module_roles
from runtime.errors import RuntimeSetupError
from runtime.fused_parts import interleaved, natural_order
from runtime.moe import reference as moe_reference

T = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402 - after the skip

CLUSTER = {"nodes": 2, "devices_per_node": 4, "memory_gib": 16, "peak_tflops": 10,
           "links": {"intra": {"latency_us": 5, "bandwidth_gbps": 100},
                     "inter": {"latency_us": 10, "bandwidth_gbps": 10}}}
BATCH, SEQ, VOCAB = 2, 8, 64


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ))


def _llama(tied: bool) -> Any:
    return T.LlamaForCausalLM(T.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16, use_cache=False,
        tie_word_embeddings=tied))


def _builders() -> dict[str, Any]:
    """Model name → (model, example inputs), each built on first use."""
    return {
        "gpt2": lambda: (T.GPT2LMHeadModel(T.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=16, resid_pdrop=0,
            embd_pdrop=0, attn_pdrop=0, use_cache=False)), (_ids(),)),
        "llama_tied": lambda: (_llama(True), (_ids(),)),
        "llama_untied": lambda: (_llama(False), (_ids(),)),
        "bert": lambda: (T.BertForMaskedLM(T.BertConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=VOCAB, max_position_embeddings=16, hidden_dropout_prob=0,
            attention_probs_dropout_prob=0)), (_ids(),)),
        "roberta": lambda: (T.RobertaForMaskedLM(T.RobertaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=VOCAB, max_position_embeddings=SEQ + 2, hidden_dropout_prob=0,
            attention_probs_dropout_prob=0)), (_ids(),)),
        "olmo": lambda: (T.OlmoForCausalLM(T.OlmoConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=VOCAB, max_position_embeddings=16, use_cache=False)), (_ids(),)),
        "qwen3": lambda: (T.Qwen3ForCausalLM(T.Qwen3Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=16,
            use_cache=False)), (_ids(),)),
        "gemma3": lambda: (T.Gemma3ForCausalLM(T.Gemma3TextConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=16,
            use_cache=False)), (_ids(),)),
        "olmo2": lambda: (T.Olmo2ForCausalLM(T.Olmo2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=VOCAB, max_position_embeddings=16, use_cache=False)), (_ids(),)),
        "convnext": lambda: (T.ConvNextForImageClassification(T.ConvNextConfig(
            num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)),
            (torch.randn(BATCH, 3, 64, 64),)),
        "opt": lambda: (T.OPTForCausalLM(T.OPTConfig(
            hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=VOCAB, max_position_embeddings=16, word_embed_proj_dim=32,
            use_cache=False)), (_ids(),)),
        "vit": lambda: (T.ViTForImageClassification(T.ViTConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            image_size=16, patch_size=4, num_labels=10, hidden_dropout_prob=0,
            attention_probs_dropout_prob=0)), (torch.randn(BATCH, 3, 16, 16),)),
        "resnet": lambda: (T.ResNetForImageClassification(T.ResNetConfig(
            embedding_size=8, hidden_sizes=[8, 16], depths=[3, 1], num_labels=10)),
            (torch.randn(BATCH, 3, 32, 32),)),
        "t5": lambda: (T.T5ForConditionalGeneration(T.T5Config(
            d_model=32, d_ff=64, num_layers=3, num_heads=4, d_kv=8, vocab_size=VOCAB,
            dropout_rate=0, use_cache=False)),
            {"input_ids": _ids(), "decoder_input_ids": _ids()}),
        "mixtral": lambda: (T.MixtralForCausalLM(T.MixtralConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16,
            num_local_experts=4, num_experts_per_tok=2, use_cache=False)), (_ids(),)),
        "qwen2_moe": lambda: (T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(
            hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16, num_experts=4,
            num_experts_per_tok=2, use_cache=False)), (_ids(),)),
        "phi3": lambda: (T.Phi3ForCausalLM(T.Phi3Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16,
            pad_token_id=0, eos_token_id=1, bos_token_id=1, use_cache=False)), (_ids(),)),
        "falcon": lambda: (T.FalconForCausalLM(T.FalconConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
            use_cache=False)), (_ids(),)),
        "gpt_neox": lambda: (T.GPTNeoXForCausalLM(T.GPTNeoXConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            vocab_size=VOCAB, max_position_embeddings=16, use_cache=False)), (_ids(),)),
        "deepseek_v2": lambda: (T.DeepseekV2ForCausalLM(_deepseek_v2()), (_ids(),)),
        "deepseek_v3": lambda: (_deepseek_v3(), (_ids(),)),
        "gpt_oss": lambda: (_gpt_oss(), (_ids(),)),
        # its router's weight is a linear it holds (``gate.wg``); a shared MLP beside
        "hunyuan_moe": lambda: (T.HunYuanMoEV1ForCausalLM(T.HunYuanMoEV1Config(
            hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=16,
            num_experts=4, moe_topk=2, use_cache=False, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)), (_ids(),)),
        # sigmoid routing with a correction bias the block holds and hands its router
        "minimax_m2": lambda: (_with_drawn_correction_bias(T.MiniMaxM2ForCausalLM(
            T.MiniMaxM2Config(hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                              vocab_size=VOCAB, max_position_embeddings=16,
                              num_local_experts=4, num_experts_per_tok=2, use_cache=False,
                              pad_token_id=0, bos_token_id=1, eos_token_id=2))), (_ids(),)),
        # the experts' activation the function F.silu; the block's ``expert_bias``
        "lfm2_moe": lambda: (_with_drawn_correction_bias(T.Lfm2MoeForCausalLM(
            T.Lfm2MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                            vocab_size=VOCAB, max_position_embeddings=16, num_experts=4,
                            num_experts_per_tok=2, num_dense_layers=1, use_cache=False,
                            layer_types=["conv", "full_attention", "conv"]))), (_ids(),)),
    }


def _with_drawn_correction_bias(model: Any) -> Any:
    """``model`` with its routed blocks' correction biases and routers drawn (zero as
    built — LFM2-MoE's router too —: a bias the routing ignored would not show)."""
    with torch.no_grad():
        for layer in model.model.layers:
            block = getattr(layer, "mlp", None) or layer.feed_forward
            bias = correction_bias(block, hf_router(block))
            if bias is not None:
                bias.uniform_(-0.3, 0.3)
                hf_router(block).weight.normal_(0.0, 0.2)
    return model


def _deepseek_v2(**routing: Any) -> Any:
    """A tiny DeepSeek-V2: MLA attention (low-rank KV, no q LoRA), layer 0 dense and layers 1–2
    routed (4 experts, top-2, one shared expert), greedy softmax routing unless ``routing``
    overrides it."""
    fields = {"topk_method": "greedy", "n_group": 1, "topk_group": 1,
              "routed_scaling_factor": 1.0, **routing}
    return T.DeepseekV2Config(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
        max_position_embeddings=16, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, use_cache=False, **fields)


def _deepseek_v3() -> Any:
    """A tiny DeepSeek-V3: MLA, layer 0 dense, layers 1–2 routed by sigmoid scores plus a
    correction bias (drawn, so that it changes some choices), the best 1 of 2 expert groups
    kept, the weights renormalised and scaled by 2.5."""
    model = T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
        max_position_embeddings=16, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, use_cache=False))
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(4))
    return model


def _gpt_oss() -> Any:
    """A tiny GPT-OSS: 4 experts, top-2 (a biased router, softmax over the top-k logits),
    experts with biases and alternating gate/up columns under a clamped GLU, attention with
    sinks, a sliding-window layer and a full one. Its biases are drawn (Hugging Face zeroes
    the router's), so that a kernel ignoring one differs."""
    model = T.GptOssForCausalLM(T.GptOssConfig(
        hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=VOCAB, max_position_embeddings=16,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=4, use_cache=False,
        layer_types=["sliding_attention", "full_attention"]))
    with torch.no_grad():
        for layer in model.model.layers:
            for b in (layer.mlp.router.bias, layer.mlp.experts.gate_up_proj_bias,
                      layer.mlp.experts.down_proj_bias):
                b.normal_(0, 0.5)
    return model


MOE_LAYER = {"mixtral": 0, "qwen2_moe": 0, "deepseek_v2": 1, "deepseek_v3": 1,
             "gpt_oss": 0, "hunyuan_moe": 0, "minimax_m2": 0, "lfm2_moe": 1}  # first routed
SHARED = {"qwen2_moe": "shared_expert", "deepseek_v2": "shared_experts",
          "deepseek_v3": "shared_experts"}
def _moe_block(model: Any, name: str) -> Any:
    """The first routed block of MoE model ``name`` (LFM2-MoE's is its ``feed_forward``)."""
    layer = model.model.layers[MOE_LAYER[name]]
    return getattr(layer, "mlp", None) or layer.feed_forward


MOES = ["mixtral", "qwen2_moe", "deepseek_v2", "deepseek_v3", "gpt_oss", "hunyuan_moe",
        "minimax_m2", "lfm2_moe"]


DENSE = ("gpt2", "llama_tied", "llama_untied", "bert", "roberta", "olmo", "opt", "vit",
         "resnet", "convnext", "t5", "phi3", "falcon")


@pytest.fixture(scope="module")
def imported() -> Iterator[dict[str, tuple[Any, Graph]]]:
    """Name → (model, graph), each model built and imported once for the module."""
    cache: dict[str, tuple[Any, Graph]] = {}

    def get(name: str) -> tuple[Any, Graph]:
        if name not in cache:
            torch.manual_seed(0)
            model, inputs = _builders()[name]()
            model.eval()
            cache[name] = (model, from_module(model, inputs))
        return cache[name]

    yield get


def _aliases(model: nn.Module) -> dict[str, set[str]]:
    """Every parameter name → all the names of its tensor (tied weights have several; the
    exported graph names a tied tensor by one of them)."""
    by_id: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), set()).add(name)
    return {name: names for names in by_id.values() for name in names}


def _owners(graph: Graph, aliases: dict[str, set[str]], fqn: str) -> list:
    return [op for op in graph.ops if aliases[fqn] & set(op.source_params)]


@pytest.mark.parametrize("name", DENSE)
def test_every_matmul_linear_and_conv_is_lifted_not_opaque(imported, name):
    model, graph = imported(name)
    aliases = _aliases(model)
    weights = [f"{path}.weight" for path, m in model.named_modules()
               if isinstance(m, (nn.Linear, Conv1D, nn.Conv2d))]
    assert weights
    for fqn in weights:
        kinds = {op.kind for op in _owners(graph, aliases, fqn)}
        assert kinds & {OpKind.LINEAR, OpKind.CONV2D}, (fqn, kinds)
    assert all(op.kind is not OpKind.OPAQUE or not op.weight for op in graph.ops)


@pytest.mark.parametrize("name", ("gpt2", "llama_untied", "bert", "roberta", "olmo", "vit",
                                  "resnet", "convnext", "t5"))
def test_every_parameter_is_owned_by_an_op_that_prices_it(imported, name):
    """``t5``: the shared table by the encoder's embedding and the tied copies (the
    decoder's embedding, the head), each stack's relative position table by its first
    self-attention (SDPA reads it in its mask). ``olmo``: its norms have no parameters, and
    hold none."""
    model, graph = imported(name)
    aliases = _aliases(model)
    owned = {a for op in graph.ops for p in op.source_params for a in aliases[p]}
    assert owned == set(aliases)
    for op in graph.ops:
        if op.kind is not OpKind.OPAQUE:
            assert len(op.source_params) == len(param_shapes(op)), op.name
    assert sum(op.params for op in graph.ops) == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", DENSE + ("mixtral", "qwen2_moe"))
def test_solves_on_two_by_four(imported, name):
    _, graph = imported(name)
    plan = ilp_planner.solve(graph, cluster=CLUSTER, baselines=False)
    assert plan.cost.total_s > 0


@pytest.mark.parametrize("name,heads_dim", [("qwen3", 2), ("gemma3", 1)])
def test_per_head_qk_norms_are_norms_on_their_projections(imported, name, heads_dim):
    """Qwen3 normalises q and k per head on the projection's ``(b, s, heads, d)`` view,
    Gemma-3 on its ``(b, heads, s, d)`` transpose: each is an RMSNorm on the projection's own
    ``(tokens, heads · 8)`` value normalising 8-wide groups (``attrs.group_width``), its
    module holding the heads at ``attrs.heads_dim`` — no opaque op — owning its 8-entry
    gain; the attention reads the norms as it reads a Llama's projections (2 key / value
    heads), and the step solves with nothing opaque."""
    _, graph = imported(name)
    assert not [op.name for op in graph.ops if op.kind is OpKind.OPAQUE]
    for layer in (0, 1):
        attn = graph[f"model.layers.{layer}.self_attn.attention"]
        for which, width in (("q", 32), ("k", 16)):
            op = graph[f"model.layers.{layer}.self_attn.{which}_norm"]
            assert op.kind is OpKind.RMSNORM
            assert op.output.shape == (BATCH * SEQ, width)
            assert op.inputs == (f"model.layers.{layer}.self_attn.{which}_proj",)
            assert (op.attrs["group_width"], op.attrs["heads_dim"]) == (8, heads_dim)
            assert op.source_params == (f"model.layers.{layer}.self_attn.{which}_norm.weight",)
            assert param_shapes(op) == {"weight": (8,)} and op.params == 8
        assert attn.inputs[:2] == (f"model.layers.{layer}.self_attn.q_norm",
                                   f"model.layers.{layer}.self_attn.k_norm")
        assert (attn.attr("heads"), attn.attr("kv_heads")) == (4, 2)
    plan = ilp_planner.solve(graph, cluster=CLUSTER, baselines=False)
    assert opaque_share(plan) == 0.0


def test_olmo2s_qk_norms_normalise_the_whole_projection(imported):
    """OLMo-2 normalises q and k over the whole projection (not per head): plain RMSNorms
    on ``(tokens, 32)``, no group, so their features stay whole — nothing opaque."""
    _, graph = imported("olmo2")
    assert not [op.name for op in graph.ops if op.kind is OpKind.OPAQUE]
    for which in ("q", "k"):
        op = graph[f"model.layers.0.self_attn.{which}_norm"]
        assert (op.kind, op.output.shape, op.params) == (OpKind.RMSNORM, (BATCH * SEQ, 32), 32)
        assert "group_width" not in op.attrs


def test_computed_token_ids_are_flat_like_the_input_ids(imported):
    """RoBERTa computes its position ids from ``input_ids`` (``ne`` the padding index, a
    cumulative sum, …): those integer values are token vectors ``(B·T,)`` as the input
    is, so the position table's lookup may split them as it splits the tokens (they were
    ``(B, T)``: a 4-way token split did not fit the batch of 2, and the edge's pricing
    failed with a bare ``KeyError``)."""
    _, graph = imported("roberta")
    ids = [op for op in graph.ops if op.output.dtype.startswith("int")]
    assert {op.name for op in ids} >= {"input_ids", "roberta.embeddings.cumsum"}
    assert all(op.output.shape == (BATCH * SEQ,) for op in ids)


def test_an_op_reading_another_view_of_a_value_is_named_not_a_key_error():
    """Where a graph wires an op to a value in a view its layouts do not fit (token ids
    ``(B, T)`` = (2, 8) read by a lookup that splits them as 16 tokens, as RoBERTa's
    import did), building the problem says which op reads which, in one line."""
    ids = TensorSpec((BATCH * SEQ,), "int64")
    graph = Graph("views", [
        Op("ids", OpKind.INPUT, (), ids),
        Op("positions", OpKind.OPAQUE, ("ids",), TensorSpec((BATCH, SEQ), "int64")),
        Op("lookup", OpKind.EMBEDDING, ("positions",), TensorSpec((BATCH * SEQ, 32), "float32"),
           TensorSpec((VOCAB, 32), "float32"), VOCAB * 32, attrs={"vocab": VOCAB}),
        Op("loss", OpKind.LOSS, ("lookup",), TensorSpec((1,), "float32"))])
    config = load_config({"model": graph, "cluster": CLUSTER})
    with pytest.raises(LayoutError, match=r"'lookup' reads 'positions' in a layout its output "
                       r"cannot take: layout .* does not fit a tensor of \(2, 8\)"):
        build_problem(graph, config.cluster, 2, 4, config.memory)


def test_an_embedding_whose_positions_are_added_after_it_reaches_its_code_as_produced(
        imported):
    """OPT's positions are looked up by a module of their own and added to the word
    embeddings in its code (``inputs_embeds + pos_embeds``, the table folded into the word
    table's op): a program at the embedding's boundary would run before that sum, so the
    solved plan hands the embedding's output to the functional code reading it as
    produced, and a choice that converts it there is named as unrunnable."""
    _, graph = imported("opt")
    config = load_config({"model": graph, "cluster": CLUSTER})
    gp = build_problem(graph, config.cluster, 2, 4, config.memory)
    choice, objective, _ = solve_exact(gp.problem, 30.0)
    assert gp.unrunnable(choice) is None
    emb = "model.decoder.embed_tokens"
    readers = [op.name for op in graph.ops if emb in op.inputs and op.attrs.get("functional")]
    assert readers
    chosen = gp.node_choice(choice)
    made = drop_unit_axes(chosen[gp.owner[emb]].outputs[gp.position[emb]])
    for r in readers:
        read = chosen[gp.owner[r]].inputs[gp.position[r]][graph[r].inputs.index(emb)]
        assert drop_unit_axes(read) == made
    g_add, add = gp.group_of[gp.owner[readers[0]]], gp.owner[readers[0]]
    other = next(k for k, o in enumerate(gp.options[add])
                 if drop_unit_axes(o.inputs[gp.position[readers[0]]][0]) != made)
    broken = list(choice)
    broken[g_add] = other
    assert gp.problem.objective(broken) > 1.0 > objective
    assert f"the layout of {emb!r} changes" in gp.unrunnable(broken)


def test_one_input_read_twice_is_read_in_one_layout(imported):
    """RoBERTa's ``input_ids`` is read by the word table and by the functional code that
    counts positions (kept whole: it is opaque): ``parallelize`` hands the module one
    tensor, so the problem couples the two reads — its optimum reads one layout, and a
    choice splitting the word table's ids over the batch (its own cheapest read) while the
    counting reads them whole costs more than any coupled choice and is named as
    unrunnable."""
    _, graph = imported("roberta")
    config = load_config({"model": graph, "cluster": CLUSTER})
    gp = build_problem(graph, config.cluster, 2, 4, config.memory)
    choice, objective, _ = solve_exact(gp.problem, 30.0)
    assert gp.unrunnable(choice) is None
    word, count = "roberta.embeddings.word_embeddings", "roberta.embeddings.ne"
    chosen = gp.node_choice(choice)
    reads = {drop_unit_axes(chosen[gp.owner[n]].inputs[gp.position[n]][0]) for n in (word, count)}
    assert len(reads) == 1
    split = next(k for k, o in enumerate(gp.options[gp.owner[word]])
                 if o.inputs[gp.position[word]][0].split_degree(0) > 1)
    broken = list(choice)
    broken[gp.group_of[gp.owner[word]]] = split
    assert gp.problem.objective(broken) > 1.0 > objective
    assert "input 'input_ids' is read in 2 layouts" in gp.unrunnable(broken)


@pytest.mark.parametrize("name", ["llama_untied", "llama_tied", "bert", "gpt2"])
def test_megatron_baselines_price_on_imported_transformers(name):
    """Megatron's DP × TP layouts exist on an imported transformer: its attention splits the
    batch over one mesh axis and the heads over the other — GPT-2's, reading ``c_attn``'s
    ``[q | k | v]`` blocks, keeps its heads whole over TP (a batch of 8 sequences, so every
    baseline's batch split fits the 2 × 4 mesh)."""
    torch.manual_seed(0)
    model, _ = _builders()[name]()
    graph = from_module(model, (torch.randint(0, VOCAB, (8, SEQ)),))
    plan = ilp_planner.solve(graph, cluster=CLUSTER)
    priced = {k.split("(")[0]: v for k, v in plan.baselines.items() if "total_s" in v}
    assert {"data_parallel", "megatron", "megatron_sp", "torchtitan"} <= set(priced), \
        {k: v.get("error") for k, v in plan.baselines.items()}
    # the planner's space holds every baseline's layouts
    assert all(plan.cost.total_s <= v["total_s"] * (1 + 1e-9) for v in priced.values())


def test_gpt2_conv1d_is_a_linear_stored_in_out(imported):
    model, graph = imported("gpt2")
    c_attn = graph["transformer.h.0.attn.c_attn"]
    assert c_attn.kind is OpKind.LINEAR
    # Conv1D stores (in, out): the IR's own layout, so the runtime maps it untransposed
    assert c_attn.weight.shape == tuple(model.transformer.h[0].attn.c_attn.weight.shape)
    assert "weight_t" not in c_attn.attrs and c_attn.attrs["bias"] == 1
    assert list(param_shapes(c_attn)) == ["weight", "bias"]


def test_falcon_linears_reading_the_weights_transpose_are_linears_stored_out_in(imported):
    """``FalconLinear`` computes ``x @ self.weight.T`` (``aten.numpy_T``): each is a linear
    of the module's ``(in, out)`` shape on every token, as ``nn.Linear`` — not a matmul with
    an untransposed weight, which gave ``query_key_value`` 24 rows of 32 (a 16-token batch
    read as 48 × 32 columns) and wrapped the next ops in opaque copies."""
    model, graph = imported("falcon")
    layer = model.transformer.h[0]
    for path, module in (("self_attention.query_key_value", layer.self_attention.query_key_value),
                         ("self_attention.dense", layer.self_attention.dense),
                         ("mlp.dense_h_to_4h", layer.mlp.dense_h_to_4h),
                         ("mlp.dense_4h_to_h", layer.mlp.dense_4h_to_h)):
        op = graph[f"transformer.h.0.{path}"]
        out_features, in_features = module.weight.shape
        assert op.kind is OpKind.LINEAR and op.attrs["weight_t"] == 1, path
        assert op.weight.shape == (in_features, out_features), path
        assert op.output.shape == (BATCH * SEQ, out_features), path
    assert [op.name for op in graph.ops if op.kind is OpKind.OPAQUE] == []


def test_falcons_multi_query_attention_reads_its_fused_projection_as_q_k_v_blocks(imported):
    """Falcon views ``query_key_value``'s output ``(B, T, heads + 2, D)``, slices q's heads
    and picks the key and value heads by list indexing (``fused[..., [-2], :]``): the
    indexing is a folded copy priced with the attention (no opaque op), which reads the
    projection as ``[q | k | v]`` blocks — batch splits only — where GPT-NeoX's view
    ``(B, T, -1, 3·D)`` (-1: the heads) is head-major and splits its heads."""
    _, graph = imported("falcon")
    attn = graph["transformer.h.0.self_attention.attention"]
    assert attn.inputs == ("transformer.h.0.self_attention.query_key_value",)
    assert attn.attrs.get("qkv_major") == 1 and head_splits(attn) == 1
    assert attn.attrs["input_copies"] >= 2  # k's and v's picks
    _, neox = imported("gpt_neox")
    attn = neox["gpt_neox.layers.0.attention.attention"]
    assert attn.inputs == ("gpt_neox.layers.0.attention.query_key_value",)
    assert "qkv_major" not in attn.attrs and head_splits(attn) == 4


def test_phi3s_sliced_qkv_projection_is_read_as_q_k_v_blocks_not_heads(imported):
    """Phi-3 slices its fused ``qkv_proj`` (``qkv[..., :q_end]``, then k's and v's columns)
    before viewing heads: ``[q | k | v]`` column blocks, as GPT-2's ``split``, so a column
    split of the projection hands no device whole heads — the attention splits the batch
    only (``qkv_major``) rather than pricing a head split its code would gather."""
    _, graph = imported("phi3")
    attn = graph["model.layers.0.self_attn.attention"]
    assert attn.inputs == ("model.layers.0.self_attn.qkv_proj",)
    assert attn.attrs.get("qkv_major") == 1 and head_splits(attn) == 1


def test_phi3s_fused_gate_up_is_cut_into_parts_no_opaque_op(imported):
    """Phi-3's MLP computes gate and up with one linear and ``chunk``s its output: the
    linear is marked ``parts`` 2 and each half is a ``part`` op of its own (functional code
    of the MLP), gate read by the activation's module, up by the product — Llama's gated
    MLP after its two projections, and no opaque op anywhere in the model."""
    _, graph = imported("phi3")
    assert [op.name for op in graph.ops if op.kind is OpKind.OPAQUE] == []
    mlp = "model.layers.0.mlp"
    fused = graph[f"{mlp}.gate_up_proj"]
    assert fused.kind is OpKind.LINEAR and fused.weight.shape == (32, 128)
    assert fused.attrs["parts"] == 2 and fused.output.shape == (BATCH * SEQ, 128)
    gate, up = graph[f"{mlp}.part"], graph[f"{mlp}.part_1"]
    for i, part in enumerate((gate, up)):
        assert part.kind is OpKind.PART and part.inputs == (fused.name,)
        # gate carries the backward's cat of both gradients (no part unread)
        assert dict(part.attrs) == {"part": i, "parts": 2, "functional": 1, "cat": int(i == 0),
                                    "row_items": BATCH,
                                    **({"unread_parts": 0} if i == 0 else {})}
        assert part.output.shape == (BATCH * SEQ, 64) and part.flops == 0
    assert graph[f"{mlp}.activation_fn"].inputs == (gate.name,)
    assert graph[f"{mlp}.mul"].inputs == (up.name, f"{mlp}.activation_fn")
    assert graph[f"{mlp}.down_proj"].inputs == (f"{mlp}.mul",)


def test_a_fused_gate_up_is_priced_as_the_unfused_pair(imported):
    """On every strategy of the 3-D family it keeps (data parallel, Megatron's column split
    among them), Phi-3's ``gate_up_proj`` costs what Llama's (same sizes) ``gate_proj`` and
    ``up_proj`` cost together under the same strategy: FLOPs, compute seconds (the flat
    model, linear in FLOPs), weight and activation bytes, and the bytes of every collective
    by kind and purpose (one gradient AllReduce of both instead of two); under SUMMA it
    holds the gathered input once, not twice. Its parts follow it with no work and no
    collective. It refuses exactly the strategies
    leaving partial sums (a reduce-scatter onto its columns would hand a device contiguous
    columns, not its share of gate and of up) — never priced, as the runtime cannot run them."""
    from ilp_planner.lowering.strategies import follow

    _, phi3 = imported("phi3")
    _, llama = imported("llama_untied")
    ctx = StrategyContext(parse_cluster({"cluster": CLUSTER}), 2, 4, MemorySpec.preset("adam"))
    fused = phi3["model.layers.0.mlp.gate_up_proj"]
    pair = [llama[f"model.layers.0.mlp.{p}_proj"] for p in ("gate", "up")]
    assert fused.flops == sum(op.flops for op in pair)

    def by_label(op: Op) -> dict:
        return {s.label: s for s in op_strategies(op, [TensorSpec((BATCH * SEQ, 32))], ctx)}

    def coll_bytes(*ss: Any) -> dict:
        out: dict = {}
        for s in ss:
            for c in (*s.collectives, *s.input_backward):
                key = (c.kind, c.purpose, c.phase)
                out[key] = out.get(key, 0) + c.bytes
        return out

    mine, gate, up = by_label(fused), by_label(pair[0]), by_label(pair[1])
    partial = {k for k, s in gate.items()
               if any(s.output.fact[a].size > 1 for a in s.output.partial_axes)}
    assert partial and set(mine) == set(gate) - partial
    for label, s in mine.items():
        g, u = gate[label], up[label]
        assert s.compute_s == pytest.approx(g.compute_s + u.compute_s, rel=1e-12)
        assert s.state_bytes == g.state_bytes + u.state_bytes
        if label.startswith("summa"):  # I[i, :] gathered (and held) once for both
            rows = s.fact[0].size
            assert s.activation_bytes == pytest.approx(
                g.activation_bytes + u.activation_bytes - BATCH * SEQ * 32 * 4 / rows)
            continue
        assert s.activation_bytes == g.activation_bytes + u.activation_bytes
        assert coll_bytes(s) == pytest.approx(coll_bytes(g, u), rel=1e-12)
        for name in ("model.layers.0.mlp.part", "model.layers.0.mlp.part_1"):
            assert follow(phi3[name], fused.output, s.output, ctx) == (s.output, (), 0.0)


def test_a_fused_weights_columns_are_stored_in_the_order_its_split_holds_them():
    """``gate_up_proj``'s 8 output rows (gate 0–3, up 4–7) split 2 ways are stored gate 0–1,
    up 4–5 | gate 2–3, up 6–7: each device's block holds matching gate and up columns;
    :func:`natural_order` gives the module's order back; unsplit, nothing moves."""
    full = torch.arange(16.0).view(8, 2)
    stored = interleaved(full, 2, 2, 0)
    assert stored[:, 0].tolist() == [0, 2, 8, 10, 4, 6, 12, 14]
    assert torch.equal(natural_order(stored, 2, 2, 0), full)
    assert interleaved(full, 2, 1, 0) is full and interleaved(full, 1, 4, 0) is full
    assert interleaved(torch.arange(12), 3, 2, 0).tolist() == [0, 1, 4, 5, 8, 9,
                                                               2, 3, 6, 7, 10, 11]


def test_llama_linear_weights_are_marked_stored_out_in(imported):
    model, graph = imported("llama_untied")
    q = graph["model.layers.0.self_attn.q_proj"]
    assert q.attrs["weight_t"] == 1 and q.attrs["bias"] == 0
    assert q.weight.shape == tuple(model.model.layers[0].self_attn.q_proj.weight.shape)[::-1]


@pytest.mark.parametrize("name,tied", [("llama_tied", 1), ("llama_untied", 0)])
def test_llama_head_tied_or_not(imported, name, tied):
    _, graph = imported(name)
    assert graph["lm_head"].kind is OpKind.LINEAR and graph["lm_head"].attrs["tied"] == tied


def test_bert_embedding_owns_its_three_tables(imported):
    model, graph = imported("bert")
    emb = graph["bert.embeddings.word_embeddings"]
    assert list(param_shapes(emb)) == ["weight", "pos", "pos_1"]
    tables = model.bert.embeddings
    assert emb.params == sum(t.weight.numel() for t in (
        tables.word_embeddings, tables.position_embeddings, tables.token_type_embeddings))
    shapes = param_shapes(emb)
    assert sorted([shapes["pos"], shapes["pos_1"]]) == sorted(
        [tuple(tables.position_embeddings.weight.shape),
         tuple(tables.token_type_embeddings.weight.shape)])


def test_gpt2_position_table_is_the_embeddings_pos(imported):
    model, graph = imported("gpt2")
    emb = graph["transformer.wte"]
    assert param_shapes(emb)["pos"] == tuple(model.transformer.wpe.weight.shape)


def test_vit_class_token_and_positions_are_parameters_of_an_op(imported):
    model, graph = imported("vit")
    owners = _owners(graph, _aliases(model), "vit.embeddings.cls_token")
    assert len(owners) == 1
    assert "vit.embeddings.position_embeddings" in owners[0].source_params


def test_convnext_channels_moved_last_and_back_are_copies_that_keep_whole_images(imported):
    """ConvNeXt permutes each block's (N, C, H, W) convolution output to (N, H, W, C) for
    its layer norm and pointwise linears, and back for the residual: each permute is an op
    of its own (it was taken for a re-view, wiring the (N·H·W, C) norm to the image as if
    it were that tensor), a copy priced by its bytes, whose rows split only by whole images
    (a divisor of the batch) — so the image's batch split and the tokens' row split are one
    distribution. Its layer scale (``γ · x`` after the second linear) is an op owning γ."""
    _, graph = imported("convnext")
    moves = [op for op in graph.ops if op.attrs.get("rows_local") and op.attrs.get("row_items")]
    assert moves and all(op.attrs["row_items"] == BATCH and op.attrs["rows_local"]
                         for op in moves)
    for op in moves:
        src = graph[op.inputs[0]]
        assert op.output.numel == src.output.numel
        assert op.attrs["bytes_read"] == op.output.nbytes
        if src.output.rank == 4:  # channels moved last: read as tokens
            n, c, h, w = src.output.shape
            assert op.output.shape == (n * h * w, c)
        else:  # moved back to an image
            assert op.output.rank == 4 and op.output.shape[1] == src.output.shape[1]
    norms = [op for op in graph.ops if op.kind is OpKind.LAYERNORM]
    assert all(graph[n.inputs[0]].output.shape == n.output.shape for n in norms)
    scales = [op for op in graph.ops if op.source_params
              and op.source_params[0].endswith("layer_scale_parameter")]
    assert len(scales) == 2 and all(op.kind is OpKind.OPAQUE for op in scales)
    ctx = StrategyContext(parse_cluster({"cluster": CLUSTER}), 2, 4, MemorySpec.preset("adam"))
    for op in moves:
        splits = {s.output.split_degree(0) for s in op_strategies(op, [], ctx)}
        assert splits == {1, 2}  # the batch of 2 splits 2 ways at most
    # its depthwise convolutions split their batch only (the runtime calls them with their
    # groups); the others split channels too
    convs = [op for op in graph.ops if op.kind is OpKind.CONV2D]
    depthwise = [op for op in convs if op.attrs.get("groups")]
    assert len(depthwise) == 2 and all(op.attrs["groups"] == op.weight.shape[0]
                                       for op in depthwise)
    for op in convs:
        channels = {s.output.split_degree(1) for s in op_strategies(op, [], ctx)}
        assert (channels == {1}) == (op in depthwise), (op.name, channels)


def test_resnet_bias_free_convs_and_in_place_residuals(imported):
    model, graph = imported("resnet")
    convs = [op for op in graph.ops if op.kind is OpKind.CONV2D]
    assert len(convs) == sum(isinstance(m, nn.Conv2d) for m in model.modules())
    for op in convs:
        assert list(param_shapes(op)) == ["weight"] and op.params == op.weight.numel
    # ``hidden_state += residual`` (aten.add_) in each of the four bottleneck layers
    assert sum(op.kind is OpKind.ADD for op in graph.ops) == 4


def _blocks(graph: Graph) -> set[tuple[str, int]]:
    return {(op.block, op.block_index) for op in graph.ops if op.block is not None}


@pytest.mark.parametrize("name,container,indices", [
    ("gpt2", "transformer.h", {0, 1}), ("bert", "bert.encoder.layer", {0, 1}),
    # block 0 owns its stack's relative position table: the later blocks tie
    ("t5", "encoder.block", {1, 2}), ("vit", "vit.layers", {0, 1}),
    # stage 0's three layers tie with each other; stage 1 (another width) ties with nothing
    ("resnet", "resnet.encoder.stages.0.layers", {0, 1, 2}),
])
def test_repeated_blocks_tied_whatever_their_names(imported, name, container, indices):
    _, graph = imported(name)
    assert {i for block, i in _blocks(graph) if block == container} == indices
    assert all(not b.startswith("resnet.encoder.stages.1") for b, _ in _blocks(graph))


@pytest.mark.parametrize("name,norm", [("mixtral", 1), ("qwen2_moe", 0), ("deepseek_v2", 0),
                                       ("deepseek_v3", 1)])
def test_moe_blocks_lift_to_one_moe_op_owning_router_and_experts(imported, name, norm):
    """Each routed block is one ``moe`` op owning its router and expert tensors (no opaque
    op holds a weight or a matmul), dropless (capacity factor E / top_k), renormalised as
    the router says (DeepSeek-V2's greedy top-k never; V3's sigmoid routing recorded with
    its groups and scale, its correction bias a buffer no op owns); Qwen2-MoE's and DeepSeek's shared
    experts stay the dense linears they are. It solves on 2 × 4 with the experts laid out by
    the MoE strategies."""
    model, graph = imported(name)
    aliases = _aliases(model)
    at = f"model.layers.{MOE_LAYER[name]}.mlp"
    mlp = model.model.layers[MOE_LAYER[name]].mlp
    owners = _owners(graph, aliases, f"{at}.experts.gate_up_proj")
    assert [op.kind for op in owners] == [OpKind.MOE]
    op = owners[0]
    assert set(op.source_params) == {f"{at}.gate.weight", f"{at}.experts.gate_up_proj",
                                     f"{at}.experts.down_proj"}
    e, f = mlp.experts.down_proj.shape[0], mlp.experts.down_proj.shape[2]
    assert (op.attr("experts"), op.attr("top_k"), op.attr("ffn")) == (e, 2, f)
    assert op.attr("capacity_pct") == 100 * e // 2 and op.attr("norm_topk") == norm
    v3 = {"sigmoid": 1, "route_scale": 2500, "groups": 2, "topk_groups": 1}
    assert {k: op.attrs.get(k) for k in v3} == (v3 if name == "deepseek_v3" else dict.fromkeys(v3))
    assert op.params == sum(p.numel() for p in (mlp.gate.weight, mlp.experts.gate_up_proj,
                                                  mlp.experts.down_proj))
    assert not [o for o in graph.ops if o.kind is OpKind.OPAQUE and (o.weight or o.params)]
    assert sum(o.params for o in graph.ops) == sum(p.numel() for p in model.parameters())
    if name in SHARED:
        shared = _owners(graph, aliases, f"{at}.{SHARED[name]}.gate_proj.weight")
        assert [o.kind for o in shared] == [OpKind.LINEAR]
    plan = ilp_planner.solve(graph, cluster=CLUSTER, baselines=False)
    layer = next(ly for ly in plan.layers if ly.name == op.name)
    assert layer.strategy.startswith("moe(")


def test_a_gpt_oss_block_is_one_moe_op_owning_its_biases_and_glu_constants(imported):
    """GPT-OSS's block (router ``weight`` and ``bias``; experts ``gate_up_proj (E, h, 2f)``
    with gate and up columns alternating, ``down_proj (E, f, h)``, each with a bias; a GLU
    clamped at ``limit`` with slope ``alpha``): before, its experts were not found (no
    ``act_fn``, another orientation), exported as the expert loop's opaque ops, and refused
    by ``parallelize`` at the first forward (the router's tuple output). Now it is one
    ``moe`` op of the interleaved form owning all six tensors in the module's order, its
    routing Mixtral's (a softmax over the top-k logits is the renormalised top-k), and it
    solves with the experts laid out by the MoE strategies."""
    model, graph = imported("gpt_oss")
    at = "model.layers.0.mlp"
    mlp = model.model.layers[0].mlp
    owners = _owners(graph, _aliases(model), f"{at}.experts.gate_up_proj")
    assert [op.kind for op in owners] == [OpKind.MOE]
    op = owners[0]
    assert op.name == f"{at}.experts.moe"  # the name the runtime finds its module by
    assert op.source_params == (f"{at}.router.weight", f"{at}.experts.gate_up_proj",
                                f"{at}.experts.down_proj", f"{at}.router.bias",
                                f"{at}.experts.gate_up_proj_bias", f"{at}.experts.down_proj_bias")
    assert (op.attr("hf_experts"), op.attr("glu_alpha"), op.attr("glu_limit")) == (
        HF_INTERLEAVED, round(1000 * mlp.experts.alpha), round(1000 * mlp.experts.limit))
    assert (op.attr("experts"), op.attr("top_k"), op.attr("ffn"), op.attr("norm_topk")) == (
        4, 2, mlp.experts.down_proj.shape[1], 1)
    assert op.params == sum(p.numel() for p in mlp.parameters())
    assert sum(o.params for o in graph.ops) == sum(p.numel() for p in model.parameters())
    plan = ilp_planner.solve(graph, cluster=CLUSTER, baselines=False)
    assert next(ly for ly in plan.layers if ly.name == op.name).strategy.startswith("moe(")


def test_gpt_oss_glu_constants_the_op_cannot_hold_are_refused():
    """The op holds ``alpha`` and ``limit`` in thousandths: a value it would round is
    refused in one line naming it, not planned and run as another activation."""
    model = _gpt_oss()
    model.model.layers[1].mlp.experts.alpha = 1.7025
    _refused_in_one_line(model, r"GptOssExperts: alpha=1\.7025; the moe op holds")
    # refused before any block's router or experts were swapped (layer 0's included)
    assert not any("forward" in vars(m) for layer in model.model.layers
                   for m in (layer.mlp.router, layer.mlp.experts))


def _assert_blocks_are_the_op(model: Any, ids: torch.Tensor) -> None:
    """The model's logits with its 2 routed blocks through ``ilp_planner::moe_experts``
    equal its own (the op is the block, not an approximation of it)."""
    with torch.no_grad():
        want = model(ids).logits
        with routed_as_one_op(model, torch) as blocks:
            got = model(ids).logits
    assert blocks == 2
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", MOES)
def test_the_moe_custom_op_computes_what_the_block_does(name):
    """While exporting, the blocks route through ``ilp_planner::moe_experts``: the model's
    logits under it equal its own (the op is the block, not an approximation of it)."""
    model, (ids,) = _builders()[name]()
    _assert_blocks_are_the_op(model, ids)
    assert "forward" not in vars(hf_router(_moe_block(model, name)))  # restored


@pytest.mark.parametrize("name", MOES)
def test_an_imported_moe_op_prices_its_modules_tensors_and_offers_no_expert_tp(imported, name):
    """``parallelize`` places the block's own tensors as they are: the op's roles are their
    shapes in the module's orientation (router ``(E, h)``, ``gate_up`` ``(E, 2f, h)``, ``down``
    ``(E, h, f)``), and no strategy splits an expert's hidden dim — a block of the fused
    gate/up dim would hold gate rows of some columns and up rows of others — while expert
    parallel ones are offered on every axis that divides the experts."""
    model, graph = imported(name)
    op = next(o for o in graph.ops if o.kind is OpKind.MOE)
    params = dict(model.named_parameters())
    biases = ["router_bias", "gate_up_bias", "down_bias"] if name == "gpt_oss" else []
    assert list(param_shapes(op)) == ["router", "gate_up", "down", *biases]
    assert list(param_shapes(op).values()) == [tuple(params[n].shape) for n in op.source_params]
    ctx = StrategyContext(parse_cluster({"cluster": CLUSTER}), 2, 4, MemorySpec.preset("adam"))
    # the experts' axes, not the example's batch of 2 (which splits its tokens two ways at
    # most under parallelize): the op as imported for a batch every mesh axis divides
    op = dataclasses.replace(op, attrs=MappingProxyType({**op.attrs, "row_items": 8}))
    strats = op_strategies(op, [TensorSpec(op.output.shape)], ctx)
    assert strats and all(s.fact[2].size == 1 for s in strats)
    assert {s.fact[1].size for s in strats if expert_parallel(s.inputs[0])} == {1, 2, 4}


@pytest.mark.parametrize("name", MOES)
def test_the_runtimes_moe_kernel_on_the_modules_tensors_is_the_blocks_experts(imported, name):
    """The kernel ``parallelize`` swaps into an imported block (:func:`runtime.moe.hf_roles`
    viewing the module's tensors as the kernel's roles; here every token in one group, the
    single-process reference) computes what the block's router and experts do, and its
    gradients reach the module's tensors."""
    model, graph = imported(name)
    op = next(o for o in graph.ops if o.kind is OpKind.MOE)
    mlp = _moe_block(model, name)
    gate = hf_router(mlp)
    x = torch.randn(op.output.shape, requires_grad=True)
    bias = correction_bias(mlp, gate)  # V3's buffer, or MiniMax-M2's on the block
    handed = bias is not None and not hasattr(gate, "e_score_correction_bias")
    _, weights, chosen = gate(x, bias) if handed else gate(x)
    want = mlp.experts(x, chosen, weights)
    roles = module_roles(op, gate, mlp.experts)  # GPT-OSS's with its three biases
    got = moe_reference(op, x, {**roles, **({} if bias is None else {"score_bias": bias})})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    tensors = (x, *roles.values())
    g_want = torch.autograd.grad(want.square().sum(), tensors)
    g_got = torch.autograd.grad(got.square().sum(), tensors)
    for a, b in zip(g_got, g_want, strict=True):
        # an expert not chosen gets no router gradient through a softmax over the top-k
        # logits (GPT-OSS); through the renormalised softmax over all, terms that cancel
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_a_float32_router_in_a_bfloat16_block_reduces_its_gradient_apart_in_float32():
    """HunYuan-MoE as ``from_pretrained`` loads it in bfloat16: its routers stay float32
    (and read the tokens in float32). The block is still one moe op — the check runs it in
    the experts' dtype — trained as it is (``own_precision``) with the router's role marked
    float32: its gradient reduces in its own AllReduce of 4-byte elements, the experts' in
    2-byte ones."""
    model, (ids,) = _builders()["hunyuan_moe"]()
    model = model.to(torch.bfloat16)
    for layer in model.model.layers:
        layer.mlp.gate.wg.float()
    graph = from_module(model, (ids,))
    op = next(o for o in graph.ops if o.kind is OpKind.MOE)
    assert op.source_params[0].endswith("gate.wg.weight")
    assert op.attrs["own_precision"] == 1 and op.attrs["float32_roles"] == 1
    assert [op.grad_itemsize(i) for i in range(3)] == [4, 2, 2]
    ctx = StrategyContext(parse_cluster({"cluster": CLUSTER}), 2, 4, MemorySpec.preset("adam"))
    op = dataclasses.replace(op, attrs=MappingProxyType({**op.attrs, "row_items": 8}))
    strat = next(s for s in op_strategies(op, [TensorSpec(op.output.shape, "bfloat16")], ctx)
                 if s.fact[0].size == 2 and s.fact[1].size == 4 and expert_parallel(s.inputs[0]))
    syncs = grad_sync(op, strat.label, strat.inputs, strat.weight, strat.output, ctx)
    sizes = {sb.roles: sb.collective.bytes / sb.numel for sb in syncs}
    assert sizes[("router",)] == 4 and all(v == 2 for r, v in sizes.items() if r != ("router",))


@pytest.mark.parametrize("routing,field", [
    ({"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ({"topk_method": "group_limited_greedy", "n_group": 3, "topk_group": 1},
     "n_group=3, topk_group=1"),
])
def test_a_deepseek_v2_router_the_moe_op_does_not_compute_is_refused(routing, field):
    """A selection method the op does not know, or groups that do not divide the experts:
    the import stops naming the config field rather than pricing another model."""
    model = T.DeepseekV2ForCausalLM(_deepseek_v2(**routing))
    with pytest.raises(ConfigError, match=f"model.layers.1.mlp.gate .*{field}") as exc:
        from_module(model, (_ids(),))
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("routing", [
    {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 2},
    {"topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1,
     "routed_scaling_factor": 2.5}])
def test_a_deepseek_v2_group_limited_or_scaled_router_is_the_op(routing):
    """``group_limited_greedy`` (groups ranked by their best softmax score; all kept when
    ``topk_group == n_group``) and ``routed_scaling_factor``: the block is the op, computed
    the same."""
    model = T.DeepseekV2ForCausalLM(_deepseek_v2(**routing))
    ids = _ids()
    _assert_blocks_are_the_op(model, ids)


def _routed(model_class: str, config_class: str, **fields: Any) -> Any:
    """A tiny routed model of ``model_class``: 2 layers, 4 experts, top-2."""
    return getattr(T, model_class)(getattr(T, config_class)(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16,
        num_local_experts=4, num_experts_per_tok=2, use_cache=False, **fields))


def _refused_in_one_line(model: Any, pattern: str) -> None:
    """Importing ``model`` raises :class:`ConfigError` matching ``pattern``, in one line."""
    with pytest.raises(ConfigError, match=pattern) as exc:
        from_module(model, (_ids(),))
    assert "\n" not in str(exc.value)


def test_a_granitemoe_block_held_as_router_is_one_moe_op_computing_the_block():
    """GraniteMoE holds its router as ``router`` (a softmax over the top-k logits:
    Mixtral's renormalised top-k). Before, its blocks were not found: exported as the
    expert loop's opaque ops, planned, and refused by ``parallelize`` at the first forward
    (the router's tuple output). Now each block is one ``moe`` op owning ``router.weight``,
    and the model's logits under the op are its own."""
    torch.manual_seed(0)
    model, ids = _routed("GraniteMoeForCausalLM", "GraniteMoeConfig"), _ids()
    graph = from_module(model, (ids,))
    at = "model.layers.0.block_sparse_moe"
    moes = [op for op in graph.ops if op.kind is OpKind.MOE]
    assert len(moes) == 2
    assert set(moes[0].source_params) == {f"{at}.router.weight", f"{at}.experts.gate_up_proj",
                                          f"{at}.experts.down_proj"}
    assert moes[0].attr("norm_topk") == 1
    assert not [o for o in graph.ops if o.kind is OpKind.OPAQUE and (o.weight or o.params)]
    _assert_blocks_are_the_op(model, ids)


def test_a_router_with_mixtrals_structure_but_another_routing_is_refused():
    """PhiMoE's block has Mixtral's structure (a 2-D router with ``top_k``, 3-D SwiGLU
    experts) but routes by its sparse mixer: the op would plan and run Mixtral's routing.
    Each block is run both ways on one random input first, and this one is refused, naming
    the block, the router's class and the difference, in one line."""
    torch.manual_seed(0)
    model = _routed("PhimoeForCausalLM", "PhimoeConfig")
    _refused_in_one_line(model, r"MoE block model\.layers\.0\.mlp \(PhimoeSparseMoeBlock, "
                                r"router PhimoeTopKRouter\): .*does not compute what the "
                                r"block computes")
    assert "forward" not in vars(model.model.layers[0].mlp.router)  # restored


def test_a_freshly_initialised_router_scoring_another_way_is_refused():
    """A router with Mixtral's structure scoring by sigmoid (renormalised over its top-k),
    freshly initialised: its logits are near zero, where sigmoid and softmax weights are
    nearly equal (MiniMax-M2's check differed by 1e-4, at the edge of its tolerance; this
    one, with smaller weights still, passed the check before). The check runs the block on
    an input spreading the logits apart, so it is refused."""
    import torch.nn.functional as F

    class SigmoidRouter(T.models.mixtral.modeling_mixtral.MixtralTopKRouter):
        def forward(self, hidden_states: torch.Tensor) -> tuple:
            logits = F.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
            weights, chosen = torch.topk(torch.sigmoid(logits.float()), self.top_k, dim=-1)
            return logits, weights / weights.sum(dim=-1, keepdim=True), chosen

    torch.manual_seed(0)
    model = _routed("MixtralForCausalLM", "MixtralConfig")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate.__class__ = SigmoidRouter
            layer.mlp.gate.weight.mul_(0.01)  # logits nearer zero still
    _refused_in_one_line(model, r"MoE block model\.layers\.0\.mlp \(MixtralSparseMoeBlock, "
                                r"router SigmoidRouter\): .*does not compute what the block")


@pytest.mark.parametrize("meta", [False, True])
def test_an_lfm2_moe_router_without_its_expert_bias_is_still_sigmoid(meta):
    """LFM2-MoE's router scores by sigmoid whether or not it has an expert bias
    (``use_expert_bias``). Without one there is no correction bias to recognise it by: it
    was taken for a softmax router — refused by the check on real weights, and on the meta
    device, where no check runs, planned as softmax routing. Its flag marks it sigmoid;
    the check on real weights agrees."""
    cfg = T.Lfm2MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                          vocab_size=VOCAB, max_position_embeddings=16, num_experts=4,
                          num_experts_per_tok=2, num_dense_layers=1, use_cache=False,
                          layer_types=["conv", "full_attention", "conv"], use_expert_bias=False)
    with torch.device("meta" if meta else "cpu"):
        model = T.Lfm2MoeForCausalLM(cfg)
    if not meta:  # Hugging Face zeroes the router: scores all equal
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.feed_forward.gate.weight.normal_(0.0, 0.2)
    graph = from_module(model, (_ids(),))
    assert [op.attrs.get("sigmoid") for op in graph.ops if op.kind is OpKind.MOE] == [1, 1]


def test_a_moe_block_whose_code_cannot_run_around_the_op_is_refused_naming_it():
    """Llama 4's block has a 2-D router with ``top_k`` and 3-D SwiGLU experts, but its
    forward unpacks two values from its router and scales the experts' inputs by the
    scores. Before, the import crashed with a bare ``ValueError`` from inside the model's
    code; now it is refused in one line naming the block, the router and the failure, and
    the router and experts are left as they were."""
    torch.manual_seed(0)
    model = T.Llama4ForCausalLM(T.Llama4TextConfig(
        hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=VOCAB,
        max_position_embeddings=16, num_local_experts=2, num_experts_per_tok=1,
        interleave_moe_layer_step=2, no_rope_layers=[1, 0], use_cache=False))
    _refused_in_one_line(model, r"MoE block model\.layers\.1\.feed_forward \(Llama4TextMoe, "
                                r"router Llama4Router\): its forward does not run around one "
                                r"moe op .*ValueError: too many values to unpack")
    block = model.model.layers[1].feed_forward
    assert "forward" not in vars(block.router) and "forward" not in vars(block.experts)


def test_a_shape_computed_from_the_data_is_refused_naming_the_model_s_line():
    """JetMoE splits its tokens by how many each expert drew (``inputs.split(expert_size)``):
    torch.export describes those sizes by symbols of the data. Before, the import crashed
    with ``TypeError: unhashable type: non-nested SymInt``; now it is refused in one line
    naming the op, the symbolic shape and the model's line."""
    torch.manual_seed(0)
    model = T.JetMoeForCausalLM(T.JetMoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2,
        kv_channels=8, intermediate_size=64, max_position_embeddings=16,
        num_local_experts=4, num_experts_per_tok=2, use_cache=False))
    _refused_in_one_line(model, r"op split_with_sizes \(split_with_sizes\) makes a tensor "
                                r"whose shape depends on the data \('u\d+', .* at "
                                r"modeling_jetmoe\.py:\d+ \('input_list = "
                                r"inputs\.split\(expert_size, dim=0\)'\)")


def test_the_routing_check_leaves_the_global_random_state():
    """The check draws its input from its own generator and runs the blocks with the
    global random state forked: a launch importing on rank 0 only draws alike on every rank
    afterwards (dropout, the next batch)."""
    torch.manual_seed(0)
    model, ids = _routed("MixtralForCausalLM", "MixtralConfig"), _ids()
    model.train()
    state = torch.get_rng_state()
    graph = from_module(model, (ids,))
    assert torch.equal(torch.get_rng_state(), state)
    assert sum(op.kind is OpKind.MOE for op in graph.ops) == 2


def test_a_per_image_statistic_on_flattened_tokens_is_an_opaque_op_and_the_model_solves():
    """ConvNeXt-V2's GRN scales its channels-last tokens, flattened to ``(b·h·w, c)`` for
    the pointwise linears, by a per-image ``(b, 1, 1, c)`` statistic: no element-wise
    strategy lays that product out. Before, the importer made it a ``mul`` op anyway and the
    solve stopped at the graph's check ("a mul op's input of shape [4, 1, 1, 64] neither
    broadcasts …"); now it is an opaque op (kept whole, counted, named by ``explain``) and
    the model solves."""
    torch.manual_seed(0)
    model = T.ConvNextV2ForImageClassification(T.ConvNextV2Config(
        num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10, drop_path_rate=0.0))
    graph = from_module(model, (torch.randn(4, 3, 32, 32),))
    grn = [op for op in graph.ops if op.name.endswith("layers.0.grn.mul")]
    assert [op.kind for op in grn] == [OpKind.OPAQUE, OpKind.OPAQUE]
    # (tokens, 4 × width): 4 images of 8 × 8 then 4 × 4 patches, widths 8 then 16
    assert [op.output.shape for op in grn] == [(256, 32), (64, 64)]
    plan = ilp_planner.solve(graph, cluster=CLUSTER, baselines=False)
    assert plan.solver.status == "optimal"


def test_a_frozen_position_table_on_a_trained_word_table_is_an_op_of_its_own():
    """Marian's sinusoidal position tables ship frozen (``requires_grad=False``); its word
    table trains. A position table added to an embedding folds into that op, but one op's
    parameters train alike: before, the import stopped ("some of its parameters are frozen
    and others not"); now the frozen table is an op of its own, frozen, and the model
    solves."""
    model = T.MarianMTModel(T.MarianConfig(
        vocab_size=VOCAB, decoder_vocab_size=VOCAB, d_model=32, encoder_layers=1,
        decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=16, use_cache=False,
        pad_token_id=0, decoder_start_token_id=1))
    ids = _ids()
    graph = from_module(model, {"input_ids": ids, "decoder_input_ids": ids})
    table = "model.encoder.embed_positions.weight"
    owners = [op for op in graph.ops if table in op.source_params]
    assert len(owners) == 1 and owners[0].frozen and owners[0].kind is not OpKind.EMBEDDING
    words = next(op for op in graph.ops if op.name == "model.encoder.embed_tokens")
    assert not words.frozen and table not in words.source_params
    plan = ilp_planner.solve(graph, cluster=CLUSTER, baselines=False)
    assert plan.solver.status == "optimal"


def test_layerdrop_is_refused_at_its_line_and_imports_when_off():
    """M2M100 ships LayerDrop on (0.05): in training each layer is skipped on a random
    draw, which no plan can fix. The import names the model's line; with the layerdrop
    fields 0 the same model imports."""
    fields = dict(vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1,
                  encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                  decoder_ffn_dim=64, max_position_embeddings=16, use_cache=False,
                  pad_token_id=0, decoder_start_token_id=1)
    ids = _ids()
    inputs = {"input_ids": ids, "decoder_input_ids": ids.clone()}
    with pytest.raises(ConfigError, match=r"modeling_m2m_100\.py:\d+ \('if dropout_probability "
                                          r"< self\.layerdrop:'\).*layerdrop fields 0"):
        from_module(T.M2M100ForConditionalGeneration(T.M2M100Config(**fields)), inputs)
    off = T.M2M100Config(**fields, encoder_layerdrop=0.0, decoder_layerdrop=0.0)
    graph = from_module(T.M2M100ForConditionalGeneration(off), inputs)
    assert sum(op.kind is OpKind.ATTENTION for op in graph.ops) == 3


class _SelfSimilarity(nn.Module):
    """``y yᵀ`` of one activation: a batched matmul the planner does not shard."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        return torch.bmm(y, y.transpose(1, 2))


def test_opaque_op_flops_and_bytes_are_torchs_count():
    x = torch.randn(2, 8, 16)
    graph = from_module(_SelfSimilarity(), (x,))
    op = graph["bmm"]  # (its transposed operand is a relayout of its own: no FLOPs)
    assert op.kind is OpKind.OPAQUE
    y = torch.randn(2, 8, 16)
    with FlopCounterMode(display=False) as counter:
        torch.bmm(y, y.transpose(1, 2))
    assert op.flops == counter.get_total_flops() == 2 * 2 * 8 * 8 * 16
    assert op.attrs["bytes_read"] == 2 * y.numel() * 4 and op.attrs["bytes_written"] == 2 * 8 * 8 * 4


def test_validate_lists_opaque_ops_with_their_flops():
    graph = from_module(_SelfSimilarity(), (torch.randn(2, 8, 16),))
    lines = unsharded_summary(graph)
    forward = sum(op.flops for op in graph.ops)
    assert lines[0] == (f"unsharded 2 op(s) kept replicated (opaque): 4.10 K of "
                        f"{forward / 1e3:.2f} K forward FLOPs ({4096 / forward:.1%})")
    assert lines[1:] == ["  bmm: 4.10 K FLOPs, 2.0 KiB read, 0.5 KiB written",
                         "  opaque: 0 FLOPs, 1.0 KiB read, 1.0 KiB written"]


def test_a_constant_added_to_itself_lists_its_parameter_once():
    g = DraftGraph(nn.Linear(2, 2), lambda node: NodeCost(0.0, 0, 0))
    node = torch.fx.Graph().call_function(torch.add, ())
    c = Const(("p",))
    for _ in range(3):
        c = lift_const(g, Call(node, "add", [c, c], {}, torch.zeros(1)))
    assert c.params == ("p",)


class _TwoHeads(nn.Module):
    """Returns a mapping whose logits are not its first field."""

    def __init__(self) -> None:
        super().__init__()
        self.aux = nn.Linear(8, 3)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"aux": self.aux(x), "logits": self.head(x)}


@pytest.mark.parametrize("output,head", [(None, "head"), ("logits", "head"), ("aux", "aux"),
                                         (0, "aux"), (1, "head")])
def test_structured_output_picks_the_logits_or_the_named_field(output, head):
    graph = from_module(_TwoHeads(), (torch.randn(4, 8),), output=output)
    (loss,) = [op for op in graph.ops if op.kind is OpKind.LOSS]
    assert loss.inputs == (head,)


def test_an_unknown_output_field_is_refused_by_name():
    with pytest.raises(ConfigError, match="no output 'hidden'"):
        from_module(_TwoHeads(), (torch.randn(4, 8),), output="hidden")


def test_a_causal_lm_with_its_cache_on_says_pass_use_cache_false():
    model = _llama(False)
    model.config.use_cache = True
    with pytest.raises(ConfigError, match="use_cache=False"):
        from_module(model, (_ids(),))


def test_explain_lists_opaque_ops_with_their_share_of_the_step():
    graph = from_module(_SelfSimilarity(), (torch.randn(2, 8, 16),))
    plan = ilp_planner.solve(graph, cluster=CLUSTER, baselines=False)
    line = next(x for x in ilp_planner.explain(plan).splitlines()
                if x.startswith("unsharded"))
    bmm = next(ly for ly in plan.layers if ly.name == "bmm")
    share = (bmm.compute_s + sum(c.seconds for c in bmm.collectives)) / plan.cost.total_s
    assert line.startswith("unsharded 2 opaque op(s), replicated: ")
    assert f"bmm {share:.1%}" in line


def test_solve_summary_warns_when_opaque_ops_are_over_5_percent_of_the_step():
    graph = from_module(_SelfSimilarity(), (torch.randn(2, 8, 16),))
    plan = ilp_planner.solve(graph, cluster=CLUSTER, baselines=False)
    share = opaque_share(plan)
    first = ilp_planner.summary(plan).splitlines()[0]
    assert share > OPAQUE_WARN_SHARE
    assert f"WARNING: {share:.0%} of the step is in unsharded (opaque) ops" in first
    lifted = ilp_planner.solve(from_module(_llama(False), (_ids(),)), cluster=CLUSTER,
                               baselines=False)
    assert opaque_share(lifted) == 0 and "WARNING" not in ilp_planner.summary(lifted)


class _Logits(nn.Module):
    """A Hugging Face model with its logits as the output, which the runtime checks."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).logits


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist = pytest.importorskip("torch.distributed")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", ("gpt2", "bert", "resnet"))
def test_applied_on_one_rank_computes_what_the_module_does(one_rank, name):
    """The parameters map back: Conv1D's ``(in, out)`` weight, BERT's three embedding
    tables, bias-free convolutions (untied heads: the runtime refuses tied weights)."""
    torch.manual_seed(0)
    untied = {"gpt2": T.GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=VOCAB,
                                   n_positions=16, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0,
                                   use_cache=False, tie_word_embeddings=False),
              "bert": T.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, vocab_size=VOCAB,
                                   max_position_embeddings=16, hidden_dropout_prob=0,
                                   attention_probs_dropout_prob=0, tie_word_embeddings=False)}
    if name == "resnet":
        model, x = _builders()["resnet"]()[0], torch.randn(BATCH, 3, 32, 32)
    else:
        cls = T.GPT2LMHeadModel if name == "gpt2" else T.BertForMaskedLM
        model, x = cls(untied[name]), _ids()
    module = _Logits(model).eval()
    expected = module(x)
    one = dict(CLUSTER, nodes=1, devices_per_node=1)
    plan = ilp_planner.solve(from_module(module, (x,)), cluster=one, baselines=False)
    got = ilp_planner.apply(plan, module)(x)
    assert torch.allclose(ilp_planner.full_value(got), expected, atol=1e-5)


@torch.library.custom_op("ilp_planner_test::square_mm", mutates_args=())
def _square_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``(x W) W``: a custom op whose matmuls only its Python body shows the counter."""
    return (x @ w) @ w


@_square_mm.register_fake
def _square_mm_shape(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class _NormThenCustom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8)
        self.w = nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _square_mm(self.norm(x), self.w)


def test_a_custom_op_is_counted_on_the_example_and_leaves_the_module_untouched():
    module = _NormThenCustom().train()
    before = module.norm.running_mean.clone(), int(module.norm.num_batches_tracked)
    graph = from_module(module, (torch.randn(4, 8) + 3.0,))
    (op,) = [op for op in graph.ops if op.kind is OpKind.OPAQUE]
    assert op.flops == 2 * (2 * 4 * 8 * 8) and op.source_params == ("w",)
    assert torch.equal(module.norm.running_mean, before[0])
    assert int(module.norm.num_batches_tracked) == before[1]


def test_t5s_position_tables_and_shared_table_are_owned_and_priced(imported):
    """Each stack's relative position table is owned by its first self-attention (it is
    SDPA's mask there and in every later self-attention of the stack, marked
    ``bias_table``; cross-attention adds none). Those attentions split the batch or the
    heads on every mesh axis, so the table's gradient is one AllReduce over all 8 devices;
    with a batch of 4 and 4 heads, no 8-way layout leaves an axis replicating them. The
    decoder's lookup of the shared table is a tied copy of the encoder's."""
    from ilp_planner.ir.layouts import B

    model, graph = imported("t5")
    self_attn = [op for op in graph.ops if op.kind is OpKind.ATTENTION
                 and ".SelfAttention." in op.name]
    assert all(op.attrs.get("bias_table") for op in self_attn)
    assert not any(op.attrs.get("bias_table") for op in graph.ops
                   if op.kind is OpKind.ATTENTION and op not in self_attn)
    owners = [op for op in self_attn if op.source_params]
    assert [op.name for op in owners] == [f"{s}.block.0.layer.0.SelfAttention.attention"
                                         for s in ("encoder", "decoder")]
    for op in owners:
        table = model.get_parameter(op.source_params[0])
        assert param_shapes(op) == {"rel_bias": tuple(table.shape)} == {"rel_bias": (32, 4)}
    ctx = StrategyContext(parse_cluster({"cluster": CLUSTER}), 2, 4, MemorySpec.preset("adam"))
    strats = op_strategies(owners[0], [TensorSpec(owners[0].output.shape)] * 3, ctx)
    assert strats and all(pl != B for s in strats for ax, pl in
                          zip(s.output.fact, s.output.placements, strict=True) if ax.size > 1)
    syncs = [c for s in strats for c in s.collectives if c.purpose == "grad_sync"]
    assert len(syncs) == len(strats)
    assert {(c.group_size, c.bytes) for c in syncs} == {(8, 32 * 4 * 4)}
    dec = graph["decoder.embed_tokens"]
    assert dec.attrs.get("tied") and dec.source_params == graph["encoder.embed_tokens"].source_params


@pytest.mark.parametrize("name,refusal", [
    ("t5", r"attention 'encoder\.block\.0\.layer\.0\.SelfAttention\.attention' has "
           r"attrs\.bias_table"),
    ("bert", r"embedding 'bert\.embeddings\.word_embeddings' has attrs\.pos_1_rows"),
    # HF's Llama turns q and k by its own rotary code before SDPA (its explicit mask is
    # proven causal): refused before its 3 projections
    ("llama_untied", r"attention 'model\.layers\.0\.self_attn\.attention' has "
                     r"attrs\.input_steps"),
    # Qwen3's per-head q norm, which the runtime's kernel would run over whole rows
    ("qwen3", r"rmsnorm 'model\.layers\.0\.self_attn\.q_norm' has attrs\.group_width"),
])
def test_the_runtime_executor_refuses_an_imported_op_it_would_run_as_another(
        imported, name, refusal):
    """The runtime's own executor (``ilp-planner run`` of a plan file) runs the planner's
    kernels, not the user's module: T5's learned attention bias, BERT's token-type table
    and Llama's separate q, k, v projections would run as other models than the one priced.
    The plan is refused when compiled — what ``run`` does for every plan before it starts a
    rank — naming the op and the attribute, and pointing at ``plan.parallelize``."""
    from runtime.errors import RuntimeSetupError
    from runtime.executor import Executor, RunOptions

    graph = imported(name)[1]
    one = dict(CLUSTER, nodes=1, devices_per_node=1)
    plan = ilp_planner.solve(graph, cluster=one, baselines=False)
    with pytest.raises(RuntimeSetupError, match=refusal + r".*plan\.parallelize\(module\)"):
        Executor(plan, RunOptions(), rank=0, world=1)


def test_t5s_decoder_lookup_in_the_encoders_table_is_refused_by_the_executor(imported):
    """T5's decoder looks its tokens up in the encoder's table (``attrs.tied`` on an
    embedding): the executor would give it a table of its own, so it refuses it — seen on
    the graph's inputs and embeddings alone (its attention, refused first, left out)."""
    from runtime import model
    from runtime.errors import RuntimeSetupError

    graph = imported("t5")[1]
    lookups = [op for op in graph.ops if op.kind in (OpKind.INPUT, OpKind.EMBEDDING)]
    assert [op.name for op in lookups if op.attrs.get("tied")] == ["decoder.embed_tokens"]
    with pytest.raises(RuntimeSetupError, match=r"embedding 'decoder\.embed_tokens' has "
                                                r"attrs\.tied: a lookup in an earlier"):
        model.check_supported(Graph(graph.name, lookups))


def test_imported_rotary_positions_are_priced_by_their_bytes_and_named(imported):
    """HF Llama's rotary (``q·cos + rotate_half(q)·sin``, k alike) is element-wise code
    between the projections and SDPA: each of its kernels (mul, neg, cat, mul, add per
    tensor) is counted on torch's tensors — q of n = 2·4·8·8 elements, k of n/2, the cos
    and sin rows 8 × 8 in float32: (10n + 2·64) × 4 bytes and 3.5n FLOPs per tensor —,
    priced with the attention forward and backward, and named by ``explain``. GQA's
    ``repeat_kv`` (expand, then a reshape that must copy) is a kernel per k and v: it reads
    k's n/2 elements once and writes n, no FLOPs; backward, a sum over the repeats."""
    from ilp_planner.lowering.compute_model import op_work

    _, graph = imported("llama_untied")
    q, k, table = BATCH * 4 * SEQ * 8, BATCH * 2 * SEQ * 8, SEQ * 8
    for i in range(2):
        op = graph[f"model.layers.{i}.self_attn.attention"]
        assert (op.attrs["input_steps"], op.attrs["input_steps_bytes"],
                op.attrs["input_steps_flops"]) == (12, (10 * (q + k) + 4 * table + 6 * k) * 4,
                                                   3.5 * (q + k))
        # backward, as autograd runs it, per tensor of n: dy·sin and dy·cos (2n + 64 each,
        # n FLOPs), the negated half's gradient (n/2 read and written), each slice's
        # gradient written into a zero-filled n (slice_backward: n/2 read, n written, no
        # FLOPs) and two sums of gradients (3n, n adds each): 7 kernels, (14n + 128) × 4
        # bytes, 4.5n FLOPs; each repeat_kv sums its gradient's repeats (3k, k adds); q's,
        # k's and v's gradients, transposed views, copied back to their projections' layout
        fwd, bwd = op_work(op, 2.0)
        assert op.attrs["input_steps_bwd"] == 2 * 7 + 2 + 3
        assert fwd.stream_bytes == op.attrs["input_steps_bytes"] / 2
        assert bwd.stream_bytes == (14 * (q + k) + 4 * table + 6 * k + 2 * (q + 2 * k)) * 4 / 2
        assert fwd.stream_flops == op.attrs["input_steps_flops"] / 2
        assert bwd.stream_flops == (4.5 * (q + k) + 2 * k) / 2
    cluster = dict(CLUSTER, gpu="a100-80gb")
    cluster.pop("peak_tflops")
    text = ilp_planner.explain(ilp_planner.solve(graph, cluster=cluster, baselines=False))
    assert "model.layers.0.self_attn.attention: 12 kernels" in text
    assert "NOT priced" not in text


def test_eager_attention_mask_is_proven_causal_unless_it_reads_the_inputs():
    """HF's eager attention adds its mask to ``q·kᵀ`` by hand: built from positions alone
    (no ``attention_mask``) it is evaluated to the lower triangle (0 / finfo.min) and the
    attention stays unmarked; built from an ``attention_mask`` input (padding), it depends
    on the inputs and the attention is marked ``not_plain_causal``."""
    model = T.LlamaForCausalLM(T.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=16, use_cache=False,
        attn_implementation="eager")).eval()
    ids = _ids()
    alone = from_module(model, (ids,))["model.layers.0.self_attn.attention"]
    padded = from_module(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)})
    assert alone.kind is OpKind.ATTENTION and "not_plain_causal" not in alone.attrs
    assert padded["model.layers.0.self_attn.attention"].attrs["not_plain_causal"] == 1


def _mla() -> Any:
    """A one-layer DeepSeek-V3 whose heads' q·k and v dims differ (qk = 4 nope + 4 rope = 8,
    v = 6) and whose queries go through a low-rank pair (q_a_proj → norm → q_b_proj)."""
    return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, vocab_size=VOCAB,
        max_position_embeddings=16, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6, use_cache=False))


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3", "mla"])
def test_multi_head_latent_attention_imports_as_its_projections_and_heads(imported, name):
    """DeepSeek's MLA: each head's key joins its own part (from ``kv_b_proj``, which also
    gives the values) and a rotary part every head shares (from ``kv_a_proj_with_mqa``),
    written into a ``new_empty`` tensor; the rotary turns pairs into complex numbers. It
    imports as its linears, its norms and one attention with every head, over q's head dim
    (nope + rope) and v's, the shared input marked — no opaque op but the copy of the
    latent columns out of ``kv_a_proj_with_mqa``'s output (priced by its bytes)."""
    if name == "mla":
        torch.manual_seed(0)
        model = _mla().eval()
        graph = from_module(model, (_ids(),))
    else:
        model, graph = imported(name)
    cfg = model.config
    attn = model.model.layers[0].self_attn
    p = "model.layers.0.self_attn"
    q = f"{p}.q_b_proj" if cfg.q_lora_rank else f"{p}.q_proj"
    op = graph[f"{p}.attention"]
    assert op.kind is OpKind.ATTENTION
    assert op.inputs == (q, f"{p}.kv_b_proj", f"{p}.kv_a_proj_with_mqa")
    heads, dqk, dv = cfg.num_attention_heads, attn.qk_head_dim, cfg.v_head_dim
    steps = {k: v for k, v in op.attrs.items() if k.startswith("input_")}
    # HF hands SDPA an explicit mask: the lower triangle, so plain causal (unmarked)
    assert {k: v for k, v in op.attrs.items() if k not in steps} == {
        "heads": heads, "seq_len": SEQ, "shared_input": 2, "functional": 1,
        "row_items": BATCH}  # the batch: its rows split by its divisors
    # its rotary on q's and the shared key's rope parts: kernels of their own, priced; the
    # key's shared rope part, written into every head's slice (v2's ``copy_`` into a
    # ``new_empty`` key, v3's too), a copy that repeats it: backward, a sum over the heads
    assert steps["input_steps"] >= 2 and steps["input_steps_bytes"] > 0
    assert steps["input_copies_repeat"] == 1 and steps["input_steps_bwd_flops"] >= \
        BATCH * SEQ * cfg.qk_rope_head_dim * (heads - 1)
    tokens = BATCH * SEQ
    assert op.output.shape == (tokens, heads * dv)
    assert op.flops == 2.0 * tokens * SEQ * heads * (dqk + dv)
    kinds = {o.name.removeprefix(f"{p}."): o.kind for o in graph.ops if o.name.startswith(p)}
    linears = {"kv_a_proj_with_mqa", "kv_b_proj", "o_proj"} | (
        {"q_a_proj", "q_b_proj"} if cfg.q_lora_rank else {"q_proj"})
    assert {n for n, k in kinds.items() if k is OpKind.LINEAR} == linears
    norms = {"kv_a_layernorm"} | ({"q_a_layernorm"} if cfg.q_lora_rank else set())
    assert {n for n, k in kinds.items() if k is OpKind.RMSNORM} == norms
    opaque = [graph[f"{p}.{n}"] for n, k in kinds.items() if k is OpKind.OPAQUE]
    assert [o.name for o in opaque] == [f"{p}.kv_a_layernorm.opaque"]
    latent = tokens * cfg.kv_lora_rank * 4  # float32 bytes
    # a copy of columns: its rows are its producer's, so it may split the tokens
    assert (opaque[0].flops, opaque[0].attrs["bytes_read"], opaque[0].attrs.get("rows_local")
            ) == (0.0, latent, 1)


def test_mla_splits_its_heads_reading_the_shared_rotary_key_whole():
    """MLA's heads split over a mesh axis (4 heads, 4 ways): q and kv_b_proj's output are
    read split by heads, the shared rotary key whole on that axis, and its gradient — each
    device's heads' share — leaves the backward partial there, so the edge sums it."""
    from ilp_planner.ir.layouts import B, P, Split

    torch.manual_seed(0)
    graph = from_module(_mla().eval(), (_ids(),))
    op = graph["model.layers.0.self_attn.attention"]
    ctx = StrategyContext(parse_cluster({"cluster": dict(CLUSTER, nodes=1)}), 1, 4,
                          MemorySpec.preset("adam"))
    split = [s for s in op_strategies(op, [graph[i].output for i in op.inputs], ctx)
             if s.output.split_degree(1) == 4]
    assert split, "no strategy splits MLA's heads"
    for s in split:
        axis = next(a for a, pl in enumerate(s.output.placements) if pl == Split(1))
        assert s.inputs[0].placements[axis] == s.inputs[1].placements[axis] == Split(1)
        assert s.inputs[2].placements[axis] == B
        assert s.grads_of_inputs[2].placements[axis] == P
        assert input_grad_layouts(op, s.label, s.inputs, s.weight) == s.grads_of_inputs
    copy = graph["model.layers.0.self_attn.kv_a_layernorm.opaque"]
    offered = op_strategies(copy, [graph[i].output for i in copy.inputs], ctx)
    # its rows (N·S) split by the batch's divisors only: parallelize splits the batch dim
    assert {s.output.split_degree(0) for s in offered} == {1, 2} and BATCH == 2
    assert all(s.output.split_degree(1) == 1 for s in offered)


def test_a_config_builds_a_hugging_face_class_from_its_configuration_fields(tmp_path):
    """``model.kind: torch`` naming a Hugging Face class: ``kwargs`` are the fields of its
    configuration class (GPT-2's ``n_embd``, not constructor keywords), ``use_cache`` off
    unless given; the graph is the one ``from_module`` imports from the same model, and a
    bad field names the configuration class."""
    path = tmp_path / "gpt2.yaml"
    fields = {"n_embd": 32, "n_layer": 2, "n_head": 4, "vocab_size": 64, "n_positions": 16}
    path.write_text(
        "model:\n  kind: torch\n  module: transformers:GPT2LMHeadModel\n"
        f"  kwargs: {fields}\n"
        "  example_inputs: {input_ids: {shape: [2, 8], dtype: int64, high: 64}}\n"
        "cluster: {gpu: a100-80gb, nodes: 1, devices_per_node: 4, intra: nvlink3, "
        "inter: 8x-ib-hdr200}\n")
    config = load_config(path)
    with torch.device("meta"):
        model = T.GPT2LMHeadModel(T.GPT2Config(**fields, use_cache=False))
    direct = from_module(model, (torch.zeros(2, 8, dtype=torch.long, device="meta"),),
                         name="GPT2LMHeadModel")
    assert [(op.name, op.kind, op.output) for op in config.graph.ops] == \
        [(op.name, op.kind, op.output) for op in direct.ops]
    assert ilp_planner.solve(config, baselines=False).solver.status == "optimal"
    path.write_text(path.read_text().replace("'n_embd': 32", "'n_embd': 30"))  # 30 % 4 heads
    with pytest.raises(ConfigError, match=r"model\.kwargs.*GPT2Config\(\*\*kwargs\)"):
        load_config(path)
    path.write_text(path.read_text().replace("'n_layer'", "'n_layers'"))  # a misspelt field
    with pytest.raises(ConfigError, match=r"model\.kwargs\.n_layers.*not a field of GPT2Config "
                                          r"\(did you mean 'n_layer'\?\)"):
        load_config(path)


def test_a_model_given_its_labels_is_refused_for_parallelize() -> None:
    """The usual Hugging Face training call passes ``labels``: the model's forward computes
    its own loss, which ``parallelize`` does not run on its sharded values (it failed at the
    first forward). Refused at import, saying what to do; without labels it imports."""
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=SEQ, use_cache=False)
    model = T.LlamaForCausalLM(cfg)
    ids = _ids()
    with pytest.raises(ConfigError, match="a loss its own forward computes"):
        from_module(model, {"input_ids": ids, "labels": ids})
    assert from_module(model, {"input_ids": ids}).ops


@pytest.mark.parametrize("name", DENSE)
def test_an_imported_graph_reads_back_from_its_plan_s_config(imported, name):
    """A plan carries its graph as the config's explicit form, which every verb and
    ``parallelize`` read back through the config's checks (an element-wise op reading a view
    of its output's elements — RoBERTa's, ConvNeXt's — must pass them)."""
    from ilp_planner.inputs.models import graph_from_spec, graph_to_spec

    _, graph = imported(name)
    again = graph_from_spec(graph_to_spec(graph), "plan.json")
    assert [(op.name, op.kind, op.output, op.inputs, dict(op.attrs)) for op in again.ops] == \
        [(op.name, op.kind, op.output, op.inputs, dict(op.attrs)) for op in graph.ops]


def test_a_bias_table_held_beside_other_weights_is_refused_before_any_parameter_is_placed(
        one_rank):
    """``parallelize`` looks an attention's bias table up in this rank's whole copy while the
    module holding it runs (an ``nn.Embedding``, Swin's ``SwinRelativePositionBias``: the
    lookup alone). A table held by the attention itself, beside its projections, is refused
    naming both — before placing a parameter or installing a hook, so the user's module is
    left as it was."""
    from tests.helpers.user_models import TableInAttentionLM

    torch.manual_seed(0)
    module = TableInAttentionLM()
    ids = torch.randint(0, 64, (BATCH, 8))
    graph = from_module(module, (ids,))
    owner = next(op for op in graph.ops if op.attrs.get("bias_buckets"))
    assert "attn.table" in owner.source_params
    one = dict(CLUSTER, nodes=1, devices_per_node=1)
    plan = ilp_planner.solve(graph, cluster=one, baselines=False)
    with pytest.raises(RuntimeSetupError, match=r"bias table attn\.table, .* TableInAttention "
                                                r"holds other parameters too \(qkv\.weight\)"):
        ilp_planner.apply(plan, module)
    assert all(type(p) is torch.nn.Parameter for p in module.parameters())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in module.modules())
