"""A pipelined plan's prices derived again from its layouts, and the check that a plan file
states what its layouts cost (:func:`check_prices`, what ``check``, ``run`` and ``explain``
run first).

Each stage (each chunk, under interleaved 1F1B) is priced as the stage solver priced it:
its ops as a graph of their own on its sub-mesh, with its boundary (the tensors it imports
and exports, the in-flight micro-batches its memory was solved for), restricted to the
file's layouts (:func:`~ilp_planner.intra_op.reprice.price_layouts`); then the assembly's
own functions add the boundary costs (a table tied across stages, the transfers' copies),
sum each stage's times and simulate the schedule over them. The cross-mesh transfers'
makespans are the file's own (their CP-SAT schedules are solved, not derived from the
layouts): what is checked is everything the layouts decide, given those."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from ilp_planner.errors import PlanFormatError
from ilp_planner.inputs.config import Config, parse_config
from ilp_planner.inter_op.assembly import (
    price_stage_boundaries,
    simulated_schedule,
    stage_costs,
    stages_cost,
)
from ilp_planner.inter_op.layer_units import subgraph
from ilp_planner.intra_op.reprice import REL_TOL, price_differences, price_layouts, reprice
from ilp_planner.lowering.stage_boundary import stage_boundary
from ilp_planner.plan.data import (
    CostBreakdown,
    LayerPlan,
    Plan,
    ReshardingEntry,
    Simulated,
    Stage,
    StageTimes,
)


@dataclasses.dataclass(frozen=True)
class StagePrices:
    """A pipelined plan priced again: its layers (boundary costs included), each stage's
    times, the cost block and the simulated schedule's figures."""

    layers: list[LayerPlan]
    times: list[StageTimes]
    cost: CostBreakdown
    simulated: Simulated | None


def reprice_stages(plan: Plan, config: Config) -> StagePrices:
    """``plan`` (pipelined, checked) priced again from its layouts under ``config``. A plan
    whose transfers carry no solved schedule (assembled by hand,
    :func:`ilp_planner.testing.pipelined_plan`) states no simulation, and none is derived."""
    if not plan.stages or plan.schedule is None:
        raise ValueError("reprice_stages takes pipelined plans (single-mesh: reprice)")
    layers, times = price_stages(config, plan.stages, plan.layers, plan.resharding)
    v = plan.schedule.virtual_stages
    simulated = None
    if all(r.transfer is not None for r in plan.resharding):
        stated = plan.schedule.simulated
        simulated = simulated_schedule(config, times, plan.resharding, v,
                                       stated.dp_objective_s if stated else 0.0).simulated
    return StagePrices(layers, times, stages_cost(times, v), simulated)


def price_stages(config: Config, stages: Sequence[Stage], stated: Sequence[LayerPlan],
                 resharding: Sequence[ReshardingEntry]
                 ) -> tuple[list[LayerPlan], list[StageTimes]]:
    """The layers of ``stages`` realised at the ``stated`` layers' layouts, each stage on
    its sub-mesh with its boundary (the in-flight count its memory was solved for, where
    its DP row says), the boundary costs added, and each stage's times."""
    graph = config.microbatch_graph()
    layers: list[LayerPlan] = []
    for st in stages:
        names = list(st.layers)
        boundary = stage_boundary(graph, names)
        held = st.dp.memory_solved_for_inflight if st.dp else None
        if held is not None:
            boundary = dataclasses.replace(boundary, inflight=held)
        priced, _ = price_layouts(config, subgraph(graph, names), st.mesh, stated, boundary)
        layers += [dataclasses.replace(ly, stage=st.index) for ly in priced]
    layers = price_stage_boundaries(graph, layers, stages, resharding, config.cluster,
                                    config.pipeline.microbatches)
    return layers, stage_costs(layers, stages, config.pipeline.microbatches)


def stage_differences(plan: Plan, prices: StagePrices) -> list[str]:
    """Where a pipelined ``plan``'s stated stage times and simulated figures differ from
    its layouts' (:func:`reprice_stages`); its layers and cost block: :func:`price_differences`."""
    out = price_differences(plan, prices.layers, prices.cost)
    for st, t in zip(plan.stages, prices.times, strict=True):
        said = st.times.to_dict() if st.times else {}
        for key, value in _flat(t.to_dict()).items():
            if not _close(_flat(said).get(key), value):
                out.append(f"stage {st.index} states {key} {_flat(said).get(key)} but its "
                           f"layers give {value:.6g}")
                break
    sim, mine = plan.schedule.simulated if plan.schedule else None, prices.simulated
    if mine is None:
        return out
    for key in ("makespan_s", "bubble_fraction", "step_s"):
        if sim is None or not _close(getattr(sim, key), getattr(mine, key)):
            out.append(f"the simulated {key} is {getattr(sim, key, None)} but its stages give "
                       f"{getattr(mine, key):.6g}")
    if sim is not None and tuple(sim.peak_inflight) != tuple(mine.peak_inflight):
        out.append(f"the simulated peak in-flight counts are {list(sim.peak_inflight)} but "
                   f"its schedule gives {list(mine.peak_inflight)}")
    return out


def _flat(d: dict, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, (int, float)):
            out[f"{prefix}{k}"] = float(v)
    return out


def _close(a: float | None, b: float) -> bool:
    return a is not None and math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-15)


def check_prices(plan: Plan, source: str) -> None:
    """Raise :class:`PlanFormatError` naming ``source`` where ``plan``'s stated figures are
    not what its layouts cost under its config (:func:`~ilp_planner.intra_op.reprice.reprice`,
    or :func:`reprice_stages` for a pipelined plan): a file edited after solving, whose
    runtime would run one program while its reports — ``explain``, ``simulate``, the audit's
    expectations, the host check — describe another."""
    config = parse_config(plan.config)
    try:
        if plan.stages:
            diffs = stage_differences(plan, reprice_stages(plan, config))
        else:
            diffs = price_differences(plan, *reprice(plan, config))
    except PlanFormatError as exc:
        raise PlanFormatError(f"{source}: {exc}") from None
    if diffs:
        raise PlanFormatError(
            f"{source}: the figures the file states are not what its layouts cost (was it "
            f"edited after solving?): {'; '.join(diffs[:6])}; re-solve the config")
