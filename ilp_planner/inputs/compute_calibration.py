"""Fit the roofline's parameters (:mod:`ilp_planner.lowering.compute_model`) from kernel
timings: what ``calibrate --measure`` writes as ``cluster.compute``.

Two kinds of timed kernel, each one launch, and the runtime's host time:

* ``stream`` — an elementwise kernel moving ``bytes``: ``t = bytes / W + f``;
* ``matmul`` — ``(m, k) × (k, n)``, ``2mnk`` FLOPs, ``bytes`` its operands and result:
  ``t = max(2mnk / (T · Π d/(d + d½)), bytes / W) + f``;
* ``dispatch`` — one training step of the runtime on a model too small for the device to
  matter, ``m`` kernels issued (counted at dispatch): ``t = m · h``, h the host's seconds a
  kernel (``ComputeFit.dispatch_s``), their median ratio. Without such rows h is not
  measured and the fragment leaves it out;
* ``replay`` — the same step with every block recomputed, ``m`` kernels issued of which
  ``n`` a recomputation replays: ``t = m · h + n · r``, r each replayed kernel's host time
  beyond its dispatch (``ComputeFit.replay_s``: ``torch.utils.checkpoint``'s bookkeeping),
  the median of ``(t − m · h) / n`` (at least 0: the two steps' noise can exceed it). It
  needs the dispatch rows' h.

Unknowns: the achieved matmul asymptote T (FLOP/s), the size scale d½, the achieved
bandwidth W (bytes/s) and the kernel floor f (s). The stream rows alone fix W and f by
linear least squares (t is linear in 1/W and f). With those, a matmul row is linear in 1/T
for a given d½: d½ is searched on a log grid and refined by golden section, 1/T solved in
closed form at each candidate (from the rows whose FLOPs, not bytes, bind at the
current estimate: a few passes). As in the α–β fit (:mod:`ilp_planner.inputs.calibration`)
residuals are relative — timings span decades and their noise is multiplicative — and a
negative floor is refitted at 0.

``T`` and ``W`` are achieved figures; the fragment states them as efficiencies of a
datasheet peak and bandwidth when given (``--peak-tflops``, ``--hbm-gbps``), else as the
peak and bandwidth themselves at efficiency 1 (a CPU has no datasheet to be a fraction of).
"""

from __future__ import annotations

import csv
import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ilp_planner.errors import ConfigError
from ilp_planner.lowering.compute_model import size_factor

KERNEL_COLUMNS = ("kernel", "m", "n", "k", "bytes", "seconds")
KERNEL_KINDS = ("matmul", "stream", "dispatch", "replay")
_STEPS = ("dispatch", "replay")  # a runtime step's rows: kernels issued, no bytes
_GOLDEN = (math.sqrt(5) - 1) / 2


@dataclass(frozen=True)
class KernelTiming:
    """One timed kernel: ``seconds`` for a ``matmul`` of sizes (m, n, k) or a ``stream``
    (m = n = k = 0) moving ``bytes``; or a runtime step issuing ``m`` kernels
    (``dispatch``, n = k = bytes = 0; ``replay``: ``n`` of them replayed by recomputation,
    k = bytes = 0)."""

    kernel: str
    m: int
    n: int
    k: int
    bytes: float
    seconds: float

    def __post_init__(self) -> None:
        if self.kernel not in KERNEL_KINDS:
            raise ValueError(f"kernel: expected one of {list(KERNEL_KINDS)}, got {self.kernel!r}")
        if self.kernel == "matmul" and min(self.m, self.n, self.k) < 1:
            raise ValueError(f"m, n, k: a matmul needs positive sizes, got {self.m, self.n, self.k}")
        if self.kernel in _STEPS and self.m < 1:
            raise ValueError(f"m: a {self.kernel} row needs the kernels its step issued (>= 1), "
                             f"got {self.m}")
        if self.kernel == "replay" and not 1 <= self.n <= self.m:
            raise ValueError(f"n: a replay row needs the kernels recomputation replayed "
                             f"(1 to m = {self.m}), got {self.n}")
        if not (math.isfinite(self.bytes) and (self.bytes > 0 or self.kernel in _STEPS
                                                and self.bytes == 0)):
            raise ValueError(f"bytes: expected a finite number > 0, got {self.bytes}")
        if not (math.isfinite(self.seconds) and self.seconds > 0):
            raise ValueError(f"seconds: expected a finite number > 0, got {self.seconds}")

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k if self.kernel == "matmul" else 0.0


@dataclass(frozen=True)
class ComputeCalibration:
    """The fitted parameters and how well they explain the timings."""

    matmul_flops: float  # T, achieved FLOP/s of a large matmul
    half_dim: float  # d½
    bandwidth: float  # W, achieved bytes/s
    floor_s: float  # f
    rows: int
    median_abs_rel: float
    max_abs_rel: float
    floor_clamped: bool = False
    dispatch_s: float | None = None  # h, host seconds a kernel (None: not measured)
    replay_s: float | None = None  # r, host seconds a replayed kernel beyond h

    def predict(self, row: KernelTiming) -> float:
        """The model's seconds for ``row``."""
        if row.kernel == "dispatch":
            return row.m * (self.dispatch_s or 0.0)
        if row.kernel == "replay":
            return row.m * (self.dispatch_s or 0.0) + row.n * (self.replay_s or 0.0)
        mem = row.bytes / self.bandwidth
        if row.kernel == "stream":
            return mem + self.floor_s
        eff = size_factor((row.m, row.n, row.k), self.half_dim)
        return max(row.flops / (self.matmul_flops * eff), mem) + self.floor_s


def _fit_stream(rows: Sequence[KernelTiming]) -> tuple[float, float, bool]:
    """(W, f, clamped) from the stream rows: relative least squares on ``t = B/W + f``."""
    b = np.array([r.bytes for r in rows])
    t = np.array([r.seconds for r in rows])
    if len(set(b.tolist())) < 2:
        raise ConfigError("stream timings: need at least two different sizes to separate "
                          "bandwidth from the kernel floor")
    x = np.column_stack([b, np.ones_like(b)]) / t[:, None]
    (inv_w, f), *_ = np.linalg.lstsq(x, np.ones_like(t), rcond=None)
    clamped = f < 0
    if clamped:
        inv_w, f = float(np.sum(b / t) / np.sum((b / t) ** 2)), 0.0
    if inv_w <= 0:
        raise ConfigError("stream timings do not determine a bandwidth (time does not grow "
                          "with bytes)")
    return 1.0 / float(inv_w), float(f), bool(clamped)


def _matmul_at(rows: Sequence[KernelTiming], half_dim: float, bandwidth: float,
               floor_s: float) -> tuple[float, float]:
    """(T, Σ squared relative residuals) of the matmul rows at a given d½."""
    t = np.array([r.seconds for r in rows])
    x = np.array([r.flops / size_factor((r.m, r.n, r.k), half_dim) for r in rows])
    y = t - floor_s
    mem = np.array([r.bytes for r in rows]) / bandwidth
    bound = np.ones(len(rows), dtype=bool)  # rows whose FLOPs bind: they alone say 1/T
    for _ in range(3):
        u = float(np.sum(x[bound] * y[bound] / t[bound] ** 2) / np.sum((x[bound] / t[bound]) ** 2))
        if u <= 0:
            return math.inf, math.inf
        now = x * u >= mem
        if not now.any() or (now == bound).all():
            break
        bound = now
    pred = np.maximum(x * u, mem) + floor_s
    return 1.0 / u, float(np.sum(((pred - t) / t) ** 2))


def _fit_half_dim(rows: Sequence[KernelTiming], bandwidth: float, floor_s: float) -> float:
    """d½ minimising the relative residuals: a log grid over [1, 10⁵], then golden
    section between the best point's neighbours (0 also tried: no size effect)."""
    grid = np.concatenate([[0.0], np.geomspace(1.0, 1e5, 101)])
    sse = [_matmul_at(rows, h, bandwidth, floor_s)[1] for h in grid]
    i = int(np.argmin(sse))
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, len(grid) - 1)]
    for _ in range(40):
        a, b = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
        if _matmul_at(rows, a, bandwidth, floor_s)[1] <= _matmul_at(rows, b, bandwidth, floor_s)[1]:
            hi = b
        else:
            lo = a
    mid = (lo + hi) / 2
    return float(mid) if _matmul_at(rows, mid, bandwidth, floor_s)[1] <= sse[i] else float(grid[i])


def fit_compute(rows: Iterable[KernelTiming]) -> ComputeCalibration:
    """Fit (T, d½, W, f) to ``rows`` (module docstring); needs stream rows of two sizes
    and matmul rows of at least two shapes."""
    rows = list(rows)
    stream = [r for r in rows if r.kernel == "stream"]
    matmul = [r for r in rows if r.kernel == "matmul"]
    steps = [r.seconds / r.m for r in rows if r.kernel == "dispatch"]
    dispatch_s = float(np.median(steps)) if steps else None
    replays = [r for r in rows if r.kernel == "replay"]
    if replays and dispatch_s is None:
        raise ConfigError("replay timings need dispatch timings: a replayed kernel's host time "
                          "is what the recomputed step takes beyond its kernels' dispatch")
    replay_s = max(0.0, float(np.median([(r.seconds - r.m * dispatch_s) / r.n
                                         for r in replays]))) if replays else None
    if len({(r.m, r.n, r.k) for r in matmul}) < 2:
        raise ConfigError("matmul timings: need at least two shapes to fit the size curve")
    bandwidth, floor_s, clamped = _fit_stream(stream)
    half_dim = _fit_half_dim(matmul, bandwidth, floor_s)
    peak, _ = _matmul_at(matmul, half_dim, bandwidth, floor_s)
    if not math.isfinite(peak):
        raise ConfigError("matmul timings do not determine a throughput (all within the "
                          "kernel floor)")
    cal = ComputeCalibration(peak, half_dim, bandwidth, floor_s, len(rows), 0.0, 0.0, clamped,
                             dispatch_s, replay_s)
    rel = np.array([abs(cal.predict(r) - r.seconds) / r.seconds for r in rows])
    return dataclasses.replace(cal, median_abs_rel=float(np.median(rel)),
                               max_abs_rel=float(rel.max()))


def compute_section(cal: ComputeCalibration, peak_tflops: float | None = None,
                    hbm_gbps: float | None = None) -> dict[str, float]:
    """The ``cluster.compute`` section of a fit: efficiencies of the given datasheet peak
    and bandwidth, or the achieved figures themselves at efficiency 1."""
    peak = peak_tflops * 1e12 if peak_tflops else cal.matmul_flops
    hbm = hbm_gbps * 1e9 if hbm_gbps else cal.bandwidth
    for what, got, of in (("matmul throughput", cal.matmul_flops, peak),
                          ("memory bandwidth", cal.bandwidth, hbm)):
        if got > of * (1 + 1e-9):
            raise ConfigError(f"the fitted {what} ({got:.4g}/s) exceeds the datasheet figure "
                              f"given ({of:.4g}/s); check --peak-tflops / --hbm-gbps")
    section = {"peak_tflops": peak / 1e12, "hbm_gbps": hbm / 1e9,
               "matmul_efficiency": min(cal.matmul_flops / peak, 1.0),
               "matmul_half_dim": cal.half_dim,
               "memory_efficiency": min(cal.bandwidth / hbm, 1.0),
               "kernel_floor_us": cal.floor_s * 1e6}
    if cal.dispatch_s is not None:
        section["dispatch_us"] = cal.dispatch_s * 1e6
    if cal.replay_s is not None:
        section["replay_us"] = cal.replay_s * 1e6
    return section


def compute_report(cal: ComputeCalibration) -> str:
    """Human lines: the four parameters and the relative residuals."""
    note = "\nnote: least squares gave a negative kernel floor; refitted with f = 0" \
        if cal.floor_clamped else ""
    return (f"compute: matmul {cal.matmul_flops / 1e12:.4g} TFLOP/s asymptote, d½ "
            f"{cal.half_dim:.4g}, bandwidth {cal.bandwidth / 1e9:.4g} GB/s, kernel floor "
            f"{cal.floor_s * 1e6:.3g} us"
            + ("" if cal.dispatch_s is None else
               f", host {cal.dispatch_s * 1e6:.3g} us a kernel issued")
            + ("" if cal.replay_s is None else
               f" and {cal.replay_s * 1e6:.3g} us more a kernel replayed")
            + f" ({cal.rows} kernels, |rel| median "
            f"{cal.median_abs_rel:.2%}, max {cal.max_abs_rel:.2%}){note}")


def write_kernel_csv(rows: Iterable[KernelTiming], path: str | Path) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(KERNEL_COLUMNS)
        for r in rows:
            w.writerow([r.kernel, r.m, r.n, r.k, repr(float(r.bytes)), repr(float(r.seconds))])


def read_kernel_csv(path: str | Path) -> list[KernelTiming]:
    """Kernel timings with header :data:`KERNEL_COLUMNS`; a bad row is a one-line error
    naming the file, the line and the field."""
    try:
        with open(path, newline="") as fh:
            records = list(csv.DictReader(fh))
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read kernel timings: {exc.strerror}") from None
    out = []
    for i, rec in enumerate(records, start=2):
        try:
            out.append(KernelTiming(rec["kernel"], int(rec["m"]), int(rec["n"]), int(rec["k"]),
                                    float(rec["bytes"]), float(rec["seconds"])))
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"{path}: line {i}: missing column {exc}; expected "
                              f"{','.join(KERNEL_COLUMNS)}") from None
        except ValueError as exc:
            raise ConfigError(f"{path}: line {i}: {exc}") from None
    return out
