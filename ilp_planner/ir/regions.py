"""Tensor regions: the block of a tensor each device of a layout holds, and how blocks meet.

A :data:`Region` is ``[lo, hi)`` per tensor dimension. Blocks follow :meth:`Layout.regions`
(the runtime's nested ``torch.chunk`` geometry), so the planner's unit tasks, the plan check
and the runtime's transfers all cut a tensor the same way. One definition of each: a region,
the blocks of a layout (:func:`layout_blocks`, mesh order; :func:`device_regions`, keyed by
global device id on a placed sub-mesh), and the intersection of two regions
(:func:`intersect`, empty when :func:`region_empty`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ilp_planner.errors import LayoutError
from ilp_planner.ir.cluster import SubMesh
from ilp_planner.ir.graph import TensorSpec
from ilp_planner.ir.layouts import Layout

Region = tuple[tuple[int, int], ...]  # [lo, hi) per tensor dimension


def chunk_bounds(n: int, k: int, j: int) -> tuple[int, int]:
    """Piece ``j`` of ``n`` split ``k`` ways, torch.chunk style (ceil size, short tail)."""
    c = -(-n // k)
    return min(j * c, n), min((j + 1) * c, n)


def layout_blocks(layout: Layout, shape: Sequence[int]) -> list[Region]:
    """The region device ``i`` (mesh order) holds; a layout with partial sums holds no block."""
    if layout.has_partial:
        raise LayoutError(f"layout {layout} has partial sums: its devices hold no block")
    return [tuple((int(lo), int(hi)) for lo, hi in dev) for dev in layout.regions(tuple(shape))]


def device_regions(tensor: TensorSpec, mesh: SubMesh, layout: Layout) -> dict[int, Region]:
    """Global device id → the region that device holds under ``layout``, for the mesh-ordered
    (host-major) devices of a sub-mesh placed in the cluster."""
    blocks = layout.regions(tensor.shape)
    out: dict[int, Region] = {}
    for m in range(mesh.size):
        node, local = divmod(m, mesh.devices)
        out[(mesh.node0 + node) * mesh.devices_per_node + mesh.local0 + local] = tuple(
            (int(lo), int(hi)) for lo, hi in blocks[m])
    return out


def region_empty(region: Region) -> bool:
    return any(hi <= lo for lo, hi in region)


def region_numel(region: Region) -> int:
    return math.prod(max(0, hi - lo) for lo, hi in region)


def intersect(a: Region, b: Region) -> Region:
    """The common part of two regions (empty, per :func:`region_empty`, when they miss)."""
    return tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b, strict=True))
