"""A pipelined plan's stages in full and compactly: per stage its layer range (blocks, and
the embedding or head it holds), sub-mesh shape, placement, its intra-op strategies, the
blocks it recomputes and its time per micro-batch; consecutive stages alike but for their
range (and time) run-length encoded into one line. ``benchmarks/published_runs.py`` prints it for every
row's plan, where one line per stage of a 64-stage plan would bury the differences."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from ilp_planner.ir.graph import Graph
from ilp_planner.plan.data import LayerPlan, Plan, Stage


def _blocks(graph: Graph, stage: Stage) -> tuple[int | None, int | None, str]:
    """First and last block index of ``stage`` and what outside blocks it holds."""
    idx = [graph[n].block_index for n in stage.layers if n in graph]
    blocks = [b for b in idx if b is not None]
    extra = []
    if idx and idx[0] is None:
        extra.append("embedding")
    if idx and idx[-1] is None:
        extra.append("head")
    return (min(blocks) if blocks else None, max(blocks) if blocks else None,
            " + ".join(extra))


def _strategies(layers: Sequence[LayerPlan], top: int = 2) -> str:
    """The stage's most used deciding strategies, e.g. ``S(1)S(0)×48, RS(0)×24``."""
    counts = Counter(ly.strategy for ly in layers if not ly.strategy.startswith("follows"))
    parts = [f"{s}×{n}" for s, n in counts.most_common(top)]
    if len(counts) > top:
        parts.append(f"+{len(counts) - top} more")
    return ", ".join(parts) or "no deciding layers"


def _describe(graph: Graph, plan: Plan, stage: Stage) -> tuple[tuple, str]:
    """The stage's run key (all but its position) and its range text."""
    mine = [ly for ly in plan.layers if ly.stage == stage.index]
    first, last, extra = _blocks(graph, stage)
    count = 0 if first is None or last is None else last - first + 1
    recomputed = len({graph[ly.name].block_index for ly in mine
                      if ly.recompute and ly.name in graph
                      and graph[ly.name].block_index is not None})
    key = (count, extra, stage.mesh, _strategies(mine), recomputed)
    rng = "" if first is None else f"{first}-{last}" if last != first else f"{first}"
    return key, rng


def _per_microbatch(stages: Sequence[Stage]) -> str:
    """The stages' forward + backward time per micro-batch, a range where they differ
    (their boundary transfers and in-flight counts differ by position)."""
    times = [s.times.forward_s + s.times.backward_s for s in stages if s.times]
    if not times:
        return ""
    lo, hi = min(times) * 1e3, max(times) * 1e3
    return f", {lo:.4g} ms per micro-batch" if f"{lo:.4g}" == f"{hi:.4g}" else \
        f", {lo:.4g}-{hi:.4g} ms per micro-batch"


def stage_lines(plan: Plan, graph: Graph) -> list[str]:
    """The plan's schedule and its stages, consecutive alike stages on one line (module
    docstring); empty for a plan on one mesh."""
    if not plan.stages or plan.schedule is None:
        return []
    sched = plan.schedule
    v = sched.virtual_stages
    p = len(plan.stages) // v
    out = [f"schedule {sched.name}, {sched.num_microbatches} micro-batches, {p} stage meshes"
           + (f" × {v} chunks (chunk j on mesh j mod {p})" if v > 1 else "")]
    rows = [(s, *_describe(graph, plan, s)) for s in plan.stages]
    i = 0
    while i < len(rows):
        j = i
        while j + 1 < len(rows) and rows[j + 1][1] == rows[i][1]:
            j += 1
        s, key, _ = rows[i]
        count, extra, mesh, strategies, recomputed = key
        ranges = rows[i][2] if i == j else f"{rows[i][2].split('-')[0]}-{rows[j][2].split('-')[-1]}"
        what = "chunk" if v > 1 else "stage"
        head = f"{what} {i}" if i == j else f"{what}s {i}-{j} (×{j - i + 1})"
        out.append(
            f"{head}: blocks {ranges or 'none'}"
            + (f" ({count} each)" if i != j and count else "") + (f" + {extra}" if extra else "")
            + f", mesh {mesh[0]}×{mesh[1]}"
            + (f" from device {s.devices[0]}" if i == j else "")
            + f", {strategies}, recompute {recomputed} of {count} blocks"
            + _per_microbatch([r[0] for r in rows[i:j + 1]]))
        i = j + 1
    return out
