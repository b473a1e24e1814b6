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

Each concept lives in its own module: the pure compile in :mod:`runtime.compiled` and
:mod:`runtime.groups`; parameters in :mod:`runtime.params`; a stage's forward (mixed
precision, recomputation, ZeRO-3 gathers) in :mod:`runtime.stage_forward`; the action
list's interpreter in :mod:`runtime.step_loop`; cross-mesh transfers in
:mod:`runtime.transfers`; the gradient chunks in :mod:`runtime.grad_sync`; sharded state in
:mod:`runtime.zero_state`; tied weights in :mod:`runtime.tied`. :class:`Executor` is the
facade the launcher drives: it wires them for this rank and runs the step's tail (gradients,
tied weights, update, loss report).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ilp_planner.ir.graph import OpKind
from ilp_planner.ir.layouts import Layout
from ilp_planner.plan.check import CheckedPlan, Stage, check_plan
from ilp_planner.plan.data import Plan
from runtime import model
from runtime.comm import Comm, LVal
from runtime.compiled import CompiledPlan, compile_plan
from runtime.errors import RuntimeSetupError
from runtime.grad_sync import GradSync
from runtime.groups import register_groups
from runtime.mesh import MeshRegistry
from runtime.ops import StageContext
from runtime.optim import Optimizer, OptimizerSpec
from runtime.params import init_params
from runtime.recorder import CommEvent, Recorder, tagged
from runtime.stage_forward import StageForward
from runtime.step_loop import ScheduleLoop
from runtime.tied import TiedWeights
from runtime.transfers import Transfers
from runtime.zero_state import ZeroState


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


def _check_world(plan: Plan, world: int) -> None:
    if plan.num_devices != world:
        raise RuntimeSetupError(
            f"plan {plan.name!r} is for {plan.num_devices} devices but the world has {world} "
            f"processes; launch with --nproc-per-node {plan.num_devices} (or re-solve)")


@dataclass
class StageRuntime:
    """What this rank runs of its stage, built by :meth:`Executor.setup`."""

    ctx: StageContext
    zero: ZeroState
    grad_sync: GradSync
    compute: StageForward
    loop: ScheduleLoop
    tied: TiedWeights


class Executor:
    """One rank's view of a plan; see the module docstring for the phases."""

    def __init__(self, plan: Plan, options: RunOptions, *, rank: int, world: int,
                 device: torch.device | None = None, checked: CheckedPlan | None = None):
        """Compile the plan (pure: no process group needed). ``checked``: the plan's
        :func:`~ilp_planner.plan.check.check_plan` result when the caller already has it
        (computed otherwise, without the strategy enumeration: the verbs ran it before launch)."""
        self.plan = plan
        self.options = options
        self.rank = rank
        self.world = world
        self.device = device or torch.device("cpu")
        _check_world(plan, world)
        checked = checked or check_plan(plan, microbatches=options.microbatches, strategies=False)
        self.compiled: CompiledPlan = compile_plan(plan, checked)
        c = self.compiled
        self.recorder = Recorder(c.cluster.devices_per_node)
        self.registry = MeshRegistry(options.timeout_s)
        self.comms = {s.index: Comm(self.registry, s.devices, rank, c.cluster, self.recorder)
                      for s in c.stages}
        register_groups(c, self.registry, self.comms)
        self.my_stage = next((s for s in c.stages if rank in s.devices), None)
        self.params: dict[str, LVal] = {}  # this stage's blocks, held between steps
        self.param_layout: dict[str, Layout] = {}
        self.stage: StageRuntime | None = None
        self.optimizer = Optimizer(options.optimizer)
        self.transfers = Transfers(rank, self.device, self.registry, self.recorder, c.stages,
                                   c.entries, c.graph)

    def setup(self) -> None:
        """Create the groups (collective) and this stage's parameters (local)."""
        self.registry.create()
        if self.my_stage is not None:
            self.stage = self._stage_runtime(self.my_stage)

    def _stage_runtime(self, s: Stage) -> StageRuntime:
        """This rank's parameters and the collaborators that run its stage, wired."""
        c, opts = self.compiled, self.options
        ctx = StageContext(s.index, s.devices, self.rank, self.comms[s.index], c.graph)
        zero = ZeroState(c, s.devices, self.registry, self.recorder, self.device)
        self.params, self.param_layout = init_params(c, s, ctx.comm, zero, opts.seed, self.device)
        grad_sync = GradSync(c.grad_chunks[s.index], self.params, s.devices, self.registry,
                             self.recorder, self.device)
        compute = StageForward(c, s, ctx, self.params, self.param_layout, zero, self.recorder,
                               opts.seed, self.device)
        loop = ScheduleLoop(c, s, compute, self.transfers, grad_sync, zero, self.recorder,
                            opts.overlap, self.device)
        tied = TiedWeights(c, s, self.rank, ctx.comm, self.registry, self.recorder)
        return StageRuntime(ctx, zero, grad_sync, compute, loop, tied)

    def train_step(self, step: int) -> StepResult:
        """One optimizer step. Every collective issued — forward, autograd backward,
        gradient synchronisation, tied-weight exchange — is recorded at dispatch level; the
        loss report at the end is tagged ``report`` (not part of the plan)."""
        rec = self.recorder
        rec.take()
        t0 = time.perf_counter()
        self._begin_step()
        with rec if self.options.record else contextlib.nullcontext():
            loss_sum = self._run_stage() if self.stage is not None else 0.0
            with tagged("report", "report"):
                loss = self._broadcast_loss(loss_sum)
        secs = time.perf_counter() - t0
        order = rec.order()
        return StepResult(step, loss, secs, rec.take(), order)

    def _begin_step(self) -> None:
        """Gradients start empty; synchronised ones accumulate in their flat buffers."""
        for p in self.params.values():
            p.t.grad = None
        if self.stage is not None:
            self.stage.grad_sync.begin_step()
            self.stage.zero.begin_step()
            self.stage.ctx.reports.clear()

    def _run_stage(self) -> float:
        """The stage's actions, then the step's tail: wait for the sends, synchronise the
        gradients, exchange the tied ones, update; returns the stage's part of the loss."""
        st = self.stage
        st.loop.run()
        self.transfers.wait_sends()
        grads = self._synced_grads(st)
        st.tied.exchange(grads, self.params)
        st.compute.drop_copies()
        updated = {k: v.t.data for k, v in self.params.items() if k not in st.zero.full}
        updated.update(st.zero.masters())  # not ZeRO-1/2's full blocks: the gather refreshes them
        self.optimizer.step(updated, grads)
        st.zero.gather_updated(self.params)
        mb = self.compiled.microbatches
        return sum(float((r.value() / mb).sum()) for r in st.ctx.reports)

    def _synced_grads(self, st: StageRuntime) -> dict[str, torch.Tensor]:
        """Every gradient the optimizer reads: the reduced chunks, the blocks no chunk
        holds, the sharded buckets' shards. Under a float16 loss scale they are unscaled,
        and must be finite."""
        out = st.grad_sync.reduced()
        for k, p in self.params.items():
            if k not in out and k not in st.zero.full:
                out[k] = p.t.grad if p.t.grad is not None else torch.zeros_like(p.t)
        out.update(st.zero.shard_grads())
        if self.compiled.loss_scale != 1.0:
            model.unscale(out, self.compiled.loss_scale)
        return out

    def _broadcast_loss(self, loss_sum: float) -> float:
        """The step's loss on every rank. The loss op's output is replicated over its
        stage (its planned reductions), so when that stage holds every rank nothing moves;
        otherwise its first device broadcasts it (tagged ``report``: not part of the plan)."""
        c = self.compiled
        loss_op = next(op.name for op in c.graph.ops if op.kind is OpKind.LOSS)
        loss_stage = c.stages[c.stage_of[loss_op]]
        if len(loss_stage.devices) == self.world:
            return loss_sum
        src = loss_stage.devices[0]
        buf = torch.tensor([loss_sum if self.rank == src else 0.0], device=self.device,
                           dtype=torch.float64)
        dist.broadcast(buf, src=src)
        return float(buf.item())

    def gather_params(self) -> dict[str, torch.Tensor]:
        """Full parameters (reference names) on every rank; tied copies are not listed. Each
        block is contributed once (by the first device holding it) to a world AllReduce."""
        out = {}
        blocks = {k: v.t.detach() for k, v in self.params.items()}
        if self.stage is not None:  # sharded: the fp32 masters, gathered
            blocks.update(self.stage.zero.full_masters())
        for spec in model.graph_param_specs(self.compiled.full_graph):
            full = torch.zeros(spec.shape, device=self.device, dtype=model.DTYPE)
            if spec.name in blocks:
                regions = self.param_layout[spec.name].regions(spec.shape)
                me = self.stage.ctx.comm.device_index
                first = next(i for i in range(len(regions)) if (regions[i] == regions[me]).all())
                if first == me:
                    full[tuple(slice(int(lo), int(hi)) for lo, hi in regions[me])] = blocks[spec.name]
            dist.all_reduce(full)
            out[spec.name] = full.cpu()
        return out
