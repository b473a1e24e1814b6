"""An edge program of the plan run on a DTensor's local block, for :mod:`runtime.apply`.

The user's tensors carry real dims (``(batch, …, features)``); the lowered programs work on
the IR's tokens-major blocks. Tokens split over the batch dim only, so a real block viewed
as ``(rows, features)`` is exactly the IR block, and the program's result goes back to the
real dims of the destination placements.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ilp_planner.ir.graph import Graph
from ilp_planner.ir.layouts import Layout, grad_layout
from ilp_planner.lowering.redistribution import Redistribution
from runtime.comm import Comm, LVal
from runtime.dtensors import DimMap, Meshes, Unwrap, Wrap, dtensor_spec, placements
from runtime.errors import FidelityError


class EdgeRunner:
    """Runs and checks the plan's layouts on the module's DTensors."""

    def __init__(self, graph: Graph, comm: Comm, meshes: Meshes):
        self.graph = graph
        self.comm = comm
        self.meshes = meshes

    def dims(self, name: str, real: torch.Tensor | DTensor, heads: int | None = None) -> DimMap:
        """How op ``name``'s IR output dims sit in the real tensor ``real`` (viewed per head,
        the heads at real dim ``heads``, where a per-head norm reads or writes it)."""
        return DimMap(tuple(real.shape), self.graph[name].output.rank, heads=heads)

    def run(self, x: DTensor, src: Layout, red: Redistribution, dst: Layout, name: str,
            where: str, heads: int | None = None) -> DTensor:
        """Run the edge program on this rank's block: the real block viewed as the IR's
        tokens-major block (tokens split over the batch dim only, so whole rows), then back
        to the real dims of the destination placements."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        dims = self.dims(name, x, heads)
        grad_src = placements(grad_layout(src), dims, where)
        local = Unwrap.apply(x, dtensor_spec(self.meshes.of(src), grad_src, x, tuple(x.shape)))
        y = self.comm.edge(LVal(dims.ir_block(local), src), red, "activation", where).t
        dst_pls = placements(dst, dims, where)
        shape, _ = compute_local_shape_and_global_offset(x.shape, self.meshes.of(dst), dst_pls)
        y = dims.real_block(y, tuple(shape))
        grad_dst = placements(red.grad_dst or grad_layout(dst), dims, where)
        return Wrap.apply(y, dtensor_spec(self.meshes.of(dst), dst_pls, x, tuple(x.shape)),
                          grad_dst, where)

    def check(self, x: Any, layout: Layout, name: str, where: str,
              heads: int | None = None) -> None:
        """``x`` must be a DTensor in ``layout``'s placements: a difference is an error,
        never a silent redistribution."""
        if not isinstance(x, DTensor):
            raise FidelityError(f"{where}: expected a DTensor in {layout}, got "
                                f"{type(x).__name__} (a tensor made outside the plan's inputs)")
        want = placements(layout, self.dims(name, x, heads), where)
        if tuple(x.placements) != want or x.device_mesh != self.meshes.of(layout):
            raise FidelityError(f"{where}: DTensor placements {tuple(x.placements)}, the plan "
                                f"has {layout} = {want}")
