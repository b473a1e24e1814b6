"""Plan the user's own PyTorch model: ``nn.Module`` → layer graph, through ``torch.export``.

The exported (training-IR) graph is walked node by node and lifted to the planner's IR
(:mod:`ilp_planner.ir.graph`), whose activations are ``(tokens, features)`` (leading dims
folded into tokens) or ``(N, C, H, W)`` for convolutional ones:

* ``linear`` (and ``x @ W`` with a parameter ``W``, and ``addmm``: Hugging Face's
  ``Conv1D``) → ``linear`` with the weight as ``(in, out)`` (``attrs.weight_t`` where the
  module stores it ``(out, in)``); ``embedding`` → ``embedding`` (each table looked up with
  constant ids and added to it — positions, token types — folds into it as one more
  parameter, as the builders' GPT's position table; a table an earlier embedding owns —
  T5's decoder looks up its encoder's — is a tied copy, ``attrs.tied``); ``layer_norm`` / ``rms_norm``
  (and a hand-written RMSNorm: a last-dim mean, then a product with a 1-D gain) →
  ``layernorm`` / ``rmsnorm``; ``conv2d``, ``batch_norm``, pooling, ``flatten``;
* ``scaled_dot_product_attention`` and hand-written attention (``q @ kᵀ``, mask, softmax,
  ``· v``) → one ``attention`` op reading the projections its q, k, v come from (one fused
  tensor or three), with heads, sequence length, grouped-query ``kv_heads`` and the fused
  layout (``[q | k | v]`` blocks are not whole heads: ``qkv_major``, batch splits only).
  Views, transposes, splits, casts, rotary embeddings and masks between a projection and
  the attention are folded into it; a learned table an SDPA's mask looks up (T5's relative
  position bias, ``(buckets, heads)``) is owned by the first attention reading it
  (``bias_buckets``) and marks every reader ``bias_table``; DeepSeek's multi-head latent
  attention reads its queries' projection, ``kv_b_proj`` (each head's key part and values)
  and the rotary key part every head shares (``kv_a_proj_with_mqa``: ``shared_input``, read
  whole where heads split), q's head dim (nope + rope) and v's own pricing its FLOPs; a
  ``new_empty`` tensor filled slice by slice (MLA's key states) is the concatenation of what
  was copied in, and a copy of some of a projection's columns (MLA's latent part) is an opaque
  copy that may split the tokens (``rows_local``); element-wise steps on q, k, v before the
  attention (rotary) are priced with it by their bytes (``input_steps``), and its mask is
  evaluated (:mod:`ilp_planner.inputs.lift_masks`): anything but provable plain causal
  attention is ``not_plain_causal``;
* a linear's output cut by ``chunk`` / ``split`` of its last dim into equal parts (Phi-3's
  fused ``gate_up_proj``: gate and up) → a ``part`` op per block, following the linear,
  which is marked ``attrs.parts``: a column split keeps matching blocks on each device
  (:mod:`runtime.fused_parts`), priced as the unfused projections;
* element-wise ops of one activation (``gelu``, ``relu``, ``silu``, ``dropout``) become
  followers; a bias or gain folds into the op owning it; the other element-wise steps of
  the module's code (a hand-written tanh GELU's pow, tanh and products, a written-out
  RMSNorm's pow, mean and rsqrt, scales) fold into the value, and each is a kernel priced
  with the op reading that value (``attrs.input_steps``:
  :func:`ilp_planner.inputs.lift_graph.folded_steps`), once — by torch's bytes forward and
  by what autograd runs backward (:mod:`ilp_planner.inputs.lift_backward`); a sum /
  difference / product of two activations → ``add`` / ``mul``; a folded re-view that moves
  bytes (a cast to another dtype, ``contiguous`` of strided data, ``clone``, a ``cat``, a
  repeat, a reshape torch cannot view) is a copy priced the same way
  (``attrs.input_copies``);
* in-place ops (``out += identity``: ``add_``) are lifted as their out-of-place forms; list
  arguments (``cat``, ``stack``) are looked up tensor by tensor;
* a Hugging Face mixture-of-experts block (router + experts as 3-D tensors: Mixtral,
  Qwen2-MoE) → one ``moe`` op (:mod:`ilp_planner.inputs.lift_moe`), its shared expert
  traced as the dense MLP it is;
* the loss: ``loss_fn(output)`` traced with the model, or (without ``loss_fn``) the mean
  cross-entropy of the output over its last dim, the runtime's convention — of its
  ``logits`` field where it returns a structure (``output=`` picks another).

An op the planner cannot shard becomes ``opaque``: kept replicated, its inputs gathered,
priced with the FLOPs torch's ``FlopCounterMode`` counts for it and the bytes it reads and
writes (``attrs.bytes_read`` / ``bytes_written``), listed by ``validate``
(:func:`ilp_planner.reports.summary.unsharded_summary`). Repeated blocks — children ``i`` of
a numbered container whose ops have the same signature, whatever the container is called —
are marked ``block`` / ``block_index`` so tying applies. Op names are the user's module paths
(``transformer.h.3.attn.c_attn``; functional ops inside a module get ``<path>.<kind>`` and,
for a plan run on the module, ``attrs.functional``: readers of one shared value,
:meth:`~ilp_planner.ir.graph.Graph.shared_reads` — as is a module's input read through the
user's code outside it, ``attrs.functional_inputs``), and
each op lists the parameters it owns (``Op.source_params``) so a plan can be applied back to
the module (:mod:`ilp_planner.parallelize`).

The walk and its handlers live in :mod:`ilp_planner.inputs.lifting` (the ``op → handler``
table), :mod:`ilp_planner.inputs.lift_layers`, :mod:`ilp_planner.inputs.lift_elementwise`
and :mod:`ilp_planner.inputs.lift_graph` (the draft IR); block marking in
:mod:`ilp_planner.inputs.block_marking`. This module runs ``torch.export`` on the user's
module and freezes the walk's drafts into the :class:`Graph`.

``torch.fx`` symbolic tracing is the fallback where ``torch.export`` fails: the traced
``GraphModule`` (whose Python control flow tracing has resolved) is exported again; where
neither works the error names both failures.
"""

from __future__ import annotations

import dataclasses
import linecache
import re
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any

from ilp_planner.errors import ConfigError
from ilp_planner.inputs.block_marking import mark_blocks
from ilp_planner.inputs.dtensor_gaps import dtensor_gaps
from ilp_planner.inputs.export_regions import inline_no_grad_regions
from ilp_planner.inputs.lift_backward import StepsBackward, replay_backward, stored_bytes
from ilp_planner.inputs.lift_graph import DraftGraph, NodeCost
from ilp_planner.inputs.lift_masks import ConstantValues
from ilp_planner.inputs.lift_moe import routed_as_one_op
from ilp_planner.inputs.lift_values import Act, Draft, Unsupported, numel
from ilp_planner.inputs.lifting import lift
from ilp_planner.ir.graph import HALF_DTYPES, Graph, Op, OpKind, TensorSpec
from ilp_planner.lowering.strategies import tied_source


def from_module(module: Any, example_inputs: Any, *,
                loss_fn: Callable[[Any], Any] | None = None, name: str | None = None,
                dtensor: bool = True, output: str | int | None = None) -> Graph:
    """The layer graph of ``module`` run on ``example_inputs`` (a tensor, a tuple of them, or
    a mapping of keyword arguments), through ``torch.export``; ``torch.fx`` symbolic tracing
    where export fails. ``loss_fn(output) → scalar`` is traced with the model; without it the
    loss is the mean cross-entropy over the output's last dim. Tensors may live on the
    ``meta`` device (a 1B-parameter model imports without allocating it).

    ``dtensor`` (default): the plan will run on this module under ``ilp_planner.parallelize``,
    where the user's own code runs on DTensors — so hand-written attention splits the batch
    or the heads, not both (DTensor's 4-D matmul cannot always merge the two splits:
    ``attrs.one_split``; SDPA may split both), and the user's loss reads its logits with
    whole classes (``attrs.whole_classes``). False gives
    the bare graph, as the builders would (the runtime's own executor runs it).

    A model may return a structure — a Hugging Face ``ModelOutput``, a dict, a tuple: the
    default loss reads its ``logits`` field, else its first tensor; ``output`` (a field name
    or an index) picks another."""
    import torch
    import torch.utils.flop_counter  # noqa: F401 - the backward counts' FLOPs (lift_backward)

    args, kwargs = _distinct(*_split_inputs(example_inputs), torch)
    root, strip = module, ""
    if loss_fn is not None:
        root, strip = _WithLoss(module, loss_fn), "model."
    with routed_as_one_op(module, torch):
        ep = _export(root, args, kwargs, torch)
    inline_no_grad_regions(ep, torch, type(module).__name__)
    g = DraftGraph(module, _NodeCounter(ep, args, kwargs, torch), strip, dtensor,
                   ConstantValues(ep, torch))
    try:
        lift(g, ep)
    except Unsupported as exc:
        raise ConfigError(f"cannot import {type(module).__name__}: {exc}") from None
    out = _model_output(g.outputs, ep.call_spec.out_spec, output, type(module).__name__)
    own_loss = any(d.kind is OpKind.LOSS for d in g.drafts.values())
    if g.drafts[out.src[0]].kind is not OpKind.LOSS:
        g.loss(_Synthetic("loss"), out)
    if own_loss and dtensor and loss_fn is None:
        raise ConfigError(
            f"cannot import {type(module).__name__} to run under parallelize: its output is "
            f"a loss its own forward computes (from its targets — Hugging Face's `labels`), "
            f"which parallelize does not run on the module's sharded values; call it without "
            f"the targets and compute the loss on its output (``loss_fn=``, or the default "
            f"cross-entropy over its logits), or import with dtensor=False for a plan the "
            f"runtime's own executor runs")
    ops = _no_grad_marked(_unused_marked(_frozen_marked(
        _frozen_ops(list(g.drafts.values()), g.param_shape), module, type(module).__name__),
        g.param_shape))
    if dtensor:  # the plan runs on the module: its functional code reads shared values
        ops = _own_precision_marked(ops, module)
        ops = _read_through_code([_marked_functional(op, module) for op in ops],
                                 g.through_code)
        ops = _whole_items(ops, _batch(args, kwargs, torch))
    return Graph(name or type(module).__name__, ops,
                 dtensor_gaps(torch, ep) if dtensor else ())


class _NodeCounter:
    """Prices the nodes the planner cannot shard with torch's own ``FlopCounterMode``.

    An aten op is run once more on its fake tensors (the export's fake mode: no memory, no
    data). A custom op (``transformers::grouped_mm_fallback``, a mixture of experts'
    matmuls) has only a shape function there, and what it computes depends on the data
    (tokens per expert): it is counted on one run of the exported program on the example
    inputs. Bytes are those of the tensors a node reads and writes."""

    def __init__(self, ep: Any, args: tuple, kwargs: dict, torch: Any):
        from torch._library.custom_ops import _maybe_get_opdef

        self.torch = torch
        bodies = {n.name: body for n in ep.graph.nodes
                  if isinstance(n.target, torch._ops.OpOverload)
                  and (body := _maybe_get_opdef(n.target)) is not None}
        self.counted_on_data = _flops_on_data(ep, args, kwargs, bodies, torch) if bodies else {}

    def __call__(self, node: Any) -> NodeCost:
        torch = self.torch
        from torch.utils.flop_counter import FlopCounterMode

        def val(a: Any) -> Any:
            return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

        args = torch.utils._pytree.tree_map(val, node.args)
        kwargs = torch.utils._pytree.tree_map(val, node.kwargs)
        inputs = [t for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)]
        outputs = [t for t in torch.utils._pytree.tree_leaves(node.meta.get("val"))
                   if isinstance(t, torch.Tensor)]
        flops = self.counted_on_data.get(node.name)
        if flops is None:
            with torch._guards.detect_fake_mode(inputs + outputs), \
                    FlopCounterMode(display=False) as counter:
                node.target(*args, **kwargs)
            flops = counter.get_total_flops()
        return NodeCost(float(flops), stored_bytes(inputs), stored_bytes(outputs))

    def backward(self, nodes: Sequence[Any], trained: Callable[[str], bool]
                 ) -> StepsBackward:
        """The backward of the folded steps ``nodes`` as autograd runs it, replayed on
        their fake tensors (:func:`ilp_planner.inputs.lift_backward.replay_backward`); an
        op torch cannot run again there is named in one line, not priced by a guess."""
        try:
            return replay_backward(self.torch, nodes, trained)
        except Exception as exc:  # noqa: BLE001 - whatever the replayed op raises
            raise Unsupported(nodes[-1], f"its backward, with the steps folded before it, "
                              f"could not be replayed to count it ({_first_line(exc)})"
                              ) from None


def _flops_on_data(ep: Any, args: tuple, kwargs: dict, bodies: dict[str, Any], torch: Any
                   ) -> dict[str, float]:
    """The FLOPs of the custom-op nodes ``bodies`` (node name → the op's definition),
    counted on one run of the exported program on the example inputs, without gradients;
    none where the inputs hold no data (``meta``). Each runs its Python body there, so the
    counter sees the aten ops inside (called through the op, they would run below the
    counter, uncounted)."""
    from torch.utils.flop_counter import FlopCounterMode

    flat = torch.utils._pytree.tree_leaves((args, kwargs))
    if any(isinstance(t, torch.Tensor) and t.is_meta for t in flat):
        return {}
    counted: dict[str, float] = {}

    class Counting(torch.fx.Interpreter):
        def run_node(self, n: Any) -> Any:
            if n.name not in bodies:
                return super().run_node(n)
            a, kw = self.fetch_args_kwargs_from_env(n)
            with FlopCounterMode(display=False) as counter:
                out = bodies[n.name]._init_fn(*a, **kw)
            counted[n.name] = float(counter.get_total_flops())
            return out

    runner = ep.module()
    # the run updates buffers (batch-norm statistics) the user's module shares: put them back
    saved = {name: b.clone() for name, b in runner.named_buffers()}
    with torch.no_grad():
        try:
            Counting(runner).run(*flat)
        finally:
            for name, b in runner.named_buffers():
                b.copy_(saved[name])
    return counted


def _frozen_ops(drafts: list[Draft], param_shape: dict[str, tuple[int, ...]]) -> list[Op]:
    """The drafts as IR ops, with their repeated blocks marked. An opaque op owning several
    parameters records each one's size (:func:`ilp_planner.ir.graph.opaque_param_sizes`), so
    the plan prices one role per parameter, as the runtime places them. Three marks need
    every op's readers, so they are made here: a fused linear another op also reads whole
    (``attrs.parts_read_whole``), and a projection a per-head norm reads (its heads,
    ``attrs.whole_heads``) — each narrows the column splits its strategies offer — and the
    part that carries the fused output's backward ``cat`` (``attrs.cat``, with the parts no
    code reads, ``attrs.unread_parts``)."""
    blocks = mark_blocks(drafts)
    read_whole = {i for d in drafts if d.kind is not OpKind.PART for i in d.inputs}
    # a projection a per-head norm reads: its heads (its columns split in whole heads)
    heads = {d.inputs[0]: d.shape[1] // d.attrs["group_width"] for d in drafts
             if d.attrs.get("group_width")}
    # a fused output's parts: autograd's one cat of their gradients (with zeros for the
    # blocks no code reads) is priced on the lowest part read (compute_model's ``part``)
    read: dict[str, list[Draft]] = {}
    for d in drafts:
        if d.kind is OpKind.PART:
            read.setdefault(d.inputs[0], []).append(d)
    cats = {min(ps, key=lambda d: d.attrs["part"]).name: ps[0].attrs["parts"] - len(ps)
            for ps in read.values()}
    ops = []
    for d in drafts:
        block, index = blocks.get(d.name, (None, None))
        weight = TensorSpec(d.weight, d.dtype) if d.weight is not None else None
        attrs = dict(d.attrs)
        if d.kind is not OpKind.PART and attrs.get("parts") and d.name in read_whole:
            attrs["parts_read_whole"] = 1  # its columns stay whole: fused_parts_strategies
        if d.name in cats:
            attrs.update(cat=1, unread_parts=cats[d.name])
        elif d.kind is OpKind.PART:
            attrs["cat"] = 0
        if d.name in heads and d.kind is OpKind.LINEAR:
            attrs["whole_heads"] = heads[d.name]  # strategies.head_column_strategies
        if d.kind is OpKind.OPAQUE and len(d.source_params) > 1:
            attrs.update({f"param_{i}": numel(param_shape[p])
                          for i, p in enumerate(d.source_params)})
        ops.append(Op(d.name, d.kind, d.inputs, TensorSpec(d.shape, d.dtype), weight, d.params,
                      d.flops, block, index, MappingProxyType(attrs),
                      source_params=d.source_params))
    return ops


def _marked_functional(op: Op, module: Any) -> Op:
    """``op`` with ``attrs.functional`` where it is the user's functional code — not a call
    of a childless module (the op named after its path, or ``<path>.<kind>[_i]`` for a later
    call of a parameterless one: a dropout run twice), not a mixture-of-experts block (run
    in its experts module). Those are the readers :mod:`runtime.apply` serves from one value
    at their producer's boundary (:meth:`Graph.shared_reads`)."""
    if op.kind in (OpKind.INPUT, OpKind.MOE) or _leaf(module, op.name):
        return op
    path, _, last = op.name.rpartition(".")
    if path and re.fullmatch(rf"{re.escape(op.kind.value)}(_\d+)?", last) \
            and not op.source_params and _leaf(module, path) \
            and not any(True for _ in module.get_submodule(path).parameters()):
        return op
    return dataclasses.replace(op, attrs=MappingProxyType({**op.attrs, "functional": 1}))


def _read_through_code(ops: list[Op], outside: Mapping[str, tuple[int, ...]]) -> list[Op]:
    """``ops`` with ``attrs.functional_inputs`` on each module's op (not functional code)
    reading an input through element-wise steps the user's code ran outside its module
    (``outside``: :meth:`DraftGraph._steps_outside`) on the output of another module that
    functional code reads too: that producer's boundary converts its output for its
    functional readers, so this module receives the steps' result of the converted value,
    not something its own boundary could convert (Granite's ``inputs_embeds * scale``, read
    by the first layer's norm and the residual add). Where no functional code reads the
    producer (GPT-2's ``c_fc`` → its GELU module → ``c_proj``), nothing converts it before
    the steps: the module's own program runs on their result from the producer's layout,
    its backward resolving the module's gradient before the steps' backward (a partial
    sum never reaches a non-linear step); a functional producer has no boundary at all."""
    by_name = {op.name: op for op in ops}
    read = {src for op in ops if op.attrs.get("functional") for src in op.inputs}

    def module(name: str) -> bool:
        op = by_name[name]
        return op.kind is not OpKind.INPUT and not op.attrs.get("functional")

    out = []
    for op in ops:
        bits = sum(1 << i for i in outside.get(op.name, ())
                   if module(op.name) and module(op.inputs[i]) and op.inputs[i] in read)
        out.append(dataclasses.replace(op, attrs=MappingProxyType(
            {**op.attrs, "functional_inputs": bits})) if bits else op)
    return out


def _leaf(module: Any, path: str) -> bool:
    """Whether ``path`` names a childless submodule of ``module``."""
    try:
        sub = module.get_submodule(path)
    except AttributeError:
        return False
    return not any(True for _ in sub.children())


class _Synthetic:
    """A stand-in node for ops the importer adds itself (the default loss)."""

    def __init__(self, name: str):
        self.name = name
        self.target = name
        self.meta: dict = {}
        self.args: tuple = ()


def _model_output(values: list[Any], spec: Any, output: str | int | None, model: str) -> Act:
    """The activation the loss reads among the graph's outputs: the user's outputs are the
    last ``spec.num_leaves`` (buffer updates come first), laid out as ``spec`` says."""
    leaves = values[len(values) - spec.num_leaves:]
    keys = _output_fields(spec)
    if output is None:
        picked = leaves[keys["logits"]] if "logits" in keys else next(
            (v for v in leaves if isinstance(v, Act)), None)
    elif output in keys:
        picked = leaves[keys[output]]
    else:
        raise ConfigError(f"cannot import {model}: it returns no output {output!r} (it has "
                          f"{', '.join(map(repr, keys)) or 'one tensor'})")
    if not isinstance(picked, Act):
        raise ConfigError(f"cannot import {model}: its output does not depend on the example "
                          f"inputs")
    return picked


def _output_fields(spec: Any) -> dict[str | int, int]:
    """Field name and position → index of its first tensor among the output's leaves, for
    the top level of a structured output (none for a single tensor)."""
    # ``children()`` from torch 2.6; ``children_specs`` before (deprecated after)
    children = spec.children() if hasattr(spec, "children") else spec.children_specs
    names = spec.context if isinstance(spec.context, (list, tuple)) else []
    out: dict[str | int, int] = {}
    first = 0
    for i, child in enumerate(children):
        out[i] = first
        if i < len(names) and isinstance(names[i], str):
            out[names[i]] = first
        first += child.num_leaves
    return out


def _frozen_marked(ops: list[Op], module: Any, name: str) -> list[Op]:
    """``ops`` with ``attrs.frozen`` (:attr:`~ilp_planner.ir.graph.Op.frozen`) on each op
    whose parameters are all frozen in ``module`` (``requires_grad=False``: a fine-tuning's
    frozen embeddings, encoder or vision tower; Whisper's sinusoidal positions). Refused,
    by name: an op with some parameters frozen and others not (its one gradient bucket
    and optimizer state are per op), a frozen table tied to a head, a frozen mixture of
    experts."""
    frozen = {n for n, p in module.named_parameters(remove_duplicate=False)
              if not p.requires_grad}
    if not frozen:
        return ops
    view = SimpleNamespace(ops=ops)
    tied = {n for o in ops if o.attrs.get("tied")
            for n in (o.name, getattr(tied_source(view, o), "name", None))}
    out = []
    for op in ops:
        hit = [n for n in op.source_params if n in frozen]
        if not hit:
            out.append(op)
            continue
        why = ("some of its parameters are frozen and others not "
               f"({', '.join(hit)} of {', '.join(op.source_params)}): the plan freezes an "
               "op's parameters all or none — freeze or unfreeze all of them"
               if len(hit) < len(op.source_params)
               else "its table is frozen and tied to another op, whose gradient exchange "
               "needs both copies trained — unfreeze it or untie the copies"
               if op.name in tied
               else "a frozen mixture of experts is not supported — unfreeze it"
               if op.kind is OpKind.MOE else None)
        if why:
            raise ConfigError(f"cannot import {name}: op {op.name!r}: {why}")
        out.append(dataclasses.replace(op, attrs=MappingProxyType({**op.attrs, "frozen": 1})))
    return out


def _own_precision_marked(ops: list[Op], module: Any) -> list[Op]:
    """``ops`` with ``attrs.own_precision`` (:attr:`~ilp_planner.ir.graph.Op.master_spec`)
    on each op whose parameters are all half-precision in ``module``: ``parallelize``
    trains the module's parameters as they are — gradients reduced and exchanged in their
    own dtype, the user's optimizer stepping them with no float32 master — so the plan
    prices that, not the mixed precision the runtime's own executor runs. An op whose
    other parameters are half-precision and some float32 (``from_pretrained`` keeps
    HunYuan's router in float32 beside its bfloat16 experts) is marked too, with those
    roles in ``attrs.float32_roles`` (:meth:`~ilp_planner.ir.graph.Op.grad_itemsize`)."""
    dtypes = {n: str(p.dtype).removeprefix("torch.")
              for n, p in module.named_parameters(remove_duplicate=False)}
    if not any(d in HALF_DTYPES for d in dtypes.values()):
        return ops
    out = []
    for op in ops:
        mine = [dtypes.get(n) for n in op.source_params]
        full = sum(1 << i for i, d in enumerate(mine) if d == "float32")
        if mine and all(d in HALF_DTYPES or d == "float32" for d in mine) \
                and any(d in HALF_DTYPES for d in mine):
            op = dataclasses.replace(op, attrs=MappingProxyType(
                {**op.attrs, "own_precision": 1, **({"float32_roles": full} if full else {})}))
        out.append(op)
    return out


def _unused_marked(ops: list[Op], param_shape: Mapping[str, tuple[int, ...]]) -> list[Op]:
    """``ops`` with each op no path leads from to the loss (the last loss op) made an
    unused one (:attr:`~ilp_planner.ir.graph.Op.unused`): the model computes it and
    nothing reads it, so autograd gives its parameters no gradient."""
    loss = next(op for op in reversed(ops) if op.kind is OpKind.LOSS)
    live = {loss.name}
    for op in reversed(ops):
        if op.name in live:
            live.update(op.inputs)
    by_name = {op.name: op for op in ops}
    return [op if op.name in live or op.kind is OpKind.INPUT
            else _computed_whole(op, [by_name[i].output for i in op.inputs], param_shape)
            for op in ops]


_KEPT_ON_WHOLE = ("functional", "functional_inputs", "row_items", "relayout")
"""The marks an unused op keeps as an opaque one: where its code runs and what it reads."""


def _computed_whole(op: Op, inputs: list[TensorSpec],
                    param_shape: Mapping[str, tuple[int, ...]]) -> Op:
    """An unused op as an opaque one (``attrs.unused``, ``attrs.frozen``): computed whole
    on every device as one process does — its FLOPs and the bytes it reads and writes
    priced, its parameters replicated and given no gradient. Nothing of it reaches the
    loss, so no split could pay for itself; and an opaque op runs wherever the user's
    code leaves it — beside the functional code reading the same value replicated
    (SigLIP's attention-pooling head beside the classifier's token mean)."""
    attrs = {k: v for k, v in op.attrs.items() if k in _KEPT_ON_WHOLE}
    sizes = [numel(param_shape[p]) for p in op.source_params]
    if len(sizes) > 1:
        attrs.update({f"param_{i}": n for i, n in enumerate(sizes)})
    item = op.output.itemsize
    attrs.update(unused=1, frozen=1, no_grad=1,
                 bytes_read=sum(t.nbytes for t in inputs) + sum(sizes) * item,
                 bytes_written=op.output.nbytes)
    return dataclasses.replace(op, kind=OpKind.OPAQUE, weight=None, params=sum(sizes),
                               attrs=MappingProxyType(attrs))


def _no_grad_marked(ops: list[Op]) -> list[Op]:
    """``ops`` with ``attrs.no_grad`` (:attr:`~ilp_planner.ir.graph.Op.no_grad`) on each
    op whose output takes no gradient (:meth:`~ilp_planner.ir.graph.Graph.gradient_carriers`:
    a frozen base, an image padded in code, a mask computed from the ids): autograd runs
    none of its backward, so none is priced."""
    carriers = Graph("carriers", ops).gradient_carriers()
    return [op if op.kind is OpKind.INPUT or op.name in carriers else dataclasses.replace(
        op, attrs=MappingProxyType({**op.attrs, "no_grad": 1})) for op in ops]


def _batch(args: tuple, kwargs: dict, torch: Any) -> int | None:
    """The example's batch: the leading dim of its first tensor input."""
    return next((int(x.shape[0]) for x in (*args, *kwargs.values())
                 if isinstance(x, torch.Tensor) and x.dim() >= 1), None)


def _whole_items(ops: list[Op], batch: int | None) -> list[Op]:
    """Each op whose rows hold whole examples marked with the batch (``attrs.row_items``):
    ``parallelize`` splits an activation's rows over the module's batch dim only, so its
    strategies split them by a divisor of the batch (a batch of 3 on 4 devices split 2 ways
    would fail at the first forward); a model input marked so too, which ``parallelize``
    checks the module is handed. An opaque op's own mark stays."""
    if not batch:
        return ops
    return [dataclasses.replace(op, attrs=MappingProxyType({**op.attrs, "row_items": batch}))
            if "row_items" not in op.attrs
            and op.output.rank >= 1 and op.output.shape[0] % batch == 0
            and op.output.shape[0] >= batch else op
            for op in ops]


def _split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (list, tuple)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def _distinct(args: tuple, kwargs: dict, torch: Any) -> tuple[tuple, dict]:
    """The example inputs with a tensor passed twice (the same ids as BART's encoder and
    decoder inputs) cloned: ``torch.export`` makes one placeholder of one tensor object, so
    the second input would have no reader of its own — and ``parallelize``, handed one
    tensor per input, no layout to give it."""
    seen: set[int] = set()

    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if id(x) in seen:
                return x.clone()
            seen.add(id(x))
        return x

    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def _export(root: Any, args: tuple, kwargs: dict, torch: Any) -> Any:
    """The exported program of ``root`` on the example inputs; where ``torch.export``
    fails, of its ``torch.fx`` trace — except on a branch on a value only known at run
    time (:func:`_run_time_branch`), which fx would trace at the one value it computes."""
    try:
        return torch.export.export(root, args, kwargs, strict=False)
    except Exception as export_error:  # noqa: BLE001 - any export failure: try fx next
        branch = _run_time_branch(export_error, torch)
        if branch:
            raise ConfigError(f"cannot import {type(root).__name__}: torch.export failed "
                              f"({_first_line(export_error)}){branch}") from None
        try:
            traced = torch.fx.symbolic_trace(root)
            return torch.export.export(traced, args, kwargs, strict=False)
        except Exception as fx_error:  # noqa: BLE001 - report both
            raise ConfigError(
                f"cannot import {type(root).__name__}: torch.export failed ({_first_line(export_error)}) "
                f"and torch.fx symbolic tracing failed too ({_first_line(fx_error)})"
                f"{_cache_hint(root)}") from None


def _cache_hint(root: Any) -> str:
    """What to do when the model returns a key / value cache (a Hugging Face model built
    with ``use_cache=True``): the cache is no tensor, so neither tracer can return it. The
    model is ``root`` or, under the loss wrapper, its ``model``."""
    if any(getattr(getattr(m, "config", None), "use_cache", False)
           for m in (root, getattr(root, "model", None))):
        return "; the model returns a key/value cache: pass use_cache=False (in its config)"
    return ""


def _run_time_branch(exc: Exception, torch: Any) -> str:
    """Where the forward branched on a value only known at run time — the line of the
    model's code (outside torch) the export stopped at — and why no plan can have it: a
    plan fixes which ops run, so a branch on the data or on a random draw (LayerDrop's
    ``if torch.rand([]) < layerdrop``, M2M100's default 0.05) cannot be planned. Empty
    for any other failure. (``torch.fx`` runs a draw made inside the forward eagerly and
    traces the branch it happened to take: a plan for a model that sometimes skips a
    layer.) Where an experts module loops over the experts its tokens chose (DBRX's), it
    says that the importer does not recognise that mixture-of-experts block."""
    guard = torch.fx.experimental.symbolic_shapes.GuardOnDataDependentSymNode
    if not isinstance(exc, guard):
        return ""
    torch_dir = str(Path(torch.__file__).parent)
    frames = [(frame, lineno) for frame, lineno in traceback.walk_tb(exc.__traceback__)
              if not frame.f_code.co_filename.startswith(torch_dir)]
    if not frames:
        return ""
    frame, lineno = frames[-1]
    file = frame.f_code.co_filename
    line = linecache.getline(file, lineno or 0).strip()  # (None on 3.12: no line known)
    where = f"{Path(file).name}:{lineno}"
    if re.match(r"assert\b|torch\._assert|torch\._check", line):  # I-BERT's range checks
        return (f"; the forward asserts on a value computed at run time at {where} "
                f"({line!r}), which torch.export cannot trace: a check of the data, not "
                f"of the program — leave it out of the module you import")
    owner = frame.f_locals.get("self")
    if isinstance(owner, torch.nn.Module) and "expert" in (type(owner).__name__ + line).lower():
        return (f"; {type(owner).__name__} loops over the experts its tokens were routed to "
                f"at {where} ({line!r}): a mixture-of-experts block the importer does not "
                f"recognise, so it could not lift it as one moe op — it lifts a router "
                f"'gate' or 'router' with a 2-D weight and top_k beside 'experts' holding "
                f"gate_up_proj and down_proj with SiLU (Mixtral's, Qwen's, DeepSeek's form) "
                f"or GPT-OSS's; this block's form the planner cannot price or run")
    return (f"; the forward branches on a value computed at run time at {where} ({line!r}): "
            f"a plan fixes which ops run, so no branch may depend on the data or on a random "
            f"draw: turn that off (LayerDrop: its layerdrop fields 0 in the model's config)")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _with_loss_class() -> type:
    import torch

    class WithLoss(torch.nn.Module):
        """The user's module followed by their loss, so both trace as one program."""

        def __init__(self, model: Any, loss_fn: Callable[[Any], Any]):
            super().__init__()
            self.model = model
            self.loss_fn = loss_fn

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return self.loss_fn(self.model(*args, **kwargs))

    return WithLoss


def _WithLoss(model: Any, loss_fn: Callable[[Any], Any]) -> Any:  # noqa: N802 - a factory
    return _with_loss_class()(model, loss_fn)
