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
   weights, and update the local blocks with SGD or Adam. Under interleaved 1F1B a rank
   holds several stages — the model chunks of its mesh — and runs their actions in the
   mesh's schedule order (:func:`runtime.step_loop.run_mesh`), then each chunk's tail.

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
from runtime.step_loop import ScheduleLoop, run_mesh
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
    params: dict[str, LVal]  # the stage's blocks (part of Executor.params)


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
        if not model.graph_param_specs(c.full_graph):  # the parameters the runtime creates
            raise RuntimeSetupError(f"plan {plan.name}'s model has no parameters: a training "
                                    f"step has nothing to train")
        self.recorder = Recorder(c.cluster.devices_per_node)
        self.registry = MeshRegistry(options.timeout_s)
        self.comms = {s.index: Comm(self.registry, s.devices, rank, c.cluster, self.recorder)
                      for s in c.stages}
        register_groups(c, self.registry, self.comms)
        # this rank's stages: one, or under interleaved 1F1B every chunk of its mesh
        self.my_stages = [s for s in c.stages if rank in s.devices]
        self.params: dict[str, LVal] = {}  # this rank's blocks (all its chunks), held between steps
        self.param_layout: dict[str, Layout] = {}
        self.chunks: dict[int, StageRuntime] = {}  # stage index -> what this rank runs of it
        self.optimizer = Optimizer(options.optimizer)
        self.transfers = Transfers(rank, self.device, self.registry, self.recorder, c.stages,
                                   c.entries, c.graph, c.interleaved)

    def setup(self) -> None:
        """Create the groups (collective) and this rank's parameters (local), stage by stage."""
        self.registry.create()
        for s in self.my_stages:
            self.chunks[s.index] = self._stage_runtime(s)

    def _stage_runtime(self, s: Stage) -> StageRuntime:
        """This rank's parameters of stage ``s`` and the collaborators that run it, wired."""
        c, opts = self.compiled, self.options
        ctx = StageContext(s.index, s.devices, self.rank, self.comms[s.index], c.graph)
        zero = ZeroState(c, s.devices, self.registry, self.recorder, self.device)
        params, layouts = init_params(c, s, ctx.comm, zero, opts.seed, self.device)
        self.params.update(params)
        self.param_layout.update(layouts)
        grad_sync = GradSync(c.grad_chunks[s.index], params, s.devices, self.registry,
                             self.recorder, self.device)
        compute = StageForward(c, s, ctx, params, layouts, zero, self.recorder,
                               opts.seed, self.device)
        loop = ScheduleLoop(c, s, compute, self.transfers, grad_sync, zero, self.recorder,
                            opts.overlap, self.device)
        tied = TiedWeights(c, s, self.rank, ctx.comm, self.registry, self.recorder)
        return StageRuntime(ctx, zero, grad_sync, compute, loop, tied, params)

    def train_step(self, step: int) -> StepResult:
        """One optimizer step. Every collective issued — forward, autograd backward,
        gradient synchronisation, tied-weight exchange — is recorded at dispatch level; the
        loss report at the end is tagged ``report`` (not part of the plan)."""
        rec = self.recorder
        rec.take()
        t0 = time.perf_counter()
        self._begin_step()
        with rec if self.options.record else contextlib.nullcontext():
            loss_sum = self._run_stages() if self.chunks else 0.0
            with tagged("report", "report"):
                loss = self._broadcast_loss(loss_sum)
        secs = time.perf_counter() - t0
        order = rec.order()
        return StepResult(step, loss, secs, rec.take(), order)

    def _begin_step(self) -> None:
        """Gradients start empty; synchronised ones accumulate in their flat buffers."""
        for p in self.params.values():
            p.t.grad = None
        for st in self.chunks.values():
            st.grad_sync.begin_step()
            st.zero.begin_step()
            st.ctx.reports.clear()

    def _run_stages(self) -> float:
        """The mesh's actions in the schedule's order (each run by its stage's loop), then
        the step's tail, stage by stage: wait for the sends, synchronise the gradients,
        exchange the tied ones; one update of every block; returns the rank's part of the
        loss."""
        run_mesh({j: st.loop for j, st in self.chunks.items()},
                 self.compiled.mesh_actions[min(self.chunks)])
        self.transfers.wait_sends()
        grads: dict[str, torch.Tensor] = {}
        updated: dict[str, torch.Tensor] = {}
        for st in self.chunks.values():
            mine = self._synced_grads(st)
            st.tied.exchange(mine, st.params)
            st.compute.drop_copies()
            grads.update(mine)
            updated.update({k: v.t.data for k, v in st.params.items() if k not in st.zero.full})
            updated.update(st.zero.masters())  # not ZeRO-1/2's full blocks: the gather refreshes them
        self.optimizer.step(updated, grads)
        for st in self.chunks.values():
            st.zero.gather_updated(st.params)
        mb = self.compiled.microbatches
        return sum(float((r.value() / mb).sum()) for st in self.chunks.values()
                   for r in st.ctx.reports)

    def _synced_grads(self, st: StageRuntime) -> dict[str, torch.Tensor]:
        """Every gradient the optimizer reads: the reduced chunks, the blocks no chunk
        holds, the sharded buckets' shards. Under a float16 loss scale they are unscaled,
        and must be finite."""
        out = st.grad_sync.reduced()
        for k, p in st.params.items():
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
        for st in self.chunks.values():  # sharded: the fp32 masters, gathered
            blocks.update(st.zero.full_masters())
        for spec in model.graph_param_specs(self.compiled.full_graph):
            full = torch.zeros(spec.shape, device=self.device, dtype=model.DTYPE)
            if spec.name in blocks:
                regions = self.param_layout[spec.name].regions(spec.shape)
                me = next(iter(self.chunks.values())).ctx.comm.device_index  # one mesh
                first = next(i for i in range(len(regions)) if (regions[i] == regions[me]).all())
                if first == me:
                    full[tuple(slice(int(lo), int(hi)) for lo, hi in regions[me])] = blocks[spec.name]
            dist.all_reduce(full)
            out[spec.name] = full.cpu()
        return out
