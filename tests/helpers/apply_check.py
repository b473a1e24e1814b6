"""torchrun script: a user's module trained under ``ilp_planner.parallelize`` matches the same
module trained in one process, and the collectives it issues are the plan's.

    torchrun --nproc-per-node N tests/helpers/apply_check.py MODEL [--steps 3]

MODEL: ``mlp`` (the runtime's MLP module with biases; a cluster that makes the plan split
weights, so biases are added to partial sums), ``llama`` (a Llama block stack: RMSNorm,
rotary embeddings, grouped-query SDPA, SwiGLU) or ``twin`` (two followers in functional
code reading one linear's output — one shared value —, planned with that linear
row-parallel so the value's partial sums are resolved once for both:
:func:`row_parallel_proj`) or ``coded`` (a ReLU following a linear applied in functional
code: nothing may move between them) or ``head_T`` (a head on a parameter's ``.T`` in the
module's own code) or ``encoder`` (PyTorch's ``nn.TransformerEncoderLayer``: its
attention's functional linear and its residual add read one value) or ``odd_batch`` (a
Llama block on a batch of 3: its rows split by divisors of 3 only) or ``weight_norm`` (a
weight-normed linear, whose backward DTensor has no rule for, run replicated) or ``relu6``
(ReLU6's backward, run on the blocks the plan splits the activation into) or ``seq_image``
(Segformer's tokens turned into an image for a convolution) or ``padded`` (an image padded
in code before its first convolution: no backward program on that edge) or ``frozen`` (a
frozen embedding and projection under a trained adapter and head). Prints
``OK <strategies>`` on rank 0 and exits 0, or prints the differences and exits 1.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ilp_planner  # noqa: E402
from ilp_planner.inputs.config import load_config  # noqa: E402
from ilp_planner.ir.graph import Op  # noqa: E402
from ilp_planner.lowering.strategies import Strategy  # noqa: E402
from ilp_planner.plan.audit import format_rows  # noqa: E402
from ilp_planner.plan.data import Plan  # noqa: E402
from ilp_planner.testing import restricted_plan  # noqa: E402
from runtime.apply import audit, full_value, parallelize  # noqa: E402
from runtime.modules import MLP  # noqa: E402
from runtime.recorder import Recorder  # noqa: E402
from tests.helpers.user_models import (  # noqa: E402
    CodedLinear,
    EncoderLM,
    FrozenBase,
    Llama,
    PaddedConv,
    ReLU6MLP,
    ResidualColumns,
    SequenceToImage,
    TransposedHead,
    TwinFollowers,
    WeightNormed,
)


def build(name: str):
    torch.manual_seed(0)
    if name == "mlp":
        model = MLP([32, 128, 128, 16], bias=True)
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.2)
        return model, torch.randn(4, 32), torch.randint(0, 16, (4,)), 0.05
    if name == "twin":
        return TwinFollowers(16, 32), torch.randn(8, 16), torch.randint(0, 16, (8,)), 1.0
    if name == "residual_columns":
        x = torch.randn(4, 6, 16)
        return ResidualColumns(), x, torch.randint(0, 8, (4, 6)), 1.0
    if name == "coded":
        return CodedLinear(16, 32), torch.randn(8, 16), torch.randint(0, 16, (8,)), 1.0
    if name == "odd_batch":  # 3 examples on 4 ranks: no split of the batch runs
        model = Llama(vocab=64, dim=32, n_layers=1, seq_len=8)
        return model, torch.randint(0, 64, (3, 8)), torch.randint(0, 64, (3, 8)), 1.0
    if name == "encoder":
        return EncoderLM(), torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)), 1.0
    if name == "frozen":
        return FrozenBase(), torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)), 1.0
    if name == "padded":
        return PaddedConv(), torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)), 1.0
    if name == "seq_image":
        return SequenceToImage(), torch.randn(4, 64, 3), torch.randint(0, 10, (4,)), 1.0
    if name == "relu6":
        return ReLU6MLP(), torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)), 1.0
    if name == "weight_norm":
        return WeightNormed(16, 32), torch.randn(8, 16), torch.randint(0, 16, (8,)), 1.0
    if name == "head_T":
        return TransposedHead(64, 32), torch.randint(0, 64, (4, 8)), torch.randint(0, 64, (4, 8)), 1.0
    model = Llama(vocab=64, dim=32, n_layers=2, seq_len=8)
    return model, torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8)), 1.0


def row_parallel_proj(op: Op, s: Strategy) -> bool:
    """``twin``'s plan: ``proj`` row-parallel (its output partial sums, resolved for both
    followers), ``mul`` whole on every device, the rest as the solver likes."""
    if op.name == "proj":
        return s.output.has_partial
    whole = not s.output.has_partial and all(s.output.split_degree(d) == 1 for d in (0, 1))
    return op.name != "mul" or whole


def add_columns_split(op: Op, s: Strategy) -> bool:
    """``residual_columns``'s plan: the residual add split over its columns on all ranks
    (so the module's input is read split on its features), the rest as the solver likes."""
    return op.name != "add" or s.output.split_degree(1) == s.output.num_devices


def planned(name: str, graph, world: int, tflops: float) -> Plan:
    """The solver's plan, or ``twin``'s and ``residual_columns``' restricted ones
    (:func:`row_parallel_proj`, :func:`add_columns_split`)."""
    keep = {"twin": row_parallel_proj, "residual_columns": add_columns_split}.get(name)
    if keep is None:
        return ilp_planner.solve(graph, cluster=cluster(world, tflops), baselines=False)
    return restricted_plan(load_config({"model": graph, "cluster": cluster(world, tflops)}),
                           keep)


def cluster(devices: int, tflops: float) -> dict:
    return {"nodes": 1, "devices_per_node": devices, "memory_gib": 16, "peak_tflops": tflops,
            "links": {"intra": {"latency_us": 1, "bandwidth_gbps": 10},
                      "inter": {"latency_us": 1, "bandwidth_gbps": 10}}}


def loss_of(out, y):
    return F.cross_entropy(out.flatten(0, -2) if out.dim() > 2 else out, y.flatten())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", choices=("mlp", "llama", "twin", "coded", "head_T", "encoder",
                                      "odd_batch", "weight_norm", "relu6", "seq_image", "padded",
                                      "frozen", "residual_columns"))
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model, x, y, tflops = build(args.model)
    reference = copy.deepcopy(model)
    graph = ilp_planner.from_module(model, (x,))
    box = [planned(args.model, graph, world, tflops).to_dict() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    plan = Plan.from_dict(box[0])
    model = parallelize(plan, model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    failures = []
    for step in range(args.steps):
        rec = Recorder(world)
        with rec:
            loss = loss_of(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad()
        ref = loss_of(reference(x), y)
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = float(full_value(loss))
        if abs(mine - float(ref)) > 1e-4 * max(1.0, abs(float(ref))):
            failures.append(f"step {step}: loss {mine} vs single-process {float(ref)}")
        rows = audit(plan, rank, rec.events)
        if not all(r.ok for r in rows):
            failures.append(format_rows(rank, rows))
    if args.model == "frozen":  # the frozen base unchanged, the rest trained as one process
        for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            if p.requires_grad != q.requires_grad or not torch.allclose(
                    full_value(p.detach()), q.detach(), atol=1e-5):
                failures.append(f"parameter {n} differs from the single-process one")
    flag = torch.tensor([len(failures)])
    dist.all_reduce(flag)
    if failures:
        print("\n".join(failures), flush=True)
    if rank == 0 and int(flag) == 0:
        kinds = sorted({ly.strategy for ly in plan.layers if not ly.strategy.startswith("follows")})
        print("OK " + " ".join(kinds), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if int(flag) else 0


if __name__ == "__main__":
    code = main()
    # gloo's worker threads, torn down during interpreter finalisation, abort a process now
    # and then after all work is done ("terminate called without an active exception"):
    # leave without finalising, as runtime.launch does
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
