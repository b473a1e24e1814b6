"""Redistribution planner: single-axis transitions, the AutoDDL §4.3 path, backward mirror,
and (hypothesis) the triangle inequality and step consistency over random layouts."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ilp_planner.cluster import Cluster, Factorisation, Link, MeshAxis, proper_factorisations
from ilp_planner.cost_model import CollectiveKind, collective_time
from ilp_planner.errors import LayoutError
from ilp_planner.graph import TensorSpec
from ilp_planner.layouts import B, Broadcast, Layout, P, Partial, S, Split, drop_unit_axes
from ilp_planner.redistribution import Redistribution, RedistStep, plan_redistribution

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


@pytest.mark.parametrize(("nodes", "local"), [(1, 2), (2, 1), (1, 3), (3, 1)])
@pytest.mark.parametrize(
    ("src", "dst", "kind"),
    [
        (P, B, K.ALL_REDUCE),
        (P, S(0), K.REDUCE_SCATTER),
        (P, S(1), K.REDUCE_SCATTER),
        (S(0), B, K.ALL_GATHER),
        (S(1), B, K.ALL_GATHER),
        (S(0), S(1), K.ALL_TO_ALL),
        (S(1), S(0), K.ALL_TO_ALL),
        (B, S(0), None),
        (B, P, None),
        (S(1), P, None),
    ],
)
def test_single_axis_transition(nodes: int, local: int, src, dst, kind) -> None:
    fact = (MeshAxis(nodes, local),)
    p = nodes * local
    r = plan_redistribution(Layout(fact, (src,)), Layout(fact, (dst,)), T, cluster(nodes, local))
    if kind is None:
        assert r.forward == [] and r.forward_seconds == 0 and len(r.steps) == 1
        return
    [col] = r.forward
    link, name = (INTER, "inter") if nodes > 1 else (INTRA, "intra")
    # n = the output size (input size for ReduceScatter) per device
    nbytes = {K.ALL_REDUCE: FULL, K.REDUCE_SCATTER: FULL, K.ALL_GATHER: FULL,
              K.ALL_TO_ALL: FULL / p}[kind]
    assert (col.kind, col.group_size, col.link, col.axes) == (kind, p, name, (0,))
    assert col.bytes == nbytes
    assert col.seconds == pytest.approx(collective_time(kind, p, nbytes, link), rel=1e-12)
    assert r.forward_seconds == col.seconds


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


# ---- AutoDDL §4.3 -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("nodes", "local", "src_sizes", "dst_sizes"),
    [(1, 8, (2, 2, 2), (2, 2, 2)), (1, 16, (2, 4, 2), (2, 2, 4)), (1, 16, (4, 2, 2), (4, 2, 2))],
)
def test_autoddl_matmul_chain_path(nodes, local, src_sizes, dst_sizes) -> None:
    """(S0:p0, S1:p1, P:p2) → (S0:p0′, B:p1′, S1:p2′) with p0 = p0′ is ReduceScatter over
    p2 then AllGather over p1′, with a free re-view between them — nothing else."""
    p0, p1, p2 = src_sizes
    _, q1, q2 = dst_sizes
    c = cluster(nodes, local)
    src = Layout(mesh(*src_sizes), (S(0), S(1), P))
    dst = Layout(mesh(*dst_sizes), (S(0), B, S(1)))
    r = plan_redistribution(src, dst, T, c)
    assert [col.kind for col in r.forward] == [K.REDUCE_SCATTER, K.ALL_GATHER]
    rs, ag = r.forward
    assert (rs.group_size, rs.bytes) == (p2, FULL / (p0 * p1))  # input of the ReduceScatter
    assert (ag.group_size, ag.bytes) == (q1, FULL / (p0 * q2))  # output of the AllGather
    expected = (collective_time(K.REDUCE_SCATTER, p2, FULL / (p0 * p1), INTRA)
                + collective_time(K.ALL_GATHER, q1, FULL / (p0 * q2), INTRA))
    assert r.forward_seconds == pytest.approx(expected, rel=1e-12)
    # every other step is a free re-view between layouts holding the same blocks
    for step in r.steps:
        if step.collective is None:
            assert step.src.canonical_key() == step.dst.canonical_key()
    # the backward pass mirrors it: AllGather then ReduceScatter, same seconds
    # the gradient runs the dual path in reverse: the AllGather's mirror (ReduceScatter)
    # first, then the ReduceScatter's mirror (AllGather), with the same seconds
    assert [col.kind for col in r.backward] == [K.REDUCE_SCATTER, K.ALL_GATHER]
    assert [col.group_size for col in r.backward] == [q1, p2]
    assert sum(col.seconds for col in r.backward) == pytest.approx(r.forward_seconds)


def test_autoddl_path_across_nodes() -> None:
    # 2 nodes × 4: p0 = 2 spans the nodes, (p1, p2) = (2, 2) inside a node
    fact = (MeshAxis(2, 1), MeshAxis(1, 2), MeshAxis(1, 2))
    r = plan_redistribution(Layout(fact, (S(0), S(1), P)), Layout(fact, (S(0), B, S(1))), T,
                            cluster(2, 4))
    assert [(col.kind, col.link) for col in r.forward] == [
        (K.REDUCE_SCATTER, "intra"), (K.ALL_GATHER, "intra")]


# ---- backward ---------------------------------------------------------------------------------
MIRROR = {K.ALL_GATHER: K.REDUCE_SCATTER, K.REDUCE_SCATTER: K.ALL_GATHER,
          K.ALL_REDUCE: K.ALL_REDUCE, K.ALL_TO_ALL: K.ALL_TO_ALL}


def _check_backward(r: Redistribution) -> None:
    fwd, bwd = r.forward, r.backward
    assert len(bwd) == len(fwd)
    for f, b in zip(fwd, reversed(bwd), strict=True):
        assert b.kind == MIRROR[f.kind]
        assert (b.group_size, b.bytes, b.link, b.seconds) == (f.group_size, f.bytes, f.link,
                                                              f.seconds)
        assert b.phase == "backward" and f.phase == "forward"
    assert sum(c.seconds for c in bwd) == pytest.approx(r.forward_seconds, rel=1e-12)
    assert r.seconds == pytest.approx(2 * r.forward_seconds, rel=1e-12)


def test_backward_mirrors_forward() -> None:
    c = cluster(2, 4)
    src = Layout((MeshAxis(2, 1), MeshAxis(1, 4)), (P, S(0)))
    dst = Layout((MeshAxis(2, 2), MeshAxis(1, 2)), (S(1), B))
    r = plan_redistribution(src, dst, T, c)
    assert r.forward
    _check_backward(r)


def test_foreign_device_set_is_rejected() -> None:
    with pytest.raises(LayoutError, match="covers"):
        plan_redistribution(Layout(mesh(8), (S(0),)), Layout(mesh(4), (S(0),)), T, cluster(1, 8))


# ---- properties over random layouts -------------------------------------------------------------
CLUSTERS = [(1, 8), (2, 4), (2, 2)]
FREE_MOVES = {(Broadcast, Split), (Broadcast, Partial), (Split, Partial)}
AXIS_KIND = {(Partial, Broadcast): K.ALL_REDUCE, (Partial, Split): K.REDUCE_SCATTER,
             (Split, Broadcast): K.ALL_GATHER, (Split, Split): K.ALL_TO_ALL}


@st.composite
def layouts_problem(draw):
    nodes, local = draw(st.sampled_from(CLUSTERS))
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.sampled_from([8, 16, 32])) for _ in range(rank))
    facts = proper_factorisations(nodes, local)
    options = [B, P] + [S(d) for d in range(rank)]

    def layout() -> Layout:
        fact = draw(st.sampled_from(facts))
        return Layout(fact, tuple(draw(st.sampled_from(options)) for _ in fact))

    return (nodes, local), TensorSpec(shape), layout(), layout(), layout()


def _check_step(step: RedistStep, tensor: TensorSpec, c: Cluster) -> None:
    """The collective of a step is the one its src → dst change requires."""
    u, v, col = step.src, step.dst, step.collective
    p_all = u.num_devices
    assert v.num_devices == p_all
    changed = [i for i in range(len(u.placements))
               if u.fact == v.fact and u.placements[i] != v.placements[i]]
    if len(changed) == 1:
        i = changed[0]
        a, b = type(u.placements[i]), type(v.placements[i])
        if col is None:
            assert (a, b) in FREE_MOVES
            return
        axis = u.fact[i]
        assert col.kind == AXIS_KIND[(a, b)]
        assert (col.group_size, col.axes) == (axis.size, (i,))
        assert col.link == ("inter" if axis.nodes > 1 else "intra")
        nbytes = u.local_bytes(tensor) * (axis.size if col.kind is K.ALL_GATHER else 1)
        assert col.bytes == pytest.approx(nbytes)
        assert col.seconds == pytest.approx(
            collective_time(col.kind, axis.size, nbytes, c.link(axis.nodes > 1)), rel=1e-12)
        return
    # a whole-layout step: both sides partial-free
    assert not u.has_partial and not v.has_partial
    if col is None:  # re-view: every device already holds the block it needs
        assert u.canonical_key() == v.canonical_key()
    else:  # reshuffle: same shard shape, other devices — one AlltoAll over all devices
        assert col.kind is K.ALL_TO_ALL and col.group_size == p_all
        assert u.local_shape(tensor.shape) == v.local_shape(tensor.shape)
        assert col.bytes == pytest.approx(u.local_bytes(tensor))
        spans = math.prod(a.nodes for a in u.fact) > 1
        assert col.link == ("inter" if spans else "intra")


def _check_path(r: Redistribution, tensor: TensorSpec, c: Cluster) -> None:
    if not r.steps:
        assert drop_unit_axes(r.src) == drop_unit_axes(r.dst)
        return
    assert r.steps[0].src == drop_unit_axes(r.src)
    assert r.steps[-1].dst == drop_unit_axes(r.dst)
    for prev, nxt in zip(r.steps, r.steps[1:], strict=False):
        assert prev.dst == nxt.src
    for step in r.steps:
        _check_step(step, tensor, c)


@settings(max_examples=60, deadline=None)
@given(layouts_problem())
def test_triangle_inequality_and_consistent_steps(problem) -> None:
    (nodes, local), tensor, a, b, mid = problem
    c = cluster(nodes, local)
    ab = plan_redistribution(a, b, tensor, c)
    am = plan_redistribution(a, mid, tensor, c)
    mb = plan_redistribution(mid, b, tensor, c)
    via = am.forward_seconds + mb.forward_seconds
    # 1e-12 relative slack for rounding; the search also charges 1e-15 s per free step
    # (csgraph needs positive weights), which forward_seconds leaves out.
    assert ab.forward_seconds <= via * (1 + 1e-12) + 1e-13
    for r in (ab, am, mb):
        _check_path(r, tensor, c)
        _check_backward(r)
