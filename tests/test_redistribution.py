"""Redistribution lowering: single-axis transitions priced by the α–β formulas, unit axes,
foreign device sets, and a sample of programs executed forward and backward on real gloo
processes against the unsharded tensor."""

from __future__ import annotations

import pytest

from ilp_planner.errors import LayoutError
from ilp_planner.ir.cluster import Cluster, Factorisation, Link, MeshAxis
from ilp_planner.ir.graph import TensorSpec
from ilp_planner.ir.layouts import B, Layout, P, S
from ilp_planner.lowering.cost_model import CollectiveKind, collective_time
from ilp_planner.lowering.redistribution import plan_redistribution

K = CollectiveKind
INTRA = Link(alpha=2e-6, beta=1e-11)
INTER = Link(alpha=3e-5, beta=4e-10)


def cluster(nodes: int, local: int) -> Cluster:
    return Cluster(nodes, local, memory_bytes=80e9, peak_flops=1e14, intra=INTRA, inter=INTER)


def mesh(*sizes: int) -> Factorisation:
    return tuple(MeshAxis(1, s) for s in sizes)


T = TensorSpec((64, 96))  # float32: 24 576 B


def test_identity_is_free() -> None:
    lay = Layout(mesh(2, 4), (S(0), P))
    r = plan_redistribution(lay, lay, T, cluster(1, 8))
    assert r.steps == () and r.forward == [] and r.forward_seconds == 0 and r.seconds == 0


def test_unit_axes_are_ignored() -> None:
    a = Layout(mesh(8), (S(0),))
    b = Layout(mesh(1, 8), (P, S(0)))
    assert plan_redistribution(a, b, T, cluster(1, 8)).forward_seconds == 0


# ---- one mesh axis changes --------------------------------------------------------------------
# A single mesh axis of prime size admits no other factorisation, so the direct collective is
# the only (and cheapest) path: 1 × 2 and 1 × 3 are intra-node, 2 × 1 and 3 × 1 inter-node.
FULL = T.nbytes


def test_transition_on_one_axis_of_two() -> None:
    # (S0:2 over nodes, S1:2 in a node) → (B, S1): AllGather of dim 0 over the inter link
    fact = (MeshAxis(2, 1), MeshAxis(1, 2))
    r = plan_redistribution(Layout(fact, (S(0), S(1))), Layout(fact, (B, S(1))), T, cluster(2, 2))
    [col] = r.forward
    assert (col.kind, col.group_size, col.bytes, col.link, col.axes) == (
        K.ALL_GATHER, 2, FULL / 2, "inter", (0,))


def test_partial_over_nodes_uses_the_fast_axis() -> None:
    """(P over 2 nodes, B in a node) → B: splitting on the intra axis first (free), reducing
    half the bytes over the slow link, then gathering inside the node (hierarchical
    AllReduce) beats one AllReduce of the whole tensor across nodes."""
    fact = (MeshAxis(2, 1), MeshAxis(1, 2))
    r = plan_redistribution(Layout(fact, (P, B)), Layout(fact, (B, B)), T, cluster(2, 2))
    direct = collective_time(K.ALL_REDUCE, 2, FULL, INTER)
    hierarchical = (collective_time(K.ALL_REDUCE, 2, FULL / 2, INTER)
                    + collective_time(K.ALL_GATHER, 2, FULL, INTRA))
    assert hierarchical < direct
    assert r.forward_seconds == pytest.approx(hierarchical, rel=1e-12)
    assert [(c.kind, c.link) for c in r.forward] == [(K.ALL_REDUCE, "inter"),
                                                     (K.ALL_GATHER, "intra")]


def test_single_axis_on_a_multi_axis_layout() -> None:
    # (S0:2, P:3) → (S0:2, S1:3) on 1 × 6: ReduceScatter over 3 intra devices of n = T/2
    fact = mesh(2, 3)
    r = plan_redistribution(Layout(fact, (S(0), P)), Layout(fact, (S(0), S(1))), T, cluster(1, 6))
    [col] = r.forward
    assert (col.kind, col.group_size, col.bytes, col.link) == (K.REDUCE_SCATTER, 3, FULL / 2,
                                                               "intra")
    assert col.seconds == pytest.approx(collective_time(K.REDUCE_SCATTER, 3, FULL / 2, INTRA))


def test_foreign_device_set_is_rejected() -> None:
    with pytest.raises(LayoutError, match="covers"):
        plan_redistribution(Layout(mesh(8), (S(0),)), Layout(mesh(4), (S(0),)), T, cluster(1, 8))


# ---- properties over random layouts -------------------------------------------------------------
CLUSTERS = [(1, 8), (2, 4), (2, 2)]

@pytest.mark.slow
def test_lowered_programs_run_on_gloo_and_give_the_unsharded_values():
    """A sample of (source, destination) pairs — S(d)/B/P per axis on meshes (8,), (2, 4),
    (4, 2) and (2, 2, 2) of a 2 × 4 cluster, between any two of them, even and uneven 2-D
    and 3-D shapes, destinations keeping partial sums included — executed forward and
    backward by the runtime's step executor on 8 real gloo processes (one launch): every
    rank's block equals the block of the unsharded tensor (the backward's of the gradient in
    the producer's layout), and each rank dispatches the local kernels the lowering prices
    (:func:`~ilp_planner.lowering.redistribution.step_work`: exactly on even shapes, at
    most that on uneven ones)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "CASE_STRIDE": "211", "PYTHONPATH": str(root), "COUNT_KERNELS": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "8",
                          str(root / "tests" / "helpers" / "redistribute_check.py")],
                         capture_output=True, text=True, timeout=300, env=env, cwd=root)
    lines = [x for x in out.stdout.splitlines() if x.startswith(("OK", "BAD", "cases"))]
    assert out.returncode == 0, "\n".join(x for x in lines if not x.startswith("OK"))[-3000:]
    assert lines[-1].endswith("bad 0") and int(lines[-1].split()[1]) > 200


def test_vectorised_edge_costs_equal_the_pairwise_ones():
    """The ILP's cost matrices read Dijkstra rows in bulk (``edge_costs``); every entry must
    be the pairwise ``edge_cost``, gradient layouts given or defaulted, searched from either
    end."""
    import itertools

    from ilp_planner.lowering.redistribution import planner_for

    c = cluster(2, 4)
    facts = [(MeshAxis(2, 4),), (MeshAxis(2, 1), MeshAxis(1, 4)), (MeshAxis(1, 4), MeshAxis(2, 1))]
    tensor = TensorSpec((16, 32))
    lays = [Layout(f, pls) for f in facts
            for pls in itertools.product([B, P, S(0), S(1)], repeat=len(f))]
    srcs = lays[::3]
    dsts = [(lay, None) for lay in lays if not lay.has_partial][::2] + [
        (Layout(facts[1], (S(0), B)), Layout(facts[1], (S(0), P)))]
    planner = planner_for(srcs[0], c)
    free = [lay for lay in lays if not lay.has_partial][1::3]
    # many sources to few destinations reads the reversed graph's rows (its partial-free
    # part where every layout is partial-free): the same distances summed from the other
    # end, equal to the last few bits
    for ss, dd in ((srcs, dsts), (srcs, dsts[:2]), (srcs[:2], dsts), (free, dsts[:2])):
        bulk = planner.edge_costs(ss, dd, tensor)
        for i, s in enumerate(ss):
            for j, (d, g) in enumerate(dd):
                assert bulk[i, j] == pytest.approx(planner.edge_cost(s, d, tensor, g),
                                                   rel=1e-12, abs=1e-20)
