"""α–β cost model for ring collectives (AutoDDL Table 2), compute and memory.

For a group of p devices and n bytes (n = the output size per device; the input size for
ReduceScatter):

    AllReduce                        2(p−1)α + 2(p−1)/p · nβ
    AllGather, ReduceScatter, A2A     (p−1)α +  (p−1)/p · nβ
    P2P send                              α +          nβ
    pipelined broadcast to A hosts   (K + A − 1)(α + nβ/K)      (K chunks)

The link level is the inter-node one as soon as the group crosses a node. All functions are
pure; nothing here knows about graphs or solvers.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from ilp_planner.errors import ConfigError
from ilp_planner.ir.cluster import Cluster, Link
from ilp_planner.ir.graph import Graph


class CollectiveKind(str, Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    P2P = "p2p"
    BROADCAST = "broadcast"


def collective_time(kind: CollectiveKind, p: int, nbytes: float, link: Link, chunks: int = 1) -> float:
    """Seconds for one collective of ``kind`` over ``p`` devices moving ``nbytes``.

    For BROADCAST, ``p`` is the number of receivers A and ``chunks`` the pipelining K.
    A group of one device costs nothing.
    """
    if p < 1:
        raise ValueError(f"group size must be >= 1, got {p}")
    if nbytes < 0:
        raise ValueError(f"bytes must be >= 0, got {nbytes}")
    a, b = link.alpha, link.beta
    if kind is CollectiveKind.P2P:
        return a + nbytes * b
    if kind is CollectiveKind.BROADCAST:
        if chunks < 1:
            raise ValueError("broadcast needs at least one chunk")
        return (chunks + p - 1) * (a + nbytes * b / chunks)
    if p == 1:
        return 0.0
    frac = (p - 1) / p
    if kind is CollectiveKind.ALL_REDUCE:
        return 2 * (p - 1) * a + 2 * frac * nbytes * b
    if kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_TO_ALL):
        return (p - 1) * a + frac * nbytes * b
    raise ValueError(f"unknown collective {kind}")


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
            phase, purpose or self.purpose,
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
) -> Collective:
    link = cluster.link(spans_nodes)
    return Collective(
        kind, p, float(nbytes), "inter" if spans_nodes else "intra",
        collective_time(kind, p, nbytes, link), axes, phase, purpose,
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
                       sum(op.params * memory.bytes_per_param for op in ops),
                       float(sum(op.output.nbytes for op in ops)))
            for name, ops in grouped.items()]


def dominant_memory_term(graph: Graph, memory: MemorySpec, tie_layers: bool = True) -> MemoryTerm:
    """The largest term: what ``validate`` and the solver's infeasibility message both name,
    so the two never blame different layers for one shortfall."""
    return max(memory_terms(graph, memory, tie_layers), key=lambda t: t.total_bytes)


def memory_bytes(local_params: float, activation_bytes: float, spec: MemorySpec) -> float:
    """Per-device memory: (weights + grads + optimizer state) of the local parameter shard
    plus the live activations."""
    return local_params * spec.bytes_per_param + activation_bytes
