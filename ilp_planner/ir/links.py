"""Interconnect catalogue: what one link level achieves under NCCL, from published figures.

A :class:`LinkSpec` is one link level of a cluster (``cluster: {intra: nvlink3, inter:
8x-ib-hdr200}``) as the collective model (:mod:`ilp_planner.lowering.cost_model`) needs it:

- **β = 1 / bus bandwidth**, where the bus bandwidth is nccl-tests' ``busbw`` of a
  large-message ``all_reduce_perf``. nccl-tests defines busbw so that an AllReduce of n
  bytes over p ranks takes ``2(p−1)/p · n / busbw`` — the ring formula with β = 1/busbw —
  so a measured busbw is exactly the β the model wants, with every protocol and topology
  overhead in it. Line rates overstate it by 20–60 %.
- **α per ring step** and the **per-call launch cost**: NCCL's own tuning model
  (``src/graph/tuning.cc`` of NVIDIA/nccl, the version at commit 01afd20: ``hwLat`` per
  hardware level, ``baseLat`` per call, both for the LL protocol, which NCCL uses for the
  small messages where latency matters). These are NVIDIA's fit to its measurements, not
  ours; where a transport has no tuning entry (TCP sockets) a measured small-message time
  stands in, as noted.

Every figure says beside it whether it was **measured** (a published nccl-tests run, cited)
or **derived** (how, from which measured figure). NIC-based entries take an ``<N>x-``
prefix for N NICs per node (``8x-ib-hdr200``): bus bandwidth scales with the NIC count
(NCCL gives every GPU of a node its own NIC and rail), latency does not — that scaling is
derived, not measured per count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ilp_planner.errors import ConfigError
from ilp_planner.ir.cluster import Cluster, Link
from ilp_planner.ir.device import device_spec

_US = 1e-6
_GB = 1e9
MAX_NICS = 64  # beyond any node built; a larger count is a typo


@dataclass(frozen=True)
class LinkSpec:
    """One catalogue link: per-step latency (µs), bus bandwidth (GB/s = 10^9 B/s, per
    node for NIC entries: per NIC times the count), per-call launch cost (µs), and whether
    the name takes an ``<N>x-`` NIC-count prefix."""

    name: str
    latency_us: float
    busbw_gbs: float
    launch_us: float
    per_nic: bool = False

    def link(self, nics: int = 1) -> Link:
        """The α–β–launch triple of this link with ``nics`` NICs per node."""
        return Link(alpha=self.latency_us * _US, beta=1.0 / (self.busbw_gbs * nics * _GB),
                    launch=self.launch_us * _US)


# NCCL tuning model (tuning.cc @ 01afd20), LL protocol: per-step hwLat NVLink 0.47 µs,
# PCI 1.0 µs, NET 2.7 µs; per-call baseLat (ring, LL) 6.6 µs.
_NVLINK_LAT, _PCI_LAT, _NET_LAT, _BASE_LAT = 0.47, 1.0, 2.7, 6.6

LINKS: tuple[LinkSpec, ...] = (
    # NVLink 2 (V100 SXM2, 6 links × 25 GB/s per direction = 150 GB/s line). DERIVED:
    # NVLink 3's measured busbw / line rate (230 / 300 = 0.77) applied to 150 GB/s.
    LinkSpec("nvlink2", _NVLINK_LAT, 115.0, _BASE_LAT),
    # NVLink 3 (A100 SXM4, NVSwitch, 300 GB/s line). MEASURED: 8 GPUs all_reduce busbw
    # 230.8 GB/s at 1 GiB (NVIDIA/nccl#527, p4dn.24xlarge) and 232.5 GB/s
    # (NVIDIA/nccl-tests#175); NCCL's tuning model caps A100 at 235.
    LinkSpec("nvlink3", _NVLINK_LAT, 230.0, _BASE_LAT),
    # NVLink 4 (H100/H200 SXM, NVSwitch, 450 GB/s line). MEASURED: ring busbw ~370 GB/s,
    # "the effective NVLink bandwidth" (NCCL maintainer, NVIDIA/nccl-tests#212). NVLink
    # SHARP AllReduce reaches ~476-480 GB/s (nccl-tests#212, #290, #272); not modelled,
    # so an intra-node H100 AllReduce is priced ~25 % high.
    LinkSpec("nvlink4", _NVLINK_LAT, 370.0, _BASE_LAT),
    # PCIe 5 x16 (63 GB/s line per direction). MEASURED: 8 GPUs (RTX 5090) all_reduce
    # busbw 28 GB/s, bound by the host's CPU and memory as on most PCIe servers
    # (NVIDIA/nccl#1639, maintainer's reply).
    LinkSpec("pcie5", _PCI_LAT, 28.0, _BASE_LAT),
    # PCIe 4 x16 (31.5 GB/s line). DERIVED: PCIe 5's measured busbw / line (28 / 63)
    # applied to 31.5 GB/s.
    LinkSpec("pcie4", _PCI_LAT, 14.0, _BASE_LAT),
    # InfiniBand HDR, 200 Gb/s per NIC (25 GB/s line). MEASURED: 3 nodes × 8 A100 with
    # 4 HDR NICs each, all_reduce peak busbw ~96 GB/s = 24 GB/s per NIC
    # (NVIDIA/nccl-tests#119); 2 nodes × 4 HDR: 86 GB/s (nccl-tests#175).
    LinkSpec("ib-hdr200", _NET_LAT, 24.0, _BASE_LAT, per_nic=True),
    # InfiniBand NDR, 400 Gb/s per NIC (50 GB/s line). MEASURED figure given by the NCCL
    # maintainers: "For NDR @ 400Gbps you should see 46-48GB/s per NIC"
    # (NVIDIA/nccl-tests#290).
    LinkSpec("ib-ndr400", _NET_LAT, 47.0, _BASE_LAT, per_nic=True),
    # 25 Gb/s Ethernet over TCP sockets (e.g. AWS p3.16xlarge, no RDMA), 3.125 GB/s line.
    # DERIVED: NCCL over TCP reaches at most ~60 % of wire speed (NVIDIA/nccl#209, on
    # 32 Gb/s) → 1.9 GB/s. Latency MEASURED: an 8-byte broadcast between two nodes over
    # TCP takes 45.8 µs (NVIDIA/nccl-tests#82), less the 6.6 µs base → 39 µs per step.
    LinkSpec("eth-25g", 39.0, 1.9, _BASE_LAT, per_nic=True),
    # 100 and 400 Gb/s Ethernet with RDMA (RoCE v2). DERIVED: InfiniBand's measured
    # busbw / line (HDR 24 / 25, NDR 47 / 50: 0.94-0.96) applied to 12.5 and 50 GB/s;
    # NCCL's NET latency, as for InfiniBand.
    LinkSpec("eth-100g", _NET_LAT, 12.0, _BASE_LAT, per_nic=True),
    LinkSpec("eth-400g", _NET_LAT, 47.0, _BASE_LAT, per_nic=True),
)

_NAME = re.compile(r"^(?:(\d+)x-)?([a-z0-9-]+)$")


def link_names() -> list[str]:
    """Every catalogue name as the docs and errors show it (``[<N>x-]`` where a NIC count
    may prefix it)."""
    return [("[<N>x-]" if s.per_nic else "") + s.name for s in LINKS]


def link_spec(name: str) -> tuple[LinkSpec, int]:
    """The catalogue entry called ``name`` (case-insensitive) and its NIC count."""
    m = _NAME.match(name.strip().lower()) if isinstance(name, str) else None
    spec = next((s for s in LINKS if m and s.name == m.group(2)), None)
    if spec is None or (m.group(1) and not spec.per_nic):
        raise ConfigError(f"unknown link {name!r}; expected one of {link_names()} "
                          f"(N = NICs per node, 1 to {MAX_NICS})")
    nics = int(m.group(1) or 1)
    if not 1 <= nics <= MAX_NICS:
        raise ConfigError(f"link {name!r}: expected 1 to {MAX_NICS} NICs per node, got {nics}")
    return spec, nics


def catalogue_link(name: str) -> Link:
    """The :class:`Link` of a catalogue name (``nvlink3``, ``8x-ib-hdr200``)."""
    spec, nics = link_spec(name)
    return spec.link(nics)


def catalogue_cluster(gpu: str, nodes: int, devices_per_node: int, intra: str, inter: str,
                      dtype: str = "bfloat16", efficiency: float = 0.5,
                      collectives: str = "nccl") -> Cluster:
    """A cluster from catalogue names, as ``cluster: {gpu: …, intra: …, inter: …}`` parses
    it: the device's memory, its dense peak for ``dtype`` (the half-precision tensor-core
    peak for float16 / bfloat16 models, else fp32's), the NCCL collective model."""
    device = device_spec(gpu)
    return Cluster(nodes, devices_per_node, device.memory_bytes, device.peak(dtype),
                   catalogue_link(intra), catalogue_link(inter), efficiency,
                   f"{nodes}x{devices_per_node}-{device.name}", device, collectives)
