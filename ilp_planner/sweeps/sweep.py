"""Batch solves over YAML grids: ``ilp-planner sweep`` and :func:`sweep`.

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

Execution. A backend (:mod:`ilp_planner.sweeps.backends`) runs the worker entry point
:func:`solve_point`, a top-level function of plain data: ``local`` in worker processes of
this machine (``concurrent.futures`` with the *spawn* start method, so no solver state is
inherited through fork), ``ray`` as one Ray task per point on a Ray cluster. A worker
returns its point's row and its plan as JSON text; this process alone writes the files, so
workers need no file system shared with it and both backends leave the same folder.
Solving is deterministic (CBC with one thread and a fixed seed, seeded warm starts), so
results from workers equal a serial run's except for the timing columns. A progress bar on
stderr shows done / total, failures, elapsed time and ETA = elapsed / solved_this_run ×
remaining.

Results, in the output folder: ``results.jsonl`` (one JSON row per point, appended as
points finish, rewritten sorted at the end), ``results.csv`` and ``results.md`` (the same
rows as tables: one column per swept key), ``plans/<point>.json`` and the PNG plots.
``resume=True`` keeps every row of the current sweep whose base configuration and solve
options are unchanged (a fingerprint in each row) and whose plan file still exists, and
solves only the others; ``retry_failed=True`` also re-solves recorded failures.

Row columns: the overrides; ``status`` (the solver's, or ``config_error`` / ``infeasible``
/ ``timeout`` / ``error``) and ``error``; ``method``, ``objective_s``, ``gap``,
``build_s``, ``solve_s``, ``wall_s``; the cost breakdown (``step_s`` = the schedule's
makespan plus its exposed gradient synchronisation for pipelined plans, else
``total_s``); ``peak_memory_gib`` and ``memory_fraction`` of the budget; ``stages`` =
max(1, len(plan.stages)); ``layout`` (a one-line summary); ``ratio_<baseline>`` =
baseline total / plan ``step_s`` (> 1: the plan is faster); ``plan`` (path relative to the
output folder).
"""

from __future__ import annotations

import csv
import hashlib
import io
import itertools
import json
import math
import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from ilp_planner.errors import ConfigError
from ilp_planner.inputs.config import apply_overrides, load_config, parse_config, read_yaml
from ilp_planner.inputs.files import prepare_output, read_input
from ilp_planner.inputs.limits import check_limit
from ilp_planner.inputs.schema import Reader, join, show
from ilp_planner.plan.data import PLAN_VERSION, Plan
from ilp_planner.reports.explain import (
    fmt_seconds,
    text_table,
)
from ilp_planner.sweeps.backends import make_backend
from ilp_planner.sweeps.points import (
    Point,
    PointOutcome,
    PointTask,
    _num,
    _safe,
    _short,
)

RESULTS_JSONL = "results.jsonl"
RESULTS_CSV = "results.csv"
RESULTS_MD = "results.md"
PLANS_DIR = "plans"

# Numeric result columns a plot may use (besides ratio_<baseline family>).
METRICS = (
    "step_s", "total_s", "compute_s", "comm_s", "activation_comm_s", "grad_sync_s",
    "activation_comm_bytes", "grad_sync_bytes", "peak_memory_gib", "memory_fraction",
    "objective_s", "gap", "build_s", "solve_s", "wall_s", "stages", "devices",
    "bubble_fraction",
)
# Columns that depend on wall-clock time: excluded when comparing runs.
TIMING_COLUMNS = ("build_s", "solve_s", "wall_s")
_ROW_HEAD = ("status", "error", "method", "objective_s", "gap", "build_s", "solve_s", "wall_s",
             "step_s", "total_s", "compute_s", "comm_s", "activation_comm_s", "grad_sync_s",
             "activation_comm_bytes", "grad_sync_bytes", "peak_memory_gib", "memory_fraction",
             "stages", "devices", "microbatches", "bubble_fraction", "layout")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_UNKNOWN_KEY = re.compile(r"unknown key '|is not a mapping")




# -- the sweep file --------------------------------------------------------------------------


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
        return _safe(f"{self.metric}_vs_{self.x}") + ".png"




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
        timeout_s = r.number(solve["timeout_s"], "solve.timeout_s", positive=True)
    if solve.get("memory_gib") is not None:
        memory_gib = r.number(solve["memory_gib"], "solve.memory_gib", positive=True)

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


# -- one point (runs in a worker process) ----------------------------------------------------


















# -- progress --------------------------------------------------------------------------------


def format_progress(done: int, total: int, failed: int, elapsed_s: float, eta_s: float | None,
                    width: int = 24, label: str = "sweep") -> str:
    """``sweep  3/9 [########----------------]  33%  1 failed  elapsed 0:12  ETA 0:24``."""
    frac = done / total if total else 1.0
    filled = int(round(frac * width))
    bar = "#" * filled + "-" * (width - filled)
    eta = "?" if eta_s is None else _clock(eta_s)
    return (f"{label} {done:>{len(str(total))}}/{total} [{bar}] {frac:4.0%}  {failed} failed  "
            f"elapsed {_clock(elapsed_s)}  ETA {eta}")


def _clock(s: float) -> str:
    s = max(0, int(round(s)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class Progress:
    """A one-line progress bar on a stream (stderr). On a terminal it redraws in place; on
    a pipe or file it writes one line per finished point."""

    def __init__(self, total: int, *, done: int = 0, failed: int = 0, stream: TextIO | None = None,
                 enabled: bool = True, label: str = "sweep"):
        self.total, self.done, self.failed = total, done, failed
        self.solved = 0
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.label = label
        self.start = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._draw(final=False)

    def update(self, failed: bool) -> None:
        self.done += 1
        self.solved += 1
        self.failed += int(failed)
        self._draw(final=False)

    def note(self, text: str) -> None:
        """A message between progress lines (a retried point): on a terminal it replaces the
        bar, which is redrawn below it."""
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + text.ljust(len(self.line())) + "\n")
            self._draw(final=False)
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def line(self) -> str:
        elapsed = time.monotonic() - self.start
        remaining = self.total - self.done
        eta = elapsed / self.solved * remaining if self.solved else (0.0 if not remaining else None)
        return format_progress(self.done, self.total, self.failed, elapsed, eta, label=self.label)

    def _draw(self, final: bool) -> None:
        if not self.enabled:
            return
        if self.tty:
            self.stream.write("\r" + self.line())
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()


# -- running a sweep -------------------------------------------------------------------------


@dataclass
class SweepResult:
    """Rows of every point of the sweep (by point index) and where they were written."""

    spec: SweepSpec
    output: Path
    rows: list[dict[str, Any]]
    solved: int = 0
    skipped: int = 0
    plots: list[Path] = field(default_factory=list)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r.get("error")]

    @property
    def csv_path(self) -> Path:
        return self.output / RESULTS_CSV

    @property
    def jsonl_path(self) -> Path:
        return self.output / RESULTS_JSONL

    def table(self, max_layout: int = 60) -> str:
        """The results as a text table (what ``ilp-planner sweep`` prints)."""
        return results_table(self.rows, self.spec.keys, max_layout=max_layout)

    def load_plan(self, row: Mapping[str, Any]):
        return Plan.load(self.output / row["plan"])


def sweep(spec: SweepSpec | str | Path, output: str | Path | None = None, *, jobs: int | None = None,
          backend: str = "local", address: str | None = None, resume: bool = False,
          retry_failed: bool = False, progress: bool = True,
          plots: bool | Sequence[PlotSpec] = True, stream: TextIO | None = None) -> SweepResult:
    """Solve every point of a sweep (a :class:`SweepSpec` or a sweep YAML path).

    ``output``: results folder (default ``sweep-results/<name>``). ``backend``: ``"local"``
    (worker processes of this machine) or ``"ray"`` (one Ray task per point; see
    :class:`~ilp_planner.sweeps.backends.RayBackend`). ``jobs``: local worker processes
    (default: the number of cores; 1 solves in this process), or with ``"ray"`` the CPUs of
    the Ray instance started here. ``address``: with ``"ray"``, the cluster to join
    (``auto``, ``HOST:PORT``, ``ray://…``); None starts a local instance. ``resume``: keep
    rows already in the folder's ``results.jsonl`` for unchanged points. ``plots``: True
    draws the sweep file's plots, False none, or a list of :class:`PlotSpec` to draw.
    Failing points are recorded in their rows; this function raises only for errors in
    the sweep itself (a malformed file, an unwritable folder, an unusable backend).

    Local workers are started with *spawn*, which re-imports the calling script: in a
    script, call this under ``if __name__ == "__main__":`` (or pass ``jobs=1``)."""

    runner = make_backend(backend, jobs=jobs, address=address)
    if not isinstance(spec, SweepSpec):
        spec = load_sweep(spec)
    out = prepare_output(Path(output) if output is not None else default_output(spec), folder=True)
    (out / PLANS_DIR).mkdir(parents=True, exist_ok=True)
    points = spec.points()
    fingerprint = spec.fingerprint

    kept: dict[str, dict[str, Any]] = {}
    if resume:
        ids = {p.id for p in points}
        for row in read_rows(out / RESULTS_JSONL):
            if row.get("id") not in ids or row.get("fingerprint") != fingerprint:
                continue
            if row.get("error") and retry_failed:
                continue
            if not row.get("error") and not _plan_inside(out, row.get("plan")):
                continue
            if not _numbers_valid(row):
                continue  # solved again: a row must not carry a metric it could not have
            kept[row["id"]] = row
    todo = [p for p in points if p.id not in kept]
    rows: dict[int, dict[str, Any]] = {}
    for p in points:
        if p.id in kept:
            rows[p.index] = {**kept[p.id], "point": p.index}

    bar = Progress(len(points), done=len(rows), failed=sum(1 for r in rows.values() if r.get("error")),
                   stream=stream, enabled=progress)
    jsonl = out / RESULTS_JSONL
    with jsonl.open("w") as fh:
        for i in sorted(rows):
            fh.write(json.dumps(rows[i]) + "\n")
        fh.flush()

        def record(outcome: PointOutcome) -> None:
            # the plan first: a row in results.jsonl always has its plan file (see resume)
            row = outcome.row
            if outcome.plan_json is not None:
                _write(out / row["plan"], outcome.plan_json)
            rows[row["point"]] = row
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            bar.update(failed=bool(row.get("error")))

        tasks = [PointTask(p.index, p.overrides, spec.base, spec.base_source, spec.name,
                           spec.baselines, spec.timeout_s, f"{PLANS_DIR}/{p.filename}", fingerprint,
                           _threads(spec.base, p.overrides), spec.memory_gib) for p in todo]
        try:
            runner.run(tasks, record, bar.note)
        finally:
            bar.close()

    ordered = [rows[i] for i in sorted(rows)]
    write_results(out, ordered, spec.keys)
    result = SweepResult(spec, out, ordered, solved=len(todo), skipped=len(points) - len(todo))
    chosen = spec.plots if plots is True else () if plots is False else tuple(plots)
    for ps in chosen:
        path = plot_rows(ordered, ps, spec.keys, out / ps.filename, title=spec.name,
                         zipped=[k for k, _ in spec.zipped])
        if path is not None:
            result.plots.append(path)
    return result


def default_output(spec: SweepSpec) -> Path:
    """Where a sweep writes when given no folder: ``sweep-results/<name>``."""
    return Path("sweep-results") / _safe(spec.name)


def _threads(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> int:
    """The point's ``solver.threads`` (the CPUs its CBC solve uses), read from the raw
    document; a bad value counts as 1 here and fails the point in its worker."""
    try:
        solver = apply_overrides(base, overrides).get("solver")
    except ConfigError:
        return 1
    threads = solver.get("threads", 1) if isinstance(solver, dict) else 1
    return threads if isinstance(threads, int) and not isinstance(threads, bool) and threads > 0 else 1




# -- results files ---------------------------------------------------------------------------


def _plan_inside(out: Path, plan: Any) -> bool:
    """A kept row's plan is a file inside ``out``'s plans folder (a resumed results file is
    input too: ``../../etc/passwd`` is not a plan)."""
    if not isinstance(plan, str) or not plan:
        return False
    folder = (out / PLANS_DIR).resolve()
    path = (out / plan).resolve()
    return path.is_relative_to(folder) and path.is_file()


def _numbers_valid(row: Mapping[str, Any]) -> bool:
    """Every metric of a row (``*_s``, ``*_bytes``, ``*fraction``, ``ratio_*``) is absent,
    null or a finite non-negative number."""
    for key, value in row.items():
        if not (key.endswith(("_s", "_bytes", "fraction")) or key.startswith("ratio_")):
            continue
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value) or value < 0:
            return False
    return True


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a ``results.jsonl`` (a missing file has none; a torn last line, from an
    interrupted run, is skipped)."""
    p = Path(path)
    if not p.is_file():
        return []
    rows = []
    for line in read_input(p).splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            continue
        if isinstance(row, dict) and "id" in row:
            rows.append(row)
    return rows


def columns(rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> list[str]:
    """CSV column order: point, swept keys, the fixed result columns, ratio_* columns in
    first-seen order, baselines, plan."""
    ratios: list[str] = []
    for row in rows:
        for k in row:
            if k.startswith("ratio_") and k not in ratios:
                ratios.append(k)
    return ["point", *keys, *_ROW_HEAD, *ratios, "baselines", "plan"]


def flat_row(row: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """A row with its overrides as one column per swept key and non-scalars as JSON."""
    flat: dict[str, Any] = {"point": row.get("point")}
    ov = row.get("overrides") or {}
    for k in keys:
        flat[k] = ov.get(k)
    for k, v in row.items():
        if k not in ("point", "overrides", "id", "fingerprint"):
            flat[k] = v
    if isinstance(flat.get("baselines"), dict):
        flat["baselines"] = "; ".join(
            f"{n}={v:.4g}" if isinstance(v, int | float) else f"{n}=n/a ({v})"
            for n, v in flat["baselines"].items())
    return {k: json.dumps(v) if isinstance(v, list | dict) else v for k, v in flat.items()}


def write_results(out: Path, rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> None:
    """``results.jsonl`` (sorted), ``results.csv`` and ``results.md``, each written whole
    and then renamed into place."""
    _write(out / RESULTS_JSONL, "".join(json.dumps(r) + "\n" for r in rows))
    cols = columns(rows, keys)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in flat_row(row, keys).items()})
    _write(out / RESULTS_CSV, buf.getvalue())
    _write(out / RESULTS_MD, results_markdown(rows, keys) + "\n")


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def _summary_cells(row: Mapping[str, Any], keys: Sequence[str], ratio_cols: Sequence[str],
                   max_layout: int) -> list[str]:
    """Table cells of one row; a failed point shows its error in the layout column."""
    ov = row.get("overrides") or {}
    cells = [str(row.get("point")), *(_short(ov.get(k)) for k in keys), str(row.get("status"))]
    if row.get("error"):
        err = " ".join(str(row["error"]).split())
        return cells + ["—"] * (4 + len(ratio_cols)) + [_cut(err, max_layout)]
    gap = row.get("gap")
    mem = row.get("peak_memory_gib")
    return cells + [
        _sec(row.get("step_s")), "n/a" if gap is None else f"{gap:.3g}",
        str(row.get("stages")), "n/a" if mem is None else f"{mem:.2f}",
        *("n/a" if row.get(c) is None else f"{row[c]:.2f}" for c in ratio_cols),
        _cut(str(row.get("layout") or ""), max_layout),
    ]


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[:n - 1] + "…"


def _header(keys: Sequence[str], ratio_cols: Sequence[str]) -> list[str]:
    """Swept keys by their last part when that is unambiguous (``bandwidth_gbps``)."""
    leaves = [k.rsplit(".", 1)[-1] for k in keys]
    names = [leaf if leaves.count(leaf) == 1 else k for leaf, k in zip(leaves, keys, strict=True)]
    return ["#", *names, "status", "step", "gap", "stages", "mem GiB",
            *(c.replace("ratio_", "×") for c in ratio_cols), "layout"]


def _ratio_cols(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    return [c for c in columns(rows, ()) if c.startswith("ratio_")]


def results_table(rows: Sequence[Mapping[str, Any]], keys: Sequence[str], max_layout: int = 60) -> str:
    """Fixed-width text table; ``×<baseline>`` columns are baseline / plan step time."""

    ratio_cols = _ratio_cols(rows)
    body = [_summary_cells(r, keys, ratio_cols, max_layout) for r in rows]
    return "\n".join(text_table(_header(keys, ratio_cols), body, indent=""))


def results_markdown(rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> str:
    ratio_cols = _ratio_cols(rows)
    header = _header(keys, ratio_cols)
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = _summary_cells(r, keys, ratio_cols, max_layout=100)
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out)


# -- plots -----------------------------------------------------------------------------------


def plot_rows(rows: Sequence[Mapping[str, Any]], ps: PlotSpec, keys: Sequence[str], path: Path,
              title: str = "", zipped: Sequence[str] = ()) -> Path | None:
    """Draw ``ps.metric`` against ``ps.x`` into ``path`` (PNG, matplotlib's Agg canvas, no
    pyplot state). Zipped keys move together, so a key zipped with ``x`` (or ``series``)
    makes no lines of its own. Failed points are left out (and counted in the title).
    Returns None when no point has the metric."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    good = [r for r in rows if not r.get("error") and _num(r.get(ps.metric)) is not None]
    if not good:
        return None
    varying = [k for k in keys if len({json.dumps((r.get("overrides") or {}).get(k), sort_keys=True)
                                        for r in rows}) > 1]
    tied = set(zipped) if (ps.x in zipped or ps.series in zipped) else set()
    others = [k for k in varying if k not in (ps.x, ps.series) and k not in tied]
    line_keys = [ps.series] if ps.series else others
    facet_keys = others if ps.series else []

    def val(row, k):
        return (row.get("overrides") or {}).get(k)

    def label(row, ks):
        return ", ".join(f"{k.rsplit('.', 1)[-1]}={_short(val(row, k))}" for k in ks)

    facets: dict[str, list] = {}
    for r in good:
        facets.setdefault(label(r, facet_keys), []).append(r)
    xs_all = [val(r, ps.x) for r in good]
    numeric = all(isinstance(x, int | float) and not isinstance(x, bool) for x in xs_all)
    categories: list[str] = []
    if not numeric:
        for x in xs_all:
            if _short(x) not in categories:
                categories.append(_short(x))
    logx = ps.logx
    if logx is None:
        logx = numeric and min(xs_all) > 0 and max(xs_all) / min(xs_all) >= 8

    n = len(facets)
    ncols = min(n, 3)
    nrows = -(-n // ncols)
    fig = Figure(figsize=(5.2 * ncols, 3.8 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    for i, (facet, frows) in enumerate(facets.items()):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        lines: dict[str, list] = {}
        for r in frows:
            lines.setdefault(label(r, line_keys), []).append(r)
        for name, lrows in lines.items():
            pts = sorted((val(r, ps.x) if numeric else categories.index(_short(val(r, ps.x))),
                           float(r[ps.metric])) for r in lrows)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name or None)
        if logx:
            ax.set_xscale("log")
        if not numeric:
            ax.set_xticks(range(len(categories)), categories)
        elif len(set(xs_all)) <= 12:
            ticks = sorted(set(xs_all))
            ax.set_xticks(ticks, [_short(t) for t in ticks])
            ax.minorticks_off()
        ax.set_xlabel(ps.x)
        ax.set_ylabel(ps.metric)
        if facet:
            ax.set_title(facet, fontsize=9)
        if any(lines):
            ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
    failed = len(rows) - len(good)
    fig.suptitle(f"{title}: {ps.metric} vs {ps.x}" + (f" ({failed} point(s) failed, not shown)"
                                                      if failed else ""), fontsize=10)
    fig.savefig(path, dpi=110)
    return path


# -- helpers ---------------------------------------------------------------------------------




def _sec(x: Any) -> str:
    return fmt_seconds(_num(x))


