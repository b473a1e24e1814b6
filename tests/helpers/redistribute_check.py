"""Run under torchrun: execute lowered redistribution programs (forward steps and backward
steps) on real gloo processes and compare every rank's block with the unsharded tensor.
Prints one line per case; exit 1 on any mismatch."""

from __future__ import annotations

import itertools
import os
import sys

import torch
import torch.distributed as dist

from ilp_planner.errors import LayoutError
from ilp_planner.ir.cluster import Cluster, Link, MeshAxis
from ilp_planner.ir.graph import TensorSpec
from ilp_planner.ir.layouts import B, Layout, P, S, grad_layout
from ilp_planner.ir.links import catalogue_cluster
from runtime.comm import Comm
from runtime.mesh import MeshRegistry


def setting(world: int) -> tuple[Cluster, list, list]:
    """Cluster, meshes and shapes: on 8 ranks a 2 × 4 cluster with (8,), (2, 4), (4, 2) and
    (2, 2, 2) — axes inside and across nodes, (4, 2)'s first axis not in ``arange`` order —
    else one node with (world,) and (2, world / 2). With ``CATALOGUE_CLUSTER`` set, the
    2 × 4 cluster is named from the catalogue, so its programs are NCCL-model choices."""
    link = Link(1e-5, 1e-9)
    if world == 8:
        cluster = Cluster(2, 4, 1e12, 1e12, link, Link(3e-5, 4e-9))
        if os.environ.get("CATALOGUE_CLUSTER"):  # the NCCL collective model's programs
            cluster = catalogue_cluster("a100-80gb", 2, 4, "nvlink3", "ib-hdr200")
        facts = [(MeshAxis(2, 4),), (MeshAxis(2, 1), MeshAxis(1, 4)), (MeshAxis(2, 2), MeshAxis(1, 2)),
                 (MeshAxis(2, 1), MeshAxis(1, 2), MeshAxis(1, 2))]
        return cluster, facts, [(16, 24), (13, 10), (8, 8, 16), (11, 9, 10)]
    cluster = Cluster(1, world, 1e12, 1e12, link, link)
    return cluster, [(MeshAxis(1, world),), (MeshAxis(1, 2), MeshAxis(1, world // 2))], \
        [(8, 12), (7, 10), (4, 6, 8), (5, 6, 9)]


def cases(facts: list, shapes: list):
    """Every (shape, source, destination) on any two meshes; destinations may keep partial
    sums the source has on the same axes (the lowering refuses any other P destination)."""
    for shape in shapes:
        rank = len(shape)
        opts = [B, P] + [S(d) for d in range(rank)]
        for sf, df in itertools.product(facts, facts):
            for sp in itertools.product(opts, repeat=len(sf)):
                for dp in itertools.product(opts, repeat=len(df)):
                    yield shape, Layout(sf, sp), Layout(df, dp)


def main() -> int:
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    cluster, facts, shapes = setting(world)
    reg = MeshRegistry(60)
    comm = Comm(reg, tuple(range(world)), dist.get_rank(), cluster)
    # the programs are pure data, identical on every rank: rank 0 lowers them once (eight
    # processes planning on two cores would double the launch's time)
    todo = []
    if dist.get_rank() == 0:
        stride = int(os.environ.get("CASE_STRIDE", "7"))
        for i, (shape, src, dst) in enumerate(cases(facts, shapes)):
            if i % stride:
                continue
            tensor = TensorSpec(shape, "float32")
            try:
                red = comm.program(src, dst, tensor)
            except LayoutError:
                continue  # a split finer than the dim, or a partial sum the source lacks
            todo.append((shape, src, dst, tensor, red))
    box = [todo]
    dist.broadcast_object_list(box, src=0)
    todo = box[0]
    for *_, red in todo:
        comm.register(red)
    reg.create()
    g = torch.Generator().manual_seed(0)
    flags = torch.zeros(len(todo), dtype=torch.int64)
    for i, (shape, src, dst, tensor, red) in enumerate(todo):
        full = torch.randn(shape, generator=g)
        got = comm.run(comm.block(full, src), red.steps, tensor, "forward", "test")
        want = comm.block(full, dst)
        ok = got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
        back = comm.run(comm.block(full, red.grad_dst), red.backward_steps, tensor, "backward", "test")
        want_b = comm.block(full, grad_layout(src))
        ok_b = back.shape == want_b.shape and torch.allclose(back, want_b, atol=1e-5)
        flags[i] = int(ok and ok_b)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # one collective for all verdicts
    bad = int((flags == 0).sum())
    if dist.get_rank() == 0:
        for (shape, src, dst, _, red), f in zip(todo, flags.tolist(), strict=True):
            print(f"{'OK ' if f else 'BAD'} {shape} {src} -> {dst}: "
                  f"{len(red.steps)} + {len(red.backward_steps)} steps", flush=True)
        print(f"cases {len(todo)} bad {bad}", flush=True)
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
