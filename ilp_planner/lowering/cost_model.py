"""Collective cost models (the textbook ring, and NCCL's choice of algorithm), compute and
memory.

Two collective models, picked per cluster (``Cluster.collectives``; the config's
``cluster.collectives``): ``ring`` for clusters given as raw numbers unless they opt in,
``nccl`` for clusters whose links come from the catalogue (:mod:`ilp_planner.ir.links`).

**ring** — AutoDDL Table 2. For a group of p devices and n bytes (n = the output size per
device; the input size for ReduceScatter), on the link level the group uses (the inter-node
one as soon as it crosses a node), plus the link's per-call launch cost L (0 for links
given as raw numbers, so their prices are what they always were):

    AllReduce                        L + 2(p−1)α + 2(p−1)/p · nβ
    AllGather, ReduceScatter, A2A    L +  (p−1)α +  (p−1)/p · nβ
    P2P send                         L +      α +          nβ
    pipelined broadcast to A hosts   L + (K + A − 1)(α + nβ/K)      (K chunks)

**nccl** — what NCCL's tuner (``src/graph/tuning.cc``) predicts and picks. A group of p
devices on N nodes (p/N on each) has intra-node steps at the intra link's α_i and
node-crossing steps at the inter link's α_o; its bandwidth is the bus bandwidth of the
slowest level it uses (β of the inter link once N > 1, which is what a multi-node
nccl-tests ``busbw`` measures), and L is that level's launch cost:

    AllReduce, ring    L + 2(p − N)α_i + 2(N − 1)α_o + 2(p−1)/p · nβ
    AllReduce, tree    L + 2((p/N − 1)α_i + ⌈log2 N⌉α_o) + 2nβ / 0.9
    AllReduce          the cheaper of the two (NCCL's choice by size and group)
    AllGather, RS      L +  (p − N)α_i +  (N − 1)α_o +  (p−1)/p · nβ
    A2A                L + (p/N − 1)α_i + (p − p/N)α_o
                         + max((p/N − 1)/p · nβ_i, (p − p/N)/p · nβ_o)
    P2P, bcast         the ring model's formulas on the group's level

NCCL runs an AllToAll as grouped send/receive pairs, one per peer: the p/N − 1 peers in
the node over the intra link and the p − p/N outside it over the network at once, so the
slower of the two shares sets its bandwidth (within one node, or with every rank on its
own node, it is the ring model's formula; nccl-tests' AllToAll ``busbw`` is algBw ·
(p−1)/p, the same bytes).

Ring steps and node crossings are NCCL's ``nsteps`` and ``nInterSteps``; the tree is its
double binary tree (a chain inside a node, a tree of depth log2 N across nodes) and 0.9 its
tree bandwidth factor (busBw × 0.9, then algBw = busBw / 2). Within one node the tree is a
chain with the ring's latency and less bandwidth, so it never wins; across nodes it wins
below a size where its ~log N latency stops paying for its bandwidth — e.g. 16 devices on
2 nodes of nvlink3 + 8x-ib-hdr200 switch to ring near 3.6 MB. Simplifications, on purpose:
one protocol (LL's latency with Simple's bandwidth: the lower envelope of NCCL's
protocols, optimistic between ~64 KiB and a few MiB), no NVLink SHARP / CollNet, no
per-size tree correction.

The intra-op ILP prices fused gradient buckets as a latency per chunk plus each op's bytes
at its own rate (:mod:`ilp_planner.lowering.grad_buckets`): exact for an affine price (the
ring model), and under ``nccl`` exact wherever an op's gradient and the chunks it is fused
into fall on the same side of the ring/tree switch (on the shipped 13B config to 1e-12);
otherwise the plan's priced chunks differ from the ILP's objective by the difference of the
two algorithms' rates on the bytes concerned (1e-4 relative on a tiny GPT with 25 MiB
buckets on nvlink3 + ib-hdr200).

A group that crosses nodes without saying how many (``nodes=None``) is taken to have
every rank on its own node — every step crosses, as the ring model assumes. All functions
are pure; nothing here knows about graphs or solvers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

from ilp_planner.errors import ConfigError
from ilp_planner.ir.cluster import Cluster, Link
from ilp_planner.ir.graph import Graph, Op


class CollectiveKind(str, Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    P2P = "p2p"
    BROADCAST = "broadcast"


def collective_time(kind: CollectiveKind, p: int, nbytes: float, link: Link, chunks: int = 1) -> float:
    """Seconds for one collective of ``kind`` over ``p`` devices moving ``nbytes``, by the
    textbook ring model (module docstring), plus the link's launch cost.

    For BROADCAST, ``p`` is the number of receivers A and ``chunks`` the pipelining K.
    A group of one device costs nothing.
    """
    if p < 1:
        raise ValueError(f"group size must be >= 1, got {p}")
    if nbytes < 0:
        raise ValueError(f"bytes must be >= 0, got {nbytes}")
    a, b = link.alpha, link.beta
    if kind is CollectiveKind.P2P:
        return link.launch + a + nbytes * b
    if kind is CollectiveKind.BROADCAST:
        if chunks < 1:
            raise ValueError("broadcast needs at least one chunk")
        return link.launch + (chunks + p - 1) * (a + nbytes * b / chunks)
    if p == 1:
        return 0.0
    frac = (p - 1) / p
    if kind is CollectiveKind.ALL_REDUCE:
        return link.launch + 2 * (p - 1) * a + 2 * frac * nbytes * b
    if kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_TO_ALL):
        return link.launch + (p - 1) * a + frac * nbytes * b
    raise ValueError(f"unknown collective {kind}")


TREE_BANDWIDTH = 0.9
"""NCCL's tree bus bandwidth as a fraction of the ring's (``busBw * .9`` in tuning.cc)."""


def nccl_allreduce_times(p: int, nbytes: float, intra: Link, inter: Link,
                         nodes: int = 1) -> dict[str, float]:
    """Seconds of an AllReduce of ``nbytes`` over ``p`` devices on ``nodes`` nodes by each
    algorithm NCCL weighs, ``{"ring": …, "tree": …}`` (module docstring)."""
    _check_group(p, nbytes, nodes)
    level = inter if nodes > 1 else intra
    if p == 1:
        return {"ring": 0.0, "tree": 0.0}
    ring = (level.launch + 2 * (p - nodes) * intra.alpha + 2 * (nodes - 1) * inter.alpha
            + 2 * (p - 1) / p * nbytes * level.beta)
    tree = (level.launch + 2 * ((p // nodes - 1) * intra.alpha
                                + math.ceil(math.log2(nodes)) * inter.alpha)
            + 2 * nbytes * level.beta / TREE_BANDWIDTH)
    return {"ring": ring, "tree": tree}


def nccl_algorithm(p: int, nbytes: float, intra: Link, inter: Link, nodes: int = 1) -> str:
    """The AllReduce algorithm NCCL would choose (the cheaper; ring on a tie)."""
    t = nccl_allreduce_times(p, nbytes, intra, inter, nodes)
    return "tree" if t["tree"] < t["ring"] else "ring"


def nccl_time(kind: CollectiveKind, p: int, nbytes: float, intra: Link, inter: Link,
              nodes: int = 1, chunks: int = 1) -> float:
    """Seconds for one collective as NCCL runs it: ``p`` devices on ``nodes`` nodes
    (``p / nodes`` on each), intra- and inter-node links (module docstring)."""
    _check_group(p, nbytes, nodes)
    level = inter if nodes > 1 else intra
    if kind is CollectiveKind.ALL_REDUCE:
        return min(nccl_allreduce_times(p, nbytes, intra, inter, nodes).values())
    if kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER) and p > 1:
        return (level.launch + (p - nodes) * intra.alpha + (nodes - 1) * inter.alpha
                + (p - 1) / p * nbytes * level.beta)
    if kind is CollectiveKind.ALL_TO_ALL and p > 1:
        local = p // nodes
        return (level.launch + (local - 1) * intra.alpha + (p - local) * inter.alpha
                + max((local - 1) / p * nbytes * intra.beta,
                      (p - local) / p * nbytes * (inter.beta if nodes > 1 else intra.beta)))
    return collective_time(kind, p, nbytes, level, chunks)


def _check_group(p: int, nbytes: float, nodes: int) -> None:
    if p < 1 or nodes < 1 or p % nodes:
        raise ValueError(f"a group of {p} devices cannot span {nodes} nodes evenly")
    if nbytes < 0:
        raise ValueError(f"bytes must be >= 0, got {nbytes}")


def group_nodes(p: int, spans_nodes: bool, nodes: int | None = None) -> int:
    """The nodes a group of ``p`` devices spans: 1 within a node, ``nodes`` where the
    caller knows it, else every rank on its own node (module docstring)."""
    if not spans_nodes:
        return 1
    return nodes if nodes else p


def collective_seconds(kind: CollectiveKind, p: int, nbytes: float, cluster: Cluster,
                       spans_nodes: bool, nodes: int | None = None, chunks: int = 1) -> float:
    """Seconds for one collective under the cluster's collective model: the ring model on
    the group's link level, or NCCL's over the ``nodes`` nodes the group spans."""
    if cluster.collectives == "ring":
        return collective_time(kind, p, nbytes, cluster.link(spans_nodes), chunks)
    return nccl_time(kind, p, nbytes, cluster.intra, cluster.inter,
                     group_nodes(p, spans_nodes, nodes), chunks)


@dataclass(frozen=True)
class Collective:
    """One collective a plan will issue: what, over how many devices, how many bytes
    (n of the formula), on which link level, how long. ``axes`` are the mesh axes of the
    group within its factorisation (empty for whole-mesh steps)."""

    kind: CollectiveKind
    group_size: int
    bytes: float
    link: str  # "intra" | "inter"
    seconds: float
    axes: tuple[int, ...] = ()
    phase: str = "forward"  # "forward" | "backward"
    purpose: str = "activation"  # "activation" | "grad_sync"
    # nodes the group spans (0: not known, e.g. read from a plan file): what the NCCL
    # model prices latency by; not part of a collective's identity, nor of the plan file
    nodes: int = field(default=0, compare=False)

    def to_dict(self) -> dict:
        return {
            "kind": self.kind.value,
            "group_size": self.group_size,
            "bytes": self.bytes,
            "link": self.link,
            "seconds": self.seconds,
            "axes": list(self.axes),
            "phase": self.phase,
            "purpose": self.purpose,
        }

    @classmethod
    def from_dict(cls, d: dict) -> Collective:
        return cls(
            kind=CollectiveKind(d["kind"]),
            group_size=int(d["group_size"]),
            bytes=float(d["bytes"]),
            link=d["link"],
            seconds=float(d["seconds"]),
            axes=tuple(d.get("axes", ())),
            phase=d.get("phase", "forward"),
            purpose=d.get("purpose", "activation"),
        )

    def with_phase(self, phase: str, purpose: str | None = None) -> Collective:
        return Collective(
            self.kind, self.group_size, self.bytes, self.link, self.seconds, self.axes,
            phase, purpose or self.purpose, self.nodes,
        )


ONCE_PER_STEP = frozenset({"grad_sync", "tied_weight", "shard_grad_sync", "weight_allgather"})
"""Purposes issued once per optimizer step; every other collective runs once per micro-batch
(state sharding's: ``shard_grad_sync`` a ZeRO-1 gradient ReduceScatter, ``weight_allgather``
the updated weights gathered after a ZeRO-1/2 step; ZeRO-2/3's per-micro-batch
``shard_grad`` ReduceScatter and ZeRO-3's ``fsdp_gather``, see
:func:`ilp_planner.lowering.strategies.state_sharded`)."""


def make_collective(
    kind: CollectiveKind, p: int, nbytes: float, cluster: Cluster, spans_nodes: bool,
    axes: tuple[int, ...] = (), phase: str = "forward", purpose: str = "activation",
    nodes: int | None = None,
) -> Collective:
    """One collective priced under the cluster's model; ``nodes``: how many nodes the group
    spans, where the caller knows it (:func:`group_nodes` otherwise)."""
    n = group_nodes(p, spans_nodes, nodes)
    return Collective(
        kind, p, float(nbytes), "inter" if spans_nodes else "intra",
        collective_seconds(kind, p, nbytes, cluster, spans_nodes, n), axes, phase, purpose, n,
    )


def compute_time(flops: float, cluster: Cluster) -> float:
    """Seconds for ``flops`` on one device at ``peak × efficiency``."""
    return flops / (cluster.peak_flops * cluster.efficiency)


OPTIMIZER_PRESETS: dict[str, tuple[float, float, float]] = {
    # (weight, gradient, optimizer-state) bytes per parameter
    # half-precision compute copy, fp32 gradients (reduced in fp32), fp32 master + 2 moments
    "adam_mixed": (2.0, 4.0, 12.0),  # = 18 B, Megatron's figure with fp32 gradient accumulation
    "adam": (4.0, 4.0, 8.0),  # fp32 weights, grads, 2 moments = 16 B
    "sgd": (4.0, 4.0, 0.0),
    "sgd_momentum": (4.0, 4.0, 4.0),
    # half-precision weights, gradients and Adam's two moments, no float32 copy: torch's
    # Adam on a bfloat16 module (what ``parallelize`` runs: Op.master_spec)
    "adam_half": (2.0, 2.0, 4.0),
}


@dataclass(frozen=True)
class MemorySpec:
    """Bytes per parameter for weights, gradients and optimizer state."""

    weight_bytes: float = 2.0
    grad_bytes: float = 4.0
    optimizer_bytes: float = 12.0

    @classmethod
    def preset(cls, optimizer: str) -> MemorySpec:
        if optimizer not in OPTIMIZER_PRESETS:
            raise ConfigError(
                f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_PRESETS)}"
            )
        return cls(*OPTIMIZER_PRESETS[optimizer])

    @property
    def bytes_per_param(self) -> float:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes

    def held_per_param(self, op: Op) -> float:
        """Bytes ``op`` holds per parameter: the weight alone where it is frozen
        (:attr:`~ilp_planner.ir.graph.Op.frozen`), else weight, gradient and optimizer state."""
        return self.weight_bytes if op.frozen else self.bytes_per_param


@dataclass(frozen=True)
class MemoryTerm:
    """One term of the memory lower bound: the ops one decision covers (a repeated op in
    every block where layers are tied, else one op), their training state and their output
    activations, unsharded."""

    name: str
    ops: tuple[str, ...]
    state_bytes: float
    activation_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes

    @property
    def label(self) -> str:
        """``h.*.mlp.fc1 (12 layers)``, or an op's name."""
        return self.name if len(self.ops) == 1 else f"{self.name} ({len(self.ops)} layers)"


def memory_terms(graph: Graph, memory: MemorySpec, tie_layers: bool = True) -> list[MemoryTerm]:
    """The memory lower bound's terms, grouped as the solver decides them (a repeated op's
    tie key with ``tie_layers``), in graph order."""
    grouped: dict[str, list] = {}
    for op in graph.ops:
        grouped.setdefault((op.tie_key if tie_layers else None) or op.name, []).append(op)
    return [MemoryTerm(name, tuple(op.name for op in ops),
                       sum(op.params * memory.held_per_param(op) for op in ops),
                       float(sum(op.held_output_bytes for op in ops)))
            for name, ops in grouped.items()]


def dominant_memory_term(graph: Graph, memory: MemorySpec, tie_layers: bool = True) -> MemoryTerm:
    """The largest term: what ``validate`` and the solver's infeasibility message both name,
    so the two never blame different layers for one shortfall."""
    return max(memory_terms(graph, memory, tie_layers), key=lambda t: t.total_bytes)


def memory_bytes(local_params: float, activation_bytes: float, spec: MemorySpec) -> float:
    """Per-device memory: (weights + grads + optimizer state) of the local parameter shard
    plus the live activations."""
    return local_params * spec.bytes_per_param + activation_bytes
