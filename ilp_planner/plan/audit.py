"""Predicted vs executed collectives, per rank and step — the check that a plan is a program.

:func:`predicted` reads what a plan prices for one rank and one optimizer step: every
collective of the layers on the rank's stage (per micro-batch, or once per step for
weight-gradient synchronisation and tied-weight exchanges; under interleaved 1F1B, of every
chunk on the rank's mesh) and every cross-mesh broadcast
task the rank sends or receives, forward (``tasks``) and backward (``backward_tasks``).
:func:`compare` sets it beside what the runtime's dispatch-level recorder saw (``(kind,
purpose, bytes)`` rows; the loss report is not part of the plan) and flags every (kind,
purpose, phase, group size) whose count or bytes differ.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ilp_planner.ir.graph import DTYPE_BYTES
from ilp_planner.ir.regions import region_numel
from ilp_planner.lowering.cost_model import ONCE_PER_STEP
from ilp_planner.plan.data import Plan

Key = tuple[str, str, str, int]  # (kind, purpose, phase, group size)


def predicted(plan: Plan, rank: int, microbatches: int) -> dict[Key, tuple[int, float]]:
    """(count, bytes) per (kind, purpose) the plan prices for ``rank`` in one step of
    ``microbatches`` micro-batches."""
    m = microbatches
    # the rank's stages: one, or under interleaved 1F1B each of its mesh's chunks
    mine = {s.index for s in plan.stages if rank in s.devices} or {0}
    out: dict[Key, list[float]] = {}

    def add(key: Key, times: int, nbytes: float) -> None:
        acc = out.setdefault(key, [0, 0.0])
        acc[0] += times
        acc[1] += times * nbytes

    for layer in plan.layers:
        if plan.stages and layer.stage not in mine:
            continue
        for c in layer.collectives:
            add((c.kind.value, c.purpose, c.phase, c.group_size),
                1 if c.purpose in ONCE_PER_STEP else m, c.bytes)
    for e in plan.resharding:
        itemsize = DTYPE_BYTES[e.dtype]
        for phase, tasks in (("forward", e.tasks), ("backward", e.backward_tasks)):
            for t in tasks:
                nbytes = region_numel(t.region) * itemsize
                group = set(t.group)
                if rank in group:
                    add(("broadcast", "resharding", phase, len(group) - 1), m, nbytes)
    return {k: (int(v[0]), float(v[1])) for k, v in out.items()}


def executed(events: Iterable) -> dict[Key, tuple[int, float]]:
    """(count, bytes) per (kind, purpose) of recorded events, the loss report aside."""
    out: dict[Key, list[float]] = {}
    for ev in events:
        if ev.phase == "report":
            continue
        acc = out.setdefault((ev.kind, ev.purpose, ev.phase, ev.group_size), [0, 0.0])
        acc[0] += 1
        acc[1] += ev.bytes
    return {k: (int(v[0]), float(v[1])) for k, v in out.items()}


@dataclass(frozen=True)
class AuditRow:
    kind: str
    purpose: str
    phase: str
    group_size: int
    predicted_count: int
    predicted_bytes: float
    executed_count: int
    executed_bytes: float

    @property
    def ok(self) -> bool:
        if self.predicted_count != self.executed_count:
            return False
        big = max(self.predicted_bytes, self.executed_bytes)
        return big == 0 or abs(self.predicted_bytes - self.executed_bytes) <= 0.02 * big


def compare(pred: dict[Key, tuple[int, float]], done: dict[Key, tuple[int, float]]) -> list[AuditRow]:
    rows = []
    for key in sorted(set(pred) | set(done)):
        pc, pb = pred.get(key, (0, 0.0))
        ec, eb = done.get(key, (0, 0.0))
        rows.append(AuditRow(*key, pc, pb, ec, eb))
    return rows


def format_rows(rank: int, rows: list[AuditRow]) -> str:
    lines = [f"rank {rank}: {'kind':<15}{'purpose':<13}{'phase':<9}{'p':>3}{'planned':>9}{'bytes':>13}"
             f"{'executed':>10}{'bytes':>13}  ratio"]
    for r in rows:
        ratio = r.executed_bytes / r.predicted_bytes if r.predicted_bytes else float("inf") \
            if r.executed_bytes else 1.0
        lines.append(f"        {r.kind:<15}{r.purpose:<13}{r.phase:<9}{r.group_size:>3}{r.predicted_count:>9}"
                     f"{r.predicted_bytes:>13.0f}{r.executed_count:>10}{r.executed_bytes:>13.0f}"
                     f"  {ratio:.3f}{'' if r.ok else '  MISMATCH'}")
    return "\n".join(lines)
