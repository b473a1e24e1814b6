"""What differs between two plans and what it costs (the ``diff`` verb).

Pure, like :func:`~ilp_planner.reports.explain.explain`: every figure is one the plans carry.
The report is a list of sections, each built by its own function from the two plans:
configuration keys, cost per step with a verdict, stages and schedule, the layers whose
strategy changed, collective totals per kind, cross-mesh resharding and the baselines.
"""

from __future__ import annotations

from collections.abc import Callable

from ilp_planner.ir.cluster import fact_str
from ilp_planner.plan.data import LayerPlan, Plan, ReshardingEntry, Stage, baseline_seconds
from ilp_planner.reports.explain import (
    baseline_family,
    collective_totals,
    decisions_text,
    devices_text,
    dtensor_placements,
    fmt_bytes,
    fmt_seconds,
    group_layers,
    label_key,
    layer_signature,
    mesh_text,
    name_template,
    record_text,
    sbp_layout,
    stage_count,
    stage_layers_text,
    step_seconds,
    text_table,
)


def diff(a: Plan, b: Plan, *, names: tuple[str, str] = ("A", "B")) -> str:
    """What differs between two plans and what it costs: configuration keys, cost per step
    (each component with its change and ratio), stages and schedule, the layers whose
    strategy changed (with their compute and collective seconds before and after),
    collective totals per kind, cross-mesh resharding and the baselines."""
    na, nb = names
    sections = [[f"diff {na}: {a.name}  →  {nb}: {b.name}"], _config_lines(a, b),
                _cost_lines(a, b, names), _stage_lines(a, b), _layer_lines(a, b, names),
                _collective_lines(a, b, names), _resharding_lines(a, b),
                _baseline_lines(a, b, names)]
    return "\n\n".join("\n".join(lines) for lines in sections if lines)


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


def _delta(a: float, b: float, fmt: Callable[[float], str]) -> str:
    d = b - a
    sign = "+" if d > 0 else "-" if d < 0 else "±"
    return sign + fmt(abs(d))


def _ratio(a: float, b: float) -> str:
    return f"{b / a:.3f}" if a else "n/a"


def _config_lines(a: Plan, b: Plan) -> list[str]:
    """The configuration keys that differ (the plan names are in the header already)."""
    fa, fb = _flatten(a.config), _flatten(b.config)
    changed = [k for k in sorted(set(fa) | set(fb))
               if k != "name" and fa.get(k, "<absent>") != fb.get(k, "<absent>")]
    return [f"configuration: {len(changed)} key(s) differ" + (":" if changed else ""),
            *(f"  {k}: {fa.get(k, '<absent>')!r} → {fb.get(k, '<absent>')!r}" for k in changed)]


def _cost_lines(a: Plan, b: Plan, names: tuple[str, str]) -> list[str]:
    """Each cost component of both plans with its change and ratio, then the verdict."""
    na, nb = names
    ca, cb = a.cost, b.cost
    pipelined = a.schedule is not None or b.schedule is not None
    rows = [[label, fmt(x), fmt(y), _delta(x, y, fmt), _ratio(x, y)] for label, x, y, fmt in (
        *([("step (makespan + exposed sync)", step_seconds(a), step_seconds(b), fmt_seconds)]
          if pipelined else []),
        ("total (no overlap)" if pipelined else "total", ca.total_s, cb.total_s, fmt_seconds),
        ("compute", ca.compute_s, cb.compute_s, fmt_seconds),
        ("activation comm", ca.activation_comm_s, cb.activation_comm_s, fmt_seconds),
        ("grad sync", ca.grad_sync_s, cb.grad_sync_s, fmt_seconds),
        ("activation bytes", ca.activation_comm_bytes, cb.activation_comm_bytes, fmt_bytes),
        ("grad sync bytes", ca.grad_sync_bytes, cb.grad_sync_bytes, fmt_bytes),
        ("memory / device", ca.peak_memory_bytes, cb.peak_memory_bytes, fmt_bytes),
    )]
    return ["cost per step:", *text_table(["", na, nb, "change", f"{nb}/{na}"], rows),
            f"  → {_verdict(a, b, nb)}"]


def _verdict(a: Plan, b: Plan, nb: str) -> str:
    """Which plan is faster per step and by how much, and the component that moved most."""
    sa, sb = step_seconds(a), step_seconds(b)
    if sa == sb:
        verdict = "equal step time"
    elif sb < sa:
        verdict = f"{nb} is {sa / sb:.3g}× faster per step" if sb else f"{nb} is faster"
    else:
        verdict = f"{nb} is {sb / sa:.3g}× slower per step" if sa else f"{nb} is slower"
    ca, cb = a.cost, b.cost
    comps = sorted(((abs(y - x), lbl, y - x) for lbl, x, y in (
        ("compute", ca.compute_s, cb.compute_s),
        ("activation comm", ca.activation_comm_s, cb.activation_comm_s),
        ("grad sync", ca.grad_sync_s, cb.grad_sync_s))), reverse=True)
    if comps[0][0] > 0:
        verdict += f"; largest change: {comps[0][1]} {_delta(0, comps[0][2], fmt_seconds)}"
    return verdict


def _stage_text(st: Stage | None) -> str:
    if st is None:
        return "—"
    return f"devices {devices_text(st.devices)}, mesh {mesh_text(st.mesh)}, {stage_layers_text(st.layers)}"


def _stage_lines(a: Plan, b: Plan) -> list[str]:
    """The stage counts, each stage that differs, and the schedules where they differ."""
    ka, kb = stage_count(a), stage_count(b)
    lines = [f"stages: {ka} → {kb}" if ka != kb else f"stages: {ka} (both)"]
    for i in range(max(len(a.stages), len(b.stages))):
        x = a.stages[i] if i < len(a.stages) else None
        y = b.stages[i] if i < len(b.stages) else None
        if x != y:
            lines.append(f"  stage {i}: {_stage_text(x)}  →  {_stage_text(y)}")
    if a.schedule != b.schedule:
        lines.append(f"  schedule: {record_text(a.schedule.to_dict()) if a.schedule else '—'}  →  "
                     f"{record_text(b.schedule.to_dict()) if b.schedule else '—'}")
    return lines


def _strategy_key(layer: LayerPlan) -> tuple:
    return (layer.strategy, layer.inputs, layer.weight, layer.output, layer.zero,
            layer.recompute)


def _layer_lines(a: Plan, b: Plan, names: tuple[str, str]) -> list[str]:
    """How many common ops changed strategy or only price, the ops only one plan has, and
    each changed op (repeated blocks folded) before and after."""
    na, nb = names
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
    lines = [f"layers: {len(moved)} of {len(common)} common ops changed strategy"
             f"{f', {len(repriced)} kept it at a different cost' if repriced else ''}; "
             f"{len(only_a)} only in {na}, {len(only_b)} only in {nb}"]
    for tag, names_ in ((na, only_a), (nb, only_b)):
        if names_:
            shown = ", ".join(names_[:6]) + (f", … ({len(names_) - 6} more)" if len(names_) > 6 else "")
            lines.append(f"  only in {tag}: {shown}")

    def pair_key(layer: LayerPlan, index: int | None) -> tuple:
        return (layer_signature(layer, index), layer_signature(lb[layer.name], index))

    for name, members in group_layers(moved, key=pair_key):
        lines += _moved_layer_lines(name, members, lb[members[0].name])
    return lines


def _moved_layer_lines(name: str, members: list[LayerPlan], y: LayerPlan) -> list[str]:
    """One changed op (or a folded group of them, ``members``; ``y`` the first one's
    counterpart): strategy, state decisions, weight and output layouts, and seconds."""
    x, n = members[0], len(members)
    count = f" ×{n}" if n > 1 else ""
    stage = f" (stage {x.stage} → {y.stage})" if x.stage != y.stage else ""
    index = name_template(x.name)[1] if n > 1 else None
    lx = label_key(x, index).replace(".*.", ".[*].")
    ly = label_key(y, index).replace(".*.", ".[*].")
    lines = [f"  {name}{count}{stage}: {lx} on {fact_str(x.output.fact)}  →  "
             f"{ly} on {fact_str(y.output.fact)}"]
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
    comm_x = sum(c.seconds for c in x.collectives)
    comm_y = sum(c.seconds for c in y.collectives)
    lines.append(f"      each: compute {fmt_seconds(x.compute_s)} → {fmt_seconds(y.compute_s)}, "
                 f"collectives {fmt_seconds(comm_x)} → {fmt_seconds(comm_y)} "
                 f"({_delta(comm_x + x.compute_s, comm_y + y.compute_s, fmt_seconds)} per micro-batch)")
    return lines


def _collective_lines(a: Plan, b: Plan, names: tuple[str, str]) -> list[str]:
    """The collective totals per step (kind, link, purpose) that differ."""
    na, nb = names
    ta, tb = collective_totals(a), collective_totals(b)
    rows = []
    for k in sorted(set(ta) | set(tb)):
        xa = ta.get(k, (0, 0.0, 0.0))
        xb = tb.get(k, (0, 0.0, 0.0))
        if xa != xb:
            rows.append([" ".join(k), f"{xa[0]}", f"{xb[0]}", fmt_bytes(xa[1]), fmt_bytes(xb[1]),
                         fmt_seconds(xa[2]), fmt_seconds(xb[2]), _delta(xa[2], xb[2], fmt_seconds)])
    if not rows:
        return ["collectives per step: identical"]
    return ["collectives per step that differ:",
            *text_table(["kind link purpose", f"n {na}", f"n {nb}", f"bytes {na}", f"bytes {nb}",
                         f"s {na}", f"s {nb}", "change"], rows)]


def resharding_seconds(entries: list[ReshardingEntry]) -> float | None:
    """Seconds per micro-batch the solved cross-mesh transfers take, forward makespans plus
    their gradients' backward makespans; None when an entry was not solved (a hand-built
    plan's tasks carry no makespan)."""
    total = 0.0
    for e in entries:
        if e.transfer is None:
            return None
        total += e.transfer.makespan_s + e.transfer.backward_makespan_s
    return total


def _resharding_lines(a: Plan, b: Plan) -> list[str]:
    if not (a.resharding or b.resharding):
        return []
    return [f"cross-mesh resharding: {len(a.resharding)} → {len(b.resharding)} transfers, "
            f"{fmt_seconds(resharding_seconds(a.resharding))} → "
            f"{fmt_seconds(resharding_seconds(b.resharding))} per micro-batch (forward + backward)"]


def _baseline_lines(a: Plan, b: Plan, names: tuple[str, str]) -> list[str]:
    """Per baseline family, each plan's ratio (baseline step / plan step)."""
    na, nb = names
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
    if not fams:
        return ["baselines (ratio = baseline / plan):", "  none priced"]
    return ["baselines (ratio = baseline / plan):",
            *text_table(["baseline", na, nb], [[f, x or "—", y or "—"] for f, (x, y) in fams.items()])]
