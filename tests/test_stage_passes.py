"""The local kernels around a pipeline's stage boundaries, priced by hand: a cross-mesh
transfer's copies (:mod:`ilp_planner.inter_op.transfer_passes`) and a tied table's exchange
across two stages (:func:`~ilp_planner.lowering.strategies.cross_stage_tied_passes_seconds`).
That the runtime dispatches exactly these, rank by rank, is
``tests/test_step_kernels.py::test_a_pipelined_step_prices_the_kernels_every_rank_dispatches``."""

from __future__ import annotations

import pytest

from ilp_planner.inter_op.transfer_passes import transfer_passes, transfer_passes_seconds
from ilp_planner.ir.cluster import Cluster, Link, MeshAxis
from ilp_planner.ir.device import ComputeFit, DeviceSpec
from ilp_planner.ir.graph import TensorSpec
from ilp_planner.ir.layouts import Layout, S
from ilp_planner.lowering.compute_model import PhaseWork
from ilp_planner.lowering.strategies import cross_stage_tied_passes_seconds
from ilp_planner.plan.data import ReshardingEntry, Stage, UnitTask

HBM, FLOOR, HOST = 2e12, 5e-6, 30e-6
TWO = (MeshAxis(1, 2),)


def _cluster(device: bool = True) -> Cluster:
    dev = DeviceSpec("t", 80 * 2**30, {"float32": 20e12}, HBM, (),
                     ComputeFit(0.8, 128.0, 1.0, FLOOR, "flash", HOST, 0.0)) if device else None
    link = Link(1e-5, 1e-10)
    return Cluster(1, 4, 80 * 2**30, 300e12, link, link, 0.5, "t", dev)


def _seconds(kernels: int, nbytes: float) -> float:
    return max(nbytes / HBM + kernels * FLOOR, kernels * HOST)


def _task(region, sender: int, receivers: tuple[int, ...]) -> UnitTask:
    return UnitTask(region, sender, (sender,), receivers, 0.0)


STAGES = [Stage(0, (0, 1), (1, 2), ()), Stage(1, (2, 3), (1, 2), ())]
ROWS, COLS = ((0, 2), (2, 4)), ((0, 3), (3, 6))
# a (4, 6) float32 tensor from rows over ranks 0, 1 to columns over ranks 2, 3: each sender's
# row block is cut in two column halves (not contiguous), each receiver's column block
# assembled from two row halves; its gradient comes back the other way (a receiver's rows
# of its column block are contiguous)
ENTRY = ReshardingEntry(
    0, 1, "a", "b", (4, 6), "float32", Layout(TWO, (S(0),)), Layout(TWO, (S(1),)),
    tuple(_task((r, c), 0 + i, (2 + j,)) for i, r in enumerate(ROWS) for j, c in enumerate(COLS)),
    tuple(_task((r, c), 2 + j, (0 + i,)) for i, r in enumerate(ROWS) for j, c in enumerate(COLS)))


def test_a_transfer_prices_each_copy_and_fill_its_ranks_run() -> None:
    # a sender: two slices of 6 copied to send, the gradient's block (12) zeroed and its
    # two halves copied in
    assert transfer_passes(ENTRY, STAGES, 0) == PhaseWork(0.0, 4 * (12 + 2 * 24), 5)
    # a receiver: its two halves copied in; its gradient's rows leave as they lie
    assert transfer_passes(ENTRY, STAGES, 3) == PhaseWork(0.0, 4 * 24, 2)
    assert transfer_passes(ENTRY, [*STAGES, Stage(2, (4,), (1, 1), ())], 4).kernels == 0
    cluster = _cluster()
    assert transfer_passes_seconds(ENTRY, STAGES, 0, cluster) == pytest.approx(
        _seconds(5, 240), rel=1e-12)
    assert transfer_passes_seconds(ENTRY, STAGES, 1, cluster) == pytest.approx(
        _seconds(2, 96), rel=1e-12)
    assert transfer_passes_seconds(ENTRY, STAGES, 0, _cluster(device=False)) == 0.0


@pytest.mark.parametrize("head,layout,devices,kernels,nbytes", [
    # the embedding's side, its vocabulary split: only the fill, 4 bytes a table element
    (False, Layout(TWO, (S(0),)), 2, 1, 4 * 48),
    # its columns split: its block cut back too (8 bytes an element of it)
    (False, Layout(TWO, (S(1),)), 2, 2, 4 * 48 + 8 * 24),
    # the head's: the fill, the transposed copy of the table, its block cut back
    (True, Layout(TWO, (S(0),)), 2, 3, 4 * 48 + 8 * 48 + 8 * 24),
    # alone on its stage: no fill
    (True, Layout.replicated((MeshAxis(1, 1),)), 1, 2, 8 * 48 + 8 * 48),
])
def test_a_tied_exchange_across_stages_prices_its_passes_by_hand(
        head: bool, layout: Layout, devices: int, kernels: int, nbytes: float) -> None:
    table = TensorSpec((6, 8) if head else (8, 6))  # the head sees the (8, 6) table transposed
    got = cross_stage_tied_passes_seconds(layout, table, head, devices, _cluster())
    assert got == pytest.approx(_seconds(kernels, nbytes), rel=1e-12)
    assert cross_stage_tied_passes_seconds(layout, table, head, devices,
                                           _cluster(device=False)) == 0.0
