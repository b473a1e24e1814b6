"""Which Hugging Face architectures import and solve: tiny configs of each (random weights,
never downloaded) imported with ``ilp_planner.from_module`` and solved on 2 × 4 devices.

    python benchmarks/hf_architectures.py [NAME …]     # default: all of them

One row per architecture: import and solve seconds, ops, opaque ops (kept replicated,
priced by torch's own count) and their share of the predicted step, the solver's status,
or the one-line error where it fails. A compatibility sweep, not a test: the models that
also train under ``parallelize`` like one process are in ``tests/test_hf_parallelize.py``
(and ``tests/helpers/hf_apply_check.py``); the ones at their real sizes, with every
baseline, in ``benchmarks/import_models.py``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers as hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ilp_planner  # noqa: E402
from ilp_planner.ir.graph import OpKind  # noqa: E402
from ilp_planner.reports.explain import opaque_share  # noqa: E402

CLUSTER = {"nodes": 2, "devices_per_node": 4, "memory_gib": 16, "peak_tflops": 10,
           "links": {"intra": {"latency_us": 5, "bandwidth_gbps": 100},
                     "inter": {"latency_us": 10, "bandwidth_gbps": 10}}}
VOCAB = 64
SMALL = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "vocab_size": VOCAB, "max_position_embeddings": 16}


def _ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8))


def _images(size: int) -> torch.Tensor:
    return torch.randn(2, 3, size, size)


def _lm(cls: str, config: str, **extra: Any) -> Callable[[], tuple[Any, Any]]:
    """A causal LM of ``SMALL`` size reading token ids."""
    return lambda: (getattr(hf, cls)(getattr(hf, config)(**{**SMALL, "use_cache": False,
                                                             **extra})), (_ids(),))


def _encoder(cls: str, config: str, **extra: Any) -> Callable[[], tuple[Any, Any]]:
    """A masked LM of ``SMALL`` size reading token ids."""
    return lambda: (getattr(hf, cls)(getattr(hf, config)(**{**SMALL, **extra})), (_ids(),))


MODELS: dict[str, Callable[[], tuple[Any, Any]]] = {
    "qwen2": _lm("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2),
    "qwen3": _lm("Qwen3ForCausalLM", "Qwen3Config", num_key_value_heads=2, head_dim=8),
    "mistral": _lm("MistralForCausalLM", "MistralConfig", num_key_value_heads=2),
    "gemma": _lm("GemmaForCausalLM", "GemmaConfig", num_key_value_heads=2, head_dim=8),
    "gemma2": _lm("Gemma2ForCausalLM", "Gemma2Config", num_key_value_heads=2, head_dim=8),
    "gemma3": _lm("Gemma3ForCausalLM", "Gemma3TextConfig", num_key_value_heads=2, head_dim=8),
    "phi": _lm("PhiForCausalLM", "PhiConfig"),
    "phi3": _lm("Phi3ForCausalLM", "Phi3Config", num_key_value_heads=2, pad_token_id=0,
                eos_token_id=1, bos_token_id=1),
    "olmo": _lm("OlmoForCausalLM", "OlmoConfig"),
    "olmo2": _lm("Olmo2ForCausalLM", "Olmo2Config"),
    "olmoe": _lm("OlmoeForCausalLM", "OlmoeConfig", num_experts=4, num_experts_per_tok=2),
    "granite": _lm("GraniteForCausalLM", "GraniteConfig"),
    "gpt_neox": _lm("GPTNeoXForCausalLM", "GPTNeoXConfig"),
    "opt": lambda: (hf.OPTForCausalLM(hf.OPTConfig(
        hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=VOCAB, max_position_embeddings=16, word_embed_proj_dim=32,
        use_cache=False)), (_ids(),)),
    "bloom": lambda: (hf.BloomForCausalLM(hf.BloomConfig(
        hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB, use_cache=False)), (_ids(),)),
    "falcon": lambda: (hf.FalconForCausalLM(hf.FalconConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
        use_cache=False)), (_ids(),)),
    "gptj": lambda: (hf.GPTJForCausalLM(hf.GPTJConfig(
        n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=16, rotary_dim=4,
        bos_token_id=0, eos_token_id=0, use_cache=False)), (_ids(),)),
    "gpt_neo": lambda: (hf.GPTNeoForCausalLM(hf.GPTNeoConfig(
        hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]],
        vocab_size=VOCAB, max_position_embeddings=16, use_cache=False)), (_ids(),)),
    "roberta": _encoder("RobertaForMaskedLM", "RobertaConfig",
                        max_position_embeddings=18),
    "xlm_roberta": _encoder("XLMRobertaForMaskedLM", "XLMRobertaConfig",
                            max_position_embeddings=18),
    "electra": _encoder("ElectraForMaskedLM", "ElectraConfig", embedding_size=32),
    "distilbert": lambda: (hf.DistilBertForMaskedLM(hf.DistilBertConfig(
        dim=32, hidden_dim=64, n_layers=2, n_heads=4, vocab_size=VOCAB,
        max_position_embeddings=16)), (_ids(),)),
    "mobilebert": lambda: (hf.MobileBertForMaskedLM(hf.MobileBertConfig(
        hidden_size=32, embedding_size=16, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=16,
        intra_bottleneck_size=16, true_hidden_size=16)), (_ids(),)),
    "bart": lambda: (hf.BartForConditionalGeneration(hf.BartConfig(
        d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
        max_position_embeddings=16, use_cache=False)),
        {"input_ids": _ids(), "decoder_input_ids": _ids()}),
    "clip_text": lambda: (hf.CLIPTextModel(hf.CLIPTextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        vocab_size=VOCAB, max_position_embeddings=16)), (_ids(),)),
    "convnext": lambda: (hf.ConvNextForImageClassification(hf.ConvNextConfig(
        num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], num_labels=10)), (_images(64),)),
    "swin": lambda: (hf.SwinForImageClassification(hf.SwinConfig(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
        window_size=4, num_labels=10)), (_images(32),)),
    "deit": lambda: (hf.DeiTForImageClassification(hf.DeiTConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        image_size=16, patch_size=4, num_labels=10)), (_images(16),)),
}


def row(name: str) -> str:
    """One architecture's line: imported, solved, or where it stops."""
    torch.manual_seed(0)
    t0 = time.perf_counter()
    try:
        model, inputs = MODELS[name]()
        model.eval()
        graph = ilp_planner.from_module(model, inputs)
        t1 = time.perf_counter()
        plan = ilp_planner.solve(graph, cluster=CLUSTER, baselines=False)
    except Exception as exc:  # noqa: BLE001 - the sweep reports whatever stops a model
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"{name:12s} fails: {type(exc).__name__}: {first[:150]}"
    t2 = time.perf_counter()
    opaque = sum(op.kind is OpKind.OPAQUE for op in graph.ops)
    return (f"{name:12s} {t1 - t0:7.1f} {t2 - t1:7.1f} {len(graph.ops):5d} {opaque:7d} "
            f"{opaque_share(plan):7.1%}  {plan.solver.status}")


def main() -> None:
    names = sys.argv[1:] or list(MODELS)
    print(f"{'model':12s} {'import':>7s} {'solve':>7s} {'ops':>5s} {'opaque':>7s} "
          f"{'share':>7s}  status")
    for name in names:
        print(row(name), flush=True)


if __name__ == "__main__":
    main()
