"""Run under torchrun: execute lowered redistribution programs (forward steps and backward
steps) on real gloo processes and compare every rank's block with the unsharded tensor.
With ``COUNT_KERNELS`` set, also count the kernels each rank dispatches outside the
collectives (as :mod:`tests.helpers.rank_kernels` does) against the kernels the lowering
prices (:func:`~ilp_planner.lowering.redistribution.step_work`): equal where the tensor
splits evenly, at most that elsewhere. Prints one line per case; exit 1 on any mismatch."""

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
from ilp_planner.lowering.redistribution import step_work
from runtime.comm import Comm
from runtime.mesh import MeshRegistry
from tests.helpers.rank_kernels import _Count, _waits_inside


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
    count = _Count() if os.environ.get("COUNT_KERNELS") else None
    kernels: list[str] = []  # rank 0's (issued, priced) per case
    if count is not None:
        _waits_inside(count)
    for i, (shape, src, dst, tensor, red) in enumerate(todo):
        full = torch.randn(shape, generator=g)
        x, gx = comm.block(full, src), comm.block(full, red.grad_dst)
        if count is not None:
            count.ops.clear()
            count.__enter__()
        got = comm.run(x, red.steps, tensor, "forward", "test")
        back = comm.run(gx, red.backward_steps, tensor, "backward", "test")
        ok_k = True
        if count is not None:
            count.__exit__(None, None, None)
            steps = red.steps + red.backward_steps
            priced = sum(step_work(st, tensor).kernels for st in steps)
            even = all(n % lay.split_degree(d) == 0 for st in steps for lay in (st.src, st.dst)
                       for d, n in enumerate(shape))
            issued = sum(count.ops.values())
            ok_k = issued == priced if even else issued <= priced
            kernels.append(f", kernels {issued} of {priced} priced")
        want = comm.block(full, dst)
        ok = got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
        want_b = comm.block(full, grad_layout(src))
        ok_b = back.shape == want_b.shape and torch.allclose(back, want_b, atol=1e-5)
        flags[i] = int(ok and ok_b and ok_k)
    dist.all_reduce(flags, op=dist.ReduceOp.MIN)  # one collective for all verdicts
    bad = int((flags == 0).sum())
    if dist.get_rank() == 0:
        for i, ((shape, src, dst, _, red), f) in enumerate(zip(todo, flags.tolist(),
                                                               strict=True)):
            print(f"{'OK ' if f else 'BAD'} {shape} {src} -> {dst}: "
                  f"{len(red.steps)} + {len(red.backward_steps)} steps"
                  f"{kernels[i] if kernels else ''}", flush=True)
        print(f"cases {len(todo)} bad {bad}", flush=True)
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
