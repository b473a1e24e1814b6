"""Cluster, links and device meshes.

A cluster is ``nodes × devices_per_node`` identical devices with two link levels: intra-node
(NVLink-like) and inter-node (InfiniBand/Ethernet-like), each an α–β pair.

Mesh convention (AutoDDL §4.2.3): a *factorisation* of an ``n × d`` (sub-)mesh is an ordered
tuple of axes, axis i being ``(nodes_i, local_i)`` with ``Π nodes_i = n`` and
``Π local_i = d``. A device's node index is read in mixed radix over ``nodes_0..`` (axis 0
most significant) and its local index over ``local_0..``; its coordinate on axis i is
``node_coord_i * local_i + local_coord_i``. A collective along axis i therefore crosses nodes
exactly when ``nodes_i > 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache

import numpy as np

from ilp_planner.errors import ConfigError
from ilp_planner.ir.device import DeviceSpec

COLLECTIVE_MODELS = ("ring", "nccl")
"""How collectives are priced (:mod:`ilp_planner.lowering.cost_model`): ``ring`` the
textbook ring formulas (AutoDDL Table 2), ``nccl`` the algorithm NCCL would choose."""


@dataclass(frozen=True)
class Link:
    """One link level: α = latency in seconds (per ring step), β = seconds per byte, and
    ``launch`` = seconds every collective call pays once (kernel launch and NCCL's base
    latency; 0 for links given as raw numbers, which keeps their prices as they were)."""

    alpha: float
    beta: float
    launch: float = 0.0

    def __post_init__(self) -> None:
        if self.alpha < 0 or self.beta <= 0:
            raise ConfigError(f"link needs alpha >= 0 and beta > 0, got α={self.alpha}, β={self.beta}")
        if self.launch < 0:
            raise ConfigError(f"link needs a launch cost >= 0, got {self.launch}")

    @classmethod
    def from_bandwidth(cls, latency_us: float, bandwidth_gbps: float) -> Link:
        """From latency in µs and bandwidth in Gbit/s (network convention: 10 Gb/s Ethernet)."""
        if bandwidth_gbps <= 0:
            raise ConfigError(f"bandwidth must be positive, got {bandwidth_gbps} Gb/s")
        return cls(alpha=latency_us * 1e-6, beta=8.0 / (bandwidth_gbps * 1e9))

    @property
    def bandwidth_gbps(self) -> float:
        return 8.0 / (self.beta * 1e9)

    def time(self, nbytes: float) -> float:
        """One point-to-point message: α + nβ."""
        return self.alpha + nbytes * self.beta


@dataclass(frozen=True)
class Cluster:
    """A homogeneous cluster. ``efficiency`` scales peak FLOP/s to achieved FLOP/s in the
    flat compute model; ``device``, where the cluster names a catalogue accelerator
    (:mod:`ilp_planner.ir.device`), carries its per-dtype peaks and HBM bandwidth for the
    roofline model; ``collectives`` picks the collective model (:data:`COLLECTIVE_MODELS`)."""

    nodes: int
    devices_per_node: int
    memory_bytes: float
    peak_flops: float
    intra: Link
    inter: Link
    efficiency: float = 0.5
    name: str = "cluster"
    # not hashed: DeviceSpec holds a read-only mapping (unhashable); the cluster is a cache
    # key of the lowering, and its other fields already tell clusters apart
    device: DeviceSpec | None = field(default=None, hash=False)
    collectives: str = "ring"

    def __post_init__(self) -> None:
        if self.collectives not in COLLECTIVE_MODELS:
            raise ConfigError(f"unknown collective model {self.collectives!r}; expected one of "
                              f"{list(COLLECTIVE_MODELS)}")
        if self.nodes < 1 or self.devices_per_node < 1:
            raise ConfigError(
                f"cluster needs nodes >= 1 and devices_per_node >= 1, got "
                f"{self.nodes} × {self.devices_per_node}"
            )
        if self.memory_bytes <= 0 or self.peak_flops <= 0:
            raise ConfigError("cluster memory and peak FLOP/s must be positive")
        if not 0 < self.efficiency <= 1:
            raise ConfigError(f"efficiency must be in (0, 1], got {self.efficiency}")

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def link(self, spans_nodes: bool) -> Link:
        return self.inter if spans_nodes else self.intra

    def full_mesh(self) -> SubMesh:
        return SubMesh(0, self.nodes, 0, self.devices_per_node, self.devices_per_node)


@dataclass(frozen=True)
class MeshAxis:
    """One mesh axis: ``nodes`` nodes × ``local`` devices of each node."""

    nodes: int
    local: int

    @property
    def size(self) -> int:
        return self.nodes * self.local

    @property
    def spans_nodes(self) -> bool:
        return self.nodes > 1

    def __str__(self) -> str:
        return f"{self.size}" if self.nodes == 1 or self.local == 1 else f"{self.nodes}x{self.local}"


Factorisation = tuple[MeshAxis, ...]


def fact_sizes(fact: Factorisation) -> tuple[int, ...]:
    return tuple(a.size for a in fact)


def fact_str(fact: Factorisation) -> str:
    """Human form: ``(4, 2x2)`` — an axis spanning nodes shows ``nodes x local``."""
    return "(" + ", ".join(str(a) for a in fact) + ")"


@dataclass(frozen=True)
class SubMesh:
    """A rectangle of the cluster: nodes ``[node0, node0+nodes)`` × local devices
    ``[local0, local0+devices)``; ``devices_per_node`` of the cluster fixes device ids."""

    node0: int
    nodes: int
    local0: int
    devices: int
    devices_per_node: int

    @property
    def size(self) -> int:
        return self.nodes * self.devices

    @property
    def shape(self) -> tuple[int, int]:
        return (self.nodes, self.devices)

    def device_ids(self) -> list[int]:
        """Global device ids (rank = node * devices_per_node + local), node-major."""
        return [
            (self.node0 + n) * self.devices_per_node + self.local0 + d
            for n in range(self.nodes)
            for d in range(self.devices)
        ]

    def __str__(self) -> str:
        return f"{self.nodes}x{self.devices}@n{self.node0}d{self.local0}"


@cache
def ordered_factorisations(n: int, parts: int) -> tuple[tuple[int, ...], ...]:
    """Every ordered tuple of ``parts`` positive integers whose product is ``n`` (1s included)."""
    if parts == 1:
        return ((n,),)
    out = []
    for f in range(1, n + 1):
        if n % f == 0:
            out.extend((f,) + rest for rest in ordered_factorisations(n // f, parts - 1))
    return tuple(out)


@cache
def mesh_factorisations(nodes: int, local: int, num_axes: int) -> tuple[Factorisation, ...]:
    """Every factorisation of an ``nodes × local`` mesh into exactly ``num_axes`` ordered
    axes, trivial (size-1) axes allowed; each axis knows how many nodes it spans."""
    return tuple(
        tuple(MeshAxis(nn, dd) for nn, dd in zip(ns, ds, strict=True))
        for ns in ordered_factorisations(nodes, num_axes)
        for ds in ordered_factorisations(local, num_axes)
    )


@cache
def proper_factorisations(nodes: int, local: int, max_axes: int = 3) -> tuple[Factorisation, ...]:
    """Factorisations with no trivial axis, up to ``max_axes`` axes: for 64 single-device
    nodes ``(64), (2, 32), …, (8, 8), …, (4, 4, 4), …``."""
    out = []
    for k in range(1, max_axes + 1):
        for fact in mesh_factorisations(nodes, local, k):
            if all(a.size > 1 for a in fact) or (k == 1):
                out.append(fact)
    return tuple(dict.fromkeys(out))


@cache
def axis_coordinates(fact: Factorisation) -> np.ndarray:
    """Array ``(p, k)``: coordinate of each mesh-ordered device (node-major) on each axis."""
    nodes = math.prod(a.nodes for a in fact)
    local = math.prod(a.local for a in fact)
    idx = np.arange(nodes * local)
    node_idx, local_idx = idx // local, idx % local
    coords = np.zeros((nodes * local, len(fact)), dtype=np.int64)
    n_rem, l_rem = node_idx.copy(), local_idx.copy()
    for i in reversed(range(len(fact))):
        nc, n_rem = n_rem % fact[i].nodes, n_rem // fact[i].nodes
        lc, l_rem = l_rem % fact[i].local, l_rem // fact[i].local
        coords[:, i] = nc * fact[i].local + lc
    coords.setflags(write=False)
    return coords


def group_spans_nodes(fact: Factorisation, axes: tuple[int, ...]) -> bool:
    """Whether a collective over the given mesh axes crosses a node boundary."""
    return any(fact[i].nodes > 1 for i in axes)


SUBMESH_SPACES = ("all", "power_of_two", "small_power_of_two", "divisors")


def submesh_shapes(nodes: int, devices_per_node: int, space: str = "all") -> list[tuple[int, int]]:
    """Sub-mesh shapes ``(n, d)`` usable for a stage (Alpa §5). ``all``: ``(1, d)`` for every
    divisor ``d`` of ``devices_per_node`` (3 and 6 included) and ``(n, devices_per_node)``
    for ``n = 1..nodes``. Alpa's ``power_of_two`` (its default) keeps the powers of two
    (``(1, 1), (1, 2), (1, 4) … (1, dpn)``, ``(2, dpn), (4, dpn) …``) and
    ``small_power_of_two`` only ``n ≤ 4`` whole nodes; both also keep ``(1, dpn)`` and
    the whole cluster ``(nodes, dpn)`` so a one-stage plan always exists. Powers of two add
    up to any device count, so every stage count stays reachable; fewer shapes mean fewer
    intra-op stage solves (``O(ranges × shapes)``) and a smaller stage-DP state space.
    ``divisors`` keeps ``(1, d)`` for every divisor ``d`` of ``devices_per_node`` and the
    whole-node counts ``n`` dividing ``nodes``: every even split of the cluster into whole
    nodes — the layouts Megatron-LM runs (PP stages of ``nodes / pp`` nodes, e.g. 35 × 9 on
    315 nodes), which powers of two cannot express on a node count that is not one."""
    if space not in SUBMESH_SPACES:
        raise ConfigError(f"unknown sub-mesh space {space!r}; expected one of "
                          f"{list(SUBMESH_SPACES)}", key="pipeline.submesh_space")
    shapes = {(1, d) for d in range(1, devices_per_node + 1) if devices_per_node % d == 0}
    shapes |= {(n, devices_per_node) for n in range(1, nodes + 1)}
    if space == "divisors":
        return sorted(shapes - {(n, d) for n, d in shapes if d == devices_per_node
                                and nodes % n})
    if space != "all":
        cap = nodes if space == "power_of_two" else min(nodes, 4)

        def pow2(x: int) -> bool:
            return x & (x - 1) == 0

        shapes = {(n, d) for n, d in shapes
                  if (n == 1 and (pow2(d) or d == devices_per_node))
                  or (d == devices_per_node and pow2(n) and n <= cap)}
        shapes.add((nodes, devices_per_node))
    return sorted(shapes)
