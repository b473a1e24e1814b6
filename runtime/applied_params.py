"""The user's parameters as DTensors in their planned placements, and their gradients'
reduction in the plan's buckets, for :mod:`runtime.apply`.

Each rank keeps its block of the value the module already holds (seed it identically on
every rank). Every parameter an op owns is one *slot* ``(op, role)``, its roles in the order
:func:`~ilp_planner.lowering.strategies.param_shapes` prices them, whatever the module calls
them. Once every gradient of the step has accumulated, the weight gradients are AllReduced in
the plan's chunks (:func:`ilp_planner.lowering.grad_buckets.fill_buckets`) and handed to the
optimizer in the parameter's placements.

A tied head (an output projection sharing the input embedding's table), or a second
embedding looking the table up (T5's decoder), is priced as the planner prices it
(:func:`~ilp_planner.lowering.strategies.tied_exchange`): the head computes with its own copy
in its planned layout, whose gradient is synchronised in its bucket and then
brought to the embedding's layout and added to the table's gradient. The user's module keeps
one parameter with one gradient: instead of sending the summed gradient back to the head's
copy (the exchange's second program), the same program refreshes the copy from the updated
parameter before the next forward — the same collectives, and the copy equals the parameter
whatever the optimizer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.tensor import DTensor

from ilp_planner.inputs.config import Config
from ilp_planner.ir.graph import Graph, Op, OpKind
from ilp_planner.ir.layouts import Layout, Partial, Split
from ilp_planner.lowering.grad_buckets import GradBucket
from ilp_planner.lowering.redistribution import Redistribution
from ilp_planner.lowering.strategies import (
    param_layouts,
    param_shapes,
    tie_transposes,
    tied_exchange,
    tied_source,
)
from ilp_planner.plan.data import LayerPlan
from runtime.comm import Comm
from runtime.dtensors import ContextStack, DimMap, Meshes, dtensor_spec, placements
from runtime.errors import FidelityError, RuntimeSetupError
from runtime.fused_parts import fused_degree, interleaved
from runtime.mesh import MeshRegistry
from runtime.recorder import tagged

Slot = tuple[str, str]  # (op name, parameter role)


@dataclass(frozen=True)
class PlacedParam:
    """One parameter of an op as placed: ``value`` is the DTensor the op computes with (the
    module's parameter, or a tied head's copy of it), ``registered`` the parameter the module
    holds at ``fqn`` (the path through the op's own module), its stored and gradient
    layouts, and how the IR's dims sit in it."""

    value: torch.Tensor
    registered: nn.Parameter
    fqn: str
    stored: Layout
    grad: Layout
    dims: DimMap


@dataclass(frozen=True)
class TiedHead:
    """A head computing with its own copy of an embedding's table: the slots of both, and
    the exchange's two lowered programs (head gradient → table layout, table → head copy)."""

    head: Slot
    table: Slot
    to_table: Redistribution
    to_head: Redistribution


def is_tied_copy(op: Op) -> bool:
    """A tied head, or an embedding looking up a table an earlier embedding owns (T5's
    decoder): an op computing with its own copy of another op's table."""
    return op.kind in (OpKind.LINEAR, OpKind.EMBEDDING) and bool(op.attrs.get("tied"))


def tied_heads(config: Config, layers: dict[str, LayerPlan]) -> dict[str, TiedHead]:
    """Each tied copy of the plan's graph (:func:`is_tied_copy`, by name) with its table
    and the lowered exchange the planner prices
    (:func:`~ilp_planner.lowering.strategies.tied_exchange`)."""
    graph = config.graph
    out: dict[str, TiedHead] = {}
    for op in graph.ops:
        if not is_tied_copy(op):
            continue
        emb = tied_source(graph, op)
        if emb is None or emb.weight is None:
            raise RuntimeSetupError(f"tied linear {op.name!r} has no embedding to share")
        head_w, emb_w = layers[op.name].weight, layers[emb.name].weight
        assert head_w is not None and emb_w is not None
        to_table, to_head = tied_exchange(emb_w, head_w, emb.master_spec, config.cluster,
                                          tie_transposes(op))
        out[op.name] = TiedHead((op.name, "weight"), (emb.name, "weight"), to_table, to_head)
    return out


def owner_of(module: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    """The submodule holding parameter ``fqn``, and the parameter's attribute name."""
    owner_path, _, attr = fqn.rpartition(".")
    return (module.get_submodule(owner_path) if owner_path else module), attr


def aliases(module: nn.Module) -> dict[int, list[str]]:
    """Every path under which each parameter object is registered (a tied table has two)."""
    out: dict[int, list[str]] = {}
    for fqn, p in module.named_parameters(remove_duplicate=False):
        out.setdefault(id(p), []).append(fqn)
    return out


def own_path(op: Op, fqn: str, paths: list[str]) -> str:
    """The path through ``op``'s own module to a parameter the importer named ``fqn`` (a
    tied table is named once, by whichever module registered it first)."""
    mine = [p for p in paths if p.startswith(f"{op.name}.")]
    return mine[0] if mine else fqn


def check_frozen(graph: Graph, module: nn.Module) -> None:
    """Each parameter the plan's ops own is frozen (``requires_grad=False``) in ``module``
    exactly where its op is :attr:`~ilp_planner.ir.graph.Op.frozen`: a plan priced for a
    frozen layer would leave a trained one's gradients unsynchronised, and one priced for
    training would synchronise gradients that never come."""
    params = dict(module.named_parameters(remove_duplicate=False))
    for op in graph.ops:
        if op.unused:  # frozen by where it sits, whatever the module says
            continue
        differ = [n for n in op.source_params
                  if n in params and (not params[n].requires_grad) != op.frozen]
        if differ:
            raise RuntimeSetupError(
                f"op {op.name!r} is planned {'frozen' if op.frozen else 'to train'} but "
                f"{', '.join(differ[:3])} {'train' if op.frozen else 'are frozen'} in the "
                f"module (requires_grad={not op.frozen}); import the module as it will run "
                f"and solve again")


def check_not_checkpointing(module: nn.Module) -> None:
    """No submodule checkpoints its activations — Hugging Face's
    ``gradient_checkpointing_enable()`` (its layers' ``gradient_checkpointing``) or torch's
    ``checkpoint_wrapper``: its forward would run again in the backward, converting its
    inputs and issuing its collectives a second time, none of it planned or priced (the
    planner prices recomputation where it chooses it, on the runtime's own executor)."""
    flagged = [path for path, m in module.named_modules()
               if getattr(m, "gradient_checkpointing", False) is True
               or isinstance(m, CheckpointWrapper)]
    # the layers that checkpoint, not a model flagged above them (Llama's ``LlamaModel``)
    found = [path or type(module).__name__ for path in flagged
             if not any(q != path and (not path or q.startswith(f"{path}.")) for q in flagged)]
    if found:
        raise RuntimeSetupError(
            f"module {found[0]!r}{f' (and {len(found) - 1} more)' if len(found) > 1 else ''} "
            f"checkpoints its activations (gradient checkpointing), recomputing its forward "
            f"in the backward — conversions and collectives the plan does not list; "
            f"parallelize applies no recomputation to a user's module: turn it off "
            f"(model.gradient_checkpointing_disable(), or unwrap checkpoint_wrapper), or "
            f"import with dtensor=False and let the runtime's executor recompute what "
            f"solver.recompute plans")


def check_owned(graph: Graph, module: nn.Module) -> None:
    """Every embedding table of the module is some op's, looked up by the op owning it (or
    its tied copies): a table no op owns stays out of the plan's placements and gradient
    reduction, yet its lookups train it — differently on every rank. T5's
    ``relative_attention_bias`` tables are owned by the first attention reading each
    (from an SDPA's mask or hand-written scores, :mod:`runtime.applied_bias`); a table
    looked up at constant ids that no attention adds (XLM's positions) folds into a
    constant, and is refused here. (A parameter the
    forward never reads — BERT's spare ``cls.predictions.bias`` — is owned by no op
    either, and harmless.)"""
    owned = {fqn for op in graph.ops for fqn in op.source_params}
    unowned = [paths[0] for paths in aliases(module).values() if not owned.intersection(paths)
               and isinstance(owner_of(module, paths[0])[0], nn.Embedding)]
    if unowned:
        raise RuntimeSetupError(
            f"embedding tables {', '.join(unowned[:3])}{' …' if len(unowned) > 3 else ''} are "
            f"owned by no op of the plan (looked up at constant ids and not added to "
            f"attention scores, they fold into constants); parallelize does not run them")
    sharing = [op.name for op in graph.ops if op.kind is OpKind.EMBEDDING
               and op.weight is not None and not op.source_params]
    if sharing:
        raise RuntimeSetupError(
            f"op {sharing[0]!r} looks up a table another op owns without the importer's tie "
            f"mark; parallelize shares a table between an embedding and the embeddings and "
            f"nn.Linear head the importer marks tied")


def guard_unowned(graph: Graph, module: nn.Module) -> None:
    """Any other trained parameter no op owns (embedding tables: :func:`check_owned`) is
    harmless only while the forward never reads it (BERT's spare bias). One the forward
    does read — a bare table indexed at constant positions and added to hand-written
    attention scores that is not ``(buckets, heads)`` (LeViT's square ``attention_biases``,
    heads first), which the importer folds into a constant — would take a gradient on
    each rank alone, never reduced, and the ranks' copies drift apart: its first gradient
    raises instead, naming it. Nothing can tell the two apart before a backward runs."""
    owned = {fqn for op in graph.ops for fqn in op.source_params}
    for paths in aliases(module).values():
        if owned.intersection(paths):
            continue
        param = module.get_parameter(paths[0])
        if param.requires_grad:
            param.register_hook(functools.partial(_unowned_gradient, paths[0]))


def _unowned_gradient(name: str, grad: torch.Tensor) -> torch.Tensor:
    raise RuntimeSetupError(
        f"parameter {name} took a gradient but no op of the plan owns it: the forward reads "
        f"it through code the importer folded into a constant (a table indexed at constant "
        f"positions and added to hand-written attention scores), so parallelize neither "
        f"places nor reduces it and each rank would train its own copy; freeze it "
        f"(requires_grad_(False)) or compute that term inside a module the plan owns")


def _left_plain(op: Op, original: torch.Tensor, stored: Layout) -> bool:
    """A frozen parameter an op of the user's functional code reads whole (replicated,
    taking no gradient) stays the plain tensor the module holds: every reader's
    implicit replication makes it a replica on that reader's own mesh, as a buffer. Placed
    as a DTensor on one op's mesh, it would meet the other readers' values on theirs
    (RoFormer's sinusoidal table: layer 0's rotary ``mul`` owns it, every later layer's
    attention computes with it on a ``(2, 2)`` mesh while it sat on ``(4,)``). The same
    bytes on every device and no collective, as the plan prices it."""
    return (bool(op.attrs.get("functional")) and not original.requires_grad
            and all(not isinstance(pl, (Split, Partial)) for pl in stored.placements))


def _unused_gradient(name: str, op: str, grad: torch.Tensor) -> torch.Tensor:
    raise RuntimeSetupError(
        f"parameter {name} took a gradient but its op {op!r} is planned unused (the import "
        f"found no path from its output to the loss), so no gradient of it is synchronised; "
        f"import the module as it runs and solve again")


def tied_heads_last(ops: tuple[Op, ...]) -> list[Op]:
    """The ops in graph order with tied copies moved last, so a table is placed by its
    embedding before a copy is made of it."""
    return sorted(ops, key=is_tied_copy)


class AppliedParams:
    """Places every parameter of the plan's ops and reduces their gradients each step."""

    def __init__(self, graph: Graph, layers: dict[str, LayerPlan], module: nn.Module,
                 comm: Comm, meshes: Meshes, chunks: tuple[GradBucket, ...],
                 tied: dict[str, TiedHead], registry: MeshRegistry, replicating: ContextStack):
        self.graph = graph
        self.layers = layers
        self.module = module
        self.comm = comm
        self.meshes = meshes
        self.chunks = chunks
        self.registry = registry
        self.replicating = replicating  # left once the gradients are reduced
        self.devices = comm.devices
        self.slots: dict[Slot, PlacedParam] = {}
        # the module's parameters held in another column order than its own (a fused
        # weight split over its columns, :mod:`runtime.fused_parts`): (parts, degree, dim)
        self.interleaved: dict[str, tuple[int, int, int]] = {}
        self.tied = tied
        self._placed: dict[int, Slot] = {}  # id of the module's original parameter -> slot
        originals = dict(module.named_parameters(remove_duplicate=False))
        paths = aliases(module)
        for op in tied_heads_last(self.graph.ops):
            if op.source_params:
                self._place(op, originals, paths)
        self._pending = 0
        # a frozen op's parameters (requires_grad=False) take no gradient to wait for, nor
        # does an unused op's (its output reaches no loss): one that comes raises
        self.trained = {s: p for s, p in self.slots.items()
                        if p.value.requires_grad and not self.graph[s[0]].unused}
        for (name, _), p in self.slots.items():
            if p.value.requires_grad and self.graph[name].unused:
                p.value.register_hook(functools.partial(_unused_gradient, p.fqn, name))
        # gradients reduced by an earlier backward of this step (gradient accumulation),
        # set aside while the next one arrives: :meth:`_set_aside`
        self._earlier: dict[Slot, torch.Tensor] = {}
        for slot, placed in self.trained.items():
            placed.value.register_hook(lambda g, s=slot: self._set_aside(s))
            placed.value.register_post_accumulate_grad_hook(lambda p: self._grad_ready())

    def of_op(self, name: str) -> dict[Slot, PlacedParam]:
        """Op ``name``'s placed parameters in role order."""
        return {slot: p for slot, p in self.slots.items() if slot[0] == name}

    def _place(self, op: Op, originals: dict[str, nn.Parameter],
               paths: dict[int, list[str]]) -> None:
        """Replace ``op``'s parameters in the module (under every path they have) by
        DTensors of this rank's blocks of their ``originals``; a table already placed
        becomes a tied head's copy."""
        ly = self.layers[op.name]
        lays = param_layouts(op, ly.strategy, ly.inputs, ly.weight, ly.output)
        shapes = param_shapes(op)
        if len(shapes) != len(op.source_params):
            raise RuntimeSetupError(f"op {op.name!r} owns parameters {op.source_params} but "
                                    f"the plan prices {list(shapes)}")
        for role, fqn in zip(shapes, op.source_params, strict=True):
            original = originals[fqn]
            ir_shape = tuple(shapes[role])
            transposed = role == "weight" and bool(op.attrs.get("weight_t"))
            # an opaque op's parameters are priced flat (replicated, any shape)
            flat = op.kind is OpKind.OPAQUE and ir_shape == (original.numel(),)
            if not flat and tuple(original.shape) != (ir_shape[::-1] if transposed else ir_shape):
                raise RuntimeSetupError(f"parameter {fqn} has shape {tuple(original.shape)}, "
                                        f"the plan's op {op.name!r} expects {ir_shape}")
            stored, grad = lays[role]
            if _left_plain(op, original, stored):
                continue
            dims = DimMap(tuple(original.shape), original.dim() if flat else len(ir_shape),
                          transposed)
            path = own_path(op, fqn, paths.get(id(original), [fqn]))
            table = self._placed.get(id(original))
            tie = self.tied.get(op.name)
            if (table is not None) != (tie is not None and tie.table == table
                                       and transposed == tie_transposes(op)):
                raise RuntimeSetupError(
                    f"op {op.name!r}'s parameter {fqn} is "
                    f"{'shared with ' + table[0] if table else 'its own'} but the plan prices "
                    f"{'a tie with ' + tie.table[0] if tie else 'no tie'}; parallelize shares "
                    f"a table only between an embedding and the embeddings and nn.Linear "
                    f"head the importer marks tied")
            if table is None:
                # a fused weight's columns in the order its column split holds them
                parts, k = op.attrs.get("parts", 0), fused_degree(self.graph, op, ly)
                dim = dims.real_dim(1) if role == "weight" else 0
                registered = self._registered(interleaved(original.detach(), parts, k, dim),
                                              stored, dims, fqn, paths.get(id(original), [fqn]),
                                              original.requires_grad)
                if parts > 1 and k > 1:  # state_dict keys holding it interleaved
                    for alias in paths.get(id(original), [fqn]):
                        self.interleaved[alias] = (parts, k, dim)
                self._placed[id(original)] = (op.name, role)
                value: torch.Tensor = registered
            else:
                registered = self.slots[table].registered
                value = self._dtensor(original, stored, dims, f"{op.name}'s copy of the table",
                                      original.requires_grad)
            self.slots[(op.name, role)] = PlacedParam(value, registered, path, stored, grad,
                                                      dims)

    def _registered(self, original: torch.Tensor, stored: Layout, dims: DimMap, fqn: str,
                    paths: list[str], requires_grad: bool) -> nn.Parameter:
        """The module's parameter as a DTensor of this rank's block, set under every path
        (frozen where the module's is: ``requires_grad``)."""
        param = nn.Parameter(self._dtensor(original, stored, dims, f"parameter {fqn}",
                                           requires_grad), requires_grad=requires_grad)
        for path in paths:
            owner, attr = owner_of(self.module, path)
            setattr(owner, attr, param)
        return param

    def _dtensor(self, original: torch.Tensor, stored: Layout, dims: DimMap,
                 where: str, requires_grad: bool) -> DTensor:
        """This rank's block of the module's full value as a DTensor leaf in ``stored``
        (frozen as the original is: ``requires_grad``)."""
        full = original.detach()
        local = self.comm.block(full.t() if dims.transposed else full, stored)
        local = local.t() if dims.transposed else local
        pls = placements(stored, dims, where)
        return DTensor(local.contiguous().clone(),
                       dtensor_spec(self.meshes.of(stored), pls, full, tuple(full.shape)),
                       requires_grad=requires_grad)

    def refresh_tied(self) -> None:
        """Each tied head's copy set to the table's current value in the head's layout (the
        exchange's second program, run on the value: see the module docstring)."""
        for t in self.tied.values():
            table, head = self.slots[t.table], self.slots[t.head]
            spec = self.graph[t.table[0]].master_spec
            with torch.no_grad():
                moved = self.comm.run(table.value._local_tensor.contiguous(), t.to_head.steps, spec,
                                      "step", "tied_weight", t.head[0])
                head.value._local_tensor.copy_(moved)

    def _set_aside(self, slot: Slot) -> None:
        """Before autograd accumulates a fresh gradient into a parameter whose ``.grad`` an
        earlier backward of this step already reduced (gradient accumulation over several
        backwards before the optimizer's step, or a ``zero_grad(set_to_none=False)``), the
        reduced one is set aside: the fresh one then arrives partial, as the plan's
        synchronisation expects, and is reduced alone — as ``DistributedDataParallel``
        reduces each backward — and :meth:`_sync_grads` adds the two. (Left in place,
        DTensor would add a partial gradient to a reduced one by an AllReduce of its own.)"""
        p = self.slots[slot].value
        if p.grad is not None:
            self._earlier[slot] = p.grad._local_tensor
            p.grad = None

    def _grad_ready(self) -> None:
        self._pending += 1
        if self._pending == len(self.trained):
            self._pending = 0
            self._sync_grads()

    def _sync_grads(self) -> None:
        """Check every gradient's placements, AllReduce the plan's buckets (the backward is
        over: plain tensors stop acting as replicas), then add each tied head's gradient to
        its table's."""
        self.replicating.leave()
        locals_ = self._local_grads()
        flat = self._flat_buffers(locals_)
        for c in self.chunks:
            with tagged("backward", "grad_sync", c.launcher):
                dist.all_reduce(flat[c.buffer][c.start:c.stop],
                                group=self.registry.axes_group(self.devices, c.fact, c.axes))
        self._hand_back(flat, locals_)
        for slot, earlier in self._earlier.items():
            self.slots[slot].value.grad._local_tensor.add_(earlier)
        self._earlier.clear()
        for slot, p in self.trained.items():
            if p.grad == p.stored or not p.grad.has_partial:
                continue
            if tuple(p.value.grad.placements) != placements(p.stored, p.dims, p.fqn):
                raise FidelityError(f"gradient of {p.fqn} ({slot[0]}) was not reduced by any "
                                    f"bucket")
        self._exchange_tied()

    def _exchange_tied(self) -> None:
        """Each tied head's synchronised gradient brought to the table's layout and added to
        the table's: the module's one parameter gets one gradient."""
        for t in self.tied.values():
            table, head = self.slots[t.table], self.slots[t.head]
            spec = self.graph[t.table[0]].master_spec
            moved = self.comm.run(head.value.grad._local_tensor.contiguous(), t.to_table.steps, spec,
                                  "step", "tied_weight", t.head[0])
            table.value.grad._local_tensor.add_(moved.view_as(table.value.grad._local_tensor))
            head.value.grad = None

    def _local_grads(self) -> dict[Slot, torch.Tensor]:
        """Every parameter's local gradient block, its placements checked against the ones
        the plan's weight-gradient synchronisation expects."""
        out: dict[Slot, torch.Tensor] = {}
        for slot, p in self.trained.items():
            want = placements(p.grad, p.dims, f"gradient of {p.fqn}")
            got = tuple(p.value.grad.placements)
            if got != want:
                raise FidelityError(f"gradient of {p.fqn} ({slot[0]}) arrives as {got}; the "
                                    f"plan's weight-gradient synchronisation expects {want}")
            out[slot] = p.value.grad._local_tensor
        return out

    def _flat_buffers(self, locals_: dict[Slot, torch.Tensor]) -> dict[int, torch.Tensor]:
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
                parts += [locals_[(m.layer, role)].reshape(-1) for role in m.roles]
            flat[c.buffer] = torch.cat(parts)
        return flat

    def _hand_back(self, flat: dict[int, torch.Tensor],
                   locals_: dict[Slot, torch.Tensor]) -> None:
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
                    p, local = self.slots[(m.layer, role)], locals_[(m.layer, role)]
                    reduced = flat[c.buffer][at:at + local.numel()].view_as(local)
                    at += local.numel()
                    pls = placements(p.stored, p.dims, f"parameter {p.fqn}")
                    p.value.grad = DTensor(reduced.clone(),
                                           dtensor_spec(self.meshes.of(p.stored), pls, reduced,
                                                        tuple(p.value.shape)),
                                           requires_grad=False)
                offsets[c.buffer] = at
