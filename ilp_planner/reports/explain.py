"""Readable reports of plans: :func:`explain` (one plan) and :func:`diff` (two plans).

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

Pipelined plans also carry ``stages`` (dicts with ``index``, ``devices``, ``mesh``,
``layers``), ``schedule`` (``name``, ``num_microbatches``, ``makespan_s``,
``bubble_fraction``) and ``resharding`` (one dict per cross-mesh transfer); they are
printed when present. The stage count of any plan is ``max(1, len(plan.stages))``.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence

from ilp_planner.ir.cluster import fact_str
from ilp_planner.ir.layouts import Broadcast, Layout, Split
from ilp_planner.lowering.cost_model import ONCE_PER_STEP, Collective
from ilp_planner.plan.data import CostBreakdown, LayerPlan, Plan, baseline_seconds
from ilp_planner.plan.programs import EdgeProgram, edge_programs, steps_text

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
    if plan.schedule and plan.schedule.get("num_microbatches"):
        return int(plan.schedule["num_microbatches"])
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
        sizes = "+".join(str(len(s.get("devices", ()) or ())) for s in plan.stages)
        sched = (plan.schedule or {}).get("name")
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


def _template(name: str) -> tuple[str, int | None]:
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


def _label_key(layer: LayerPlan, index: int | None) -> str:
    """Strategy label with the block index of a ``follows`` target abstracted."""
    if index is not None and layer.strategy.startswith("follows "):
        return layer.strategy.replace(f".{index}.", ".*.")
    return layer.strategy


def _layer_signature(layer: LayerPlan, index: int | None) -> tuple:
    return (layer.kind, _label_key(layer, index), layer.inputs, layer.weight, layer.output,
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


def group_layers(layers: Sequence[LayerPlan], key=_layer_signature) -> list[tuple[str, list[LayerPlan]]]:
    """Layers of repeated blocks with equal ``key`` merged: ``[(display name, members)]`` in
    order of first appearance."""
    groups: dict[tuple, tuple[str, list[int], list[LayerPlan]]] = {}
    for layer in layers:
        tmpl, index = _template(layer.name)
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
    c = config.get("cluster") or {}
    name = f"{c['name']}: " if "name" in c else ""
    links = c.get("links") or {}

    def link(level: str) -> str:
        d = links.get(level) or {}
        if "bandwidth_gbps" in d:
            return f"{level} {d.get('bandwidth_gbps')} Gb/s, {d.get('latency_us')} µs"
        if "beta" in d:
            return f"{level} α {d.get('alpha')} s, β {d.get('beta')} s/B"
        return f"{level} ?"

    return (f"cluster   {name}{c.get('nodes')} × {c.get('devices_per_node')} devices, "
            f"{c.get('memory_gib')} GiB and {c.get('peak_tflops')} TFLOP/s each; "
            f"{link('intra')}; {link('inter')}")


def _budget(plan: Plan) -> float | None:
    gib = (plan.config.get("cluster") or {}).get("memory_gib")
    try:
        return float(gib) * _GIB
    except (TypeError, ValueError):
        return None


def _stage_layers_text(layers) -> str:
    if isinstance(layers, list | tuple):
        if not layers:
            return "no ops"
        if all(isinstance(x, str) for x in layers):
            return f"{len(layers)} ops {layers[0]} .. {layers[-1]}"
        if len(layers) == 2 and all(isinstance(x, int) for x in layers):
            return f"ops [{layers[0]}, {layers[1]})"
    if isinstance(layers, int):
        return f"{layers} ops"
    return str(layers)


def _mesh_text(mesh) -> str:
    if isinstance(mesh, list | tuple) and mesh and all(isinstance(a, list | tuple) for a in mesh):
        return "(" + ", ".join("x".join(map(str, a)) if a[0] != 1 else str(a[1]) for a in mesh) + ")"
    if isinstance(mesh, list | tuple):
        return " × ".join(map(str, mesh))
    return str(mesh)


def _devices_text(devices) -> str:
    if not isinstance(devices, list | tuple) or not devices:
        return str(devices)
    d = list(devices)
    if all(isinstance(x, int) for x in d) and d == list(range(d[0], d[-1] + 1)) and len(d) > 2:
        return f"{d[0]}-{d[-1]}"
    return ",".join(map(str, d))


def _stage_memory(plan: Plan) -> dict[int, float]:
    """Per stage: the stage dict's own figure when it has one, else the sum over its ops
    (as the solve's cost breakdown sums them)."""
    out: dict[int, float] = defaultdict(float)
    for layer in plan.layers:
        out[layer.stage] += layer.memory_bytes
    for s in plan.stages:
        for key in ("peak_memory_bytes", "memory_bytes"):
            if isinstance(s.get(key), int | float):
                out[int(s.get("index", 0))] = float(s[key])
                break
    return dict(out)


def solver_stats_text(stats: dict) -> str:
    """One line of a plan's solver statistics (:class:`formulations.result.SolveStats`):
    model size, nodes and where the time went; figures the solver did not report are
    ``n/a``."""
    def count(key: str) -> str:
        v = stats.get(key)
        return "n/a" if v is None else f"{int(v):,}"

    size = (f"{count('variables')} variables ({count('integer_variables')} integer), "
            f"{count('constraints')} constraints, {count('nodes')} nodes")
    times = ", ".join(f"{name} {fmt_seconds(stats.get(name + '_s'))}"
                      for name in ("build", "presolve", "search", "proof"))
    note = f" [{stats['note']}]" if stats.get("note") else ""
    return f"{size}; {times}{note}"


def _generic(d: dict) -> str:
    """``k v`` pairs of a free-form record (a resharding transfer, a schedule), seconds and
    bytes in readable units."""
    def value(k: str, v) -> str:
        if isinstance(v, int | float) and not isinstance(v, bool):
            if k == "seconds" or k.endswith("_s"):
                return fmt_seconds(v)
            if k == "bytes" or k.endswith("_bytes"):
                return fmt_bytes(v)
        return str(v)

    return ", ".join(f"{k} {value(k, v)}" for k, v in d.items()
                     if not isinstance(v, dict | list) or len(str(v)) < 60)


def _opaque_lines(plan: Plan, shown: int = 5) -> list[str]:
    """The ops kept replicated because the planner cannot shard them (``opaque``), with
    their share of the predicted step (compute and the collectives each issues), the
    costliest first: what importing the model left on the table."""
    cost = {ly.name: ly.compute_s + sum(c.seconds for c in ly.collectives)
            for ly in plan.layers if ly.kind == "opaque"}
    if not cost:
        return []
    total = plan.cost.total_s or 1.0
    top = sorted(cost, key=lambda name: -cost[name])[:shown]
    listed = ", ".join(f"{name} {cost[name] / total:.1%}" for name in top)
    more = f", … {len(cost) - shown} more" if len(cost) > shown else ""
    return [f"unsharded {len(cost)} opaque op(s), replicated: {fmt_seconds(sum(cost.values()))} "
            f"({sum(cost.values()) / total:.1%} of the step): {listed}{more}"]


def explain(plan: Plan, *, collectives: bool = True) -> str:
    """A readable report of ``plan``: solver report, model and cluster, cost per step,
    stages and schedule (pipelined plans), memory per device, every layer's strategy in
    SBP and DTensor notation with the program of each input edge (the lowered steps the
    runtime executes, forward and backward, :mod:`ilp_planner.plan.programs`) and its
    collectives (bytes, predicted seconds), collective totals per kind, cross-mesh
    resharding and the baselines with ratios.

    ``collectives=False`` leaves out the per-layer collective lines (the totals stay)."""
    s = plan.solver
    m = microbatches(plan)
    lines = [
        f"plan {plan.name} (schema v{plan.version})",
        "  solver    status {} (method {}), objective {}, bound {}, gap {}, build {}, solve {}".format(
            s.get("status"), s.get("method"), fmt_seconds(s.get("objective")),
            fmt_seconds(s.get("bound")), "n/a" if s.get("gap") is None else f"{s['gap']:.3g}",
            fmt_seconds(s.get("build_s")), fmt_seconds(s.get("solve_s"))),
    ]
    if isinstance(s.get("stats"), dict):
        lines.append(f"  stats     {solver_stats_text(s['stats'])}")
    if s.get("message"):
        lines.append(f"  note      {s['message']}")
    lines += ["  " + _model_line(plan.config), "  " + _cluster_line(plan.config)]
    c = plan.cost
    lines += [
        "",
        f"cost per step ({m} micro-batch{'es' if m != 1 else ''}): total {fmt_seconds(c.total_s)} = "
        f"compute {fmt_seconds(c.compute_s)} + activation comm {fmt_seconds(c.activation_comm_s)} "
        f"({fmt_bytes(c.activation_comm_bytes)}) + grad sync {fmt_seconds(c.grad_sync_s)} "
        f"({fmt_bytes(c.grad_sync_bytes)}); grad sync overlapped with the backward in buckets: "
        f"{fmt_seconds(c.grad_sync_exposed_s)} exposed, step {fmt_seconds(c.step_s)}",
    ]
    lines += _opaque_lines(plan)
    if plan.schedule:
        lines.append(f"step time {fmt_seconds(step_seconds(plan))} (schedule makespan "
                     f"{fmt_seconds(float(plan.schedule.get('makespan_s', 0.0)))} + exposed "
                     f"gradient synchronisation)")

    # stages and schedule
    lines += ["", f"stages: {stage_count(plan)}"]
    if plan.stages:
        per_stage = defaultdict(lambda: [0.0, 0.0, 0])
        for layer in plan.layers:
            acc = per_stage[layer.stage]
            acc[0] += layer.compute_s
            acc[1] += sum(x.seconds for x in layer.collectives)
            acc[2] += 1
        for st in plan.stages:
            i = int(st.get("index", 0))
            comp, comm, n = per_stage.get(i, (0.0, 0.0, 0))
            lines.append(f"  stage {i}: devices {_devices_text(st.get('devices'))}, mesh "
                         f"{_mesh_text(st.get('mesh'))}, {_stage_layers_text(st.get('layers'))}; "
                         f"per micro-batch compute {fmt_seconds(comp)}, collectives "
                         f"{fmt_seconds(comm)}")
            stage_solver = st.get("solver")
            if isinstance(stage_solver, dict) and isinstance(stage_solver.get("stats"), dict):
                lines.append(f"    ILP {stage_solver.get('status')}: "
                             f"{solver_stats_text(stage_solver['stats'])}")
        if plan.schedule:
            sch = plan.schedule
            bubble = sch.get("bubble_fraction")
            lines.append(f"  schedule {sch.get('name')}: {sch.get('num_microbatches')} micro-batches, "
                         f"makespan {fmt_seconds(sch.get('makespan_s'))}, bubble "
                         f"{'n/a' if bubble is None else f'{bubble:.1%}'}")
    else:
        devices = plan.num_devices if "cluster" in plan.config else "?"
        meshes = sorted({fact_str(layer.output.fact) for layer in plan.layers})
        lines.append(f"  one stage on all {devices} devices; layer meshes: {', '.join(meshes)}")

    # memory
    budget = _budget(plan)
    lines += ["", "memory per device:"]
    if plan.stages:
        for i, mem in sorted(_stage_memory(plan).items()):
            lines.append(f"  stage {i}: {fmt_bytes(mem)}" +
                         (f" of {fmt_bytes(budget)} ({mem / budget:.1%})" if budget else ""))
    else:
        mem = c.peak_memory_bytes
        lines.append(f"  {fmt_bytes(mem)}" + (f" of {fmt_bytes(budget)} ({mem / budget:.1%})"
                                              if budget else ""))
    heavy = sorted(group_layers(plan.layers), key=lambda g: -sum(x.memory_bytes for x in g[1]))[:3]
    if heavy:
        lines.append("  largest: " + ", ".join(
            f"{name} {fmt_bytes(sum(x.memory_bytes for x in members))}" for name, members in heavy))

    # layers
    lines += ["", decisions_summary(plan)]
    lines += ["", f"layers ({len(plan.layers)} ops; layouts as SBP (placement:axis) and DTensor; "
                  f"compute and collectives per micro-batch):"]
    programs: dict[str, list[EdgeProgram]] = defaultdict(list)
    for ep in edge_programs(plan):
        programs[ep.consumer].append(ep)
    for name, members in group_layers(plan.layers):
        layer = members[0]
        count = f"  ×{len(members)}" if len(members) > 1 else ""
        stage = f"  stage {layer.stage}" if plan.stages else ""
        label = layer.strategy
        if len(members) > 1 and label.startswith("follows "):
            label = _label_key(layer, _template(layer.name)[1]).replace(".*.", ".[*].")
        lines.append(f"  {name} [{layer.kind}] {label} on mesh {fact_str(layer.output.fact)}"
                     f"{stage}{count}{decisions_text(layer)}")
        if not layer.strategy.startswith("follows "):
            for j, x in enumerate(layer.inputs):
                lines.append(f"      in{j}    {sbp_layout(x):<28} {dtensor_placements(x)}")
            if (w := layer.weight) is not None:
                lines.append(f"      weight {sbp_layout(w):<28} {dtensor_placements(w)}")
        lines.append(f"      out    {sbp_layout(layer.output):<28} {dtensor_placements(layer.output)}")
        for ep in programs[layer.name]:
            what = "export" if ep.role == "export" else f"in{ep.index} {ep.role} from {ep.producer}"
            red = ep.program
            lines.append(f"      {what}: fwd {steps_text(red.steps)}")
            if red.backward_steps:
                lines.append(f"      {' ' * len(what)}  bwd {steps_text(red.backward_steps)}")
        comm = sum(x.seconds for x in layer.collectives)
        lines.append(f"      compute {fmt_seconds(layer.compute_s)}, memory {fmt_bytes(layer.memory_bytes)}, "
                     f"{len(layer.collectives)} collective(s) {fmt_seconds(comm)}")
        if collectives:
            for coll in layer.collectives:
                lines.append(f"        - {_collective_line(coll)}")

    # collective totals
    totals = collective_totals(plan)
    lines += ["", "collectives per step (predicted by the α–β model):"]
    if totals:
        lines += text_table(["kind", "link", "purpose", "count", "bytes", "seconds"],
                        [[k, link, p, str(n), fmt_bytes(b), fmt_seconds(t)]
                         for (k, link, p), (n, b, t) in totals.items()])
    else:
        lines.append("  none")

    # cross-mesh resharding
    if plan.resharding:
        lines += ["", f"cross-mesh resharding ({len(plan.resharding)} transfers):"]
        for r in plan.resharding:
            lines.append("  " + (_generic(r) if isinstance(r, dict) else str(r)))

    # baselines
    lines += ["", "baselines (same cost model; ratio = baseline / plan, > 1 means the plan is faster):"]
    lines += _baseline_table(plan)
    return "\n".join(lines)


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


# -- diff ------------------------------------------------------------------------------------


def _flatten(d, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    if isinstance(d, dict):
        for k, v in d.items():
            key = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, dict) and v:
                out.update(_flatten(v, key))
            else:
                out[key] = v
    else:
        out[prefix] = d
    return out


def _delta(a: float, b: float, fmt) -> str:
    d = b - a
    sign = "+" if d > 0 else "-" if d < 0 else "±"
    return sign + fmt(abs(d))


def _ratio(a: float, b: float) -> str:
    return f"{b / a:.3f}" if a else "n/a"


def _strategy_key(layer: LayerPlan) -> tuple:
    return (layer.strategy, layer.inputs, layer.weight, layer.output, layer.zero,
            layer.recompute)


def diff(a: Plan, b: Plan, *, names: tuple[str, str] = ("A", "B")) -> str:
    """What differs between two plans and what it costs: configuration keys, cost per step
    (each component with its change and ratio), stages and schedule, the layers whose
    strategy changed (with their compute and collective seconds before and after),
    collective totals per kind, and the baselines."""
    na, nb = names
    lines = [f"diff {na}: {a.name}  →  {nb}: {b.name}"]

    # configuration
    fa, fb = _flatten(a.config), _flatten(b.config)
    changed = [k for k in sorted(set(fa) | set(fb))  # names are in the header already
               if k != "name" and fa.get(k, "<absent>") != fb.get(k, "<absent>")]
    lines += ["", f"configuration: {len(changed)} key(s) differ" + (":" if changed else "")]
    for k in changed:
        lines.append(f"  {k}: {fa.get(k, '<absent>')!r} → {fb.get(k, '<absent>')!r}")

    # cost
    ca, cb = a.cost, b.cost
    rows = []
    pipelined = a.schedule is not None or b.schedule is not None
    for label, x, y, fmt in (
        *([("step (makespan + exposed sync)", step_seconds(a), step_seconds(b), fmt_seconds)]
          if pipelined else []),
        ("total (no overlap)" if pipelined else "total", ca.total_s, cb.total_s, fmt_seconds),
        ("compute", ca.compute_s, cb.compute_s, fmt_seconds),
        ("activation comm", ca.activation_comm_s, cb.activation_comm_s, fmt_seconds),
        ("grad sync", ca.grad_sync_s, cb.grad_sync_s, fmt_seconds),
        ("activation bytes", ca.activation_comm_bytes, cb.activation_comm_bytes, fmt_bytes),
        ("grad sync bytes", ca.grad_sync_bytes, cb.grad_sync_bytes, fmt_bytes),
        ("memory / device", ca.peak_memory_bytes, cb.peak_memory_bytes, fmt_bytes),
    ):
        rows.append([label, fmt(x), fmt(y), _delta(x, y, fmt), _ratio(x, y)])
    lines += ["", "cost per step:"]
    lines += text_table(["", na, nb, "change", f"{nb}/{na}"], rows)
    sa, sb = step_seconds(a), step_seconds(b)
    if sa == sb:
        verdict = "equal step time"
    elif sb < sa:
        verdict = f"{nb} is {sa / sb:.3g}× faster per step" if sb else f"{nb} is faster"
    else:
        verdict = f"{nb} is {sb / sa:.3g}× slower per step" if sa else f"{nb} is slower"
    comps = sorted(((abs(y - x), lbl, y - x) for lbl, x, y in (
        ("compute", ca.compute_s, cb.compute_s),
        ("activation comm", ca.activation_comm_s, cb.activation_comm_s),
        ("grad sync", ca.grad_sync_s, cb.grad_sync_s))), reverse=True)
    if comps[0][0] > 0:
        verdict += f"; largest change: {comps[0][1]} {_delta(0, comps[0][2], fmt_seconds)}"
    lines.append(f"  → {verdict}")

    # stages / schedule
    ka, kb = stage_count(a), stage_count(b)
    lines += ["", f"stages: {ka} → {kb}" if ka != kb else f"stages: {ka} (both)"]
    for i in range(max(len(a.stages), len(b.stages))):
        x = a.stages[i] if i < len(a.stages) else None
        y = b.stages[i] if i < len(b.stages) else None
        if x != y:
            def show(st):
                if st is None:
                    return "—"
                return (f"devices {_devices_text(st.get('devices'))}, mesh {_mesh_text(st.get('mesh'))}, "
                        f"{_stage_layers_text(st.get('layers'))}")
            lines.append(f"  stage {i}: {show(x)}  →  {show(y)}")
    if a.schedule != b.schedule:
        lines.append(f"  schedule: {_generic(a.schedule) if a.schedule else '—'}  →  "
                     f"{_generic(b.schedule) if b.schedule else '—'}")

    # layers
    la = {x.name: x for x in a.layers}
    lb = {x.name: x for x in b.layers}
    only_a = [n for n in la if n not in lb]
    only_b = [n for n in lb if n not in la]
    common = [x for x in a.layers if x.name in lb]
    moved = [x for x in common if _strategy_key(x) != _strategy_key(lb[x.name])
             or x.stage != lb[x.name].stage]
    repriced = [x for x in common if x not in moved and (
        x.compute_s != lb[x.name].compute_s or x.collectives != lb[x.name].collectives
        or x.memory_bytes != lb[x.name].memory_bytes)]
    lines += ["", f"layers: {len(moved)} of {len(common)} common ops changed strategy"
                  f"{f', {len(repriced)} kept it at a different cost' if repriced else ''}; "
                  f"{len(only_a)} only in {na}, {len(only_b)} only in {nb}"]
    for tag, names_ in ((na, only_a), (nb, only_b)):
        if names_:
            shown = ", ".join(names_[:6]) + (f", … ({len(names_) - 6} more)" if len(names_) > 6 else "")
            lines.append(f"  only in {tag}: {shown}")

    def pair_key(layer: LayerPlan, index: int | None) -> tuple:
        other = lb[layer.name]
        return (_layer_signature(layer, index), _layer_signature(other, index))

    for name, members in group_layers(moved, key=pair_key):
        x = members[0]
        y = lb[x.name]
        n = len(members)
        count = f" ×{n}" if n > 1 else ""
        comm_x = sum(c.seconds for c in x.collectives)
        comm_y = sum(c.seconds for c in y.collectives)
        stage = f" (stage {x.stage} → {y.stage})" if x.stage != y.stage else ""
        index = _template(x.name)[1] if n > 1 else None
        lx = _label_key(x, index).replace(".*.", ".[*].")
        ly = _label_key(y, index).replace(".*.", ".[*].")
        lines.append(f"  {name}{count}{stage}: {lx} on {fact_str(x.output.fact)}  →  "
                     f"{ly} on {fact_str(y.output.fact)}")
        if (x.zero, x.recompute) != (y.zero, y.recompute):
            lines.append(f"      state/recompute:{decisions_text(x) or '  [replicated, kept]'}"
                         f"  →{decisions_text(y) or '  [replicated, kept]'}")
        if x.weight is not None or y.weight is not None:
            wx = "—" if x.weight is None else f"{sbp_layout(x.weight)} {dtensor_placements(x.weight)}"
            wy = "—" if y.weight is None else f"{sbp_layout(y.weight)} {dtensor_placements(y.weight)}"
            if wx != wy:
                lines.append(f"      weight {wx}  →  {wy}")
        ox = f"{sbp_layout(x.output)} {dtensor_placements(x.output)}"
        oy = f"{sbp_layout(y.output)} {dtensor_placements(y.output)}"
        if ox != oy:
            lines.append(f"      out    {ox}  →  {oy}")
        lines.append(f"      each: compute {fmt_seconds(x.compute_s)} → {fmt_seconds(y.compute_s)}, "
                     f"collectives {fmt_seconds(comm_x)} → {fmt_seconds(comm_y)} "
                     f"({_delta(comm_x + x.compute_s, comm_y + y.compute_s, fmt_seconds)} per micro-batch)")

    # collective totals
    ta, tb = collective_totals(a), collective_totals(b)
    keys = sorted(set(ta) | set(tb))
    rows = []
    for k in keys:
        xa = ta.get(k, (0, 0.0, 0.0))
        xb = tb.get(k, (0, 0.0, 0.0))
        if xa != xb:
            rows.append([" ".join(k), f"{xa[0]}", f"{xb[0]}", fmt_bytes(xa[1]), fmt_bytes(xb[1]),
                         fmt_seconds(xa[2]), fmt_seconds(xb[2]), _delta(xa[2], xb[2], fmt_seconds)])
    lines += ["", "collectives per step that differ:" if rows else "collectives per step: identical"]
    if rows:
        lines += text_table(["kind link purpose", f"n {na}", f"n {nb}", f"bytes {na}", f"bytes {nb}",
                         f"s {na}", f"s {nb}", "change"], rows)

    # resharding
    if a.resharding or b.resharding:
        ra = sum(float(r.get("seconds", 0) or 0) for r in a.resharding if isinstance(r, dict))
        rb = sum(float(r.get("seconds", 0) or 0) for r in b.resharding if isinstance(r, dict))
        lines += ["", f"cross-mesh resharding: {len(a.resharding)} → {len(b.resharding)} transfers, "
                      f"{fmt_seconds(ra)} → {fmt_seconds(rb)}"]

    # baselines
    lines += ["", "baselines (ratio = baseline / plan):"]
    fams: dict[str, list] = {}
    for tag, plan in ((0, a), (1, b)):
        mine = step_seconds(plan)
        for name, block in plan.baselines.items():
            fam = fams.setdefault(baseline_family(name), [None, None])
            if "error" in block:
                fam[tag] = f"n/a ({name})"
            else:
                total = baseline_seconds(block)
                fam[tag] = f"{total / mine:.2f} ({name})" if mine else f"n/a ({name})"
    if fams:
        lines += text_table(["baseline", na, nb], [[f, x or "—", y or "—"] for f, (x, y) in fams.items()])
    else:
        lines.append("  none priced")
    return "\n".join(lines)


def summary(plan: Plan) -> str:
    """Solver status, cost breakdown and the baselines beside it with ratios (baseline
    step time / this plan's step time)."""
    s = plan.solver
    lines = [
        f"plan {plan.name}: status {s['status']} (method {s.get('method')}), objective "
        f"{s['objective']:.6g} s, bound {_fmt(s.get('bound'))}, gap {_fmt(s.get('gap'))}, "
        f"build {s['build_s']:.2f} s, solve {s['solve_s']:.2f} s",
    ]
    if isinstance(s.get("stats"), dict):
                lines.append(f"  solver stats: {solver_stats_text(s['stats'])}")
    if s.get("message"):
        lines.append(f"  note: {s['message']}")
    if plan.schedule:
        sc = plan.schedule
        lines.append(
            f"  pipeline: {len(plan.stages)} stages "
            f"{[tuple(st['mesh']) for st in plan.stages]}, {sc['name']} with "
            f"{sc['num_microbatches']} micro-batches: makespan {sc['makespan_s']:.4g} s, "
            f"bubble {sc['bubble_fraction']:.1%}; per-device costs below are the busiest "
            f"stage's")
    header = f"  {'plan':<28}{'step s':>11}{'compute s':>11}{'act comm s':>11}" \
             f"{'grad sync s':>12}{'memory GiB':>11}{'ratio':>8}"
    lines.append(header)
    mine = plan.step_s

    def row(name: str, c: CostBreakdown, step: float) -> str:
        ratio = step / mine if mine else float("nan")
        return (f"  {name:<28}{step:>11.4g}{c.compute_s:>11.4g}{c.activation_comm_s:>11.4g}"
                f"{c.grad_sync_s:>12.4g}{c.peak_memory_bytes / 2**30:>11.2f}{ratio:>8.2f}")

    lines.append(row("ilp_planner", plan.cost, mine))
    for name, b in plan.baselines.items():
        if "error" in b:
            lines.append(f"  {name:<28}n/a: {b['error']}")
        else:
            lines.append(row(name, CostBreakdown.from_dict(b), baseline_seconds(b)))
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.4g}"
