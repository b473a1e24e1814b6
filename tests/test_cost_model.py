"""α–β collective formulas (AutoDDL Table 2) against hand-computed numbers, link-level choice,
compute time and per-device memory."""

from __future__ import annotations

import pytest

from ilp_planner.errors import ConfigError
from ilp_planner.ir.cluster import Cluster, Link, MeshAxis, group_spans_nodes
from ilp_planner.lowering.cost_model import (
    Collective,
    CollectiveKind,
    MemorySpec,
    collective_time,
    compute_time,
    make_collective,
    memory_bytes,
)

K = CollectiveKind
LINK = Link(alpha=1e-5, beta=1e-9)
INTRA = Link(alpha=2e-6, beta=1e-11)
INTER = Link(alpha=3e-5, beta=1e-9)


def _cluster(nodes: int = 2, local: int = 4) -> Cluster:
    return Cluster(nodes, local, memory_bytes=80e9, peak_flops=1e14, intra=INTRA, inter=INTER,
                   efficiency=0.5)


# p = 4, n = 1e6 bytes, α = 1e-5 s, β = 1e-9 s/B; worked by hand:
#   AllReduce      2·3·1e-5 + 2·(3/4)·1e6·1e-9 = 6e-5 + 1.5e-3
#   AG / RS / A2A    3·1e-5 +   (3/4)·1e6·1e-9 = 3e-5 + 7.5e-4
#   P2P                1e-5 +        1e6·1e-9 = 1e-5 + 1e-3
@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        (K.ALL_REDUCE, 6e-5 + 1.5e-3),
        (K.ALL_GATHER, 3e-5 + 7.5e-4),
        (K.REDUCE_SCATTER, 3e-5 + 7.5e-4),
        (K.ALL_TO_ALL, 3e-5 + 7.5e-4),
        (K.P2P, 1e-5 + 1e-3),
    ],
)
def test_collective_formulas_by_hand(kind: CollectiveKind, expected: float) -> None:
    assert collective_time(kind, 4, 1e6, LINK) == pytest.approx(expected, rel=1e-12)


def test_allreduce_equals_reducescatter_plus_allgather() -> None:
    # The ring AllReduce is a ReduceScatter followed by an AllGather (same n).
    for p in (2, 3, 8, 64):
        ar = collective_time(K.ALL_REDUCE, p, 3e7, LINK)
        rs = collective_time(K.REDUCE_SCATTER, p, 3e7, LINK)
        ag = collective_time(K.ALL_GATHER, p, 3e7, LINK)
        assert ar == pytest.approx(rs + ag, rel=1e-12)


def test_p8_numbers() -> None:
    # p = 8, n = 8e6: AllReduce 14α + 1.75·8e6·β.
    assert collective_time(K.ALL_REDUCE, 8, 8e6, LINK) == pytest.approx(14e-5 + 14e-3, rel=1e-12)
    assert collective_time(K.ALL_GATHER, 8, 8e6, LINK) == pytest.approx(7e-5 + 7e-3, rel=1e-12)


@pytest.mark.parametrize("kind", [K.ALL_REDUCE, K.ALL_GATHER, K.REDUCE_SCATTER, K.ALL_TO_ALL])
def test_group_of_one_costs_nothing(kind: CollectiveKind) -> None:
    assert collective_time(kind, 1, 1e9, LINK) == 0.0


def test_zero_bytes_costs_latency_only() -> None:
    assert collective_time(K.ALL_GATHER, 4, 0, LINK) == pytest.approx(3e-5)


@pytest.mark.parametrize(
    ("receivers", "chunks", "expected"),
    [
        # (K + A − 1)(α + nβ/K) with n = 1e6, α = 1e-5, β = 1e-9
        (4, 1, 4 * (1e-5 + 1e-3)),
        (4, 8, 11 * (1e-5 + 1.25e-4)),
        (1, 1, 1e-5 + 1e-3),  # one receiver, one chunk: a plain send
        (3, 4, 6 * (1e-5 + 2.5e-4)),
    ],
)
def test_pipelined_broadcast(receivers: int, chunks: int, expected: float) -> None:
    got = collective_time(K.BROADCAST, receivers, 1e6, LINK, chunks=chunks)
    assert got == pytest.approx(expected, rel=1e-12)


def test_pipelining_helps_large_broadcasts() -> None:
    one = collective_time(K.BROADCAST, 8, 1e8, LINK, chunks=1)
    many = collective_time(K.BROADCAST, 8, 1e8, LINK, chunks=16)
    assert many < one


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((K.ALL_REDUCE, 0, 1.0), {}), ((K.ALL_REDUCE, 4, -1.0), {}),
     ((K.BROADCAST, 4, 1.0), {"chunks": 0})],
)
def test_collective_time_rejects_bad_arguments(args: tuple, kwargs: dict) -> None:
    with pytest.raises(ValueError):
        collective_time(*args, LINK, **kwargs)


@pytest.mark.parametrize(
    ("axis", "link_name", "link"),
    [(MeshAxis(1, 4), "intra", INTRA), (MeshAxis(2, 1), "inter", INTER),
     (MeshAxis(2, 4), "inter", INTER), (MeshAxis(2, 2), "inter", INTER)],
)
def test_link_level_follows_node_span(axis: MeshAxis, link_name: str, link: Link) -> None:
    c = _cluster()
    col = make_collective(K.ALL_GATHER, axis.size, 1e6, c, axis.spans_nodes, axes=(0,))
    assert col.link == link_name
    assert c.link(axis.spans_nodes) is link
    assert col.seconds == pytest.approx(collective_time(K.ALL_GATHER, axis.size, 1e6, link))
    assert col.group_size == axis.size and col.bytes == 1e6 and col.axes == (0,)


def test_group_spans_nodes_over_axes() -> None:
    fact = (MeshAxis(2, 1), MeshAxis(1, 2), MeshAxis(1, 2))
    assert group_spans_nodes(fact, (0,))
    assert not group_spans_nodes(fact, (1, 2))
    assert group_spans_nodes(fact, (0, 2))


def test_inter_node_group_is_slower() -> None:
    c = _cluster()
    intra = make_collective(K.ALL_REDUCE, 2, 1e6, c, spans_nodes=False)
    inter = make_collective(K.ALL_REDUCE, 2, 1e6, c, spans_nodes=True)
    assert intra.seconds < inter.seconds


def test_collective_dict_round_trip() -> None:
    col = make_collective(K.REDUCE_SCATTER, 4, 2e6, _cluster(), True, axes=(0, 2),
                          phase="backward", purpose="grad_sync")
    assert Collective.from_dict(col.to_dict()) == col
    moved = col.with_phase("forward")
    assert moved.phase == "forward" and moved.purpose == "grad_sync"
    assert moved.seconds == col.seconds


def test_compute_time() -> None:
    # 1e12 FLOPs at 1e14 peak × 0.5 efficiency = 0.02 s
    assert compute_time(1e12, _cluster()) == pytest.approx(0.02)
    assert compute_time(0, _cluster()) == 0.0


@pytest.mark.parametrize(
    ("name", "per_param"), [("adam_mixed", 18.0), ("adam", 16.0), ("sgd", 8.0),
                            ("sgd_momentum", 12.0)],
)
def test_memory_presets(name: str, per_param: float) -> None:
    assert MemorySpec.preset(name).bytes_per_param == per_param


def test_default_memory_spec_is_adam_mixed() -> None:
    assert MemorySpec() == MemorySpec.preset("adam_mixed")


def test_unknown_optimizer_preset() -> None:
    with pytest.raises(ConfigError, match="adamw.*adam_mixed"):
        MemorySpec.preset("adamw")


def test_memory_bytes() -> None:
    spec = MemorySpec.preset("adam_mixed")
    # 1e6 local parameters × 18 B + 5e5 B of activations
    assert memory_bytes(1e6, 5e5, spec) == pytest.approx(18e6 + 5e5)
    assert memory_bytes(0, 0, spec) == 0
    custom = MemorySpec(weight_bytes=4, grad_bytes=4, optimizer_bytes=0)
    assert memory_bytes(10, 1, custom) == 81
