"""A plan's edge programs: for every input of every layer, the lowered redistribution the
runtime executes for it, step by step — what ``explain`` prints beside the layer.

They are derived from the plan's layouts by the same pure functions the planner priced and
the executor runs (:func:`ilp_planner.lowering.redistribution.plan_redistribution`, the stage
boundary programs of :mod:`ilp_planner.lowering.stage_boundary`), so each program's collectives are
among the layer's listed collectives (tested), and the audit counts them at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

from ilp_planner.inputs.config import Config, parse_config
from ilp_planner.ir.graph import Graph, OpKind
from ilp_planner.lowering.redistribution import Redistribution, RedistStep, plan_redistribution
from ilp_planner.lowering.shared_reads import riders
from ilp_planner.lowering.stage_boundary import export_program, import_program
from ilp_planner.lowering.strategies import input_grad_layouts
from ilp_planner.plan.data import Plan


@dataclass(frozen=True)
class EdgeProgram:
    """``program`` runs for input ``index`` of ``consumer`` (read from ``producer``);
    ``role`` is ``edge`` (same stage), ``import`` (received from an earlier stage),
    ``export`` (``consumer`` is the producer itself, sending to a later stage) or
    ``shared`` (a functional reader of a value another reader's program made —
    :mod:`ilp_planner.lowering.shared_reads` —: ``program`` is the one that ran, listed
    and priced on that reader, not again here)."""

    consumer: str
    index: int
    producer: str
    role: str
    program: Redistribution


def edge_programs(plan: Plan, config: Config | None = None,
                  graph: Graph | None = None) -> list[EdgeProgram]:
    """Every edge program of ``plan``, in layer order (``config`` and ``graph`` — its
    micro-batch graph — derived from the plan when not given)."""
    config = config or parse_config(plan.config)
    graph = graph or config.microbatch_graph()
    cluster = config.cluster
    layers = {ly.name: ly for ly in plan.layers}
    rides = riders(graph)
    out: list[EdgeProgram] = []
    for ly in plan.layers:
        op = graph[ly.name]
        grads = input_grad_layouts(op, ly.strategy, ly.inputs, ly.weight)
        for idx, src in enumerate(op.inputs):
            if graph[src].kind is OpKind.INPUT:
                continue
            tensor = graph[src].output
            if layers[src].stage != ly.stage:
                red = import_program(ly.inputs[idx], grads[idx], tensor, cluster)
                out.append(EdgeProgram(ly.name, idx, src, "import", red))
            else:
                red = plan_redistribution(layers[src].output, ly.inputs[idx], tensor, cluster,
                                          grads[idx])
                role = "shared" if (ly.name, idx) in rides else "edge"
                out.append(EdgeProgram(ly.name, idx, src, role, red))
        if any(layers[c].stage > ly.stage for c in graph.consumers(ly.name) if c in layers):
            out.append(EdgeProgram(ly.name, -1, ly.name, "export",
                                   export_program(ly.output, op.output, cluster)))
    return out


def steps_text(steps: tuple[RedistStep, ...]) -> str:
    """``S(1):4 → all_gather(p=2) → all_gather(p=2) → B:4``-style chain: the layouts at the
    ends and each step's collective (``local`` for slices and re-views)."""
    if not steps:
        return "nothing moves"
    parts = [str(steps[0].src)]
    for s in steps:
        c = s.collective
        parts.append("local" if c is None else f"{c.kind.value}(p={c.group_size}, {c.link})")
    parts.append(str(steps[-1].dst))
    return " → ".join(parts)
