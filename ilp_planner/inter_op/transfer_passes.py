"""The local kernels a cross-mesh transfer runs beside its broadcasts, as
:class:`runtime.transfers.Transfers` runs them each micro-batch — priced so that a pipelined
stage's seconds are its devices' whole work, not only its layers' and the links'.

On the source stage, every device: each forward task it sends is a slice of its block,
copied where the slice is not contiguous; the gradient's block is allocated zeroed (one fill)
and each backward task it receives copied into it. On the destination stage, every device:
each forward task it receives copied into its block; each backward task it sends a slice of
its gradient's block, copied where not contiguous. Each copy reads and writes its slice's
bytes; the fill writes the block's."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ilp_planner.ir.cluster import Cluster
from ilp_planner.ir.graph import TensorSpec
from ilp_planner.ir.layouts import Layout
from ilp_planner.ir.regions import layout_blocks
from ilp_planner.lowering.compute_model import PhaseWork, phase_seconds
from ilp_planner.plan.data import ReshardingEntry, Stage

Region = tuple[tuple[int, int], ...]


def transfer_passes(entry: ReshardingEntry, stages: Sequence[Stage], rank: int) -> PhaseWork:
    """The kernels and bytes ``rank`` runs for ``entry`` each micro-batch (module
    docstring): nothing unless it is a device of the entry's source or destination stage."""
    item = TensorSpec(entry.shape, entry.dtype).itemsize
    if rank in stages[entry.src_stage].devices:
        mine = _block(entry, stages, entry.src_stage, entry.src_layout, rank)
        sent = [t.region for t in entry.tasks if t.sender == rank]
        got = [t.region for t in entry.backward_tasks if rank in t.receivers]
        fill = (1, math.prod(_extent(mine)))
    elif rank in stages[entry.dst_stage].devices:
        mine = _block(entry, stages, entry.dst_stage, entry.dst_layout, rank)
        sent = [t.region for t in entry.backward_tasks if t.sender == rank]
        got = [t.region for t in entry.tasks if rank in t.receivers]
        fill = (0, 0)
    else:
        return PhaseWork(0.0, 0.0, 0)
    copied = [r for r in sent if not _contiguous(_extent(r), _extent(mine))] + got
    elements = fill[1] + 2 * sum(math.prod(_extent(r)) for r in copied)
    return PhaseWork(0.0, float(item * elements), fill[0] + len(copied))


def transfer_passes_seconds(entry: ReshardingEntry, stages: Sequence[Stage], stage: int,
                            cluster: Cluster) -> float:
    """Seconds a micro-batch of ``entry``'s :func:`transfer_passes` on ``stage`` (its source
    or destination), at its slowest device; 0 on a flat cluster."""
    if cluster.device is None:
        return 0.0
    return max(phase_seconds(transfer_passes(entry, stages, r), cluster.device, entry.dtype)
               for r in stages[stage].devices)


def _block(entry: ReshardingEntry, stages: Sequence[Stage], stage: int, layout: Layout,
           rank: int) -> Region:
    return layout_blocks(layout, entry.shape)[stages[stage].devices.index(rank)]


def _extent(region: Region) -> tuple[int, ...]:
    return tuple(b - a for a, b in region)


def _contiguous(extent: tuple[int, ...], block: tuple[int, ...]) -> bool:
    """Whether a slice of ``extent`` of a row-major ``block`` is contiguous (``torch``'s
    rule: every dim after the first holding more than one element is whole)."""
    spread = False
    for e, b in zip(extent, block, strict=True):
        if spread and e != b:
            return False
        spread = spread or e > 1
    return True

