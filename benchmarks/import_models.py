"""Models users bring, at their real sizes: Hugging Face classes built from their published
configs on the meta device (no weights, no memory), imported with ``ilp_planner.from_module``,
solved on 8 × 8 H100 80 GB in bf16 with Adam, side by side with every baseline.

    python benchmarks/import_models.py [MODEL …]     # default: all of them

One row per model: parameters, import seconds, ops, opaque ops and their share of the
predicted step, solve seconds, status, gap, the plan's step time, and each baseline family's
step time as a ratio to the plan's (> 1: the plan is faster; ``n/a`` with the reason below the
table). VGG13 is the planner's own builder (no Hugging Face class). The target: each solves
optimal (gap ≤ 0.1 %) in under 30 s.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers as hf

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ilp_planner  # noqa: E402
from ilp_planner.inputs.models import vgg13  # noqa: E402
from ilp_planner.intra_op.request import PhaseTimes  # noqa: E402
from ilp_planner.ir.graph import Graph, OpKind  # noqa: E402
from ilp_planner.plan.data import baseline_seconds  # noqa: E402
from ilp_planner.reports.explain import opaque_share, step_seconds  # noqa: E402

CLUSTER = {  # catalogue figures: NCCL's collective model and the roofline compute model
    "gpu": "h100", "nodes": 8, "devices_per_node": 8, "intra": "nvlink4",
    "inter": "8x-ib-ndr400",
}
TRAINING = {"optimizer": "adam_mixed"}
SOLVER = {"tie_layers": True, "gap": 0.001, "time_limit_s": 60}
BASELINES = ("data_parallel", "megatron", "megatron_sp", "summa", "torchtitan")
TARGET_S = 30.0


def _lm(config: hf.PretrainedConfig, cls: type, batch: int, seq: int) -> tuple:
    config.use_cache = False
    with torch.device("meta"):
        return cls(config).to(torch.bfloat16), (torch.zeros(batch, seq, dtype=torch.long),)


def _images(config: hf.PretrainedConfig, cls: type, batch: int, size: int) -> tuple:
    with torch.device("meta"):
        return (cls(config).to(torch.bfloat16),
                (torch.zeros(batch, 3, size, size, dtype=torch.bfloat16),))


MODELS: dict[str, Callable[[], tuple]] = {
    "llama-3-8b": lambda: _lm(hf.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192),
        hf.LlamaForCausalLM, 64, 2048),
    "gpt2-xl": lambda: _lm(hf.GPT2Config(n_embd=1600, n_layer=48, n_head=25, vocab_size=50257,
                                         n_positions=1024), hf.GPT2LMHeadModel, 256, 1024),
    "bert-large": lambda: _lm(hf.BertConfig(hidden_size=1024, intermediate_size=4096,
                                            num_hidden_layers=24, num_attention_heads=16),
                              hf.BertForMaskedLM, 256, 512),
    "vit-b-16": lambda: _images(hf.ViTConfig(hidden_size=768, intermediate_size=3072,
                                             num_hidden_layers=12, num_attention_heads=12,
                                             image_size=224, patch_size=16, num_labels=1000),
                                hf.ViTForImageClassification, 256, 224),
    "resnet-50": lambda: _images(hf.ResNetConfig(embedding_size=64,
                                                 hidden_sizes=[256, 512, 1024, 2048],
                                                 depths=[3, 4, 6, 3], layer_type="bottleneck",
                                                 num_labels=1000),
                                 hf.ResNetForImageClassification, 256, 224),
}


def _graph(name: str) -> tuple[Graph, int, float]:
    """The model's graph, its parameter count and the import seconds."""
    if name == "vgg13":
        t0 = time.perf_counter()
        graph = vgg13(batch=256, dtype="bfloat16")
        return graph, graph.total_params, time.perf_counter() - t0
    module, inputs = MODELS[name]()
    t0 = time.perf_counter()
    graph = ilp_planner.from_module(module, inputs, name=name)
    return graph, sum(p.numel() for p in module.parameters()), time.perf_counter() - t0


def _cells(plan) -> tuple[list[str], list[str]]:
    """Each baseline family's ratio to the plan, and the reasons of those that did not price."""
    mine, cells, notes = step_seconds(plan), [], []
    for family in BASELINES:
        hits = [(k, v) for k, v in plan.baselines.items() if k.split("(", 1)[0] == family]
        if not hits:
            cells.append("—")
        elif "error" in hits[0][1]:
            cells.append("n/a")
            notes.append(f"  {plan.name} {hits[0][0]}: {hits[0][1]['error'][:160]}")
        else:
            cells.append(f"{baseline_seconds(hits[0][1]) / mine:.2f}×")
    return cells, notes


def main(names: list[str]) -> None:
    head = (f"{'model':<12}{'params':>15}{'import s':>9}{'ops':>6}{'opaque':>7}{'op. share':>10}"
            f"{'solve s':>9}{'status':>10}{'gap':>9}{'step s':>10}"
            + "".join(f"{b:>15}" for b in BASELINES))
    print(head)
    print("-" * len(head))
    notes: list[str] = []
    for name in names:
        graph, params, import_s = _graph(name)
        opaque = sum(op.kind is OpKind.OPAQUE for op in graph.ops)
        t0 = time.perf_counter()
        times = PhaseTimes()
        plan = ilp_planner.solve(graph, cluster=CLUSTER, training=TRAINING, solver=SOLVER,
                                 name=name, times=times)
        solve_s = time.perf_counter() - t0
        notes.append(f"  {name}: solve {solve_s:.1f} s = plan {times.solve_s:.1f} s + "
                     f"baselines {times.baselines_s:.1f} s")
        cells, why = _cells(plan)
        notes += why
        gap = plan.solver.gap
        print(f"{name:<12}{params:>15,}{import_s:>9.1f}{len(graph):>6}{opaque:>7}"
              f"{opaque_share(plan):>10.1%}{solve_s:>9.1f}{plan.solver.status:>10}"
              f"{'n/a' if gap is None else f'{gap:.2%}':>9}{step_seconds(plan):>10.4g}"
              + "".join(f"{c:>15}" for c in cells), flush=True)
    print(f"\ntarget: optimal (gap ≤ 0.1 %) in < {TARGET_S:.0f} s; ratio = baseline step / plan step")
    for line in notes:
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:] or [*MODELS, "vgg13"])
