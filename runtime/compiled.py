"""Compile a checked plan into what every rank executes: pure, before any collective.

:func:`compile_plan` turns a :class:`~ilp_planner.plan.check.CheckedPlan` into a
:class:`CompiledPlan` — identical on every rank, no process group needed, so ``ilp-planner
check``/``run`` compile a plan once before any rank starts. It checks what the runtime needs
beyond a valid plan (even splits, supported ops, state sharding and gradient chunks exactly
as the plan lists and prices them, no sharded tied weight, recomputed layers inside repeated
blocks) and takes every program from the planner's own lowering: edge and export programs
(:func:`ilp_planner.plan.programs.edge_programs`), weight-gradient buckets
(:func:`~ilp_planner.lowering.strategies.grad_sync`, fused by
:func:`~ilp_planner.lowering.grad_buckets.fill_buckets`) and tied-weight exchanges.
:func:`runtime.groups.register_groups` then names every process group they use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ilp_planner.errors import PlanFormatError
from ilp_planner.ir.cluster import Cluster
from ilp_planner.ir.graph import Graph, Op, OpKind
from ilp_planner.lowering.grad_buckets import GradBucket, fill_buckets
from ilp_planner.lowering.redistribution import Redistribution
from ilp_planner.lowering.stage_boundary import stage_boundary
from ilp_planner.lowering.strategies import (
    StrategyContext,
    SyncBucket,
    backward_reads,
    grad_sync,
    tied_exchange,
    tied_source,
)
from ilp_planner.plan.check import CheckedPlan
from ilp_planner.plan.data import LayerPlan, Plan, ReshardingEntry, Stage
from ilp_planner.plan.programs import edge_programs
from runtime import model
from runtime.errors import RuntimeSetupError
from runtime.zero import ZERO_PURPOSES, planned_collectives

Segment = tuple[bool, tuple[str, ...]]  # (recomputed under one checkpoint?, layers in order)


@dataclass(frozen=True)
class CompiledPlan:
    """Everything a rank executes, derived from the plan alone (see the module docstring)."""

    plan: Plan
    cluster: Cluster
    full_graph: Graph  # the step's graph (reference, data, results)
    graph: Graph  # the micro-batch graph the stages run
    microbatches: int
    compute_dtype: torch.dtype
    loss_scale: float
    layers: dict[str, LayerPlan]
    strategy_ctx: StrategyContext
    stages: list[Stage]
    stage_of: dict[str, int]  # layer -> stage index
    entries: list[ReshardingEntry]  # cross-mesh transfers
    entry_of: dict[tuple[str, int], int]  # (consumer, input index) -> entry bringing it
    actions: dict[int, list[tuple[str, int]]]  # stage -> lowered schedule (kind, micro-batch)
    mesh_actions: dict[int, list[tuple[int, str, int]]]  # mesh -> its (stage, kind, mb) order
    edges: dict[tuple[str, int], Redistribution]  # (consumer, input index) -> edge program
    exports: dict[str, Redistribution]  # tensor leaving its stage -> its export program
    buckets: dict[str, tuple[SyncBucket, ...]]  # layer -> gradient buckets AllReduced
    zero_syncs: dict[str, tuple[SyncBucket, ...]]  # sharded layer -> its sharded buckets
    tied: dict[str, str]  # head linear -> the embedding it shares its weight with
    tied_programs: dict[str, tuple[Redistribution, ...]]  # head on its embedding's stage
    grad_chunks: dict[int, tuple[GradBucket, ...]]  # stage -> fused gradient chunks
    segments: dict[int, list[Segment]]  # stage -> its layers cut into checkpointed runs
    reached: frozenset[str]  # layers whose first input takes a gradient (:func:`_input_reached`)

    @property
    def interleaved(self) -> bool:
        """Interleaved 1F1B: a mesh runs several stages (the model's chunks)."""
        return self.plan.schedule is not None and self.plan.schedule.virtual_stages > 1

    def syncs(self, layer: str) -> tuple[SyncBucket, ...]:
        """Every weight-gradient bucket of ``layer``, AllReduced or sharded."""
        return self.buckets[layer] or self.zero_syncs.get(layer, ())

    def zero3_backward_reads(self, op: Op, sync: SyncBucket) -> bool:
        """ZeRO-3: whether ``op``'s backward reads the bucket's weights
        (:func:`~ilp_planner.lowering.strategies.backward_reads`): autograd reaches its input unless that is
        what the model's data gives alone, as the planner's ``input_reached``."""
        return backward_reads(op, sync.roles, op.name in self.reached)


def compile_plan(plan: Plan, checked: CheckedPlan) -> CompiledPlan:
    """The plan's per-rank program (pure; see the module docstring)."""
    config, graph = checked.config, checked.graph
    model.check_supported(graph)
    layers = {lp.name: lp for lp in plan.layers}
    _check_even(graph, layers)
    _check_data_inputs(graph, layers)
    stages = checked.stages
    stage_of = {n: s.index for s in stages for n in s.layers}
    edges, exports = _lowered_edges(plan, checked)
    ctx = StrategyContext(config.cluster, 1, 1, config.memory)
    compute_dtype = model.compute_dtype(graph)
    reached = _input_reached(graph, stages)
    buckets, zero_syncs = _gradient_buckets(graph, layers, stage_of, ctx, compute_dtype, reached)
    tied = _tied_pairs(graph, layers, stage_of)
    return CompiledPlan(
        plan=plan, cluster=config.cluster, full_graph=config.graph, graph=graph,
        microbatches=checked.microbatches, compute_dtype=compute_dtype,
        loss_scale=model.loss_scale(graph),
        layers=layers, strategy_ctx=ctx, stages=stages, stage_of=stage_of,
        entries=checked.entries, entry_of=checked.entry_of, actions=checked.actions,
        mesh_actions=checked.mesh_actions,
        edges=edges, exports=exports, buckets=buckets, zero_syncs=zero_syncs, tied=tied,
        tied_programs=_tied_programs(graph, layers, stage_of, tied, config.cluster),
        grad_chunks={s.index: _grad_chunks(plan, s, buckets, config.grad_bucket_bytes, ctx)
                     for s in stages},
        segments={s.index: _segments(s, graph, layers) for s in stages}, reached=reached)


def _input_reached(graph: Graph, stages: list[Stage]) -> frozenset[str]:
    """The layers whose first input takes a gradient on their stage
    (:meth:`~ilp_planner.ir.graph.Graph.gradient_carriers`, with the tensors the stage
    imports): autograd runs their input's backward — the planner's ``input_reached``."""
    out: set[str] = set()
    for s in stages:
        carriers = graph.gradient_carriers(stage_boundary(graph, s.layers).imported)
        out.update(n for n in s.layers if graph[n].inputs and graph[n].inputs[0] in carriers)
    return frozenset(out)


def _check_even(graph: Graph, layers: dict[str, LayerPlan]) -> None:
    """The runtime's own requirement beyond a valid plan: even splits of the micro-batch
    shapes (every rank's block the same size)."""
    for op in graph.ops:
        if op.kind is OpKind.INPUT:
            continue
        lp = layers[op.name]
        for lay, spec in [*zip(lp.inputs, (graph[s].output for s in op.inputs), strict=True),
                          (lp.output, op.output)]:
            if not lay.is_even(spec):
                raise RuntimeSetupError(f"layer {op.name!r}: {lay} splits {spec.shape} "
                                        f"unevenly (the runtime needs even splits of the "
                                        f"micro-batch shapes)")


def _check_data_inputs(graph: Graph, layers: dict[str, LayerPlan]) -> None:
    """Each rank cuts its block of the model's data locally: no layout may ask for it as
    partial sums."""
    for op in graph.ops:
        if op.kind is OpKind.INPUT:
            continue
        for idx, src in enumerate(op.inputs):
            want = layers[op.name].inputs[idx]
            if graph[src].kind is OpKind.INPUT and want.has_partial:
                raise RuntimeSetupError(f"layer {op.name!r} wants its input {src!r} as "
                                        f"partial sums {want}")


def _lowered_edges(plan: Plan, checked: CheckedPlan
                   ) -> tuple[dict[tuple[str, int], Redistribution], dict[str, Redistribution]]:
    """Every edge's and export's lowered program: the ones the plan priced and ``explain``
    prints (:func:`ilp_planner.plan.programs.edge_programs`)."""
    edges: dict[tuple[str, int], Redistribution] = {}
    exports: dict[str, Redistribution] = {}
    for ep in edge_programs(plan, checked.config, checked.graph):
        if ep.role == "shared" and (ep.program.steps or ep.program.backward_steps):
            # the planner priced it once, on another reader, for functional code
            raise RuntimeSetupError(
                f"input {ep.index} of {ep.consumer!r} reads {ep.producer!r} as a shared read "
                f"of functional code (an import for parallelize), which the executor would "
                f"convert once per reader; run the plan with ilp_planner.parallelize, or "
                f"import with from_module(dtensor=False) for the executor")
        if ep.role == "export":
            exports[ep.producer] = ep.program
        else:
            edges[(ep.consumer, ep.index)] = ep.program
    return edges, exports


def _gradient_buckets(graph: Graph, layers: dict[str, LayerPlan], stage_of: dict[str, int],
                      ctx: StrategyContext, compute_dtype: torch.dtype, reached: frozenset[str]
                      ) -> tuple[dict[str, tuple[SyncBucket, ...]], dict[str, tuple[SyncBucket, ...]]]:
    """Each layer's weight-gradient buckets: AllReduced (in the fused chunks), or — for a
    layer that shards its state — kept as sharded flat buffers, no part of the chunks."""
    buckets: dict[str, tuple[SyncBucket, ...]] = {}
    zero_syncs: dict[str, tuple[SyncBucket, ...]] = {}
    for name in stage_of:
        op, lp = graph[name], layers[name]
        syncs = grad_sync(op, lp.strategy, lp.inputs, lp.weight, lp.output, ctx)
        if lp.zero:
            _check_zero(op, lp, syncs, compute_dtype, op.name in reached)
            zero_syncs[name] = syncs
            buckets[name] = ()
        else:
            buckets[name] = syncs
    return buckets, zero_syncs


def _check_zero(op: Op, lp: LayerPlan, syncs: tuple[SyncBucket, ...],
                compute_dtype: torch.dtype, input_reached: bool) -> None:
    """The state-sharding collectives this runtime will issue for ``lp`` (from the
    planner's own :func:`~ilp_planner.lowering.strategies.grad_sync` buckets, one flat buffer
    each) must be the ones the plan lists and prices."""
    if not syncs:
        raise RuntimeSetupError(f"layer {lp.name!r} is planned with zero{lp.zero} but its "
                                f"strategy {lp.strategy!r} reduces no weight gradient")
    item = torch.empty((), dtype=compute_dtype).element_size()
    issued = sorted(c for b in syncs
                    for c in planned_collectives(b, lp.zero, item, lp.recompute,
                                                 backward_reads(op, b.roles, input_reached)))
    listed = sorted((c.kind.value, c.purpose, c.phase, c.bytes, c.group_size)
                    for c in lp.collectives if c.purpose in ZERO_PURPOSES)
    if issued != listed:
        raise PlanFormatError(  # the file, not this host
            f"layer {lp.name!r} (zero{lp.zero}): the plan lists state-sharding collectives "
            f"{listed} but its gradient buckets give {issued}; re-solve the config")


def _tied_pairs(graph: Graph, layers: dict[str, LayerPlan], stage_of: dict[str, int]
                ) -> dict[str, str]:
    """Head linear -> the embedding whose table it uses transposed. Neither copy may shard
    its state: the exchange sums the two copies' full gradients."""
    tied: dict[str, str] = {}
    for name in stage_of:
        op = graph[name]
        if op.kind is OpKind.LINEAR and op.attrs.get("tied"):
            src_op = tied_source(graph, op)
            if src_op is None:
                raise RuntimeSetupError(f"tied linear {name!r} has no embedding to share")
            tied[name] = src_op.name
    for head, emb in tied.items():
        sharded = [n for n in (head, emb) if layers[n].zero]
        if sharded:
            raise RuntimeSetupError(
                f"layer {sharded[0]!r} shards its state (zero{layers[sharded[0]].zero}) "
                f"but is one of the tied pair {emb!r} / {head!r}: the tied-weight exchange "
                f"sums the two copies' full gradients, which a sharded copy no longer holds "
                f"(the plan prices no gather for it); re-solve with solver.state_sharding: "
                f"[0] or an untied model")
    return tied


def _tied_programs(graph: Graph, layers: dict[str, LayerPlan], stage_of: dict[str, int],
                   tied: dict[str, str], cluster: Cluster) -> dict[str, tuple[Redistribution, ...]]:
    """The lowered exchange (:func:`~ilp_planner.lowering.strategies.tied_exchange`) of each
    tied pair on one stage; a pair across stages sums its gradients with one AllReduce."""
    out: dict[str, tuple[Redistribution, ...]] = {}
    for head, emb in tied.items():
        ew, hw, table = layers[emb].weight, layers[head].weight, graph[emb].master_spec
        assert ew is not None and hw is not None and table is not None
        if stage_of[emb] == stage_of[head]:
            out[head] = tied_exchange(ew, hw, table, cluster)
    return out


def _grad_chunks(plan: Plan, stage: Stage, buckets: dict[str, tuple[SyncBucket, ...]],
                 cap_bytes: float, ctx: StrategyContext) -> tuple[GradBucket, ...]:
    """The stage's gradient chunks (:func:`ilp_planner.lowering.grad_buckets.fill_buckets` with
    the config's cap), checked against the ones the plan lists and prices."""
    syncs = [(n, b) for n in stage.layers for b in buckets[n]]
    chunks = fill_buckets(syncs, cap_bytes, ctx)
    listed = sorted((ly.name, col.bytes, col.group_size) for ly in plan.layers
                    if ly.name in stage.layers for col in ly.collectives
                    if col.purpose == "grad_sync")
    issued = sorted((ch.launcher, ch.collective.bytes, ch.collective.group_size) for ch in chunks)
    if listed != issued:
        raise PlanFormatError(  # the file, not this host
            f"stage {stage.index}: the plan lists gradient AllReduces {listed} but its layers "
            f"and training.grad_bucket_mb give {issued}; re-solve the config")
    return chunks


def _segments(stage: Stage, graph: Graph, layers: dict[str, LayerPlan]) -> list[Segment]:
    """The stage's layers in order, cut into runs: each maximal run of consecutive
    recomputed layers of one block is one checkpointed region (``True``); every other
    layer runs alone."""
    out: list[tuple[bool, list[str]]] = []
    unit = None
    for name in stage.layers:
        lp, op = layers[name], graph[name]
        if not lp.recompute:
            out.append((False, [name]))
            unit = None
            continue
        if op.kind is OpKind.LOSS or op.block is None:
            raise RuntimeSetupError(f"layer {name!r} is planned as recomputed but is not "
                                    f"inside a repeated block")
        here = (op.block, op.block_index)
        if unit == here and out and out[-1][0]:
            out[-1][1].append(name)
        else:
            out.append((True, [name]))
        unit = here
    return [(rc, tuple(names)) for rc, names in out]
