"""A pipeline assembled from its stage plans as it runs: the layers renamed into the full
graph and tagged with their stages, the crossing tensors resharded
(:mod:`ilp_planner.inter_op.stage_resharding`), the stage boundaries checked and priced,
each stage's forward and backward priced, and the schedule simulated."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

from formulations.schedules import INTERLEAVED, make_schedule
from formulations.simulator import StageDurations, simulate
from formulations.stage_dp import StageChoice
from ilp_planner.errors import InfeasibleError
from ilp_planner.inputs.config import Config
from ilp_planner.inter_op.stage_resharding import plan_stage_resharding
from ilp_planner.inter_op.transfer_passes import transfer_passes_seconds
from ilp_planner.ir.cluster import Cluster
from ilp_planner.ir.graph import Graph, OpKind, TensorSpec
from ilp_planner.ir.layouts import Layout
from ilp_planner.lowering.cost_model import ONCE_PER_STEP, Collective, CollectiveKind, make_collective
from ilp_planner.lowering.grad_buckets import exposed_grad_sync
from ilp_planner.lowering.redistribution import plan_redistribution
from ilp_planner.lowering.strategies import (
    cross_stage_tied_passes_seconds,
    tie_transposes,
    tied_source,
)
from ilp_planner.plan.check import find_entry
from ilp_planner.plan.data import (
    CostBreakdown,
    LayerPlan,
    PipelineSchedule,
    Plan,
    ReshardingEntry,
    Simulated,
    SolverReport,
    Stage,
    StageDP,
    StageTimes,
)
from ilp_planner.plan.layer_check import FOLLOWS


@dataclass(frozen=True)
class SolvedStage:
    """One stage of a pipeline to assemble: where it runs (``choice``), its layers' names in
    the full graph, its layer plans (under the names of the range they were solved for, in
    the same order), the solver's report, and the in-flight count its memory was solved for."""

    choice: StageChoice
    names: list[str]
    layers: list[LayerPlan]
    solver: SolverReport
    solved_for: int | None


@dataclass(frozen=True)
class AssembledPipeline:
    """A pipeline as the plan stores it: its layers tagged with their stages, the stage
    rows, the cross-mesh resharding entries, and the simulated schedule."""

    layers: list[LayerPlan]
    stages: list[Stage]
    resharding: list[ReshardingEntry]
    schedule: PipelineSchedule
    resharding_s: float
    note: str = ""

    @property
    def step_s(self) -> float:
        assert self.schedule.simulated is not None
        return self.schedule.simulated.step_s


def assemble_pipeline(config: Config, graph: Graph, plans: Sequence[SolvedStage],
                      dp_objective_s: float, reshardings: dict | None = None,
                      virtual_stages: int = 1) -> AssembledPipeline:
    """The pipeline of ``plans`` as it runs: resharding solved for every crossing tensor,
    the stage boundaries checked and priced, each stage's forward and backward per
    micro-batch, and the schedule simulated (``step_s``: makespan + the exposed gradient
    synchronisation tail). The planner's plan and the pipelined grid baseline both come
    from here, so their steps compare like for like; ``reshardings`` carries the solved
    resharding schedules from one assembly to the next (pipelines on the same meshes share
    their crossings). ``virtual_stages`` > 1: ``plans`` are the chunks of an interleaved
    pipeline (chunk ``j`` on the mesh of ``plans[j mod p]``), simulated as such."""
    pipe = config.pipeline
    layers: list[LayerPlan] = []
    stages: list[Stage] = []
    stage_of: dict[str, int] = {}
    out_layout: dict[str, Layout] = {}
    in_layouts: dict[tuple[str, str], Layout] = {}
    for i, sp in enumerate(plans):
        st = sp.choice
        rename = dict(zip((ly.name for ly in sp.layers), sp.names, strict=True))
        for ly in sp.layers:
            name = rename[ly.name]
            stage_of[name] = i
            out_layout[name] = ly.output
            for src, lay in zip(graph[name].inputs, ly.inputs, strict=True):
                in_layouts[(src, name)] = lay
            layers.append(_renamed(ly, name, i, rename))
        stages.append(Stage(
            i, tuple(st.placement.device_ids() if st.placement else ()), st.submesh,
            tuple(sp.names),
            StageDP(str(st.placement), (st.start, st.end), st.time_s, st.boundary_time_s,
                    st.memory_bytes, st.inflight_microbatches, sp.solved_for, sp.solver)))
    t0 = time.perf_counter()
    resharding = plan_stage_resharding(config, graph, [sp.choice.placement for sp in plans],
                                  stage_of, out_layout, in_layouts,
                                  {} if reshardings is None else reshardings)
    resharding_s = time.perf_counter() - t0
    layers = price_stage_boundaries(graph, layers, stages, resharding, config.cluster,
                                    pipe.microbatches)
    times = stage_costs(layers, stages, pipe.microbatches)
    stages = [dataclasses.replace(s, times=t) for s, t in zip(stages, times, strict=True)]
    schedule = simulated_schedule(config, times, resharding, virtual_stages, dp_objective_s)
    return AssembledPipeline(layers, stages, resharding, schedule, resharding_s)


def simulated_schedule(config: Config, times: Sequence[StageTimes],
                       resharding: Sequence[ReshardingEntry], virtual_stages: int,
                       dp_objective_s: float) -> PipelineSchedule:
    """The config's schedule over stages priced ``times`` (chunks, under interleaved 1F1B)
    with the ``resharding`` entries' transfers between them, simulated."""
    pipe = config.pipeline
    name = INTERLEAVED if virtual_stages > 1 else pipe.schedule
    sched = make_schedule(name, len(times) // virtual_stages, pipe.microbatches,
                          virtual_stages=virtual_stages)
    sim = simulate(sched, stage_durations(times, resharding), overlap=pipe.overlap)
    return PipelineSchedule(
        name, pipe.microbatches, tuple(tuple(row) for row in sched.to_strings()),
        Simulated(sim.makespan_s, sim.bubble_fraction, tuple(sim.peak_inflight), pipe.overlap,
                  dp_objective_s, sim.makespan_s + _exposed_tail(times, virtual_stages)),
        virtual_stages)


def _exposed_tail(times: Sequence[StageTimes], virtual_stages: int) -> float:
    """The step's exposed gradient-synchronisation tail: the largest per mesh (under
    interleaved 1F1B a mesh's chunks synchronise one after the other)."""
    p = len(times) // virtual_stages
    return max(sum(t.grad_sync_exposed_s for t in times[r::p]) for r in range(p))


def pipeline_plan(config: Config, pipeline: AssembledPipeline, report: SolverReport) -> Plan:
    """The plan of ``pipeline``, its cost :func:`pipeline_cost`."""
    return Plan(config.name, config.raw, report, pipeline_cost(pipeline), pipeline.layers,
                stages=pipeline.stages, schedule=pipeline.schedule,
                resharding=pipeline.resharding)


def pipeline_cost(pipeline: AssembledPipeline) -> CostBreakdown:
    """A pipeline's cost breakdown: its busiest stage mesh's (under interleaved 1F1B a
    mesh's chunks summed: its devices run them all), with the largest peak of any chunk —
    one figure for the plan and for a compared configuration's pipeline, so their rows
    compare like with like."""
    return stages_cost([s.times for s in pipeline.stages if s.times is not None],
                       pipeline.schedule.virtual_stages)


def stages_cost(times: Sequence[StageTimes], virtual_stages: int) -> CostBreakdown:
    """:func:`pipeline_cost` of stages (chunks, under interleaved 1F1B) priced ``times``."""
    per_chunk = [t.cost for t in times]
    p = len(per_chunk) // virtual_stages
    summed = [f.name for f in dataclasses.fields(CostBreakdown) if f.name != "peak_memory_bytes"]
    per_mesh = [dataclasses.replace(per_chunk[r], **{f: sum(getattr(c, f) for c in per_chunk[r::p])
                                                     for f in summed}) for r in range(p)]
    busiest = max(per_mesh, key=lambda c: c.total_s)
    return dataclasses.replace(busiest, peak_memory_bytes=max(c.peak_memory_bytes
                                                              for c in per_chunk))


def _renamed(layer: LayerPlan, name: str, stage: int, rename: dict[str, str]) -> LayerPlan:
    """A stage's LayerPlan under its name in the full graph, tagged with its stage; a
    follower's label names its producer in the full graph too (a range solved once serves
    its signature-equal twins)."""
    strategy = layer.strategy
    if strategy.startswith(FOLLOWS):
        strategy = FOLLOWS + rename[strategy[len(FOLLOWS):]]
    return dataclasses.replace(layer, name=name, stage=stage, strategy=strategy)


def stage_costs(layers: Sequence[LayerPlan], stages: Sequence[Stage], microbatches: int
                ) -> list[StageTimes]:
    """Per stage, what its layers price (boundary programs and tied exchanges included):
    per micro-batch ``forward_s`` (a third of the compute, backward ≈ 2 × forward FLOPs,
    plus the forward-phase activation collectives) and ``backward_s``; per step
    ``grad_sync_s`` (and its exposed part) and the stage's :class:`CostBreakdown` (memory
    from the stage's DP row when present, else its layers')."""
    out = []
    for s in stages:
        mine = [ly for ly in layers if ly.stage == s.index]
        compute = sum(ly.compute_s for ly in mine)
        colls = [c for ly in mine for c in ly.collectives]
        act = [c for c in colls if c.purpose not in ONCE_PER_STEP]
        memory = s.dp.memory_bytes if s.dp else sum(ly.memory_bytes for ly in mine)
        exposed = exposed_grad_sync(mine)
        out.append(StageTimes(
            compute / 3 + sum(c.seconds for c in act if c.phase == "forward"),
            2 * compute / 3 + sum(c.seconds for c in act if c.phase != "forward"),
            sum(c.seconds for c in colls if c.purpose in ONCE_PER_STEP), exposed,
            CostBreakdown.of(compute, colls, memory, microbatches, exposed)))
    return out


def stage_durations(stages: Sequence[StageTimes], resharding: Sequence[ReshardingEntry]
                    ) -> StageDurations:
    """Simulator durations of a pipelined plan: each stage's priced forward and backward
    per micro-batch (:func:`stage_costs`); each boundary's transfers are the solved
    resharding makespans of the tensors entering the next stage, forward (``tasks``) and
    backward (``backward_tasks``); a skip edge from an earlier stage is charged to the
    boundary just before its destination."""
    S = len(stages)
    forward, backward = [0.0] * (S - 1), [0.0] * (S - 1)
    for r in resharding:
        assert r.transfer is not None, "a solved pipeline's entries carry their transfers"
        forward[r.dst_stage - 1] += r.transfer.makespan_s
        backward[r.dst_stage - 1] += r.transfer.backward_makespan_s
    return StageDurations.make(S, [s.forward_s for s in stages], [s.backward_s for s in stages],
                               activation_transfer=forward, gradient_transfer=backward)


def cross_stage_tied_collectives(layout: Layout, table: TensorSpec, ranks: Sequence[int],
                                 cluster: Cluster, head: bool, devices: int
                                 ) -> tuple[list[Collective], float]:
    """One side of a tied table's gradient exchange across two stages, as the runtime runs
    it: the copy's gradient gathered to replicated within its stage (lowered program), then
    one AllReduce of the full table over both stages' ranks, in the master dtype (``table``
    is in it: the embedding's :attr:`~ilp_planner.ir.graph.Op.master_spec`, seen from the
    side) — with the seconds of the gather's slices' copies and of the runtime's passes
    around it (:func:`~ilp_planner.lowering.strategies.cross_stage_tied_passes_seconds`;
    ``head``: the side seeing the table transposed, ``devices``: its stage's)."""
    gather = plan_redistribution(layout, Layout.replicated(layout.fact), table, cluster)
    spans = len({r // cluster.devices_per_node for r in ranks}) > 1
    colls = [c.with_phase("step", "tied_weight") for c in gather.forward] + [
        make_collective(CollectiveKind.ALL_REDUCE, len(ranks), table.nbytes, cluster, spans,
                        phase="step", purpose="tied_weight")]
    return colls, gather.local_forward_s + cross_stage_tied_passes_seconds(
        layout, table, head, devices, cluster)


def price_stage_boundaries(graph: Graph, layers: list[LayerPlan], stages: Sequence[Stage],
                           resharding: Sequence[ReshardingEntry], cluster: Cluster,
                           microbatches: int) -> list[LayerPlan]:
    """Check that every edge crossing stages has a resharding entry delivering exactly the
    layout its consumer reads (the stage's own export and import programs are already on
    its layers, :mod:`ilp_planner.lowering.stage_boundary`), and add the one boundary cost no stage
    ILP can see: the gradient exchange of a table tied across two stages — its collectives,
    and its local passes in ``compute_s``, once a step spread over its ``microbatches`` (as
    :func:`~ilp_planner.intra_op.realise.realise` spreads the exchange on one stage) — and
    the cross-mesh transfers' own copies each micro-batch
    (:func:`~ilp_planner.inter_op.transfer_passes.transfer_passes_seconds`), on the producer's
    stage and the consumer's (their broadcasts are the resharding makespans)."""
    by_name = {ly.name: ly for ly in layers}
    stage_of = {ly.name: ly.stage for ly in layers}
    rows = [(e.tensor, e.consumer, e.dst_stage, e.dst_layout) for e in resharding]
    extra: dict[str, list[Collective]] = {ly.name: [] for ly in layers}
    local = dict.fromkeys(extra, 0.0)
    for op in graph.ops:
        if op.name not in by_name:
            continue
        ly = by_name[op.name]
        for idx, src in enumerate(op.inputs):
            if graph[src].kind is OpKind.INPUT or stage_of[src] == ly.stage:
                continue
            if find_entry(rows, src, op.name, ly.stage, ly.inputs[idx]) is None:
                raise InfeasibleError(f"edge {src} -> {op.name} crosses stages without a "
                                      f"resharding entry delivering {ly.inputs[idx]}")
        emb = tied_source(graph, op) if op.attrs.get("tied") else None
        if emb is not None and stage_of[emb.name] != ly.stage:
            assert emb.weight is not None
            ranks = [d for n in (emb.name, op.name) for d in stages[stage_of[n]].devices]
            seen = emb.weight.shape[::-1] if tie_transposes(op) else emb.weight.shape
            master = emb.master_spec
            for name, table in ((emb.name, master), (op.name, TensorSpec(seen, master.dtype))):
                weight = by_name[name].weight
                assert weight is not None
                colls, seconds = cross_stage_tied_collectives(
                    weight, table, ranks, cluster, name == op.name,
                    len(stages[stage_of[name]].devices))
                extra[name] += colls
                local[name] += seconds / microbatches
    for e in resharding:  # the transfers' own copies, each micro-batch, on both stages
        local[e.tensor] += transfer_passes_seconds(e, stages, e.src_stage, cluster)
        local[e.consumer] += transfer_passes_seconds(e, stages, e.dst_stage, cluster)
    return [dataclasses.replace(ly, collectives=ly.collectives + tuple(extra[ly.name]),
                                compute_s=ly.compute_s + local[ly.name])
            for ly in layers]
