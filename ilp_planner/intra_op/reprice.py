"""A plan's prices derived again from its layouts: what ``ilp-planner check`` sets against
the figures the file states.

A plan file states, beside each layer's layouts, the collectives, compute seconds and memory
they cost, and a cost block over them. The runtime reads only the layouts (and checks the
gradient reductions it issues against the listed ones); ``explain``, ``simulate``, the audit's
expectations and the host-memory check read the stated figures. A file edited by hand —
one layer's layouts changed, a collective's seconds, the cost block — would therefore run
one program and report another. :func:`reprice` prices a single-mesh plan's layouts again
under its own config, through the planner's own problem restricted to exactly those
layouts and :func:`~ilp_planner.intra_op.realise.realise` (the function that wrote them), and
:func:`price_differences` says where the file disagrees.

A pipelined plan's stages are priced by the same function, each with its boundary
(:mod:`ilp_planner.inter_op.reprice_stages`, which also holds :func:`check_prices`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from ilp_planner.errors import PlanFormatError
from ilp_planner.inputs.config import Config
from ilp_planner.intra_op.problem import GraphProblem, build_problem
from ilp_planner.intra_op.realise import realise
from ilp_planner.ir.graph import Graph, Op
from ilp_planner.lowering.stage_boundary import StageBoundary
from ilp_planner.lowering.strategies import Strategy
from ilp_planner.plan.data import CostBreakdown, LayerPlan, Plan

REL_TOL = 1e-6
"""Relative tolerance on seconds and bytes figures (the file's JSON round trip keeps floats
exact; sums taken in another order may differ in the last bits)."""


def reprice(plan: Plan, config: Config) -> tuple[list[LayerPlan], CostBreakdown]:
    """The layers and cost of ``plan`` (a single-mesh plan, checked) priced again from its
    layouts, ZeRO levels and recomputed layers under ``config``."""
    if plan.stages:
        raise ValueError("reprice takes single-mesh plans (pipelined: reprice_stages)")
    cl = config.cluster
    return price_layouts(config, config.microbatch_graph(), (cl.nodes, cl.devices_per_node),
                         plan.layers)


def price_layouts(config: Config, graph: Graph, mesh: tuple[int, int],
                  stated: Sequence[LayerPlan], boundary: StageBoundary | None = None
                  ) -> tuple[list[LayerPlan], CostBreakdown]:
    """``graph``'s ops (the whole model, or a stage's with its ``boundary``) on ``mesh``
    realised at the layouts, ZeRO levels and recomputation the ``stated`` layers name —
    the planner's own problem restricted to exactly those, untied (a hand-edited block
    need not match its twins)."""
    layers = {ly.name: ly for ly in stated}
    # the build shares one option list among the copies of a repeated op, filtered once:
    # keep what any op of the same signature has in the plan (each node picks its own)
    allowed: dict[tuple, set[tuple]] = {}
    for op in graph.ops:
        if op.name in layers:
            ly = layers[op.name]
            allowed.setdefault(_signature(graph, op), set()).add(
                (ly.strategy, ly.zero, ly.inputs, ly.weight, ly.output))

    def keep(op: Op, s: Strategy) -> bool:
        return (s.label, s.zero, s.inputs, s.weight, s.output) in allowed.get(
            _signature(graph, op), ())

    blocks = frozenset((op.block, op.block_index) for op in graph.ops
                       if op.name in layers and layers[op.name].recompute
                       and op.block is not None and op.block_index is not None)
    try:
        gp = build_problem(graph, config.cluster, mesh[0], mesh[1], config.memory,
                           tie_layers=False, microbatches=config.pipeline.microbatches,
                           boundary=boundary, grad_bucket_bytes=config.grad_bucket_bytes,
                           zero_levels=tuple(config.solver.state_sharding),
                           recompute=blocks, keep=keep)
    except ValueError as exc:
        raise PlanFormatError(f"its layouts cannot be priced: {exc}") from None
    return realise(gp, _choice(gp, layers))


def _signature(graph: Graph, op: Op) -> tuple:
    """What decides an op's strategies: its kind, shapes and attributes."""
    return (op.kind, op.output, op.weight, tuple(graph[i].output for i in op.inputs),
            tuple(sorted(op.attrs.items())))


def _choice(gp: GraphProblem, layers: dict[str, LayerPlan]) -> list[int]:
    """Per group, the option whose every op has the plan's layouts and recomputation."""
    choice = []
    for group in gp.groups:
        n = len(gp.options[group[0]])
        fits = [k for k in range(n) if all(
            _same(gp.options[node][k], pos, layers[op])
            for node in group for pos, op in enumerate(gp.members[node]))]
        if not fits:
            name = gp.members[group[0]][0]
            raise PlanFormatError(
                f"layer {name!r}: no strategy of the planner gives it (and the layers its node "
                f"fuses: {', '.join(gp.members[group[0]][1:]) or 'none'}) its layouts and "
                f"recomputation; the file was edited after solving: re-solve the config")
        choice.append(fits[0])
    return choice


def _same(opt, pos: int, ly: LayerPlan) -> bool:
    """Whether op ``pos`` of option ``opt`` is layer ``ly``: layouts, recomputation and (the
    node's own op) its state sharding level."""
    return (opt.outputs[pos] == ly.output and tuple(opt.inputs[pos]) == tuple(ly.inputs)
            and opt.recompute == ly.recompute and (pos or opt.base.zero == ly.zero))


def price_differences(plan: Plan, layers: list[LayerPlan], cost: CostBreakdown,
                      shown: int = 3) -> list[str]:
    """Where ``plan``'s stated figures differ from ``layers`` and ``cost`` (its layouts
    priced again, :func:`reprice`): per layer its collectives (kind, purpose, phase, group,
    bytes, link and seconds), compute seconds and memory, then the cost block; at most
    ``shown`` layers named."""
    out = []
    mine = {ly.name: ly for ly in plan.layers}
    for ly in layers:
        stated = mine[ly.name]
        said, derived = _collectives(stated), _collectives(ly)
        if not _close_rows(said, derived):
            out.append(f"layer {ly.name!r} lists collectives {_brief(said)} but its layouts "
                       f"give {_brief(derived)}")
        elif not _close(stated.compute_s, ly.compute_s):
            out.append(f"layer {ly.name!r} states compute {stated.compute_s:.6g} s but its "
                       f"layouts give {ly.compute_s:.6g} s")
        elif not _close(stated.memory_bytes, ly.memory_bytes):
            out.append(f"layer {ly.name!r} states memory {stated.memory_bytes:.6g} B but its "
                       f"layouts give {ly.memory_bytes:.6g} B")
    out = out[:shown] + ([f"… {len(out) - shown} more layers"] if len(out) > shown else [])
    fields = ("compute_s", "activation_comm_s", "activation_comm_bytes", "grad_sync_s",
              "grad_sync_bytes", "peak_memory_bytes", "grad_sync_exposed_s")
    for f in fields:
        a, b = getattr(plan.cost, f), getattr(cost, f)
        if not _close(a, b):
            out.append(f"cost.{f} is {a:.6g} but its layers give {b:.6g}")
    return out


def _collectives(ly: LayerPlan) -> list[tuple]:
    return sorted((c.kind.value, c.purpose, c.phase, c.group_size, c.bytes, c.link, c.seconds)
                  for c in ly.collectives)


def _close_rows(a: list[tuple], b: list[tuple]) -> bool:
    return len(a) == len(b) and all(x[:-1] == y[:-1] and _close(x[-1], y[-1])
                                    for x, y in zip(a, b, strict=True))


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-15)


def _brief(rows: list[tuple]) -> str:
    shown = [f"{k}({p}, {ph}, p={g}, {b:.6g} B, {s:.3g} s)" for k, p, ph, g, b, _, s in rows[:4]]
    return "[" + ", ".join(shown) + (", …" if len(rows) > 4 else "") + "]"
