"""A plan's layers checked against the ops and meshes they claim to run on.

The runtime, the gradient-synchronisation buckets and the backward layouts all dispatch on a
layer's strategy label (``3d(…)``, ``summa(…)``, ``follows …``) and trust its layouts. A
label or a layout the strategy generator would not produce for that op on that stage's mesh
is therefore not a different plan but an unpriced program, so it is refused before anything
runs: every deciding layer must be one of :func:`~ilp_planner.lowering.strategies.op_strategies` for
its op on its stage's mesh (same label, input, weight and output layouts), and every
follower must read its producer's output with partial sums resolved and produce what
:func:`~ilp_planner.lowering.strategies.follow` says (so, e.g., a ReLU never receives partial sums).
"""

from __future__ import annotations

from collections.abc import Sequence

from ilp_planner.errors import LayoutError, PlanFormatError
from ilp_planner.inputs.config import Config
from ilp_planner.ir.graph import Graph, Op, OpKind
from ilp_planner.lowering.strategies import (
    FOLLOWER_KINDS,
    Strategy,
    StrategyContext,
    follow,
    follower_inputs,
    op_strategies,
)
from ilp_planner.plan.data import LayerPlan

FOLLOWS = "follows "


def check_layer_strategies(layers: Sequence[LayerPlan], graph: Graph, config: Config,
                           meshes: list[tuple[int, int]], source: str, *,
                           strategies: bool = True) -> None:
    """Raise :class:`PlanFormatError` naming ``source`` (a plan's name) and the first of a
    plan's ``layers`` whose strategy label or layouts are not what the planner generates
    for its op on its stage's mesh (``meshes[stage]`` = (nodes, devices per node), already
    checked) under ``config``'s solver options — a compared configuration the planner
    would keep as its plan is checked so too.

    ``strategies=False`` leaves the deciding layers unchecked against the enumerated
    strategies — the one costly part, which a training rank skips because the verbs that
    start ranks ran it — and still checks every op, stage and follower."""
    src = source
    cluster = config.cluster
    contexts = {shape: StrategyContext(cluster, *shape, config.memory,
                                       config.solver.max_weight_replication,
                                       config.solver.state_sharding) for shape in meshes}
    by_name = {ly.name: ly for ly in layers}
    cache: dict[tuple, list[Strategy]] = {}
    for i, ly in enumerate(layers):
        where = f"{src}: layers[{i}] ({ly.name}).strategy"
        if ly.name not in graph or graph[ly.name].kind is OpKind.INPUT:
            raise PlanFormatError(f"{where}: the plan's config has no op {ly.name!r} to run")
        if not 0 <= ly.stage < len(meshes):
            raise PlanFormatError(f"{where}: stage {ly.stage} does not exist")
        op = graph[ly.name]
        ctx = contexts[meshes[ly.stage]]
        try:
            if ly.strategy.startswith(FOLLOWS):
                _check_follower(op, ly, by_name, graph, ctx, where)
                continue
            if not strategies:
                continue
            in_specs = [graph[s].output for s in op.inputs]
            key = (op.kind, op.output, op.weight, tuple(in_specs), tuple(sorted(op.attrs.items())),
                   meshes[ly.stage])
            if key not in cache:
                cache[key] = op_strategies(op, in_specs, ctx)
        except (LayoutError, ValueError) as exc:
            raise PlanFormatError(f"{where}: {exc}") from exc
        same = [s for s in cache[key] if s.label == ly.strategy and s.zero == ly.zero]
        if not same:
            raise PlanFormatError(
                f"{where}: label {ly.strategy!r} is not a strategy of a {op.kind.value} op on a "
                f"{meshes[ly.stage][0]}x{meshes[ly.stage][1]} mesh (e.g. "
                f"{', '.join(sorted({s.label for s in cache[key]})[:4])})")
        if not any(s.inputs == ly.inputs and s.weight == ly.weight and s.output == ly.output
                   for s in same):
            raise PlanFormatError(
                f"{where}: layouts inputs {[str(x) for x in ly.inputs]}, weight {ly.weight}, "
                f"output {ly.output} are not those of strategy {ly.strategy!r}")


def _check_follower(op: Op, ly: LayerPlan, layers: dict[str, LayerPlan], graph: Graph,
                    ctx: StrategyContext, where: str) -> None:
    if op.kind not in FOLLOWER_KINDS or len(op.inputs) != 1:
        raise PlanFormatError(f"{where}: a {op.kind.value} op with {len(op.inputs)} inputs cannot "
                              f"follow its producer")
    src = op.inputs[0]
    tensor = graph[src].output
    producer = layers.get(src)
    allowed = (follower_inputs(op, producer.output, tensor)
               if producer is not None and producer.stage == ly.stage else ly.inputs[:1])
    if len(ly.inputs) != 1 or ly.inputs[0] not in allowed or ly.inputs[0].has_partial:
        raise PlanFormatError(f"{where}: a follower reads its producer's output with partial sums "
                              f"resolved ({' or '.join(str(a) for a in allowed)}), the plan says "
                              f"{[str(x) for x in ly.inputs]}")
    out = follow(op, tensor, ly.inputs[0], ctx)[0]
    if ly.output != out:
        raise PlanFormatError(f"{where}: follower output {ly.output} should be {out}")
