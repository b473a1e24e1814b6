"""Helpers of the importer's pricing tests: tiny Hugging Face language models (random
weights, never downloaded) — GPT-2 with its eager attention, Mixtral or Llama in bf16 — and
the closed-form price of the steps folded into ops."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import transformers as T
from torch import nn

from ilp_planner.ir.device import DeviceSpec
from ilp_planner.ir.graph import Op


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


def folded_seconds(ops: Iterable[Op], device: DeviceSpec) -> float:
    """The roofline price of the steps folded into ``ops`` (``attrs.input_steps*``): their
    bytes, forward and backward, at the device's achieved memory bandwidth, plus a kernel
    floor each."""
    rate = device.hbm_bytes_per_s * device.fit.memory_efficiency
    return sum((op.attrs["input_steps_bytes"] + op.attrs["input_steps_bwd_bytes"]) / rate
               + (op.attrs["input_steps"] + op.attrs["input_steps_bwd"])
               * device.fit.kernel_floor_s for op in ops)
