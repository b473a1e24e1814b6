"""Cluster IR: links, factorisations, the mesh coordinate convention and sub-mesh shapes."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest

from ilp_planner.errors import ConfigError
from ilp_planner.ir.cluster import (
    Cluster,
    Link,
    MeshAxis,
    SubMesh,
    axis_coordinates,
    fact_sizes,
    fact_str,
    group_spans_nodes,
    mesh_factorisations,
    ordered_factorisations,
    proper_factorisations,
    submesh_shapes,
)


# ---- links and clusters -----------------------------------------------------------------------
def test_link_from_bandwidth_uses_gigabits() -> None:
    link = Link.from_bandwidth(latency_us=10, bandwidth_gbps=100)
    assert link.alpha == pytest.approx(1e-5)
    assert link.beta == pytest.approx(8e-11)  # 100 Gb/s = 12.5 GB/s
    assert link.bandwidth_gbps == pytest.approx(100)
    assert link.time(1e6) == pytest.approx(1e-5 + 8e-5)


@pytest.mark.parametrize(
    "make",
    [lambda: Link(-1e-6, 1e-9), lambda: Link(1e-6, 0.0), lambda: Link.from_bandwidth(1, 0),
     lambda: Cluster(0, 4, 1e9, 1e12, Link(0, 1e-9), Link(0, 1e-9)),
     lambda: Cluster(1, 4, 0, 1e12, Link(0, 1e-9), Link(0, 1e-9)),
     lambda: Cluster(1, 4, 1e9, 1e12, Link(0, 1e-9), Link(0, 1e-9), efficiency=0)],
)
def test_invalid_links_and_clusters(make) -> None:
    with pytest.raises(ConfigError):
        make()


def test_cluster_basics() -> None:
    c = Cluster(2, 4, 1e9, 1e12, Link(1e-6, 1e-10), Link(1e-5, 1e-9))
    assert c.num_devices == 8
    assert c.link(False) is c.intra and c.link(True) is c.inter
    assert c.full_mesh().device_ids() == list(range(8))


def test_submesh_device_ids() -> None:
    # nodes 1..2, local devices 2..3 of a 4-device-per-node cluster
    sm = SubMesh(node0=1, nodes=2, local0=2, devices=2, devices_per_node=4)
    assert sm.device_ids() == [6, 7, 10, 11]
    assert sm.size == 4 and sm.shape == (2, 2)


# ---- factorisations -------------------------------------------------------------------------
def test_ordered_factorisations_of_64() -> None:
    assert ordered_factorisations(64, 1) == ((64,),)
    two = ordered_factorisations(64, 2)
    three = ordered_factorisations(64, 3)
    assert (8, 8) in two and (2, 32) in two and (32, 2) in two
    assert (4, 4, 4) in three and (1, 1, 64) in three and (2, 4, 8) in three
    # 64 = 2^6: ordered k-part factorisations = compositions of 6 into k non-negative parts
    assert len(two) == math.comb(7, 1)
    assert len(three) == math.comb(8, 2) == 28
    for parts, facts in ((2, two), (3, three)):
        assert len(set(facts)) == len(facts)
        assert all(len(f) == parts and math.prod(f) == 64 for f in facts)


def test_ordered_factorisations_non_prime_power() -> None:
    # 12 = 2^2·3: 2-part → 3·2 = 6 ordered factorisations
    assert set(ordered_factorisations(12, 2)) == {(1, 12), (2, 6), (3, 4), (4, 3), (6, 2), (12, 1)}


def test_proper_factorisations_single_device_nodes() -> None:
    facts = proper_factorisations(64, 1, 3)
    sizes = {fact_sizes(f) for f in facts}
    assert {(64,), (8, 8), (4, 4, 4), (2, 32), (2, 2, 16)} <= sizes
    assert all(all(s > 1 for s in fs) for fs in sizes)
    assert len(facts) == len(set(facts)) == 1 + 5 + 10  # 7 − 2 trivial; 28 − 18 with a 1


def test_mesh_factorisations_on_2x4() -> None:
    facts = mesh_factorisations(2, 4, 2)
    assert len(facts) == 2 * 3  # nodes 2 = 1·2, 2·1; local 4 = 1·4, 2·2, 4·1
    assert (MeshAxis(2, 1), MeshAxis(1, 4)) in facts
    assert (MeshAxis(1, 2), MeshAxis(2, 2)) in facts
    for fact in facts:
        assert math.prod(a.nodes for a in fact) == 2
        assert math.prod(a.local for a in fact) == 4
    spans = {fact: tuple(a.spans_nodes for a in fact) for fact in facts}
    assert spans[(MeshAxis(2, 1), MeshAxis(1, 4))] == (True, False)
    assert spans[(MeshAxis(1, 4), MeshAxis(2, 1))] == (False, True)
    assert fact_str((MeshAxis(1, 2), MeshAxis(2, 2))) == "(2, 2x2)"


# ---- coordinates ----------------------------------------------------------------------------
def test_axis_coordinates_docstring_example() -> None:
    # (nodes axis, local axis) on 2 × 4: axis 0 = node, axis 1 = local index
    coords = axis_coordinates((MeshAxis(2, 1), MeshAxis(1, 4)))
    assert coords.tolist() == [[d // 4, d % 4] for d in range(8)]
    # local axis first: coordinates swap columns
    coords = axis_coordinates((MeshAxis(1, 4), MeshAxis(2, 1)))
    assert coords.tolist() == [[d % 4, d // 4] for d in range(8)]
    # one axis of 2 nodes × 4: coordinate = node · 4 + local = the device id
    assert axis_coordinates((MeshAxis(2, 4),))[:, 0].tolist() == list(range(8))


@pytest.mark.parametrize(
    "fact",
    [f for k in (1, 2, 3) for f in mesh_factorisations(2, 4, k)]
    + [f for f in mesh_factorisations(3, 2, 2)],
    ids=fact_str,
)
def test_axis_coordinates_group_devices_as_documented(fact) -> None:
    """Each device gets a distinct coordinate tuple within the axis sizes, and the devices
    that differ only along axis i sit on exactly ``nodes_i`` nodes: an axis groups devices of
    different nodes iff ``nodes_i > 1``."""
    local = math.prod(a.local for a in fact)
    coords = axis_coordinates(fact)
    p = math.prod(a.size for a in fact)
    assert coords.shape == (p, len(fact))
    assert len({tuple(r) for r in coords}) == p
    for i, a in enumerate(fact):
        assert coords[:, i].min() == 0 and coords[:, i].max() == a.size - 1
        groups: dict[tuple, list[int]] = defaultdict(list)
        for dev, row in enumerate(coords):
            groups[tuple(np.delete(row, i))].append(dev)
        for members in groups.values():
            assert len(members) == a.size
            nodes_spanned = {dev // local for dev in members}
            assert len(nodes_spanned) == a.nodes
            assert (len(nodes_spanned) > 1) == group_spans_nodes(fact, (i,))


def test_axis_coordinates_are_read_only() -> None:
    coords = axis_coordinates((MeshAxis(1, 8),))
    with pytest.raises(ValueError):
        coords[0, 0] = 3


# ---- sub-meshes -----------------------------------------------------------------------------
def test_submesh_shapes_six_devices_per_node() -> None:
    shapes = submesh_shapes(1, 6)
    assert shapes == [(1, 1), (1, 2), (1, 3), (1, 6)]
    shapes = submesh_shapes(4, 6)
    assert {(1, 3), (1, 6), (2, 6), (3, 6), (4, 6)} <= set(shapes)
    assert (1, 4) not in shapes and (2, 3) not in shapes
    assert shapes == sorted(set(shapes))


def test_submesh_spaces_follow_alpa() -> None:
    assert submesh_shapes(128, 8, "power_of_two") == [
        (1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8), (8, 8), (16, 8), (32, 8), (64, 8),
        (128, 8)]
    assert submesh_shapes(12, 8, "small_power_of_two") == [
        (1, 1), (1, 2), (1, 4), (1, 8), (2, 8), (4, 8), (12, 8)]
    assert (12, 6) in submesh_shapes(12, 6, "power_of_two") and (1, 3) not in submesh_shapes(
        12, 6, "power_of_two")
    assert submesh_shapes(4, 6, "all") == submesh_shapes(4, 6)
    with pytest.raises(ConfigError, match="sub-mesh space"):
        submesh_shapes(2, 8, "powers")


def test_submesh_space_divisors_is_every_even_split() -> None:
    """``divisors``: the node counts dividing the cluster's (Megatron's ``nodes / pp``), the
    divisors of a node's devices, and nothing else — closed form on small clusters."""
    assert submesh_shapes(315, 8, "divisors") == [
        (1, 1), (1, 2), (1, 4), (1, 8), (3, 8), (5, 8), (7, 8), (9, 8), (15, 8), (21, 8),
        (35, 8), (45, 8), (63, 8), (105, 8), (315, 8)]
    assert submesh_shapes(12, 6, "divisors") == [
        (1, 1), (1, 2), (1, 3), (1, 6), (2, 6), (3, 6), (4, 6), (6, 6), (12, 6)]
    assert submesh_shapes(7, 1, "divisors") == [(1, 1), (7, 1)]
    for nodes, dpn in [(240, 8), (384, 8), (36, 4), (1, 8)]:
        shapes = submesh_shapes(nodes, dpn, "divisors")
        whole = sorted(n for n, d in shapes if d == dpn)
        assert whole == [n for n in range(1, nodes + 1) if nodes % n == 0]
        assert sorted(d for n, d in shapes if n == 1) == [
            d for d in range(1, dpn + 1) if dpn % d == 0]
        assert set(shapes) <= set(submesh_shapes(nodes, dpn, "all"))
    # the published stages of the 1,920-3,072-GPU Megatron rows: 15, 9 and 6 nodes
    assert (15, 8) in submesh_shapes(240, 8, "divisors")
    assert (6, 8) in submesh_shapes(384, 8, "divisors")
    assert (15, 8) not in submesh_shapes(240, 8, "power_of_two")
