"""A plan as PyTorch's tensor-parallel styles, for
``torch.distributed.tensor.parallel.parallelize_module(module, mesh["tp"], styles)``.

:func:`to_parallelize_plan` maps a plan whose layers are exactly PyTorch's styles on one
tensor-parallel (TP) device grouping, with the batch split over the other ranks (data
parallelism, which the user runs: each data-parallel rank feeds its block of the batch and
averages gradients over ``mesh["dp"]``; :func:`tensor_parallel_mesh` builds that mesh):

* a linear whose weight splits its output features over TP, reading replicas there →
  ``ColwiseParallel``; one whose weight splits its input features, reading the features
  split → ``RowwiseParallel``; an embedding split on the vocabulary → ``RowwiseParallel``,
  on the hidden dim → ``ColwiseParallel``;
* each styled layer's ``input_layouts`` say what its producer hands it and its
  ``output_layouts`` what its consumers read, so every layout change the plan makes
  (gathering features, summing partial sums) runs in a style — up to the loss: logits the
  loss reads whole come back replicated (plain, whole tensors), logits it reads split on
  the vocabulary come back as DTensors (``use_local_output=False``) for a loss computed
  inside ``torch.distributed.tensor.parallel.loss_parallel()``;
* every other op runs on the plain local tensors as they arrive (attention on its heads,
  element-wise ops on split features, norms on whole rows); an element-wise op following a
  styled layer (a dropout) runs on what the style hands its readers — the style's output
  conversion runs before it rather than after, the same collective on a tensor of the same
  shape;
* a linear whose module stores its weight ``(in, out)`` (Hugging Face's GPT-2 ``Conv1D``),
  and an embedding and the head tied to it, take :mod:`runtime.planned_styles`' subclasses
  (torch's styles shard only ``nn.Linear`` and would split a shared table into two
  parameters): the tie stays one parameter where the plan places the table alike in both —
  one column- and the other row-parallel — and raises otherwise. An embedding's extra
  tables (GPT-2's position table, priced with the word table) stay whole on TP: added to the
  gathered lookup, with no collective.

Anything else raises ``ValueError`` naming every layer that cannot be expressed and why — a
data-parallel plan (no weight split: wrap the module in DDP / FSDP), weights split over two
mesh axes or on two different device groupings, token splits over TP (tokens are the
flattened ``batch × sequence`` dim here, not ``SequenceParallel``'s sequence dim), a tied
table placed otherwise in the embedding and the head, a layout change between two ops no
style performs. Never a dict that would hand the user's loss something else than the plan's
layout. A ``(in, out)`` weight must be a module's (a ``Conv1D``): ``x @ W`` in functional
code has no module for a style. ``parallelize`` runs any single-mesh plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ilp_planner.inputs.config import parse_config
from ilp_planner.ir.cluster import Factorisation, axis_coordinates
from ilp_planner.ir.graph import Graph, Op, OpKind
from ilp_planner.ir.layouts import B, Layout, Split
from ilp_planner.ir.layouts import Partial as IRPartial
from ilp_planner.lowering.strategies import tied_source
from ilp_planner.plan.data import LayerPlan, Plan
from runtime.planned_styles import PlannedColwise, PlannedRowwise, SharedParams

Groups = frozenset[frozenset[int]]  # a mesh axis as the device groups it runs collectives in

LOCAL_ON_FEATURES = (OpKind.ATTENTION, OpKind.GELU, OpKind.RELU, OpKind.SILU, OpKind.MUL,
                     OpKind.ADD, OpKind.DROPOUT)
"""Ops that run on a block of split features as they are: attention on its heads,
element-wise ops. Norms, softmax over features and the loss need whole rows."""


def axis_groups(fact: Factorisation, axis: int) -> Groups:
    """The device groups mesh axis ``axis`` of ``fact`` spans: devices agreeing on every
    other coordinate. Two axes of two factorisations are the same grouping iff equal."""
    coords = axis_coordinates(fact)
    others = [i for i in range(len(fact)) if i != axis]
    groups: dict[tuple[int, ...], set[int]] = {}
    for dev, c in enumerate(coords):
        groups.setdefault(tuple(int(c[i]) for i in others), set()).add(dev)
    return frozenset(frozenset(g) for g in groups.values())


@dataclass(frozen=True)
class TPAxis:
    """The tensor-parallel grouping (its device groups and their size) and the data-
    parallel grouping beside it: every layout must live on these two."""

    groups: Groups
    size: int
    dp_groups: Groups

    def foreign_axes(self, layout: Layout) -> int:
        """How many of ``layout``'s mesh axes group devices otherwise than TP and DP."""
        return sum(1 for a, ax in enumerate(layout.fact) if ax.size > 1
                   and axis_groups(layout.fact, a) not in (self.groups, self.dp_groups))

    def placement(self, layout: Layout) -> Any:
        """``layout``'s placement on the TP grouping (replicated where no axis is it)."""
        for a, (ax, pl) in enumerate(zip(layout.fact, layout.placements, strict=True)):
            if ax.size > 1 and axis_groups(layout.fact, a) == self.groups:
                return pl
        return B

    def others(self, layout: Layout) -> list[Any]:
        """``layout``'s placements on every mesh axis that is not the TP grouping."""
        return [pl for a, (ax, pl) in enumerate(zip(layout.fact, layout.placements, strict=True))
                if ax.size > 1 and axis_groups(layout.fact, a) != self.groups]


def _weight_split_axes(ly: LayerPlan) -> list[int]:
    assert ly.weight is not None
    return [a for a, (ax, pl) in enumerate(zip(ly.weight.fact, ly.weight.placements, strict=True))
            if ax.size > 1 and isinstance(pl, Split)]


def find_tp_axis(plan: Plan, graph: Graph, errors: list[str]) -> TPAxis | None:
    """The one grouping every split weight uses; each layer that splits its weight otherwise
    is an error."""
    tp: TPAxis | None = None
    for ly in plan.layers:
        if ly.weight is None or graph[ly.name].kind not in (OpKind.LINEAR, OpKind.EMBEDDING):
            continue
        axes = _weight_split_axes(ly)
        if len(axes) > 1:
            errors.append(f"{ly.name} ({ly.strategy}) splits its weight over {len(axes)} mesh "
                          f"axes; a tensor-parallel style splits over one")
        elif axes:
            mine = _tp_axis(ly.weight.fact, axes[0])
            if tp is None:
                tp = mine
            elif mine.groups != tp.groups:
                errors.append(f"{ly.name} ({ly.strategy}) splits its weight {mine.size} ways "
                              f"over other device groups than an earlier layer ({tp.size} "
                              f"ways): one TP mesh dim has one grouping")
    return tp


def _stored_in_out(op: Op) -> bool:
    """An imported linear (it names its module's parameters) whose module keeps the weight
    ``(in, out)``: no ``weight_t`` mark, which the importer sets on ``nn.Linear``'s."""
    return op.kind is OpKind.LINEAR and bool(op.source_params) and not op.attrs.get("weight_t")


def _tp_axis(fact: Factorisation, axis: int) -> TPAxis:
    """Axis ``axis`` of ``fact`` as the TP grouping; the devices sharing a TP coordinate
    (the rest of the mesh, flattened) as DP."""
    coords = axis_coordinates(fact)[:, axis]
    dp = frozenset(frozenset(int(d) for d in np.flatnonzero(coords == c))
                   for c in range(fact[axis].size))
    return TPAxis(axis_groups(fact, axis), fact[axis].size, dp)


def _as_torch(pl: Any) -> Any:
    """An IR placement on TP as the style placement of the real tensor: features are the
    last dim."""
    if pl == B:
        return Replicate()
    if pl == Split(1):
        return Shard(-1)
    return None


class StyleMap:
    """Walks the plan in graph order, deciding each layer's style and checking that every
    tensor arrives as its reader plans to read it."""

    def __init__(self, plan: Plan, graph: Graph, tp: TPAxis):
        self.graph, self.tp = graph, tp
        self.layers = {ly.name: ly for ly in plan.layers}
        self.styles: dict[str, Any] = {}
        self.errors: list[str] = []
        self.handed: dict[str, Any] = {}  # op -> what its users receive on TP (IR placement)
        self.carried: set[str] = set()  # element-wise followers run on a style's output
        self.shared = SharedParams()  # one DTensor per table the styled modules share
        self.tables = _tied_tables(graph)

    def run(self) -> None:
        for op in self.graph.ops:
            ly = self.layers.get(op.name)
            if op.kind is OpKind.INPUT:
                self.handed[op.name] = B
            elif op.name in self.carried:
                self.handed[op.name] = self.handed[op.inputs[0]]
            elif ly is not None:
                self._check_data_parallel(op, ly)
                if ly.weight is not None and _weight_split_axes(ly) and self.tp.placement(
                        ly.weight) != B:
                    self._style(op, ly)
                else:
                    self._plain(op, ly)

    def _check_data_parallel(self, op: Op, ly: LayerPlan) -> None:
        """Every layout lives on the TP and DP groupings; off TP only the batch splits;
        weights are whole there."""
        acts = [lay for lay in (*ly.inputs, ly.output) if lay is not None]
        if any(self.tp.foreign_axes(lay) for lay in (*acts, ly.weight) if lay is not None):
            self.errors.append(f"{op.name} ({ly.strategy}) runs on a mesh whose device groups "
                               f"are neither the TP groups ({self.tp.size} ranks) nor the "
                               f"data-parallel ones beside them")
        if any(pl not in (B, Split(0)) for lay in acts for pl in self.tp.others(lay)):
            self.errors.append(f"{op.name} ({ly.strategy}) splits more than the batch outside "
                               f"the TP mesh dim")
        if ly.weight is not None and any(pl != B for pl in self.tp.others(ly.weight)):
            self.errors.append(f"{op.name} ({ly.strategy}) splits its weight outside the TP "
                               f"mesh dim (data parallelism keeps whole weights)")

    def _reads(self, op: Op, ly: LayerPlan) -> bool:
        """Each input arrives on TP as ``op`` reads it (no style between them converts)."""
        ok = True
        for idx, src in enumerate(op.inputs):
            got, want = self.handed.get(src, B), self.tp.placement(ly.inputs[idx])
            if got != want:
                self.errors.append(f"{op.name} ({ly.strategy}) reads input {idx} as {want} on "
                                   f"TP, {src!r} hands it {got}: no style runs that change "
                                   f"between them")
                ok = False
        return ok

    def _plain(self, op: Op, ly: LayerPlan) -> None:
        """An op no style wraps runs on the local tensors as they arrive."""
        self._reads(op, ly)
        out = self.tp.placement(ly.output)
        if isinstance(out, IRPartial) or (isinstance(out, Split) and out.dim == 0):
            self.errors.append(f"{op.name} ({ly.strategy}) leaves its output {out} on TP; no "
                               f"style hands that on (tokens split over TP are not "
                               f"SequenceParallel's sequence dim)")
        elif out == Split(1) and op.kind not in LOCAL_ON_FEATURES \
                and not ly.strategy.startswith("follows "):
            self.errors.append(f"{op.name} ({ly.strategy}) computes on features split over "
                               f"TP, which {op.kind.value} cannot do on a local block")
        elif out == Split(1) and op.attrs.get("bias_table"):
            self.errors.append(f"{op.name} ({ly.strategy}) splits its heads over TP but adds "
                               f"a learned bias of all heads (T5's relative positions), which "
                               f"the module adds whole to its local heads' scores")
        self.handed[op.name] = out

    def _style(self, op: Op, ly: LayerPlan) -> None:
        """A linear or embedding whose weight splits over TP: its style, its input layouts
        what its producer hands, its output layouts what its consumers read."""
        w, x = self.tp.placement(ly.weight), self.tp.placement(ly.inputs[0])
        # a linear's (in, out) weight and an embedding's (vocab, hidden) table alike: a
        # split of dim 1 is column-parallel, of dim 0 row-parallel
        if w == Split(1) and x == B:
            kind = ColwiseParallel
        elif w == Split(0) and x == (B if op.kind is OpKind.EMBEDDING else Split(1)):
            kind = RowwiseParallel
        else:
            self.errors.append(f"{op.name} ({ly.strategy}) is neither column- nor row-parallel "
                               f"on TP (weight {w}, input {x})")
            return
        given = _as_torch(self.handed.get(op.inputs[0], B))
        wanted = self._consumers_read(op)
        if given is None or wanted is None:
            return
        loss_reads_split = wanted == Split(1) and any(
            self.graph[c].kind is OpKind.LOSS for c in self.graph.consumers(op.name))
        layouts = {"input_layouts": given, "output_layouts": _as_torch(wanted),
                   "use_local_output": not loss_reads_split}
        in_out = _stored_in_out(op)
        if in_out or op.name in self.tables:
            planned = PlannedColwise if kind is ColwiseParallel else PlannedRowwise
            self.styles[op.name] = planned(shared=self.shared, in_out=in_out, **layouts)
        else:
            self.styles[op.name] = kind(**layouts)
        self.handed[op.name] = wanted

    def _readers(self, op: Op) -> list[tuple[str, str]]:
        """(consumer, the op it reads) for every reader of ``op``'s output, looking through
        the element-wise ops that follow it (a dropout): those run on what the style hands
        them — its output conversion runs before them instead of after, the same collective
        on a tensor of the same shape — and are marked carried."""
        out = []
        for c in self.graph.consumers(op.name):
            cop, cly = self.graph[c], self.layers[c]
            if cly.strategy == f"follows {op.name}" and cop.kind in LOCAL_ON_FEATURES \
                    and len(cop.inputs) == 1 and self.graph.consumers(c):
                self.carried.add(c)
                out += [(r, c) for r in self.graph.consumers(c)]
            else:
                out.append((c, op.name))
        return out

    def _consumers_read(self, op: Op) -> Any:
        """The one placement on TP every reader (:meth:`_readers`) reads ``op``'s output in."""
        reads = {self.tp.placement(self.layers[c].inputs[list(self.graph[c].inputs).index(
            src)]) for c, src in self._readers(op)}
        if len(reads) != 1 or _as_torch(next(iter(reads))) is None:
            self.errors.append(f"{op.name}'s consumers read it as {sorted(map(str, reads))} "
                               f"on TP; a style hands one layout, replicated or split on "
                               f"the features")
            return None
        return reads.pop()


def _tied_tables(graph: Graph) -> dict[str, str]:
    """Each tied copy (a head, or a second embedding looking the table up) by name, mapped
    to the embedding owning its table; the owner mapped to itself."""
    out: dict[str, str] = {}
    for op in graph.ops:
        emb = tied_source(graph, op) if op.kind in (OpKind.LINEAR, OpKind.EMBEDDING) \
            and op.attrs.get("tied") else None
        if emb is not None:
            out[op.name], out[emb.name] = emb.name, emb.name
    return out


def _tie_errors(graph: Graph, styles: dict[str, Any]) -> list[str]:
    """A tied copy and its embedding share one parameter, so one placement: both unstyled
    (whole on TP), or both styled alike — an embedding's column split is the hidden dim, a
    head's row split too, so a head takes the other style than its embedding, a second
    embedding the same one."""
    errors = []
    tables = _tied_tables(graph)
    for name, emb in tables.items():
        if name == emb:
            continue
        head_s, emb_s = styles.get(name), styles.get(emb)
        if head_s is None and emb_s is None:
            continue
        same = graph[name].kind is OpKind.EMBEDDING
        if head_s is None or emb_s is None or (isinstance(head_s, ColwiseParallel) == isinstance(
                emb_s, ColwiseParallel)) != same:
            errors.append(f"{name} is tied to {emb}'s table, which the plan places "
                          f"otherwise in each ({_style_name(head_s)} vs {_style_name(emb_s)}); "
                          f"one parameter has one placement under parallelize_module — run "
                          f"this plan with ilp_planner.parallelize")
    return errors


def _style_name(style: Any) -> str:
    if style is None:
        return "whole on TP"
    return "column-parallel" if isinstance(style, ColwiseParallel) else "row-parallel"


def to_parallelize_plan(plan: Plan) -> dict[str, Any]:
    """The plan as ``{module path: style}`` (see the module docstring); ``ValueError``
    naming every layer that no style expresses."""
    if plan.stages:
        raise ValueError("a pipelined plan has no tensor-parallel-style form")
    graph = parse_config(plan.config).graph
    errors: list[str] = []
    tp = find_tp_axis(plan, graph, errors)
    if tp is None and not errors:
        raise ValueError("the plan splits no weight (data parallel): there is nothing for "
                         "parallelize_module to do; wrap the module in DDP or FSDP")
    styles: dict[str, Any] = {}
    if tp is not None:
        walk = StyleMap(plan, graph, tp)
        walk.run()
        errors += walk.errors + _tie_errors(graph, walk.styles)
        styles = walk.styles
    if errors:
        raise ValueError("the plan does not map onto PyTorch's tensor-parallel styles:\n  "
                         + "\n  ".join(errors))
    return styles


def tensor_parallel_mesh(plan: Plan, device_type: str = "cpu") -> DeviceMesh:
    """A 2-D DeviceMesh ``("dp", "tp")`` of the plan's groupings: ``mesh["tp"]`` for
    ``parallelize_module``, ``mesh["dp"]`` for the batch split (rank ``i`` of a dp group
    feeds the ``i``-th block of the batch) and the gradient average."""
    graph = parse_config(plan.config).graph
    errors: list[str] = []
    tp = find_tp_axis(plan, graph, errors)
    if tp is None or errors:
        raise ValueError("the plan has no single tensor-parallel grouping: "
                         + "; ".join(errors or ["no weight is split"]))
    world = sum(len(g) for g in tp.groups)
    tp_rank = {dev: sorted(g).index(dev) for g in tp.groups for dev in g}
    dp_rank = _batch_block_of(plan, graph, world)
    grid = np.empty((world // tp.size, tp.size), dtype=np.int64)
    for dev in range(world):
        grid[dp_rank[dev], tp_rank[dev]] = dev
    return DeviceMesh(device_type, torch.tensor(grid), mesh_dim_names=("dp", "tp"))


def _batch_block_of(plan: Plan, graph: Graph, world: int) -> dict[int, int]:
    """Each device's block of the batch: the order of its rows in the layout the model's
    first input is read in (the same block on every TP rank of a group)."""
    layers = {ly.name: ly for ly in plan.layers}
    first = next(op for op in graph.ops if op.kind is OpKind.INPUT)
    reader = graph.consumers(first.name)[0]
    lay = layers[reader].inputs[list(graph[reader].inputs).index(first.name)]
    regions = lay.regions(first.output.shape)
    starts = sorted({int(r[0][0]) for r in regions})
    return {dev: starts.index(int(regions[dev][0][0])) for dev in range(world)}
