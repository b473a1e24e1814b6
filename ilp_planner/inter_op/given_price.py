"""A configuration the user already runs (``solve --compare``, the config's ``compare:``),
priced under the planner's own model beside the plan.

Without a pipeline it is one restricted intra-op solve on the whole cluster
(:func:`~ilp_planner.intra_op.given_layout.solve_given_layout`). With ``pp`` stages the
layers split uniformly into ``pp`` stages on equal sub-meshes (the engines' default split:
the embedding with the first layers, the head with the last), each stage priced by the
same restricted solve holding its 1F1B in-flight micro-batches, the pipeline assembled and
its 1F1B schedule simulated as the planner's own pipelines are
(:func:`~ilp_planner.inter_op.assembly.assemble_pipeline`). Interleaving (``vpp > 1``) cuts
the layers into ``pp·vpp`` uniform chunks, chunk ``j`` on stage mesh ``j mod pp``, and
simulates interleaved 1F1B on the chunks' times and the priced chunk-to-chunk transfers, as
the planner prices its own interleaved candidates (:mod:`ilp_planner.inter_op.interleaved`).
The price goes into the plan's baselines block with the
configuration's TFLOP/s per GPU (model FLOPs as Megatron counts them), whether it fits
the memory budget and by how much it does not, what differs from the plan, and the
engine's flags.

A solve prices each compared configuration once: as a rival of the plan
(:mod:`~ilp_planner.inter_op.given_rival`) and beside it are one pricing, shared within
:func:`priced_once` (``api.solve`` and the published-runs benchmark open it).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

from formulations.schedules import inflight_interleaved, inflight_microbatches
from formulations.stage_dp import StageChoice, pack_submeshes
from ilp_planner.errors import InfeasibleError
from ilp_planner.inputs.config import Config
from ilp_planner.inputs.given_config import (
    GivenConfig,
    engine_flags,
    microbatches,
    recomputed_blocks,
    stage_shape,
)
from ilp_planner.inter_op.assembly import (
    AssembledPipeline,
    SolvedStage,
    assemble_pipeline,
    pipeline_cost,
)
from ilp_planner.inter_op.layer_units import RangeKeys, layer_units, subgraph
from ilp_planner.inter_op.stage_solver import pipeline_latency
from ilp_planner.intra_op.given_layout import GivenLayout, solve_given_layout
from ilp_planner.intra_op.problem import BuildCache, held_activations, peak_memory
from ilp_planner.intra_op.realise import realise
from ilp_planner.ir.graph import Graph
from ilp_planner.lowering.stage_boundary import stage_boundary
from ilp_planner.plan.data import CostBreakdown, LayerPlan, Plan, SolverReport

GIB = 2**30


def interleaved_inflight(num_stages: int, rank: int, num_microbatches: int, chunks: int) -> float:
    """Micro-batches' worth of activations pipeline rank ``rank`` holds at its peak under
    Megatron's interleaved 1F1B: its warm-up runs ``(p − rank − 1)·2 + (v − 1)·p`` forward
    micro-chunks (all ``m·v`` when ``m = p``; Megatron-LM's
    ``forward_backward_pipelining_with_interleaving``), one more starts before the first
    backward, and each holds the activations of ``1/v`` of the rank's layers."""
    p, m, v = num_stages, num_microbatches, chunks
    total = m * v
    warmup = total if m == p else min((p - rank - 1) * 2 + (v - 1) * p, total)
    return min(warmup + 1, total) / v


def model_flops(config: Config, recomputed: int) -> float:
    """FLOPs of one step as the engines count them, recomputation included. For a GPT:
    Megatron's ``24·B·s·l·h²·(3 + r)·(1 + s/6h) + 6·B·s·h·V`` with ``r`` the share of the
    ``l`` layers recomputed — ``96·B·s·l·h²·(1 + s/6h + V/16lh)`` with full recomputation
    (Narayanan et al., SC'21, Appendix), ``72·…`` without. Another model: three times its
    forward FLOPs (backward ≈ 2 × forward) plus the forward of ``recomputed`` of its
    blocks (a block's share of the blocks' FLOPs)."""
    m, graph = config.model, config.graph
    if m.get("kind") == "gpt":
        B, s, h, V, L = (int(m[k]) for k in ("batch", "seq_len", "hidden", "vocab", "layers"))
        r = recomputed / L
        return 24.0 * B * s * L * h * h * (3 + r) * (1 + s / (6 * h)) + 6.0 * B * s * h * V
    blocks = graph.blocks()
    block_flops = sum(op.flops for op in graph.ops if op.block is not None)
    return 3 * graph.forward_flops + (block_flops * recomputed / len(blocks) if blocks else 0.0)


def price_given(config: Config, g: GivenConfig, plan: Plan) -> dict[str, dict]:
    """``g`` (resolved for ``config``) priced beside ``plan``: its baselines entry, a cost
    breakdown (``pipeline_s`` the step when pipelined) with a ``given`` block (module
    docstring), or the reason it cannot be priced."""
    try:
        priced = price_alone(config, g)
    except InfeasibleError as exc:
        return {g.label(): {"error": str(exc)}}
    block = {**priced.cost.to_dict(), **({"pipeline_s": priced.step_s} if g.pp > 1 else {})}
    block["given"] = _given_block(config, g, plan, priced.layers, priced.cost, priced.step_s,
                                  priced.microbatches)
    return {g.label(): block}


@dataclasses.dataclass(frozen=True)
class GivenPrice:
    """A configuration's price without a plan beside it: its layers as priced, the cost
    breakdown (the busiest stage's where pipelined), the step, the micro-batch count and,
    pipelined, the whole pipeline (a plan the planner may keep:
    :mod:`~ilp_planner.inter_op.given_rival`)."""

    layers: list[LayerPlan]
    cost: CostBreakdown
    step_s: float
    microbatches: int
    pipeline: AssembledPipeline | None = None


# (config without compare:, configuration) -> its price or why it has none, while open
_PRICED: ContextVar[dict[tuple[str, GivenConfig], GivenPrice | InfeasibleError] | None] = \
    ContextVar("given_prices", default=None)


@contextmanager
def priced_once() -> Iterator[None]:
    """Within it, :func:`price_alone` prices each (config, configuration) pair once: the
    rival of the plan and its price beside the plan are the same pricing (restricted ILPs
    on every stage: seconds to minutes on the published rows). Nested scopes share the
    outermost's prices; outside any scope nothing is kept."""
    token = _PRICED.set({}) if _PRICED.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _PRICED.reset(token)


def price_alone(config: Config, g: GivenConfig) -> GivenPrice:
    """``g`` priced under the planner's model (module docstring) — what :func:`price_given`
    sets beside a plan, for a caller that has none (``benchmarks/published_runs.py``
    prices published runs whose own plan is too large to solve on every machine); within
    :func:`priced_once` the price of an earlier call for the same config (its ``compare:``
    aside) and configuration. Raises :class:`InfeasibleError` where it cannot be priced."""
    prices = _PRICED.get()
    key = (json.dumps({k: v for k, v in config.raw.items() if k != "compare"}, sort_keys=True,
                      default=str), g)
    if prices is None or key not in prices:
        try:
            priced: GivenPrice | InfeasibleError = _price(config, g)
        except InfeasibleError as exc:
            priced = exc
        if prices is not None:
            prices[key] = priced
    else:
        priced = prices[key]
    if isinstance(priced, InfeasibleError):
        raise priced
    return priced


def _price(config: Config, g: GivenConfig) -> GivenPrice:
    """:func:`price_alone`'s pricing itself, uncached."""
    m, cfg = _priced_config(config, g)
    graph = cfg.microbatch_graph()
    if g.pp == 1:
        layout = solve_given_layout(g, cfg, graph, (cfg.cluster.nodes, cfg.cluster.devices_per_node), m)
        layers, cost = realise(layout.gp, layout.choice)
        return GivenPrice(layers, cost, cost.total_s, m)
    pipeline = _given_pipeline(g, cfg, graph, m)
    return GivenPrice(pipeline.layers, pipeline_cost(pipeline), pipeline.step_s, m, pipeline)


def _priced_config(config: Config, g: GivenConfig) -> tuple[int, Config]:
    """``g``'s micro-batch count and ``config`` set to run ``g``'s stages under 1F1B."""
    m = microbatches(g, config.model.get("batch"))
    return m, config.with_overrides({"pipeline.microbatches": m, "pipeline.stages": g.pp,
                                     "pipeline.schedule": "1f1b", "pipeline.virtual_stages": 1,
                                     "pipeline.submeshes": None, "compare": None})


def _given_pipeline(g: GivenConfig, cfg: Config, graph: Graph, m: int) -> AssembledPipeline:
    """``g``'s ``pp`` stages (module docstring) — ``pp·vpp`` chunks when interleaved, chunk
    ``j`` on mesh ``j mod pp`` — assembled and simulated as the planner's own pipelines are
    (:func:`~ilp_planner.inter_op.assembly.assemble_pipeline`: the boundary transfers
    resharded and priced, 1F1B or interleaved 1F1B simulated per chunk). Chunks of one
    signature class (the middle ones of a uniform split) share one solve: without a memory
    budget the choice does not depend on the in-flight count, only the peak does, and that
    is computed per mesh (:func:`_mesh_peaks`)."""
    cluster = cfg.cluster
    units = layer_units(graph)
    keys = RangeKeys(graph, units)
    shape = stage_shape(g, cluster.nodes, cluster.devices_per_node)
    meshes = pack_submeshes([shape] * g.pp, cluster.nodes, cluster.devices_per_node)
    chunks = g.pp * g.vpp
    per = len(units) // chunks
    cache = BuildCache()
    solved: dict[tuple, tuple] = {}
    rows = []
    for j in range(chunks):
        a, e = j * per, (j + 1) * per
        names = [n for u in units[a:e] for n in u]
        if keys.key(a, e) not in solved:
            layout = solve_given_layout(g, cfg, subgraph(graph, names), shape, m,
                                        stage_boundary(graph, names), cache)
            solved[keys.key(a, e)] = (layout, *realise(layout.gp, layout.choice))
        rows.append((a, e, names, *solved[keys.key(a, e)]))
    peaks = _mesh_peaks(g, m, [row[3] for row in rows])
    times = [cost.total_s / m for *_, cost in rows]
    stages = []
    for j, (a, e, names, _layout, layers, cost) in enumerate(rows):
        r = j % g.pp
        held = (inflight_microbatches("1f1b", g.pp - r, m) if g.vpp == 1
                else inflight_interleaved(g.pp, r, m, g.vpp))
        choice = StageChoice(a, e, shape, times[j], times[j], 0.0, peaks[r], held, meshes[r])
        report = SolverReport("optimal", cost.total_s, f"given configuration {g.text()}")
        stages.append(SolvedStage(choice, names, layers, report, held))
    per_mesh = [sum(times[r::g.pp]) for r in range(g.pp)]  # the stage DP's formula, reported
    return assemble_pipeline(cfg, graph, stages, pipeline_latency(per_mesh, m),
                             virtual_stages=g.vpp)


def _mesh_peaks(g: GivenConfig, m: int, chunks: Sequence[GivenLayout]) -> list[float]:
    """Per mesh the bytes at its peak: its chunks' peaks holding one micro-batch each plus
    the activations the engine's schedule keeps in flight beyond that — 1F1B's warm-up, or
    Megatron's interleaved warm-up (:func:`interleaved_inflight`, in micro-batches of the
    mesh's layers) times the mesh's chunks' held activations together."""
    peaks = []
    for r in range(g.pp):
        mine = chunks[r::g.pp]
        held = (inflight_microbatches("1f1b", g.pp - r, m) if g.vpp == 1
                else interleaved_inflight(g.pp, r, m, g.vpp))
        ats = [(dataclasses.replace(lay.gp, boundary=dataclasses.replace(lay.gp.boundary,
                                                                         inflight=1)), lay.choice)
               for lay in mine]
        peaks.append(sum(peak_memory(at, c) for at, c in ats)
                     + (held - 1) * sum(held_activations(at, c) for at, c in ats))
    return peaks


def _given_block(config: Config, g: GivenConfig, plan: Plan, layers: Sequence[LayerPlan],
                 cost: CostBreakdown, step: float, m: int) -> dict:
    """What the reports print beside the priced configuration."""
    devices = config.cluster.num_devices
    budget = config.cluster.memory_bytes
    recomputed = len(recomputed_blocks(g, config.graph))
    flops = model_flops(config, recomputed)
    plan_flops = model_flops(config, _plan_recomputed(config.graph, plan))
    notes = []
    if g.engine == "megatron" and g.recompute == "selective":
        notes.append("Megatron's selective recomputation (core attention) is not a recompute "
                     "unit of the planner: priced without recomputation")
    if g.zero:
        notes.append(f"{'FSDP' if g.fsdp else 'the distributed optimizer'} as ZeRO-{g.zero} "
                     f"wherever the planner offers it; ops without such a strategy keep "
                     f"replicated state")
    if g.vpp > 1:
        notes.append(f"interleaving simulated on {g.pp * g.vpp} chunks with their "
                     f"stage-to-stage transfers (the closed form's bubble (p-1)/(v*m) = "
                     f"{(g.pp - 1) / (g.vpp * m):.1%} leaves the transfers out)")
    return {
        "text": g.text(),
        "flags": engine_flags(g, config.model.get("batch"), len(config.graph.blocks())),
        "step_s": step,
        "tflops_per_gpu": flops / step / devices / 1e12 if step else 0.0,
        "plan_tflops_per_gpu": plan_flops / plan.step_s / devices / 1e12 if plan.step_s else 0.0,
        "speedup": step / plan.step_s if plan.step_s else 0.0,
        "fits": cost.peak_memory_bytes <= budget * (1 + 1e-9),
        "peak_memory_bytes": cost.peak_memory_bytes,
        "budget_bytes": budget,
        "differs": differences(config, g, plan, layers, m),
        "notes": notes,
    }


def _plan_recomputed(graph: Graph, plan: Plan) -> int:
    """How many blocks the plan recomputes."""
    return len({(graph[ly.name].block, graph[ly.name].block_index) for ly in plan.layers
                if ly.recompute and graph[ly.name].block is not None})


def family(name: str) -> str:
    """A layer family: the op name with its block index starred (``h.3.mlp.fc1`` →
    ``h.*.mlp.fc1``)."""
    return re.sub(r"(^|\.)\d+(\.|$)", r"\1*\2", name)


def _families(layers: Sequence[LayerPlan]) -> dict[str, str]:
    """Per layer family its most common deciding strategy (state sharding and
    recomputation marked)."""
    seen: dict[str, Counter] = {}
    for ly in layers:
        if ly.strategy.startswith("follows"):
            continue
        text = ly.strategy + (" recomputed" if ly.recompute else "")
        seen.setdefault(family(ly.name), Counter())[text] += 1
    return {f: c.most_common(1)[0][0] for f, c in seen.items()}


def differences(config: Config, g: GivenConfig, plan: Plan, layers: Sequence[LayerPlan],
                m: int, most: int = 6) -> list[str]:
    """What the plan does otherwise than ``g``: stages, micro-batches (a one-mesh plan's as
    its own config says: a kept compared configuration sets its own), recomputed blocks,
    and the layout of each layer family where the two differ (at most ``most`` families)."""
    out = []
    v = plan.schedule.virtual_stages if plan.schedule else 1
    stages = max(1, len(plan.stages) // v)
    if (stages, v) != (g.pp, g.vpp):
        out.append(f"stages: plan {stages}" + (f" x {v} chunks" if v > 1 else "")
                   + f", given {g.pp}" + (f" x {g.vpp} chunks" if g.vpp > 1 else ""))
    plan_m = plan.schedule.num_microbatches if plan.schedule else \
        (plan.config.get("pipeline") or {}).get("microbatches", config.pipeline.microbatches)
    if plan_m != m:
        out.append(f"micro-batches: plan {plan_m}, given {m}")
    mine, given = _plan_recomputed(config.graph, plan), len(recomputed_blocks(g, config.graph))
    if mine != given:
        out.append(f"recomputed blocks: plan {mine}, given {given}")
    a, b = _families(plan.layers), _families(layers)
    fams = [f for f in a if f in b and a[f] != b[f]]
    out += [f"{f}: plan {a[f]}, given {b[f]}" for f in fams[:most]]
    if len(fams) > most:
        out.append(f"+{len(fams) - most} more layer families")
    return out
