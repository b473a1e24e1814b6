"""SBP layouts: local shapes, GSPMD and DTensor spellings, canonical keys."""

from __future__ import annotations

import pytest

from ilp_planner.errors import LayoutError
from ilp_planner.ir.cluster import MeshAxis
from ilp_planner.ir.graph import TensorSpec
from ilp_planner.ir.layouts import B, Broadcast, Layout, P, S, Split, drop_unit_axes, parse_placement


def mesh(*sizes: int) -> tuple[MeshAxis, ...]:
    """Single-node factorisation with the given axis sizes."""
    return tuple(MeshAxis(1, s) for s in sizes)


# ---- placements -----------------------------------------------------------------------------
def test_placement_strings_round_trip() -> None:
    for pl in (S(0), S(3), B, P):
        assert parse_placement(str(pl)) == pl
    assert parse_placement("S1") == Split(1)
    assert str(Layout(mesh(2, 4), (S(0), P))) == "(S(0):2, P:4)"
    assert Layout(mesh(2, 2, 2), (S(0), B, P)).sbp() == "S(0)BP"
    with pytest.raises(LayoutError, match="cannot parse"):
        parse_placement("Q")


def test_placements_are_hashable_values() -> None:
    assert {S(0), Split(0), B, Broadcast(), P} == {S(0), B, P}


def test_layout_needs_one_placement_per_axis() -> None:
    with pytest.raises(LayoutError, match="2 placements for a 3-axis mesh"):
        Layout(mesh(2, 2, 2), (B, B))


# ---- local shapes ---------------------------------------------------------------------------
def test_local_shape_even() -> None:
    lay = Layout(mesh(2, 4), (S(0), S(1)))
    assert lay.local_shape((8, 12)) == (4, 3)
    assert lay.local_bytes(TensorSpec((8, 12))) == 8 * 12 * 4 / 8
    assert lay.is_even(TensorSpec((8, 12)))


def test_local_shape_same_dim_on_two_axes() -> None:
    lay = Layout(mesh(2, 4), (S(0), S(0)))
    assert lay.split_degree(0) == 8 and lay.split_degree(1) == 1
    assert lay.local_shape((16, 5)) == (2, 5)


def test_local_shape_uneven_is_ceil() -> None:
    lay = Layout(mesh(4), (S(0),))
    assert lay.local_shape((10, 7)) == (3, 7)  # torch.chunk(10, 4) gives 3, 3, 3, 1
    assert not lay.is_even(TensorSpec((10, 7)))


def test_broadcast_and_partial_keep_full_shape() -> None:
    lay = Layout(mesh(2, 4), (B, P))
    assert lay.local_shape((6, 6)) == (6, 6)
    assert lay.replica_degree == 2 and lay.partial_axes == (1,)


def test_check_rejects_impossible_splits() -> None:
    with pytest.raises(LayoutError, match="rank 2"):
        Layout(mesh(2), (S(2),)).check(TensorSpec((4, 4)))
    with pytest.raises(LayoutError, match="cannot be split 8 ways"):
        Layout(mesh(2, 4), (S(0), S(0))).check(TensorSpec((4, 4)))
    Layout(mesh(2, 4), (S(0), S(0))).check(TensorSpec((8, 4)))


# ---- GSPMD ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("fact", "placements", "rank", "spec"),
    [
        (mesh(8), (S(0),), 2, "S^0R"),
        (mesh(2, 4), (S(0), S(0)), 2, "S^{01}R"),
        (mesh(2, 4), (B, S(1)), 2, "RS^1"),
        (mesh(2, 4), (S(1), S(0)), 2, "S^1S^0"),
        (mesh(2, 2, 2), (S(0), B, B), 3, "S^0RR"),
        (mesh(2, 2, 2), (S(1), S(0), S(1)), 2, "S^1S^{02}"),
    ],
)
def test_gspmd_round_trip(fact, placements, rank: int, spec: str) -> None:
    lay = Layout(fact, placements)
    assert lay.to_gspmd(rank) == spec
    assert Layout.from_gspmd(spec, fact, rank) == lay


def test_gspmd_short_forms() -> None:
    fact = mesh(2, 2, 2)
    assert Layout.from_gspmd("S0RR", fact, 3) == Layout(fact, (S(0), B, B))
    assert Layout.from_gspmd("S01R", mesh(2, 4)) == Layout(mesh(2, 4), (S(0), S(0)))
    assert Layout.from_gspmd("S^0 R", mesh(8)) == Layout(mesh(8), (S(0),))


@pytest.mark.parametrize(
    ("spec", "fact", "rank", "match"),
    [
        ("S^2R", mesh(2, 4), 2, "names mesh axis 2 but the mesh"),
        ("S^0RR", mesh(2, 4), 2, "has 3 dims but the tensor has rank 2"),
        ("S^0S^0", mesh(2, 4), 2, "uses mesh axis 0 twice"),
        ("S^{00}R", mesh(2, 4), 2, "twice"),
        ("S^{10}R", mesh(2, 4), 2, "major first"),
        ("S^0X", mesh(2, 4), 2, "unexpected character"),
    ],
)
def test_gspmd_parse_errors(spec: str, fact, rank: int, match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        Layout.from_gspmd(spec, fact, rank)


def test_gspmd_cannot_express_partial() -> None:
    with pytest.raises(LayoutError, match="partial"):
        Layout(mesh(2, 4), (P, S(0))).to_gspmd(2)


def test_gspmd_split_beyond_rank() -> None:
    with pytest.raises(LayoutError, match="rank is 2"):
        Layout(mesh(2, 4), (S(2), B)).to_gspmd(2)


# ---- DTensor --------------------------------------------------------------------------------
def test_dtensor_round_trip() -> None:
    from torch.distributed.tensor import Partial as TPartial
    from torch.distributed.tensor import Replicate, Shard

    fact = mesh(2, 2, 2)
    lay = Layout(fact, (S(1), B, P))
    placements = lay.to_dtensor()
    assert placements == [Shard(1), Replicate(), TPartial()]
    assert Layout.from_dtensor(placements, fact) == lay
    for pls in ((S(0), S(0), B), (B, B, B), (P, P, S(2))):
        assert Layout.from_dtensor(Layout(fact, pls).to_dtensor(), fact) == Layout(fact, pls)


def test_dtensor_unsupported_placement() -> None:
    with pytest.raises(LayoutError, match="unsupported DTensor placement"):
        Layout.from_dtensor(["Shard(0)"], mesh(2))


# ---- canonical keys -------------------------------------------------------------------------
def test_canonical_key_same_blocks_any_factorisation() -> None:
    two_axes = Layout(mesh(2, 4), (S(0), S(0)))
    one_axis = Layout(mesh(8), (S(0),))
    assert two_axes.canonical_key() == one_axis.canonical_key()
    # trailing replicated dims and replicated axes do not matter
    assert Layout(mesh(2, 4), (S(0), B)).canonical_key() == \
        Layout(mesh(2, 2, 2), (S(0), B, B)).canonical_key()


def test_canonical_key_differs_when_blocks_move() -> None:
    base = Layout(mesh(2, 4), (S(0), S(1))).canonical_key()
    # same degrees per dim, other devices: the axis order is swapped
    assert Layout(mesh(4, 2), (S(1), S(0))).canonical_key() != base
    # same degrees, a different axis does the split
    assert Layout(mesh(2, 2, 2), (S(0), B, B)).canonical_key() != \
        Layout(mesh(2, 2, 2), (B, S(0), B)).canonical_key()
    # different degrees
    assert Layout(mesh(2, 4), (S(1), S(0))).canonical_key() != base


def test_canonical_key_on_two_nodes() -> None:
    # 2 nodes × 4: (S0 over nodes, S0 over local) is one 8-way split by device id ...
    node_major = Layout((MeshAxis(2, 1), MeshAxis(1, 4)), (S(0), S(0)))
    assert node_major.canonical_key() == Layout((MeshAxis(2, 4),), (S(0),)).canonical_key()
    # ... but local-major order interleaves the nodes: other blocks on other devices.
    local_major = Layout((MeshAxis(1, 4), MeshAxis(2, 1)), (S(0), S(0)))
    assert local_major.canonical_key() != node_major.canonical_key()


def test_canonical_key_rejects_partial() -> None:
    with pytest.raises(LayoutError, match="partial"):
        Layout(mesh(2), (P,)).canonical_key()


def test_drop_unit_axes() -> None:
    lay = Layout(mesh(1, 4, 1, 2), (B, S(0), P, S(1)))
    assert drop_unit_axes(lay) == Layout(mesh(4, 2), (S(0), S(1)))
    assert drop_unit_axes(Layout(mesh(1), (S(0),))) == Layout(mesh(1), (B,))
    kept = Layout(mesh(2, 4), (S(0), B))
    assert drop_unit_axes(kept) is kept
