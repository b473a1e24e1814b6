"""Apply a solved plan to the user's own ``nn.Module`` (``plan.parallelize(module)``).

The module was imported (:func:`ilp_planner.inputs.importer.from_module`), so each op of the plan's
graph names the user's module path and parameters. :func:`parallelize` turns the module into
the plan's program, in place, on every rank of the job:

* **parameters** become DTensors in their planned placements (each rank keeps its block of
  the value the module already holds — seed it identically on every rank);
* **edges**: every layout change the plan prices between two ops runs its lowered program
  (:func:`ilp_planner.plan.programs.edge_programs`, the ones the planner priced and ``explain``
  prints) on this rank's block, through the runtime's :class:`~runtime.comm.Comm` — in a
  forward pre-hook of the consumer's module, or a forward hook of the producer's module when
  the consumer is functional code; autograd runs the program's backward steps;
* **inside an op** the user's code runs on DTensors whose placements are the planned ones,
  so DTensor's sharding propagation finds the planned strategy without communicating; the
  hooks check every placement at every module boundary, forward and backward, and a
  difference is an error (:class:`~runtime.errors.FidelityError`), never a silent
  redistribution;
* **weight gradients** are reduced in the plan's buckets
  (:func:`ilp_planner.lowering.grad_buckets.fill_buckets`) once every gradient of the step has
  accumulated, then handed to the optimizer in the parameter's placements.

Everything the program issues is tagged for the dispatch-level
:class:`~runtime.recorder.Recorder`, so :func:`audit` compares it with what the plan prices
(:func:`ilp_planner.plan.audit.predicted`): a collective DTensor slipped in is ``untagged`` and
shows as a mismatch. The loss is the user's code on the module's output (a DTensor in the
planned layout of the loss's input); its scalar reduction is not part of the comparison.

What it refuses, naming the op: pipelined or micro-batched plans, tied weights (one
parameter in two layouts), a layout change between two ops written as functional code (no
module boundary to run it at), an op whose module runs several of the plan's ops, a token
split the module's batch dimension cannot carry, and meshes that are not a row-major view of
the ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.experimental import implicit_replication

from ilp_planner.inputs.config import parse_config
from ilp_planner.ir.cluster import Factorisation, axis_coordinates
from ilp_planner.ir.graph import Graph, OpKind
from ilp_planner.ir.layouts import B, Layout, Split, drop_unit_axes, grad_layout
from ilp_planner.ir.layouts import Partial as IRPartial
from ilp_planner.lowering.grad_buckets import fill_buckets
from ilp_planner.lowering.redistribution import Redistribution
from ilp_planner.lowering.strategies import (
    StrategyContext,
    grad_sync,
    input_grad_layouts,
    is_summa,
    param_layouts,
    param_shapes,
)
from ilp_planner.plan.audit import AuditRow, compare, executed, predicted
from ilp_planner.plan.data import Plan
from ilp_planner.plan.programs import edge_programs
from runtime.comm import Comm, LVal
from runtime.errors import FidelityError, RuntimeSetupError
from runtime.mesh import MeshRegistry
from runtime.ops import bias_share
from runtime.recorder import tagged

GROUP_TIMEOUT_S = 300.0


# -- meshes and placements -----------------------------------------------------------------


def mesh_shape(layout: Layout) -> tuple[int, ...]:
    """The DeviceMesh shape a layout lives on: its mesh without size-1 axes."""
    return tuple(a.size for a in layout.fact if a.size > 1) or (1,)


def check_row_major(fact: Factorisation, world: int) -> None:
    """A layout's mesh must be the ranks in row-major order (DeviceMesh's convention)."""
    sizes = [a.size for a in fact]
    if math.prod(sizes) != world:
        raise RuntimeSetupError(f"a layout's mesh covers {math.prod(sizes)} ranks, not {world}")
    coords = axis_coordinates(fact)
    flat = np.ravel_multi_index(coords.T, sizes)
    if not np.array_equal(flat, np.arange(world)):
        raise RuntimeSetupError(
            f"mesh {sizes} is not a row-major view of the ranks (its axes interleave nodes and "
            f"devices); parallelize needs row-major meshes")


@dataclass(frozen=True)
class DimMap:
    """How the IR's tensor dims sit in the real tensor: IR ``(tokens, features)`` is the
    real ``(batch, …, features)`` (tokens split only over the batch dim), a linear's
    ``(in, out)`` weight may be stored ``(out, in)`` (``transposed``)."""

    real_shape: tuple[int, ...]
    ir_rank: int
    transposed: bool = False

    def real_dim(self, d: int) -> int:
        if self.transposed:
            return 1 - d
        if self.ir_rank == len(self.real_shape):
            return d
        return 0 if d == 0 else len(self.real_shape) - 1


def placements(layout: Layout, dims: DimMap, where: str) -> tuple:
    """The DTensor placements of an IR layout on its mesh (:func:`mesh_shape`)."""
    out: list[Any] = []
    split_of: dict[int, int] = {}
    for axis, pl in zip(layout.fact, layout.placements, strict=True):
        if axis.size == 1:
            continue
        if isinstance(pl, IRPartial):
            out.append(Partial())
        elif isinstance(pl, Split):
            real = dims.real_dim(pl.dim)
            out.append(Shard(real))
            split_of[real] = split_of.get(real, 1) * axis.size
        else:
            out.append(Replicate())
    for real, k in split_of.items():
        if dims.real_shape[real] % k:
            raise RuntimeSetupError(
                f"{where}: {layout} splits dim {real} of the module's tensor "
                f"{tuple(dims.real_shape)} {k} ways; parallelize needs even splits of the real "
                f"dims (tokens split over the batch dim only)")
    return tuple(out) or (Replicate(),)


# -- DTensor <-> local blocks, with the placements checked both ways ----------------------


def _spec(mesh: DeviceMesh, pls: tuple, like: torch.Tensor | DTensor,
          shape: tuple[int, ...]) -> DTensorSpec:
    stride = tuple(torch.empty(shape, device="meta").stride())
    return DTensorSpec(mesh, tuple(pls), tensor_meta=TensorMeta(torch.Size(shape), stride,
                                                                like.dtype))


class _Wrap(torch.autograd.Function):
    """A local block as a DTensor (no communication); its gradient must come back in the
    placements the plan's backward program starts from."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec, grad_pls: tuple, where: str):
        ctx.grad_pls, ctx.where = grad_pls, where
        return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx, grad: DTensor):
        if tuple(grad.placements) != tuple(ctx.grad_pls):
            raise FidelityError(f"{ctx.where}: the gradient arrives as {grad.placements}, the "
                                f"plan's backward program expects {ctx.grad_pls}")
        return grad._local_tensor, None, None, None


class _Unwrap(torch.autograd.Function):
    """A DTensor's local block; its gradient returns as a DTensor in ``grad_spec``."""

    @staticmethod
    def forward(ctx, x: DTensor, grad_spec: DTensorSpec):
        ctx.grad_spec = grad_spec
        return x._local_tensor.view_as(x._local_tensor)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return DTensor(g.contiguous(), ctx.grad_spec, requires_grad=False), None


# -- the applied program -------------------------------------------------------------------


@dataclass
class _Hook:
    """What one module boundary runs: per input index the edge program (or a check), and
    for the output a program for functional consumers (or a check)."""

    op: str
    inputs: dict[int, tuple[Layout, Redistribution | None, Layout]] = field(default_factory=dict)
    output: tuple[Layout, Redistribution | None] | None = None
    local: bool = False  # the module computes on this rank's blocks (see LOCAL_KINDS)


class Applied:
    """The state :func:`parallelize` attaches to the module (``module.ilp_plan``)."""

    def __init__(self, plan: Plan, module: nn.Module, device_mesh: DeviceMesh | None):
        if not dist.is_initialized():
            raise RuntimeSetupError("parallelize runs under torch.distributed (torchrun): "
                                    "initialise the default process group first")
        self.plan, self.module = plan, module
        self.config = parse_config(plan.config)
        self.graph: Graph = self.config.graph
        if plan.stages or self.config.pipeline.microbatches != 1:
            raise RuntimeSetupError("parallelize applies single-mesh plans without micro-"
                                    "batches; solve with pipeline.stages: 1, microbatches: 1")
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        if self.world != self.config.cluster.num_devices:
            raise RuntimeSetupError(f"the plan is for {self.config.cluster.num_devices} devices, "
                                    f"the job has {self.world} ranks")
        self.layers = {ly.name: ly for ly in plan.layers}
        self.devices = tuple(range(self.world))
        cl = self.config.cluster
        self.ctx = StrategyContext(cl, cl.nodes, cl.devices_per_node, self.config.memory,
                                   self.config.solver.max_weight_replication)
        self.registry = MeshRegistry(GROUP_TIMEOUT_S)
        self.comm = Comm(self.registry, self.devices, self.rank, cl, None)
        self._check_ops()
        self.edges = {(e.consumer, e.index): e.program
                      for e in edge_programs(plan, self.config, self.graph) if e.role == "edge"}
        for red in self.edges.values():
            self.comm.register(red)
        self._setup_grad_chunks()
        layouts = [lay for ly in plan.layers for lay in (*ly.inputs, ly.output)
                   if lay is not None]
        if device_mesh is not None and device_mesh.size() != self.world:
            raise RuntimeSetupError(f"device_mesh covers {device_mesh.size()} ranks, the job "
                                    f"has {self.world}")
        self.device_type = device_mesh.device_type if device_mesh is not None else (
            "cuda" if torch.cuda.is_available() else "cpu")
        self.registry.create()
        # one DeviceMesh per mesh shape the plan's layouts use (each op's operands share its
        # strategy's mesh), created in one order on every rank
        self.meshes: dict[tuple[int, ...], DeviceMesh] = {}
        for lay in layouts:
            check_row_major(drop_unit_axes(lay).fact, self.world)
        for shape in sorted({mesh_shape(lay) for lay in layouts}):
            self.meshes[shape] = DeviceMesh(self.device_type,
                                            torch.arange(self.world).reshape(shape))
        self._place_params()
        self._place_hooks()

    def mesh(self, layout: Layout) -> DeviceMesh:
        return self.meshes[mesh_shape(layout)]

    # -- checks and compile ----------------------------------------------------------------
    def _check_ops(self) -> None:
        unsupported = [ly.name for ly in self.plan.layers if ly.zero or ly.recompute]
        if unsupported:  # runtime.executor runs them on the runtime's own models
            raise RuntimeSetupError(
                f"layers {', '.join(unsupported[:4])}{' …' if len(unsupported) > 4 else ''} are "
                f"planned with state sharding or recomputation, which parallelize does not "
                f"apply to a user's module; solve with solver.state_sharding: [0] and "
                f"solver.recompute: never")
        for op in self.graph.ops:
            if op.kind is OpKind.LINEAR and op.attrs.get("tied"):
                raise RuntimeSetupError(f"op {op.name!r} ties its weight to an embedding: one "
                                        f"parameter in two layouts is not supported by "
                                        f"parallelize")
            if op.kind is not OpKind.INPUT and op.name not in self.layers:
                raise RuntimeSetupError(f"the plan has no layer for op {op.name!r}")

    def _setup_grad_chunks(self) -> None:
        syncs = []
        for op in self.graph.ops:
            if op.kind is OpKind.INPUT:
                continue
            ly = self.layers[op.name]
            syncs += [(op.name, b) for b in grad_sync(op, ly.strategy, ly.inputs, ly.weight,
                                                      ly.output, self.ctx)]
        self.chunks = fill_buckets(syncs, self.config.grad_bucket_bytes, self.ctx)
        listed = sorted((ly.name, c.bytes, c.group_size) for ly in self.plan.layers
                        for c in ly.collectives if c.purpose == "grad_sync")
        issued = sorted((c.launcher, c.collective.bytes, c.collective.group_size)
                        for c in self.chunks)
        if listed != issued:
            raise RuntimeSetupError(f"the plan lists gradient AllReduces {listed}, its layers "
                                    f"give {issued}; re-solve the config")
        for c in self.chunks:
            self.registry.need_axes(self.devices, c.fact, c.axes)

    # -- parameters ------------------------------------------------------------------------
    def _place_params(self) -> None:
        self.params: dict[str, tuple[nn.Parameter, Layout, Layout, DimMap]] = {}
        for op in self.graph.ops:
            if not op.source_params:
                continue
            ly = self.layers[op.name]
            lays = param_layouts(op, ly.strategy, ly.inputs, ly.weight, ly.output)
            roles = list(param_shapes(op))
            if len(roles) != len(op.source_params):
                raise RuntimeSetupError(f"op {op.name!r} owns parameters {op.source_params} but "
                                        f"the plan prices {roles}")
            for role, fqn in zip(roles, op.source_params, strict=True):
                owner_path, _, attr = fqn.rpartition(".")
                owner = self.module.get_submodule(owner_path) if owner_path else self.module
                full = owner.get_parameter(attr).detach()
                ir_shape = param_shapes(op)[role]
                transposed = role == "weight" and bool(op.attrs.get("weight_t"))
                if tuple(full.shape) != (tuple(ir_shape)[::-1] if transposed else tuple(ir_shape)):
                    raise RuntimeSetupError(f"parameter {fqn} has shape {tuple(full.shape)}, the "
                                            f"plan's op {op.name!r} expects {ir_shape}")
                stored, grad = lays[role]
                dims = DimMap(tuple(full.shape), len(ir_shape), transposed)
                ir_full = full.t() if transposed else full
                local = self.comm.block(ir_full, stored)
                local = local.t().contiguous() if transposed else local
                pls = placements(stored, dims, f"parameter {fqn}")
                dt = DTensor(local.clone(), _spec(self.mesh(stored), pls, full,
                                                  tuple(full.shape)),
                             requires_grad=True)
                param = nn.Parameter(dt)
                setattr(owner, attr, param)
                self.params[fqn] = (param, stored, grad, dims)
        self._pending = 0
        for fqn, (param, *_rest) in self.params.items():
            param.register_post_accumulate_grad_hook(lambda p, fqn=fqn: self._grad_ready(fqn))

    def _grad_ready(self, fqn: str) -> None:
        self._pending += 1
        if self._pending == len(self.params):
            self._pending = 0
            self._sync_grads()

    def _sync_grads(self) -> None:
        """Check every gradient's placements, then AllReduce the plan's buckets (the
        backward is over: plain tensors stop acting as replicas)."""
        self._leave(self._replicating)
        locals_: dict[str, torch.Tensor] = {}
        for fqn, (param, _, grad, dims) in self.params.items():
            want = placements(grad, dims, f"gradient of {fqn}")
            got = tuple(param.grad.placements)
            if got != want:
                raise FidelityError(f"gradient of {fqn} arrives as {got}; the plan's weight-"
                                    f"gradient synchronisation expects {want}")
            locals_[fqn] = param.grad._local_tensor
        by_role = {}
        for op in self.graph.ops:
            for role, fqn in zip(param_shapes(op), op.source_params, strict=False):
                by_role[(op.name, role)] = fqn
        flat: dict[int, torch.Tensor] = {}
        for c in self.chunks:
            if c.buffer not in flat:
                members = [m for cc in self.chunks if cc.buffer == c.buffer for m in cc.members]
                seen, parts = set(), []
                for m in members:
                    if (m.layer, m.start) in seen:
                        continue
                    seen.add((m.layer, m.start))
                    for role in m.roles:
                        parts.append(locals_[by_role[(m.layer, role)]].reshape(-1))
                flat[c.buffer] = torch.cat(parts)
            buf = flat[c.buffer][c.start:c.stop]
            with tagged("backward", "grad_sync", c.launcher):
                dist.all_reduce(buf, group=self.registry.axes_group(self.devices, c.fact, c.axes))
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
                    param, stored, _, dims = self.params[fqn]
                    n = locals_[fqn].numel()
                    reduced = flat[c.buffer][at:at + n].view_as(locals_[fqn])
                    at += n
                    pls = placements(stored, dims, f"parameter {fqn}")
                    param.grad = DTensor(reduced.clone(), _spec(self.mesh(stored), pls, reduced,
                                                                tuple(param.shape)),
                                         requires_grad=False)
                offsets[c.buffer] = at
        for fqn, (param, stored, grad, dims) in self.params.items():
            if grad == stored or not grad.has_partial:
                continue
            if tuple(param.grad.placements) != placements(stored, dims, fqn):
                raise FidelityError(f"gradient of {fqn} was not reduced by any bucket")

    # -- hooks -----------------------------------------------------------------------------
    def _module_of(self, name: str) -> nn.Module | None:
        try:
            sub = self.module.get_submodule(name)
        except AttributeError:
            return None
        return sub if not any(True for _ in sub.children()) else None

    def _place_hooks(self) -> None:
        g = self.graph
        hooks: dict[str, _Hook] = {}
        post_programs: dict[str, tuple[Layout, Redistribution]] = {}
        for op in g.ops:
            if op.kind is OpKind.INPUT:
                continue
            ly = self.layers[op.name]
            for idx, src in enumerate(op.inputs):
                if g[src].kind is OpKind.INPUT:
                    continue
                red = self.edges[(op.name, idx)]
                moves = bool(red.steps or red.backward_steps)
                if op.kind is OpKind.LOSS:
                    if moves:
                        post_programs[src] = (ly.inputs[idx], red)
                    continue
                if self._module_of(op.name) is not None:
                    h = hooks.setdefault(op.name, _Hook(op.name))
                    h.inputs[idx] = (self.layers[src].output, red if moves else None,
                                     ly.inputs[idx])
                elif moves:
                    prev = post_programs.get(src)
                    if prev is not None and prev[0] != ly.inputs[idx]:
                        raise RuntimeSetupError(
                            f"{src!r} feeds functional code in two layouts ({prev[0]}, "
                            f"{ly.inputs[idx]}): no module boundary can run both programs")
                    post_programs[src] = (ly.inputs[idx], red)
        for src, (dst, _) in post_programs.items():
            if self._module_of(src) is None and src != self._output_op():
                raise RuntimeSetupError(
                    f"the plan changes the layout of {src!r} ({self.layers[src].output} → {dst}) "
                    f"between two pieces of functional code; parallelize runs programs at module "
                    f"boundaries only — make {src!r} or its consumer a module")
        out_op = self._output_op()
        for op in g.ops:
            if op.kind is OpKind.INPUT or self._module_of(op.name) is None:
                continue
            h = hooks.setdefault(op.name, _Hook(op.name))
            # the module's own output is converted once, by the root's hook
            red = None if op.name == out_op else post_programs.get(op.name, (None, None))[1]
            h.output = (self.layers[op.name].output, red)
            h.local = _runs_locally(op, self.layers[op.name])
        self.hooks = hooks
        for name, h in hooks.items():
            mod = self.module.get_submodule(name)
            mod.register_forward_pre_hook(lambda m, args, h=h: self._pre(h, args))
            mod.register_forward_hook(lambda m, args, out, h=h: self._post(h, out))
        self.final = post_programs.get(out_op)
        self.module.register_forward_pre_hook(lambda m, args, kwargs: self._inputs(args, kwargs),
                                              with_kwargs=True)
        self.module.register_forward_hook(lambda m, args, out: self._output(out),
                                          always_call=True)
        self._replicating: list = []  # from the forward until the gradients are reduced
        self._origin: dict[int, tuple[DTensor, DTensor]] = {}  # converted -> (it, original)
        self._forward_only: list = []

    def _output_op(self) -> str:
        loss = [op for op in self.graph.ops if op.kind is OpKind.LOSS]
        return loss[-1].inputs[0] if loss else self.graph.ops[-1].name

    def _dims(self, name: str, real: torch.Tensor | DTensor) -> DimMap:
        return DimMap(tuple(real.shape), self.graph[name].output.rank)

    def _edge(self, x: DTensor, src: Layout, red: Redistribution, dst: Layout, name: str,
              where: str) -> DTensor:
        """Run the edge program on this rank's block: the real block viewed as the IR's
        tokens-major block (tokens split over the batch dim only, so whole rows), then back
        to the real dims of the destination placements."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        dims = self._dims(name, x)
        ir_rank = self.graph[name].output.rank
        grad_src = placements(grad_layout(src), dims, where)
        local = _Unwrap.apply(x, _spec(self.mesh(src), grad_src, x, tuple(x.shape)))
        if local.dim() != ir_rank:
            local = local.reshape(-1, local.shape[-1])
        y = self.comm.edge(LVal(local, src), red, "activation", where).t
        dst_pls = placements(dst, dims, where)
        shape, _ = compute_local_shape_and_global_offset(x.shape, self.mesh(dst), dst_pls)
        y = y.reshape(shape)
        grad_dst = placements(red.grad_dst or grad_layout(dst), dims, where)
        return _Wrap.apply(y, _spec(self.mesh(dst), dst_pls, x, tuple(x.shape)), grad_dst,
                           where)

    def _check(self, x: Any, layout: Layout, name: str, where: str) -> None:
        if not isinstance(x, DTensor):
            raise FidelityError(f"{where}: expected a DTensor in {layout}, got "
                                f"{type(x).__name__} (a tensor made outside the plan's inputs)")
        want = placements(layout, self._dims(name, x), where)
        if tuple(x.placements) != want or tuple(x.device_mesh.shape) != mesh_shape(layout):
            raise FidelityError(f"{where}: DTensor placements {tuple(x.placements)}, the plan "
                                f"has {layout} = {want}")

    def _pre(self, h: _Hook, args: tuple) -> tuple:
        args = list(args)
        op = self.graph[h.op]
        for idx, (src, red, dst) in h.inputs.items():
            producer = op.inputs[idx]
            where = f"input {idx} of {h.op}"
            origin = self._origin.get(id(args[idx]))
            if origin is not None and origin[0] is args[idx]:
                # the producer's hook converted it for functional consumers: this module's
                # own program starts from the producer's planned output, as priced
                args[idx] = origin[1]
            self._check(args[idx], src, producer, where)
            if red is not None:
                with tagged("forward", "activation", h.op):
                    args[idx] = self._edge(args[idx], src, red, dst, producer, where)
        if h.local:
            args = self._to_blocks(h, args)
        return tuple(args)

    def _to_blocks(self, h: _Hook, args: list) -> list:
        """The module's inputs and parameters as this rank's blocks for its forward; their
        gradients come back in the plan's layouts (:func:`input_grad_layouts`, the
        parameters' gradient layouts). A bias added to partial sums is each device's share
        (``b / p``, the runtime's :func:`runtime.ops.bias_share`)."""
        op, ly = self.graph[h.op], self.layers[h.op]
        grads = input_grad_layouts(op, ly.strategy, ly.inputs, ly.weight)
        for idx in range(len(op.inputs)):
            x = args[idx]
            where = f"input {idx} of {h.op}"
            if isinstance(x, DTensor):
                dims = self._dims(op.inputs[idx], x)
                args[idx] = _Unwrap.apply(x, _spec(self.mesh(grads[idx]),
                                                   placements(grads[idx], dims, where), x,
                                                   tuple(x.shape)))
        for role, fqn in zip(param_shapes(op), op.source_params, strict=True):
            param, stored, grad, dims = self.params[fqn]
            local = _Unwrap.apply(param, _spec(self.mesh(stored),
                                               placements(grad, dims, f"gradient of {fqn}"),
                                               param, tuple(param.shape)))
            if role == "bias" or role.startswith("pos"):
                local = bias_share(local, ly.output)
            owner, _, attr = fqn.rpartition(".")
            module = self.module.get_submodule(owner) if owner else self.module
            module._parameters[attr] = local  # nn.Module refuses non-Parameters via setattr
        return args

    def _restore_params(self, h: _Hook) -> None:
        for fqn in self.graph[h.op].source_params:
            owner, _, attr = fqn.rpartition(".")
            module = self.module.get_submodule(owner) if owner else self.module
            module._parameters[attr] = self.params[fqn][0]

    def _post(self, h: _Hook, out: Any) -> Any:
        layout, red = h.output
        where = f"output of {h.op}"
        if h.local:
            self._restore_params(h)
            full = self._global_shape(h.op, out, layout)
            dims = DimMap(full, self.graph[h.op].output.rank)
            out = _Wrap.apply(out, _spec(self.mesh(layout), placements(layout, dims, where), out,
                                         full),
                              placements(grad_layout(layout), dims, where), where)
        self._check(out, layout, h.op, where)
        if red is None:
            return out
        with tagged("forward", "activation", h.op):
            converted = self._edge(out, layout, red, red.dst, h.op, where)
        self._origin[id(converted)] = (converted, out)
        return converted

    def _global_shape(self, name: str, local: torch.Tensor, layout: Layout) -> tuple[int, ...]:
        """The real global shape of a block computed locally: the IR's global shape with
        the block's trailing real dims (tokens split over the batch dim only)."""
        ir = self.graph[name].output.shape
        if local.dim() == len(ir):
            return tuple(ir)
        rows = ir[0] // math.prod(local.shape[1:-1])
        return (rows, *local.shape[1:-1], ir[-1])

    def _inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The module's tensors (the same full batch on every rank) → planned blocks.

        From here until the step's gradients are reduced, plain tensors — masks and rotary
        tables the forward makes or keeps as buffers, the user's targets — act as replicas
        (DTensor's ``implicit_replication``: local, no communication; autograd replays the
        flag into the backward only if it is on when ``backward()`` is called). On CPU
        meshes SDPA takes its math path: DTensor shards its matmuls and softmax, the fused
        CPU kernel has no sharding rule."""
        self._origin: dict[int, tuple[DTensor, DTensor]] = {}
        if not self._replicating:
            ctx = implicit_replication()
            ctx.__enter__()
            self._replicating.append(ctx)
        if self.device_type == "cpu":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            ctx = sdpa_kernel([SDPBackend.MATH])
            ctx.__enter__()
            self._forward_only.append(ctx)
        inputs = [op for op in self.graph.ops if op.kind is OpKind.INPUT]
        values = list(args) + list(kwargs.values())
        if len(values) != len(inputs):
            raise RuntimeSetupError(f"the plan's graph has {len(inputs)} input(s), the module "
                                    f"got {len(values)}")
        out = []
        for op, x in zip(inputs, values, strict=True):
            wants = {self.layers[c].inputs[list(self.graph[c].inputs).index(op.name)]
                     for c in self.graph.consumers(op.name)}
            if len(wants) != 1:
                raise RuntimeSetupError(f"input {op.name!r} is read in {len(wants)} layouts")
            lay = wants.pop()
            ir_full = x.reshape(op.output.shape)
            local = self.comm.block(ir_full, lay)
            dims = DimMap(tuple(x.shape), op.output.rank)
            real_local = self._real_block(local, x, lay, dims)
            out.append(DTensor(real_local, _spec(self.mesh(lay), placements(lay, dims,
                                                                       op.name), x,
                                                 tuple(x.shape)), requires_grad=False))
        return tuple(out[:len(args)]), dict(zip(kwargs, out[len(args):], strict=True))

    @staticmethod
    def _real_block(local: torch.Tensor, x: torch.Tensor, lay: Layout, dims: DimMap
                    ) -> torch.Tensor:
        """An IR block (tokens-major) reshaped to the real tensor's dims: tokens split over
        the batch dim keep whole rows of the trailing dims."""
        if local.dim() == x.dim():
            return local.contiguous()
        k = lay.split_degree(0)
        return local.reshape(x.shape[0] // k, *x.shape[1:]).contiguous()

    def _output(self, out: Any) -> Any:
        self._leave(self._forward_only)
        name = self._output_op()
        self._check(out, self.layers[name].output, name, f"output of the module ({name})")
        if self.final is not None:
            dst, red = self.final
            with tagged("forward", "activation", name):
                out = self._edge(out, self.layers[name].output, red, dst, name,
                                 "the module's output")
        return out

    def _leave(self, contexts: list) -> None:
        while contexts:
            contexts.pop().__exit__(None, None, None)


LOCAL_KINDS = (OpKind.LINEAR, OpKind.LAYERNORM, OpKind.RMSNORM, OpKind.CONV2D, OpKind.EMBEDDING)
"""Ops whose module computes on local blocks exactly as the plan's layouts say (the runtime's
kernels' arithmetic): a matmul of blocks is the block of the product, or its partial sum; a
norm over whole rows is local. The user's other code runs on DTensors."""


def _runs_locally(op, ly) -> bool:
    if op.kind not in LOCAL_KINDS or len(op.source_params) != len(param_shapes(op)):
        return False
    if op.kind is OpKind.EMBEDDING:  # a vocabulary split needs a masked lookup
        return ly.weight is not None and ly.weight.split_degree(0) == 1
    if op.kind is OpKind.LINEAR:
        return not is_summa(ly.strategy)
    return True


def to_parallelize_plan(plan: Plan) -> dict[str, Any]:
    """The plan as PyTorch's tensor-parallel styles, for
    ``torch.distributed.tensor.parallel.parallelize_module(module, tp_mesh, plan)``, where
    its layouts are exactly those styles on one TP mesh axis:

    * a linear whose weight splits its output features over the TP axis, input replicated
      there → ``ColwiseParallel`` (output kept split on the features);
    * one whose weight splits its input features, input split on the features → output
      partial sums all-reduced to replicas → ``RowwiseParallel``;
    * an embedding split on the vocabulary → ``RowwiseParallel``, on the hidden dim →
      ``ColwiseParallel``; layers not split over the TP axis are left out.

    The TP axis is the one mesh axis every split weight uses; every other axis may only split
    the batch (data parallelism, the user's DDP / FSDP over the other mesh dim). Token splits
    over the TP axis are batch splits in this IR, not ``SequenceParallel``'s sequence splits,
    so they do not map. Raises ``ValueError`` naming the first layer that does not fit —
    ``Plan.parallelize`` runs any single-mesh plan."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    graph = parse_config(plan.config).graph
    tp_size: int | None = None
    styles: dict[str, Any] = {}
    for ly in plan.layers:
        op = graph[ly.name]
        lays = [lay for lay in (*ly.inputs, ly.output, ly.weight) if lay is not None]
        if ly.strategy.startswith("follows "):
            continue  # element-wise on its producer's layout (a GELU after a column split)
        if op.kind not in (OpKind.LINEAR, OpKind.EMBEDDING):
            if any(isinstance(pl, Split) and pl.dim != 0 for lay in lays
                   for pl in drop_unit_axes(lay).placements):
                raise ValueError(f"layer {ly.name!r} ({ly.strategy}) splits features outside a "
                                 f"linear; no tensor-parallel style does that")
            continue
        if ly.weight is None or not ly.strategy.startswith("3d"):
            raise ValueError(f"layer {ly.name!r} ({ly.strategy}) is not a 3-D matmul strategy")
        split_axes = [a for a, (ax, pl) in enumerate(zip(ly.weight.fact, ly.weight.placements,
                                                        strict=True))
                      if ax.size > 1 and isinstance(pl, Split)]
        if not split_axes:
            continue
        if len(split_axes) > 1:
            raise ValueError(f"layer {ly.name!r} ({ly.strategy}) splits its weight over "
                             f"{len(split_axes)} mesh axes; tensor-parallel styles use one")
        a = split_axes[0]
        size = ly.weight.fact[a].size
        if tp_size not in (None, size):
            raise ValueError(f"layer {ly.name!r} splits its weight {size} ways, an earlier "
                             f"layer {tp_size}: one TP mesh axis has one size")
        tp_size = size
        x, w, out = ly.inputs[0].placements[a], ly.weight.placements[a], ly.output.placements[a]
        col_dim, row_dim = (1, 0)
        if op.kind is OpKind.EMBEDDING:
            styles[ly.name] = RowwiseParallel() if w == Split(0) else ColwiseParallel()
        elif w == Split(col_dim) and x == B and out == Split(1):
            styles[ly.name] = ColwiseParallel()
        elif w == Split(row_dim) and x == Split(1) and isinstance(out, IRPartial):
            styles[ly.name] = RowwiseParallel()
        else:
            raise ValueError(f"layer {ly.name!r} ({ly.strategy}) is neither column- nor "
                             f"row-parallel over its TP axis")
        for other, (ax, pl) in enumerate(zip(ly.inputs[0].fact, ly.inputs[0].placements,
                                             strict=True)):
            if other != a and ax.size > 1 and pl not in (B, Split(0)):
                raise ValueError(f"layer {ly.name!r} ({ly.strategy}) splits more than the batch "
                                 f"outside its TP axis")
    return styles


def apply(plan: Plan, module: nn.Module, device_mesh: DeviceMesh | None = None) -> nn.Module:
    """``ilp_planner.apply(plan, module)``: the same as :func:`parallelize`."""
    return parallelize(plan, module, device_mesh)


def parallelize(plan: Plan, module: nn.Module, device_mesh: DeviceMesh | None = None
                ) -> nn.Module:
    """Apply ``plan`` to ``module`` in place on this rank (see the module docstring) and
    return it; its :class:`Applied` state is ``module.ilp_plan``."""
    module.ilp_plan = Applied(plan, module, device_mesh)  # type: ignore[attr-defined]
    return module


def audit(plan: Plan, rank: int, events: list) -> list[AuditRow]:
    """Planned vs executed collectives of one step of an applied plan, the loss's own
    reduction aside (the loss is the user's code)."""
    pred = {k: v for k, v in predicted(plan, rank, 1).items() if k[1] != "loss"}
    done = executed(events)
    return compare(pred, done)
