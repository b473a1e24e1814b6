"""The user's parameters as DTensors in their planned placements, and their gradients'
reduction in the plan's buckets, for :mod:`runtime.apply`.

Each rank keeps its block of the value the module already holds (seed it identically on
every rank). Once every gradient of the step has accumulated, the weight gradients are
AllReduced in the plan's chunks (:func:`ilp_planner.lowering.grad_buckets.fill_buckets`) and
handed to the optimizer in the parameter's placements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ilp_planner.ir.graph import Graph, Op
from ilp_planner.ir.layouts import Layout
from ilp_planner.lowering.grad_buckets import GradBucket
from ilp_planner.lowering.strategies import param_layouts, param_shapes
from ilp_planner.plan.data import LayerPlan
from runtime.comm import Comm
from runtime.dtensors import ContextStack, DimMap, Meshes, dtensor_spec, placements
from runtime.errors import FidelityError, RuntimeSetupError
from runtime.mesh import MeshRegistry
from runtime.recorder import tagged


@dataclass(frozen=True)
class PlacedParam:
    """A parameter of the user's module as placed: the DTensor, its stored and gradient
    layouts, and how the IR's dims sit in it."""

    param: nn.Parameter
    stored: Layout
    grad: Layout
    dims: DimMap


def owner_of(module: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    """The submodule holding parameter ``fqn``, and the parameter's attribute name."""
    owner_path, _, attr = fqn.rpartition(".")
    return (module.get_submodule(owner_path) if owner_path else module), attr


class AppliedParams:
    """Places every parameter of the plan's ops and reduces their gradients each step."""

    def __init__(self, graph: Graph, layers: dict[str, LayerPlan], module: nn.Module,
                 comm: Comm, meshes: Meshes, chunks: tuple[GradBucket, ...],
                 registry: MeshRegistry, replicating: ContextStack):
        self.graph = graph
        self.layers = layers
        self.module = module
        self.comm = comm
        self.meshes = meshes
        self.chunks = chunks
        self.registry = registry
        self.replicating = replicating  # left once the gradients are reduced
        self.devices = comm.devices
        self.by_fqn: dict[str, PlacedParam] = {}
        for op in graph.ops:
            if op.source_params:
                self._place(op)
        self._pending = 0
        for fqn, placed in self.by_fqn.items():
            placed.param.register_post_accumulate_grad_hook(
                lambda p, fqn=fqn: self._grad_ready(fqn))

    def _place(self, op: Op) -> None:
        """Replace ``op``'s parameters in the module by DTensors of this rank's blocks."""
        ly = self.layers[op.name]
        lays = param_layouts(op, ly.strategy, ly.inputs, ly.weight, ly.output)
        shapes = param_shapes(op)
        if len(shapes) != len(op.source_params):
            raise RuntimeSetupError(f"op {op.name!r} owns parameters {op.source_params} but "
                                    f"the plan prices {list(shapes)}")
        for role, fqn in zip(shapes, op.source_params, strict=True):
            owner, attr = owner_of(self.module, fqn)
            full = owner.get_parameter(attr).detach()
            ir_shape = shapes[role]
            transposed = role == "weight" and bool(op.attrs.get("weight_t"))
            if tuple(full.shape) != (tuple(ir_shape)[::-1] if transposed else tuple(ir_shape)):
                raise RuntimeSetupError(f"parameter {fqn} has shape {tuple(full.shape)}, the "
                                        f"plan's op {op.name!r} expects {ir_shape}")
            stored, grad = lays[role]
            dims = DimMap(tuple(full.shape), len(ir_shape), transposed)
            local = self.comm.block(full.t() if transposed else full, stored)
            local = local.t().contiguous() if transposed else local
            pls = placements(stored, dims, f"parameter {fqn}")
            dt = DTensor(local.clone(), dtensor_spec(self.meshes.of(stored), pls, full,
                                                     tuple(full.shape)),
                         requires_grad=True)
            param = nn.Parameter(dt)
            setattr(owner, attr, param)
            self.by_fqn[fqn] = PlacedParam(param, stored, grad, dims)

    def _grad_ready(self, fqn: str) -> None:
        self._pending += 1
        if self._pending == len(self.by_fqn):
            self._pending = 0
            self._sync_grads()

    def _sync_grads(self) -> None:
        """Check every gradient's placements, then AllReduce the plan's buckets (the
        backward is over: plain tensors stop acting as replicas)."""
        self.replicating.leave()
        locals_ = self._local_grads()
        by_role = {(op.name, role): fqn for op in self.graph.ops
                   for role, fqn in zip(param_shapes(op), op.source_params, strict=False)}
        flat = self._flat_buffers(locals_, by_role)
        for c in self.chunks:
            with tagged("backward", "grad_sync", c.launcher):
                dist.all_reduce(flat[c.buffer][c.start:c.stop],
                                group=self.registry.axes_group(self.devices, c.fact, c.axes))
        self._hand_back(flat, locals_, by_role)
        for fqn, p in self.by_fqn.items():
            if p.grad == p.stored or not p.grad.has_partial:
                continue
            if tuple(p.param.grad.placements) != placements(p.stored, p.dims, fqn):
                raise FidelityError(f"gradient of {fqn} was not reduced by any bucket")

    def _local_grads(self) -> dict[str, torch.Tensor]:
        """Every parameter's local gradient block, its placements checked against the ones
        the plan's weight-gradient synchronisation expects."""
        out: dict[str, torch.Tensor] = {}
        for fqn, p in self.by_fqn.items():
            want = placements(p.grad, p.dims, f"gradient of {fqn}")
            got = tuple(p.param.grad.placements)
            if got != want:
                raise FidelityError(f"gradient of {fqn} arrives as {got}; the plan's weight-"
                                    f"gradient synchronisation expects {want}")
            out[fqn] = p.param.grad._local_tensor
        return out

    def _flat_buffers(self, locals_: dict[str, torch.Tensor],
                      by_role: dict[tuple[str, str], str]) -> dict[int, torch.Tensor]:
        """Each device group's flat buffer: its members' gradients concatenated in order."""
        flat: dict[int, torch.Tensor] = {}
        for c in self.chunks:
            if c.buffer in flat:
                continue
            seen, parts = set(), []
            for m in (m for cc in self.chunks if cc.buffer == c.buffer for m in cc.members):
                if (m.layer, m.start) in seen:
                    continue
                seen.add((m.layer, m.start))
                parts += [locals_[by_role[(m.layer, role)]].reshape(-1) for role in m.roles]
            flat[c.buffer] = torch.cat(parts)
        return flat

    def _hand_back(self, flat: dict[int, torch.Tensor], locals_: dict[str, torch.Tensor],
                   by_role: dict[tuple[str, str], str]) -> None:
        """Each reduced gradient, read from its slice of the flat buffer, becomes the
        parameter's ``.grad`` in its stored placements."""
        offsets: dict[int, int] = {}
        done: set = set()
        for c in self.chunks:
            for m in c.members:
                if (c.buffer, m.layer, m.start) in done:
                    continue
                done.add((c.buffer, m.layer, m.start))
                at = offsets.get(c.buffer, 0)
                for role in m.roles:
                    fqn = by_role[(m.layer, role)]
                    p = self.by_fqn[fqn]
                    n = locals_[fqn].numel()
                    reduced = flat[c.buffer][at:at + n].view_as(locals_[fqn])
                    at += n
                    pls = placements(p.stored, p.dims, f"parameter {fqn}")
                    p.param.grad = DTensor(reduced.clone(),
                                           dtensor_spec(self.meshes.of(p.stored), pls, reduced,
                                                        tuple(p.param.shape)),
                                           requires_grad=False)
                offsets[c.buffer] = at
