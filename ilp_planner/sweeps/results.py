"""A sweep's results folder: its rows (``results.jsonl``), the same rows as ``results.csv``
and ``results.md``, and the text table ``ilp-planner sweep`` prints.

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
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ilp_planner.errors import ConfigError
from ilp_planner.inputs.files import read_input
from ilp_planner.reports.explain import fmt_seconds, text_table
from ilp_planner.sweeps.points import Point, finite_or_none, short_text

RESULTS_JSONL = "results.jsonl"
RESULTS_CSV = "results.csv"
RESULTS_MD = "results.md"
PLANS_DIR = "plans"

# Columns that depend on wall-clock time: excluded when comparing runs.
TIMING_COLUMNS = ("build_s", "solve_s", "wall_s")
_ROW_HEAD = ("status", "error", "method", "objective_s", "gap", "build_s", "solve_s", "wall_s",
             "step_s", "total_s", "compute_s", "comm_s", "activation_comm_s", "grad_sync_s",
             "activation_comm_bytes", "grad_sync_bytes", "peak_memory_gib", "memory_fraction",
             "stages", "devices", "microbatches", "bubble_fraction", "layout")


def resumable_rows(out: Path, points: Sequence[Point], fingerprint: str,
                   retry_failed: bool) -> dict[str, dict[str, Any]]:
    """Point id → the row a resumed sweep keeps from ``out``'s ``results.jsonl``: a point of
    this sweep with the same fingerprint, whose plan file is still there (or, unless
    ``retry_failed``, a recorded failure), and whose metrics are numbers it could have."""
    ids = {p.id for p in points}
    kept: dict[str, dict[str, Any]] = {}
    for row in read_rows(out / RESULTS_JSONL):
        if not _identity_valid(row):
            continue
        if row["id"] not in ids or row.get("fingerprint") != fingerprint:
            continue
        if row.get("error") and retry_failed:
            continue
        if not row.get("error") and not _plan_inside(out, row.get("plan")):
            continue
        if not _numbers_valid(row):
            continue  # solved again: a row must not carry a metric it could not have
        kept[row["id"]] = row
    return kept


def _identity_valid(row: Mapping[str, Any]) -> bool:
    """A row names its point as a point does: an ``id`` string and an ``overrides`` mapping
    (an edited row with a list there is solved again, not looked up or tabulated)."""
    return isinstance(row.get("id"), str) and isinstance(row.get("overrides"), dict)


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
    write_atomic(out / RESULTS_JSONL, "".join(json.dumps(r) + "\n" for r in rows))
    cols = columns(rows, keys)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if v is None else v) for k, v in flat_row(row, keys).items()})
    write_atomic(out / RESULTS_CSV, buf.getvalue())
    write_atomic(out / RESULTS_MD, results_markdown(rows, keys) + "\n")


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` whole to a temporary file and rename it into place, so a reader (or a
    resume after a kill) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as exc:
        raise ConfigError(f"cannot write the file: {exc.strerror}", source=str(path)) from None


def _summary_cells(row: Mapping[str, Any], keys: Sequence[str], ratio_cols: Sequence[str],
                   max_layout: int) -> list[str]:
    """Table cells of one row; a failed point shows its error in the layout column."""
    ov = row.get("overrides") or {}
    cells = [str(row.get("point")), *(short_text(ov.get(k)) for k in keys), str(row.get("status"))]
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


def _sec(x: Any) -> str:
    return fmt_seconds(finite_or_none(x))
