"""torchrun script: Hugging Face models trained under ``parallelize`` match the same models
trained in one process, and the collectives they issue are the plan's.

    torchrun --nproc-per-node 4 tests/helpers/hf_apply_check.py --shape 2x2 [MODEL …]

One launch runs every model of :data:`MODELS` (or the ones named) on one cluster shape
(``NODESxDEVICES``): each is built from a tiny config with random weights (seeded alike on
every rank), imported with :func:`ilp_planner.from_module`, solved on rank 0 (the plan
broadcast), applied and trained with a plain loop on the model's own output structure (a
``ModelOutput``) — gradients clipped every step (:func:`ilp_planner.clip_grad_norm_`), the
second step accumulating two backwards into the zeros the first step's
``zero_grad(set_to_none=False)`` kept — beside an unsharded copy. Prints one line per model on rank 0 —
``OK <model> <strategies>`` or ``FAIL <model>: <why>`` — and exits 1 if any failed. A new
model is one builder in :data:`MODELS`.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ilp_planner  # noqa: E402
from ilp_planner.inputs.config import load_config  # noqa: E402
from ilp_planner.intra_op.baselines import (  # noqa: E402
    Filter,
    data_parallel_filter,
    megatron_filter,
)
from ilp_planner.ir.cluster import MeshAxis, mesh_factorisations  # noqa: E402
from ilp_planner.ir.graph import Op, OpKind  # noqa: E402
from ilp_planner.ir.layouts import drop_unit_axes  # noqa: E402
from ilp_planner.lowering.moe_strategies import expert_parallel  # noqa: E402
from ilp_planner.lowering.strategies import Strategy  # noqa: E402
from ilp_planner.plan.audit import format_rows  # noqa: E402
from ilp_planner.plan.data import Plan  # noqa: E402
from ilp_planner.testing import restricted_plan  # noqa: E402
from runtime.apply import (  # noqa: E402
    audit,
    full_state_dict,
    full_value,
    load_full_state_dict,
    parallelize,
)
from runtime.dtensors import rank_grid  # noqa: E402
from runtime.errors import RuntimeSetupError  # noqa: E402
from runtime.recorder import Recorder  # noqa: E402
from runtime.tp_styles import tensor_parallel_mesh, to_parallelize_plan  # noqa: E402

VOCAB, SEQ, BATCH, CLASSES = 64, 8, 4, 10
MAX_NORM = 1.0  # gradients clipped every step (most steps clip: norms of 2 to 5 here)


@dataclass(frozen=True)
class Case:
    """A model to plan and train: its module, the batch it reads, the targets of its loss,
    and the strategies its plan may use (all if None: the solver's plan)."""

    model: nn.Module
    inputs: torch.Tensor | dict[str, torch.Tensor]  # a mapping: keyword inputs
    targets: torch.Tensor
    keep: Filter | None = None
    layouts: Callable[[int, int], Filter] | None = None  # ``keep`` for a cluster shape
    # relative tolerance of losses and state against one process: fp32's summation order,
    # or a bfloat16 module's (its 8-bit mantissa: a sum in another order moves the last bit)
    rtol: float = 1e-4
    atol: float = 1e-5  # of the state: bfloat16's ulp at the weights' magnitudes


def llama(tied: bool) -> Case:
    """LlamaForCausalLM with grouped-query attention (4 heads, 2 KV heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2 * SEQ, use_cache=False,
                      tie_word_embeddings=tied, attention_dropout=0.0)
    return Case(LlamaForCausalLM(cfg), *_tokens())


def bert() -> Case:
    """BertForMaskedLM, decoder untied from the word embeddings (word, position and
    token-type tables)."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=2 * SEQ,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     tie_word_embeddings=False)
    return Case(BertForMaskedLM(cfg), *_tokens())


def gpt2() -> Case:
    """GPT2LMHeadModel: HF ``Conv1D`` projections (weights stored ``(in, out)``), word and
    position tables, the head tied to the word table."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=2 * SEQ,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return Case(GPT2LMHeadModel(cfg), *_tokens())


def gpt2_dropout() -> Case:
    """GPT-2 with its default dropouts (0.1: embeddings, residual branches, and SDPA's on
    its probabilities, split over the batch and the heads): every rank draws each mask as
    one process does and keeps its block (:mod:`runtime.local_dropout`), so training matches
    one process drawing from the same generator."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=2 * SEQ,
                     use_cache=False)
    return Case(GPT2LMHeadModel(cfg), *_tokens())


def bert_eager_dropout() -> Case:
    """BERT's hand-written attention with its default dropouts (0.1: hidden, and
    ``F.dropout`` on the 4-D attention probabilities, a DTensor split over the batch and the
    heads)."""
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=2 * SEQ,
                     tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    return Case(BertForMaskedLM(cfg), *_tokens())


def roberta() -> Case:
    """RobertaForMaskedLM: its position ids computed from ``input_ids`` (a cumulative sum of
    the padding mask), so the one input tensor is read by the word table and by that
    functional code — the plan reads it in one layout."""
    from transformers import RobertaConfig, RobertaForMaskedLM

    cfg = RobertaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=2 * SEQ + 2, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return Case(RobertaForMaskedLM(cfg), *_tokens())


def olmo() -> Case:
    """OlmoForCausalLM: layer norms without gain or bias (no parameters at all)."""
    from transformers import OlmoConfig, OlmoForCausalLM

    cfg = OlmoConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4,
                     max_position_embeddings=2 * SEQ, use_cache=False)
    return Case(OlmoForCausalLM(cfg), *_tokens())


def convnext() -> Case:
    """ConvNextForImageClassification: each block's image permuted to channels-last for its
    layer norm and pointwise linears and back, a layer scale ``γ · x``."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    cfg = ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
                         num_labels=CLASSES)
    return Case(ConvNextForImageClassification(cfg), *_images(32))


def convnext_wide() -> Case:
    """ConvNeXt 16 / 32 channels wide: plans split its channels-first layer norms' tokens
    over both mesh axes. That norm permutes the image around ``nn.LayerNorm``, so it runs on
    DTensors, not on local blocks (whose features-last real shape it does not have)."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    cfg = ConvNextConfig(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                         num_labels=CLASSES)
    return Case(ConvNextForImageClassification(cfg), *_images(32))


def convnextv2() -> Case:
    """ConvNextV2ForImageClassification: GRN scales each block's flattened tokens by a
    per-image statistic (an opaque op)."""
    from transformers import ConvNextV2Config, ConvNextV2ForImageClassification

    cfg = ConvNextV2Config(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                           num_labels=CLASSES, drop_path_rate=0.0)
    return Case(ConvNextV2ForImageClassification(cfg), *_images(32))


def pvt() -> Case:
    """PvtForImageClassification: each attention's keys and values reduced by a strided
    convolution over its tokens laid back out as an image (``permute(0, 2, 1)``)."""
    from transformers import PvtConfig, PvtForImageClassification

    cfg = PvtConfig(image_size=32, hidden_sizes=[16, 32, 48, 64],
                    num_attention_heads=[1, 2, 2, 4], depths=[1, 1, 1, 1],
                    num_labels=CLASSES, drop_path_rate=0.0, hidden_dropout_prob=0.0,
                    attention_probs_dropout_prob=0.0)
    return Case(PvtForImageClassification(cfg), *_images(32))


def mobilevit() -> Case:
    """MobileViTForImageClassification: convolutions, and transformer blocks over patches
    unfolded from the image and folded back for the next convolution. In float64: its
    batch norms over 4 images of 1 or 2 pixels amplify float32's rounding past the
    tolerance (in float64 it agrees to 1e-10)."""
    from transformers import MobileViTConfig, MobileViTForImageClassification

    cfg = MobileViTConfig(image_size=32, hidden_sizes=[16, 24, 32],
                          neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32], num_labels=CLASSES,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                          classifier_dropout_prob=0.0)
    images, labels = _images(32)
    return Case(MobileViTForImageClassification(cfg).double(), images.double(), labels)


def mobilenet_v2() -> Case:
    """MobileNetV2ForImageClassification: TensorFlow-style padding computed in code before
    each strided convolution, depthwise convolutions, ReLU6, inverted residuals, a dropped
    out classifier. In float64, like MobileViT: its batch norms over 4 images of 1 pixel
    make float32 chaotic (one process in float32 and in float64 already differ by 0.2 % at
    the second step), and a clipped step in float64 must be torch's to the last bit."""
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    cfg = MobileNetV2Config(image_size=16, depth_multiplier=0.25, num_labels=CLASSES)
    images, labels = _images(16)
    return Case(MobileNetV2ForImageClassification(cfg).double(), images.double(), labels)


def beit() -> Case:
    """BeitForImageClassification: a learned relative position bias table per layer,
    looked up by an index buffer and added to the attention scores, layer scale on both
    residual branches, mean pooling."""
    from transformers import BeitConfig, BeitForImageClassification

    cfg = BeitConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, image_size=16, patch_size=4, num_labels=CLASSES,
                     use_relative_position_bias=True)
    return Case(BeitForImageClassification(cfg), *_images(16))


def mamba() -> Case:
    """MambaForCausalLM: selective-scan mixers (their input projection, causal convolution,
    scan and gate run whole on every device as opaque ops) between RMS norms, the head
    tied to the table."""
    from transformers import MambaConfig, MambaForCausalLM

    cfg = MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=VOCAB, state_size=8,
                      use_cache=False)
    return Case(MambaForCausalLM(cfg), *_tokens())


def gemma2() -> Case:
    """Gemma2ForCausalLM: its logits soft-capped (``tanh`` of the head's output, scaled)
    in functional code between the head and the module's return."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, max_position_embeddings=2 * SEQ, use_cache=False)
    return Case(Gemma2ForCausalLM(cfg), *_tokens())


def heads_split_norms(op: Op, s: Strategy) -> bool:
    """A per-head q / k norm (``attrs.group_width``) splits its heads 2 ways (the key /
    value heads' count), so its weight's gradient is summed over the heads axis too."""
    return "group_width" not in op.attrs or s.output.split_degree(1) == 2


def qwen3() -> Case:
    """Qwen3ForCausalLM: q and k normalised per head (``q_norm`` on the projection's
    ``(b, s, heads, head_dim)`` view), the norms' heads split 2 ways."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=2 * SEQ, use_cache=False)
    return Case(Qwen3ForCausalLM(cfg), *_tokens(), keep=heads_split_norms)


def gemma3() -> Case:
    """Gemma3ForCausalLM (text): per-head q / k norms on the ``(b, heads, s, head_dim)``
    value (transposed before the norm), gains ``1 + w``; the norms' heads split 2 ways."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=8, max_position_embeddings=2 * SEQ, use_cache=False)
    return Case(Gemma3ForCausalLM(cfg), *_tokens(), keep=heads_split_norms)


def opt() -> Case:
    """OPTForCausalLM: learned positions looked up by their own module and added to the
    word embeddings in its code (the importer folds that table into the word table's op)."""
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                    num_attention_heads=4, max_position_embeddings=2 * SEQ,
                    word_embed_proj_dim=32, use_cache=False, dropout=0.0,
                    attention_dropout=0.0)
    return Case(OPTForCausalLM(cfg), *_tokens())


def granite() -> Case:
    """GraniteForCausalLM: its embeddings scaled in the model's code (``inputs_embeds *
    embedding_multiplier``), between the embedding's boundary and the first layer's norm,
    which reads the product (a read through functional code, converted at the embedding's
    boundary with the residual's)."""
    from transformers import GraniteConfig, GraniteForCausalLM

    cfg = GraniteConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=2 * SEQ, embedding_multiplier=2.0,
                        use_cache=False)
    return Case(GraniteForCausalLM(cfg), *_tokens())


def gemma() -> Case:
    """GemmaForCausalLM: its embeddings scaled by √hidden inside the embedding's own module
    (before its boundary)."""
    from transformers import GemmaConfig, GemmaForCausalLM

    cfg = GemmaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=2 * SEQ, use_cache=False)
    return Case(GemmaForCausalLM(cfg), *_tokens())


def embedding_converted(make: Callable[[], Case]) -> Callable[[], Case]:
    """``make``'s model planned with its word table's columns split (its output split over
    the hidden dim, no partial sums): the norms and the residual read whole rows, so the
    embedding's boundary converts its output for them."""
    def keep(op: Op, s: Strategy) -> bool:
        return op.kind is not OpKind.EMBEDDING or (
            s.output.split_degree(1) > 1 and not drop_unit_axes(s.output).has_partial)

    return lambda: dataclasses.replace(make(), keep=keep)


def gpt2_gelu_after_conversion() -> Case:
    """GPT-2 planned with each ``c_fc`` splitting its output's columns and each ``c_proj``
    reading whole rows (column-parallel: its input gradient partial sums): the GELU module
    between them runs in the model's code on ``c_fc``'s output, which no functional code
    reads, so ``c_proj``'s own boundary converts the GELU's result and its backward resolves
    the partial gradient before the GELU's backward reads it."""
    def keep(op: Op, s: Strategy) -> bool:
        if op.name.endswith("mlp.c_fc"):
            return s.output.split_degree(1) > 1 and not drop_unit_axes(s.output).has_partial
        return not op.name.endswith("mlp.c_proj") or s.inputs[0].split_degree(1) == 1

    return dataclasses.replace(gpt2(), keep=keep)


def vit() -> Case:
    """ViTForImageClassification: patch convolution, class token and position table, a
    classifier on the class token."""
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, image_size=16, patch_size=4, num_labels=CLASSES,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return Case(ViTForImageClassification(cfg), *_images(16))


def resnet() -> Case:
    """ResNetForImageClassification: bias-free convolutions, batch norms, in-place residual
    adds (``out += identity``)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                       num_labels=CLASSES)
    return Case(ResNetForImageClassification(cfg), *_images(32))


def resnet_batch_split(both: bool) -> Callable[[], Case]:
    """ResNet with every batch norm splitting its batch (synchronised batch norm,
    :mod:`runtime.local_batchnorm`): data parallel over all 4 devices, or (``both``) the
    solver's best plan among those whose batch norms split the batch and the channels at
    once, over two mesh axes."""
    def bn_splits(op: Op, s: Strategy) -> bool:
        return op.kind is not OpKind.BATCHNORM or (
            s.output.split_degree(0) > 1 and (s.output.split_degree(1) > 1) == both)

    def on(nodes: int, devices: int) -> Filter:
        if both:
            return bn_splits
        dp = data_parallel_filter(MeshAxis(nodes, devices))
        return lambda op, s: dp(op, s) and bn_splits(op, s)

    def case() -> Case:
        c = resnet()
        return Case(c.model, c.inputs, c.targets, layouts=on)
    return case


def running_stats_differ(plan: Plan, model: nn.Module, reference: nn.Module) -> list[str]:
    """Batch norms whose running mean or variance, on this rank's channels (the block it
    updates), differ from one process's."""
    graph, out = load_config(plan.config).graph, []
    layers = {ly.name: ly for ly in plan.layers}
    for op in graph.ops:
        if op.kind is not OpKind.BATCHNORM:
            continue
        path = op.source_params[0].rsplit(".", 1)[0]
        lo, hi = layers[op.name].output.regions(op.output.shape)[dist.get_rank()][1]
        mine, ref = model.get_submodule(path), reference.get_submodule(path)
        for buf in ("running_mean", "running_var"):
            a, b = getattr(mine, buf)[lo:hi], getattr(ref, buf)[lo:hi]
            if not torch.allclose(a, b, rtol=1e-4, atol=1e-5):
                out.append(f"{path}.{buf}[{lo}:{hi}] differs by {float((a - b).abs().max())}")
    return out


def saved_state_differs(model: nn.Module, reference: nn.Module, rtol: float = 1e-4,
                        atol: float = 1e-5) -> list[str]:
    """Entries of the applied module's whole state (:func:`full_state_dict`: Phi-3's fused
    ``gate_up_proj``, held interleaved, in its own column order; a channel-split batch
    norm's running statistics from every rank's channels) that differ from one process's
    after training, or from rank to rank; and entries that loading a state
    (:func:`load_full_state_dict`: a perturbed copy, then the state itself) does not set."""
    out = []
    state = full_state_dict(model)
    for name, want in reference.state_dict().items():
        got = state[name]
        if got.shape != want.shape or not torch.allclose(got.double(), want.double(),
                                                         rtol=rtol, atol=atol):
            out.append(f"full_state_dict()[{name!r}] differs from one process's"
                       + (f" by {float((got.double() - want.double()).abs().max()):.3g}"
                          if got.shape == want.shape else "")
                       + (f" (shape {tuple(got.shape)})" if got.shape != want.shape else ""))
    sums = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(sums, sum(v.double().sum() for v in state.values()).reshape(1))
    if len({float(x) for x in sums}) > 1:
        out.append(f"full_state_dict() differs between ranks: sums {[float(x) for x in sums]}")
    moved = {n: v + 1 if v.is_floating_point() else v for n, v in state.items()}
    for loaded in (moved, state):
        load_full_state_dict(model, loaded)
        back = full_state_dict(model)
        out += [f"load_full_state_dict did not set {n}" for n, v in loaded.items()
                if not torch.equal(back[n], v)]
    return out


def t5(attention: str = "sdpa") -> Case:
    """T5ForConditionalGeneration: keyword inputs (``input_ids``, ``decoder_input_ids``),
    relative position biases (an embedding of bucketed distances, SDPA's mask in every
    self-attention of its stack: :mod:`runtime.applied_bias`), encoder and decoder stacks
    looking up one shared table, the head tied to it (two tied copies of the table).
    ``attention="eager"``: Hugging Face's hand-written attention, which adds the bias to
    its scores (:mod:`runtime.local_attention` adds each rank's block)."""
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8,
                   dropout_rate=0.0, use_cache=False)
    cfg._attn_implementation = attention
    ids, targets = _tokens()
    return Case(T5ForConditionalGeneration(cfg), {"input_ids": ids,
                                                  "decoder_input_ids": _tokens()[0]}, targets)


def phi3() -> Case:
    """Phi3ForCausalLM: its MLP's fused ``gate_up_proj`` cut into gate and up by ``chunk``
    (``part`` ops: each device's gate and up columns match, :mod:`runtime.fused_parts`), its
    attention's fused ``qkv_proj`` sliced into q, k and v (batch splits only)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    cfg = Phi3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=2 * SEQ, pad_token_id=0, eos_token_id=1,
                     bos_token_id=1, use_cache=False, attention_dropout=0.0,
                     resid_pdrop=0.0, embd_pdrop=0.0)
    return Case(Phi3ForCausalLM(cfg), *_tokens())


def falcon() -> Case:
    """FalconForCausalLM, multi-query: one ``query_key_value`` viewed ``(B, T, heads + 2,
    D)``, q's heads sliced and the key and value heads picked by list indexing (folded
    copies, the attention splitting the batch), linears computing ``x @ W.T``."""
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                       num_attention_heads=4, use_cache=False, attention_dropout=0.0,
                       hidden_dropout=0.0)
    return Case(FalconForCausalLM(cfg), *_tokens())


def phi3_gate_up_split() -> Case:
    """Phi-3 with every fused ``gate_up_proj`` splitting its columns 4 ways (each device's
    16 gate columns and the matching 16 up columns) and each ``down_proj`` its rows."""
    def keep(op: Op, s: Strategy) -> bool:
        if op.name.endswith("gate_up_proj"):
            return s.output.split_degree(1) == 4
        return True

    return dataclasses.replace(phi3(), keep=keep)


def _images(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, 3, size, size), torch.randint(0, CLASSES, (BATCH,))


def whisper() -> Case:
    """WhisperForConditionalGeneration: mel features through two convolutions, its encoder's
    sinusoidal position table shipped frozen (``requires_grad=False``: held, never
    synchronised or updated — ``attrs.frozen``), a decoder reading the encoder's output by
    cross-attention, the head tied to the decoder's table."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4,
                        encoder_ffn_dim=64, decoder_ffn_dim=64, d_model=32,
                        max_source_positions=SEQ, max_target_positions=2 * SEQ,
                        use_cache=False, dropout=0.0, attention_dropout=0.0,
                        activation_dropout=0.0, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, decoder_start_token_id=1)
    ids, targets = _tokens()
    return Case(WhisperForConditionalGeneration(cfg),
                {"input_features": torch.randn(BATCH, 8, 2 * SEQ), "decoder_input_ids": ids},
                targets)


def llama_lora() -> Case:
    """A LoRA fine-tuning of Llama: every weight frozen, adapters (:class:`LoRALinear`) on
    each block's query and value projections trained — the frozen base held alone, its
    input gradients computed through it to the adapters below."""
    from tests.helpers.user_models import LoRALinear

    case = llama(tied=False)
    for p in case.model.parameters():
        p.requires_grad_(False)
    for layer in case.model.model.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)
    return case


def gpt2_frozen_lower() -> Case:
    """GPT-2 with its first block frozen: its copy of each repeated op is planned apart
    from the trained block's (no gradient synchronisation there, one here)."""
    case = gpt2()
    for p in case.model.transformer.h[0].parameters():
        p.requires_grad_(False)
    return case


def bert_frozen_encoder() -> Case:
    """BERT's embeddings and encoder frozen, its masked-LM head trained: nothing below the
    head takes a gradient, so no backward runs there at all."""
    case = bert()
    for p in case.model.bert.parameters():
        p.requires_grad_(False)
    return case


def llama_bf16() -> Case:
    """Llama loaded in bfloat16, trained as it is (no float32 copy): its gradients reduced
    in bfloat16 as the plan prices them (``attrs.own_precision``; they were priced in
    float32, the audit's bytes half the plan's)."""
    case = llama(tied=False)
    return dataclasses.replace(case, model=case.model.to(torch.bfloat16), rtol=2e-2,
                               atol=1e-2)


def gpt2_bf16() -> Case:
    """GPT-2 in bfloat16: its head's tied exchange in bfloat16 too."""
    case = gpt2()
    return dataclasses.replace(case, model=case.model.to(torch.bfloat16), rtol=2e-2,
                               atol=1e-2)


def bart() -> Case:
    """BartForConditionalGeneration trained to reconstruct its input: one tensor of ids
    handed to the encoder and the decoder (two inputs of the plan, each read by its own
    table), learned positions, the head tied to the shared table."""
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                     decoder_ffn_dim=64, max_position_embeddings=2 * SEQ, dropout=0.0,
                     attention_dropout=0.0, activation_dropout=0.0, use_cache=False,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    ids, targets = _tokens()
    return Case(BartForConditionalGeneration(cfg),
                {"input_ids": ids, "decoder_input_ids": ids}, targets)


def granitemoe() -> Case:
    """GraniteMoeForCausalLM: 4 experts, top-2, its router held as ``router`` (not ``gate``)
    and weighting the top-k by a softmax over their logits (Mixtral's renormalised top-k)."""
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    cfg = GraniteMoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=2 * SEQ, num_local_experts=4,
                           num_experts_per_tok=2, use_cache=False)
    return Case(GraniteMoeForCausalLM(cfg), *_tokens())


def dropout_on_constants() -> Case:
    """A user's dropout module called on a constant between its planned calls
    (:class:`tests.helpers.user_models.DropoutOnConstants`): that call is no op's."""
    from tests.helpers.user_models import DropoutOnConstants

    return Case(DropoutOnConstants(VOCAB, 32), *_tokens())


def gated_probabilities() -> Case:
    """Hand-written attention whose probabilities a learned per-head gate scales
    (:class:`tests.helpers.user_models.GatedProbabilities`): an opaque op, not a mask."""
    from tests.helpers.user_models import GatedProbabilities

    return Case(GatedProbabilities(VOCAB, 32), *_tokens())


def no_grad_scaled() -> Case:
    """A user's model computing a scale under ``torch.no_grad()``
    (:class:`tests.helpers.user_models.NoGradScaled`): the region is imported as the
    detached values it makes, its ops run on the module's DTensors."""
    from tests.helpers.user_models import NoGradScaled

    return Case(NoGradScaled(VOCAB, 32), *_tokens())


def _translation(config: str, model: str, **fields) -> Case:
    """A tiny encoder-decoder translating its input (``bart``'s sizes)."""
    import transformers

    cfg = getattr(transformers, config)(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=2 * SEQ, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, use_cache=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, **fields)
    ids, targets = _tokens()
    return Case(getattr(transformers, model)(cfg),
                {"input_ids": ids, "decoder_input_ids": ids}, targets)


def marian() -> Case:
    """MarianMTModel: frozen sinusoidal position tables added to trained word embeddings
    (an op of their own), its own decoder vocabulary."""
    return _translation("MarianConfig", "MarianMTModel", decoder_vocab_size=VOCAB)


def pegasus() -> Case:
    """PegasusForConditionalGeneration: frozen sinusoidal positions, pre-norm layers."""
    return _translation("PegasusConfig", "PegasusForConditionalGeneration")


def convbert() -> Case:
    """ConvBertForMaskedLM: span-based dynamic convolutions beside attention, a depthwise
    ``nn.Conv1d`` reading the tokens transposed (the copy named in its module's path)."""
    from transformers import ConvBertConfig, ConvBertForMaskedLM

    cfg = ConvBertConfig(vocab_size=VOCAB, hidden_size=32, embedding_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=2 * SEQ, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
    return Case(ConvBertForMaskedLM(cfg), *_tokens())


def roformer() -> Case:
    """RoFormerForMaskedLM: one frozen sinusoidal table (an ``nn.Embedding``'s weight) read
    by every layer's rotary code; layer 0's ``mul`` owns it, later layers fold it into
    their attention's input steps."""
    from transformers import RoFormerConfig, RoFormerForMaskedLM

    cfg = RoFormerConfig(vocab_size=VOCAB, hidden_size=32, embedding_size=32,
                         intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         max_position_embeddings=2 * SEQ, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
    return Case(RoFormerForMaskedLM(cfg), *_tokens())


def focalnet() -> Case:
    """FocalNetForImageClassification: focal modulation (depthwise convolutions, gates) and
    a head pooling its tokens' transpose with ``nn.AdaptiveAvgPool1d`` (``as_strided`` in
    its backward)."""
    from transformers import FocalNetConfig, FocalNetForImageClassification

    cfg = FocalNetConfig(image_size=32, embed_dim=16, depths=[1, 1], num_labels=CLASSES,
                         drop_path_rate=0.0, hidden_dropout_prob=0.0)
    return Case(FocalNetForImageClassification(cfg), *_images(32))


def swin() -> Case:
    """SwinForImageClassification: window attention (SDPA) whose mask adds a relative
    position bias table — a bare parameter of its own module (``SwinRelativePositionBias``)
    indexed at constant positions — and, in shifted windows, a constant mask; patch merging
    between the stages."""
    from transformers import SwinConfig, SwinForImageClassification

    cfg = SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 1],
                     num_heads=[2, 4], window_size=4, num_labels=CLASSES,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                     drop_path_rate=0.0)
    return Case(SwinForImageClassification(cfg), *_images(32))


def mpnet() -> Case:
    """MPNetForMaskedLM: one relative position bias (an embedding of bucketed distances)
    computed by the encoder, expanded over the batch and added to every layer's
    hand-written attention scores."""
    from transformers import MPNetConfig, MPNetForMaskedLM

    cfg = MPNetConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=2 * SEQ + 2, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0)
    ids, targets = _tokens()
    return Case(MPNetForMaskedLM(cfg), ids, targets)


def deberta() -> Case:
    """DebertaForMaskedLM: its own layer norm module adds its bias in its forward, an op of
    its own apart from the norm's; ``in_proj`` makes q, k and v at once, with separate q and
    v biases added in the attention's code."""
    from transformers import DebertaConfig, DebertaForMaskedLM

    cfg = DebertaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=2 * SEQ + 2, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    return Case(DebertaForMaskedLM(cfg), *_tokens())


def _two_tower_classifier(config: str, model: str) -> Case:
    """A two-tower (image, text) model's image classifier on 16 × 16 images, its vision
    tower 2 layers deep."""
    import transformers

    tower = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4)
    cfg = getattr(transformers, config)(
        vision_config=dict(image_size=16, patch_size=4, num_hidden_layers=2, **tower),
        text_config=dict(vocab_size=VOCAB, num_hidden_layers=1, **tower), num_labels=CLASSES)
    return Case(getattr(transformers, model)(cfg), *_images(16))


def clip_vision() -> Case:
    """CLIPForImageClassification: the vision tower's ``post_layernorm`` runs on the class
    token, which the classifier (reading the mean of the other tokens) never reads — an
    unused op, its parameters given no gradient."""
    return _two_tower_classifier("CLIPConfig", "CLIPForImageClassification")


def siglip() -> Case:
    """SiglipForImageClassification: the classifier reads the mean of the vision tower's
    tokens; its attention-pooling head (``nn.MultiheadAttention``: functional ``F.linear``
    on the same tokens) reaches no loss — unused ops, computed whole."""
    return _two_tower_classifier("SiglipConfig", "SiglipForImageClassification")


def fnet() -> Case:
    """FNetForMaskedLM: token mixing by a 2-D FFT (an opaque op, replicated) in a module
    returning ``(output,)``."""
    from transformers import FNetConfig, FNetForMaskedLM

    cfg = FNetConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, max_position_embeddings=2 * SEQ,
                     hidden_dropout_prob=0.0, use_tpu_fourier_optimizations=False)
    return Case(FNetForMaskedLM(cfg), *_tokens())


def modernbert() -> Case:
    """ModernBertForMaskedLM: fused ``Wqkv``, a GLU MLP (``Wi`` chunked into input and
    gate), no biases, and local sliding-window attention (a window of 4) in every layer but
    each second's global one."""
    from transformers import ModernBertConfig, ModernBertForMaskedLM

    cfg = ModernBertConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                           num_hidden_layers=3, num_attention_heads=4,
                           max_position_embeddings=2 * SEQ, global_attn_every_n_layers=2,
                           local_attention=4, pad_token_id=0, bos_token_id=1,
                           eos_token_id=2, cls_token_id=1, sep_token_id=2, mlp_dropout=0.0,
                           attention_dropout=0.0, embedding_dropout=0.0)
    return Case(ModernBertForMaskedLM(cfg), *_tokens())


def lfm2() -> Case:
    """Lfm2ForCausalLM: a gated short convolution block (a depthwise causal ``Conv1d``
    between two projections) beside an attention block with per-head q / k norms."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    cfg = Lfm2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=2 * SEQ, use_cache=False,
                     layer_types=["conv", "full_attention"])
    return Case(Lfm2ForCausalLM(cfg), *_tokens())


class PooledClassifier(nn.Module):
    """A backbone returning a ``pooler_output`` (a Hugging Face ``*Model``) under a linear
    classifier: a fine-tuning's head."""

    def __init__(self, backbone: nn.Module, width: int):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x).pooler_output)


def dinov3() -> Case:
    """DINOv3's ViT under a classifier: a class token and register tokens joined to the
    patches, rotary positions on the patches alone, layer scale. Its training-time jitter
    of the rotary coordinates (``pos_embed_rescale``) is off: a random draw in the
    forward, which one process and the ranks would each draw their own of."""
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    cfg = DINOv3ViTConfig(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_register_tokens=2,
                          pos_embed_rescale=None)
    return Case(PooledClassifier(DINOv3ViTModel(cfg), 32), *_images(16))


def minimax() -> Case:
    """MiniMaxForCausalLM: lightning (linear) attention in blocks — ``q @ kᵀ`` decayed and
    multiplied by ``v`` without a softmax, a state carried across blocks, an RMS norm and
    an output gate — beside a softmax attention layer, and Mixtral's MoE."""
    from transformers import MiniMaxConfig, MiniMaxForCausalLM

    cfg = MiniMaxConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, max_position_embeddings=2 * SEQ, use_cache=False,
                        num_local_experts=4, num_experts_per_tok=2, block_size=4,
                        layer_types=["linear_attention", "full_attention"])
    return Case(MiniMaxForCausalLM(cfg), *_tokens())


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ))


def titan_llama() -> Case:
    """A Llama written by hand the way torchtitan's is (complex rotary, ``ModuleDict``
    blocks, ``repeat_interleave`` GQA: :class:`tests.helpers.user_models.TitanLlama`)."""
    from tests.helpers.user_models import TitanLlama

    model = TitanLlama(VOCAB, dim=32, layers=2, heads=4, kv_heads=2, hidden=64, max_seq=SEQ)
    return Case(model, *_tokens())


def llama_tied_exchanging() -> Case:
    """Tied Llama whose table is whole on every device while its head splits the vocabulary
    4 ways: the tied exchange gathers the head's gradient and cuts the table."""
    def keep(op: Op, s: Strategy) -> bool:
        if op.name == "model.embed_tokens":
            return s.weight is not None and s.weight.split_degree(0) == s.weight.split_degree(1) == 1
        if op.name == "lm_head":
            return s.weight is not None and s.weight.split_degree(1) == 4
        return True

    case = llama(tied=True)
    return Case(case.model, case.inputs, case.targets, keep)


def t5_tied_exchanging() -> Case:
    """T5 whose encoder's table is whole on every device while the decoder's lookup splits
    the vocabulary 4 ways: the tied exchange between two embeddings moves data (the
    decoder's gradient gathered, the table's block cut back)."""
    def keep(op: Op, s: Strategy) -> bool:
        if op.name in ("encoder.embed_tokens", "decoder.embed_tokens"):
            want = 1 if op.name == "encoder.embed_tokens" else 4
            return s.weight is not None and s.weight.split_degree(0) == want \
                and s.weight.split_degree(1) == 1
        return True

    case = t5()
    return Case(case.model, case.inputs, case.targets, keep)


def megatron_layouts(sequence_parallel: bool) -> Callable[[int, int], Filter]:
    """Megatron's (or Megatron-SP's) layouts on every ``dp × tp`` mesh of a cluster shape
    with both axes larger than 1 (the baselines' :func:`megatron_filter`): attention splits
    the batch over one axis and the heads over the other."""
    def on(nodes: int, devices: int) -> Filter:
        keeps = [megatron_filter(a, b, sequence_parallel)
                 for a, b in mesh_factorisations(nodes, devices, 2) if a.size > 1 and b.size > 1]
        return lambda op, s: any(k(op, s) for k in keeps)
    return on


def megatron(make: Callable[[], Case], sequence_parallel: bool = False) -> Callable[[], Case]:
    """``make``'s model planned in Megatron's layouts (data × tensor parallel)."""
    def case() -> Case:
        c = make()
        return Case(c.model, c.inputs, c.targets, layouts=megatron_layouts(sequence_parallel))
    return case


def expert_parallel_only(op: Op, s: Strategy) -> bool:
    """Every MoE block exchanges its tokens over a mesh axis (AllToAlls the audit counts)."""
    return op.kind is not OpKind.MOE or (expert_parallel(s.inputs[0]) and s.fact[1].size > 1)


def experts_sliced_only(op: Op, s: Strategy) -> bool:
    """Every MoE block keeps its tokens and slices its experts over a mesh axis."""
    return op.kind is not OpKind.MOE or (not expert_parallel(s.inputs[0]) and s.fact[1].size > 1)


def mixtral(keep: Filter) -> Case:
    """MixtralForCausalLM: 4 experts, top-2 (the importer's one ``moe`` op per block)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=2 * SEQ, num_local_experts=4,
                        num_experts_per_tok=2, use_cache=False)
    return Case(MixtralForCausalLM(cfg), *_tokens(), keep)


def qwen2_moe() -> Case:
    """Qwen2MoeForCausalLM: 4 experts, top-2 without renormalising, a gated shared expert
    (dense linears beside the ``moe`` op)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         moe_intermediate_size=16, shared_expert_intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2 * SEQ, num_experts=4, num_experts_per_tok=2,
                         use_cache=False)
    return Case(Qwen2MoeForCausalLM(cfg), *_tokens(), expert_parallel_only)


def gpt_oss(keep: Filter | None = None) -> Case:
    """GptOssForCausalLM: 4 experts, top-2 (a biased router, its softmax over the top-k
    logits; experts with biases, gate and up columns alternating, a clamped GLU), attention
    with learned sinks, sliding-window and full layers alternating. The biases are drawn
    (Hugging Face zeroes them), so that one added on every rank of a partial sum shows."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=8, max_position_embeddings=2 * SEQ, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=4, use_cache=False,
                       layer_types=["sliding_attention", "full_attention"])
    model = GptOssForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.model.layers:
            for b in (layer.mlp.router.bias, layer.mlp.experts.gate_up_proj_bias,
                      layer.mlp.experts.down_proj_bias):
                b.normal_(0, 0.5)
    return Case(model, *_tokens(), keep)


def hunyuan_moe() -> Case:
    """HunYuanMoEV1ForCausalLM: 4 experts, top-2, the router's weight held by a linear
    (``gate.wg``), a shared MLP beside the experts, per-head query and key norms; the
    experts parallel."""
    from transformers import HunYuanMoEV1Config, HunYuanMoEV1ForCausalLM

    cfg = HunYuanMoEV1Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=16,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=8, max_position_embeddings=2 * SEQ, num_experts=4,
                             moe_topk=2, use_cache=False, pad_token_id=0, bos_token_id=1,
                             eos_token_id=2)
    return Case(HunYuanMoEV1ForCausalLM(cfg), *_tokens(), expert_parallel_only)


def hunyuan_moe_bf16() -> Case:
    """HunYuan-MoE in bfloat16 as ``from_pretrained`` loads it: its routers stay float32
    (built so), and read the tokens in float32."""
    case = hunyuan_moe()
    model = case.model.to(torch.bfloat16)
    for layer in model.model.layers:
        layer.mlp.gate.wg.float()
    return dataclasses.replace(case, model=model, rtol=2e-2, atol=1e-2)


def _drawn_correction_biases(model: nn.Module) -> nn.Module:
    """``model`` with its blocks' correction biases drawn (zero as built, which would hide
    a bias the routing ignored)."""
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(layer.mlp, "e_score_correction_bias", None)
            if bias is not None:
                bias.uniform_(-0.3, 0.3)
    return model


def minimax_m2() -> Case:
    """MiniMaxM2ForCausalLM: sigmoid routing, its correction bias a buffer of the block
    handed to the router (drawn), the weights renormalised; the experts parallel."""
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    cfg = MiniMaxM2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=16,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=8, max_position_embeddings=2 * SEQ, num_local_experts=4,
                          num_experts_per_tok=2, use_cache=False, pad_token_id=0,
                          bos_token_id=1, eos_token_id=2)
    return Case(_drawn_correction_biases(MiniMaxM2ForCausalLM(cfg)), *_tokens(),
                expert_parallel_only)


def hy_v3() -> Case:
    """HYV3ForCausalLM: a dense first layer, then sigmoid routing with the block's
    correction bias (drawn), renormalised and scaled by ``router_scaling_factor``, a float32
    router, a shared expert; the experts sliced."""
    from transformers import HYV3Config, HYV3ForCausalLM

    cfg = HYV3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                     moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, max_position_embeddings=2 * SEQ,
                     num_experts=4, num_experts_per_tok=2, num_shared_experts=1,
                     mlp_layer_types=["dense", "sparse"], use_cache=False, pad_token_id=0,
                     bos_token_id=1, eos_token_id=2)
    return Case(_drawn_correction_biases(HYV3ForCausalLM(cfg)), *_tokens(), experts_sliced_only)


def lfm2_moe() -> Case:
    """Lfm2MoeForCausalLM: a dense first layer (a gated short convolution), then attention
    and routed experts (the activation the function ``F.silu``, sigmoid routing with the
    block's ``expert_bias``, drawn; the router drawn too — Hugging Face zeroes it); the
    experts parallel."""
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    cfg = Lfm2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=2 * SEQ,
                        num_experts=4, num_experts_per_tok=2, num_dense_layers=1,
                        layer_types=["conv", "full_attention"], use_cache=False)
    model = Lfm2MoeForCausalLM(cfg)
    with torch.no_grad():
        block = model.model.layers[1].feed_forward
        block.expert_bias.uniform_(-0.3, 0.3)
        block.gate.weight.normal_(0.0, 0.2)
    return Case(model, *_tokens(), expert_parallel_only)


def apertus() -> Case:
    """ApertusForCausalLM: xIELU activations, which compute both branches and pick per
    element (``where(x > 0, …, …)``) with learned scales on each (bfloat16 parameters in a
    float32 model), per-head q / k norms, no gated MLP."""
    from transformers import ApertusConfig, ApertusForCausalLM

    cfg = ApertusConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, max_position_embeddings=2 * SEQ, use_cache=False,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return Case(ApertusForCausalLM(cfg), *_tokens())


def gptj() -> Case:
    """GPTJForCausalLM: attention and MLP in parallel on one normed input, rotary on a
    part of each head (``rotary_dim`` 4 of 8), a biased head."""
    from transformers import GPTJConfig, GPTJForCausalLM

    cfg = GPTJConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                     n_positions=2 * SEQ, use_cache=False)
    return Case(GPTJForCausalLM(cfg), *_tokens())


def gpt_neo() -> Case:
    """GPTNeoForCausalLM: global and local (windowed) attention layers alternating,
    unscaled scores."""
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    cfg = GPTNeoConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                       attention_types=[[["global", "local"], 1]], window_size=4,
                       max_position_embeddings=2 * SEQ, use_cache=False)
    return Case(GPTNeoForCausalLM(cfg), *_tokens())


def dots1() -> Case:
    """Dots1ForCausalLM: a dense first layer, then routed experts (sigmoid scores with a
    correction bias, DeepSeek-V3's router) beside a shared expert."""
    from transformers import Dots1Config, Dots1ForCausalLM

    cfg = Dots1Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, max_position_embeddings=2 * SEQ, moe_intermediate_size=16,
                      n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                      first_k_dense_replace=1, n_group=1, topk_group=1, use_cache=False)
    return Case(Dots1ForCausalLM(cfg), *_tokens())


def codegen() -> Case:
    """CodeGenForCausalLM: one fused ``qkv_proj`` whose columns its code regroups in four
    model-parallel blocks before splitting q, k and v, rotary on a part of each head,
    attention and MLP in parallel on one normed input."""
    from transformers import CodeGenConfig, CodeGenForCausalLM

    cfg = CodeGenConfig(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, rotary_dim=4,
                        n_positions=2 * SEQ, n_ctx=2 * SEQ, use_cache=False)
    return Case(CodeGenForCausalLM(cfg), *_tokens())


MLA_FIELDS = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
                  v_head_dim=8)
"""Multi-head latent attention's ranks and head dims, small."""


def minicpm3() -> Case:
    """MiniCPM3ForCausalLM: multi-head latent attention (a low-rank query, a compressed
    key / value), its embeddings and residual branches scaled in the model's code."""
    from transformers import MiniCPM3Config, MiniCPM3ForCausalLM

    cfg = MiniCPM3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=2 * SEQ, use_cache=False, **MLA_FIELDS)
    return Case(MiniCPM3ForCausalLM(cfg), *_tokens())


def _mla_moe(name: str) -> Callable[[], Case]:
    """``<name>ForCausalLM`` (GLM-4-MoE-Lite, Mistral 4): multi-head latent attention, a
    dense first layer, then DeepSeek-V3's sigmoid router with its correction bias (drawn)
    beside a shared expert."""
    def make() -> Case:
        import transformers

        cfg = getattr(transformers, f"{name}Config")(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2 * SEQ,
            moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
            use_cache=False, **MLA_FIELDS)
        model = getattr(transformers, f"{name}ForCausalLM")(cfg)
        with torch.no_grad():
            for path, bias in model.named_buffers():
                if path.endswith("e_score_correction_bias"):
                    bias.uniform_(-0.3, 0.3)
        return Case(model, *_tokens())

    return make


def qwen3_5() -> Case:
    """Qwen3_5ForCausalLM, hybrid: a Gated DeltaNet layer (its recurrence, causal
    convolution — ``causal_conv1d_fn`` on its ``conv1d`` module's weight, in the layer's
    code — and gated norm opaque, its ``dt_bias`` added to a linear's output in that code),
    then full attention (queries projected twice as wide, their second half gating the
    output; rotary on a part of each head; per-head q / k norms)."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=8, max_position_embeddings=2 * SEQ, use_cache=False,
                            linear_key_head_dim=8, linear_value_head_dim=8,
                            linear_num_key_heads=2, linear_num_value_heads=4,
                            layer_types=["linear_attention", "full_attention"])
    return Case(Qwen3_5ForCausalLM(cfg), *_tokens())


def mixtral_v3_router() -> Case:
    """Mixtral routed by DeepSeek-V3's routers (sigmoid scores plus a drawn correction bias
    — a buffer —, the best 1 of 2 expert groups, the weights renormalised and scaled by 2.5),
    the experts parallel: V3's routing under ``parallelize`` without its multi-head latent
    attention, which ``parallelize`` cannot split (the key states are written in place into
    a ``new_empty`` tensor, an opaque op)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    case = mixtral(expert_parallel_only)
    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=4, num_experts_per_tok=2,
                           n_group=2, topk_group=1, routed_scaling_factor=2.5,
                           norm_topk_prob=True)
    for layer in case.model.model.layers:
        gate = DeepseekV3TopkRouter(cfg)
        with torch.no_grad():
            gate.weight.copy_(layer.mlp.gate.weight)
            gate.e_score_correction_bias.copy_(0.05 * torch.randn(4))
        layer.mlp.gate = gate
    return case


def deepseek_v2() -> Case:
    """DeepseekV2ForCausalLM: multi-head latent attention (low-rank KV, no q LoRA), layer 0
    dense, layer 1 routed (4 experts, top-2, one shared expert, greedy softmax routing)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=2 * SEQ, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, topk_method="greedy", n_group=1,
        topk_group=1, routed_scaling_factor=1.0, use_cache=False)
    return Case(DeepseekV2ForCausalLM(cfg), *_tokens())


def deepseek_v3() -> Case:
    """DeepseekV3ForCausalLM: MLA with a low-rank query (q_a_proj → norm → q_b_proj), layer
    0 dense, layer 1 routed by sigmoid scores plus a drawn correction bias, the best of two
    expert groups, weights renormalised and scaled by 2.5."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=2 * SEQ, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6, use_cache=False)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(4))
    return Case(model, *_tokens())


def deepseek_v32() -> Case:
    """DeepseekV32ForCausalLM: DeepSeek-V3's layers with its sparse attention — a lightning
    indexer (its own projections, key norm and per-head weights, opaque ops) scores the
    keys, and a mask keeping each query's top 4 of 8 joins the causal mask SDPA reads. The
    mask, built from the opaque ops' output, lives on their flattened mesh."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    cfg = DeepseekV32Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=2 * SEQ, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, kv_lora_rank=16, q_lora_rank=8,
        qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=6, index_topk=SEQ // 2,
        index_head_dim=8, index_n_heads=4, use_cache=False)
    model = DeepseekV32ForCausalLM(cfg)
    with torch.no_grad():
        model.model.layers[1].mlp.gate.e_score_correction_bias.copy_(0.05 * torch.randn(4))
    return Case(model, *_tokens())


def deepseek_v2_heads_split() -> Case:
    """DeepSeek-V2 planned with MLA's heads split 4 ways and ``kv_a_proj_with_mqa`` split
    over the batch: the latent columns' copy reads that projection's output as it is, the
    attention reads its shared rotary part whole — one value reaching functional code in two
    layouts, which no module boundary can serve."""
    def keep(op: Op, s: Strategy) -> bool:
        if op.name.endswith("kv_a_proj_with_mqa"):
            return s.output.split_degree(0) == 4
        return op.kind is not OpKind.ATTENTION or s.output.split_degree(1) == 4

    return dataclasses.replace(deepseek_v2(), keep=keep)


REFUSED: dict[str, tuple[Callable[[], Case], str]] = {
    "deepseek-v2-refused": (deepseek_v2_heads_split,
                            "'model.layers.0.self_attn.kv_a_proj_with_mqa' feeds functional "
                            "code in two layouts"),
}
"""Plans ``parallelize`` refuses up front, and what the refusal must name."""


def check_refused(name: str, nodes: int, devices: int, steps: int) -> list[str]:
    """``parallelize`` refuses the model's plan naming the op, and leaves the module as it
    was: no forward swapped (an imported MoE's), no hook installed, no parameter placed."""
    make, names = REFUSED[name]
    torch.manual_seed(0)
    case = make()
    plan = plan_on_rank0(lambda: solve(case, nodes, devices))
    try:
        parallelize(plan, case.model)
    except RuntimeSetupError as exc:
        if names not in str(exc):
            return [f"refused without naming {names!r}: {exc}"]
        message = str(exc)
    else:
        return ["parallelize accepted a plan it cannot run"]
    touched = [path or "<root>" for path, m in case.model.named_modules()
               if "forward" in vars(m) or m._forward_hooks or m._forward_pre_hooks]
    placed = [n for n, p in case.model.named_parameters() if isinstance(p, DTensor)]
    if touched or placed:
        return [f"refused late: forwards or hooks on {touched[:3]}, parameters placed "
                f"{placed[:3]}"]
    if dist.get_rank() == 0:
        print(f"OK {name} {message}", flush=True)
    return []


MODELS: dict[str, Callable[[], Case]] = {
    "llama": lambda: llama(tied=False),
    "llama-tied": lambda: llama(tied=True),
    "llama-tied-exchanging": llama_tied_exchanging,
    "bert": bert,
    "roberta": roberta,
    "olmo": olmo,
    "convnext": convnext,
    "convnext-wide": convnext_wide,
    "convnextv2": convnextv2,
    "pvt": pvt,
    "mobilevit": mobilevit,
    "gemma2": gemma2,
    "qwen3": qwen3,
    "gemma3": gemma3,
    "opt": opt,
    "granite-embedding-converted": embedding_converted(granite),
    "gemma-embedding-converted": embedding_converted(gemma),
    "gpt2-gelu-after-conversion": gpt2_gelu_after_conversion,
    "gpt2": gpt2,
    "gpt2-dropout": gpt2_dropout,
    "bert-eager-dropout": bert_eager_dropout,
    "vit": vit,
    "resnet": resnet,
    "resnet-data-parallel": resnet_batch_split(both=False),
    "resnet-batch-and-channels": resnet_batch_split(both=True),
    "llama-megatron": megatron(lambda: llama(tied=False)),
    "llama-megatron-sp": megatron(lambda: llama(tied=False), sequence_parallel=True),
    "titan-llama": titan_llama,
    "titan-llama-megatron-sp": megatron(titan_llama, sequence_parallel=True),
    "bert-megatron-sp": megatron(bert, sequence_parallel=True),
    "gpt2-megatron": megatron(gpt2),
    "mixtral": lambda: mixtral(expert_parallel_only),
    "mixtral-sliced": lambda: mixtral(experts_sliced_only),
    "qwen2-moe": qwen2_moe,
    "t5": t5,
    "t5-tied-exchanging": t5_tied_exchanging,
    "t5-eager": lambda: t5("eager"),
    "mixtral-v3-router": mixtral_v3_router,
    "gpt-oss": gpt_oss,
    "gpt-oss-expert-parallel": lambda: gpt_oss(expert_parallel_only),
    "gpt-oss-sliced": lambda: gpt_oss(experts_sliced_only),
    "hunyuan-moe": hunyuan_moe,
    "hunyuan-moe-bf16": hunyuan_moe_bf16,
    "apertus": apertus,
    "minimax-m2": minimax_m2,
    "hy-v3": hy_v3,
    "lfm2-moe": lfm2_moe,
    "gptj": gptj,
    "gpt-neo": gpt_neo,
    "dots1": dots1,
    "codegen": codegen,
    "minicpm3": minicpm3,
    "glm4-moe-lite": _mla_moe("Glm4MoeLite"),
    "mistral4": _mla_moe("Mistral4"),
    "qwen3.5": qwen3_5,
    "deepseek-v2": deepseek_v2,
    "deepseek-v3": deepseek_v3,
    "deepseek-v3.2": deepseek_v32,
    "mobilenet-v2": mobilenet_v2,
    "beit": beit,
    "mamba": mamba,
    "phi3": phi3,
    "phi3-gate-up-split": phi3_gate_up_split,
    "falcon": falcon,
    "whisper": whisper,
    "llama-lora": llama_lora,
    "gpt2-frozen-lower": gpt2_frozen_lower,
    "bert-frozen-encoder": bert_frozen_encoder,
    "llama-bf16": llama_bf16,
    "gpt2-bf16": gpt2_bf16,
    "bart": bart,
    "granitemoe": granitemoe,
    "no-grad-scaled": no_grad_scaled,
    "marian": marian,
    "pegasus": pegasus,
    "convbert": convbert,
    "roformer": roformer,
    "focalnet": focalnet,
    "swin": swin,
    "mpnet": mpnet,
    "deberta": deberta,
    "clip-vision": clip_vision,
    "siglip": siglip,
    "dropout-on-constants": dropout_on_constants,
    "gated-probabilities": gated_probabilities,
    "fnet": fnet,
    "modernbert": modernbert,
    "lfm2": lfm2,
    "dinov3": dinov3,
    "minimax": minimax,
}


def cluster(nodes: int, devices: int) -> dict:
    """A slow interconnect for tiny models, so plans split weights, not only the batch."""
    return {"nodes": nodes, "devices_per_node": devices, "memory_gib": 16, "peak_tflops": 1,
            "links": {"intra": {"latency_us": 1, "bandwidth_gbps": 10},
                      "inter": {"latency_us": 2, "bandwidth_gbps": 5}}}


def loss_of(output, targets: torch.Tensor) -> torch.Tensor:
    """The user's loss on the model's own output (its ``logits`` where it returns a
    structure): cross-entropy per token (language models) or per image (classifiers)."""
    logits = output.logits if hasattr(output, "logits") else output
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten())


def example(inputs: torch.Tensor | dict[str, torch.Tensor]) -> tuple | dict:
    """``from_module``'s example inputs: a tensor as the one positional input, a mapping
    as keyword inputs."""
    return inputs if isinstance(inputs, dict) else (inputs,)


def forward(model: nn.Module, inputs: torch.Tensor | dict[str, torch.Tensor]):
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def plan_on_rank0(make: Callable[[], Plan]) -> Plan:
    """One plan for every rank: solved on rank 0, broadcast."""
    box: list = [None]
    if dist.get_rank() == 0:
        try:
            box = [make().to_dict()]
        except Exception as exc:  # every rank raises it, none waits for a plan
            box = [f"rank 0 could not plan: {type(exc).__name__}: {exc}"]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise RuntimeError(box[0])
    return Plan.from_dict(box[0])


def solve(case: Case, nodes: int, devices: int) -> Plan:
    """The solver's plan for ``case``, or the best one among the strategies it keeps."""
    graph = ilp_planner.from_module(case.model, example(case.inputs))
    keep = case.layouts(nodes, devices) if case.layouts is not None else case.keep
    if keep is None:
        return ilp_planner.solve(graph, cluster=cluster(nodes, devices), baselines=False)
    config = load_config({"model": graph, "cluster": cluster(nodes, devices)})
    return restricted_plan(config, keep)


def check(name: str, nodes: int, devices: int, steps: int) -> list[str]:
    """This rank's differences from one process and from the plan (empty: all agree)."""
    torch.manual_seed(0)
    case = MODELS[name]()
    case.model.train()
    reference = copy.deepcopy(case.model)
    plan = plan_on_rank0(lambda: solve(case, nodes, devices))
    model = parallelize(plan, case.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    failures = []
    exchanged: set[str] = set()  # purposes of the AllToAlls the audit matched
    synced: set[str] = set()  # phases of the batch norms' statistics AllReduces matched
    for step in range(steps):
        # the second step accumulates two backwards (each reduced, as DDP does; the second
        # outside the audit, which counts one backward's collectives)
        passes = 2 if step == 1 else 1
        drawn = torch.get_rng_state()  # one process draws the same dropout masks
        rec = Recorder(dist.get_world_size())
        with rec:
            loss = loss_of(forward(model, case.inputs), case.targets)
            (loss / passes).backward()
        for _ in range(passes - 1):
            (loss_of(forward(model, case.inputs), case.targets) / passes).backward()
        norm = float(ilp_planner.clip_grad_norm_(model, MAX_NORM))
        opt.step()
        opt.zero_grad(set_to_none=step != 0)  # zeros kept once: set aside like a reduced one
        torch.set_rng_state(drawn)
        ref = loss_of(forward(reference, case.inputs), case.targets)
        (ref / passes).backward()
        for _ in range(passes - 1):
            (loss_of(forward(reference, case.inputs), case.targets) / passes).backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM))
        ref_opt.step()
        ref_opt.zero_grad()
        mine, want = float(full_value(loss)), float(ref)
        if abs(mine - want) > case.rtol * max(1.0, abs(want)):
            failures.append(f"step {step}: loss {mine} vs single-process {want}")
        if abs(norm - ref_norm) > case.rtol * max(1.0, ref_norm):
            failures.append(f"step {step}: gradient norm {norm} vs single-process {ref_norm}")
        rows = audit(plan, dist.get_rank(), rec.events)
        if not all(r.ok for r in rows):
            failures.append(format_rows(dist.get_rank(), rows))
        exchanged |= {r.purpose for r in rows if r.kind == "all_to_all" and r.executed_count}
        synced |= {r.phase for r in rows if r.purpose == "batchnorm" and r.executed_count}
    failures += running_stats_differ(plan, model, reference)
    failures += saved_state_differs(model, reference, case.rtol, case.atol)
    if dist.get_rank() == 0 and not failures:
        a2a = f" all_to_all={','.join(sorted(exchanged))}" if exchanged else ""
        bn = f" batchnorm={','.join(sorted(synced))}" if synced else ""
        print(f"OK {name} {describe(plan)}{a2a}{bn}", flush=True)
    return failures


def describe(plan: Plan) -> str:
    """The plan's strategies, rank grids (``grids=`` lists each mesh's ranks in DeviceMesh
    order: ``0,2,1,3`` is a mesh whose first axis walks a node's devices) and how many
    attention layers split their batch and their heads at once (``dp×tp-attention=``)."""
    kinds = sorted({ly.strategy for ly in plan.layers if not ly.strategy.startswith("follows")})
    world = dist.get_world_size()
    grids = sorted({",".join(str(r) for r in rank_grid(lay.fact, world).ravel())
                    for ly in plan.layers for lay in (*ly.inputs, ly.output) if lay is not None})
    graph = load_config(plan.config).graph
    both = sum(1 for ly in plan.layers if graph[ly.name].kind is OpKind.ATTENTION
               and ly.output.split_degree(0) > 1 and ly.output.split_degree(1) > 1)
    heads = sum(1 for ly in plan.layers if "group_width" in graph[ly.name].attrs
                and ly.output.split_degree(1) > 1)
    return (f"{' '.join(kinds)} grids={' '.join(grids)} dp×tp-attention={both} "
            f"heads-split-norms={heads}")


def megatron_plan(case: Case, nodes: int, devices: int) -> Plan:
    """The best plan in Megatron's layouts on a 2 (data) × 2 (tensor) mesh, for PyTorch's
    styles: imported without ``dtensor`` (the styles run the module on local tensors, so
    attention may split the batch and the heads at once)."""
    graph = ilp_planner.from_module(case.model, example(case.inputs), dtensor=False)
    config = load_config({"model": graph, "cluster": cluster(nodes, devices)})
    return restricted_plan(config, megatron_filter(MeshAxis(1, 2), MeshAxis(1, 2)))


TP_STYLES = ("llama", "gpt2")
"""Models whose Megatron plan also trains through ``parallelize_module`` (``--tp-styles``):
GPT-2's ``Conv1D`` layers and its head tied to the word table take
:mod:`runtime.planned_styles`."""


def check_tp_styles(name: str, nodes: int, devices: int, steps: int) -> list[str]:
    """``to_parallelize_plan`` of a Megatron plan through ``parallelize_module``: each data-
    parallel rank trains on its block of the batch (gradients averaged over ``mesh["dp"]``)
    and the mean of their losses matches one process on the whole batch."""
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    case = MODELS[name]()
    reference = copy.deepcopy(case.model)
    plan = plan_on_rank0(lambda: megatron_plan(case, nodes, devices))
    mesh = tensor_parallel_mesh(plan)
    model = parallelize_module(case.model, mesh["tp"], to_parallelize_plan(plan))
    if len(list(model.parameters())) != len(list(reference.parameters())):
        return ["the styles split a parameter the module shares (a tied table) in two"]
    dp, dp_group = mesh["dp"].size(), mesh["dp"].get_group()
    rows = slice(mesh["dp"].get_local_rank() * BATCH // dp,
                 (mesh["dp"].get_local_rank() + 1) * BATCH // dp)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    failures = []
    for step in range(steps):
        loss = loss_of(model(case.inputs[rows]), case.targets[rows])
        loss.backward()
        for p in model.parameters():
            grad = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(grad, group=dp_group)
            grad /= dp
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp_group)
        ref = loss_of(forward(reference, case.inputs), case.targets)
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if abs(float(mean) / dp - float(ref)) > 1e-4 * max(1.0, abs(float(ref))):
            failures.append(f"step {step}: loss {float(mean) / dp} vs single-process "
                            f"{float(ref)}")
    if dist.get_rank() == 0 and not failures:
        print(f"OK tp-styles-{name} {len(to_parallelize_plan(plan))} styles", flush=True)
    return failures


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=[*MODELS, *REFUSED])
    ap.add_argument("--shape", default="1x4", help="NODESxDEVICES_PER_NODE")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--tp-styles", action="store_true",
                    help="also train Llama's and GPT-2's Megatron plans through "
                         "parallelize_module")
    args = ap.parse_args()
    nodes, devices = (int(v) for v in args.shape.split("x"))
    dist.init_process_group("gloo")
    failed = 0
    runs = [(check_refused if name in REFUSED else check, name, name) for name in args.models]
    runs += [(check_tp_styles, name, f"tp-styles-{name}") for name in TP_STYLES
             ] if args.tp_styles else []
    for run, name, label in runs:
        try:
            failures = run(name, nodes, devices, args.steps)
        except Exception as exc:  # one model's failure is reported, the next model runs
            failures = [f"{type(exc).__name__}: {exc}"]
            if os.environ.get("HF_CHECK_TRACEBACK"):
                traceback.print_exc()
        flag = torch.tensor([len(failures)])
        dist.all_reduce(flag)
        if failures:
            print(f"FAIL {label} (rank {dist.get_rank()}): " + "\n".join(failures), flush=True)
        failed += int(flag) > 0
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    # gloo's worker threads, torn down during interpreter finalisation, abort a process now
    # and then after all work is done: leave without finalising, as runtime.launch does
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
