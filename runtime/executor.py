"""Execute a solved plan: per-stage programs, cross-mesh transfers, the pipeline schedule.

Life of a run (:class:`Executor`):

1. **compile** (pure, before any collective; identical on every rank): rebuild the graph
   from ``plan.config`` (the micro-batch graph when the step is cut into micro-batches),
   check every op is supported and every edge crossing stages has a resharding entry, parse
   the schedule, and register every mesh and process group the run will use — layer layouts,
   every layout on the planner's redistribution paths, SUMMA's gathered layouts, one group
   per ``{sender} ∪ receivers`` of each forward task and ``{receiver} ∪ holders`` of each
   backward task, and the group joining two stages that share a tied weight;
2. **setup**: create all groups in registration order (:class:`runtime.mesh.MeshRegistry`),
   then the parameters of this rank's stage as DTensor leaves in their planned placements,
   from the deterministic initialisation (every rank of a stage draws the same full tensor
   and keeps its shard — no communication);
3. **step**: interpret this stage's lowered action list through a ``kind → handler`` table
   (``RF`` receive activations, ``F`` forward of a micro-batch, ``SF`` send activations,
   ``RB``/``B``/``SB`` the same for the backward, ``W`` nothing: B computes weight gradients
   too); then synchronise weight gradients (each gradient brought to its parameter's
   placements: AllReduce over the axes where the weight is replicated, bucketed), exchange
   the gradients of tied weights, and update the local shards with SGD or Adam.

Cross-mesh transfers (seed 003). Forward: the boundary tensor is brought (inside its source
stage) to the entry's ``src_layout``, then each unit task, in the plan's order, is one
``dist.broadcast`` from its sender within the group ``{sender} ∪ receivers``; receivers
assemble their shard of ``dst_layout`` and wrap it as a leaf DTensor. Backward: the leaf's
gradient is made non-partial (redistributed to ``dst_layout``) and each slice is broadcast
back from the task's first receiver to the holders, who assemble the gradient of their
``src_layout`` shard and run autograd from there. Sends are asynchronous (waited at the end
of the step) and receives block, so no schedule that respects its own dependencies can
deadlock; forward and backward transfers use distinct groups because a 1F1B stage
interleaves the two directions differently from its neighbour.

Tied weights (GPT's head uses the embedding table transposed): the head keeps its own copy
in its planned layout, initialised identically; after gradient synchronisation both copies'
full gradients are summed (locally when one stage holds both, with one AllReduce over the
two stages' ranks otherwise) and both copies take the same update. The planner prices
neither this exchange nor a per-step weight redistribution (it assumes the head's layout);
this is a deviation of the runtime from the cost model, recorded as ``tied_weight`` events.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
from torch.distributed.tensor import Partial as TPartial

from formulations.schedules import Schedule, ScheduleError, lower, make_schedule, validate
from ilp_planner.config import parse_config
from ilp_planner.errors import LayoutError, PlanFormatError
from ilp_planner.graph import Graph, OpKind
from ilp_planner.layouts import Layout
from ilp_planner.plan import LayerPlan, Plan, layout_from_dict
from runtime import model
from runtime.comm import Comm, CommEvent, DVal, Recorder, settle
from runtime.errors import RuntimeSetupError
from runtime.mesh import MeshRegistry
from runtime.ops import OPS, StageContext, is_summa, param_layouts, summa_compute_layouts
from runtime.optim import Optimizer, OptimizerSpec
from runtime.plans import device_regions


@dataclass(frozen=True)
class RunOptions:
    steps: int = 3
    seed: int = 0
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    timeout_s: float = 60.0
    microbatches: int | None = None  # single-stage plans: gradient accumulation override
    grad_buckets: str = "stage"  # gradient AllReduce per stage bucket | per op (as priced) | none


@dataclass(frozen=True)
class Task:
    region: tuple[tuple[int, int], ...]
    sender: int
    holders: tuple[int, ...]
    receivers: tuple[int, ...]

    @property
    def fwd_group(self) -> tuple[int, ...]:
        return tuple(sorted({self.sender, *self.receivers}))

    @property
    def bwd_group(self) -> tuple[int, ...]:
        return tuple(sorted({self.receivers[0], *self.holders}))


@dataclass(frozen=True)
class Entry:
    """One resharding entry of the plan: a tensor moving between two stages."""

    index: int
    src_stage: int
    dst_stage: int
    tensor: str
    consumer: str
    shape: tuple[int, ...]
    src_layout: Layout
    dst_layout: Layout
    tasks: tuple[Task, ...]


@dataclass
class Stage:
    index: int
    devices: tuple[int, ...]
    layers: list[str]


@dataclass
class StepResult:
    step: int
    loss: float
    seconds: float
    events: list[CommEvent]


class Executor:
    """One rank's view of a plan; see the module docstring for the phases."""

    def __init__(self, plan: Plan, options: RunOptions, *, rank: int, world: int,
                 device: torch.device | None = None):
        self.plan = plan
        self.options = options
        self.rank = rank
        self.world = world
        self.device = device or torch.device("cpu")
        if plan.num_devices != world:
            raise RuntimeSetupError(
                f"plan {plan.name!r} is for {plan.num_devices} devices but the world has {world} "
                f"processes; launch with --nproc-per-node {plan.num_devices} (or re-solve)")
        try:
            self.config = parse_config(plan.config)
        except Exception as exc:  # a plan whose embedded config no longer parses
            raise PlanFormatError(f"plan {plan.name!r}: its config does not parse: {exc}") from exc
        self.cluster = self.config.cluster
        self.full_graph = self.config.graph
        self.microbatches = self._microbatches()
        self.graph = self._graph()
        model.check_supported(self.graph)
        self.layers: dict[str, LayerPlan] = {lp.name: lp for lp in plan.layers}
        self._check_layers()
        self.stages = self._stages()
        self.stage_of = {n: s.index for s in self.stages for n in s.layers}
        self.entries = self._entries()
        self.actions = self._actions()
        self.recorder = Recorder()
        self.registry = MeshRegistry("cuda" if self.device.type == "cuda" else "cpu",
                                     options.timeout_s)
        self.comms = {s.index: Comm(self.registry, s.devices, self.cluster, self.recorder)
                      for s in self.stages}
        self.tied: dict[str, str] = {}  # head op -> embedding op
        self._compile()
        self.my_stage = next((s for s in self.stages if rank in s.devices), None)
        self.params: dict[str, DVal] = {}
        self.state: dict[int, dict] = {}
        self.pending: list = []
        # kind -> handler (formulations.schedules action kinds; lowered schedules)
        self.handlers: dict[str, Callable[[int], None]] = {
            "RF": self.recv_forward, "F": self.forward, "SF": self.send_forward,
            "RB": self.recv_backward, "B": self.backward, "SB": self.send_backward,
            "W": self.weight_grad,
        }

    # ---- compile -------------------------------------------------------------------------
    def _microbatches(self) -> int:
        if self.plan.schedule:
            try:
                return int(self.plan.schedule["num_microbatches"])
            except (KeyError, TypeError, ValueError) as exc:
                raise PlanFormatError(f"plan {self.plan.name!r}: schedule has no integer "
                                      f"num_microbatches") from exc
        return self.options.microbatches or self.config.pipeline.microbatches

    def _graph(self) -> Graph:
        m = self.microbatches
        if m == 1:
            return self.full_graph
        if "batch" not in self.config.model or self.config.model["batch"] % m:
            raise RuntimeSetupError(f"model batch {self.config.model.get('batch')} does not split "
                                    f"into {m} micro-batches")
        return self.config.with_overrides({"model.batch": self.config.model["batch"] // m,
                                           "pipeline.microbatches": 1}).graph

    def _check_layers(self) -> None:
        for op in self.graph.ops:
            if op.kind is OpKind.INPUT:
                continue
            if op.name not in self.layers:
                raise PlanFormatError(f"plan {self.plan.name!r} has no layer for op {op.name!r}")
            lp = self.layers[op.name]
            if len(lp.inputs) != len(op.inputs):
                raise PlanFormatError(f"layer {op.name!r}: {len(lp.inputs)} input layouts for "
                                      f"{len(op.inputs)} inputs")
            try:
                for lay, src in zip(lp.inputs, op.inputs, strict=True):
                    lay.check(self.graph[src].output)
                    if not lay.is_even(self.graph[src].output):
                        raise LayoutError(f"{lay} splits {self.graph[src].output.shape} unevenly")
                lp.output.check(op.output)
            except LayoutError as exc:
                raise RuntimeSetupError(f"layer {op.name!r}: {exc} (the runtime needs even "
                                        f"splits of the micro-batch shapes)") from exc

    def _stages(self) -> list[Stage]:
        names = [lp.name for lp in self.plan.layers]
        if not self.plan.stages:
            return [Stage(0, tuple(range(self.world)), names)]
        out = []
        try:
            for i, s in enumerate(self.plan.stages):
                if int(s["index"]) != i:
                    raise PlanFormatError(f"stage {i} has index {s['index']}")
                out.append(Stage(i, tuple(int(d) for d in s["devices"]), list(s["layers"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanFormatError(f"plan {self.plan.name!r}: malformed stages ({exc})") from exc
        placed = [n for s in out for n in s.layers]
        if sorted(placed) != sorted(names):
            raise PlanFormatError(f"plan {self.plan.name!r}: stages list {len(placed)} layers, the "
                                  f"plan has {len(names)} (each layer in exactly one stage)")
        used = [d for s in out for d in s.devices]
        if len(set(used)) != len(used) or any(not 0 <= d < self.world for d in used):
            raise PlanFormatError(f"plan {self.plan.name!r}: stage devices {used} overlap or lie "
                                  f"outside 0..{self.world - 1}")
        for s in out:
            for n in s.layers:
                lay = self.layers[n].output
                if lay.num_devices != len(s.devices):
                    raise PlanFormatError(f"layer {n!r} is laid out on {lay.num_devices} devices, "
                                          f"its stage {s.index} has {len(s.devices)}")
        return out

    def _entries(self) -> list[Entry]:
        out = []
        for i, e in enumerate(self.plan.resharding):
            try:
                tasks = tuple(Task(tuple((int(a), int(b)) for a, b in t["slice"]), int(t["sender"]),
                                   tuple(int(h) for h in t["holders"]),
                                   tuple(int(r) for r in t["receivers"])) for t in e["tasks"])
                ent = Entry(i, int(e["src_stage"]), int(e["dst_stage"]), e["tensor"], e["consumer"],
                            tuple(int(x) for x in e["shape"]), layout_from_dict(e["src_layout"]),
                            layout_from_dict(e["dst_layout"]), tasks)
            except (KeyError, TypeError, ValueError, LayoutError) as exc:
                raise PlanFormatError(f"plan {self.plan.name!r}: resharding entry {i} is malformed "
                                      f"({type(exc).__name__}: {exc})") from exc
            self._check_entry(ent)
            out.append(ent)
        return out

    def _check_entry(self, e: Entry) -> None:
        where = f"resharding entry {e.index} ({e.tensor} -> {e.consumer})"
        spec = self.graph[e.tensor].output if e.tensor in self.graph else None
        if spec is None or e.consumer not in self.graph:
            raise PlanFormatError(f"{where}: names an op the graph does not have")
        if tuple(spec.shape) != e.shape:
            raise PlanFormatError(f"{where}: shape {list(e.shape)} but the op's output is "
                                  f"{list(spec.shape)}")
        if self.stage_of[e.tensor] != e.src_stage or self.stage_of[e.consumer] != e.dst_stage:
            raise PlanFormatError(f"{where}: stages {e.src_stage}->{e.dst_stage} disagree with the "
                                  f"stage lists")
        if e.src_layout.has_partial or e.dst_layout.has_partial:
            raise RuntimeSetupError(f"{where}: cross-mesh layouts must be free of partial sums")
        src_dev = self.stages[e.src_stage].devices
        dst_dev = self.stages[e.dst_stage].devices
        src_reg = dict(zip(src_dev, device_regions(e.src_layout, e.shape), strict=True))
        dst_reg = dict(zip(dst_dev, device_regions(e.dst_layout, e.shape), strict=True))
        covered = dict.fromkeys(dst_dev, 0)
        for k, t in enumerate(e.tasks):
            if t.sender not in t.holders or not t.receivers:
                raise PlanFormatError(f"{where}: task {k} sender {t.sender} is not a holder, or no "
                                      f"receivers")
            for h in t.holders:
                if h not in src_reg or not _inside(t.region, src_reg[h]):
                    raise PlanFormatError(f"{where}: task {k} slice {t.region} is not held by {h}")
            for r in t.receivers:
                if r not in dst_reg or not _inside(t.region, dst_reg[r]):
                    raise PlanFormatError(f"{where}: task {k} slice {t.region} not needed by {r}")
                covered[r] += _numel(t.region)
        for r, n in covered.items():
            if n != _numel(dst_reg[r]):
                raise PlanFormatError(f"{where}: device {r} receives {n} of the {_numel(dst_reg[r])} "
                                      f"elements of its shard")

    def _actions(self) -> dict[int, list[tuple[str, int]]]:
        """Parse, validate (complete, locally ordered, deadlock-free — the lead's
        :func:`formulations.schedules.validate`) and lower the schedule: per stage the
        ``(kind, micro-batch)`` list the handler table runs. Accepted plan forms:
        ``{"actions": {"0": ["F0", …], …}, "num_microbatches": M}`` or the
        ``Schedule.to_dict`` form ``{"rows": ["F0 F1 …", …], "microbatches": M}``."""
        m, n = self.microbatches, len(self.stages)
        raw = self.plan.schedule or {}
        name = str(raw.get("name", "custom"))
        if raw.get("actions"):
            acts = raw["actions"]
            try:
                rows = [acts[str(i)] if str(i) in acts else acts[i] for i in range(n)]
            except (KeyError, TypeError) as exc:
                raise ScheduleError(f"schedule actions need one list per stage 0..{n - 1} "
                                    f"({exc})") from exc
        elif raw.get("rows"):
            rows = raw["rows"]
        elif n == 1:
            rows = make_schedule("1f1b", 1, m).to_strings()
        else:
            raise PlanFormatError(f"plan {self.plan.name!r} has {n} stages but no schedule actions")
        if len(rows) != n:
            raise ScheduleError(f"schedule has {len(rows)} rows for {n} stages")
        sched = Schedule.from_strings(rows, num_microbatches=m, name=name)
        validate(sched)
        sched = lower(sched)
        for e in self.entries:
            if e.src_stage >= e.dst_stage:
                raise RuntimeSetupError(f"resharding entry {e.index} ({e.tensor} -> {e.consumer}) "
                                        f"goes from stage {e.src_stage} to {e.dst_stage}; "
                                        f"transfers must go to a later stage")
        return {i: [(a.kind.value, a.microbatch) for a in row] for i, row in enumerate(sched.rows)}

    def _compile(self) -> None:
        """Register every mesh and group (same order on every rank)."""
        reg = self.registry
        g = self.graph
        self.entry_of: dict[tuple[str, str], Entry] = {}
        for e in self.entries:
            self.entry_of[(e.tensor, e.consumer)] = e
        for s in self.stages:
            comm = self.comms[s.index]
            for name in s.layers:
                op, lp = g[name], self.layers[name]
                reg.need_mesh(s.devices, lp.output.fact)
                for idx, src in enumerate(op.inputs):
                    want = lp.inputs[idx]
                    reg.need_mesh(s.devices, want.fact)
                    spec = g[src].output
                    if g[src].kind is OpKind.INPUT:
                        if want.has_partial:
                            raise RuntimeSetupError(f"layer {name!r} wants its input {src!r} as "
                                                    f"partial sums {want}")
                    elif self.stage_of[src] == s.index:
                        comm.register(self.layers[src].output, want, spec)
                    else:
                        e = self.entry_of.get((src, name))
                        if e is None:
                            raise PlanFormatError(
                                f"edge {src} -> {name} crosses stages {self.stage_of[src]} -> "
                                f"{s.index} but the plan has no resharding entry for it")
                        comm.register(e.dst_layout, want, spec)
                for lay in param_layouts(op, lp).values():
                    reg.need_mesh(s.devices, lay.fact)
                if op.kind is OpKind.LINEAR and is_summa(lp):
                    xc, _ = summa_compute_layouts(lp)
                    comm.register(lp.inputs[0], xc, g[op.inputs[0]].output)
                if op.kind is OpKind.LINEAR and op.attrs.get("tied"):
                    src_op = model.tied_source(g, op)
                    self.tied[name] = src_op.name
                    reg.need_mesh(s.devices, Layout.replicated(lp.output.fact).fact)
        for e in self.entries:
            src = self.stages[e.src_stage]
            self.comms[e.src_stage].register(self.layers[e.tensor].output, e.src_layout,
                                             g[e.tensor].output)
            reg.need_mesh(src.devices, e.src_layout.fact)
            reg.need_mesh(self.stages[e.dst_stage].devices, e.dst_layout.fact)
            for t in e.tasks:
                reg.need_group(("fwd", t.fwd_group), t.fwd_group)
                reg.need_group(("bwd", t.bwd_group), t.bwd_group)
        for head, emb in self.tied.items():
            a, b = self.stage_of[emb], self.stage_of[head]
            if a != b:
                ranks = self.stages[a].devices + self.stages[b].devices
                reg.need_group(("tied", head), ranks)

    # ---- setup ---------------------------------------------------------------------------
    def setup(self) -> None:
        """Create the groups (collective) and this stage's parameters (local)."""
        self.registry.create()
        s = self.my_stage
        if s is None:
            return
        self.ctx = StageContext(s.index, s.devices, self.rank, self.comms[s.index], self.graph)
        for name in s.layers:
            op, lp = self.graph[name], self.layers[name]
            layouts = param_layouts(op, lp)
            specs = {p.role: p for p in model.param_specs(op)}
            if name in self.tied:
                emb = self.graph[self.tied[name]]
                full = model.init_param(model.param_specs(emb)[0], self.options.seed).t().contiguous()
                self.params[f"{name}.weight"] = self._leaf(full, layouts["weight"])
                continue
            for role, lay in layouts.items():
                full = model.init_param(specs[role], self.options.seed)
                self.params[f"{name}.{role}"] = self._leaf(full, lay)
        self.optimizer = Optimizer(self.options.optimizer)

    def _leaf(self, full: torch.Tensor, layout: Layout) -> DVal:
        dt = distribute_tensor(full.to(self.device), self.ctx.comm.mesh(layout),
                               tuple(layout.to_dtensor()), src_data_rank=None)
        return DVal(dt.requires_grad_(True), layout)

    # ---- one optimizer step ----------------------------------------------------------------
    def train_step(self, step: int) -> StepResult:
        dist.barrier()
        self.recorder.take()
        t0 = time.perf_counter()
        for p in self.params.values():
            p.dt.grad = None
        self.loss_sum = 0.0
        self.state = {}
        batch = model.make_batch(self.full_graph, self.options.seed)
        self.data = [{k: v.to(self.device) for k, v in mb.items()}
                     for mb in model.split_microbatches(batch, self.microbatches)]
        if self.my_stage is not None:
            for kind, mb in self.actions[self.my_stage.index]:
                self.handlers[kind](mb)
        for work, _ in self.pending:
            work.wait()
        self.pending = []
        if self.my_stage is not None:
            grads = self._sync_grads()
            self._exchange_tied(grads)
            self.optimizer.step({k: v.dt._local_tensor for k, v in self.params.items()},
                                {k: g.to_local() for k, g in grads.items()})
        loss = self._broadcast_loss()
        secs = time.perf_counter() - t0
        return StepResult(step, loss, secs, self.recorder.take())

    def recv_forward(self, mb: int) -> None:
        """RF: receive every boundary tensor this stage reads, as leaf DTensors."""
        s = self.my_stage
        self.state.setdefault(mb, {})["recv"] = {
            e.index: self._recv_forward(e) for e in self.entries if e.dst_stage == s.index}

    def forward(self, mb: int) -> None:
        """F: run the stage's ops on micro-batch ``mb``; bring outgoing tensors to their
        entries' source layouts; keep what the backward needs."""
        s, g, comm = self.my_stage, self.graph, self.ctx.comm
        st = self.state.setdefault(mb, {})
        if "recv" not in st:
            self.recv_forward(mb)
        recv = st["recv"]
        data = self.data[mb]
        vals: dict[str, DVal] = {}
        loss = None
        for name in s.layers:
            op, lp = g[name], self.layers[name]
            xs = []
            for idx, src in enumerate(op.inputs):
                want = lp.inputs[idx]
                if g[src].kind is OpKind.INPUT:
                    dt = distribute_tensor(data[src], comm.mesh(want), tuple(want.to_dtensor()),
                                           src_data_rank=None)
                    xs.append(DVal(dt, want))
                elif self.stage_of[src] == s.index:
                    xs.append(comm.to_layout(vals[src], want, g[src].output, name))
                else:
                    e = self.entry_of[(src, name)]
                    xs.append(comm.to_layout(recv[e.index], want, g[src].output, name))
            params = {k.rsplit(".", 1)[1]: v for k, v in self.params.items()
                      if k.rsplit(".", 1)[0] == name}
            vals[name] = OPS[op.kind](self.ctx, op, lp, xs, params, data)
            if op.kind is OpKind.LOSS:
                loss = vals[name]
        st["out"] = {e.index: comm.to_layout(vals[e.tensor], e.src_layout, g[e.tensor].output, "send")
                     for e in self.entries if e.src_stage == s.index}
        st["loss"] = loss

    def send_forward(self, mb: int) -> None:
        """SF: broadcast each outgoing tensor's unit tasks (asynchronously)."""
        for idx, v in self.state[mb]["out"].items():
            self._send_forward(self.entries[idx], v)

    def recv_backward(self, mb: int) -> None:
        """RB: receive the gradients of this stage's outgoing tensors."""
        st = self.state[mb]
        st["grad_in"] = self._recv_backward(st["out"])

    def backward(self, mb: int) -> None:
        """B: autograd from the loss (last stage, scaled by 1/M) and from the received
        gradients of the outgoing tensors; weight gradients accumulate in the DTensor
        parameters."""
        st = self.state[mb]
        if "grad_in" not in st:
            self.recv_backward(mb)
        tensors: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        if st["loss"] is not None:
            local = st["loss"].dt.to_local() / self.microbatches
            self.loss_sum += float(local.detach().sum())
            tensors.append(local.sum())
            grads.append(torch.ones((), device=self.device))
        for idx, v in st["out"].items():
            if v.dt.requires_grad:
                tensors.append(v.dt)
                grads.append(st["grad_in"][idx])
        if tensors:
            torch.autograd.backward(tensors, grads)
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
        return device_regions(layout, shape)[devices.index(self.rank)]

    def _rel(self, task_region, mine) -> tuple[slice, ...]:
        return tuple(slice(a - m0, b - m0) for (a, b), (m0, _) in zip(task_region, mine, strict=True))

    def _send_forward(self, e: Entry, v: DVal) -> None:
        devices = self.stages[e.src_stage].devices
        mine = self._region(e.src_layout, e.shape, devices)
        local = settle(v.dt).to_local().detach()
        for t in e.tasks:
            if t.sender == self.rank:
                buf = local[self._rel(t.region, mine)].contiguous()
                work = dist.broadcast(buf, src=t.sender, group=self.registry.group(("fwd", t.fwd_group)),
                                      async_op=True)
                self.pending.append((work, buf))

    def _recv_forward(self, e: Entry) -> DVal:
        devices = self.stages[e.dst_stage].devices
        mine = self._region(e.dst_layout, e.shape, devices)
        local = torch.empty([b - a for a, b in mine], device=self.device, dtype=model.DTYPE)
        posted = []
        for t in e.tasks:
            if self.rank in t.receivers:
                buf = torch.empty([b - a for a, b in t.region], device=self.device, dtype=model.DTYPE)
                t0 = time.perf_counter()
                work = dist.broadcast(buf, src=t.sender, group=self.registry.group(("fwd", t.fwd_group)),
                                      async_op=True)
                posted.append((t, buf, work, t0))
        for t, buf, work, t0 in posted:
            work.wait()
            self._record_broadcast(t, buf, t0, "forward")
            local[self._rel(t.region, mine)] = buf
        comm = self.comms[e.dst_stage]
        dt = DTensor.from_local(local, comm.mesh(e.dst_layout), tuple(e.dst_layout.to_dtensor()),
                                run_check=False, shape=torch.Size(e.shape),
                                stride=_stride(e.shape))
        return DVal(dt.requires_grad_(True), e.dst_layout)

    def _send_backward(self, e: Entry, leaf: DVal) -> None:
        comm = self.comms[e.dst_stage]
        g = leaf.dt.grad
        if g is None:
            g = distribute_tensor(torch.zeros(e.shape, device=self.device), comm.mesh(e.dst_layout),
                                  tuple(e.dst_layout.to_dtensor()), src_data_rank=None)
        elif tuple(g.placements) != tuple(e.dst_layout.to_dtensor()):
            g = comm.redistribute(DVal(g, Layout.from_dtensor(list(g.placements), e.dst_layout.fact)),
                                  e.dst_layout, "boundary grad", "resharding").dt
        local = settle(g).to_local()
        mine = self._region(e.dst_layout, e.shape, self.stages[e.dst_stage].devices)
        for t in e.tasks:
            if t.receivers[0] == self.rank:
                buf = local[self._rel(t.region, mine)].contiguous()
                work = dist.broadcast(buf, src=self.rank, group=self.registry.group(("bwd", t.bwd_group)),
                                      async_op=True)
                self.pending.append((work, buf))

    def _recv_backward(self, sent: dict[int, DVal]) -> dict[int, DTensor]:
        """Post every receive of the gradients of ``sent`` entries, then wait for them."""
        out = {}
        posted = []
        for idx in sent:
            e = self.entries[idx]
            mine = self._region(e.src_layout, e.shape, self.stages[e.src_stage].devices)
            local = torch.empty([b - a for a, b in mine], device=self.device, dtype=model.DTYPE)
            for t in e.tasks:
                if self.rank in t.holders:
                    buf = torch.empty([b - a for a, b in t.region], device=self.device,
                                      dtype=model.DTYPE)
                    t0 = time.perf_counter()
                    work = dist.broadcast(buf, src=t.receivers[0],
                                          group=self.registry.group(("bwd", t.bwd_group)), async_op=True)
                    posted.append((idx, t, buf, work, t0, mine))
            out[idx] = local
        for idx, t, buf, work, t0, mine in posted:
            work.wait()
            self._record_broadcast(t, buf, t0, "backward", holders=True)
            out[idx][self._rel(t.region, mine)] = buf
        res = {}
        for idx, local in out.items():
            e = self.entries[idx]
            res[idx] = DTensor.from_local(local, self.comms[e.src_stage].mesh(e.src_layout),
                                          tuple(e.src_layout.to_dtensor()), run_check=False,
                                          shape=torch.Size(e.shape), stride=_stride(e.shape))
        return res

    def _record_broadcast(self, t: Task, buf: torch.Tensor, t0: float, phase: str,
                          holders: bool = False) -> None:
        group = t.bwd_group if holders else t.fwd_group
        nodes = {r // self.cluster.devices_per_node for r in group}
        self.recorder.add(CommEvent("broadcast", len(group) - 1, buf.numel() * buf.element_size(),
                                    "inter" if len(nodes) > 1 else "intra",
                                    time.perf_counter() - t0, phase, "resharding"))

    # ---- gradients and optimizer -----------------------------------------------------------
    def _sync_grads(self) -> dict[str, DTensor]:
        """Each weight gradient brought to its parameter's placements. Gradients whose only
        change is partial → replicated over the same mesh axes (AutoDDL §4.4.1's AllReduce)
        share one bucket: flattened into one buffer, all-reduced once per axis, split back —
        one collective per bucket and axis instead of one per tensor, as DDP does. Buckets
        span the stage (``grad_buckets="stage"``) or one op's tensors (``"op"``: what the cost
        model prices, one AllReduce per op); ``"none"`` syncs tensor by tensor. Any other
        change (e.g. SUMMA's ReduceScatter) goes through the layout machinery."""
        comm = self.ctx.comm
        out: dict[str, DTensor] = {}
        buckets: dict[tuple, list[str]] = {}
        for name, p in self.params.items():
            g = p.dt.grad
            if g is None:
                out[name] = distribute_tensor(torch.zeros(p.dt.shape, device=self.device),
                                              p.dt.device_mesh, p.dt.placements, src_data_rank=None)
                continue
            have, want = tuple(g.placements), tuple(p.dt.placements)
            axes = tuple(a for a in range(len(want)) if have[a] != want[a])
            if not axes:
                out[name] = settle(g)
            elif self.options.grad_buckets != "none" and all(
                    isinstance(have[a], TPartial) and isinstance(want[a], Replicate) for a in axes):
                op = name.rsplit(".", 1)[0] if self.options.grad_buckets == "op" else ""
                buckets.setdefault((p.layout.fact, axes, op), []).append(name)
            else:
                lay = Layout.from_dtensor(list(have), p.layout.fact)
                out[name] = settle(comm.redistribute(DVal(g, lay), p.layout, name, "grad_sync").dt)
        for (fact, axes, _), names in buckets.items():
            mesh = self.params[names[0]].dt.device_mesh
            locs = [settle(self.params[n].dt.grad).to_local() for n in names]
            flat = torch.cat([t.reshape(-1) for t in locs])
            for a in axes:
                t0 = time.perf_counter()
                dist.all_reduce(flat, group=mesh.get_group(a))
                comm.record("all_reduce", fact[a].size, flat.numel() * flat.element_size(),
                            fact[a].nodes > 1, time.perf_counter() - t0, "step", "grad_sync",
                            f"bucket of {len(names)}")
            offset = 0
            for n, t in zip(names, locs, strict=True):
                p = self.params[n].dt
                piece = flat[offset:offset + t.numel()].view_as(t)
                offset += t.numel()
                out[n] = DTensor.from_local(piece, p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
        return out

    def _exchange_tied(self, grads: dict[str, DTensor]) -> None:
        """Sum the gradients of a tied weight's two copies into both (module docstring)."""
        for head, emb in self.tied.items():
            a, b = self.stage_of[emb], self.stage_of[head]
            mine = self.my_stage.index
            if mine not in (a, b):
                continue
            t0 = time.perf_counter()
            total = None
            for name, transpose in ((f"{emb}.weight", False), (f"{head}.weight", True)):
                if name in self.params:
                    full = self._full(grads[name], self.params[name].layout)
                    full = full.t() if transpose else full
                    total = full if total is None else total + full
            if a != b:
                if self.rank != self.my_stage.devices[0]:
                    total = torch.zeros_like(total)
                total = total.contiguous()
                dist.all_reduce(total, group=self.registry.group(("tied", head)))
            for name, transpose in ((f"{emb}.weight", False), (f"{head}.weight", True)):
                if name in self.params:
                    p = self.params[name]
                    src = total.t().contiguous() if transpose else total
                    grads[name] = distribute_tensor(src, p.dt.device_mesh, p.dt.placements,
                                                    src_data_rank=None)
            self.recorder.add(CommEvent("mixed", len(self.my_stage.devices), total.numel() * 4,
                                        "intra", time.perf_counter() - t0, "step", "tied_weight"))

    def _full(self, t: DTensor, layout: Layout) -> torch.Tensor:
        rep = Layout.replicated(layout.fact)
        if tuple(t.placements) == tuple(rep.to_dtensor()):
            return t.to_local()
        return settle(t.redistribute(t.device_mesh, tuple(rep.to_dtensor()))).to_local()

    def _broadcast_loss(self) -> float:
        loss_stage = self.stages[self.stage_of[self._loss_op()]]
        src = loss_stage.devices[0]
        buf = torch.tensor([self.loss_sum if self.rank == src else 0.0], device=self.device,
                           dtype=torch.float64)
        dist.broadcast(buf, src=src)
        return float(buf.item())

    def _loss_op(self) -> str:
        return next(op.name for op in self.graph.ops if op.kind is OpKind.LOSS)

    # ---- results ---------------------------------------------------------------------------
    def gather_params(self) -> dict[str, torch.Tensor]:
        """Full parameters (reference names) on every rank; tied copies are not listed."""
        out = {}
        for spec in model.graph_param_specs(self.full_graph):
            owner = self.stages[self.stage_of[spec.op]]
            if self.rank in owner.devices:
                p = self.params[spec.name]
                full = self._full(p.dt.detach(), p.layout).contiguous()
            else:
                full = torch.empty(spec.shape, device=self.device, dtype=model.DTYPE)
            dist.broadcast(full, src=owner.devices[0])
            out[spec.name] = full.cpu()
        return out


def _stride(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def _inside(inner, outer) -> bool:
    return all(o0 <= a and b <= o1 for (a, b), (o0, o1) in zip(inner, outer, strict=True))


def _numel(region) -> int:
    n = 1
    for a, b in region:
        n *= b - a
    return n
