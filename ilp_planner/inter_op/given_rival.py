"""The configurations the config compares against (``compare:``), offered to the planner
as rivals of its plan, so that its plan is never predicted slower than one of them.

The stage DP's space holds a compared configuration's stage layout only without
interleaving; Megatron-LM's published runs interleave (``vpp > 1``), and the planner's own
interleaved candidates cut their chunks by a min–max DP, not the engine's uniform split.
A one-mesh configuration (``pp = 1``) runs its own gradient accumulation (``B / (dp·mbs)``
micro-batches), which the one-mesh solve does not search. So the guarantee "the plan is at
least the compared configuration" is made here: each compared configuration is priced
exactly as ``--compare`` prices it (:func:`~ilp_planner.inter_op.given_price.price_alone`:
its uniform stages or chunks, or its layout on the whole cluster, by restricted intra-op
solves; a pipeline assembled and simulated like the planner's own), and where it fits the
memory budget, is what the config leaves free (:func:`out_of_space`,
:func:`mesh_out_of_space`) and is predicted faster than the planner's plan, it becomes the
plan (the report's message says so). :func:`given_if_faster` does it for pipelined
configurations (the stage DP's and the interleaved driver's pipelines), :func:`mesh_if_faster`
for one-mesh ones (any plan). The plan's step is then at most every such compared
configuration's priced step, by construction.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from formulations.schedules import INTERLEAVED
from ilp_planner.errors import InfeasibleError, PlanFormatError
from ilp_planner.inputs.config import Config, apply_overrides
from ilp_planner.inputs.given_config import GivenConfig, microbatches
from ilp_planner.inter_op.assembly import AssembledPipeline
from ilp_planner.inter_op.given_price import GivenPrice, price_alone
from ilp_planner.plan.data import Plan
from ilp_planner.plan.layer_check import check_layer_strategies


def out_of_space(config: Config, g: GivenConfig) -> str | None:
    """Why pipelined ``g`` cannot be the plan of ``config`` (None: it can): the config fixes
    what ``g`` does otherwise — its stage count, its sub-meshes, its schedule (``g`` runs
    1F1B, interleaved where ``vpp > 1``: listing it in ``compare:`` beside ``schedule:
    1f1b`` is taken as consent to its interleaving; ``interleaved-1f1b`` takes only an
    interleaved ``g``, of the config's chunk count where it fixes one), its micro-batch
    count, recomputation other than the config's policy."""
    m = microbatches(g, config.model.get("batch"))
    pipe = config.pipeline
    if g.pp < 2:
        return "not pipelined"
    if pipe.stages != "auto" and int(pipe.stages) != g.pp:
        return f"{g.pp} stages, the config's pipeline.stages is {pipe.stages}"
    if pipe.submeshes:
        return "the config fixes pipeline.submeshes"
    if pipe.schedule == INTERLEAVED:
        if g.vpp < 2:
            return f"1F1B without interleaving, the config's pipeline.schedule is {INTERLEAVED}"
        if isinstance(pipe.virtual_stages, int) and pipe.virtual_stages > 1 \
                and g.vpp != pipe.virtual_stages:
            return (f"{g.vpp} chunks a stage mesh, the config's pipeline.virtual_stages is "
                    f"{pipe.virtual_stages}")
    elif pipe.schedule != "1f1b":
        return f"1F1B, the config's pipeline.schedule is {pipe.schedule}"
    if m != config.pipeline.microbatches:
        return f"{m} micro-batches, the config's pipeline.microbatches is {config.pipeline.microbatches}"
    return _recompute_refused(config, g)


def mesh_out_of_space(config: Config, g: GivenConfig) -> str | None:
    """Why ``g`` cannot be ``config``'s plan as one mesh (None: it can): it is pipelined, or
    the config fixes what ``g`` does otherwise — pipeline stages, sub-meshes or the
    interleaved schedule, a micro-batch count written in the config (left to its default,
    the count is ``g``'s own gradient accumulation: the one-mesh solve does not search it;
    a model without a batch size — an import, which ``parallelize`` runs one micro-batch a
    step — is priced at one micro-batch only), recomputation other than the config's
    policy. A pipelined ``g`` of a pipelined config is :func:`out_of_space`'s."""
    pipe = config.pipeline
    if g.pp > 1:
        return "pipelined" if pipe.pipelined else f"{g.pp} stages, the config is not pipelined"
    if pipe.stages not in ("auto", 1):
        return f"one mesh, the config's pipeline.stages is {pipe.stages}"
    if pipe.submeshes:
        return "the config fixes pipeline.submeshes"
    if pipe.pipelined and pipe.schedule == INTERLEAVED:
        return f"one mesh, the config's pipeline.schedule is {INTERLEAVED}"
    m = microbatches(g, config.model.get("batch"))
    if m != pipe.microbatches and "microbatches" in (config.raw.get("pipeline") or {}):
        return f"{m} micro-batches, the config's pipeline.microbatches is {pipe.microbatches}"
    return _recompute_refused(config, g)


def _recompute_refused(config: Config, g: GivenConfig) -> str | None:
    """Why ``g``'s recomputation is outside the config's space (None: it is not):
    ``solver.recompute: never`` refuses any, ``always`` all but full recomputation."""
    policy = config.solver.recompute
    if (policy == "never" and g.recompute != "none") or (policy == "always"
                                                         and g.recompute != "full"):
        return f"recompute={g.recompute}, the config's solver.recompute is {policy}"
    return None


def _refused(config: Config, priced: GivenPrice) -> str | None:
    """Why a priced rival cannot be the plan (None: it can): its peak over the memory
    budget, or a layer the config's own strategies do not hold (a state sharding level or
    a weight replication the config's ``solver`` options leave out) — which ``plan check``
    would refuse, as it checks the planner's own plans."""
    if priced.cost.peak_memory_bytes > config.cluster.memory_bytes * (1 + 1e-9):
        return f"needs {priced.cost.peak_memory_bytes / 2**30:.4g} GiB a device, over the budget"
    cfg = config.with_overrides({"pipeline.microbatches": priced.microbatches})
    meshes = ([s.mesh for s in priced.pipeline.stages] if priced.pipeline is not None
              else [(config.cluster.nodes, config.cluster.devices_per_node)])
    try:
        check_layer_strategies(priced.layers, cfg.microbatch_graph(), cfg, meshes, "its plan")
    except PlanFormatError as exc:
        return f"outside the config's strategies: {exc}"
    return None


def _fastest(config: Config, own_step_s: float | None,
             space: Callable[[Config, GivenConfig], str | None], other: str
             ) -> tuple[tuple[GivenConfig, GivenPrice] | None, list[str]]:
    """The compared configuration predicted fastest among those ``space`` leaves free that
    fit and beat ``own_step_s`` (None: the planner has no plan of this kind) — or None —
    and a note for every other one (``space``'s ``other`` answer: not this kind, no note)."""
    best: tuple[GivenConfig, GivenPrice] | None = None
    notes = []
    for g in config.compare:
        why = space(config, g)
        if why == other:
            continue
        priced = None
        if why is None:
            try:
                priced = price_alone(config, g)
            except InfeasibleError as exc:
                why = f"not priced: {exc}"
        if priced is not None:
            why = _refused(config, priced)
        if why is not None or priced is None:
            notes.append(f"{g.text()} not offered as the plan ({why})")
            continue
        bar = best[1].step_s if best is not None else own_step_s
        if bar is None or priced.step_s < bar:
            if best is not None:
                notes.append(_slower(*best))
            best = (g, priced)
        else:
            notes.append(_slower(g, priced))
    return best, notes


def _slower(g: GivenConfig, priced: GivenPrice) -> str:
    """The note of a rival priced, fitting and not kept: a faster plan or rival was kept."""
    return f"{g.text()} offered as the plan: {priced.step_s:.6g} s a step, not faster"


def given_if_faster(config: Config, pipeline: AssembledPipeline | None
                    ) -> AssembledPipeline | None:
    """``pipeline`` (None: the planner found none), or the fastest pipelined compared
    configuration's pipeline (module docstring) where it simulates faster, with a note
    naming what was kept and why others were not."""
    return given_if_faster_noted(config, pipeline)[0]


def given_if_faster_noted(config: Config, pipeline: AssembledPipeline | None
                          ) -> tuple[AssembledPipeline | None, list[str]]:
    """:func:`given_if_faster` and the compared configurations' notes, which a caller left
    with no pipeline (neither the planner's nor a compared one) puts in its refusal."""
    best, notes = _fastest(config, None if pipeline is None else pipeline.step_s,
                           out_of_space, "not pipelined")
    kept = pipeline
    if best is not None:
        g, priced = best
        kept = priced.pipeline
        assert kept is not None
        v = kept.schedule.virtual_stages
        own = "none" if pipeline is None else f"{pipeline.step_s:.6g} s"
        notes.insert(0, f"the compared configuration {g.text()}: {len(kept.stages) // v} stages"
                        f"{f' × {v} chunks' if v > 1 else ''} simulate to {kept.step_s:.6g} s a "
                        f"step, the planner's pipeline {own}: kept the compared configuration")
    if not notes or kept is None:
        return kept, notes
    own_note = pipeline.note if pipeline is not None else ""
    return dataclasses.replace(kept, note="; ".join(n for n in (own_note, *notes) if n)), notes


def mesh_if_faster(config: Config, plan: Plan) -> Plan:
    """``plan``, or the fastest one-mesh compared configuration (``pp = 1``) as the plan where
    it is predicted faster — its layers and cost as priced, the config's micro-batch count
    set to its own (what ``plan check`` and the runtime read), its report that of a priced
    configuration (no bound, no stage search: the planner's solve was of another problem)
    — the report's message saying which was kept and why others were not."""
    best, notes = _fastest(config, plan.step_s, mesh_out_of_space, "pipelined")
    if best is None:
        return _with_message(plan, plan, notes)
    g, priced = best
    notes.insert(0, f"the compared configuration {g.text()} on one mesh, {priced.microbatches} "
                    f"micro-batch(es): {priced.step_s:.6g} s a step, the planner's plan "
                    f"{plan.step_s:.6g} s: kept the compared configuration")
    raw = apply_overrides(config.raw, {"pipeline.microbatches": priced.microbatches})
    report = dataclasses.replace(plan.solver, objective=priced.step_s,
                                 method=f"given configuration {g.text()}", bound=None,
                                 gap=None, stats=None, stages=None)
    kept = Plan(plan.name, raw, report, priced.cost, priced.layers, plan.baselines)
    return _with_message(kept, plan, notes)


def _with_message(plan: Plan, solved: Plan, notes: list[str]) -> Plan:
    """``plan`` with ``notes`` after the message of ``solved``'s report."""
    if not notes:
        return plan
    message = "; ".join(n for n in (solved.solver.message, *notes) if n)
    return dataclasses.replace(plan, solver=dataclasses.replace(plan.solver, message=message))
