"""Plan and train your own PyTorch model — the user's path end to end.

    torchrun --nproc-per-node 8 examples/train_own_model.py [--steps 5] [--audit]

Defines a small language model as any PyTorch user would (``nn.Embedding``, ``nn.LayerNorm``,
``nn.Linear``, SDPA attention), imports it (:func:`ilp_planner.from_module`), solves a plan
for the job's ranks, applies it (``ilp_planner.parallelize``) and trains with a plain loop. Every
rank also trains an unsharded copy of the model on the same batch: the losses must agree
(fp32, 1e-4), and ``--audit`` prints, per step, the collectives the plan prices beside those
the program issued (counted at dispatch level, DTensor's included). Exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import ilp_planner
from ilp_planner.plan.audit import format_rows
from ilp_planner.plan.data import Plan
from runtime.apply import audit, full_value
from runtime.recorder import Recorder


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, self.heads, c // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)),
                                           is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64, heads: int = 4, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def cluster(devices: int) -> dict:
    """One node of ``devices`` GPUs with a slow interconnect for their speed, so that the plan
    mixes data, tensor and 3-D parallelism (several mesh shapes) on this tiny model."""
    return {"nodes": 1, "devices_per_node": devices, "memory_gib": 16, "peak_tflops": 1,
            "links": {"intra": {"latency_us": 1, "bandwidth_gbps": 10},
                      "inter": {"latency_us": 1, "bandwidth_gbps": 10}}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--audit", action="store_true")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same initial model and batch on every rank
    model = TinyLM()
    ids = torch.randint(0, 128, (2, 16))
    targets = torch.randint(0, 128, (2, 16))
    reference = copy.deepcopy(model)

    graph = ilp_planner.from_module(model, (ids,))
    box = [ilp_planner.solve(graph, cluster=cluster(world), baselines=False).to_dict()
           if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)  # one plan for every rank
    plan = Plan.from_dict(box[0])
    if rank == 0:
        kinds = sorted({ly.strategy for ly in plan.layers if not ly.strategy.startswith("follows")})
        print(f"plan: {plan.cost.total_s * 1e3:.3f} ms per step (modelled); strategies "
              f"{', '.join(kinds)}")

    model = ilp_planner.parallelize(plan, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ok = True
    for step in range(args.steps):
        rec = Recorder(world)
        with rec:
            loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = F.cross_entropy(reference(ids).flatten(0, 1), targets.flatten())
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine, single = float(full_value(loss)), ref_loss.item()
        rows = audit(plan, rank, rec.events)
        same = abs(mine - single) <= 1e-4 * max(1.0, abs(single))
        ok = ok and same and all(r.ok for r in rows)
        if rank == 0:
            print(f"step {step}: loss {mine:.6f}  single-process {single:.6f}"
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
    # and then after all work is done ("terminate called without an active exception"):
    # leave without finalising, as runtime.launch does
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
