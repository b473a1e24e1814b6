"""The module-boundary hooks that run the plan's edge programs on the user's module, for
:mod:`runtime.apply`.

:func:`hook_table` decides, from the plan alone, what each module boundary runs: for each
input of a module the edge program (or a check that it already arrives in its planned
layout — always so for an input it reads through the user's code outside it,
:meth:`~ilp_planner.ir.graph.Op.reads_functionally`, converted at its producer's boundary),
and for the output one program for all its functional consumers (or a check) —
they read one value, so they must read one layout and hand back their gradients in one
layout (autograd sums them into the one backward program), as the plan's shared reads
price it (:mod:`ilp_planner.lowering.shared_reads`). A layout change between two pieces of
functional code has no boundary to run at and is refused.
:class:`BoundaryHooks` installs and runs them: the root module's pre-hook cuts the full batch
into the planned blocks, each leaf's hooks convert and check, the root's forward hook
converts the module's output.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.utils._pytree import tree_flatten, tree_unflatten

from ilp_planner.ir.graph import Graph, Op, OpKind, read_inside_its_module
from ilp_planner.ir.layouts import Layout, drop_unit_axes, grad_layout
from ilp_planner.lowering.moe_strategies import hf_experts
from ilp_planner.lowering.redistribution import Redistribution
from ilp_planner.lowering.shared_reads import priced_read
from ilp_planner.lowering.strategies import input_grad_layouts, is_summa, param_shapes
from ilp_planner.plan.data import LayerPlan
from runtime.applied_edges import EdgeRunner
from runtime.applied_moe import moe_path
from runtime.applied_params import AppliedParams, owner_of
from runtime.comm import Comm
from runtime.dtensors import ContextStack, DimMap, Meshes, Unwrap, Wrap, dtensor_spec, placements
from runtime.errors import RuntimeSetupError
from runtime.fused_parts import LocalParts
from runtime.local_attention import LocalAttention
from runtime.local_batchnorm import LocalBatchNorm, StatsGroups
from runtime.local_dropout import LocalDropout
from runtime.ops import bias_share
from runtime.recorder import tagged

LOCAL_KINDS = (OpKind.LINEAR, OpKind.LAYERNORM, OpKind.RMSNORM, OpKind.CONV2D, OpKind.EMBEDDING)
"""Ops whose module computes on local blocks exactly as the plan's layouts say (the runtime's
kernels' arithmetic): a matmul of blocks is the block of the product, or its partial sum; a
norm over whole rows is local; a lookup in a block of vocabulary rows is a masked lookup
(:class:`VocabMask`), its rows summed over the vocabulary split. The user's other code runs
on DTensors."""


@dataclass(frozen=True)
class VocabMask:
    """A lookup in this rank's rows ``[lo, hi)`` of a vocabulary-split table: ids outside
    them look up row 0 and their outputs are zeroed, so the blocks' outputs sum to the
    lookup (the partial sums the plan prices); the table's padding row, if this rank holds
    it, keeps its zero gradient."""

    outside: torch.Tensor
    lo: int
    hi: int

    @staticmethod
    def of(ids: torch.Tensor, rows: tuple[int, int]) -> VocabMask:
        lo, hi = rows
        return VocabMask((ids < lo) | (ids >= hi), lo, hi)

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.where(self.outside, torch.zeros_like(ids), ids - self.lo)

    def local_padding(self, padding_idx: int | None) -> int | None:
        if padding_idx is None or not self.lo <= padding_idx < self.hi:
            return None
        return padding_idx - self.lo

    def apply(self, out: torch.Tensor) -> torch.Tensor:
        return out.masked_fill(self.outside.unsqueeze(-1), 0.0)


@dataclass
class Hook:
    """What one module boundary runs: per input index the edge program (or a check), and
    for the output a program for functional consumers (or a check)."""

    op: str
    inputs: dict[int, tuple[Layout, Redistribution | None, Layout]] = field(default_factory=dict)
    output: tuple[Layout, Redistribution | None] | None = None
    local: bool = False  # the module computes on this rank's blocks (see LOCAL_KINDS)
    # inputs read through the user's code outside the module (Op.reads_functionally):
    # converted, if at all, at their producer's boundary; checked here as they arrive
    through_code: frozenset[int] = frozenset()


Programs = dict[str, tuple[Layout, Redistribution]]  # producer -> (layout read, program)


def runs_locally(op: Op, ly: LayerPlan, sub: nn.Module, module: nn.Module) -> bool:
    """Whether ``sub`` (op's module) computes on this rank's blocks. A linear must be
    ``nn.Linear``: another projection module (Hugging Face's ``Conv1D``) may shape its output
    from its own whole sizes (``view(..., self.nf)``), which a block does not have — it runs on
    DTensors, whose shapes are the whole ones. Every parameter of ``sub`` must be the op's
    (``op.source_params`` name them in the root ``module``)."""
    if op.kind is OpKind.MOE:  # the runtime's kernel, swapped in (runtime.applied_moe)
        return hf_experts(op)
    if op.kind not in LOCAL_KINDS or len(op.source_params) != len(param_shapes(op)):
        return False
    owned = {id(module.get_parameter(f)) for f in op.source_params}
    if any(id(p) not in owned for p in sub.parameters(recurse=False)):
        # a parameter of the module another op owns (DeBERTa's layer norm adds its bias
        # in its own forward, imported as an op of its own): it stays a DTensor there,
        # which would meet the local blocks
        return False
    if op.kind is OpKind.LINEAR:
        return isinstance(sub, nn.Linear) and not is_summa(ly.strategy)
    if op.kind is OpKind.LAYERNORM and isinstance(sub, nn.LayerNorm):
        # a subclass with its own forward may move its features (ConvNeXt's channels-first
        # norm permutes the image around nn.LayerNorm): its block is not features-last
        return type(sub).forward is nn.LayerNorm.forward
    return True


def computes_past(graph: Graph, op: Op) -> bool:
    """Whether ``op``'s module goes on computing with its value: an op the importer named
    inside that module's path reads it (Qwen3.5's gated norm multiplies its normed tokens
    by a gate its forward is handed; DeBERTa's layer norm adds a bias). Its forward then
    returns that op's value, not ``op``'s, and reads tensors ``op`` does not: it runs on
    DTensors, not on this rank's blocks of ``op``'s inputs, and no program may change
    ``op``'s layout for that code (:func:`_outputs` refuses one: it would run on the
    later value the module returns)."""
    return any(read_inside_its_module(c, op.name) for c in graph.consumers(op.name))


def heads_dim(op: Op) -> int | None:
    """Where a per-head norm's module holds the heads of the value it reads and writes
    (``attrs.heads_dim``; ``attrs.group_width`` marks such a norm), None for any other op."""
    return op.attrs.get("heads_dim") if "group_width" in op.attrs else None


def leaf_module(module: nn.Module, name: str) -> nn.Module | None:
    """The childless submodule named ``name``, if the op is one."""
    try:
        sub = module.get_submodule(name)
    except AttributeError:
        return None
    return sub if not any(True for _ in sub.children()) else None


def runner_path(module: nn.Module, op: Op) -> str | None:
    """The path of the childless submodule that runs ``op``: the op's own name, or, for a
    later call of a module the forward calls several times (one ``nn.Dropout`` after the
    attention and after the MLP), the module whose call the importer named
    ``<path>.<kind>[_i]``. The module's hooks run its ops in call order. None for an op of
    functional code. An imported MoE op runs in its experts module
    (:func:`runtime.applied_moe.moe_path`), children and all."""
    if op.kind is OpKind.MOE:
        return moe_path(module, op)
    if leaf_module(module, op.name) is not None:
        return op.name
    path = _later_call(module, op)
    if path is not None and not _has_parameters(module, path):
        return path
    return None


def _later_call(module: nn.Module, op: Op) -> str | None:
    """The childless submodule whose later call the importer named ``op``
    (``<path>.<kind>[_i]``, owning no parameters), or None — not the copy the module's
    input is laid out by (``attrs.relayout``: SqueezeBERT's tokens transposed for its
    ``nn.Conv1d``), which carries its reader's path too."""
    path, _, last = op.name.rpartition(".")
    if path and not op.attrs.get("relayout") \
            and re.fullmatch(rf"{re.escape(op.kind.value)}(_\d+)?", last) \
            and leaf_module(module, path) is not None and not op.source_params:
        return path
    return None


def _has_parameters(module: nn.Module, path: str) -> bool:
    return any(True for _ in module.get_submodule(path).parameters())


def output_op(graph: Graph) -> str:
    """The op whose value the module returns: the loss's input, or the last op."""
    loss = [op for op in graph.ops if op.kind is OpKind.LOSS]
    return loss[-1].inputs[0] if loss else graph.ops[-1].name


def converted_at_its_module(graph: Graph) -> bool:
    """Whether the module's output is converted by its own op's module, not the root's:
    where element-wise steps run between the two (Gemma-2's logit soft-capping, a tanh —
    folded into the loss's input, ``attrs.input_steps``), they must read the value in the
    layout the loss reads (the plan prices them there), not a partial sum."""
    loss = [op for op in graph.ops if op.kind is OpKind.LOSS]
    return bool(loss) and bool(loss[-1].attrs.get("input_steps"))


def hook_table(graph: Graph, layers: dict[str, LayerPlan], edges: dict[tuple[str, int], Redistribution],
               module: nn.Module) -> tuple[dict[str, Hook], Programs]:
    """Every module boundary's :class:`Hook`, and the programs run on a producer's output
    for functional consumers (the module's own output's among them)."""
    _refuse_reused_weights(graph, module)
    hooks: dict[str, Hook] = {}
    functional: dict[str, list[tuple[str, int]]] = {}  # producer -> its functional readers
    for op in graph.ops:
        if op.kind is OpKind.INPUT:
            continue
        ly = layers[op.name]
        for idx, src in enumerate(op.inputs):
            if graph[src].kind is OpKind.INPUT:
                continue
            red = edges[(op.name, idx)]
            if op.kind is not OpKind.LOSS and runner_path(module, op) is not None:
                h = hooks.setdefault(op.name, Hook(op.name))
                if op.reads_functionally(idx):
                    _read_through_code(h, idx, ly.inputs[idx])
                    functional.setdefault(src, []).append((op.name, idx))
                    continue
                moves = bool(red.steps or red.backward_steps)
                h.inputs[idx] = (layers[src].output, red if moves else None, ly.inputs[idx])
                continue
            functional.setdefault(src, []).append((op.name, idx))
    post = {src: prog for src, readers in functional.items()
            if (prog := _shared_program(graph, src, readers, edges)) is not None}
    _outputs(graph, layers, module, hooks, post)
    return hooks, post


def _refuse_reused_weights(graph: Graph, module: nn.Module) -> None:
    """Refuse, before anything changes, a module with parameters the forward calls again:
    the importer names a later call ``<path>.<kind>[_i]`` without parameters (its weight
    priced once, on the first call, and the calls laid out apart), and no hook can run it
    (ALBERT's shared layer: it failed in the first forward)."""
    for op in graph.ops:
        path = _later_call(module, op)
        if path is not None and path in graph and graph[path].kind is op.kind \
                and _has_parameters(module, path):
            raise RuntimeSetupError(
                f"module {path!r} is called again in the forward (op {op.name!r}) with its "
                f"parameters: a module called twice with its weights (a shared layer, as "
                f"ALBERT's) is not supported by parallelize — the plan prices its weight on "
                f"the first call only and lays the calls out apart")


def _read_through_code(h: Hook, idx: int, read: Layout) -> None:
    """Input ``idx`` of ``h``'s module reaches it through the user's code run outside the
    module (Granite's ``inputs_embeds * embedding_multiplier``): a value computed from what
    its producer's boundary handed out — converted there, with the producer's functional
    readers, to the layout it reads — so the module only checks it arrives in ``read``."""
    h.inputs[idx] = (read, None, read)
    h.through_code |= {idx}


def _shared_program(graph: Graph, src: str, readers: list[tuple[str, int]],
                    edges: dict[tuple[str, int], Redistribution]
                    ) -> tuple[Layout, Redistribution] | None:
    """The one program run on ``src``'s output for all its functional ``readers`` (one value
    reaches them all), or None where nothing moves. They must read one layout and hand back
    their gradients in one layout — autograd sums them into the one backward program — and
    the plan must have priced that program once, as a shared read of exactly these readers
    (:mod:`ilp_planner.lowering.shared_reads`); a plan of a graph that does not say so
    prices it once per reader."""
    progs = [edges[r] for r in readers]
    shared = graph.shared_reads().get(src, ())
    priced_once = set(readers) == set(shared) if len(readers) > 1 else not shared
    if not priced_once and any(p.steps or p.backward_steps for p in progs):
        raise RuntimeSetupError(
            f"{src!r} is read by functional code {sorted(readers)}, which the plan's graph "
            f"does not price as one shared read ({sorted(shared) or 'none'}); import the "
            f"module with from_module(dtensor=True) and re-solve")
    # unit mesh axes aside: one DeviceMesh and the same placements run both
    back = [p for p, (r, _) in zip(progs, readers, strict=True) if not graph[r].unused]
    for what, seen in (("layouts", {drop_unit_axes(p.dst) for p in progs}),
                       ("gradient layouts", {drop_unit_axes(p.grad_dst) for p in back})):
        if len(seen) > 1:
            raise RuntimeSetupError(
                f"{src!r} feeds functional code in two {what} "
                f"({', '.join(sorted(map(str, seen)))}): no module boundary can run both "
                f"programs")
    red = edges[priced_read(graph, tuple(readers))] if len(readers) > 1 else progs[0]
    return (red.dst, red) if red.steps or red.backward_steps else None


def _outputs(graph: Graph, layers: dict[str, LayerPlan], module: nn.Module,
             hooks: dict[str, Hook], post: Programs) -> None:
    """Each module's output check and program; refuses a program between two pieces of
    functional code."""
    out_op = output_op(graph)
    for src, (dst, _) in post.items():
        if runner_path(module, graph[src]) is None and src != out_op:
            raise RuntimeSetupError(
                f"the plan changes the layout of {src!r} ({layers[src].output} → {dst}) "
                f"between two pieces of functional code; parallelize runs programs at module "
                f"boundaries only — make {src!r} or its consumer a module")
    for op in graph.ops:
        path = runner_path(module, op)
        if op.kind is OpKind.INPUT or path is None:
            continue
        h = hooks.setdefault(op.name, Hook(op.name))
        # the module's own output is converted once, by the root's hook (or its own)
        red = None if op.name == out_op and not converted_at_its_module(graph) \
            else post.get(op.name, (None, None))[1]
        h.output = (layers[op.name].output, red)
        past = computes_past(graph, op)
        if past and red is not None and red.steps:
            raise RuntimeSetupError(
                f"the plan changes the layout of {op.name!r} ({layers[op.name].output} → "
                f"{red.dst}) for code its own module runs after it; parallelize runs "
                f"programs at module boundaries only, where that module returns the later "
                f"value — keep {op.name!r} in the layout that code reads")
        h.local = not past and runs_locally(op, layers[op.name], module.get_submodule(path),
                                            module)


class BoundaryHooks:
    """Runs the hook table on the module's forward (and, through autograd, its backward)."""

    def __init__(self, graph: Graph, layers: dict[str, LayerPlan], module: nn.Module,
                 comm: Comm, meshes: Meshes, edges: EdgeRunner, params: AppliedParams,
                 replicating: ContextStack, device_type: str,
                 batchnorms: StatsGroups | None = None):
        self.graph = graph
        self.layers = layers
        self.module = module
        self.comm = comm
        self.meshes = meshes
        self.edges = edges
        self.params = params
        self.replicating = replicating  # from the forward until the gradients are reduced
        self.device_type = device_type
        self.batchnorms = batchnorms or {}  # runtime.local_batchnorm: their statistics' groups
        self.forward_only = ContextStack()
        # converted -> (it, original, producer)
        self.origin: dict[int, tuple[DTensor, DTensor, str]] = {}
        self.hooks: dict[str, Hook] = {}
        self.final: tuple[Layout, Redistribution | None] | None = None
        self.masks: dict[str, VocabMask] = {}  # vocabulary-split lookups running now
        self.paddings: dict[str, int] = {}  # their modules' own padding rows
        self.calls: dict[str, int] = {}  # module path -> its calls so far in this forward
        self.runs: dict[str, list[Hook]] = {}  # module path -> its ops' hooks in call order
        self.off_plan: set[str] = set()  # modules running now on values made outside the plan
        self.parts: LocalParts | None = None  # fused outputs cut into parts, this forward

    def install(self, programs: dict[tuple[str, int], Redistribution]) -> None:
        self.hooks, post = hook_table(self.graph, self.layers, programs, self.module)
        runs: dict[str, list[Hook]] = {}  # module path -> its ops' hooks in call order
        for op in self.graph.ops:
            if op.name in self.hooks:
                path = runner_path(self.module, op)
                assert path is not None
                runs.setdefault(path, []).append(self.hooks[op.name])
        self.runs = runs
        for path, hs in runs.items():
            mod = self.module.get_submodule(path)
            mod.register_forward_pre_hook(lambda m, args, p=path, hs=hs: self._pre_call(
                p, hs, m, args))
            mod.register_forward_hook(lambda m, args, out, p=path, hs=hs: self._post_call(
                p, hs, out))
        out = output_op(self.graph)
        # (the layout the module's output arrives in at the root, the program left there)
        self.final = (post[out][0], None) if converted_at_its_module(self.graph) and \
            out in post else (self.layers[out].output, post[out][1] if out in post else None)
        self.module.register_forward_pre_hook(lambda m, args, kwargs: self._inputs(args, kwargs),
                                              with_kwargs=True)
        self.module.register_forward_hook(lambda m, args, out: self._output(out),
                                          always_call=True)

    def _pre_call(self, path: str, hs: list[Hook], mod: nn.Module, args: tuple) -> tuple | None:
        """A call of the module at ``path``: its op's, or no op's (:func:`_on_constants`)."""
        if _on_constants(mod, args):
            self.off_plan.add(path)
            return None
        return self._pre(self._call(path, hs), args)

    def _post_call(self, path: str, hs: list[Hook], out: Any) -> Any:
        if path in self.off_plan:
            self.off_plan.discard(path)
            return None
        h = self._call(path, hs)
        self.calls[path] = self.calls.get(path, 0) + 1
        return _on_first(out, lambda t: self._post(h, t))

    def _call(self, path: str, hs: list[Hook]) -> Hook:
        """The hook of this call of the module at ``path`` (its ops in call order)."""
        n = self.calls.get(path, 0)
        if n >= len(hs):
            raise RuntimeSetupError(f"module {path!r} was called {n + 1} times in one forward "
                                    f"(or run again in the backward: torch.utils.checkpoint "
                                    f"in the module's code, which parallelize does not "
                                    f"apply); the plan has {len(hs)} op(s) for it")
        return hs[n]

    def _pre(self, h: Hook, args: tuple) -> tuple:
        args = list(args)
        op = self.graph[h.op]
        for idx, (src, red, dst) in h.inputs.items():
            producer = op.inputs[idx]
            where = f"input {idx} of {h.op}"
            if idx >= len(args):
                raise RuntimeSetupError(
                    f"op {h.op!r} reads {producer!r} as its input {idx}, but its module is "
                    f"called with {len(args)} positional input(s): a value passed by keyword "
                    f"or read from elsewhere, which parallelize cannot convert at the "
                    f"module's boundary")
            origin = None if idx in h.through_code else self.origin.get(id(args[idx]))
            # (an in-place op of functional code — ``out += identity`` — keeps the converted
            # tensor's identity but makes it another op's output: not the producer's then)
            if origin is not None and origin[0] is args[idx] and origin[2] == producer:
                # the producer's hook converted it for functional consumers: this module's
                # own program starts from the producer's planned output, as priced
                args[idx] = origin[1]
            self.edges.check(args[idx], src, producer, where, heads_dim(op))
            if red is not None:
                with tagged("forward", "activation", h.op):
                    args[idx] = self.edges.run(args[idx], src, red, dst, producer, where,
                                               heads_dim(op))
        if h.local:
            args = self._to_blocks(h, args)
        else:
            self._swap_copies(h)
        return tuple(args)

    def _to_blocks(self, h: Hook, args: list) -> list:
        """The module's inputs and parameters as this rank's blocks for its forward; their
        gradients come back in the plan's layouts (:func:`input_grad_layouts`, the
        parameters' gradient layouts). A bias added to partial sums is each device's share
        (``b / p``, the runtime's :func:`runtime.ops.bias_share`)."""
        op, ly = self.graph[h.op], self.layers[h.op]
        grads = input_grad_layouts(op, ly.strategy, ly.inputs, ly.weight)
        for idx in range(len(op.inputs)):
            x = args[idx]
            if isinstance(x, DTensor):
                dims = self.edges.dims(op.inputs[idx], x, heads_dim(op))
                pls = placements(grads[idx], dims, f"input {idx} of {h.op}")
                args[idx] = Unwrap.apply(x, dtensor_spec(self.meshes.of(grads[idx]), pls, x,
                                                         tuple(x.shape)))
        if op.kind is OpKind.EMBEDDING and ly.weight is not None \
                and ly.weight.split_degree(0) > 1:
            args[0] = self._masked_lookup(h, args[0])
        for (_, role), p in self.params.of_op(h.op).items():
            local = Unwrap.apply(p.value, dtensor_spec(
                self.meshes.of(p.stored), placements(p.grad, p.dims, f"gradient of {p.fqn}"),
                p.value, tuple(p.value.shape)))
            if role == "bias" or role.startswith("pos"):
                local = bias_share(local, ly.output)
            owner, attr = owner_of(self.module, p.fqn)
            owner._parameters[attr] = local  # nn.Module refuses non-Parameters via setattr
        return args

    def _masked_lookup(self, h: Hook, ids: torch.Tensor) -> torch.Tensor:
        """The local ids of a lookup in this rank's vocabulary rows (:class:`VocabMask`),
        the module's padding row made local while it runs."""
        (lo, hi), *_ = self.comm.region(self.layers[h.op].weight, self.graph[h.op].weight.shape)
        mask = VocabMask.of(ids, (lo, hi))
        self.masks[h.op] = mask
        mod = self.module.get_submodule(h.op)
        padding = getattr(mod, "padding_idx", None)
        if padding is not None:
            self.paddings[h.op] = padding
            mod.padding_idx = mask.local_padding(padding)
        return mask.local_ids(ids)

    def _unmask(self, h: Hook, out: torch.Tensor) -> torch.Tensor:
        mask = self.masks.pop(h.op, None)
        if mask is None:
            return out
        if h.op in self.paddings:
            self.module.get_submodule(h.op).padding_idx = self.paddings.pop(h.op)
        return mask.apply(out)

    def _swap_copies(self, h: Hook) -> None:
        """A tied head computes with its own copy of the table (DTensor code reads it where
        the module is not run on local blocks)."""
        for p in self.params.of_op(h.op).values():
            if p.value is not p.registered:
                owner, attr = owner_of(self.module, p.fqn)
                owner._parameters[attr] = p.value

    def _restore_params(self, h: Hook) -> None:
        for p in self.params.of_op(h.op).values():
            owner, attr = owner_of(self.module, p.fqn)
            owner._parameters[attr] = p.registered

    def _post(self, h: Hook, out: Any) -> Any:
        layout, red = h.output
        where = f"output of {h.op}"
        self._restore_params(h)
        if h.local:
            out = self._unmask(h, out)
            full = self._global_shape(h.op, out)
            dims = DimMap(full, self.graph[h.op].output.rank, heads=heads_dim(self.graph[h.op]))
            out = Wrap.apply(out, dtensor_spec(self.meshes.of(layout),
                                               placements(layout, dims, where), out, full),
                             placements(grad_layout(layout), dims, where), where)
        heads = heads_dim(self.graph[h.op])
        self.edges.check(out, layout, h.op, where, heads)
        if red is None:
            return self._marked(h.op, out)
        with tagged("forward", "activation", h.op):
            converted = self.edges.run(out, layout, red, red.dst, h.op, where, heads)
        self.origin[id(converted)] = (converted, out, h.op)
        return self._marked(h.op, converted)

    def _marked(self, name: str, out: Any) -> Any:
        """``out``, a fused output whose parts its code cuts on each rank's block
        (:class:`~runtime.fused_parts.LocalParts`) where op ``name`` computes them."""
        parts = self.graph[name].attrs.get("parts")
        if parts and self.parts is not None:
            self.parts.mark(out, parts)
        return out

    def _global_shape(self, name: str, local: torch.Tensor) -> tuple[int, ...]:
        """The real global shape of a block computed locally: the IR's global shape with
        the block's trailing real dims (tokens split over the batch dim only)."""
        ir = self.graph[name].output.shape
        if local.dim() == len(ir):
            return tuple(ir)
        heads = heads_dim(self.graph[name])
        if heads is not None:  # a per-head norm's block: its batch and heads split
            lay = self.layers[name].output
            return tuple(n * (lay.split_degree(0) if i == 0 else
                              lay.split_degree(1) if i == heads else 1)
                         for i, n in enumerate(local.shape))
        rows = ir[0] // math.prod(local.shape[1:-1])
        return (rows, *local.shape[1:-1], ir[-1])

    def _inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The module's tensors (the same full batch on every rank) → planned blocks.

        From here until the step's gradients are reduced, plain tensors — masks and rotary
        tables the forward makes or keeps as buffers, the user's targets — act as replicas
        (DTensor's ``implicit_replication``: local, no communication; autograd replays the
        flag into the backward only if it is on when ``backward()`` is called). SDPA split
        over the batch and the heads runs on this rank's blocks
        (:class:`~runtime.local_attention.LocalAttention`), and so does batch norm
        (:class:`~runtime.local_batchnorm.LocalBatchNorm`); any other SDPA on CPU meshes
        takes its math path, where DTensor shards its matmuls and softmax (the fused CPU
        kernel has no sharding rule)."""
        self.origin = {}
        self.calls = {}
        self.off_plan = set()
        self.params.refresh_tied()
        if not self.replicating:
            self.replicating.enter(implicit_replication())
        if self.device_type == "cpu":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            self.forward_only.enter(sdpa_kernel([SDPBackend.MATH]))
        self.forward_only.enter(LocalAttention())
        self.forward_only.enter(LocalDropout())
        self.forward_only.enter(LocalBatchNorm(self.batchnorms))
        if any(op.kind is OpKind.PART for op in self.graph.ops):
            self.parts = LocalParts()
            self.forward_only.enter(self.parts)
        inputs = [op for op in self.graph.ops if op.kind is OpKind.INPUT]
        values = list(args) + list(kwargs.values())
        if len(values) != len(inputs):
            raise RuntimeSetupError(f"the plan's graph has {len(inputs)} input(s), the module "
                                    f"got {len(values)}")
        out = [self._input_block(op, x) for op, x in zip(inputs, values, strict=True)]
        return tuple(out[:len(args)]), dict(zip(kwargs, out[len(args):], strict=True))

    def _input_block(self, op: Op, x: torch.Tensor) -> DTensor:
        """Input ``op``'s full tensor ``x`` as this rank's block of the one layout its
        consumers read (unit mesh axes aside: the planner couples them so,
        :func:`~ilp_planner.intra_op.problem.input_reads`), on the first consumer's mesh."""
        wants = [self.layers[c].inputs[i] for c in self.graph.consumers(op.name)
                 for i, src in enumerate(self.graph[c].inputs) if src == op.name]
        seen = {drop_unit_axes(lay) for lay in wants}
        if len(seen) != 1:
            raise RuntimeSetupError(f"input {op.name!r} is read in {len(seen)} layouts "
                                    f"({', '.join(sorted(map(str, seen)))})")
        lay = wants[0]
        batch = op.attrs.get("row_items")
        if x.numel() != op.output.numel or (batch and x.dim() and x.shape[0] != batch):
            example = f"a batch of {batch}, " if batch else ""
            raise RuntimeSetupError(
                f"input {op.name!r} has shape {tuple(x.shape)}; the plan was solved for "
                f"{example}{op.output.numel} elements: a plan's layouts and prices are for its "
                f"example inputs' shapes — pad the batch to them, or import and solve for these")
        local = self.comm.block(x.reshape(op.output.shape), lay)
        dims = DimMap(tuple(x.shape), op.output.rank)
        spec = dtensor_spec(self.meshes.of(lay), placements(lay, dims, op.name), x, tuple(x.shape))
        return DTensor(_real_block(local, x, lay), spec, requires_grad=False)

    def _output(self, out: Any) -> Any:
        """The module's output, whatever its structure (a tensor, a tuple, a dict, a
        ``ModelOutput``): its first tensor is the graph's output (the importer's), checked
        and brought to the layout the loss reads; every tensor in it then reaches the user as
        the single-process module returns it where its layout is replicated — a plain
        tensor with the whole value — and as a DTensor where it is split or partial (the
        user's loss on it is DTensor code)."""
        self.forward_only.leave()
        _check_calls(self.runs, self.calls)
        leaves, structure = tree_flatten(out)
        first = next((i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)), None)
        if first is None:
            raise RuntimeSetupError(f"the module returned {type(out).__name__} with no tensor")
        leaves[first] = self._planned_output(leaves[first])
        return tree_unflatten([_user_tensor(x) for x in leaves], structure)

    def _planned_output(self, out: Any) -> Any:
        name = output_op(self.graph)
        assert self.final is not None
        arrives, red = self.final
        self.edges.check(out, arrives, name, f"output of the module ({name})")
        if red is None:
            return out
        with tagged("forward", "activation", name):
            return self.edges.run(out, arrives, red, red.dst, name, "the module's output")


def _check_calls(runs: dict[str, list[Hook]], calls: dict[str, int]) -> None:
    """Every module ran each call the plan has an op for, in this forward."""
    for path, hs in runs.items():
        n = calls.get(path, 0)
        if n == 0:
            raise RuntimeSetupError(
                f"module {path!r} was not called in the forward, though the plan has an op for "
                f"it: code outside it computes with its parameters (Mamba-2's "
                f"causal_conv1d_fn(x, conv1d.weight, …)), which parallelize cannot run as the "
                f"op's module")
        if n != len(hs):
            raise RuntimeSetupError(f"module {path!r} ran {n} of the {len(hs)} calls the plan "
                                    f"has ops for in this forward")


def _on_first(out: Any, post: Callable[[Any], Any]) -> Any:
    """``post`` on a module's output — the op's value — or, where the module returns it
    as the only tensor of a tuple or list (FNet's Fourier transform returns
    ``(output,)``), on that tensor, the structure kept."""
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor) \
            and not any(isinstance(x, torch.Tensor) for x in out[1:]):
        return type(out)([post(out[0]), *out[1:]])
    return post(out)


def _on_constants(mod: nn.Module, args: tuple) -> bool:
    """Whether this call of a module without parameters reads no value of the plan — only
    tensors made outside it, none a DTensor: the importer folded it into a constant, so no
    op is its (XLNet's dropout module run on the relative position encodings, between its
    calls on the embeddings and on the last layer's output). Every planned call reads a
    DTensor: the module's inputs are placed before its first op runs."""
    tensors = [a for a in tree_flatten(args)[0] if isinstance(a, torch.Tensor)]
    return (bool(tensors) and not any(isinstance(a, DTensor) for a in tensors)
            and next(mod.parameters(), None) is None)


def _user_tensor(x: Any) -> Any:
    """A replicated DTensor as its local tensor (the whole value; its gradient comes back
    replicated, no communication); anything else as it is."""
    if not isinstance(x, DTensor) or any(not pl.is_replicate() for pl in x.placements):
        return x
    return Unwrap.apply(x, dtensor_spec(x.device_mesh, tuple(x.placements), x, tuple(x.shape)))


def _real_block(local: torch.Tensor, x: torch.Tensor, lay: Layout) -> torch.Tensor:
    """An IR block (tokens-major) reshaped to the real tensor's dims (:class:`DimMap`'s
    ``(batch, …, features)``): tokens split over the batch dim keep whole rows of the
    middle dims; the features keep the block's (a plan may read an input split on them:
    a residual add split over its columns)."""
    if local.dim() == x.dim():
        return local.contiguous()
    k = lay.split_degree(0)
    if local.dim() == 1:  # token ids: (tokens,) is the real (batch, …)
        return local.reshape(x.shape[0] // k, *x.shape[1:]).contiguous()
    return local.reshape(x.shape[0] // k, *x.shape[1:-1], local.shape[-1]).contiguous()
