"""Sweep files: what ``ilp-planner sweep`` reads, parsed and checked before any point runs.

A sweep file names a base configuration and the dotted keys to vary::

    name: gpt-size-x-devices           # optional; defaults to the file stem
    base: ../gpt-2.6b-2x4.yaml         # path relative to the sweep file, or an inline mapping
    grid:                              # cartesian product (the last key varies fastest)
      model.layers: [4, 8]
      cluster.nodes: [1, 2]
    zip:                               # optional: lists of equal length advanced together;
      cluster.links.inter.bandwidth_gbps: [10, 25, 100]    # the product with the grid
      cluster.links.inter.latency_us: [20, 10, 5]
    solve:                             # optional
      baselines: true                  # price the baselines (the ratio_* columns need them)
      timeout_s: null                  # wall-clock limit per point; over it the point fails
      memory_gib: null                 # memory a point reserves on a Ray cluster (ray backend)
    plot:                              # optional: one mapping or a list of them
      metric: step_s                   # a numeric result column (see METRICS, or ratio_<baseline>)
      x: cluster.nodes                 # a swept key
      series: model.layers             # optional swept key: one line per value

Points. With grid lists ``G_1 … G_k`` and zip length ``Z`` (1 without ``zip``) there are
``|G_1| · … · |G_k| · Z`` points; point ``i`` sets every swept key at once on a deep copy
of the base document (:func:`ilp_planner.inputs.config.apply_overrides`) and re-parses it with the
full validation of a configuration file. Its identity is the canonical JSON of its
overrides, so a point keeps its identity when the grid around it grows.

Validation. Keys are checked when the sweep is loaded: a key the configuration schema does
not have (``model.layerz``) is a :class:`~ilp_planner.errors.ConfigError` naming the sweep
file and ``grid.model.layerz``. Values are checked per point: a bad value (``layers: 0``),
an infeasible point (the memory lower bound above the budget), a time-out or any other
failure is recorded in that point's row (``status`` + ``error``) and the sweep goes on.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ilp_planner.errors import ConfigError
from ilp_planner.inputs.config import apply_overrides, load_config, parse_config, read_yaml
from ilp_planner.inputs.config_keys import MAX_SECONDS, PHYSICAL_MAX
from ilp_planner.inputs.limits import check_limit
from ilp_planner.inputs.schema import Reader, join, show
from ilp_planner.plan.data import PLAN_VERSION
from ilp_planner.sweeps.points import Point, file_safe

# Numeric result columns a plot may use (besides ratio_<baseline family>).
METRICS = (
    "step_s", "total_s", "compute_s", "comm_s", "activation_comm_s", "grad_sync_s",
    "activation_comm_bytes", "grad_sync_bytes", "peak_memory_gib", "memory_fraction",
    "objective_s", "gap", "build_s", "solve_s", "wall_s", "stages", "devices",
    "bubble_fraction",
)
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_UNKNOWN_KEY = re.compile(r"unknown key '|is not a mapping")


@dataclass(frozen=True)
class PlotSpec:
    """One PNG: ``metric`` against the swept key ``x``, one line per ``series`` value (or
    per combination of the other swept keys when ``series`` is None); with ``series`` set,
    each combination of the remaining swept keys gets its own panel."""

    metric: str
    x: str
    series: str | None = None
    logx: bool | None = None  # None: log scale when x is positive and spans ≥ 8×

    @property
    def filename(self) -> str:
        return file_safe(f"{self.metric}_vs_{self.x}") + ".png"


@dataclass(frozen=True)
class SweepSpec:
    """A parsed sweep file (see the module docstring). ``base`` is the raw configuration
    document, already validated; ``grid`` and ``zipped`` keep the key order of the file."""

    name: str
    base: dict
    grid: tuple[tuple[str, tuple], ...] = ()
    zipped: tuple[tuple[str, tuple], ...] = ()
    baselines: bool = True
    timeout_s: float | None = None
    plots: tuple[PlotSpec, ...] = ()
    source: str | None = None
    base_source: str | None = None
    memory_gib: float | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.grid) + tuple(k for k, _ in self.zipped)

    def points(self) -> list[Point]:
        """Grid product (last key fastest), each combined with every zip position."""
        zlen = len(self.zipped[0][1]) if self.zipped else 1
        out: list[Point] = []
        for combo in itertools.product(*(values for _, values in self.grid)):
            for j in range(zlen):
                ov = {k: v for (k, _), v in zip(self.grid, combo, strict=True)}
                ov.update({k: values[j] for k, values in self.zipped})
                out.append(Point(len(out), ov))
        return out

    @property
    def fingerprint(self) -> str:
        """Hash of what decides a point's result besides its overrides: a resumed run
        keeps only rows with the same fingerprint."""

        doc = {"base": self.base, "baselines": self.baselines, "plan_version": PLAN_VERSION}
        return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_sweep(path: str | Path, max_points: int | None = None) -> SweepSpec:
    """Read and validate a sweep file (see the module docstring)."""
    return parse_sweep(read_yaml(path), str(path), max_points)


def parse_sweep(data: Mapping[str, Any], source: str | None = None,
                max_points: int | None = None) -> SweepSpec:
    """Validate a parsed sweep document. ``base`` paths are relative to ``source``'s folder
    (the working directory for in-memory documents). More points than ``max_points``
    (default :data:`ilp_planner.inputs.limits.LIMITS`) is an error, counted before any is built."""
    r = Reader(source)
    top = r.mapping(data, "", required=("base",), optional=("name", "grid", "zip", "solve", "plot"))
    base_value = top["base"]
    if isinstance(base_value, str):
        folder = Path(source).parent if source else Path(".")
        base_path = Path(base_value) if Path(base_value).is_absolute() else folder / base_value
        try:
            base_cfg = load_config(base_path)
        except ConfigError as exc:
            r.fail("base", f"the base configuration does not load: {exc}")
        base_source = str(base_path)
    elif isinstance(base_value, Mapping):
        base_cfg = parse_config(base_value, source)
        base_source = source
    else:
        r.fail("base", f"expected a configuration file path or an inline configuration mapping, "
                       f"got {show(base_value)}")
    base = base_cfg.raw
    if "name" in top:
        name = r.string(top["name"], "name")
    else:
        name = Path(source).stem if source else base_cfg.name

    grid = _axes(r, top.get("grid"), "grid")
    zipped = _axes(r, top.get("zip"), "zip")
    for key, _ in zipped:
        if key in dict(grid):
            r.fail(join("zip", key), f"{key!r} is swept in both grid and zip; keep it in one")
    if zipped:
        lengths = {k: len(v) for k, v in zipped}
        if len(set(lengths.values())) > 1:
            r.fail("zip", "zipped lists must have equal lengths, got "
                          + ", ".join(f"{k}: {n}" for k, n in lengths.items()))
    count = math.prod(len(v) for _, v in grid) * (len(zipped[0][1]) if zipped else 1)
    check_limit("points", count, "the number of sweep points", source=source, key="grid",
                bound=max_points, how="--max-points" if max_points is not None else None)

    solve = {} if top.get("solve") is None else r.mapping(
        top["solve"], "solve", optional=("baselines", "timeout_s", "memory_gib"))
    baselines = r.boolean(solve["baselines"], "solve.baselines") if "baselines" in solve else True
    timeout_s = memory_gib = None
    if solve.get("timeout_s") is not None:
        timeout_s = r.number(solve["timeout_s"], "solve.timeout_s", positive=True,
                             at_most=MAX_SECONDS)  # the alarm clock's range, as the solver's
    if solve.get("memory_gib") is not None:
        memory_gib = r.number(solve["memory_gib"], "solve.memory_gib", positive=True,
                              at_most=PHYSICAL_MAX)

    spec = SweepSpec(name, base, grid, zipped, baselines, timeout_s, (), source, base_source,
                     memory_gib)
    _check_keys(spec)
    return replace(spec, plots=_plots(r, top.get("plot"), spec.keys))


def _axes(r: Reader, value: Any, section: str) -> tuple[tuple[str, tuple], ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        r.fail(section, f"expected a mapping of dotted configuration keys to lists of values, "
                        f"got {show(value)}")
    out = []
    for key, values in value.items():
        path = join(section, str(key))
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            r.fail(path, f"expected a dotted configuration key such as 'cluster.nodes', got "
                         f"{show(key)}")
        out.append((key, tuple(r.sequence(values, path, min_len=1))))
    return tuple(out)


def _check_keys(spec: SweepSpec) -> None:
    """Reject keys the configuration schema does not have, naming the sweep key. A key is
    tried alone with its first value and, if that fails, together with the first point's
    other overrides (a key may exist only under another swept value, e.g. ``model.dims``
    once ``model.kind`` is ``mlp``). Value errors are left to the points."""
    points = spec.points()
    if not points:
        return
    first = points[0].overrides

    def unknown(overrides: dict[str, Any], key: str) -> ConfigError | None:
        try:
            parse_config(apply_overrides(spec.base, overrides), spec.base_source)
        except ConfigError as exc:
            k = exc.key or ""
            if k and (key == k or key.startswith(k + ".")) and _UNKNOWN_KEY.search(str(exc)):
                return exc
        return None

    for key in spec.keys:
        exc = unknown({key: first[key]}, key) and unknown(first, key)
        if exc is not None:
            section = "grid" if key in dict(spec.grid) else "zip"
            detail = str(exc).split(": ", 1)[1] if spec.base_source and str(exc).startswith(
                spec.base_source) else str(exc)
            raise ConfigError(f"{key!r} is not a configuration key ({detail})",
                              source=spec.source, key=join(section, key))


def _plots(r: Reader, value: Any, keys: tuple[str, ...]) -> tuple[PlotSpec, ...]:
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    out = []
    for i, item in enumerate(items):
        path = "plot" if not isinstance(value, list) else join("plot", i)
        d = r.mapping(item, path, required=("x",), optional=("metric", "series", "logx"))
        metric = d.get("metric", "step_s")
        check_metric(metric, source=r.source, key=join(path, "metric"))
        for k in ("x", "series"):
            if k in d and d[k] is not None and d[k] not in keys:
                r.fail(join(path, k), f"{d[k]!r} is not a swept key; swept keys: {', '.join(keys)}")
        if d.get("series") is not None and d["series"] == d["x"]:
            r.fail(join(path, "series"), "series and x must be different keys")
        logx = r.boolean(d["logx"], join(path, "logx")) if d.get("logx") is not None else None
        out.append(PlotSpec(metric, d["x"], d.get("series"), logx))
    return tuple(out)


def check_metric(metric: Any, source: str | None = None, key: str | None = None) -> None:
    if not isinstance(metric, str) or not (metric in METRICS or re.fullmatch(r"ratio_\w+", metric)):
        raise ConfigError(f"unknown metric {show(metric)}; expected one of {', '.join(METRICS)} "
                          f"or ratio_<baseline> (e.g. ratio_megatron)", source=source, key=key)
