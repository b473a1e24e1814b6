"""Apply a solved plan to the user's own ``nn.Module`` (``plan.parallelize(module)``).

The module was imported (:func:`ilp_planner.inputs.importer.from_module`), so each op of the plan's
graph names the user's module path and parameters. :func:`parallelize` turns the module into
the plan's program, in place, on every rank of the job:

* **parameters** become DTensors in their planned placements (each rank keeps its block of
  the value the module already holds — seed it identically on every rank: a module that
  differs between ranks is refused, :mod:`runtime.rank_agreement`);
* **edges**: every layout change the plan prices between two ops runs its lowered program
  (:func:`ilp_planner.plan.programs.edge_programs`, the ones the planner priced and ``explain``
  prints) on this rank's block, through the runtime's :class:`~runtime.comm.Comm` — in a
  forward pre-hook of the consumer's module, or a forward hook of the producer's module when
  the consumer is functional code; autograd runs the program's backward steps;
* **inside an op** the user's code runs on DTensors whose placements are the planned ones,
  so DTensor's sharding propagation finds the planned strategy without communicating; the
  hooks check every placement at every module boundary, forward and backward, and a
  difference is an error (:class:`~runtime.errors.FidelityError`), never a silent
  redistribution; SDPA split over the batch and the heads runs on this rank's blocks
  (:mod:`runtime.local_attention`), which DTensor's 4-D matmul cannot always do, and so
  does batch norm, synchronised over the axes splitting its batch
  (:mod:`runtime.local_batchnorm`), which DTensor's rule (channels only) cannot do;
* **a per-head q / k norm** (Qwen3's, Gemma-3's: ``attrs.group_width``) runs on this rank's
  heads: its module reads the projection's value viewed ``(b, s, heads, d)`` (Gemma-3's
  transposed ``(b, heads, s, d)``, ``attrs.heads_dim``), whose heads the plan's column split
  shards (:class:`~runtime.dtensors.DimMap`); its gain's gradient, each rank's share, is
  summed over the row and head axes by the plan's AllReduce;
* **dropout** on a DTensor draws the whole tensor's mask on every rank, as one process
  does, and keeps this rank's block (:mod:`runtime.local_dropout`; SDPA's ``dropout_p`` on
  its blocks too): every rank's generator must start alike, which is checked here where the
  plan drops anything;
* **weight gradients** are reduced in the plan's buckets
  (:func:`ilp_planner.lowering.grad_buckets.fill_buckets`) once every gradient of the step has
  accumulated, then handed to the optimizer in the parameter's placements;
* **a tied table** (an embedding and the head that uses it transposed) stays one parameter
  with one gradient; the head computes with its own copy in its planned layout, as the plan
  prices it (:mod:`runtime.applied_params`) — and so does a second embedding looking the
  table up (T5's decoder);
* **a learned attention bias** (T5's relative position table, looked up in functional code
  and added to SDPA's scores as its mask) is looked up in this rank's whole copy, its
  gradient partial over every axis until the plan's AllReduce (:mod:`runtime.applied_bias`);
* **an imported mixture of experts** runs the runtime's MoE kernel on this rank's blocks
  in place of its block's router and expert loop (:mod:`runtime.applied_moe`), issuing the
  planned AllToAlls;
* **the module's output**, whatever its structure, reaches the user's loss as the single-
  process module returns it where its layout is replicated (plain tensors), as DTensors
  where it is split.

Everything the program issues is tagged for the dispatch-level
:class:`~runtime.recorder.Recorder`, so :func:`audit` compares it with what the plan prices
(:func:`ilp_planner.plan.audit.predicted`): a collective DTensor slipped in is ``untagged`` and
shows as a mismatch. The loss is the user's code on the module's output (in the planned
layout of the loss's input); its scalar reduction is not part of the comparison.

What it refuses, naming the op — before it swaps a forward or places a parameter
(:func:`runtime.applied_hooks.hook_table` runs first): pipelined or micro-batched plans,
parameters frozen where the plan trains them or the reverse
(:func:`runtime.applied_params.check_frozen`), a module that checkpoints its activations
(:func:`runtime.applied_params.check_not_checkpointing`), embedding tables no
op of the plan owns (:func:`runtime.applied_params.check_owned`: a table looked up at
constant ids that no attention adds; one an SDPA's mask or hand-written scores add is its
first attention's, :mod:`runtime.applied_bias`), a layout change between two ops written as
functional code, or one value that functional code reads in two layouts (no module boundary
to run the program at); and, when the forward runs, a
module with parameters the forward calls several times (a parameter-free one — a dropout
called after the attention and after the MLP — runs its ops in call order), and a token
split the module's batch dimension cannot carry.
Meshes of any factorisation run: each is a DeviceMesh over the ranks at their coordinates
(:func:`runtime.dtensors.rank_grid`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from ilp_planner.inputs.config import Config, parse_config
from ilp_planner.ir.graph import OpKind
from ilp_planner.lowering.grad_buckets import GradBucket, fill_buckets
from ilp_planner.lowering.moe_strategies import hf_experts
from ilp_planner.lowering.strategies import StrategyContext, grad_sync
from ilp_planner.plan.audit import AuditRow, compare, executed, predicted
from ilp_planner.plan.data import LayerPlan, Plan
from ilp_planner.plan.programs import edge_programs
from runtime.applied_bias import check_bias_tables, install_bias_tables
from runtime.applied_edges import EdgeRunner
from runtime.applied_hooks import BoundaryHooks, hook_table, leaf_module
from runtime.applied_moe import install_moe
from runtime.applied_params import (
    AppliedParams,
    TiedHead,
    check_frozen,
    check_not_checkpointing,
    check_owned,
    guard_unowned,
    tied_heads,
)
from runtime.comm import Comm
from runtime.dtensors import ContextStack, Meshes
from runtime.errors import RuntimeSetupError
from runtime.fused_parts import fused_degree, interleaved, natural_order
from runtime.local_batchnorm import register_batchnorms, stats_groups
from runtime.local_dropout import dropping_ops
from runtime.mesh import MeshRegistry
from runtime.rank_agreement import check_generators, check_same_values
from runtime.replicated_ops import run_replicated

GROUP_TIMEOUT_S = 300.0


class Applied:
    """The state :func:`parallelize` attaches to the module (``module.ilp_plan``): the
    plan checked and compiled for this job, its parameters placed
    (:class:`~runtime.applied_params.AppliedParams`) and its boundary hooks installed
    (:class:`~runtime.applied_hooks.BoundaryHooks`)."""

    def __init__(self, plan: Plan, module: nn.Module, device_mesh: DeviceMesh | None):
        if not dist.is_initialized():
            raise RuntimeSetupError("parallelize runs under torch.distributed (torchrun): "
                                    "initialise the default process group first")
        self.plan, self.module = plan, module
        self.config = parse_config(plan.config)
        self.graph = self.config.graph
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.layers = {ly.name: ly for ly in plan.layers}
        _check_applicable(plan, self.config, self.layers, self.world)
        cl = self.config.cluster
        self.ctx = StrategyContext(cl, cl.nodes, cl.devices_per_node, self.config.memory,
                                   self.config.solver.max_weight_replication)
        self.registry = MeshRegistry(GROUP_TIMEOUT_S)
        self.comm = Comm(self.registry, tuple(range(self.world)), self.rank, cl, None)
        programs = {(e.consumer, e.index): e.program
                    for e in edge_programs(plan, self.config, self.graph)
                    if e.role in ("edge", "shared")}
        for red in programs.values():
            self.comm.register(red)
        chunks = self._grad_chunks()
        tied = tied_heads(self.config, self.layers)
        _check_tied_heads(tied, module)
        check_frozen(self.graph, module)
        check_not_checkpointing(module)
        check_owned(self.graph, module)
        check_bias_tables(self.graph, module)
        check_same_values(module)  # each rank keeps its block of its own module's values
        run_replicated(self.graph.replicated_ops)  # ops DTensor has no rule for
        # the boundary hooks' refusals (a layout change between two pieces of functional
        # code), before install_moe swaps forwards and AppliedParams places parameters
        hook_table(self.graph, self.layers, programs, module)
        for op in self.graph.ops:  # fused column blocks each read on their own
            if op.kind is not OpKind.INPUT:
                fused_degree(self.graph, op, self.layers[op.name])
        for t in tied.values():
            self.comm.register(t.to_table)
            self.comm.register(t.to_head)
        install_moe(self.graph, self.layers, module, self.comm)
        norms = register_batchnorms(self.graph, self.layers, self.comm)
        self.device_type = _device_type(device_mesh, self.world)
        self.registry.create()
        dropping = dropping_ops(self.graph)
        if dropping:  # every rank draws each mask whole (runtime.local_dropout)
            check_generators(self.device_type,
                             f"the plan drops values ({', '.join(dropping[:3])}"
                             f"{', …' if len(dropping) > 3 else ''})")
        self.meshes = Meshes((lay for ly in plan.layers for lay in (*ly.inputs, ly.output)
                              if lay is not None), self.device_type, self.world)
        batchnorms = stats_groups(self.graph, norms, self.comm, self.meshes)
        replicating = ContextStack()  # from the forward until the gradients are reduced
        self.params = AppliedParams(self.graph, self.layers, module, self.comm, self.meshes,
                                    chunks, tied, self.registry, replicating)
        install_bias_tables(self.graph, self.params, module, self.meshes)
        guard_unowned(self.graph, module)
        edges = EdgeRunner(self.graph, self.comm, self.meshes)
        self.hooks = BoundaryHooks(self.graph, self.layers, module, self.comm, self.meshes,
                                   edges, self.params, replicating, self.device_type,
                                   batchnorms)
        self.hooks.install(programs)

    def _grad_chunks(self) -> tuple[GradBucket, ...]:
        """The plan's weight-gradient chunks, checked against the ones it lists and prices,
        their groups registered."""
        syncs = []
        for op in self.graph.ops:
            if op.kind is OpKind.INPUT:
                continue
            ly = self.layers[op.name]
            syncs += [(op.name, b) for b in grad_sync(op, ly.strategy, ly.inputs, ly.weight,
                                                      ly.output, self.ctx)]
        chunks = fill_buckets(syncs, self.config.grad_bucket_bytes, self.ctx)
        listed = sorted((ly.name, c.bytes, c.group_size) for ly in self.plan.layers
                        for c in ly.collectives if c.purpose == "grad_sync")
        issued = sorted((c.launcher, c.collective.bytes, c.collective.group_size)
                        for c in chunks)
        if listed != issued:
            raise RuntimeSetupError(f"the plan lists gradient AllReduces {listed}, its layers "
                                    f"give {issued}; re-solve the config")
        for c in chunks:
            self.registry.need_axes(self.comm.devices, c.fact, c.axes)
        return chunks


def _check_applicable(plan: Plan, config: Config, layers: dict[str, LayerPlan],
                      world: int) -> None:
    """What parallelize refuses before it creates anything (see the module docstring)."""
    if plan.stages or config.pipeline.microbatches != 1:
        raise RuntimeSetupError("parallelize applies single-mesh plans without micro-"
                                "batches; solve with pipeline.stages: 1, microbatches: 1")
    if world != config.cluster.num_devices:
        raise RuntimeSetupError(f"the plan is for {config.cluster.num_devices} devices, "
                                f"the job has {world} ranks")
    unsupported = [ly.name for ly in plan.layers if ly.zero or ly.recompute]
    if unsupported:  # runtime.executor runs them on the runtime's own models
        raise RuntimeSetupError(
            f"layers {', '.join(unsupported[:4])}{' …' if len(unsupported) > 4 else ''} are "
            f"planned with state sharding or recomputation, which parallelize does not "
            f"apply to a user's module; solve with solver.state_sharding: [0] and "
            f"solver.recompute: never")
    for op in config.graph.ops:
        if op.kind is not OpKind.INPUT and op.name not in layers:
            raise RuntimeSetupError(f"the plan has no layer for op {op.name!r}")
        if op.kind is OpKind.MOE and not hf_experts(op):  # runtime.moe runs built-in ones
            raise RuntimeSetupError(f"op {op.name!r} is a built-in mixture of experts (kind: "
                                    f"moe), which the runtime's executor runs; parallelize "
                                    f"runs the blocks it imported from Hugging Face modules")


def _check_tied_heads(tied: dict[str, TiedHead], module: nn.Module) -> None:
    """A tied head computes with its own copy of the table, swapped into its module while
    it runs: the head must be a module of its own, not functional code on the table."""
    for head in tied:
        if leaf_module(module, head) is None:
            raise RuntimeSetupError(f"op {head!r} ties its weight to an embedding in "
                                    f"functional code; parallelize needs the tied head to be a "
                                    f"module (an nn.Linear sharing the embedding's weight)")


def _device_type(device_mesh: DeviceMesh | None, world: int) -> str:
    """The user's mesh's device type (it must cover the job), else CUDA when present."""
    if device_mesh is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device_mesh.size() != world:
        raise RuntimeSetupError(f"device_mesh covers {device_mesh.size()} ranks, the job "
                                f"has {world}")
    return device_mesh.device_type


def apply(plan: Plan, module: nn.Module, device_mesh: DeviceMesh | None = None) -> nn.Module:
    """``ilp_planner.apply(plan, module)``: the same as :func:`parallelize`."""
    return parallelize(plan, module, device_mesh)


def parallelize(plan: Plan, module: nn.Module, device_mesh: DeviceMesh | None = None
                ) -> nn.Module:
    """Apply ``plan`` to ``module`` in place on this rank (see the module docstring) and
    return it; its :class:`Applied` state is ``module.ilp_plan``."""
    module.ilp_plan = Applied(plan, module, device_mesh)  # type: ignore[attr-defined]
    return module


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The applied module's whole state, every entry a plain tensor in the module's own
    order — what one process training it would save, the same on every rank: each
    DTensor's full value, a fused weight's columns (held interleaved,
    :mod:`runtime.fused_parts`) put back in order, and a batch norm split over its channels
    given every rank's channels of its running statistics (each rank updates its own,
    :mod:`runtime.local_batchnorm`). A collective: every rank calls it. ``state_dict()``
    itself holds the entries as they train — DTensors, fused columns interleaved, as the
    optimizer's state is — which is what resuming on the same plan needs."""
    applied = module.ilp_plan  # type: ignore[union-attr]
    held, stats = applied.params.interleaved, _channel_blocks(applied)
    out = {}
    for name, value in module.state_dict().items():
        full = (value.full_tensor() if isinstance(value, DTensor) else value).detach()
        if name in held:
            full = natural_order(full, *held[name])
        elif name in stats:
            full = _gathered_channels(full, stats[name])
        out[name] = full
    return out


def _channel_blocks(applied: Applied) -> dict[str, list[tuple[int, int]]]:
    """Per running-statistics buffer of a batch norm the plan splits over its channels,
    every rank's ``[lo, hi)`` channel block."""
    out = {}
    for op in applied.graph.ops:
        if op.kind is not OpKind.BATCHNORM:
            continue
        blocks = [(int(lo), int(hi)) for lo, hi in
                  applied.layers[op.name].output.regions(op.output.shape)[:, 1]]
        if any(b != (0, op.output.shape[1]) for b in blocks):
            path = op.source_params[0].rsplit(".", 1)[0]
            out.update({f"{path}.{buf}": blocks for buf in ("running_mean", "running_var")})
    return out


def _gathered_channels(mine: torch.Tensor, blocks: list[tuple[int, int]]) -> torch.Tensor:
    """A per-channel buffer whole: each rank's value on its own channel block."""
    every = [torch.empty_like(mine) for _ in blocks]
    dist.all_gather(every, mine.contiguous())
    out = mine.clone()
    for value, (lo, hi) in zip(every, blocks, strict=True):
        out[lo:hi] = value[lo:hi]
    return out


def load_full_state_dict(module: nn.Module, state: dict[str, torch.Tensor],
                         strict: bool = True):
    """Load whole tensors in the module's own order (one process's ``state_dict``, a
    :func:`full_state_dict`) into the applied module: each rank cuts its own block of every
    entry the plan splits (no communication: every rank holds ``state``), a fused weight's
    columns interleaved first. Returns ``load_state_dict``'s missing and unexpected keys."""
    held = module.ilp_plan.params.interleaved  # type: ignore[union-attr]
    own = module.state_dict()
    cut = {}
    for name, value in state.items():
        value = interleaved(value, *held[name]) if name in held else value
        like = own.get(name)
        cut[name] = distribute_tensor(value.to(like.dtype), like.device_mesh, like.placements,
                                      src_data_rank=None) if isinstance(like, DTensor) else value
    return module.load_state_dict(cut, strict=strict)


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A tensor computed from the applied module's output, whole and detached: a loss is a
    plain tensor where the output came back replicated and a DTensor where it stayed split."""
    return t.detach().full_tensor() if isinstance(t, DTensor) else t.detach()


def audit(plan: Plan, rank: int, events: list) -> list[AuditRow]:
    """Planned vs executed collectives of one step of an applied plan, the loss's own
    reduction aside (the loss is the user's code)."""
    pred = {k: v for k, v in predicted(plan, rank, 1).items() if k[1] != "loss"}
    done = executed(events)
    return compare(pred, done)
