"""Run under torchrun: execute lowered redistribution programs (forward steps and backward
steps) on real gloo processes and compare every rank's block with the unsharded tensor.
Prints one line per case; exit 1 on any mismatch."""

from __future__ import annotations

import itertools
import os
import sys

import torch
import torch.distributed as dist

from ilp_planner.cluster import Cluster, Link, MeshAxis
from ilp_planner.graph import TensorSpec
from ilp_planner.layouts import B, Layout, P, S, grad_layout
from runtime.comm import Comm
from runtime.mesh import MeshRegistry


def cases(world: int):
    facts = [(MeshAxis(1, world),), (MeshAxis(1, 2), MeshAxis(1, world // 2))]
    shapes = [(8, 12), (7, 10), (4, 6, 8), (5, 6, 9)]
    for shape in shapes:
        rank = len(shape)
        opts = [B, P] + [S(d) for d in range(rank)]
        for sf, df in itertools.product(facts, facts):
            for sp in itertools.product(opts, repeat=len(sf)):
                for dp in itertools.product([o for o in opts if o != P], repeat=len(df)):
                    yield shape, Layout(sf, sp), Layout(df, dp)


def main() -> int:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    link = Link(1e-5, 1e-9)
    cluster = Cluster(1, world, 1e12, 1e12, link, link)
    reg = MeshRegistry(60)
    comm = Comm(reg, tuple(range(world)), dist.get_rank(), cluster)
    todo = []
    stride = int(os.environ.get("CASE_STRIDE", "7"))
    for i, (shape, src, dst) in enumerate(cases(world)):
        if i % stride:
            continue
        tensor = TensorSpec(shape, "float32")
        try:
            red = comm.program(src, dst, tensor)
        except Exception:
            continue  # a split finer than the dim: not a layout of this tensor
        comm.register(red)
        todo.append((shape, src, dst, tensor, red))
    reg.create()
    bad = 0
    g = torch.Generator().manual_seed(0)
    for shape, src, dst, tensor, red in todo:
        full = torch.randn(shape, generator=g)
        got = comm.run(comm.block(full, src), red.steps, tensor, "forward", "test")
        want = comm.block(full, dst)
        ok = got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
        back = comm.run(comm.block(full, red.grad_dst), red.backward_steps, tensor, "backward", "test")
        want_b = comm.block(full, grad_layout(src))
        ok_b = back.shape == want_b.shape and torch.allclose(back, want_b, atol=1e-5)
        flags = torch.tensor([int(ok and ok_b)])
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        if not flags.item():
            bad += 1
        if dist.get_rank() == 0:
            print(f"{'OK ' if flags.item() else 'BAD'} {shape} {src} -> {dst}: "
                  f"{len(red.steps)} + {len(red.backward_steps)} steps", flush=True)
    if dist.get_rank() == 0:
        print(f"cases {len(todo)} bad {bad}", flush=True)
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
