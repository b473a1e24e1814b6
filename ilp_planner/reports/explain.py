"""Readable reports of a plan: :func:`explain` and :func:`summary` (two plans:
:func:`ilp_planner.reports.diff.diff`, which shares the formatters here).

Both are pure: a string built from :class:`~ilp_planner.plan.data.Plan` data, nothing re-solved
and nothing re-priced. Every number is the one the cost model wrote into the plan at solve
time — per-layer compute seconds, each collective's group, bytes, link level and predicted
α–β seconds, the memory each op holds, the baselines' cost blocks. So the report always
agrees with ``plan.json`` and with :meth:`Plan.summary`.

Units. Layer compute and collectives are per micro-batch (what one forward + backward of
the layer issues); the per-step figures multiply activation traffic and compute by the
number of micro-batches and count weight-gradient synchronisation once, exactly as
:meth:`CostBreakdown.of` does::

    step seconds of a collective kind = m · Σ_per-micro-batch seconds + Σ_once-per-step seconds
    (weight-gradient sync, tied-weight exchange)

Notation. A layout is printed twice: in SBP form, one ``placement:axis`` pair per mesh axis
(``(S(0):2, B:4)`` — split dim 0 over an axis of 2 devices, replicated over an axis of 4;
``2x4`` is an axis spanning 2 nodes × 4 local devices), and as DTensor placements in
mesh-axis order (``[Shard(0), Replicate()]``). The DTensor strings are formatted here from
the placements, so no torch import is needed.

Repeated blocks (GPT's ``h.0.*`` … ``h.31.*``) whose layers have identical strategies,
layouts and costs are printed once as ``h.[0-31].attn.qkv`` with a ``×32`` count.

Pipelined plans also carry ``stages`` (:class:`~ilp_planner.plan.data.Stage`),
``schedule`` (:class:`~ilp_planner.plan.data.PipelineSchedule`) and ``resharding`` (one
:class:`~ilp_planner.plan.data.ReshardingEntry` per cross-mesh transfer); they are printed
when present. The stage count of any plan is ``max(1, len(plan.stages))``. :func:`explain`
is a list of sections, each built by its own function.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence

from formulations.result import SolveStats
from ilp_planner.errors import ConfigError
from ilp_planner.inputs.config import Config, parse_cluster, parse_config
from ilp_planner.inputs.lift_graph import COPY_KINDS
from ilp_planner.ir.cluster import Cluster, fact_str
from ilp_planner.ir.graph import Graph, Op, OpKind
from ilp_planner.ir.layouts import Broadcast, Layout, Split
from ilp_planner.lowering.cost_model import ONCE_PER_STEP, Collective
from ilp_planner.plan.data import CostBreakdown, LayerPlan, Plan, baseline_seconds
from ilp_planner.plan.programs import EdgeProgram, edge_programs, steps_text
from ilp_planner.reports.given import given_lines
from ilp_planner.reports.roofline import BOUNDS, bound_seconds

_GIB = 2**30
_INDEX = re.compile(r"(?:(?<=\.)|^)(\d+)(?=\.|$)")


# -- small formatters ----------------------------------------------------------------------


def fmt_seconds(x: float | None) -> str:
    """``1.23 s``, ``4.56 ms``, ``7.8 µs``; ``n/a`` for None."""
    if x is None:
        return "n/a"
    a = abs(x)
    if a == 0:
        return "0 s"
    if a >= 1:
        return f"{x:.4g} s"
    if a >= 1e-3:
        return f"{x * 1e3:.4g} ms"
    return f"{x * 1e6:.4g} µs"


def fmt_bytes(x: float | None) -> str:
    if x is None:
        return "n/a"
    a = abs(x)
    for div, unit in ((_GIB, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if a >= div:
            return f"{x / div:.2f} {unit}"
    return f"{x:.0f} B"


def dtensor_placements(layout: Layout) -> str:
    """DTensor spelling of a layout, mesh-axis order: ``[Shard(0), Replicate(), Partial()]``."""
    out = []
    for pl in layout.placements:
        if isinstance(pl, Split):
            out.append(f"Shard({pl.dim})")
        elif isinstance(pl, Broadcast):
            out.append("Replicate()")
        else:
            out.append("Partial()")
    return "[" + ", ".join(out) + "]"


def sbp_layout(layout: Layout) -> str:
    """SBP spelling: ``(S(0):2, B:2x4)``, one placement per mesh axis with the axis size."""
    return str(layout)


def stage_count(plan: Plan) -> int:
    return max(1, len(plan.stages))


def microbatches(plan: Plan) -> int:
    """Micro-batches per step: the schedule's, else the config's gradient accumulation."""
    if plan.schedule is not None:
        return plan.schedule.num_microbatches
    pipe = plan.config.get("pipeline") or {}
    return int(pipe.get("microbatches", 1) or 1)


def step_seconds(plan: Plan) -> float:
    """Seconds per training step, :attr:`Plan.step_s`: for a pipelined plan the schedule's
    makespan plus its exposed gradient synchronisation (what a baseline's ``pipeline_s``
    counts too), else the cost breakdown's total (no overlap of compute and
    communication)."""
    return plan.step_s


def baseline_family(name: str) -> str:
    """``megatron(dp=2,tp=4)`` → ``megatron``: the baseline without its mesh."""
    return name.split("(", 1)[0]


def layout_summary(plan: Plan, top: int = 4) -> str:
    """One line: stages (if any) and the most used strategies among deciding layers (not
    followers), e.g. ``S(1)S(0)@(4, 2)×96, 3d(p0=2,p1=4,p2=1)×65, +3 more``."""
    counts: dict[str, int] = {}
    for layer in plan.layers:
        if layer.strategy.startswith("follows "):
            continue
        label = layer.strategy
        if "=" not in label:  # 3d(p0=..) labels already name their mesh
            label = f"{label}@{fact_str(layer.output.fact)}"
        counts[label] = counts.get(label, 0) + 1
    ranked = sorted(counts.items(), key=lambda kv: -kv[1])  # stable: ties keep graph order
    parts = [f"{label}×{n}" for label, n in ranked[:top]]
    if len(ranked) > top:
        parts.append(f"+{len(ranked) - top} more")
    text = ", ".join(parts) or "no layers"
    if plan.stages:
        sizes = "+".join(str(len(s.devices)) for s in plan.stages)
        sched = plan.schedule.name if plan.schedule is not None else None
        text = f"{len(plan.stages)} stages ({sizes} devices{', ' + sched if sched else ''}): {text}"
    return text


def text_table(header: Sequence[str], rows: Iterable[Sequence[str]], indent: str = "  ") -> list[str]:
    rows = [list(map(str, r)) for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True)]
        return (indent + "  ".join([first, *rest])).rstrip()

    return [line(header), *(line(r) for r in rows)]


# -- grouping of repeated blocks -------------------------------------------------------------


def name_template(name: str) -> tuple[str, int | None]:
    """``h.12.attn.qkv`` → (``h.{}.attn.qkv``, 12); names without an index → (name, None)."""
    m = _INDEX.search(name)
    if m is None:
        return name, None
    return name[:m.start()] + "{}" + name[m.end():], int(m.group(1))


def _index_range(indices: Sequence[int]) -> str:
    idx = sorted(indices)
    if len(idx) > 2 and idx == list(range(idx[0], idx[-1] + 1)):
        return f"[{idx[0]}-{idx[-1]}]"
    return "[" + ",".join(map(str, idx)) + "]"


def label_key(layer: LayerPlan, index: int | None) -> str:
    """Strategy label with the block index of a ``follows`` target abstracted."""
    if index is not None and layer.strategy.startswith("follows "):
        return layer.strategy.replace(f".{index}.", ".*.")
    return layer.strategy


def layer_signature(layer: LayerPlan, index: int | None) -> tuple:
    return (layer.kind, label_key(layer, index), layer.inputs, layer.weight, layer.output,
            layer.compute_s, layer.memory_bytes, layer.collectives, layer.stage, layer.zero,
            layer.recompute)


ZERO_TEXT = {1: "optimizer state", 2: "gradients + optimizer state",
             3: "weights + gradients + optimizer state"}


def decisions_text(layer: LayerPlan) -> str:
    """The state sharding and recomputation of a layer, e.g. ``  [ZeRO-3: weights +
    gradients + optimizer state sharded; recomputed]``."""
    parts = []
    if layer.zero:
        parts.append(f"ZeRO-{layer.zero}: {ZERO_TEXT[layer.zero]} sharded")
    if layer.recompute:
        parts.append("recomputed")
    return f"  [{'; '.join(parts)}]" if parts else ""


def decisions_summary(plan: Plan) -> str:
    """One line: how many ops shard their state at each ZeRO level and how many
    recompute their activations."""
    deciding = [ly for ly in plan.layers if not ly.strategy.startswith("follows ")]
    zero = {z: sum(ly.zero == z for ly in deciding) for z in (1, 2, 3)}
    shown = ", ".join(f"ZeRO-{z} ×{n}" for z, n in zero.items() if n) or "none"
    again = sum(ly.recompute for ly in plan.layers)
    return (f"state sharding: {shown}; activations recomputed in {again} of "
            f"{len(plan.layers)} ops")


def group_layers(layers: Sequence[LayerPlan], key=layer_signature) -> list[tuple[str, list[LayerPlan]]]:
    """Layers of repeated blocks with equal ``key`` merged: ``[(display name, members)]`` in
    order of first appearance."""
    groups: dict[tuple, tuple[str, list[int], list[LayerPlan]]] = {}
    for layer in layers:
        tmpl, index = name_template(layer.name)
        k = (tmpl, key(layer, index)) if index is not None else (layer.name, None)
        if k not in groups:
            groups[k] = (tmpl, [], [])
        groups[k][2].append(layer)
        if index is not None:
            groups[k][1].append(index)
    out = []
    for tmpl, indices, members in groups.values():
        name = members[0].name if len(members) == 1 else tmpl.replace("{}", _index_range(indices))
        out.append((name, members))
    return out


# -- collective totals ---------------------------------------------------------------------


def collective_totals(plan: Plan) -> dict[tuple[str, str, str], tuple[int, float, float]]:
    """Per step, by (kind, link, purpose): (count, bytes, seconds). Activation collectives
    run once per micro-batch, gradient synchronisation once per step."""
    m = microbatches(plan)
    out: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for layer in plan.layers:
        for c in layer.collectives:
            times = 1 if c.purpose in ONCE_PER_STEP else m
            acc = out[(c.kind.value, c.link, c.purpose)]
            acc[0] += times
            acc[1] += times * c.bytes
            acc[2] += times * c.seconds
    return {k: (int(v[0]), v[1], v[2]) for k, v in sorted(out.items())}


def _collective_line(c: Collective) -> str:
    axes = f", axes {','.join(map(str, c.axes))}" if c.axes else ""
    phase = {"forward": "fwd", "backward": "bwd"}.get(c.phase, c.phase)
    return (f"{c.kind.value} {phase} {c.purpose}: group {c.group_size} ({c.link}{axes}), "
            f"{fmt_bytes(c.bytes)}, {fmt_seconds(c.seconds)}")


# -- explain ---------------------------------------------------------------------------------


def _model_line(config: dict) -> str:
    model = dict(config.get("model") or {})
    kind = model.pop("kind", "?")
    model.pop("ops", None)
    keys = ", ".join(f"{k} {v}" for k, v in model.items() if not isinstance(v, dict | list)
                     or k == "dims")
    return f"model     {kind}" + (f" ({keys})" if keys else "")


def _cluster_line(config: dict) -> str:
    """The cluster as the config gives it: numbers as written, catalogue names by name (with
    the figures they stand for)."""
    c = config.get("cluster") or {}
    name = f"{c['name']}: " if "name" in c else ""
    links = c.get("links") or {}
    cluster = _parsed_cluster(config)

    def link(level: str) -> str:
        d = links.get(level) or {}
        named = f" {c[level]}" if isinstance(c.get(level), str) else ""
        if "bandwidth_gbps" in d:
            return f"{level}{named} {d.get('bandwidth_gbps')} Gb/s, {d.get('latency_us')} µs"
        if "beta" in d:
            return f"{level}{named} α {d.get('alpha')} s, β {d.get('beta')} s/B"
        return f"{level}{named}" if named else f"{level} ?"

    def figure(key: str, value: float | None) -> object:
        return c[key] if key in c else (f"{value:g}" if value is not None else None)

    gpu = f" {c['gpu']}" if isinstance(c.get("gpu"), str) else ""
    memory = figure("memory_gib", cluster and cluster.memory_bytes / _GIB)
    peak = figure("peak_tflops", cluster and cluster.peak_flops / 1e12)
    model = f"; {cluster.collectives} collectives" if cluster and cluster.collectives != "ring" \
        else ""
    return (f"cluster   {name}{c.get('nodes')} × {c.get('devices_per_node')}{gpu} devices, "
            f"{memory} GiB and {peak} TFLOP/s each; {link('intra')}; {link('inter')}{model}")


def _parsed_cluster(config: dict) -> Cluster | None:
    """The config's cluster, or None where a (hand-edited) plan's cluster does not parse:
    the report still prints what it can."""
    try:
        return parse_cluster(config)
    except ConfigError:
        return None


def _budget(plan: Plan) -> float | None:
    cluster = _parsed_cluster(plan.config)
    return None if cluster is None else cluster.memory_bytes


def stage_layers_text(layers: Sequence[str]) -> str:
    return f"{len(layers)} ops {layers[0]} .. {layers[-1]}" if layers else "no ops"


def mesh_text(mesh: tuple[int, int]) -> str:
    return " × ".join(map(str, mesh))


def devices_text(devices: Sequence[int]) -> str:
    """``0-7`` for a run of more than two devices, else ``0,1``."""
    d = list(devices)
    if len(d) > 2 and d == list(range(d[0], d[-1] + 1)):
        return f"{d[0]}-{d[-1]}"
    return ",".join(map(str, d))


def _stage_memory(plan: Plan) -> dict[int, float]:
    """Per stage: the memory the stage DP solved it for when it has one, else the sum over
    its ops (as the solve's cost breakdown sums them)."""
    out: dict[int, float] = defaultdict(float)
    for layer in plan.layers:
        out[layer.stage] += layer.memory_bytes
    for s in plan.stages:
        if s.dp is not None:
            out[s.index] = float(s.dp.memory_bytes)
    return dict(out)


def solver_stats_text(stats: SolveStats) -> str:
    """One line of a plan's solver statistics (:class:`formulations.result.SolveStats`):
    model size, nodes and where the time went; figures the solver did not report are
    ``n/a``."""
    def count(v: int | None) -> str:
        return "n/a" if v is None else f"{v:,}"

    size = (f"{count(stats.variables)} variables ({count(stats.integer_variables)} integer), "
            f"{count(stats.constraints)} constraints, {count(stats.nodes)} nodes")
    times = ", ".join(f"{name} {fmt_seconds(getattr(stats, name + '_s'))}"
                      for name in ("build", "presolve", "search", "proof"))
    note = f" [{stats.note}]" if stats.note else ""
    return f"{size}; {times}{note}"


def record_text(d: dict) -> str:
    """``k v`` pairs of a plan record (a resharding entry, a schedule): seconds and bytes in
    readable units, fractions as percentages; long lists and mappings left out."""
    def value(k: str, v) -> str:
        if isinstance(v, int | float) and not isinstance(v, bool):
            if k == "seconds" or k.endswith("_s"):
                return fmt_seconds(v)
            if k == "bytes" or k.endswith("_bytes"):
                return fmt_bytes(v)
            if k.endswith("_fraction"):
                return f"{v:.1%}"
        return str(v)

    return ", ".join(f"{k} {value(k, v)}" for k, v in d.items()
                     if not isinstance(v, dict | list) or len(str(v)) < 60)


OPAQUE_WARN_SHARE = 0.05  # above this share of the step, solve's summary line says so


def _opaque_costs(plan: Plan) -> dict[str, float]:
    """Seconds per step of each op kept replicated because the planner cannot shard it
    (``opaque``): its compute and the collectives it issues."""
    return {ly.name: ly.compute_s + sum(c.seconds for c in ly.collectives)
            for ly in plan.layers if ly.kind == "opaque"}


def opaque_share(plan: Plan) -> float:
    """The share of the predicted step the plan's opaque ops take (0 with none)."""
    return sum(_opaque_costs(plan).values()) / (plan.cost.total_s or 1.0)


def _opaque_lines(plan: Plan, shown: int = 5) -> list[str]:
    """The opaque ops with their share of the predicted step, the costliest first: what
    importing the model left on the table."""
    cost = _opaque_costs(plan)
    if not cost:
        return []
    total = plan.cost.total_s or 1.0
    top = sorted(cost, key=lambda name: -cost[name])[:shown]
    listed = ", ".join(f"{name} {cost[name] / total:.1%}" for name in top)
    more = f", … {len(cost) - shown} more" if len(cost) > shown else ""
    lines = [f"unsharded {len(cost)} opaque op(s), replicated: {fmt_seconds(sum(cost.values()))} "
             f"({opaque_share(plan):.1%} of the step): {listed}{more}"]
    config = parse_config(plan.config)
    unused = [name for name in cost if name in config.graph and config.graph[name].unused]
    if unused:
        lines.append(f"  {len(unused)} of them unused (no loss reads their output: computed "
                     f"whole, forward only, no gradient): {', '.join(unused[:shown])}"
                     f"{' …' if len(unused) > shown else ''}")
    free = [ly.name for ly in plan.layers if ly.name in cost and ly.compute_s == 0.0]
    if free and config.cluster.device is None:
        lines.append(
            f"  priced by their FLOPs only, on a cluster without a compute model: torch counts "
            f"none for {', '.join(free[:shown])}{' …' if len(free) > shown else ''}, so their "
            f"compute is free here; name a catalogue `gpu:` or give `cluster.compute` to price "
            f"their bytes and kernels")
    return lines


def _replicated_lines(plan: Plan) -> list[str]:
    """The aten ops of an imported model that ``parallelize`` runs replicated, DTensor
    having no rule for them (:mod:`runtime.replicated_ops`)."""
    gaps = parse_config(plan.config).graph.replicated_ops
    return [f"run by the runtime's own rules under parallelize (DTensor has none for them; "
            f"element-wise ones on their operands' blocks, the rest replicated): "
            f"{', '.join(gaps)}"] if gaps else []


def _frozen_lines(plan: Plan) -> list[str]:
    """The ops whose parameters are frozen (:attr:`~ilp_planner.ir.graph.Op.frozen`):
    held, never synchronised, updated or given optimizer state."""
    frozen = [op.name for op in parse_config(plan.config).graph.ops if op.frozen]
    return [f"frozen (requires_grad=False: weights held, no gradient, synchronisation or "
            f"optimizer state): {', '.join(frozen)}"] if frozen else []


def explain(plan: Plan, *, collectives: bool = True) -> str:
    """A readable report of ``plan``: solver report, model and cluster, cost per step,
    stages and schedule (pipelined plans), memory per device, every layer's strategy in
    SBP and DTensor notation with the program of each input edge (the lowered steps the
    runtime executes, forward and backward, :mod:`ilp_planner.plan.programs`) and its
    collectives (bytes, predicted seconds), collective totals per kind, cross-mesh
    resharding and the baselines with ratios.

    Under the roofline compute model, a table of what bounds each op kind (compute, memory
    or the kernel floor, :mod:`ilp_planner.reports.roofline`).

    ``collectives=False`` leaves out the per-layer collective lines (the totals stay)."""
    config = parse_config(plan.config)
    sections = [_solver_lines(plan), _cost_lines(plan), _roofline_lines(plan, config),
                _folded_step_lines(config),
                _stage_lines(plan), _memory_lines(plan),
                [decisions_summary(plan)], _layer_lines(plan, collectives, config),
                _totals_lines(plan), _resharding_lines(plan),
                ["baselines (same cost model; ratio = baseline / plan, > 1 means the plan is "
                 "faster):", *_baseline_table(plan)], given_lines(plan)]
    return "\n\n".join("\n".join(lines) for lines in sections if lines)


def _solver_lines(plan: Plan) -> list[str]:
    """The header: how the plan was solved, the model and the cluster."""
    s = plan.solver
    lines = [
        f"plan {plan.name} (schema v{plan.version})",
        "  solver    status {} (method {}), objective {}, bound {}, gap {}, build {}, solve {}".format(
            s.status, s.method, fmt_seconds(s.objective), fmt_seconds(s.bound),
            "n/a" if s.gap is None else f"{s.gap:.3g}", fmt_seconds(s.build_s),
            fmt_seconds(s.solve_s)),
    ]
    if s.stats is not None:
        lines.append(f"  stats     {solver_stats_text(s.stats)}")
    if s.message:
        lines.append(f"  note      {s.message}")
    return [*lines, "  " + _model_line(plan.config), "  " + _cluster_line(plan.config)]


def _cost_lines(plan: Plan) -> list[str]:
    """The cost breakdown per step, and a pipelined plan's simulated step."""
    c, m = plan.cost, microbatches(plan)
    lines = [
        f"cost per step ({m} micro-batch{'es' if m != 1 else ''}): total {fmt_seconds(c.total_s)} = "
        f"compute {fmt_seconds(c.compute_s)} + activation comm {fmt_seconds(c.activation_comm_s)} "
        f"({fmt_bytes(c.activation_comm_bytes)}) + grad sync {fmt_seconds(c.grad_sync_s)} "
        f"({fmt_bytes(c.grad_sync_bytes)}); grad sync overlapped with the backward in buckets: "
        f"{fmt_seconds(c.grad_sync_exposed_s)} exposed, so {fmt_seconds(c.step_s)} a step "
        f"where the runtime overlaps them (the objective and every ratio use the total)",
    ]
    lines += _opaque_lines(plan)
    lines += _replicated_lines(plan)
    lines += _frozen_lines(plan)
    if plan.schedule is not None:
        sim = plan.schedule.simulated
        lines.append(f"step time {fmt_seconds(step_seconds(plan))} (schedule makespan "
                     f"{fmt_seconds(sim.makespan_s if sim else 0.0)} + exposed "
                     f"gradient synchronisation)")
    return lines


def _stage_lines(plan: Plan) -> list[str]:
    """Each stage's devices, mesh, ops and per-micro-batch seconds, its ILP's statistics,
    and the schedule; a plan without stages: its one stage's layer meshes."""
    lines = [f"stages: {stage_count(plan)}"]
    v = plan.schedule.virtual_stages if plan.schedule is not None else 1
    if v > 1:  # interleaved 1F1B: the stages are the model's chunks
        lines[0] += (f" (model chunks: {len(plan.stages) // v} stage meshes × {v} virtual "
                     f"stages, chunk j on the devices of stage j mod {len(plan.stages) // v})")
    if not plan.stages:
        devices = plan.num_devices if "cluster" in plan.config else "?"
        meshes = sorted({fact_str(layer.output.fact) for layer in plan.layers})
        return [*lines, f"  one stage on all {devices} devices; layer meshes: {', '.join(meshes)}"]
    per_stage = defaultdict(lambda: [0.0, 0.0])
    for layer in plan.layers:
        per_stage[layer.stage][0] += layer.compute_s
        per_stage[layer.stage][1] += sum(x.seconds for x in layer.collectives)
    for st in plan.stages:
        comp, comm = per_stage.get(st.index, (0.0, 0.0))
        lines.append(f"  stage {st.index}: devices {devices_text(st.devices)}, mesh "
                     f"{mesh_text(st.mesh)}, {stage_layers_text(st.layers)}; "
                     f"per micro-batch compute {fmt_seconds(comp)}, collectives "
                     f"{fmt_seconds(comm)}")
        if st.dp is not None and st.dp.solver.stats is not None:
            lines.append(f"    ILP {st.dp.solver.status}: {solver_stats_text(st.dp.solver.stats)}")
    if plan.schedule is not None:
        sch, sim = plan.schedule, plan.schedule.simulated
        lines.append(f"  schedule {sch.name}: {sch.num_microbatches} micro-batches, "
                     f"makespan {fmt_seconds(sim.makespan_s if sim else None)}, bubble "
                     f"{f'{sim.bubble_fraction:.1%}' if sim else 'n/a'}")
    return lines


def _memory_lines(plan: Plan) -> list[str]:
    """Memory per device (per stage for pipelined plans) against the budget, and the three
    heaviest layer groups."""
    budget = _budget(plan)

    def share(mem: float) -> str:
        return f" of {fmt_bytes(budget)} ({mem / budget:.1%})" if budget else ""

    lines = ["memory per device:"]
    if plan.stages:
        lines += [f"  stage {i}: {fmt_bytes(mem)}{share(mem)}"
                  for i, mem in sorted(_stage_memory(plan).items())]
    else:
        lines.append(f"  {fmt_bytes(plan.cost.peak_memory_bytes)}{share(plan.cost.peak_memory_bytes)}")
    heavy = sorted(group_layers(plan.layers), key=lambda g: -sum(x.memory_bytes for x in g[1]))[:3]
    if heavy:
        lines.append("  largest: " + ", ".join(
            f"{name} {fmt_bytes(sum(x.memory_bytes for x in members))}" for name, members in heavy))
    return lines


def _roofline_lines(plan: Plan, config: Config) -> list[str]:
    """Per op kind, the costliest first: its kernels' seconds by bound and the main one."""
    table = bound_seconds(plan, config)
    if not table:
        return []
    rows = [[kind, *(fmt_seconds(row[b]) for b in BOUNDS), f"{max(BOUNDS, key=row.get)}-bound"]
            for kind, row in sorted(table.items(), key=lambda kv: -sum(kv[1].values()))]
    return [f"roofline on {config.cluster.device.name}: each kind's kernels per micro-batch "
            f"(forward + backward, local shards) by what bounds them:",
            *text_table(["kind", *BOUNDS, "mostly"], rows)]


def _copies(op: Op) -> str:
    """The folded copies among an attention's input steps (GQA's repeated heads, casts,
    ``contiguous``, rotate-half's ``cat``: re-views that move bytes), where it has any."""
    return f" (of which {_copies_text(op)})" if op.attrs.get("input_copies") else ""


def _copies_text(op: Op) -> str:
    """``op``'s folded copies by kind with their bytes per micro-batch, forward (torch's
    count) and backward (closed form: :func:`ilp_planner.inputs.lift_graph.copy_backward`)."""
    a = op.attrs
    kinds = ", ".join(f"{a[f'input_copies_{k}']} {k}" for k in COPY_KINDS
                      if a.get(f"input_copies_{k}"))
    back = a.get("input_copies_bwd_bytes")
    return (f"{a['input_copies']} copies{f' ({kinds})' if kinds else ''}: "
            f"{fmt_bytes(a['input_copies_bytes'])} forward"
            + (f", {fmt_bytes(back)} backward" if back is not None else ""))


def _steps_text(op: Op) -> str:
    """The kernels an import folded into ``op``'s inputs, per micro-batch: forward (their
    number, torch's bytes of their tensors, one FLOP per element an element-wise step
    writes) and backward (as autograd runs them:
    :func:`ilp_planner.inputs.lift_backward.replay_backward`), with the copies among
    them (:func:`_copies`)."""
    a = op.attrs
    back = (f"; backward {a['input_steps_bwd']} kernels, "
            f"{fmt_bytes(a.get('input_steps_bwd_bytes', 0))}"
            if "input_steps_bwd" in a else "")
    return (f"{a['input_steps']} kernels, {fmt_bytes(a.get('input_steps_bytes', 0))}, "
            f"{a.get('input_steps_flops', 0):.3g} FLOPs{back}" + _copies(op))


def _step_lines(graph: Graph, flat: str, shown: int = 3) -> list[str]:
    """The ops other than attention that read values the module's code computed or copied
    on the way — a hand-written activation (GPT-2's tanh GELU) or norm (an RMSNorm's pow,
    mean, rsqrt), a cast before a norm, ``contiguous`` of attention's output before its
    projection, a ``cat`` — priced with the op reading them (``attrs.input_steps``)."""
    ops = [op for op in graph.ops if op.kind is not OpKind.ATTENTION
           and op.attrs.get("input_steps")]
    if not ops:
        return []
    listed = "; ".join(f"{op.name}: {_steps_text(op)}" for op in ops[:shown])
    more = f"; … {len(ops) - shown} more" if len(ops) > shown else ""
    return [f"element-wise steps and copies of the module's code folded into the values "
            f"{len(ops)} other op(s) read (hand-written activations and norms, casts, "
            f"layout copies, concatenations), priced with the op reading them as "
            f"memory-bound kernels per micro-batch, forward by torch's bytes, backward as "
            f"autograd runs it: {listed}{more}{flat}"]


def _folded_step_lines(config: Config, shown: int = 3) -> list[str]:
    """The attention ops whose imported q, k or v carry element-wise steps of the user's
    code (rotary positions, a scale: ``attrs.input_steps``; a hand-written one's scores'
    scale and mask), each with its kernels, bytes and FLOPs per micro-batch — priced with
    the attention by torch's bytes, not guessed
    (:func:`ilp_planner.inputs.lift_layers.input_steps`) —, the other ops' folded steps
    (:func:`_step_lines`) and the built-in attention ops pricing rotary positions by
    formula (``rope_theta``)."""
    graph = config.microbatch_graph()
    attention = [op for op in graph.ops if op.kind is OpKind.ATTENTION]
    folded = [op for op in attention if op.attrs.get("input_steps")]
    rope = [op.name for op in attention if op.attrs.get("rope_theta")]
    flat = "" if config.cluster.device is not None else (
        " — NOT priced: the flat compute model (no cluster device) counts only FLOPs at "
        "matmul speed")
    lines = []
    if folded:
        listed = "; ".join(f"{op.name}: {_steps_text(op)}" for op in folded[:shown])
        more = f"; … {len(folded) - shown} more" if len(folded) > shown else ""
        lines.append(f"element-wise steps of the module's code on attention's q, k, v (its "
                     f"rotary positions, scales, folded copies) or a hand-written one's "
                     f"scores (a scale, a mask), priced by torch's bytes per micro-batch "
                     f"forward, backward by what autograd runs: {listed}{more}{flat}")
    lines += _step_lines(graph, flat)
    if rope:
        lines.append(f"rotary positions priced in {len(rope)} attention op(s) "
                     f"(rope_theta: 3 FLOPs per q and k element, one pass over them and the "
                     f"cos / sin rows, forward and backward): {', '.join(rope[:shown])}"
                     + (", …" if len(rope) > shown else "") + flat)
    return lines


def _layer_lines(plan: Plan, collectives: bool, config: Config) -> list[str]:
    """Every layer (repeated blocks folded): strategy, layouts, the programs of its input
    edges, compute, memory and (``collectives``) each collective."""
    lines = [f"layers ({len(plan.layers)} ops; layouts as SBP (placement:axis) and DTensor; "
             f"compute and collectives per micro-batch):"]
    programs: dict[str, list[EdgeProgram]] = defaultdict(list)
    graph = config.microbatch_graph()
    for ep in edge_programs(plan, config):
        programs[ep.consumer].append(ep)
    for name, members in group_layers(plan.layers):
        layer = members[0]
        count = f"  ×{len(members)}" if len(members) > 1 else ""
        stage = f"  stage {layer.stage}" if plan.stages else ""
        label = layer.strategy
        if len(members) > 1 and label.startswith("follows "):
            label = label_key(layer, name_template(layer.name)[1]).replace(".*.", ".[*].")
        lines.append(f"  {name} [{layer.kind}] {label} on mesh {fact_str(layer.output.fact)}"
                     f"{stage}{count}{decisions_text(layer)}")
        lines += _layout_lines(layer)
        lines += _program_lines(programs[layer.name])
        comm = sum(x.seconds for x in layer.collectives)
        lines.append(f"      compute {fmt_seconds(layer.compute_s)}, memory {fmt_bytes(layer.memory_bytes)}, "
                     f"{len(layer.collectives)} collective(s) {fmt_seconds(comm)}")
        if layer.name in graph and graph[layer.name].attrs.get("input_steps"):
            lines.append(f"      folded steps it reads, in its compute: "
                         f"{_steps_text(graph[layer.name])}")
        if collectives:
            lines += [f"        - {_collective_line(coll)}" for coll in layer.collectives]
    return lines


def _layout_lines(layer: LayerPlan) -> list[str]:
    """A layer's layouts in SBP and DTensor notation (a follower's inputs and weight are
    its leader's, so only its output)."""
    lines = []
    if not layer.strategy.startswith("follows "):
        lines += [f"      in{j}    {sbp_layout(x):<28} {dtensor_placements(x)}"
                  for j, x in enumerate(layer.inputs)]
        if (w := layer.weight) is not None:
            lines.append(f"      weight {sbp_layout(w):<28} {dtensor_placements(w)}")
    return [*lines, f"      out    {sbp_layout(layer.output):<28} {dtensor_placements(layer.output)}"]


def _program_lines(programs: Sequence[EdgeProgram]) -> list[str]:
    """The lowered steps of a layer's edge programs, forward and backward."""
    lines = []
    for ep in programs:
        what = "export" if ep.role == "export" else f"in{ep.index} {ep.role} from {ep.producer}"
        lines.append(f"      {what}: fwd {steps_text(ep.program.steps)}")
        if ep.program.backward_steps:
            lines.append(f"      {' ' * len(what)}  bwd {steps_text(ep.program.backward_steps)}")
    return lines


def _totals_lines(plan: Plan) -> list[str]:
    totals = collective_totals(plan)
    lines = ["collectives per step (predicted by the α–β model):"]
    if not totals:
        return [*lines, "  none"]
    return lines + text_table(["kind", "link", "purpose", "count", "bytes", "seconds"],
                              [[k, link, p, str(n), fmt_bytes(b), fmt_seconds(t)]
                               for (k, link, p), (n, b, t) in totals.items()])


def _resharding_lines(plan: Plan) -> list[str]:
    if not plan.resharding:
        return []
    return [f"cross-mesh resharding ({len(plan.resharding)} transfers):",
            *("  " + record_text(e.to_dict()) for e in plan.resharding)]


def _baseline_table(plan: Plan) -> list[str]:
    mine = step_seconds(plan)
    rows = [["ilp_planner", fmt_seconds(mine), fmt_seconds(plan.cost.compute_s),
             fmt_seconds(plan.cost.comm_s), fmt_bytes(plan.cost.peak_memory_bytes), "1.00"]]
    notes = []
    for name, b in plan.baselines.items():
        if "error" in b:
            notes.append(f"  {name}: n/a — {b['error']}")
            continue
        cb = CostBreakdown.from_dict(b)
        ratio = f"{baseline_seconds(b) / mine:.2f}" if mine else "n/a"
        rows.append([name, fmt_seconds(baseline_seconds(b)), fmt_seconds(cb.compute_s),
                     fmt_seconds(cb.comm_s), fmt_bytes(cb.peak_memory_bytes), ratio])
    if not plan.baselines:
        notes.append("  (none priced: solved with baselines off)")
    return text_table(["plan", "step", "compute", "comm", "memory", "ratio"], rows) + notes


def _opaque_warning(plan: Plan) -> str:
    """A clause for the summary line when ops the planner cannot shard take a real share of
    the step: the plan is then only as good as their replicated cost."""
    share = opaque_share(plan)
    if share <= OPAQUE_WARN_SHARE:
        return ""
    return f"; WARNING: {share:.0%} of the step is in unsharded (opaque) ops, see explain"


def summary(plan: Plan) -> str:
    """Solver status, cost breakdown and the baselines beside it with ratios (baseline
    step time / this plan's step time)."""
    s = plan.solver
    lines = [
        f"plan {plan.name}: status {s.status} (method {s.method}), objective "
        f"{s.objective:.6g} s, bound {_fmt(s.bound)}, gap {_fmt(s.gap)}, "
        f"build {_fixed(s.build_s)} s, solve {_fixed(s.solve_s)} s" + _opaque_warning(plan),
    ]
    if s.stats is not None:
        lines.append(f"  solver stats: {solver_stats_text(s.stats)}")
    if s.message:
        lines.append(f"  note: {s.message}")
    if plan.schedule is not None and plan.schedule.simulated is not None:
        sc, sim = plan.schedule, plan.schedule.simulated
        lines.append(
            f"  pipeline: {len(plan.stages)} stages "
            f"{[st.mesh for st in plan.stages]}, {sc.name} with "
            f"{sc.num_microbatches} micro-batches: makespan {sim.makespan_s:.4g} s, "
            f"bubble {sim.bubble_fraction:.1%}; per-device costs below are the busiest "
            f"stage's")
    return "\n".join(lines + _cost_table(plan) + given_lines(plan))


RATIO_LEGEND = ("  ratio = a plan's step time / ilp_planner's (> 1: ilp_planner is faster); "
                "memory = peak per device")


def _cost_table(plan: Plan) -> list[str]:
    """The plan and every baseline per step: times and memory in adaptive units (a tiny
    config's memory is not ``0.00 GiB``), columns as wide as their longest cell (a long
    baseline name does not shift them), the ratio explained above; a baseline that could
    not be priced follows the table with its reason."""
    mine = plan.step_s
    rows = [_cost_row("ilp_planner", plan.cost, mine, mine)]
    unpriced = []
    for name, b in plan.baselines.items():
        if "error" in b:
            unpriced.append(f"  {name}: n/a — {b['error']}")
        else:
            rows.append(_cost_row(name, CostBreakdown.from_dict(b), baseline_seconds(b), mine))
    header = ["plan", "step", "compute", "act comm", "grad sync", "memory", "ratio"]
    return [RATIO_LEGEND, *text_table(header, rows), *unpriced]


def _cost_row(name: str, c: CostBreakdown, step: float, mine: float) -> list[str]:
    ratio = f"{step / mine:.2f}" if mine else "n/a"
    return [name, fmt_seconds(step), fmt_seconds(c.compute_s), fmt_seconds(c.activation_comm_s),
            fmt_seconds(c.grad_sync_s), fmt_bytes(c.peak_memory_bytes), ratio]


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"


def _fixed(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"
