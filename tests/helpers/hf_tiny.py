"""Tiny Hugging Face language models (random weights, never downloaded) for the importer's
pricing tests: GPT-2 with its eager attention, and Mixtral or Llama in bf16."""

from __future__ import annotations

import torch
import transformers as T
from torch import nn


def tiny_hf(name: str) -> nn.Module:
    """``gpt2``, ``mixtral`` or (anything else) ``llama``, 2 layers of width 32."""
    small = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64,
             "max_position_embeddings": 16, "use_cache": False}
    if name == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(
            n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16, resid_pdrop=0,
            embd_pdrop=0, attn_pdrop=0, use_cache=False, attn_implementation="eager"))
    if name == "mixtral":
        return T.MixtralForCausalLM(T.MixtralConfig(
            **small, num_local_experts=4, num_experts_per_tok=2)).to(torch.bfloat16)
    return T.LlamaForCausalLM(T.LlamaConfig(**small)).to(torch.bfloat16)
