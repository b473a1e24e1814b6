"""Cross-mesh resharding planner (Zhuang et al. §2.2, §3): unit tasks from GSPMD sharding specs,
the cost of each transfer strategy, and the scheduled plan. Pure; no torch.

Meshes. A mesh is a :class:`~ilp_planner.ir.cluster.SubMesh` of one cluster — ``nodes ×
devices`` starting at node ``node0`` and local device ``local0``, device id
``node * devices_per_node + local`` — seen as the 2-D mesh ``(nodes, devices)``: mesh axis 0
runs over hosts, axis 1 over the devices of a host. Source and destination must not share a
device (they may share a host). Host = node index of the cluster.

Specs. One token per tensor dimension — ``S^0``, ``S^1``, ``S^{01}`` or ``R`` (``S0RR``,
``S01R`` also accepted), parsed by :meth:`Layout.from_gspmd`. ``S^{01}`` splits by axis 0,
then each piece by axis 1.

Slices. A dimension of size ``n`` split ``k`` ways gives pieces
``[min(j·c, n), min((j+1)·c, n))`` with ``c = ⌈n/k⌉`` — torch.chunk/DTensor's convention, i.e.
the tensor is padded to ``k·c`` and the padding is never sent; trailing pieces may be short
or empty (Zhuang et al. pads in case 6: 1024 rows over 3 hosts = 342 + 342 + 340).

Unit tasks (§2.2). Devices holding the same region form one *source slice* σ (its replicas);
likewise destination devices needing the same region form a *destination slice* δ. Each
non-empty σ ∩ δ is one unit task: holders = devices of σ, receivers = devices of δ. Source
slices tile the tensor, so each destination device's region is the disjoint union of its
tasks' regions: every (element, destination device) pair is delivered exactly once.
Tasks are numbered destination-major (for δ: for σ), the order Alpa issues them in.

Transfer strategies (§3.1) for one task of ``n`` bytes from sender host ``s`` to ``b_h``
devices on each receiving host ``h``; ``A`` = receiving hosts other than ``s``; inter link
(α, β) between hosts, intra link (α_i, β_i) inside one. Each gives a NIC time ``d`` (the
sender's send side and the receivers' receive sides are busy) and a tail ``e`` (intra-node
work after the NICs are free, which holds no host resource):

``broadcast`` (default)  pipelined ring broadcast over the A hosts in K chunks:
    d = (K + A − 1)(α + nβ/K)        e = H_max (α_i + nβ_i/K)
    where H_max is the longest NVLink chain inside one host (b_h − 1 hops on a receiving
    host, b_s on the sender's own host). The first device of a host forwards to the next
    host and to its local neighbour on separate links, so every chain but the last host's
    overlaps the inter-host pipeline; the tail charges the last one. K minimises d + e
    (K* = √(((A−1)nβ + H_max nβ_i)/α), capped by ``max_chunks``) unless fixed. With A = 0
    (all receivers on the sender's host) it is the same broadcast over NVLink, e = 0.
``send_recv``  one device-to-device message per receiving device, one after another:
    d = Σ_h b_h (α + nβ) + b_s (α_i + nβ_i),  e = 0.
``local_allgather``  (Alpa, Megatron) each receiving host gets one copy cut in b_h parts,
    then an all-gather over NVLink:  d = Σ_h (b_h α + nβ),  e = max_h AG_intra(b_h, n).
``global_allgather``  the copy is cut in D = Σ b_h parts, one per receiving device, then a
    ring all-gather over all D devices:  d = Σ_h b_h (α + nβ/D) + AG_inter(D, n),  e = 0
    (the all-gather crosses hosts, so it holds the NICs; on one host it becomes the tail).
AG(p, n) = (p−1)α + (p−1)/p·nβ (AutoDDL, Table 2). Transfers the sender's own host receives over
NVLink run beside the NIC part and do not add to ``d`` when A > 0.

Host resources (what eq. 3 serialises): the sender host's send side and every receiving
host's receive side, for ``d`` seconds — also when A = 0 (conservative: NVLink does not use
the NIC, but the model keeps eq. 3 per host). In a ring broadcast the receiving hosts also
forward chunks with their send sides; when source and destination are on different hosts
(all of Zhuang et al.'s cases) nothing else needs a destination host's send side, so eq. 3 leaves
it out; meshes sharing a host are allowed but this forwarding load is then not modelled.

Scheduling (Zhuang et al. eqs. 1–3) is :mod:`formulations.cross_mesh`; the plan keeps every
algorithm's makespan and uses the best.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace

from formulations.cross_mesh import (
    Candidate,
    CrossMeshProblem,
    Result,
    SchedTask,
    SchedulerOptions,
    best_result,
    in_order_greedy,
    load_balance,
    randomized_greedy,
    solve_all,
)
from ilp_planner.errors import ConfigError, LayoutError, PlanFormatError
from ilp_planner.ir.cluster import Cluster, Link, MeshAxis, SubMesh, fact_str
from ilp_planner.ir.graph import TensorSpec
from ilp_planner.ir.layouts import Layout, Split
from ilp_planner.ir.regions import Region, device_regions, intersect, region_empty, region_numel
from ilp_planner.lowering.cost_model import CollectiveKind, collective_time

STRATEGIES = ("broadcast", "send_recv", "local_allgather", "global_allgather")

# Zhuang et al. Table 2, the nine microbenchmark cases (tensor 1024 × 1024 × 512, fp32, 4 GPUs
# per host): (send spec, receive spec, send mesh, receive mesh). Case 6's (3, 4) mesh splits
# 1024 rows unevenly; see benchmarks/resharding_cases.py for how the table was read.
TABLE2_CASES = (
    ("S^0RR", "S^0RR", "2x4", "2x4"),
    ("RRR", "S^0RR", "2x4", "2x4"),
    ("RS^0R", "S^0RR", "2x4", "2x4"),
    ("RS^{01}R", "S^{01}RR", "2x4", "2x4"),
    ("S^1RR", "S^0RR", "2x4", "2x4"),
    ("S^0RR", "S^0RR", "2x4", "3x4"),
    ("S^1RR", "RRR", "1x4", "2x4"),
    ("RRR", "RRR", "2x3", "3x2"),
    ("RS^0R", "RRS^0", "2x4", "2x4"),
)


MeshSpec = SubMesh  # a mesh placed in the cluster: (node0, nodes, local0, devices, per node)


# -- inputs ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HostLinks:
    """The two link levels the cost model needs: inside a host and between hosts."""

    intra: Link
    inter: Link

    @classmethod
    def of(cls, links: Cluster | HostLinks | tuple[Link, Link]) -> HostLinks:
        if isinstance(links, HostLinks):
            return links
        if isinstance(links, Cluster):
            return cls(links.intra, links.inter)
        if isinstance(links, tuple) and len(links) == 2:
            return cls(*links)
        raise ConfigError(f"expected a Cluster, HostLinks or (intra, inter) Links, got {links!r}")


@dataclass(frozen=True)
class ReshardOptions:
    """``chunks``: pipelining K of broadcasts (None = the per-task optimum ≤ ``max_chunks``).
    ``compare_strategies``: also price the other strategies (cheap heuristics only)."""

    strategy: str = "broadcast"
    chunks: int | None = None
    max_chunks: int = 256
    scheduler: SchedulerOptions = field(default_factory=SchedulerOptions)
    compare_strategies: bool = True

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"unknown transfer strategy {self.strategy!r}; expected one of "
                              f"{list(STRATEGIES)}")
        if self.chunks is not None and self.chunks < 1:
            raise ConfigError(f"chunks must be >= 1, got {self.chunks}")
        if self.max_chunks < 1:
            raise ConfigError(f"max_chunks must be >= 1, got {self.max_chunks}")


def parse_mesh(text: str, devices_per_node: int, node0: int = 0, local0: int = 0) -> SubMesh:
    """``"2x4"`` (NODESxDEVICES) placed at node ``node0``, local device ``local0``."""
    parts = text.lower().replace("(", "").replace(")", "").replace(",", "x").split("x")
    try:
        nodes, devices = (int(p) for p in parts)
    except ValueError:
        raise ConfigError(f"mesh {text!r}: expected NODESxDEVICES, e.g. 2x4") from None
    if nodes < 1 or devices < 1:
        raise ConfigError(f"mesh {text!r}: both sizes must be positive")
    if local0 + devices > devices_per_node:
        raise ConfigError(f"mesh {text!r} at local device {local0} needs {local0 + devices} "
                          f"devices per host, but hosts have {devices_per_node}")
    return SubMesh(node0, nodes, local0, devices, devices_per_node)


def mesh_factorisation(mesh: SubMesh) -> tuple[MeshAxis, MeshAxis]:
    """Axis 0 over the mesh's hosts, axis 1 over the devices of a host."""
    return (MeshAxis(mesh.nodes, 1), MeshAxis(1, mesh.devices))


def mesh_layout(mesh: SubMesh, spec: str | Layout, tensor: TensorSpec, role: str = "") -> Layout:
    """Parse ``spec`` on ``mesh`` (or check a ready :class:`Layout`, e.g. one the intra-op
    ILP chose on any factorisation of the mesh); errors say which mesh (``role``) and what is
    wrong. A split finer than its dimension is allowed (DTensor allows it too): the trailing
    devices then hold empty shards, send nothing and receive nothing."""
    where = f"{role} spec {spec_text(spec, tensor.rank)!r} on mesh {mesh.nodes}x{mesh.devices}"
    where = where.strip()
    try:
        if not isinstance(spec, Layout):
            return Layout.from_gspmd(spec, mesh_factorisation(mesh), rank=tensor.rank)
        nodes = math.prod(a.nodes for a in spec.fact)
        local = math.prod(a.local for a in spec.fact)
        if (nodes, local) != (mesh.nodes, mesh.devices):
            raise LayoutError(f"the layout's factorisation {fact_str(spec.fact)} covers "
                              f"{nodes}x{local} devices, not the mesh's")
        if spec.has_partial:
            raise LayoutError("a partial-sum layout cannot cross meshes; reduce it first "
                              "(AllReduce or ReduceScatter on the source mesh)")
        for i, pl in enumerate(spec.placements):
            if isinstance(pl, Split) and not 0 <= pl.dim < tensor.rank:
                raise LayoutError(f"mesh axis {i} splits dim {pl.dim} but the tensor has rank "
                                  f"{tensor.rank}")
        return spec
    except LayoutError as exc:
        raise LayoutError(f"{where}: {exc}") from None


def spec_text(spec: str | Layout, rank: int) -> str:
    """The spec as the plan records it: the string given, or a layout's GSPMD form with its
    factorisation as ``(nodes x local, ...)`` per axis, e.g. ``S^0S^1R@(2x1, 1x2, 1x2)``."""
    if not isinstance(spec, Layout):
        return spec
    try:
        text = spec.to_gspmd(rank)
    except LayoutError:
        text = spec.sbp()
    return f"{text}@(" + ", ".join(f"{a.nodes}x{a.local}" for a in spec.fact) + ")"












def check_meshes(src: SubMesh, dst: SubMesh, cluster: Cluster | None = None) -> None:
    """Raise :class:`ConfigError` if the meshes overlap, disagree on host size, or (given a
    cluster) do not fit in it."""
    if src.devices_per_node != dst.devices_per_node:
        raise ConfigError(f"source mesh {src} has {src.devices_per_node} devices per host but "
                          f"destination mesh {dst} has {dst.devices_per_node}")
    for role, m in (("source", src), ("destination", dst)):
        if m.local0 + m.devices > m.devices_per_node:
            raise ConfigError(f"{role} mesh {m} uses local devices {m.local0}.."
                              f"{m.local0 + m.devices - 1} but hosts have {m.devices_per_node}")
        if cluster is not None and (m.node0 + m.nodes > cluster.nodes
                                    or m.devices_per_node != cluster.devices_per_node):
            raise ConfigError(f"{role} mesh {m} does not fit the {cluster.nodes}x"
                              f"{cluster.devices_per_node} cluster {cluster.name!r}")
    shared = sorted(set(src.device_ids()) & set(dst.device_ids()))
    if shared:
        raise ConfigError(
            f"source mesh {src} and destination mesh {dst} share device(s) {shared[:8]}"
            f"{' …' if len(shared) > 8 else ''}; cross-mesh resharding needs disjoint meshes "
            f"(place the destination at another node offset or local device offset)")


# -- unit tasks ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UnitTask:
    """One unique data slice to move: ``region`` of the tensor, held by ``holders`` (source
    device ids), needed by ``receivers`` (destination device ids). ``src_slice`` /
    ``dst_slice`` index the unique source / destination slices it intersects."""

    index: int
    region: Region
    nbytes: int
    src_slice: int
    dst_slice: int
    holders: tuple[int, ...]
    receivers: tuple[int, ...]
    devices_per_node: int

    @property
    def holder_hosts(self) -> tuple[int, ...]:
        return tuple(sorted({d // self.devices_per_node for d in self.holders}))

    @property
    def receiver_hosts(self) -> tuple[int, ...]:
        return tuple(sorted({d // self.devices_per_node for d in self.receivers}))

    def receivers_per_host(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for d in self.receivers:
            out[d // self.devices_per_node] = out.get(d // self.devices_per_node, 0) + 1
        return out

    def to_dict(self) -> dict:
        return {"index": self.index, "region": [list(r) for r in self.region],
                "bytes": self.nbytes, "src_slice": self.src_slice, "dst_slice": self.dst_slice,
                "holders": list(self.holders), "receivers": list(self.receivers)}


def _unique_slices(regions: Mapping[int, Region]) -> list[tuple[Region, tuple[int, ...]]]:
    groups: dict[Region, list[int]] = {}
    for dev, reg in regions.items():
        if not region_empty(reg):
            groups.setdefault(reg, []).append(dev)
    return [(reg, tuple(devs)) for reg, devs in groups.items()]


def _meeting(regions: Sequence[Region]):
    """A function from a region to the indices (ascending) of ``regions`` that may meet it:
    on the dimension the regions are cut most along, where their intervals do not overlap
    (a layout's blocks: a grid), only those whose interval meets the region's — found by
    bisection, so a batch split over 2,048 devices on each side pairs each destination
    slice with its one or two sources instead of all 2,048. Otherwise (overlapping
    intervals) every index. The caller still intersects each candidate: exact, the same
    unit tasks in the same order."""
    every = range(len(regions))
    if not regions or not regions[0]:
        return lambda _: every
    dim = max(range(len(regions[0])), key=lambda d: len({r[d] for r in regions}))
    spans = sorted({r[dim] for r in regions})
    if any(a[1] > b[0] for a, b in itertools.pairwise(spans)):
        return lambda _: every
    by_span: dict[tuple[int, int], list[int]] = {}
    for i, r in enumerate(regions):
        by_span.setdefault(r[dim], []).append(i)
    los, his = [a for a, _ in spans], [b for _, b in spans]

    def meeting(region: Region) -> list[int]:
        lo, hi = region[dim]
        found = spans[bisect.bisect_right(his, lo):bisect.bisect_left(los, hi)]
        return sorted(i for span in found for i in by_span[span])
    return meeting


def unit_tasks(tensor: TensorSpec, src: SubMesh, src_spec: str | Layout, dst: SubMesh,
               dst_spec: str | Layout) -> tuple[UnitTask, ...]:
    """The unit tasks of resharding ``tensor`` from (src, src_spec) to (dst, dst_spec)."""
    check_meshes(src, dst)
    src_slices = _unique_slices(device_regions(tensor, src, mesh_layout(src, src_spec, tensor,
                                                                        "source")))
    dst_slices = _unique_slices(device_regions(tensor, dst, mesh_layout(dst, dst_spec, tensor,
                                                                        "destination")))
    out = []
    meeting = _meeting([reg for reg, _ in src_slices])
    for j, (dreg, receivers) in enumerate(dst_slices):
        for i in meeting(dreg):
            sreg, holders = src_slices[i]
            reg = intersect(sreg, dreg)
            if region_empty(reg):
                continue
            out.append(UnitTask(len(out), reg, region_numel(reg) * tensor.itemsize, i, j,
                                holders, receivers, src.devices_per_node))
    return tuple(out)


# -- strategy costs ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransferCost:
    """NIC seconds, tail seconds and chunks K (1 for the non-pipelined strategies)."""

    duration: float
    tail: float
    chunks: int = 1


def _best_chunks(alpha: float, c: float, cost, max_chunks: int) -> int:
    """Integer K minimising ``cost(K)`` = Kα + c/K + const (convex): K* = √(c/α)."""
    if c <= 0:
        return 1
    k_star = max_chunks if alpha <= 0 else math.sqrt(c / alpha)
    ks = {min(max_chunks, max(1, int(math.floor(k_star)))),
          min(max_chunks, max(1, int(math.ceil(k_star))))}
    return min(sorted(ks), key=cost)


def transfer_cost(strategy: str, nbytes: float, sender_host: int,
                  receivers_per_host: Mapping[int, int], links: HostLinks,
                  chunks: int | None = None, max_chunks: int = 256) -> TransferCost:
    """Cost of one unit task under ``strategy`` (formulas in the module docstring)."""
    n = float(nbytes)
    remote = {h: b for h, b in receivers_per_host.items() if h != sender_host}
    local = receivers_per_host.get(sender_host, 0)
    A = len(remote)
    inter, intra = links.inter, links.intra
    bc = CollectiveKind.BROADCAST
    ag = CollectiveKind.ALL_GATHER
    if strategy == "broadcast":
        if A == 0:
            def cost0(K: int) -> float:
                return collective_time(bc, local, n, intra, K)
            K = chunks or _best_chunks(intra.alpha, (local - 1) * n * intra.beta, cost0,
                                       max_chunks)
            return TransferCost(cost0(K), 0.0, K)
        hops = max([b - 1 for b in remote.values()] + [local])

        def cost(K: int) -> float:
            return collective_time(bc, A, n, inter, K) + hops * (intra.alpha + n * intra.beta / K)
        K = chunks or _best_chunks(inter.alpha, (A - 1) * n * inter.beta + hops * n * intra.beta,
                                   cost, max_chunks)
        return TransferCost(collective_time(bc, A, n, inter, K),
                            hops * (intra.alpha + n * intra.beta / K), K)
    if strategy == "send_recv":
        return TransferCost(sum(b * inter.time(n) for b in remote.values())
                            + local * intra.time(n), 0.0)
    if strategy == "local_allgather":
        nic = sum(b * inter.alpha + n * inter.beta for b in remote.values())
        own = local * intra.alpha + n * intra.beta if local else 0.0
        tail = max([collective_time(ag, b, n, intra) for b in remote.values()]
                   + ([collective_time(ag, local, n, intra)] if local else []))
        return TransferCost(max(nic, own) if A else own, tail)
    if strategy == "global_allgather":
        D = sum(remote.values()) + local
        nic = sum(b * inter.time(n / D) for b in remote.values())
        own = local * intra.time(n / D)
        scatter = max(nic, own) if A else own
        hosts = A + (1 if local else 0)
        if hosts > 1:
            return TransferCost(scatter + collective_time(ag, D, n, inter), 0.0)
        return TransferCost(scatter, collective_time(ag, D, n, intra))
    raise ConfigError(f"unknown transfer strategy {strategy!r}; expected one of "
                      f"{list(STRATEGIES)}")


def scheduling_problem(tasks: Sequence[UnitTask], strategy: str, links: HostLinks,
                       chunks: int | None = None, max_chunks: int = 256
                       ) -> tuple[CrossMeshProblem, list[list[int]]]:
    """The :class:`CrossMeshProblem` of ``tasks`` (one candidate per holder host) and the
    chunk count K of each (task, candidate)."""
    sched, ks = [], []
    num_hosts = 1
    for t in tasks:
        per_host = t.receivers_per_host()
        cands, kk = [], []
        for h in t.holder_hosts:
            c = transfer_cost(strategy, t.nbytes, h, per_host, links, chunks, max_chunks)
            cands.append(Candidate(h, c.duration, c.tail))
            kk.append(c.chunks)
        sched.append(SchedTask(f"t{t.index}", t.receiver_hosts, tuple(cands)))
        ks.append(kk)
        num_hosts = max(num_hosts, 1 + max(t.holder_hosts + t.receiver_hosts))
    return CrossMeshProblem(tuple(sched), num_hosts), ks


# -- the plan ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskTransfer:
    """Task ``task`` is sent by ``sender_device`` (on ``sender_host``) to its receivers as
    one broadcast: NICs busy in [start_s, end_s), data in place at finish_s."""

    task: int
    sender_host: int
    sender_device: int
    start_s: float
    end_s: float
    finish_s: float
    chunks: int

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class AlgorithmRun:
    """One scheduling algorithm's outcome, as the plan reports it."""

    name: str
    status: str
    makespan_s: float
    wall_s: float
    note: str = ""

    def to_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Delivery:
    """``region`` goes from ``src_device`` (which holds it) to ``dst_device`` in task ``task``."""

    task: int
    src_device: int
    dst_device: int
    region: Region


@dataclass(frozen=True)
class ReshardingPlan:
    """A solved cross-mesh resharding: unit tasks, the chosen sender and start of each,
    makespan, lower bound, every algorithm's makespan and (optionally) the makespans of the
    other transfer strategies under the paper's baseline scheduler and under the best cheap
    heuristic."""

    tensor: TensorSpec
    src: SubMesh
    src_spec: str
    dst: SubMesh
    dst_spec: str
    links: HostLinks
    strategy: str
    tasks: tuple[UnitTask, ...]
    transfers: tuple[TaskTransfer, ...]
    makespan_s: float
    lower_bound_s: float
    algorithm: str
    status: str
    runs: tuple[AlgorithmRun, ...]
    strategy_makespans: Mapping[str, Mapping[str, float]] = field(default_factory=dict)

    @property
    def order(self) -> tuple[int, ...]:
        """Task indices in launch order (by start time)."""
        return tuple(t.task for t in sorted(self.transfers, key=lambda t: (t.start_s, t.task)))

    @property
    def speedup_vs_allgather(self) -> float | None:
        """Alpa's approach (local all-gather, in-order greedy senders) over this plan."""
        base = self.strategy_makespans.get("local_allgather", {}).get("in_order_greedy")
        return None if base is None or self.makespan_s <= 0 else base / self.makespan_s

    def shifted(self, nodes: int) -> ReshardingPlan:
        """This plan moved ``nodes`` whole nodes along the cluster (both meshes, every
        device and host id). Exact: the cost model sees only which devices share a host
        and the two link levels, so the moved problem is the same problem, and this its
        solution — the pipeline planner solves each crossing shape once this way."""
        if nodes == 0:
            return self
        dev = nodes * self.src.devices_per_node
        return replace(
            self, src=replace(self.src, node0=self.src.node0 + nodes),
            dst=replace(self.dst, node0=self.dst.node0 + nodes),
            tasks=tuple(replace(t, holders=tuple(d + dev for d in t.holders),
                                receivers=tuple(d + dev for d in t.receivers))
                        for t in self.tasks),
            transfers=tuple(replace(x, sender_host=x.sender_host + nodes,
                                    sender_device=x.sender_device + dev)
                            for x in self.transfers))

    def deliveries(self) -> list[Delivery]:
        """Every (region, destination device) transfer in launch order."""
        return [Delivery(i, self.transfers[i].sender_device, d, self.tasks[i].region)
                for i in self.order for d in self.tasks[i].receivers]

    def to_dict(self) -> dict:
        def mesh(m: SubMesh) -> dict:
            return {"node0": m.node0, "nodes": m.nodes, "local0": m.local0,
                    "devices": m.devices, "devices_per_node": m.devices_per_node}

        def link(x: Link) -> dict:  # a launch cost only where there is one (older form)
            return {"alpha": x.alpha, "beta": x.beta, **({"launch": x.launch} if x.launch else {})}

        return {
            "tensor": {"shape": list(self.tensor.shape), "dtype": self.tensor.dtype},
            "src": {"mesh": mesh(self.src), "spec": self.src_spec},
            "dst": {"mesh": mesh(self.dst), "spec": self.dst_spec},
            "links": {"intra": link(self.links.intra), "inter": link(self.links.inter)},
            "strategy": self.strategy,
            "algorithm": self.algorithm,
            "status": self.status,
            "makespan_s": self.makespan_s,
            "lower_bound_s": self.lower_bound_s,
            "tasks": [{**t.to_dict(), **self.transfers[t.index].to_dict()} for t in self.tasks],
            "order": list(self.order),
            "algorithms": [r.to_dict() for r in self.runs],
            "strategies": {k: dict(v) for k, v in self.strategy_makespans.items()},
        }

    @classmethod
    def from_dict(cls, d: Mapping) -> ReshardingPlan:
        """Inverse of :meth:`to_dict`."""
        try:
            dpn = int(d["src"]["mesh"]["devices_per_node"])
            tasks, transfers = [], []
            for t in d["tasks"]:
                tasks.append(UnitTask(int(t["index"]), tuple(tuple(r) for r in t["region"]),
                                      int(t["bytes"]), int(t["src_slice"]), int(t["dst_slice"]),
                                      tuple(t["holders"]), tuple(t["receivers"]), dpn))
                transfers.append(TaskTransfer(**{f.name: t[f.name] for f in
                                                 fields(TaskTransfer)}))
            return cls(
                TensorSpec(tuple(d["tensor"]["shape"]), d["tensor"]["dtype"]),
                SubMesh(**d["src"]["mesh"]), d["src"]["spec"],
                SubMesh(**d["dst"]["mesh"]), d["dst"]["spec"],
                HostLinks(Link(**d["links"]["intra"]), Link(**d["links"]["inter"])),
                d["strategy"], tuple(tasks), tuple(transfers), float(d["makespan_s"]),
                float(d["lower_bound_s"]), d["algorithm"], d["status"],
                tuple(AlgorithmRun(**r) for r in d["algorithms"]),
                {k: dict(v) for k, v in d.get("strategies", {}).items()},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanFormatError(f"resharding plan: malformed or missing field ({exc!r})") \
                from None

    def table(self) -> str:
        """Human-readable summary: tasks with sender and times, then the algorithms."""
        lines = [
            f"reshard {self.tensor.shape} {self.tensor.dtype}: {self.src_spec} on "
            f"{self.src.nodes}x{self.src.devices} (hosts {self.src.node0}.."
            f"{self.src.node0 + self.src.nodes - 1}) -> {self.dst_spec} on "
            f"{self.dst.nodes}x{self.dst.devices} (hosts {self.dst.node0}.."
            f"{self.dst.node0 + self.dst.nodes - 1}), strategy {self.strategy}",
            f"{'task':>4} {'region':<34} {'MiB':>8} {'from hosts':<11} {'to hosts':<11} "
            f"{'sender':>8} {'K':>4} {'start ms':>9} {'end ms':>9} {'done ms':>9}",
        ]
        for t in self.tasks:
            x = self.transfers[t.index]
            reg = "[" + ", ".join(f"{lo}:{hi}" for lo, hi in t.region) + "]"
            lines.append(
                f"{t.index:>4} {reg:<34} {t.nbytes / 2**20:>8.2f} "
                f"{','.join(map(str, t.holder_hosts)):<11} "
                f"{','.join(map(str, t.receiver_hosts)):<11} "
                f"{f'h{x.sender_host}/d{x.sender_device}':>8} {x.chunks:>4} "
                f"{x.start_s * 1e3:>9.2f} {x.end_s * 1e3:>9.2f} {x.finish_s * 1e3:>9.2f}")
        lines.append(f"makespan {self.makespan_s * 1e3:.2f} ms ({self.algorithm}, {self.status}); "
                     f"lower bound {self.lower_bound_s * 1e3:.2f} ms")
        lines.append(f"{'algorithm':<18} {'makespan ms':>12} {'/ LB':>6} {'status':<9} "
                     f"{'wall s':>7}  note")
        for r in self.runs:
            ratio = r.makespan_s / self.lower_bound_s if self.lower_bound_s > 0 else 1.0
            lines.append(f"{r.name:<18} {r.makespan_s * 1e3:>12.2f} {ratio:>6.3f} "
                         f"{r.status:<9} {r.wall_s:>7.3f}  {r.note}")
        if self.strategy_makespans:
            lines.append(f"{'strategy':<18} {'in-order greedy ms':>19} {'best heuristic ms':>18}")
            for s, v in self.strategy_makespans.items():
                lines.append(f"{s:<18} {v['in_order_greedy'] * 1e3:>19.2f} "
                             f"{v['best_heuristic'] * 1e3:>18.2f}")
            sp = self.speedup_vs_allgather
            if sp is not None:
                lines.append(f"speed-up over local all-gather with in-order greedy senders "
                             f"(Alpa): {sp:.2f}x")
        return "\n".join(lines)


def _transfers(tasks: Sequence[UnitTask], result: Result, ks: list[list[int]]
               ) -> tuple[TaskTransfer, ...]:
    out = []
    for t, s in zip(tasks, result.schedule, strict=True):
        dev = min(d for d in t.holders if d // t.devices_per_node == s.sender)
        out.append(TaskTransfer(t.index, s.sender, dev, s.start, s.end, s.finish,
                                ks[t.index][s.candidate]))
    return tuple(out)


def compare_strategies(tasks: Sequence[UnitTask], links: HostLinks,
                       options: ReshardOptions) -> dict[str, dict[str, float]]:
    """Makespan of every strategy under the paper's baseline scheduler (in-order greedy
    senders, task order) and under the better of LPT and randomised greedy."""
    out: dict[str, dict[str, float]] = {}
    for s in STRATEGIES:
        problem, _ = scheduling_problem(tasks, s, links, options.chunks, options.max_chunks)
        base = in_order_greedy(problem).makespan
        best = min(load_balance(problem).makespan,
                   randomized_greedy(problem, options.scheduler.seed, 2,
                                     options.scheduler.greedy_samples).makespan)
        out[s] = {"in_order_greedy": base, "best_heuristic": best}
    return out


def plan_resharding(
    tensor: TensorSpec,
    src: SubMesh,
    src_spec: str | Layout,
    dst: SubMesh,
    dst_spec: str | Layout,
    links: Cluster | HostLinks | tuple[Link, Link],
    options: ReshardOptions | None = None,
) -> ReshardingPlan:
    """Plan the cross-mesh resharding of ``tensor`` from ``src_spec`` on ``src`` to
    ``dst_spec`` on ``dst``: unit tasks, strategy costs, every requested scheduling
    algorithm, and the best schedule. A spec is a GSPMD string on the ``(hosts, devices)``
    view of the mesh or a partial-free :class:`Layout` on any factorisation of it.
    ``links`` is the cluster (whose size the meshes must fit) or just its two link levels."""
    opts = options or ReshardOptions()
    check_meshes(src, dst, links if isinstance(links, Cluster) else None)
    host_links = HostLinks.of(links)
    tasks = unit_tasks(tensor, src, src_spec, dst, dst_spec)
    problem, ks = scheduling_problem(tasks, opts.strategy, host_links, opts.chunks,
                                     opts.max_chunks)
    results = solve_all(problem, opts.scheduler)
    best = best_result(results)
    runs = tuple(AlgorithmRun(r.algorithm, r.status.value, r.makespan, r.wall_s, r.note)
                 for r in results.values())
    strategies = compare_strategies(tasks, host_links, opts) if opts.compare_strategies else {}
    return ReshardingPlan(tensor, src, spec_text(src_spec, tensor.rank), dst,
                          spec_text(dst_spec, tensor.rank), host_links, opts.strategy,
                          tasks, _transfers(tasks, best, ks), best.makespan,
                          problem.lower_bound(), best.algorithm, best.status.value, runs,
                          strategies)


def with_scheduler(options: ReshardOptions, **changes) -> ReshardOptions:
    """A copy of ``options`` with scheduler fields changed (``algorithms=...``, ...)."""
    return replace(options, scheduler=replace(options.scheduler, **changes))
