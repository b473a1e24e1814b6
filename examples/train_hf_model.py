"""Plan and train a Hugging Face model — a model users bring, as it comes.

    torchrun --nproc-per-node 4 examples/train_hf_model.py [--steps 5] [--nodes 2] [--audit]

Builds ``LlamaForCausalLM`` from a small config (grouped-query attention, input and output
embeddings tied, random weights: nothing is downloaded), imports it
(:func:`ilp_planner.from_module`), solves a plan for the job's ranks once on rank 0 and
broadcasts it, applies it (``ilp_planner.parallelize``) and trains with a plain loop on the
model's own output (``out.logits``, a plain tensor where the plan hands the loss whole
logits). Every rank also trains an unsharded copy on the same batch: the losses must agree
(fp32, 1e-4), and ``--audit`` prints, per step, the collectives the plan prices beside
those the program issued. ``--nodes 2`` plans for two nodes of half the ranks each, whose
meshes need not be row-major views of the ranks. Exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

import ilp_planner
from ilp_planner.plan.audit import format_rows
from ilp_planner.plan.data import Plan
from runtime.apply import audit, full_value
from runtime.recorder import Recorder

VOCAB = 128


def model() -> LlamaForCausalLM:
    """A tiny Llama: 4 query heads sharing 2 key/value heads, tied embeddings, no dropout."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=True, use_cache=False,
                      attention_dropout=0.0)
    return LlamaForCausalLM(cfg)


def cluster(nodes: int, devices: int) -> dict:
    """A slow interconnect for the model's size, so that the plan splits weights."""
    return {"nodes": nodes, "devices_per_node": devices, "memory_gib": 16, "peak_tflops": 1,
            "links": {"intra": {"latency_us": 1, "bandwidth_gbps": 10},
                      "inter": {"latency_us": 2, "bandwidth_gbps": 5}}}


def loss_of(output, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--audit", action="store_true")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same initial model and batch on every rank
    llama = model()
    ids = torch.randint(0, VOCAB, (4, 16))
    targets = torch.randint(0, VOCAB, (4, 16))
    reference = copy.deepcopy(llama)

    box = [None]
    if rank == 0:  # one solve, one plan for every rank
        graph = ilp_planner.from_module(llama, (ids,))
        box = [ilp_planner.solve(graph, cluster=cluster(args.nodes, world // args.nodes),
                                 baselines=False).to_dict()]
    dist.broadcast_object_list(box, src=0)
    plan = Plan.from_dict(box[0])
    if rank == 0:
        kinds = sorted({ly.strategy for ly in plan.layers if not ly.strategy.startswith("follows")})
        print(f"plan: {plan.cost.total_s * 1e3:.3f} ms per step (modelled); strategies "
              f"{', '.join(kinds)}")

    llama = ilp_planner.parallelize(plan, llama)
    opt = torch.optim.AdamW(llama.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    ok = True
    for step in range(args.steps):
        rec = Recorder(world)
        with rec:
            loss = loss_of(llama(ids), targets)
            loss.backward()
        # torch's clip_grad_norm_ refuses gradients on several device meshes; this one
        # reduces each mesh's share and clips as torch does
        ilp_planner.clip_grad_norm_(llama, 1.0)
        opt.step()
        opt.zero_grad()
        ref_loss = loss_of(reference(ids), targets)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        mine = float(full_value(loss))
        rows = audit(plan, rank, rec.events)
        same = abs(mine - float(ref_loss)) <= 1e-4 * max(1.0, abs(float(ref_loss)))
        ok = ok and same and all(r.ok for r in rows)
        if rank == 0:
            print(f"step {step}: loss {mine:.6f}  single-process {float(ref_loss):.6f}"
                  f"  {'match' if same else 'DIFFER'}")
            if args.audit:
                print(format_rows(rank, rows))
    flags = torch.tensor([0 if ok else 1])
    dist.all_reduce(flags)
    if rank == 0:
        print("all ranks: losses match and executed = planned" if int(flags) == 0
              else f"{int(flags)} rank(s) saw a mismatch")
    dist.barrier()
    dist.destroy_process_group()
    return 1 if int(flags) else 0


if __name__ == "__main__":
    code = main()
    # gloo's worker threads, torn down during interpreter finalisation, abort a process now
    # and then after all work is done: leave without finalising, as runtime.launch does
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
