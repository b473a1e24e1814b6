"""Batch solves over YAML grids: ``ilp-planner sweep`` and :func:`sweep`.

The sweep file (:mod:`ilp_planner.sweeps.spec`) names a base configuration and the keys to
vary; this driver runs its points through a backend, records each row as it arrives and
writes the results folder (:mod:`ilp_planner.sweeps.results`) and plots
(:mod:`ilp_planner.sweeps.plots`).

Execution. A backend (:mod:`ilp_planner.sweeps.backends`) runs the worker entry point
:func:`~ilp_planner.sweeps.points.solve_point`, a top-level function of plain data:
``local`` in worker processes of this machine (``concurrent.futures`` with the *spawn*
start method, so no solver state is inherited through fork), ``ray`` as one Ray task per
point on a Ray cluster. A worker returns its point's row and its plan as JSON text; this
process alone writes the files, so workers need no file system shared with it and both
backends leave the same folder. Solving is deterministic (CBC with one thread and a fixed
seed, seeded warm starts), so results from workers equal a serial run's except for the
timing columns. A progress bar on stderr shows done / total, failures, elapsed time and
ETA = elapsed / solved_this_run × remaining.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ilp_planner.errors import ConfigError
from ilp_planner.inputs.config import apply_overrides
from ilp_planner.inputs.files import prepare_output
from ilp_planner.plan.data import Plan
from ilp_planner.sweeps.backends import make_backend
from ilp_planner.sweeps.plots import plot_rows
from ilp_planner.sweeps.points import PointOutcome, PointTask, file_safe
from ilp_planner.sweeps.progress import Progress
from ilp_planner.sweeps.results import (
    PLANS_DIR,
    RESULTS_CSV,
    RESULTS_JSONL,
    RESULTS_MD,
    results_table,
    resumable_rows,
    write_atomic,
    write_results,
)
from ilp_planner.sweeps.spec import PlotSpec, SweepSpec, load_sweep


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
    chosen = spec.plots if plots is True else () if plots is False else tuple(plots)
    _prepare_results_folder(out, chosen)
    points = spec.points()
    fingerprint = spec.fingerprint

    kept = resumable_rows(out, points, fingerprint, retry_failed) if resume else {}
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
                write_atomic(out / row["plan"], outcome.plan_json)
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
    for ps in chosen:
        path = plot_rows(ordered, ps, spec.keys, out / ps.filename, title=spec.name,
                         zipped=[k for k, _ in spec.zipped])
        if path is not None:
            result.plots.append(path)
    return result


def _prepare_results_folder(out: Path, plots: Sequence[PlotSpec]) -> None:
    """The plans folder created and every results file writable before any point is
    solved: a file where ``plans/`` goes, or a folder where ``results.jsonl`` goes, ends the
    sweep with an error naming it instead of after the solves, in a traceback."""
    prepare_output(out / PLANS_DIR, folder=True)
    for name in (RESULTS_JSONL, RESULTS_CSV, RESULTS_MD):
        prepare_output(out / name)
    for ps in plots:
        prepare_output(out / ps.filename)


def default_output(spec: SweepSpec) -> Path:
    """Where a sweep writes when given no folder: ``sweep-results/<name>``."""
    return Path("sweep-results") / file_safe(spec.name)


def _threads(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> int:
    """The point's ``solver.threads`` (the CPUs its CBC solve uses), read from the raw
    document; a bad value counts as 1 here and fails the point in its worker."""
    try:
        solver = apply_overrides(base, overrides).get("solver")
    except ConfigError:
        return 1
    threads = solver.get("threads", 1) if isinstance(solver, dict) else 1
    return threads if isinstance(threads, int) and not isinstance(threads, bool) and threads > 0 else 1
