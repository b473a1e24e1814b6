"""Every layout pair, lowered and executed.

Pairs of placements (``S(d)`` for each dim, ``B``, ``P`` per mesh axis) on the meshes
(8,), (2, 4), (4, 2), (2, 2, 2) of a 2-node × 4-device cluster — so axes within a node and
across nodes both occur, and (4, 2)'s first axis has a rank order other than ``arange`` —
for an even and an uneven 2-D and 3-D shape (one in bfloat16). All pairs where they
number a few hundred, a deterministic stratified sample
(:func:`runtime.fidelity.placement_pairs`) where the product explodes ((2, 2, 2) has 125²
3-D pairs).

1. **Fidelity**: on torch's fake process group, one process playing rank 0 and then rank 5,
   the collectives the dispatch-level recorder sees while the runtime executes a program
   (forward, then autograd's backward through the edge) equal the lowered program exactly:
   kind, group size, bytes, link, in order. Pairs that end in a partial sum the source
   lacks are refused by the lowering and unreachable for the ILP's pricing.
2. **Never dearer than DTensor**: on the same pairs, the lowered program's α–β time
   (forward + backward) is at most what ``DTensor.redistribute`` itself issues — forward,
   and autograd's backward with the gradient in the placements ``to_local`` hands back —
   priced by the same cost model. Rank 0 holds the largest chunk on every axis, so its
   record is DTensor's slowest group (DTensor pads per group, the runtime per layout).

Values are checked on real gloo processes in ``tests/test_redistribution.py``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from functools import cache

import pytest

from ilp_planner.errors import LayoutError
from ilp_planner.ir.cluster import Cluster, Factorisation, Link, MeshAxis
from ilp_planner.ir.graph import TensorSpec
from ilp_planner.ir.layouts import Layout, Partial
from ilp_planner.lowering.redistribution import Redistribution, plan_redistribution, redistribution_seconds
from runtime.comm import Comm
from runtime.fidelity import (
    device_mesh,
    fake_world,
    placement_pairs,
    program_keys,
    record_dtensor,
    record_runtime,
)
from runtime.mesh import MeshRegistry
from runtime.recorder import Recorder

# gpt-2.6b-2x4's links: NVLink inside a node, 10 Gb/s Ethernet between the two nodes
CLUSTER = Cluster(2, 4, 16 * 2**30, 1.25e14, Link.from_bandwidth(5, 1200), Link.from_bandwidth(10, 10))
DEVICES = tuple(range(8))
MESHES: dict[str, Factorisation] = {
    "(8,)": (MeshAxis(2, 4),),
    "(2,4)": (MeshAxis(2, 1), MeshAxis(1, 4)),
    "(4,2)": (MeshAxis(2, 2), MeshAxis(1, 2)),
    "(2,2,2)": (MeshAxis(2, 1), MeshAxis(1, 2), MeshAxis(1, 2)),
}
# (even, uneven) per rank; 10 split 8 ways leaves empty chunks, 9 and 11 ragged ones; one
# shape in bfloat16 so bytes are counted per element size on both sides
SHAPES = {2: (TensorSpec((16, 24)), TensorSpec((13, 10))),
          3: (TensorSpec((8, 8, 16)), TensorSpec((11, 9, 10), "bfloat16"))}
BUDGET = {(1, 2): None, (1, 3): None, (2, 2): None, (2, 3): 160, (3, 2): 160, (3, 3): 200}
RANKS = (0, 5)


def cases() -> Iterator[tuple[str, Layout, Layout, TensorSpec]]:
    for name, fact in MESHES.items():
        for rank, tensors in SHAPES.items():
            for tensor in tensors:
                for sp, dp in placement_pairs(len(fact), rank, BUDGET[(len(fact), rank)]):
                    yield name, Layout(fact, sp), Layout(fact, dp), tensor


def makes_partial(src: Layout, dst: Layout) -> bool:
    """``dst`` has a partial sum on an axis where ``src`` has none."""
    return any(isinstance(pl, Partial) and not isinstance(src.placements[i], Partial)
               for i, pl in enumerate(dst.placements))


@cache
def lowered() -> tuple[list[tuple[str, Redistribution]], list[tuple[str, Layout, Layout, TensorSpec]]]:
    """(mesh name, program) of every offered pair, and the refused pairs."""
    offered, refused = [], []
    for name, src, dst, tensor in cases():
        src.check(tensor)  # every case is a layout of its tensor
        dst.check(tensor)
        if makes_partial(src, dst):
            refused.append((name, src, dst, tensor))
        else:
            offered.append((name, plan_redistribution(src, dst, tensor, CLUSTER)))
    return offered, refused


def test_the_pair_set_is_large_and_mixed() -> None:
    offered, refused = lowered()
    names = {n for n, _ in offered}
    assert names == set(MESHES)
    assert len(offered) > 1500 and len(refused) > 500
    uneven = [r for _, r in offered if not r.src.is_even(r.tensor) or not r.dst.is_even(r.tensor)]
    assert len(uneven) > 300
    kinds = {c.kind for _, r in offered for c in r.forward + r.backward}
    assert len(kinds) == 4  # all-reduce, all-gather, reduce-scatter, all-to-all all occur
    assert any(len(r.src.fact) == 3 and r.backward for _, r in offered)


def test_pairs_that_make_partial_sums_are_refused_not_priced() -> None:
    """S→P, B→P (and P over another axis) cannot be produced by a layout change: the
    lowering refuses them and the ILP's pricing finds them unreachable."""
    _, refused = lowered()
    for _, src, dst, tensor in refused:
        with pytest.raises(LayoutError, match="partial"):
            plan_redistribution(src, dst, tensor, CLUSTER)
        with pytest.raises(LayoutError):
            redistribution_seconds(src, dst, tensor, CLUSTER)


@pytest.mark.parametrize("rank", RANKS)
def test_runtime_issues_exactly_the_lowered_program(rank: int) -> None:
    offered, _ = lowered()
    bad: list[str] = []
    with fake_world(rank, len(DEVICES)):
        registry = MeshRegistry(60)
        comm = Comm(registry, DEVICES, rank, CLUSTER)
        for _, red in offered:
            comm.register(red)
        registry.create()
        recorder = Recorder(CLUSTER.devices_per_node)
        for name, red in offered:
            got, want = record_runtime(comm, red, recorder), program_keys(red)
            if got != want:
                bad.append(f"{name} {red.tensor.shape} {red.src} -> {red.dst}:\n"
                           f"  lowered  {want}\n  executed {got}")
    assert not bad, f"{len(bad)} of {len(offered)} pairs differ on rank {rank}:\n" + "\n".join(bad[:10])


def test_lowering_is_never_dearer_than_dtensor() -> None:
    offered, _ = lowered()
    dearer: list[str] = []
    cheaper = 0
    with fake_world(0, len(DEVICES)), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        meshes = {name: device_mesh(fact, DEVICES) for name, fact in MESHES.items()}
        recorder = Recorder(CLUSTER.devices_per_node)
        for name, red in offered:
            dt = record_dtensor(meshes[name], red.src, red.dst, red.tensor, recorder)
            planned, theirs = red.seconds, dt.seconds(CLUSTER)
            if planned > theirs * (1 + 1e-9):
                dearer.append(f"{name} {red.tensor.shape} {red.src} -> {red.dst}: planned "
                              f"{planned:.4g} s {program_keys(red)}, DTensor {theirs:.4g} s {dt}")
            cheaper += planned < theirs * (1 - 1e-9)
    assert not dearer, f"{len(dearer)} pairs dearer than DTensor:\n" + "\n".join(dearer[:10])
    assert cheaper > len(offered) // 4  # the search finds cheaper paths, not only DTensor's
