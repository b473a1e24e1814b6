"""One sweep point: its task, its solve in a worker (with a deadline), and the results row it becomes.

Both the driver (:mod:`ilp_planner.sweeps.sweep`) and the backends that run the points
(:mod:`ilp_planner.sweeps.backends`) import these; nothing here imports either."""

from __future__ import annotations

import hashlib
import json
import math
import re
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ilp_planner.api import solve
from ilp_planner.errors import ConfigError, InfeasibleError, PlannerError
from ilp_planner.inputs.config import apply_overrides, parse_config
from ilp_planner.plan.data import baseline_seconds
from ilp_planner.reports.explain import (
    baseline_family,
    layout_summary,
    microbatches,
    step_seconds,
)


class PointTimeout(PlannerError):
    """A point ran past the sweep's ``solve.timeout_s``."""
@dataclass(frozen=True)
class Point:
    """One grid point: its position and the dotted keys it sets (grid keys, then zip keys)."""

    index: int
    overrides: dict[str, Any]

    @property
    def id(self) -> str:
        """Canonical JSON of the overrides: the point's identity across runs."""
        return json.dumps(self.overrides, sort_keys=True, separators=(",", ":"))

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={short_text(v)}" for k, v in self.overrides.items()) or "base"

    @property
    def filename(self) -> str:
        """``layers-4_nodes-2-<hash>.json``: readable, and unique through the hash."""
        leaves = [k.rsplit(".", 1)[-1] for k in self.overrides]
        names = [leaf if leaves.count(leaf) == 1 else k for leaf, k in zip(leaves, self.overrides,
                                                                           strict=True)]
        joined = "_".join(f"{n}-{short_text(v)}" for n, v in zip(names, self.overrides.values(),
                                                                 strict=True))
        slug = file_safe(joined)[:80] if joined else "base"
        return f"{slug}-{hashlib.sha1(self.id.encode()).hexdigest()[:8]}.json"
@dataclass(frozen=True)
class PointTask:
    """Everything a worker needs, as plain picklable data, and what the point reserves on a
    cluster (``cpus``: the point's ``solver.threads``; ``memory_gib``: ``solve.memory_gib``),
    which the local backend ignores."""

    index: int
    overrides: dict[str, Any]
    base: dict
    base_source: str | None
    name: str
    baselines: bool
    timeout_s: float | None
    plan_rel: str
    fingerprint: str
    cpus: int = 1
    memory_gib: float | None = None
@dataclass(frozen=True)
class PointOutcome:
    """What a worker sends back: the point's row and, for a solved point, its plan file's
    text (written by the driver at ``row["plan"]``, so workers need no shared file system)."""

    row: dict[str, Any]
    plan_json: str | None = None
def solve_point(task: PointTask) -> PointOutcome:
    """Solve one point and return its row and plan. Never raises for a failing point: the
    error goes into the row."""

    point = Point(task.index, task.overrides)
    row: dict[str, Any] = {"point": task.index, "id": point.id, "overrides": task.overrides,
                           "fingerprint": task.fingerprint}
    t0 = time.perf_counter()
    deadline = _Deadline(task.timeout_s)
    plan_json = None
    try:
        deadline.arm()
        overrides = dict(task.overrides)
        if "name" not in overrides:
            overrides["name"] = f"{task.name}[{point.label}]"
        config = parse_config(apply_overrides(task.base, overrides), task.base_source)
        plan = solve(config, baselines=task.baselines)
        deadline.disarm()
        text = plan.to_json()
        row.update(plan_row(plan))
        row["plan"] = task.plan_rel
        plan_json = text  # only once the row is complete: a row naming a plan comes with it
    except PointTimeout as exc:
        row.update(status="timeout", error=str(exc))
    except ConfigError as exc:
        row.update(status="config_error", error=_config_error(exc, task))
    except InfeasibleError as exc:
        row.update(status="infeasible", error=str(exc))
    except PlannerError as exc:
        row.update(status="error", error=f"{type(exc).__name__}: {exc}")
    except Exception as exc:  # noqa: BLE001 - a point's bug must not stop the sweep
        row.update(status="error", error=describe_error(exc))
    finally:
        deadline.disarm()
    row["wall_s"] = time.perf_counter() - t0
    return PointOutcome(row, plan_json)
def describe_error(exc: BaseException) -> str:
    """``ValueError: message (file.py:123)`` — the innermost frame names where it broke."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"
class _Deadline:
    """A wall-clock limit through SIGALRM, where there is one (POSIX, main thread; a pool
    worker process and a Ray worker both run their tasks on their main thread). The handler
    raises only while armed, so an alarm racing with :meth:`disarm` is ignored rather than
    escaping.

    A solver subprocess (CBC) still running when the limit fires is left to its own
    ``solver.time_limit_s``."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.armed = False
        self.previous = None

    def arm(self) -> None:
        if self.seconds is None or not hasattr(signal, "setitimer") or \
                threading.current_thread() is not threading.main_thread():
            return
        self.previous = signal.signal(signal.SIGALRM, self._fire)
        self.armed = True
        signal.setitimer(signal.ITIMER_REAL, self.seconds)

    def _fire(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        if self.armed:
            self.armed = False
            raise PointTimeout(f"timed out after {self.seconds:g} s (solve.timeout_s)")

    def disarm(self) -> None:
        if self.previous is None:
            return
        self.armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, self.previous)
        self.previous = None
def _config_error(exc: ConfigError, task: PointTask) -> str:
    """``bad override: model.layers: expected a positive integer, got 0`` when the bad key
    is (under) a swept key; otherwise the message with the base file it came from."""
    msg = str(exc)
    src = task.base_source
    key = exc.key or ""
    swept = key and any(key == k or key.startswith(k + ".") or k.startswith(key + ".")
                        for k in task.overrides)
    if not swept:
        return msg
    if src and msg.startswith(src + ": "):
        msg = msg[len(src) + 2:]
    return "bad override: " + msg
def plan_row(plan) -> dict[str, Any]:
    """The result columns of a solved plan."""

    s, c = plan.solver, plan.cost
    step = step_seconds(plan)
    budget = finite_or_none((plan.config.get("cluster") or {}).get("memory_gib"))
    peak_gib = c.peak_memory_bytes / 2**30
    row: dict[str, Any] = {
        "status": s.status, "error": None, "method": s.method,
        "objective_s": finite_or_none(s.objective), "gap": finite_or_none(s.gap),
        "build_s": finite_or_none(s.build_s), "solve_s": finite_or_none(s.solve_s),
        "step_s": step, "total_s": c.total_s, "compute_s": c.compute_s, "comm_s": c.comm_s,
        "activation_comm_s": c.activation_comm_s, "grad_sync_s": c.grad_sync_s,
        "activation_comm_bytes": c.activation_comm_bytes, "grad_sync_bytes": c.grad_sync_bytes,
        "peak_memory_gib": peak_gib,
        "memory_fraction": peak_gib / budget if budget else None,
        "stages": max(1, len(plan.stages)), "devices": plan.num_devices,
        "microbatches": microbatches(plan),
        "bubble_fraction": finite_or_none(plan.schedule.simulated.bubble_fraction
                                if plan.schedule and plan.schedule.simulated else None),
        "layout": layout_summary(plan),
    }
    ratios: dict[str, float | None] = {}
    baselines: dict[str, Any] = {}
    for name, block in plan.baselines.items():
        fam = "ratio_" + re.sub(r"\W", "_", baseline_family(name))
        if "error" in block:
            baselines[name] = block["error"]
            ratios.setdefault(fam, None)
            continue
        ratio = baseline_seconds(block) / step if step else None
        baselines[name] = ratio
        if ratio is not None and (ratios.get(fam) is None or ratio < ratios[fam]):
            ratios[fam] = ratio
    row.update(ratios)
    row["baselines"] = baselines
    return row


def failed_row(task: PointTask, error: str) -> dict[str, Any]:
    """The row of a point whose worker never returned one (it died, or raised)."""
    return {"point": task.index, "id": Point(task.index, task.overrides).id,
            "overrides": task.overrides, "fingerprint": task.fingerprint,
            "status": "error", "error": error}


def finite_or_none(x: Any) -> float | None:
    """``x`` as a finite float, or None: a row's metric may be missing, text or NaN."""
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) else None


def short_text(v: Any) -> str:
    """A swept value as it reads in a label, a table cell or a file name (``1e-05``,
    ``[1,4]``)."""
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, str | int) or v is None:
        return str(v)
    return json.dumps(v, separators=(",", ":"))


def file_safe(text: str) -> str:
    """``text`` with every run of characters unsafe in a file name replaced by ``_``; a
    name of dots alone (``..``) becomes ``_``, so it never names a folder above."""
    safe = re.sub(r"[^A-Za-z0-9._=-]+", "_", text).strip("_")
    return safe if safe.strip(".") else "_"
