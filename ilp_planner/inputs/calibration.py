"""Fit the α–β parameters of each link level from measured collective timings (AutoDDL §3.2).

Every timing of a collective over ``p`` devices moving ``n`` bytes is, by the ring formulas of
:mod:`ilp_planner.lowering.cost_model`, one linear equation in the unknowns α (s) and β (s/byte):

    seconds = a(kind, p) · α + b(kind, p, n) · β

    kind                                a            b
    all_reduce                      2(p−1)       2(p−1)/p · n
    all_gather, reduce_scatter,      (p−1)        (p−1)/p · n
      all_to_all
    p2p                                1                  n
    broadcast (K = 1 chunk,            A              A · n        (p = A receivers)
      A receivers)

Stacking the rows of one link level (``intra`` or ``inter``) gives an over-determined system
``X [α, β]ᵀ ≈ y`` solved by linear least squares (:func:`numpy.linalg.lstsq`).

Weighting. Timings span several decades (a 4 KiB message costs ~α, a 1 GiB one ~nβ), and
measurement noise is roughly multiplicative. Plain least squares on seconds lets the largest
messages decide everything and leaves α — which only small messages reveal — at the mercy of
their noise. By default each row is divided by its measured time, so the fit minimises the
*relative* residuals Σ ((pred − meas)/meas)²; ``weighting="absolute"`` gives the textbook
unweighted fit.

Non-negativity. A latency cannot be negative, but noisy data can make the unconstrained α
negative. With ``nonnegative=True`` such a fit is redone with α fixed at 0 (β alone by least
squares) and the result says so (``alpha_clamped``). A non-positive β means the data do not
determine a bandwidth at all, which is an error.

For ``broadcast`` rows the ``group_size`` column is the number of receivers A, the same
convention as :func:`ilp_planner.lowering.cost_model.collective_time` (a process group of g ranks
broadcasting from one root has A = g − 1 receivers).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from ilp_planner.errors import ConfigError
from ilp_planner.ir.cluster import Link
from ilp_planner.lowering.cost_model import CollectiveKind

CSV_COLUMNS = ("collective", "group_size", "bytes", "link", "seconds")
LINK_LEVELS = ("intra", "inter")
WEIGHTINGS = ("relative", "absolute")


@dataclass(frozen=True)
class TimingRow:
    """One measured collective: ``seconds`` for ``kind`` over ``group_size`` devices moving
    ``bytes`` (n of the cost formula) on link level ``link``."""

    kind: CollectiveKind
    group_size: int
    bytes: float
    link: str
    seconds: float

    def __post_init__(self) -> None:
        _check_row(self.kind, self.group_size, self.bytes, self.link, self.seconds)


def _check_row(kind: CollectiveKind, p: int, nbytes: float, link: str, seconds: float) -> None:
    """Raise ``ValueError`` naming the first field that makes the row useless for a fit."""
    min_p = 1 if kind is CollectiveKind.BROADCAST else 2
    if p < min_p:
        raise ValueError(f"group_size: {kind.value} needs group_size >= {min_p}, got {p}")
    if not (math.isfinite(nbytes) and nbytes >= 0):
        raise ValueError(f"bytes: expected a finite number >= 0, got {nbytes}")
    if link not in LINK_LEVELS:
        raise ValueError(f"link: expected one of {list(LINK_LEVELS)}, got {link!r}")
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"seconds: expected a finite number > 0, got {seconds}")


def coefficients(kind: CollectiveKind, p: int, nbytes: float) -> tuple[float, float]:
    """``(a, b)`` with ``collective_time(kind, p, nbytes, Link(α, β)) == a·α + b·β``
    (broadcast with one chunk). Kept beside the fit so the two cannot drift apart unseen:
    the tests compare them with :func:`collective_time`."""
    if kind is CollectiveKind.P2P:
        return 1.0, float(nbytes)
    if kind is CollectiveKind.BROADCAST:
        return float(p), float(p) * nbytes
    frac = (p - 1) / p
    if kind is CollectiveKind.ALL_REDUCE:
        return 2.0 * (p - 1), 2.0 * frac * nbytes
    if kind in (CollectiveKind.ALL_GATHER, CollectiveKind.REDUCE_SCATTER, CollectiveKind.ALL_TO_ALL):
        return float(p - 1), frac * nbytes
    raise ValueError(f"unknown collective {kind}")


@dataclass(frozen=True)
class LinkFit:
    """Fitted α–β of one link level and how well the model explains the data.

    ``rms`` is the root-mean-square residual in seconds; ``rel_residuals`` are
    (predicted − measured)/measured per row, in input order; ``r2`` is the coefficient of
    determination on seconds (1 − SS_res/SS_tot; NaN when all measurements are equal).
    """

    link: str
    alpha: float
    beta: float
    n_rows: int
    rms: float
    rel_residuals: tuple[float, ...]
    r2: float
    alpha_clamped: bool = False
    weighting: str = "relative"

    @property
    def bandwidth_gbps(self) -> float:
        return 8.0 / (self.beta * 1e9)

    @property
    def max_abs_rel(self) -> float:
        return max(abs(r) for r in self.rel_residuals)

    @property
    def median_abs_rel(self) -> float:
        return float(np.median(np.abs(self.rel_residuals)))

    def to_link(self) -> Link:
        return Link(self.alpha, self.beta)


def fit_link(
    rows: Sequence[TimingRow], link: str, *, weighting: str = "relative", nonnegative: bool = True
) -> LinkFit:
    """Least-squares α, β for ``link`` from the rows measured on it (see module docstring)."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
    mine = [r for r in rows if r.link == link]
    if not mine:
        raise ConfigError(f"no timings for link level {link!r}")
    X = np.array([coefficients(r.kind, r.group_size, r.bytes) for r in mine], dtype=float)
    y = np.array([r.seconds for r in mine], dtype=float)
    w = 1.0 / y if weighting == "relative" else np.ones_like(y)
    # Scale the columns to O(1) so the rank test and lstsq are not fooled by α ~ 1e-5
    # against β ~ 1e-10 (b coefficients ~ 1e9).
    scale = np.abs(X).max(axis=0)
    if np.any(scale == 0) or np.linalg.matrix_rank(X / scale) < 2:
        raise ConfigError(
            f"{len(mine)} timings for link {link!r} do not determine both α and β: they need "
            "at least two points with different ratios of latency to bandwidth terms (several "
            "message sizes, some of them non-zero)"
        )
    Xw = X * w[:, None] / scale
    sol, *_ = np.linalg.lstsq(Xw, y * w, rcond=None)
    alpha, beta = sol / scale
    clamped = False
    if nonnegative and alpha < 0:
        bw = X[:, 1] * w
        beta = float(bw @ (y * w) / (bw @ bw))
        alpha, clamped = 0.0, True
    if not beta > 0:
        raise ConfigError(
            f"least squares gives β = {beta:.3g} s/byte for link {link!r}: the timings do not "
            "grow with message size; measure larger messages"
        )
    pred = X @ np.array([alpha, beta])
    res = pred - y
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((res**2).sum()) / ss_tot if ss_tot > 0 else float("nan")
    return LinkFit(
        link=link,
        alpha=float(alpha),
        beta=float(beta),
        n_rows=len(mine),
        rms=float(np.sqrt((res**2).mean())),
        rel_residuals=tuple(float(v) for v in res / y),
        r2=r2,
        alpha_clamped=clamped,
        weighting=weighting,
    )


def fit_links(
    rows: Iterable[TimingRow], *, weighting: str = "relative", nonnegative: bool = True
) -> dict[str, LinkFit]:
    """One :class:`LinkFit` per link level present in ``rows`` (``intra`` before ``inter``)."""
    rows = list(rows)
    if not rows:
        raise ConfigError("no timings to fit")
    present = {r.link for r in rows}
    return {
        link: fit_link(rows, link, weighting=weighting, nonnegative=nonnegative)
        for link in LINK_LEVELS
        if link in present
    }


# ---- CSV ------------------------------------------------------------------------------------
def read_timings_csv(path: str | Path) -> list[TimingRow]:
    """Rows of a CSV with header ``collective,group_size,bytes,link,seconds`` (any order;
    extra columns are ignored, blank lines skipped). Errors name the file, line and column."""
    path = Path(path)
    src = str(path)
    try:
        fh = path.open(newline="")
    except OSError as exc:
        raise ConfigError(f"cannot read timings: {exc.strerror}", source=src) from exc
    rows: list[TimingRow] = []
    with fh:
        reader = csv.reader(fh)
        header = None
        for line_no, record in enumerate(reader, start=1):
            if not record or all(not f.strip() for f in record):
                continue
            if header is None:
                header = [f.strip().lower() for f in record]
                missing = [c for c in CSV_COLUMNS if c not in header]
                if missing:
                    raise ConfigError(
                        f"header lacks column(s) {', '.join(missing)}; expected "
                        f"{','.join(CSV_COLUMNS)}, got {','.join(header)}",
                        source=f"{src}:{line_no}",
                    )
                col = {c: header.index(c) for c in CSV_COLUMNS}
                continue
            rows.append(_parse_record(record, col, len(header), f"{src}:{line_no}"))
    if header is None:
        raise ConfigError(f"empty file; expected a header {','.join(CSV_COLUMNS)}", source=src)
    if not rows:
        raise ConfigError("no timing rows after the header", source=src)
    return rows


def _parse_record(record: list[str], col: dict[str, int], width: int, where: str) -> TimingRow:
    if len(record) != width:
        raise ConfigError(f"expected {width} fields like the header, got {len(record)}",
                          source=where)
    field = {c: record[i].strip() for c, i in col.items()}
    try:
        kind = CollectiveKind(field["collective"].lower())
    except ValueError:
        raise ConfigError(
            f"unknown collective {field['collective']!r}; expected one of "
            f"{[k.value for k in CollectiveKind]}",
            source=where, key="collective",
        ) from None
    group_size = _number(field, "group_size", where)
    if group_size != int(group_size):
        raise ConfigError(f"expected an integer, got {field['group_size']!r}",
                          source=where, key="group_size")
    nbytes = _number(field, "bytes", where)
    seconds = _number(field, "seconds", where)
    link = field["link"].lower()
    try:
        _check_row(kind, int(group_size), nbytes, link, seconds)
    except ValueError as exc:
        column, _, message = str(exc).partition(": ")
        raise ConfigError(message, source=where, key=column) from None
    return TimingRow(kind, int(group_size), nbytes, link, seconds)


def _number(field: dict[str, str], column: str, where: str) -> float:
    try:
        value = float(field[column])
    except ValueError:
        raise ConfigError(f"expected a number, got {field[column]!r}",
                          source=where, key=column) from None
    if not math.isfinite(value):
        raise ConfigError(f"expected a finite number, got {field[column]!r}",
                          source=where, key=column)
    return value


def write_timings_csv(rows: Iterable[TimingRow], path: str | Path) -> None:
    """Inverse of :func:`read_timings_csv` (used by measurement scripts and tests)."""
    with Path(path).open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(CSV_COLUMNS)
        for r in rows:
            w.writerow([r.kind.value, r.group_size, repr(float(r.bytes)), r.link,
                        repr(float(r.seconds))])


# ---- output ---------------------------------------------------------------------------------
def fit_report(fits: dict[str, LinkFit]) -> str:
    """Human table: α in µs, β in s/byte and Gb/s, residual statistics per link level."""
    head = (f"{'link':<6} {'rows':>5} {'alpha (us)':>11} {'beta (s/B)':>11} {'bw (Gb/s)':>10} "
            f"{'RMS res (s)':>12} {'|rel| med':>10} {'|rel| max':>10} {'R^2':>8}")
    lines = [head, "-" * len(head)]
    notes = []
    for link, f in fits.items():
        lines.append(
            f"{link:<6} {f.n_rows:>5} {f.alpha * 1e6:>11.3f} {f.beta:>11.4g} "
            f"{f.bandwidth_gbps:>10.4g} {f.rms:>12.4g} {f.median_abs_rel:>10.2%} "
            f"{f.max_abs_rel:>10.2%} {f.r2:>8.5f}"
        )
        if f.alpha_clamped:
            notes.append(f"{link}: least squares gave a negative latency; refitted with α = 0")
    for level in LINK_LEVELS:
        if level not in fits:
            notes.append(f"{level}: no timings, not fitted (keep the cluster's own value)")
    weighting = {f.weighting for f in fits.values()}
    lines.append(f"fit: least squares, {'/'.join(sorted(weighting))} residuals")
    return "\n".join(lines + [f"note: {n}" for n in notes])


def cluster_fragment(fits: dict[str, LinkFit], compute: dict[str, float] | None = None) -> str:
    """YAML ``cluster: {links: {intra: {alpha, beta}, inter: {...}}}`` for a cluster config;
    a comment line per link repeats the values as latency (µs) and bandwidth (Gb/s).
    ``compute``, where kernels were fitted too
    (:func:`~ilp_planner.inputs.compute_calibration.compute_section`), is its
    ``cluster.compute`` section."""
    links = {link: {"alpha": float(f.alpha), "beta": float(f.beta)} for link, f in fits.items()}
    comments = [
        f"# {link}: latency {f.alpha * 1e6:.3f} us, bandwidth {f.bandwidth_gbps:.4g} Gb/s "
        f"({f.n_rows} timings, R^2 {f.r2:.4f})"
        for link, f in fits.items()
    ]
    section: dict = {"links": links} if links else {}
    if compute is not None:
        section["compute"] = {k: float(v) for k, v in compute.items()}
        comments.append("# compute: the roofline's parameters, fitted from timed kernels")
    body = yaml.safe_dump({"cluster": section}, sort_keys=False)
    return "\n".join(["# alpha-beta fitted by `ilp-planner calibrate` (AutoDDL 3.2)", *comments,
                      body.rstrip("\n")]) + "\n"
