"""A plan checked before anything reads it as a program.

A plan file is input like any other: edited, truncated, produced by another version, or
simply wrong. Every verb that reads a plan (``explain``, ``diff``, ``simulate``, ``check``,
``run`` in its parent process) and the runtime on every rank run :func:`check_plan` first,
so a bad plan ends with one :class:`~ilp_planner.errors.PlanFormatError` naming the file, the
place in it and what was expected — never a traceback, never a different program. Checked,
in order:

1. every field present with its type, every number finite, and non-negative where it is a
   time, a size or a count — as the file is read (:meth:`Plan.from_dict
   <ilp_planner.plan.data.Plan.from_dict>` and :mod:`ilp_planner.plan.fields`);
2. the embedded config parses and re-derives the layer graph of the plan's layers (names,
   kinds, input counts, the tensor shapes each layer recorded, every layout valid for its
   tensor): an edited config is a mismatch, not a different model;
3. stages: indices in order, disjoint device sets inside the cluster, each mesh the size of
   its device set, every layer in exactly one stage and saying so;
4. strategy labels and layouts against the op and its stage's mesh
   (:mod:`ilp_planner.plan.layer_check`);
5. the schedule, validated *after* lowering to per-rank actions (FIFO order per link);
6. resharding entries: ops, stages and shapes that exist, the layouts the producer exports
   and the consumer reads, and forward and backward unit tasks whose senders hold their
   slices and whose receivers get exactly their blocks.

The runtime adds only what is its own (supported ops, even splits, the world size), and a
rank skips item 4's comparison with the enumerated strategies: ``check`` and ``run`` ran it
before any rank starts, and enumerating on every rank repeats the planner's costliest step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from formulations.schedules import (
    INTERLEAVED,
    Schedule,
    ScheduleError,
    check_schedule_name,
    lower,
    make_schedule,
    validate,
)
from ilp_planner.errors import LayoutError, PlanFormatError, PlannerError
from ilp_planner.inputs.config import Config, parse_config
from ilp_planner.ir.graph import Graph, OpKind
from ilp_planner.ir.layouts import Layout
from ilp_planner.ir.regions import Region, region_numel
from ilp_planner.lowering.strategies import resolve_partial
from ilp_planner.plan.data import Plan, ReshardingEntry, Stage, UnitTask
from ilp_planner.plan.layer_check import check_layer_strategies


@dataclass(frozen=True)
class CheckedPlan:
    """What checking derived, for the runtime to reuse: the stages (one on every device for a
    plan without any), the resharding entries and which brings each cross-stage input, per
    stage its lowered ``(kind, micro-batch)`` actions, and per stage mesh the order its
    ranks run them in (``(stage, kind, micro-batch)``: one stage per mesh, or under
    interleaved 1F1B the mesh's chunks interleaved)."""

    config: Config
    graph: Graph
    microbatches: int
    stages: list[Stage]
    entries: list[ReshardingEntry]
    entry_of: dict[tuple[str, int], int]  # (consumer, input index) -> entry bringing it
    actions: dict[int, list[tuple[str, int]]]
    mesh_actions: dict[int, list[tuple[int, str, int]]]


def check_plan(plan: Plan, source: str | None = None, microbatches: int | None = None, *,
               strategies: bool = True) -> CheckedPlan:
    """Check ``plan`` (see the module docstring); ``microbatches`` overrides a single-stage
    plan's gradient accumulation as the runtime may. ``strategies=False`` skips comparing
    the deciding layers with the enumerated strategies (item 4; what a training rank does:
    ``check``, ``run`` and ``explain`` ran the whole check before). Raises
    :class:`PlanFormatError`."""
    src = source or f"plan {plan.name!r}"
    try:
        try:
            config = parse_config(plan.config)
        except PlannerError as exc:
            raise PlanFormatError(f"{src}: config: {exc}") from exc
        m = plan_microbatches(plan, config, microbatches, src)
        graph = microbatch_graph(config, m, src)
        _check_layers(plan, graph, src)
        stages = plan_stages(plan, config, src)
        check_layer_strategies(plan.layers, graph, config, [s.mesh for s in stages], src,
                               strategies=strategies)
        stage_of = {n: s.index for s in stages for n in s.layers}
        entries, entry_of = plan_entries(plan, graph, stages, stage_of, src)
        mesh_actions = lowered_actions(plan, len(stages), m, src)
    except (ScheduleError, LayoutError) as exc:
        raise PlanFormatError(f"{src}: {exc}") from exc
    actions: dict[int, list[tuple[str, int]]] = {s.index: [] for s in stages}
    for row in mesh_actions.values():
        for stage, kind, mb in row:
            actions[stage].append((kind, mb))
    return CheckedPlan(config, graph, m, stages, entries, entry_of, actions, mesh_actions)


def load_checked(path: str | Path) -> Plan:
    """A plan file, loaded and checked (what every verb reading a plan uses)."""
    plan = Plan.load(path)
    check_plan(plan, str(path))
    return plan


def plan_microbatches(plan: Plan, config: Config, override: int | None, src: str) -> int:
    """Micro-batches per step: the schedule's, else ``override``, else the config's."""
    if plan.schedule is not None:
        return plan.schedule.num_microbatches
    return override or config.pipeline.microbatches


def microbatch_graph(config: Config, m: int, src: str) -> Graph:
    """The layer graph of one of ``m`` micro-batches. ``compare:`` is dropped first: its
    entries are resolved against the whole batch (an interleaved one needs its micro-batches
    a multiple of ``pp``) and say nothing about the plan's graph."""
    if m == 1:
        return config.graph
    if "batch" not in config.model or config.model["batch"] % m:
        raise PlanFormatError(f"{src}: model batch {config.model.get('batch')} does not split "
                              f"into {m} micro-batches")
    return config.with_overrides({"model.batch": config.model["batch"] // m,
                                  "pipeline.microbatches": 1, "compare": None}).graph


def _check_layers(plan: Plan, graph: Graph, src: str) -> None:
    ops = [op for op in graph.ops if op.kind is not OpKind.INPUT]
    names = [ly.name for ly in plan.layers]
    if sorted(names) != sorted(op.name for op in ops) or len(set(names)) != len(names):
        missing = sorted({op.name for op in ops} - set(names))
        extra = sorted(set(names) - {op.name for op in ops})
        raise PlanFormatError(f"{src}: layers do not match the config's graph (missing "
                              f"{missing[:5]}, not in the graph {extra[:5]}, or duplicated): the "
                              f"config was edited or the plan is for another model")
    for i, ly in enumerate(plan.layers):
        op = graph[ly.name]
        where = f"{src}: layers[{i}] ({ly.name})"
        if ly.kind != op.kind.value:
            raise PlanFormatError(f"{where}.kind: {ly.kind!r}, the config's op is {op.kind.value!r}")
        if len(ly.inputs) != len(op.inputs):
            raise PlanFormatError(f"{where}.strategy.inputs: {len(ly.inputs)} layouts for "
                                  f"{len(op.inputs)} inputs")
        shapes = [(f"inputs[{j}]", ly.input_shapes[j] if j < len(ly.input_shapes) else None,
                   graph[s].output.shape) for j, s in enumerate(op.inputs)]
        for what, have, want in [*shapes, ("output", ly.output_shape or None, op.output.shape)]:
            if have is None or tuple(have) != tuple(want):
                raise PlanFormatError(
                    f"{where}.strategy.{what}.shape: the plan was solved for "
                    f"{list(have) if have else 'no recorded shape'}, its config gives {list(want)} "
                    f"(the config was edited, or the plan is for another model: re-solve it)")
        try:
            for j, (lay, s) in enumerate(zip(ly.inputs, op.inputs, strict=True)):
                where_j = f"{where}.strategy.inputs[{j}]"
                lay.check(graph[s].output)
            where_j = f"{where}.strategy.output"
            ly.output.check(op.output)
            if ly.weight is not None and op.weight is not None:
                where_j = f"{where}.strategy.weight"
                ly.weight.check(op.weight)
        except LayoutError as exc:
            raise PlanFormatError(f"{where_j}: {exc}") from exc


def plan_stages(plan: Plan, config: Config, src: str) -> list[Stage]:
    """The plan's stages (one stage on every device when it has none), checked."""
    num_devices = config.cluster.num_devices
    layers = {ly.name: ly for ly in plan.layers}
    if not plan.stages:
        if any(ly.stage != 0 for ly in plan.layers):
            raise PlanFormatError(f"{src}: a plan without stages has layers on stage > 0")
        out = [Stage(0, tuple(range(num_devices)),
                     (config.cluster.nodes, config.cluster.devices_per_node), tuple(layers))]
    else:
        out = list(plan.stages)
        for i, s in enumerate(out):
            where = f"{src}: stages[{i}]"
            if s.index != i:
                raise PlanFormatError(f"{where}.index is {s.index}, expected {i}")
            if s.mesh[0] * s.mesh[1] != len(s.devices):
                raise PlanFormatError(f"{where}.mesh: expected [nodes, devices per node] with "
                                      f"{len(s.devices)} devices in all, got {list(s.mesh)}")
            _check_node_aligned(s, config.cluster.devices_per_node, where)
        placed = [n for s in out for n in s.layers]
        if sorted(placed) != sorted(layers):
            raise PlanFormatError(f"{src}: stages list {len(placed)} layers, the plan has "
                                  f"{len(layers)} (each layer in exactly one stage)")
        used = [d for s in out[:_check_chunk_meshes(plan, out, src)] for d in s.devices]
        if len(set(used)) != len(used) or any(not 0 <= d < num_devices for d in used):
            raise PlanFormatError(f"{src}: stage devices {used} overlap or lie outside "
                                  f"0..{num_devices - 1}")
    for s in out:
        for n in s.layers:
            if layers[n].stage != s.index:
                raise PlanFormatError(f"{src}: layer {n!r} says stage {layers[n].stage} but is "
                                      f"listed in stage {s.index}")
            for what, lay in (("output", layers[n].output), ("weight", layers[n].weight),
                              *(("input", x) for x in layers[n].inputs)):
                if lay is not None and lay.num_devices != len(s.devices):
                    raise PlanFormatError(f"{src}: layer {n!r} {what} is laid out on "
                                          f"{lay.num_devices} devices, its stage {s.index} has "
                                          f"{len(s.devices)}")
    return out


def _check_node_aligned(stage: Stage, per_node: int, where: str) -> None:
    """A stage's devices in mesh order are its ``mesh``: each of its ``nodes`` rows is
    ``devices per node`` consecutive devices of one node, each row on another node — the
    links its collectives were priced on (a row spanning two nodes would run them over the
    slower link)."""
    nodes, local = stage.mesh
    rows = [stage.devices[r * local:(r + 1) * local] for r in range(nodes)]
    homes = [row[0] // per_node for row in rows]
    if any(list(row) != list(range(row[0], row[0] + local)) or row[-1] // per_node != home
           for row, home in zip(rows, homes, strict=True)) or len(set(homes)) != nodes:
        raise PlanFormatError(
            f"{where}.devices: {list(stage.devices)} are not a {nodes}x{local} mesh of whole "
            f"node rows ({local} consecutive devices of one node per row, each row on its own "
            f"node of {per_node} devices)")


def virtual_stages(plan: Plan) -> int:
    """Model chunks per stage mesh: the schedule's ``virtual_stages`` (1 but for
    interleaved 1F1B)."""
    return plan.schedule.virtual_stages if plan.schedule is not None else 1


def _check_chunk_meshes(plan: Plan, stages: Sequence[Stage], src: str) -> int:
    """How many stage meshes the plan's stages sit on: all of them, or under interleaved
    1F1B (``v`` virtual stages) ``p = len(stages) / v``, stage ``j`` on the devices and
    mesh of stage ``j mod p`` (checked)."""
    v = virtual_stages(plan)
    if v == 1:
        return len(stages)
    if len(stages) % v or len(stages) // v < 2:
        raise PlanFormatError(f"{src}: schedule.virtual_stages is {v} but the plan has "
                              f"{len(stages)} stages: expected p·{v} model chunks on p ≥ 2 "
                              f"stage meshes")
    p = len(stages) // v
    for j in range(p, len(stages)):
        if (stages[j].devices, stages[j].mesh) != (stages[j % p].devices, stages[j % p].mesh):
            raise PlanFormatError(f"{src}: stages[{j}] is chunk {j} of an interleaved pipeline "
                                  f"over {p} meshes: expected the devices and mesh of stage "
                                  f"{j % p}, got {list(stages[j].devices)}")
    return p


def plan_entries(plan: Plan, graph: Graph, stages: Sequence[Stage], stage_of: dict[str, int],
                 src: str) -> tuple[list[ReshardingEntry], dict[tuple[str, int], int]]:
    """The resharding entries, parsed and checked (module docstring, item 6), and which
    entry brings each cross-stage input ``(consumer, input index)``."""
    out = list(plan.resharding)
    for i, ent in enumerate(out):
        _check_entry(plan, graph, stages, stage_of, ent, f"{src}: resharding entry {i} "
                                                         f"({ent.tensor} -> {ent.consumer})")
    rows = [(e.tensor, e.consumer, e.dst_stage, e.dst_layout) for e in out]
    entry_of: dict[tuple[str, int], int] = {}
    for ly in plan.layers:
        for idx, s in enumerate(graph[ly.name].inputs):
            if graph[s].kind is OpKind.INPUT or stage_of[s] == stage_of[ly.name]:
                continue
            k = find_entry(rows, s, ly.name, stage_of[ly.name], ly.inputs[idx])
            if k is None:
                raise PlanFormatError(
                    f"{src}: edge {s} -> {ly.name} crosses stages {stage_of[s]} -> "
                    f"{stage_of[ly.name]} but the plan has no resharding entry bringing {s} to "
                    f"stage {stage_of[ly.name]} in the layout {ly.inputs[idx]} it reads")
            entry_of[(ly.name, idx)] = k
    return out, entry_of


def _check_entry(plan: Plan, graph: Graph, stages: Sequence[Stage], stage_of: dict[str, int],
                 e: ReshardingEntry, where: str) -> None:
    if e.tensor not in stage_of or e.consumer not in stage_of:
        raise PlanFormatError(f"{where}: names an op the plan does not have")
    spec = graph[e.tensor].output
    if tuple(spec.shape) != e.shape:
        raise PlanFormatError(f"{where}: shape {list(e.shape)} but the op's output is "
                              f"{list(spec.shape)}")
    if e.dtype != spec.dtype:  # the transfer's bytes, the audit's expectation
        raise PlanFormatError(f"{where}: dtype {e.dtype} but the op's output is {spec.dtype}")
    if stage_of[e.tensor] != e.src_stage or stage_of[e.consumer] != e.dst_stage:
        raise PlanFormatError(f"{where}: stages {e.src_stage}->{e.dst_stage} disagree with the "
                              f"stage lists")
    if e.src_stage >= e.dst_stage:
        raise PlanFormatError(f"{where}: goes from stage {e.src_stage} to {e.dst_stage}; "
                              f"transfers must go to a later stage")
    if e.src_layout.has_partial or e.dst_layout.has_partial:
        raise PlanFormatError(f"{where}: cross-mesh layouts must be free of partial sums")
    sent = resolve_partial(plan.layer(e.tensor).output, spec)
    if e.src_layout != sent:
        raise PlanFormatError(f"{where}: sends from {e.src_layout}, but the producer's export "
                              f"program (priced) yields {sent}")
    for stage, lay in ((e.src_stage, e.src_layout), (e.dst_stage, e.dst_layout)):
        if lay.num_devices != len(stages[stage].devices):
            raise PlanFormatError(f"{where}: layout {lay} is not on stage {stage}'s "
                                  f"{len(stages[stage].devices)} devices")
    src_reg = _regions(e.src_layout, e.shape, stages[e.src_stage].devices)
    dst_reg = _regions(e.dst_layout, e.shape, stages[e.dst_stage].devices)
    check_tasks(f"{where}, forward", e.tasks, src_reg, dst_reg)
    check_tasks(f"{where}, backward", e.backward_tasks, dst_reg, src_reg)


def _regions(layout: Layout, shape: tuple[int, ...], devices: Sequence[int]) -> dict[int, Region]:
    return {d: tuple((int(lo), int(hi)) for lo, hi in reg)
            for d, reg in zip(devices, layout.regions(shape), strict=True)}


def check_tasks(where: str, tasks: tuple[UnitTask, ...], have: dict, need: dict) -> None:
    """Every task's sender holds its slice (in ``have``: device → region), every receiver
    needs it, and every needing device receives exactly its whole region."""
    covered = dict.fromkeys(need, 0)
    for k, t in enumerate(tasks):
        if t.sender not in t.holders or not t.receivers:
            raise PlanFormatError(f"{where}: task {k} sender {t.sender} is not a holder, or no "
                                  f"receivers")
        for h in t.holders:
            if h not in have or not _inside(t.region, have[h]):
                raise PlanFormatError(f"{where}: task {k} slice {t.region} is not held by {h}")
        for r in t.receivers:
            if r not in need or not _inside(t.region, need[r]):
                raise PlanFormatError(f"{where}: task {k} slice {t.region} not needed by {r}")
            covered[r] += region_numel(t.region)
    for r, n in covered.items():
        if n != region_numel(need[r]):
            raise PlanFormatError(f"{where}: device {r} receives {n} of the {region_numel(need[r])} "
                                  f"elements of its shard")


def _inside(inner, outer) -> bool:
    return len(inner) == len(outer) and all(
        o0 <= a and b <= o1 for (a, b), (o0, o1) in zip(inner, outer, strict=True))


def lowered_actions(plan: Plan, num_stages: int, m: int, src: str
                    ) -> dict[int, list[tuple[int, str, int]]]:
    """The schedule as it will run: per stage mesh the lowered ``(stage, kind,
    micro-batch)`` list, validated after lowering (complete, locally ordered, FIFO per
    link, deadlock-free). A single-stage plan without a schedule runs 1F1B. Under
    interleaved 1F1B the ``num_stages`` stages are the chunks, ``num_stages / v`` rows."""
    if plan.schedule is not None and plan.schedule.actions:
        name, rows = known_schedule(plan.schedule.name, src), [list(row) for row in plan.schedule.actions]
    elif num_stages == 1:
        name, rows = "1f1b", make_schedule("1f1b", 1, m).to_strings()
    else:
        raise PlanFormatError(f"{src}: {num_stages} stages but no schedule actions")
    v = virtual_stages(plan)
    if len(rows) * v != num_stages:
        raise PlanFormatError(f"{src}: schedule has {len(rows)} rows"
                              f"{f' × {v} virtual stages' if v > 1 else ''} for {num_stages} stages")
    if (name == INTERLEAVED) != (v > 1):
        raise PlanFormatError(f"{src}: schedule {name!r} with virtual_stages {v}: virtual "
                              f"stages (> 1) go with {INTERLEAVED!r} and only with it")
    try:
        sched = lower(Schedule.from_strings(rows, num_microbatches=m, name=name, virtual_stages=v))
    except (TypeError, ValueError, AttributeError) as exc:
        raise PlanFormatError(f"{src}: schedule actions do not parse ({exc})") from exc
    validate(sched)
    _as_named(rows, name, m, v, src)
    return {i: [(a.stage, a.kind.value, a.microbatch) for a in row]
            for i, row in enumerate(sched.rows)}


def _as_named(rows: list[list[str]], name: str, m: int, v: int, src: str) -> None:
    """A valid schedule must also be the one its name says: the stages' memory was solved
    for its micro-batches in flight and ``simulate`` replays it by name — GPipe's order
    under the name ``1f1b`` would hold every micro-batch at once."""
    named = make_schedule(name, len(rows), m, virtual_stages=v).to_strings()
    for i, (row, want) in enumerate(zip(rows, named, strict=True)):
        if row != want:
            j = next((j for j, (a, b) in enumerate(zip(row, want, strict=False)) if a != b),
                     min(len(row), len(want)))
            got = row[j] if j < len(row) else "nothing"
            runs = want[j] if j < len(want) else "nothing"
            raise PlanFormatError(
                f"{src}: schedule.actions.{i}: not the {name} order for {len(rows)} stage "
                f"meshes and {m} micro-batches (the order memory and time were priced for): "
                f"action {j} is {got} where {name} runs {runs}")


def known_schedule(name: str, src: str) -> str:
    """A schedule name the planner knows: the verbs that simulate a plan regenerate its
    schedule by name, so an unknown one (``zb-v``) would be simulated as another."""
    try:
        return check_schedule_name(name)
    except ScheduleError as exc:
        raise PlanFormatError(f"{src}: schedule.name: {exc}") from None


def find_entry(entries: Sequence[tuple[str, str, int, Layout]], tensor: str, consumer: str,
               stage: int, want: Layout) -> int | None:
    """Which resharding entry brings ``tensor`` to ``consumer`` on ``stage`` in the layout
    ``want`` it reads: the entry naming that consumer, else another delivering that layout
    to that stage (entries are shared by consumers of one stage). ``entries`` are
    ``(tensor, consumer, dst_stage, dst_layout)`` rows; one rule for planner and runtime.
    No entry delivering another layout is accepted: its conversion would be unpriced."""
    for rule in (lambda e: e[1] == consumer, lambda e: True):
        for i, e in enumerate(entries):
            if e[0] == tensor and e[2] == stage and e[3] == want and rule(e):
                return i
    return None
