"""A sweep's PNG plots: one metric against one swept key (matplotlib, optional).

Zipped keys move together, so a key zipped with ``x`` (or ``series``) makes no lines of its
own; every other varying key makes lines (without ``series``) or panels (with it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ilp_planner.sweeps.points import finite_or_none, short_text
from ilp_planner.sweeps.spec import PlotSpec

Row = Mapping[str, Any]


def plot_rows(rows: Sequence[Row], ps: PlotSpec, keys: Sequence[str], path: Path,
              title: str = "", zipped: Sequence[str] = ()) -> Path | None:
    """Draw ``ps.metric`` against ``ps.x`` into ``path`` (PNG, matplotlib's Agg canvas, no
    pyplot state). Failed points are left out (and counted in the title). Returns None when
    no point has the metric."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    good = [r for r in rows if not r.get("error") and finite_or_none(r.get(ps.metric)) is not None]
    if not good:
        return None
    varying = [k for k in keys if len({json.dumps(_value(r, k), sort_keys=True)
                                        for r in rows}) > 1]
    tied = set(zipped) if (ps.x in zipped or ps.series in zipped) else set()
    others = [k for k in varying if k not in (ps.x, ps.series) and k not in tied]
    line_keys = [ps.series] if ps.series else others
    facet_keys = others if ps.series else []
    facets: dict[str, list] = {}
    for r in good:
        facets.setdefault(_label(r, facet_keys), []).append(r)
    axis = _XAxis.of(good, ps)

    n = len(facets)
    ncols = min(n, 3)
    nrows = -(-n // ncols)
    fig = Figure(figsize=(5.2 * ncols, 3.8 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    for i, (facet, frows) in enumerate(facets.items()):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        _draw_panel(ax, frows, ps, line_keys, axis)
        if facet:
            ax.set_title(facet, fontsize=9)
    failed = len(rows) - len(good)
    fig.suptitle(f"{title}: {ps.metric} vs {ps.x}" + (f" ({failed} point(s) failed, not shown)"
                                                      if failed else ""), fontsize=10)
    fig.savefig(path, dpi=110)
    return path


@dataclass(frozen=True)
class _XAxis:
    """The x values of the plotted points: numbers (log scale when they span ≥ 8×, unless
    the plot says) or categories in first-seen order."""

    values: tuple[Any, ...]
    numeric: bool
    categories: tuple[str, ...]
    log: bool

    @classmethod
    def of(cls, good: Sequence[Row], ps: PlotSpec) -> _XAxis:
        xs = tuple(_value(r, ps.x) for r in good)
        numeric = all(isinstance(x, int | float) and not isinstance(x, bool) for x in xs)
        categories: list[str] = []
        if not numeric:
            for x in xs:
                if short_text(x) not in categories:
                    categories.append(short_text(x))
        log = ps.logx
        if log is None:
            log = numeric and min(xs) > 0 and max(xs) / min(xs) >= 8
        return cls(xs, numeric, tuple(categories), bool(log))

    def position(self, x: Any) -> Any:
        return x if self.numeric else self.categories.index(short_text(x))


def _draw_panel(ax: Any, rows: Sequence[Row], ps: PlotSpec, line_keys: Sequence[str],
                axis: _XAxis) -> None:
    """One panel: a line per combination of ``line_keys``."""
    lines: dict[str, list] = {}
    for r in rows:
        lines.setdefault(_label(r, line_keys), []).append(r)
    for name, lrows in lines.items():
        pts = sorted((axis.position(_value(r, ps.x)), float(r[ps.metric])) for r in lrows)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name or None)
    if axis.log:
        ax.set_xscale("log")
    if not axis.numeric:
        ax.set_xticks(range(len(axis.categories)), list(axis.categories))
    elif len(set(axis.values)) <= 12:
        ticks = sorted(set(axis.values))
        ax.set_xticks(ticks, [short_text(t) for t in ticks])
        ax.minorticks_off()
    ax.set_xlabel(ps.x)
    ax.set_ylabel(ps.metric)
    if any(lines):
        ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)


def _value(row: Row, key: str) -> Any:
    return (row.get("overrides") or {}).get(key)


def _label(row: Row, keys: Sequence[str]) -> str:
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={short_text(_value(row, k))}" for k in keys)
