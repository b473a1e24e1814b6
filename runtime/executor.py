"""Execute a solved plan: per-stage programs, cross-mesh transfers, the pipeline schedule.

A plan is a program: every collective this executor issues comes from the planner's own
lowering (:mod:`ilp_planner.lowering.redistribution` for edges, :mod:`ilp_planner.lowering.strategies` for
SUMMA's gathers, weight-gradient buckets, the loss and tied-weight exchanges), and the
dispatch-level :class:`runtime.recorder.Recorder` counts what really ran, so ``--audit``
can compare the two.

Life of a run (:class:`Executor`):

1. **compile** (pure, before any collective; identical on every rank): rebuild the graph
   from ``plan.config`` (the micro-batch graph when the step is cut into micro-batches),
   check every op is supported and every edge crossing stages has a resharding entry, parse
   the schedule, lower every edge to its program (forward and backward steps) and register
   every process group the programs, buckets, loss and transfers use;
2. **setup**: create all groups in registration order (:class:`runtime.mesh.MeshRegistry`),
   then the parameters of this rank's stage as local leaf blocks in their planned layouts,
   from the deterministic initialisation (every rank draws the same full tensor and keeps
   its block — no communication);
3. **step**: interpret this stage's lowered action list through a ``kind → handler`` table
   (``RF`` receive activations, ``F`` forward of a micro-batch, ``SF`` send activations,
   ``RB``/``B``/``SB`` the same for the backward, ``W`` nothing: B computes weight gradients
   too; during the stage's last B each complete gradient chunk — the priced buckets — is
   AllReduced asynchronously); then wait for the chunks, exchange the gradients of tied
   weights, and update the local blocks with SGD or Adam.

Cross-mesh transfers (seed 003). Forward: the boundary tensor is brought (inside its source
stage, by its export program, once per tensor) to the entries' ``src_layout``, then each
unit task, in the plan's order, is one ``dist.broadcast`` from its sender within the group
``{sender} ∪ receivers``; receivers assemble their block of ``dst_layout`` as a leaf.
Backward: the plan's ``backward_tasks`` (their own solved schedule) move the leaf's
gradient the other way, from devices holding a slice of it to the devices of the source
stage, who assemble the gradient of their ``src_layout`` block and run autograd from
there. Sends are asynchronous (waited at the end of the step) and receives block, so no
schedule that respects its own dependencies can deadlock; forward and backward transfers
use distinct groups because a 1F1B stage interleaves the two directions differently from
its neighbour.

State sharding (``LayerPlan.zero``, :mod:`runtime.zero`): a sharded layer's gradient
buckets (the planner's :func:`~ilp_planner.lowering.strategies.grad_sync`) are not AllReduced but
kept as flat buffers sharded over the bucket's group; the optimizer updates each rank's
fp32 shard. ZeRO-1/2 keep the full blocks in the compute dtype and add each micro-batch's
gradient to a flat fp32 buffer, as the planner prices them; ZeRO-1 reduce-scatters it
once, after the step's last backward, ZeRO-2 after every micro-batch's backward; both
all-gather the updated shards into the full blocks after the update. ZeRO-3 keeps only the
shard, all-gathers it in the op's forward, keeps no gathered block for the backward (which
gathers again only where it reads the weights: for the input's gradient, when autograd
reaches the input; a recomputed op's backward reads its recomputation's gather instead)
and reduce-scatters the gradient there. Compile checks that these are the collectives the
plan lists for the layer. A sharded tied weight is refused (its exchange needs the full
gradient).

Recomputation (``LayerPlan.recompute``): each run of consecutive recomputed layers of one
block executes under non-reentrant ``torch.utils.checkpoint``, with the edge programs of
its inputs inside, so the backward replays them and the layers' own collectives; the
replay is recorded in phase ``recompute`` (:func:`runtime.recorder.replaying`), the
phase the plan lists it in.

Tied weights (GPT's head uses the embedding table transposed): the head keeps its own copy
in its planned layout, initialised identically; after gradient synchronisation both copies'
gradients are summed and both copies take the same update.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.utils.checkpoint

from ilp_planner.ir.graph import Op, OpKind, TensorSpec
from ilp_planner.ir.layouts import Layout
from ilp_planner.ir.regions import layout_blocks
from ilp_planner.lowering.grad_buckets import GradBucket, fill_buckets
from ilp_planner.lowering.redistribution import Redistribution
from ilp_planner.lowering.strategies import (
    StrategyContext,
    SyncBucket,
    grad_sync,
    is_summa,
    loss_axes,
    param_layouts,
    param_shapes,
    summa_programs,
    tied_exchange,
    tied_source,
)
from ilp_planner.plan.check import CheckedPlan, check_plan
from ilp_planner.plan.data import LayerPlan, Plan, ReshardingEntry, UnitTask
from ilp_planner.plan.programs import edge_programs
from runtime import model
from runtime.comm import Comm, LVal, Report, all_reduce_async
from runtime.errors import RuntimeSetupError
from runtime.mesh import MeshRegistry
from runtime.ops import OPS, StageContext
from runtime.optim import Optimizer, OptimizerSpec
from runtime.recorder import CommEvent, Recorder, replaying, tagged, timed
from runtime.zero import (
    ZERO_PURPOSES,
    ZeroBucket,
    backward_reads,
    gather,
    planned_collectives,
    released,
)


@dataclass(frozen=True)
class RunOptions:
    steps: int = 3
    seed: int = 0
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    timeout_s: float = 60.0
    microbatches: int | None = None  # single-stage plans: gradient accumulation override
    record: bool = True  # dispatch-level recording of every collective (audit, timings)
    overlap: bool = True  # reduce gradient chunks during the backward (else after it)


@dataclass
class StepResult:
    step: int
    loss: float
    seconds: float
    events: list[CommEvent]
    order: list[str] = field(default_factory=list)  # collectives and marks, when recorded


class Executor:
    """One rank's view of a plan; see the module docstring for the phases."""

    def __init__(self, plan: Plan, options: RunOptions, *, rank: int, world: int,
                 device: torch.device | None = None, checked: CheckedPlan | None = None):
        """``checked``: the plan's :func:`~ilp_planner.plan.check.check_plan` result when the
        caller already has it (computed otherwise, without the strategy enumeration)."""
        self.plan = plan
        self.options = options
        self.rank = rank
        self.world = world
        self.device = device or torch.device("cpu")
        if plan.num_devices != world:
            raise RuntimeSetupError(
                f"plan {plan.name!r} is for {plan.num_devices} devices but the world has {world} "
                f"processes; launch with --nproc-per-node {plan.num_devices} (or re-solve)")
        checked = checked or check_plan(plan, microbatches=options.microbatches, strategies=False)
        self.config = checked.config
        self.cluster = self.config.cluster
        self.full_graph = self.config.graph
        self.microbatches = checked.microbatches
        self.graph = checked.graph
        model.check_supported(self.graph)
        self.compute_dtype = model.compute_dtype(self.graph)
        self.loss_scale = model.loss_scale(self.graph)
        self.layers: dict[str, LayerPlan] = {lp.name: lp for lp in plan.layers}
        self._check_even()
        self.stages = checked.stages
        self.stage_of = {n: s.index for s in self.stages for n in s.layers}
        self.entries = checked.entries
        self.entry_of = checked.entry_of  # (consumer, input) -> entry, exact layout (checked)
        self.actions = checked.actions
        self.recorder = Recorder(self.cluster.devices_per_node)
        self.registry = MeshRegistry(options.timeout_s)
        self.comms = {s.index: Comm(self.registry, s.devices, rank, self.cluster, self.recorder)
                      for s in self.stages}
        self.strategy_ctx = StrategyContext(self.cluster, 1, 1, self.config.memory)
        self._data: list[dict] | None = None
        self._blocks: dict[tuple, torch.Tensor] = {}
        self.tied: dict[str, str] = {}  # head op -> embedding op
        self._compile()
        self.my_stage = next((s for s in self.stages if rank in s.devices), None)
        self.params: dict[str, LVal] = {}
        self._copies: dict[str, LVal] = {}  # this step's compute copies (_compute_copy)
        self.state: dict[int, dict] = {}
        self.pending: list = []
        # kind -> handler (formulations.schedules action kinds; lowered schedules)
        self.handlers: dict[str, Callable[[int], None]] = {
            "RF": self.recv_forward, "F": self.forward, "SF": self.send_forward,
            "RB": self.recv_backward, "B": self.backward, "SB": self.send_backward,
            "W": self.weight_grad,
        }

    # ---- compile -------------------------------------------------------------------------
    def _check_even(self) -> None:
        """The runtime's own requirement beyond a valid plan: even splits of the micro-batch
        shapes (every rank's block the same size)."""
        for op in self.graph.ops:
            if op.kind is OpKind.INPUT:
                continue
            lp = self.layers[op.name]
            for lay, spec in [*zip(lp.inputs, (self.graph[s].output for s in op.inputs), strict=True),
                              (lp.output, op.output)]:
                if not lay.is_even(spec):
                    raise RuntimeSetupError(f"layer {op.name!r}: {lay} splits {spec.shape} "
                                            f"unevenly (the runtime needs even splits of the "
                                            f"micro-batch shapes)")

    def _compile(self) -> None:
        """Take every edge's lowered program (:func:`ilp_planner.plan.programs.edge_programs`, the
        ones the plan priced and ``explain`` prints; identical on all ranks) and register
        every group the programs, transfers, weight-gradient buckets, loss and tied-weight
        exchanges use."""
        reg = self.registry
        g = self.graph
        self.edges: dict[tuple[str, int], Redistribution] = {}
        self.exports: dict[str, Redistribution] = {}  # exported tensor -> export program
        for ep in edge_programs(self.plan, self.config, g):  # the programs explain prints, the plan priced
            if ep.role == "export":
                self.exports[ep.producer] = ep.program
            else:
                self.edges[(ep.consumer, ep.index)] = ep.program
        self.buckets: dict[str, tuple[SyncBucket, ...]] = {}
        self.zero_syncs: dict[str, tuple[SyncBucket, ...]] = {}  # layers with sharded state
        for s in self.stages:
            comm = self.comms[s.index]
            for name in s.layers:
                op, lp = g[name], self.layers[name]
                reg.need_mesh(s.devices, lp.output.fact)
                for idx, src in enumerate(op.inputs):
                    want = lp.inputs[idx]
                    reg.need_mesh(s.devices, want.fact)
                    if g[src].kind is OpKind.INPUT:
                        if want.has_partial:
                            raise RuntimeSetupError(f"layer {name!r} wants its input {src!r} as "
                                                    f"partial sums {want}")
                        continue
                    comm.register(self.edges[(name, idx)])
                if op.kind is OpKind.LINEAR and is_summa(lp.strategy):
                    assert op.weight is not None
                    for red in summa_programs(lp.output.fact, g[op.inputs[0]].output, op.weight,
                                              self.cluster):
                        comm.register(red)
                if op.kind is OpKind.LOSS:
                    for axes in loss_axes(lp.inputs[0]):
                        if axes:
                            comm.register_axes(lp.inputs[0], axes)
                for lay, _ in param_layouts(op, lp.strategy, lp.inputs, lp.weight,
                                            lp.output).values():
                    reg.need_mesh(s.devices, lay.fact)
                syncs = grad_sync(op, lp.strategy, lp.inputs, lp.weight, lp.output,
                                  self.strategy_ctx)
                for b in syncs:
                    reg.need_axes(s.devices, b.fact, b.axes)
                if lp.zero:  # sharded: no AllReduce, no part in the fused buckets
                    self._check_zero(op, lp, syncs)
                    self.zero_syncs[name] = syncs
                    self.buckets[name] = ()
                else:
                    self.buckets[name] = syncs
                if op.kind is OpKind.LINEAR and op.attrs.get("tied"):
                    src_op = tied_source(g, op)
                    if src_op is None:
                        raise RuntimeSetupError(f"tied linear {name!r} has no embedding to share")
                    self.tied[name] = src_op.name
        for head, emb in self.tied.items():
            sharded = [n for n in (head, emb) if self.layers[n].zero]
            if sharded:
                raise RuntimeSetupError(
                    f"layer {sharded[0]!r} shards its state (zero{self.layers[sharded[0]].zero}) "
                    f"but is one of the tied pair {emb!r} / {head!r}: the tied-weight exchange "
                    f"sums the two copies' full gradients, which a sharded copy no longer holds "
                    f"(the plan prices no gather for it); re-solve with solver.state_sharding: "
                    f"[0] or an untied model")
        self.grad_chunks = {s.index: self._grad_chunks(s) for s in self.stages}
        self.segments = {s.index: self._segments(s) for s in self.stages}
        for e in self.entries:
            src = self.stages[e.src_stage]
            self.comms[e.src_stage].register(self.exports[e.tensor])
            reg.need_mesh(src.devices, e.src_layout.fact)
            reg.need_mesh(self.stages[e.dst_stage].devices, e.dst_layout.fact)
            for t in e.tasks:
                reg.need_group(("fwd", t.group), t.group)
            for t in e.backward_tasks:
                reg.need_group(("bwd", t.group), t.group)
        self.tied_programs: dict[str, tuple[Redistribution, ...]] = {}
        for head, emb in self.tied.items():
            a, b = self.stage_of[emb], self.stage_of[head]
            ew, hw = self.layers[emb].weight, self.layers[head].weight
            assert ew is not None and hw is not None and g[emb].weight is not None
            if a == b:
                progs = tied_exchange(ew, hw, g[emb].weight, self.cluster)
                for red in progs:
                    self.comms[a].register(red)
                self.tied_programs[head] = progs
            else:
                reg.need_group(("tied", head), self.stages[a].devices + self.stages[b].devices)

    def _grad_chunks(self, stage) -> tuple[GradBucket, ...]:
        """The stage's gradient chunks (:func:`ilp_planner.lowering.grad_buckets.fill_buckets` with
        the config's cap), checked against the ones the plan lists and prices."""
        syncs = [(n, b) for n in stage.layers for b in self.buckets[n]]
        chunks = fill_buckets(syncs, self.config.grad_bucket_bytes, self.strategy_ctx)
        listed = sorted((ly.name, c.bytes, c.group_size) for ly in self.plan.layers
                        if ly.name in stage.layers for c in ly.collectives if c.purpose == "grad_sync")
        issued = sorted((c.launcher, c.collective.bytes, c.collective.group_size) for c in chunks)
        if listed != issued:
            raise RuntimeSetupError(
                f"stage {stage.index}: the plan lists gradient AllReduces {listed} but its layers "
                f"and training.grad_bucket_mb give {issued}; re-solve the config")
        return chunks

    def _check_zero(self, op, lp: LayerPlan, syncs: tuple[SyncBucket, ...]) -> None:
        """The state-sharding collectives this runtime will issue for ``lp`` (from the
        planner's own :func:`~ilp_planner.lowering.strategies.grad_sync` buckets, one flat buffer
        each) must be the ones the plan lists and prices."""
        if not syncs:
            raise RuntimeSetupError(f"layer {lp.name!r} is planned with zero{lp.zero} but its "
                                    f"strategy {lp.strategy!r} reduces no weight gradient")
        item = torch.empty((), dtype=self.compute_dtype).element_size()
        issued = sorted(c for b in syncs
                        for c in planned_collectives(b, lp.zero, item, lp.recompute,
                                                     self._backward_reads(op, b)))
        listed = sorted((c.kind.value, c.purpose, c.phase, c.bytes, c.group_size)
                        for c in lp.collectives if c.purpose in ZERO_PURPOSES)
        if issued != listed:
            raise RuntimeSetupError(
                f"layer {lp.name!r} (zero{lp.zero}): the plan lists state-sharding collectives "
                f"{listed} but its gradient buckets give {issued}; re-solve the config")

    def _backward_reads(self, op: Op, sync: SyncBucket) -> bool:
        """ZeRO-3: whether ``op``'s backward reads the bucket's weights
        (:func:`runtime.zero.backward_reads`): autograd reaches its input unless that is
        the model's data, as the planner's ``input_reached``."""
        return backward_reads(op, sync.roles, self.graph[op.inputs[0]].kind is not OpKind.INPUT)

    def _segments(self, stage) -> list[tuple[bool, tuple[str, ...]]]:
        """The stage's layers in order, cut into runs: each maximal run of consecutive
        recomputed layers of one block is one checkpointed region (``True``); every other
        layer runs alone."""
        out: list[tuple[bool, list[str]]] = []
        unit = None
        for name in stage.layers:
            lp, op = self.layers[name], self.graph[name]
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

    # ---- setup ---------------------------------------------------------------------------
    def setup(self) -> None:
        """Create the groups (collective) and this stage's parameters (local)."""
        self.registry.create()
        s = self.my_stage
        if s is None:
            return
        self.ctx = StageContext(s.index, s.devices, self.rank, self.comms[s.index], self.graph)
        self.zero_buckets: list[ZeroBucket] = []
        self.zero_of: dict[str, list[ZeroBucket]] = {}
        self.param_layout: dict[str, Layout] = {}
        for name in s.layers:
            op, lp = self.graph[name], self.layers[name]
            layouts = param_layouts(op, lp.strategy, lp.inputs, lp.weight, lp.output)
            specs = {p.role: p for p in model.param_specs(op)}
            blocks: dict[str, torch.Tensor] = {}
            for role, (lay, _) in layouts.items():
                if name in self.tied:
                    emb = self.graph[self.tied[name]]
                    full = model.init_param(model.param_specs(emb)[0], self.options.seed).t()
                else:
                    full = model.init_param(specs[role], self.options.seed)
                blocks[role] = self.ctx.comm.block(full.to(self.device), lay)
                self.param_layout[f"{name}.{role}"] = lay
            shard_only: set[str] = set()
            for i, sync in enumerate(self.zero_syncs.get(name, ())):
                zb = ZeroBucket(name, i, lp.zero, sync,
                                {r: tuple(blocks[r].shape) for r in sync.roles},
                                {r: math.prod(layouts[r][0].padded_shape(
                                    param_shapes(op)[r])) for r in sync.roles},
                                self.compute_dtype)
                zb.init(blocks, self.registry.axes_group(s.devices, sync.fact, sync.axes),
                        self.device)
                zb.backward_reads = self._backward_reads(op, sync)
                zb.recomputed = lp.recompute
                self.zero_buckets.append(zb)
                self.zero_of.setdefault(name, []).append(zb)
                if lp.zero == 3:
                    shard_only |= set(sync.roles)
                elif lp.zero:  # levels 1, 2: the full blocks in the compute dtype (the
                    # planner's w bytes; the fp32 master is the shard), refreshed by the
                    # all-gather after each update, never updated themselves — but SUMMA
                    # gathers its weight from the master's dtype (as priced) and casts it
                    for role in sync.roles:
                        if not (role == "weight" and is_summa(lp.strategy)):
                            blocks[role] = blocks[role].to(self.compute_dtype)
            for role, local in blocks.items():
                if role not in shard_only:
                    self.params[f"{name}.{role}"] = LVal(local.requires_grad_(True),
                                                         layouts[role][0])
        self.zero_full = {f"{zb.layer}.{r}": (zb, r) for zb in self.zero_buckets
                          if zb.level < 3 for r in zb.sync.roles}
        for zb in self.zero_buckets:
            if zb.level == 3:
                continue
            for role, view in zb.views(zb.full_grad).items():
                t = self.params[f"{zb.layer}.{role}"].t
                t.register_post_accumulate_grad_hook(
                    lambda p, view=view: self._zero_accumulate(p, view))
                if zb.level == 1:  # reduce-scattered once the last backward completes it
                    t.register_post_accumulate_grad_hook(lambda p, zb=zb: self._zero1_ready(zb))
        self.layer_params = {name: {k.rsplit(".", 1)[1]: v for k, v in self.params.items()
                                    if k.rsplit(".", 1)[0] == name} for name in s.layers}
        self._setup_grad_sync(s)
        self.optimizer = Optimizer(self.options.optimizer)

    def _setup_grad_sync(self, stage) -> None:
        """Flat gradient buffers (one per device group, in backward order) whose slices are
        the parameters' ``.grad`` (autograd accumulates in place: one fp32 gradient per
        parameter, as the memory model prices), and a hook on every parameter: during the
        stage's last backward, every chunk whose gradients are all accumulated is
        AllReduced asynchronously right away — overlapped with the rest of the backward."""
        chunks = self.grad_chunks[stage.index]
        sizes: dict[int, int] = {}
        self.grad_slot: dict[str, tuple[int, int, int]] = {}  # key -> (buffer, start, stop)
        for c in chunks:
            sizes[c.buffer] = max(sizes.get(c.buffer, 0), c.stop)
            for m in c.members:
                offset = m.start
                for role in m.roles:
                    key = f"{m.layer}.{role}"
                    n = self.params[key].t.numel()
                    self.grad_slot[key] = (c.buffer, offset, offset + n)
                    offset += n
        self.grad_flat = {b: torch.zeros(n, device=self.device, dtype=model.DTYPE)
                          for b, n in sizes.items()}
        self.grad_view = {key: self.grad_flat[b][lo:hi].view_as(self.params[key].t)
                          for key, (b, lo, hi) in self.grad_slot.items()}
        self.chunks_of = {key: [i for i, c in enumerate(chunks)
                                if c.buffer == b and c.start < hi and c.stop > lo]
                          for key, (b, lo, hi) in self.grad_slot.items()}
        self.chunk_needs = [sum(1 for key in self.grad_slot if i in self.chunks_of[key])
                            for i in range(len(chunks))]
        self.last_backward = last_backward(self.actions[stage.index])
        self._armed = False
        for key in self.grad_slot:
            self.params[key].t.register_post_accumulate_grad_hook(
                lambda p, key=key: self._grad_ready(key, p))

    def _grad_ready(self, key: str, p: torch.Tensor) -> None:
        if not self._armed:
            return
        self._check_in_buffer(key)
        for i in self.chunks_of[key]:
            self.chunk_waiting[i] -= 1
            if self.chunk_waiting[i] == 0:
                self._launch_chunk(i)

    def _check_in_buffer(self, key: str) -> None:
        grad = self.params[key].t.grad
        if grad is None or grad.data_ptr() != self.grad_view[key].data_ptr():
            raise RuntimeError(f"autograd replaced the gradient buffer of {key!r} instead of "
                               f"accumulating into it; its reduction would miss this step")

    def _launch_chunk(self, i: int) -> None:
        c = self.grad_chunks[self.my_stage.index][i]
        group = self.registry.axes_group(self.my_stage.devices, c.fact, c.axes)
        self.chunk_work[i] = all_reduce_async(self.grad_flat[c.buffer][c.start:c.stop], group,
                                              self.recorder, "backward", "grad_sync", c.launcher)

    # ---- one optimizer step ----------------------------------------------------------------
    def train_step(self, step: int) -> StepResult:
        """One optimizer step. Every collective issued — forward, autograd backward,
        gradient synchronisation, tied-weight exchange — is recorded at dispatch level; the
        loss report at the end is tagged ``report`` (not part of the plan)."""
        rec = self.recorder
        rec.take()
        t0 = time.perf_counter()
        for p in self.params.values():
            p.t.grad = None
        if self.my_stage is not None:  # synchronised gradients accumulate in their buffers
            for buf in self.grad_flat.values():
                buf.zero_()
            for key, view in self.grad_view.items():
                self.params[key].t.grad = view
            for zb in self.zero_buckets:
                if zb.level == 3:
                    zb.master.grad = None
                    continue
                zb.full_grad.zero_()
                zb.grad_shard.zero_()
        self.state = {}
        self.loss_sum = 0.0
        if self.my_stage is not None:
            self.ctx.reports.clear()
            self.chunk_waiting = list(self.chunk_needs)
            self.chunk_work: dict[int, Report] = {}
            self.zero_waiting = {zb.key: len(zb.sync.roles) for zb in self.zero_buckets}
            self.zero_work: dict[str, Report] = {}
        with rec if self.options.record else contextlib.nullcontext():
            if self.my_stage is not None:
                for kind, mb in self.actions[self.my_stage.index]:
                    self.handlers[kind](mb)
            for work, _ in self.pending:
                work.wait()
            self.pending = []
            if self.my_stage is not None:
                grads = self._sync_grads()
                self._exchange_tied(grads)
                self._copies = {}  # the next step casts the updated masters
                self.optimizer.step(self._updated(), grads)
                self._gather_updated()
                self.loss_sum = sum(float((r.value() / self.microbatches).sum())
                                    for r in self.ctx.reports)
            with tagged("report", "report"):
                loss = self._broadcast_loss()
        secs = time.perf_counter() - t0
        order = rec.order()
        return StepResult(step, loss, secs, rec.take(), order)

    def _batch(self) -> list[dict]:
        if self._data is None:
            batch = model.make_batch(self.full_graph, self.options.seed)
            self._data = [{k: v.to(self.device) for k, v in mb.items()}
                          for mb in model.split_microbatches(batch, self.microbatches)]
        return self._data

    def recv_forward(self, mb: int) -> None:
        """RF: receive every boundary tensor this stage reads, as leaf blocks."""
        s = self.my_stage
        self.state.setdefault(mb, {})["recv"] = {
            i: self._recv_forward(e) for i, e in enumerate(self.entries) if e.dst_stage == s.index}

    def forward(self, mb: int) -> None:
        """F: run the stage's ops on micro-batch ``mb`` through the lowered edge programs;
        bring outgoing tensors to their entries' source layouts; keep what the backward
        needs."""
        s, g, comm = self.my_stage, self.graph, self.ctx.comm
        st = self.state.setdefault(mb, {})
        if "recv" not in st:
            self.recv_forward(mb)
        recv = st["recv"]
        data = self._batch()[mb]
        vals: dict[str, LVal] = {}

        def have(name: str, idx: int, src: str) -> LVal:
            return vals[src] if self.stage_of[src] == s.index else recv[self.entry_of[(name, idx)]]

        for recompute, names in self.segments[s.index]:
            if recompute:
                self._checkpointed(names, mb, data, have, vals)
            else:
                vals[names[0]] = self._op_forward(names[0], mb, data, have)
        loss = next((vals[n] for n in s.layers if g[n].kind is OpKind.LOSS), None)
        sent = {name: comm.edge(vals[name], red, "activation", "send")
                for name, red in self.exports.items() if self.stage_of[name] == s.index}
        st["out"] = {i: sent[e.tensor] for i, e in enumerate(self.entries) if e.src_stage == s.index}
        st["loss"] = loss

    def _op_forward(self, name: str, mb: int, data: dict,
                    have: Callable[[str, int, str], LVal]) -> LVal:
        """One op on micro-batch ``mb``: its inputs through their lowered edge programs
        (``have`` gives the producer's value), then its kernel. A ZeRO-3 op gathers its
        sharded parameters first and runs under :class:`runtime.zero.released`, so the
        gathered blocks are not kept for the backward (a recomputed op's recomputation
        keeps its own gather for the backward, through the checkpoint)."""
        g, comm = self.graph, self.ctx.comm
        op, lp = g[name], self.layers[name]
        xs = []
        for idx, src in enumerate(op.inputs):
            want = lp.inputs[idx]
            if g[src].kind is OpKind.INPUT:
                key = (mb, src, want)  # the fixed batch: each rank's blocks cut once
                if key not in self._blocks:
                    self._blocks[key] = comm.block(data[src], want)
                xs.append(LVal(self._blocks[key], want))
                continue
            xs.append(comm.edge(have(name, idx, src), self.edges[(name, idx)], "activation", name))
        params = dict(self.layer_params[name])
        gathered = []
        if lp.zero == 3:
            for zb in self.zero_of[name]:
                views, pair = gather(zb, self.recorder)
                params.update({r: LVal(t, self.param_layout[f"{name}.{r}"])
                               for r, t in views.items()})
                gathered.append(pair)
        if self.compute_dtype != model.DTYPE:  # mixed precision: compute copies of the
            # masters (SUMMA gathers its weight's master and casts it itself; ZeRO gathers
            # and ZeRO-1/2 blocks are in the compute dtype already)
            params = {r: v if (r == "weight" and is_summa(lp.strategy))
                      or v.t.dtype == self.compute_dtype else self._compute_copy(f"{name}.{r}", v)
                      for r, v in params.items()}
        with released(gathered) if gathered else contextlib.nullcontext():
            return OPS[op.kind](self.ctx, op, lp, xs, params, data)

    def _compute_copy(self, key: str, master: LVal) -> LVal:
        """The compute-dtype copy of a master block, cast once per step: every micro-batch's
        forward (and a recomputation) reads the same copy, so the step holds it once — the
        planner's w bytes a parameter — not once per micro-batch in flight, and autograd
        adds each micro-batch's gradient to the fp32 master through the one cast."""
        copy = self._copies.get(key)
        if copy is None:
            copy = self._copies[key] = LVal(master.t.to(self.compute_dtype), master.layout)
        return copy

    def _checkpointed(self, names: tuple[str, ...], mb: int, data: dict,
                      have: Callable[[str, int, str], LVal], vals: dict[str, LVal]) -> None:
        """A recomputed run of one block's layers under ``torch.utils.checkpoint``
        (non-reentrant): the values it reads from outside enter as the checkpoint's inputs
        and pass through the layers' edge programs *inside* it, so the recomputation in
        the backward replays those programs and every collective of the layers — recorded
        in phase ``recompute`` (:func:`runtime.recorder.replaying`), as the plan lists
        them. Only the run's values read after it leave it. ``early_stop=False``: the whole
        run is replayed (stopping at the last saved tensor would skip the collectives after
        it). Dropout runs with p = 0 and the checkpoint restores the RNG state, so the
        replay recomputes the same values."""
        g = self.graph
        inside = set(names)
        ext: dict[tuple[str, int], tuple[str, int, str]] = {}  # first reader of each outside value
        keys: list[tuple] = []
        for name in names:
            for idx, src in enumerate(g[name].inputs):
                if src in inside or g[src].kind is OpKind.INPUT:
                    continue
                key = (src,) if self.stage_of[src] == self.my_stage.index else \
                    ("recv", self.entry_of[(name, idx)])
                if key not in keys:
                    keys.append(key)
                ext[(name, idx)] = key
        first = {k: next(v for v, kk in ext.items() if kk == k) for k in keys}
        given = [have(n, i, g[n].inputs[i]) for n, i in (first[k] for k in keys)]
        outs = [n for n in names
                if n in self.exports or any(c not in inside for c in g.consumers(n))]
        layouts = [v.layout for v in given]

        def run(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
            local = {k: LVal(t, lay) for k, t, lay in zip(keys, ts, layouts, strict=True)}
            here: dict[str, LVal] = {}

            def lookup(name: str, idx: int, src: str) -> LVal:
                return here[src] if src in inside else local[ext[(name, idx)]]

            for name in names:
                here[name] = self._op_forward(name, mb, data, lookup)
            return tuple(here[n].t for n in outs)

        got = torch.utils.checkpoint.checkpoint(
            run, *(v.t for v in given), use_reentrant=False, early_stop=False,
            context_fn=lambda: (contextlib.nullcontext(), replaying()))
        for n, t in zip(outs, got, strict=True):
            vals[n] = LVal(t, self.layers[n].output)

    def send_forward(self, mb: int) -> None:
        """SF: broadcast each outgoing tensor's unit tasks (asynchronously)."""
        for idx, v in self.state[mb]["out"].items():
            self._send_forward(self.entries[idx], v)

    def recv_backward(self, mb: int) -> None:
        """RB: receive the gradients of this stage's outgoing tensors."""
        st = self.state[mb]
        st["grad_in"] = self._recv_backward(st["out"])

    def backward(self, mb: int) -> None:
        """B: autograd from the loss (last stage, scaled by 1/M and the float16 loss scale)
        and from the received gradients of the outgoing tensors; weight gradients
        accumulate in the local leaf blocks."""
        st = self.state[mb]
        if "grad_in" not in st:
            self.recv_backward(mb)
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if st["loss"] is not None:
            local = st["loss"].t / self.microbatches  # this rank's part of the loss
            tensors.append(local.sum())
            grads.append(torch.full((), self.loss_scale, device=self.device))
        for idx, v in st["out"].items():
            if v.t.requires_grad:
                tensors.append(v.t)
                grads.append(st["grad_in"][idx])
        # the last backward's gradients are final: reduce each chunk as soon as it is complete
        self._armed = self.options.overlap and mb == self.last_backward
        if tensors:
            torch.autograd.backward(tensors, grads)
        self._armed = False
        self._reduce_scatter_microbatch()
        self.recorder.mark(f"backward_end:{mb}")
        st["done"] = True
        del st["out"], st["grad_in"], st["loss"]

    def send_backward(self, mb: int) -> None:
        """SB: send the gradients of the tensors received in RF back to their holders."""
        st = self.state.pop(mb)
        for idx, leaf in st.get("recv", {}).items():
            self._send_backward(self.entries[idx], leaf)

    def weight_grad(self, mb: int) -> None:
        """W: nothing left to do — B already computed the weight gradients (the runtime does
        not split the backward; a split schedule runs correctly, without the overlap)."""

    # ---- cross-mesh transfers ---------------------------------------------------------------
    def _region(self, layout: Layout, shape, devices) -> tuple[tuple[int, int], ...]:
        return layout_blocks(layout, shape)[devices.index(self.rank)]

    def _rel(self, task_region, mine) -> tuple[slice, ...]:
        return tuple(slice(a - m0, b - m0) for (a, b), (m0, _) in zip(task_region, mine, strict=True))

    def _send(self, tasks: tuple[UnitTask, ...], local: torch.Tensor, mine, direction: str,
              tensor: str) -> None:
        """Post (asynchronously) every task this rank sends, a slice of its block ``local``
        (whose region is ``mine``); waited at the end of the step."""
        for t in tasks:
            if t.sender == self.rank:
                buf = local[self._rel(t.region, mine)].contiguous()
                with tagged(direction, "resharding", tensor):
                    work = dist.broadcast(buf, src=t.sender, async_op=True,
                                          group=self.registry.group((_GROUP_TAG[direction], t.group)))
                self.pending.append((work, buf))

    def _dtype(self, tensor: str) -> torch.dtype:
        return getattr(torch, self.graph[tensor].output.dtype)

    def _post_receives(self, tasks: tuple[UnitTask, ...], direction: str, tensor: str) -> list:
        posted = []
        for t in tasks:
            if self.rank in t.receivers:
                buf = torch.empty([b - a for a, b in t.region], device=self.device,
                                  dtype=self._dtype(tensor))
                with tagged(direction, "resharding", tensor):
                    work = dist.broadcast(buf, src=t.sender, async_op=True,
                                          group=self.registry.group((_GROUP_TAG[direction], t.group)))
                posted.append((t, buf, work))
        return posted

    def _send_forward(self, e: ReshardingEntry, v: LVal) -> None:
        mine = self._region(e.src_layout, e.shape, self.stages[e.src_stage].devices)
        self._send(e.tasks, v.t.detach(), mine, "forward", e.tensor)

    def _recv_forward(self, e: ReshardingEntry) -> LVal:
        mine = self._region(e.dst_layout, e.shape, self.stages[e.dst_stage].devices)
        local = torch.empty([b - a for a, b in mine], device=self.device, dtype=self._dtype(e.tensor))
        with timed(self.recorder):  # receives block: their time is the transfer's
            posted = self._post_receives(e.tasks, "forward", e.tensor)
            for _, _, work in posted:
                work.wait()
        for t, buf, _ in posted:
            local[self._rel(t.region, mine)] = buf
        return LVal(local.requires_grad_(True), e.dst_layout)

    def _send_backward(self, e: ReshardingEntry, leaf: LVal) -> None:
        g = leaf.t.grad
        if g is None:
            g = torch.zeros_like(leaf.t)
        mine = self._region(e.dst_layout, e.shape, self.stages[e.dst_stage].devices)
        self._send(e.backward_tasks, g, mine, "backward", e.tensor)

    def _recv_backward(self, sent: dict[int, LVal]) -> dict[int, torch.Tensor]:
        """Post every receive of the gradients of ``sent`` entries, then wait for them."""
        out = {}
        posted = []
        first = len(self.recorder.events)
        t0 = time.perf_counter()
        for idx in sent:
            e = self.entries[idx]
            mine = self._region(e.src_layout, e.shape, self.stages[e.src_stage].devices)
            out[idx] = torch.zeros([b - a for a, b in mine], device=self.device,
                                   dtype=self._dtype(e.tensor))
            posted += [(idx, t, buf, work, mine)
                       for t, buf, work in self._post_receives(e.backward_tasks, "backward", e.tensor)]
        for _, _, _, work, _ in posted:
            work.wait()
        received = self.recorder.events[first:]
        for ev in received:
            ev.seconds = (time.perf_counter() - t0) / len(received)
        for idx, t, buf, _, mine in posted:
            out[idx][self._rel(t.region, mine)] = buf
        return out

    # ---- gradients and optimizer -----------------------------------------------------------
    def _sync_grads(self) -> dict[str, torch.Tensor]:
        """Wait for the gradient chunks launched during the backward (launching, in chunk
        order, any not launched: without overlap, or holding a parameter the step did not
        reach — its slice stays zero) and read each reduced gradient from its slice of the
        flat buffer. A chunk's recorded seconds are the time the step waited for it (its
        exposed part). Under a float16 loss scale the reduced gradients are unscaled, and
        must be finite."""
        chunks = self.grad_chunks[self.my_stage.index]
        for key in self.grad_slot:
            self._check_in_buffer(key)
        for i in range(len(chunks)):
            if i not in self.chunk_work:
                self._launch_chunk(i)
        for chunk in self.chunk_work.values():
            chunk.value()
        out = dict(self.grad_view)
        for k in self.params:
            if k not in out and k not in self.zero_full:
                out[k] = self._grad(k)
        for zb in self.zero_buckets:
            if zb.level == 1:  # once per step: launched during the last backward, or now
                if zb.key not in self.zero_work:
                    zb.grad_shard += zb.reduce_scatter(zb.full_grad, "shard_grad_sync",
                                                       self.recorder)
                else:
                    zb.grad_shard += self.zero_work[zb.key].value()
            out[zb.key] = zb.shard_grad()
        if self.loss_scale != 1.0:
            model.unscale(out, self.loss_scale)
        return out

    @staticmethod
    def _zero_accumulate(p: torch.Tensor, view: torch.Tensor) -> None:
        """ZeRO-1/2: a full block's gradient (in the block's compute dtype) joins the flat
        fp32 buffer the reduce-scatter reads, and leaves the block — gradients accumulate
        in fp32, as the planner prices them (its g bytes), whatever the block's dtype."""
        view.add_(p.grad)
        p.grad = None

    def _zero1_ready(self, zb: ZeroBucket) -> None:
        """During the step's last backward (with overlap): once every role of a ZeRO-1
        bucket has its final gradient, reduce-scatter it asynchronously, as a gradient
        chunk is AllReduced (the plan prices it overlapped with the rest of the backward)."""
        if not self._armed:
            return
        self.zero_waiting[zb.key] -= 1
        if self.zero_waiting[zb.key] == 0:
            out = torch.empty(zb.s, device=self.device, dtype=torch.float32)
            first = len(self.recorder.events)
            with tagged("backward", "shard_grad_sync", zb.layer):
                work = dist.reduce_scatter_tensor(out, zb.full_grad, group=zb.group, async_op=True)
            self.zero_work[zb.key] = Report(out, work, self.recorder.events[first:])

    def _reduce_scatter_microbatch(self) -> None:
        """ZeRO-2: after each micro-batch's backward, every flat gradient is reduce-scattered
        into its shard (which accumulates) and the full buffer is emptied for the next."""
        for zb in self.zero_buckets:
            if zb.level == 2:
                zb.grad_shard += zb.reduce_scatter(zb.full_grad, "shard_grad", self.recorder)
                zb.full_grad.zero_()

    def _updated(self) -> dict[str, torch.Tensor]:
        """What the optimizer updates: every parameter block this rank holds whole, and the
        fp32 master shard of each sharded flat buffer (not the full blocks of ZeRO-1/2,
        which the all-gather after the update refreshes)."""
        out = {k: v.t.data for k, v in self.params.items() if k not in self.zero_full}
        out.update({zb.key: zb.master.data for zb in self.zero_buckets})
        return out

    def _gather_updated(self) -> None:
        """ZeRO-1/2: all-gather each updated shard (in the compute dtype, as priced) into the
        full local blocks the next forward reads."""
        for zb in self.zero_buckets:
            if zb.level < 3:
                full = zb.all_gather(zb.master.detach().to(self.compute_dtype), "step",
                                     "weight_allgather", self.recorder)
                with torch.no_grad():
                    for role, view in zb.views(full).items():
                        self.params[f"{zb.layer}.{role}"].t.copy_(view)

    def _grad(self, key: str) -> torch.Tensor:
        p = self.params[key].t
        return p.grad if p.grad is not None else torch.zeros_like(p)

    def _exchange_tied(self, grads: dict[str, torch.Tensor]) -> None:
        """Sum the gradients of a tied weight's two copies into both. On one stage: the
        lowered programs of :func:`ilp_planner.lowering.strategies.tied_exchange`. Across stages:
        each stage gathers its copy's gradient (lowered program to replicated), one
        AllReduce over both stages' ranks sums them, each keeps its block."""
        comm = self.ctx.comm
        for head, emb in self.tied.items():
            a, b = self.stage_of[emb], self.stage_of[head]
            mine = self.my_stage.index
            if mine not in (a, b):
                continue
            table = self.graph[emb].weight.master  # gradients are exchanged in fp32
            ek, hk = f"{emb}.weight", f"{head}.weight"
            if a == b:
                to_emb, back = self.tied_programs[head]
                moved = comm.run(grads[hk].t().contiguous(), to_emb.steps, table, "step",
                                 "tied_weight", head)
                total = grads[ek] + moved
                grads[ek] = total
                grads[hk] = comm.run(total, back.steps, table, "step", "tied_weight",
                                     head).t().contiguous()
                continue
            key = ek if mine == a else hk
            lay = self.params[key].layout
            shape = table.shape if key == ek else table.shape[::-1]
            spec = TensorSpec(tuple(shape), table.dtype)
            full = comm.run(grads[key], comm.program(lay, Layout.replicated(lay.fact), spec).steps,
                            spec, "step", "tied_weight", head)
            full = full if key == ek else full.t()
            if self.rank != self.my_stage.devices[0]:
                full = torch.zeros_like(full)
            full = full.contiguous()
            with tagged("step", "tied_weight", head), timed(self.recorder):
                dist.all_reduce(full, group=self.registry.group(("tied", head)))
            full = full if key == ek else full.t()
            grads[key] = comm.block(full, lay)

    def _broadcast_loss(self) -> float:
        """The step's loss on every rank. The loss op's output is replicated over its
        stage (its planned reductions), so when that stage holds every rank nothing moves;
        otherwise its first device broadcasts it (tagged ``report``: not part of the plan)."""
        loss_stage = self.stages[self.stage_of[self._loss_op()]]
        if len(loss_stage.devices) == self.world:
            return self.loss_sum
        src = loss_stage.devices[0]
        buf = torch.tensor([self.loss_sum if self.rank == src else 0.0], device=self.device,
                           dtype=torch.float64)
        dist.broadcast(buf, src=src)
        return float(buf.item())

    def _loss_op(self) -> str:
        return next(op.name for op in self.graph.ops if op.kind is OpKind.LOSS)

    # ---- results ---------------------------------------------------------------------------
    def gather_params(self) -> dict[str, torch.Tensor]:
        """Full parameters (reference names) on every rank; tied copies are not listed. Each
        block is contributed once (by the first device holding it) to a world AllReduce."""
        out = {}
        blocks = {k: v.t.detach() for k, v in self.params.items()}
        for zb in getattr(self, "zero_buckets", ()):  # sharded: the fp32 masters, gathered
            blocks.update({f"{zb.layer}.{r}": t for r, t in zb.full_master().items()})
        for spec in model.graph_param_specs(self.full_graph):
            full = torch.zeros(spec.shape, device=self.device, dtype=model.DTYPE)
            if spec.name in blocks:
                layout = self.param_layout[spec.name]
                regions = layout.regions(spec.shape)
                me = self.ctx.comm.device_index
                first = next(i for i in range(len(regions)) if (regions[i] == regions[me]).all())
                if first == me:
                    full[tuple(slice(int(lo), int(hi)) for lo, hi in regions[me])] = blocks[spec.name]
            dist.all_reduce(full)
            out[spec.name] = full.cpu()
        return out


def last_backward(actions: list[tuple[str, int]]) -> int | None:
    """The micro-batch of a stage's last ``B`` action, in action order: a schedule may run
    its backwards out of micro-batch order, and only the last one completes the gradients."""
    return next((mb for kind, mb in reversed(actions) if kind == "B"), None)


_GROUP_TAG = {"forward": "fwd", "backward": "bwd"}  # transfer groups, one set per direction
