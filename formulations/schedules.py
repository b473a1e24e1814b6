"""Pipeline schedules as data: per-stage ordered action lists, generators, lowering, validation.

A schedule for ``S`` stages and ``M`` micro-batches is one ordered row of :class:`Action` per
stage (stage ``s = 0..S-1`` in code; the papers number them ``i = s + 1``). Kinds:

=========  =====  ==========================================================================
kind       short  meaning
=========  =====  ==========================================================================
F          ``F``  forward of micro-batch m on this stage
B          ``B``  backward: the full backward, or only the input-gradient half when the
                  schedule splits the backward (``split_backward``)
W          ``W``  weight-gradient half of the backward (only with ``split_backward``)
SEND_F     ``SF`` send the activation of m to stage s+1      (after F(m) on s)
RECV_F     ``RF`` wait for the activation of m from stage s-1 (before F(m) on s)
SEND_B     ``SB`` send the input gradient of m to stage s-1  (after B(m) on s)
RECV_B     ``RB`` wait for the gradient of m from stage s+1   (before B(m) on s)
=========  =====  ==========================================================================

String form (round-trips, PyTorch-pipelining style): ``F3``, ``B0``, ``W2``, ``SF1`` inside a
row (the row gives the stage) or ``2F3`` with an explicit stage prefix.

Generators (warm-up = forwards a stage runs before its first backward, capped by ``M``):

* GPipe: every stage runs all ``M`` forwards, then all ``M`` backwards.
* 1F1B (Narayanan et al.): stage ``i = 1..S`` warms up with ``S − i + 1`` forwards, then
  alternates one backward and one forward (steady phase), then drains its backwards.
* eager-1F1B (Zhuang et al. §4): the same with ``2(S − i) + 1`` warm-up forwards, so a stage has
  computation of other micro-batches to run while a cross-mesh transfer is in flight.

With ``delay_weight_grad`` every B is split into B (input gradient, which is all the upstream
stage waits for) and W (weight gradient). W is deferred: after each B the stage first runs its
next forward (if any) and then runs pending W's only while more than ``lag_s`` are pending; the
rest run at the end, filling the drain bubble. Default ``lag_s = min(s, M)`` (0-based ``s``):
stage ``s`` idles about ``s`` backward-times at the end of 1F1B, so it keeps that many W's to
fill it (the ZB-H1 pattern).

In-flight activations of a stage = forwards run whose backward (W when split) has not run. In
program order this peaks at the warm-up count without split — the number the stage DP charges
(:func:`inflight_microbatches`) — and at most ``min(warm-up + lag + 1, M)`` with it (a W runs
after the next forward).

Lowering (:func:`lower`) is a pure pass that inserts the transfers: ``RF`` just before each F
and ``SF`` just after it, ``RB`` just before each B and ``SB`` just after it, on every stage
boundary. Receives are *waits* (unbounded buffers: a send never blocks on its receiver).

Interleaved 1F1B (:func:`interleaved_1f1b`, Narayanan et al. SC'21 §2.2.2): each of the ``S``
rows (stage meshes) holds ``v`` model chunks, chunk ``j`` on row ``j mod S``; an action's
``stage`` is its chunk (``2F3`` in a row's strings) and the boundaries, links and
dependencies above are between consecutive *chunks* — the last stage sends chunk
``S − 1``'s activation to stage 0 for chunk ``S`` (the wrap-around). Every rule below reads
"chunk" for "stage" then; with ``v = 1`` the two coincide.

Validation (:func:`validate`) proves a schedule (lowered or not) is

1. complete — every required action for every micro-batch on every stage exactly once;
2. locally ordered — on each stage F(m) < B(m) < W(m), RF(m) < F(m) < SF(m), RB(m) < B(m) <
   SB(m) in program order;
3. channel-ordered (lowered schedules, ``fifo_channels``) — on each directed link the receives
   are posted in the order of the sends (NCCL matches point-to-point messages in order);
4. deadlock-free — the per-stage orders plus the cross-stage edges F(m, s−1) → F(m, s) and
   B(m, s+1) → B(m, s) (or SF → RF, SB → RB when lowered) form an acyclic graph. It is
   checked by running the schedule with unbounded buffers: repeatedly advance every stage
   whose next action has its cross-stage dependency done; if some stage cannot finish, the
   blocked front is reported (every stage's stuck action and what it waits for).

Errors are :class:`ScheduleError` naming the stage, position and action, with the stage ×
step grid printed and the failing cell(s) marked ``[..]``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum

from ilp_planner.errors import PlannerError

SCHEDULE_NAMES = ("gpipe", "1f1b", "eager-1f1b")
INTERLEAVED = "interleaved-1f1b"
# every name the planner knows; the interleaved schedule also needs its virtual-stage count
ALL_SCHEDULE_NAMES = (*SCHEDULE_NAMES, INTERLEAVED)


class ScheduleError(PlannerError):
    """A schedule is malformed, incomplete, misordered or would deadlock.

    ``stage``/``position``/``action`` locate the first failing cell (``None`` when the
    problem is not tied to one cell); the message ends with the marked grid."""

    def __init__(
        self,
        message: str,
        *,
        stage: int | None = None,
        position: int | None = None,
        action: Action | None = None,
    ):
        self.stage = stage
        self.position = position
        self.action = action
        super().__init__(message)


class ActionKind(Enum):
    F = "F"
    B = "B"
    W = "W"
    SEND_F = "SF"
    RECV_F = "RF"
    SEND_B = "SB"
    RECV_B = "RB"

    # Members are singletons: identity hashing is exact and much cheaper than Enum's.
    __hash__ = object.__hash__

    @property
    def is_compute(self) -> bool:
        return self.value in ("F", "B", "W")

    @property
    def is_comm(self) -> bool:
        return self.value not in ("F", "B", "W")


COMPUTE_KINDS = (ActionKind.F, ActionKind.B, ActionKind.W)
COMM_KINDS = (ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B)
_BY_SHORT = {k.value: k for k in ActionKind}
_ACTION_RE = re.compile(r"^\s*(\d+)?(SF|RF|SB|RB|F|B|W)(\d+)\s*$")


@dataclass(frozen=True)
class Action:
    """One step of one stage: ``kind`` on ``microbatch`` at ``stage`` (0-based; under
    interleaved 1F1B the model chunk, which runs on stage ``stage mod S``)."""

    kind: ActionKind
    microbatch: int
    stage: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self.stage}{self.kind.value}{self.microbatch})"

    @property
    def long(self) -> str:
        """``2F3``: stage-prefixed form, unambiguous outside a row."""
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    @classmethod
    def parse(cls, text: str, stage: int | None = None) -> Action:
        """Parse ``F3`` (needs ``stage``) or ``2F3``. A prefix must agree with ``stage``."""
        m = _ACTION_RE.match(text)
        if not m:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected e.g. 'F3', 'B0', 'W2', 'SF1' or '2F3'"
            )
        prefix, short, mb = m.groups()
        if prefix is not None:
            if stage is not None and int(prefix) != stage:
                raise ScheduleError(
                    f"action {text!r} names stage {prefix} but sits in the row of stage {stage}",
                    stage=stage,
                )
            stage = int(prefix)
        if stage is None:
            raise ScheduleError(f"action {text!r} has no stage: write it as e.g. '0{text}'")
        return cls(_BY_SHORT[short], int(mb), stage)


@dataclass(frozen=True)
class Schedule:
    """Per-stage ordered action lists. ``split_backward``: B is the input-gradient half and
    every micro-batch also has a W. ``lowered``: the rows contain send/recv actions.

    ``virtual_stages`` (``v``, interleaved schedules): the model is cut into
    ``num_chunks = num_stages · v`` chunks, chunk ``j`` on row ``j mod num_stages``; an
    action's ``stage`` is then its chunk and its string form carries it (``2F3``). With
    ``v = 1`` chunk and row coincide (every other schedule)."""

    name: str
    num_stages: int
    num_microbatches: int
    rows: tuple[tuple[Action, ...], ...]
    split_backward: bool = False
    virtual_stages: int = 1

    @property
    def lowered(self) -> bool:
        return any(a.kind.is_comm for row in self.rows for a in row)

    @property
    def num_chunks(self) -> int:
        """Model chunks (virtual stages in all): ``num_stages · virtual_stages``."""
        return self.num_stages * self.virtual_stages

    def chunks_of(self, row: int) -> tuple[int, ...]:
        """The chunks row ``row`` runs: ``row, row + S, …``."""
        return tuple(range(row, self.num_chunks, self.num_stages))

    def to_strings(self) -> list[list[str]]:
        if self.virtual_stages > 1:
            return [[a.long for a in row] for row in self.rows]
        return [[str(a) for a in row] for row in self.rows]

    @classmethod
    def from_strings(
        cls,
        rows: Sequence[Sequence[str] | str],
        *,
        num_microbatches: int | None = None,
        name: str = "custom",
        split_backward: bool | None = None,
        virtual_stages: int = 1,
    ) -> Schedule:
        """Rows of ``"F0"``-style strings (a row may be one space-separated string; with
        ``virtual_stages > 1`` every action names its chunk, ``"2F0"``).
        ``num_microbatches`` defaults to 1 + the largest index; ``split_backward`` to
        whether any W appears."""
        parsed = []
        for s, row in enumerate(rows):
            items = row.split() if isinstance(row, str) else row
            parsed.append(tuple(_parse_in_row(t, s, len(rows), virtual_stages) for t in items))
        if num_microbatches is None:
            num_microbatches = 1 + max((a.microbatch for r in parsed for a in r), default=-1)
        if split_backward is None:
            split_backward = any(a.kind is ActionKind.W for r in parsed for a in r)
        return cls(name, len(parsed), num_microbatches, tuple(parsed), split_backward,
                   virtual_stages)

    def to_dict(self) -> dict:
        d = {
            "name": self.name,
            "stages": self.num_stages,
            "microbatches": self.num_microbatches,
            "split_backward": self.split_backward,
            "rows": [" ".join(r) for r in self.to_strings()],
        }
        return d if self.virtual_stages == 1 else {**d, "virtual_stages": self.virtual_stages}

    @classmethod
    def from_dict(cls, d: dict) -> Schedule:
        sched = cls.from_strings(
            d["rows"],
            num_microbatches=d["microbatches"],
            name=d.get("name", "custom"),
            split_backward=d.get("split_backward"),
            virtual_stages=d.get("virtual_stages", 1),
        )
        if sched.num_stages != d["stages"]:
            raise ScheduleError(
                f"schedule {sched.name!r} declares {d['stages']} stages but has {sched.num_stages} rows"
            )
        return sched

    def grid(self, marks: Iterable[tuple[int, int]] = (), window: int = 12) -> str:
        return render_grid(self, marks, window=window)

    def __str__(self) -> str:
        return render_grid(self, (), window=None)


def _parse_in_row(text: str, row: int, num_rows: int, virtual_stages: int) -> Action:
    """One action of row ``row``; with virtual stages its chunk prefix is required and must
    be one of the row's chunks (``row + k·num_rows``)."""
    if virtual_stages == 1:
        return Action.parse(text, row)
    a = Action.parse(text)  # needs the prefix
    if a.stage % num_rows != row or not 0 <= a.stage < num_rows * virtual_stages:
        raise ScheduleError(
            f"action {text!r} names chunk {a.stage} but sits in the row of stage {row}: with "
            f"{num_rows} stages × {virtual_stages} virtual stages, stage {row} runs chunks "
            f"{list(range(row, num_rows * virtual_stages, num_rows))}",
            stage=row,
        )
    return a


# ---------------------------------------------------------------------------------------------
# Warm-up and in-flight counts (the formulas the stage DP charges memory with)


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1 or num_microbatches < 1:
        raise ScheduleError(
            f"a schedule needs at least one stage and one micro-batch, got "
            f"{num_stages} stages × {num_microbatches} micro-batches"
        )


def warmup_1f1b(num_stages: int, stage: int, num_microbatches: int) -> int:
    """1F1B: stage ``i = stage + 1`` runs ``S − i + 1`` forwards first, capped by ``M``."""
    return min(num_stages - stage, num_microbatches)


def warmup_eager_1f1b(num_stages: int, stage: int, num_microbatches: int) -> int:
    """eager-1F1B (Zhuang et al. §4): ``2(S − i) + 1`` warm-up forwards, capped by ``M``."""
    return min(2 * (num_stages - 1 - stage) + 1, num_microbatches)


def warmup_gpipe(num_stages: int, stage: int, num_microbatches: int) -> int:
    """GPipe: all ``M`` forwards before any backward."""
    return num_microbatches


_WARMUP = {"gpipe": warmup_gpipe, "1f1b": warmup_1f1b, "eager-1f1b": warmup_eager_1f1b}


def check_schedule_name(name: str) -> str:
    key = name.lower().replace("_", "-")
    if key in ("eager1f1b", "eager"):
        key = "eager-1f1b"
    if key in ("interleaved1f1b", "1f1b-interleaved"):
        key = INTERLEAVED
    if key not in ALL_SCHEDULE_NAMES:
        raise ScheduleError(
            f"unknown pipeline schedule {name!r}: expected one of {', '.join(ALL_SCHEDULE_NAMES)}"
        )
    return key


def warmup_forwards(name: str, num_stages: int, stage: int, num_microbatches: int) -> int:
    """Warm-up forwards of ``stage`` (0-based) under schedule ``name`` (not the
    interleaved one: its count needs the virtual stages, :func:`warmup_interleaved`)."""
    key = check_schedule_name(name)
    if key == INTERLEAVED:
        raise ScheduleError(
            f"schedule {INTERLEAVED!r} counts its warm-up in chunks and needs the number of "
            f"virtual stages: use warmup_interleaved / inflight_interleaved"
        )
    return _WARMUP[key](num_stages, stage, num_microbatches)


def inflight_microbatches(name: str, stages_from_end: int, num_microbatches: int) -> int:
    """Micro-batches whose activations a stage holds at its peak, by its position counted
    from the end (``stages_from_end = S − i + 1``: 1 for the last stage). Without weight
    delaying this is the warm-up count: 1F1B ``s``, eager-1F1B ``2s − 1``, GPipe ``M``,
    all capped by ``M``. It depends only on the stages after this one, which is what lets
    the stage DP check memory while building the pipeline from its end."""
    return warmup_forwards(name, stages_from_end, 0, num_microbatches)


def default_weight_lags(num_stages: int, num_microbatches: int) -> tuple[int, ...]:
    """Pending-W allowance per stage: ``min(s, M)``, the drain bubble of stage ``s`` measured
    in backward steps."""
    return tuple(min(s, num_microbatches) for s in range(num_stages))


# ---------------------------------------------------------------------------------------------
# Generators


def _generate(
    name: str,
    num_stages: int,
    num_microbatches: int,
    warmups: Sequence[int],
    delay_weight_grad: bool | Sequence[int],
) -> Schedule:
    S, M = num_stages, num_microbatches
    split = delay_weight_grad is not False
    if split:
        lags = (
            default_weight_lags(S, M)
            if delay_weight_grad is True
            else tuple(int(x) for x in delay_weight_grad)  # type: ignore[union-attr]
        )
        if len(lags) != S or any(x < 0 for x in lags):
            raise ScheduleError(f"delay_weight_grad needs one non-negative lag per stage ({S}), got {lags}")
    rows = []
    for s in range(S):
        w = warmups[s]
        row: list[Action] = [Action(ActionKind.F, m, s) for m in range(w)]
        pending: list[int] = []
        for k in range(M):
            row.append(Action(ActionKind.B, k, s))
            if w + k < M:
                row.append(Action(ActionKind.F, w + k, s))
            if split:
                pending.append(k)
                while len(pending) > lags[s]:
                    row.append(Action(ActionKind.W, pending.pop(0), s))
        row.extend(Action(ActionKind.W, m, s) for m in pending)
        rows.append(tuple(row))
    return Schedule(name, S, M, tuple(rows), split_backward=split)


def gpipe(
    num_stages: int, num_microbatches: int, *, delay_weight_grad: bool | Sequence[int] = False
) -> Schedule:
    """All forwards, then all backwards, on every stage."""
    _check_sizes(num_stages, num_microbatches)
    w = [warmup_gpipe(num_stages, s, num_microbatches) for s in range(num_stages)]
    return _generate("gpipe", num_stages, num_microbatches, w, delay_weight_grad)


def one_f_one_b(
    num_stages: int, num_microbatches: int, *, delay_weight_grad: bool | Sequence[int] = False
) -> Schedule:
    """1F1B: ``S − i + 1`` warm-up forwards on stage ``i``, then backward/forward pairs."""
    _check_sizes(num_stages, num_microbatches)
    w = [warmup_1f1b(num_stages, s, num_microbatches) for s in range(num_stages)]
    return _generate("1f1b", num_stages, num_microbatches, w, delay_weight_grad)


def eager_1f1b(
    num_stages: int, num_microbatches: int, *, delay_weight_grad: bool | Sequence[int] = False
) -> Schedule:
    """eager-1F1B: ``2(S − i) + 1`` warm-up forwards on stage ``i`` (Zhuang et al. §4)."""
    _check_sizes(num_stages, num_microbatches)
    w = [warmup_eager_1f1b(num_stages, s, num_microbatches) for s in range(num_stages)]
    return _generate("eager-1f1b", num_stages, num_microbatches, w, delay_weight_grad)


def check_interleaved(num_stages: int, num_microbatches: int, virtual_stages: int) -> None:
    """What the interleaved schedule requires (Megatron-LM's own condition): at least one
    virtual stage, and micro-batches in whole rounds of ``num_stages``."""
    _check_sizes(num_stages, num_microbatches)
    if virtual_stages < 1:
        raise ScheduleError(f"{INTERLEAVED}: virtual_stages must be at least 1, got {virtual_stages}")
    if num_microbatches % num_stages:
        raise ScheduleError(
            f"{INTERLEAVED}: the micro-batches ({num_microbatches}) must be a multiple of the "
            f"pipeline stages ({num_stages}), as in Megatron-LM: each chunk runs the "
            f"micro-batches in rounds of {num_stages}"
        )


def warmup_interleaved(num_stages: int, stage: int, num_microbatches: int, virtual_stages: int) -> int:
    """Interleaved 1F1B (Narayanan et al. SC'21 §2.2.2; Megatron-LM): stage ``s`` (0-based)
    runs ``2(S − 1 − s) + (v − 1)·S`` chunk forwards before its first backward, capped by the
    ``M·v`` chunk forwards it has."""
    return min(2 * (num_stages - 1 - stage) + (virtual_stages - 1) * num_stages,
               num_microbatches * virtual_stages)


def inflight_interleaved(num_stages: int, stage: int, num_microbatches: int, virtual_stages: int) -> int:
    """Peak chunk activations stage ``s`` holds under interleaved 1F1B: its warm-up plus the
    steady phase's forward that runs before its backward (capped by ``M·v``). Each is one
    chunk's activations, about ``1/v`` of the stage's layers: stage 0 of 4 with ``v = 2``
    holds 11 half-stage activations where 1F1B holds 4 whole ones."""
    return min(warmup_interleaved(num_stages, stage, num_microbatches, virtual_stages) + 1,
               num_microbatches * virtual_stages)


def interleaved_1f1b(num_stages: int, num_microbatches: int, virtual_stages: int) -> Schedule:
    """Interleaved 1F1B: stage ``s`` holds chunks ``s, s + S, …, s + (v − 1)S`` of the
    model cut into ``S·v`` contiguous chunks. Its ``M·v`` chunk forwards run in rounds of
    ``S`` micro-batches per chunk, chunk after chunk (forward ``k``: chunk
    ``(k // S) mod v``, micro-batch ``(k // (S·v))·S + k mod S``), its backwards in the same
    rounds from the last chunk down. After :func:`warmup_interleaved` forwards it alternates
    a forward and a backward, then drains its backwards (the order of PyTorch's
    ``ScheduleInterleaved1F1B`` and Megatron-LM's interleaved schedule). The bubble shrinks
    ``v``-fold: ``(S − 1)/(v·M)`` of the ideal time for equal chunks."""
    check_interleaved(num_stages, num_microbatches, virtual_stages)
    S, M, v = num_stages, num_microbatches, virtual_stages
    total = M * v

    def mb(k: int) -> int:
        return (k // (S * v)) * S + k % S

    rows = []
    for s in range(S):
        w = warmup_interleaved(S, s, M, v)

        def fwd(k: int, s: int = s) -> Action:
            return Action(ActionKind.F, mb(k), ((k // S) % v) * S + s)

        def bwd(k: int, s: int = s) -> Action:
            return Action(ActionKind.B, mb(k), (v - 1 - (k // S) % v) * S + s)

        row = [fwd(k) for k in range(w)]
        for k in range(total - w):
            row += [fwd(k + w), bwd(k)]
        row += [bwd(k) for k in range(total - w, total)]
        rows.append(tuple(row))
    return Schedule(INTERLEAVED, S, M, tuple(rows), virtual_stages=v)


def make_schedule(
    name: str,
    num_stages: int,
    num_microbatches: int,
    *,
    delay_weight_grad: bool | Sequence[int] = False,
    virtual_stages: int = 1,
) -> Schedule:
    """The generator for ``name`` (``gpipe``, ``1f1b``, ``eager-1f1b``, or
    ``interleaved-1f1b`` with ``virtual_stages`` chunks per stage)."""
    key = check_schedule_name(name)
    if key == INTERLEAVED:
        if delay_weight_grad is not False:
            raise ScheduleError(f"{INTERLEAVED} does not split the backward (delay_weight_grad)")
        return interleaved_1f1b(num_stages, num_microbatches, virtual_stages)
    if virtual_stages != 1:
        raise ScheduleError(f"schedule {key!r} runs one chunk per stage; virtual_stages "
                            f"{virtual_stages} needs {INTERLEAVED!r}")
    gen = {"gpipe": gpipe, "1f1b": one_f_one_b, "eager-1f1b": eager_1f1b}[key]
    return gen(num_stages, num_microbatches, delay_weight_grad=delay_weight_grad)


# ---------------------------------------------------------------------------------------------
# Lowering


def lower(schedule: Schedule) -> Schedule:
    """Insert the transfers: ``RF m`` before and ``SF m`` after each F (where a neighbour
    exists), ``RB m`` before and ``SB m`` after each B. An already lowered schedule is
    returned unchanged."""
    if schedule.lowered:
        return schedule
    C = schedule.num_chunks  # boundaries are between consecutive chunks (stages when v = 1)
    rows = []
    for row in schedule.rows:
        out: list[Action] = []
        for a in row:
            m, j = a.microbatch, a.stage
            if a.kind is ActionKind.F:
                if j > 0:
                    out.append(Action(ActionKind.RECV_F, m, j))
                out.append(a)
                if j < C - 1:
                    out.append(Action(ActionKind.SEND_F, m, j))
            elif a.kind is ActionKind.B:
                if j < C - 1:
                    out.append(Action(ActionKind.RECV_B, m, j))
                out.append(a)
                if j > 0:
                    out.append(Action(ActionKind.SEND_B, m, j))
            else:
                out.append(a)
        rows.append(tuple(out))
    return dataclasses.replace(schedule, rows=tuple(rows))


# ---------------------------------------------------------------------------------------------
# In-flight activations


def inflight_profile(schedule: Schedule) -> tuple[tuple[int, ...], ...]:
    """Per stage, the number of micro-batches holding activations after each action in
    program order (+1 at F, −1 at the last backward part: W when split, else B)."""
    release = ActionKind.W if schedule.split_backward else ActionKind.B
    out = []
    for row in schedule.rows:
        n, prof = 0, []
        for a in row:
            if a.kind is ActionKind.F:
                n += 1
            elif a.kind is release:
                n -= 1
            prof.append(n)
        out.append(tuple(prof))
    return tuple(out)


def peak_inflight(schedule: Schedule) -> tuple[int, ...]:
    """Peak in-flight micro-batches per stage (see :func:`inflight_profile`)."""
    return tuple(max(p, default=0) for p in inflight_profile(schedule))


# ---------------------------------------------------------------------------------------------
# Grid rendering


def render_grid(schedule: Schedule, marks: Iterable[tuple[int, int]] = (), window: int | None = 12) -> str:
    """The stage × step grid; cells in ``marks`` ((stage, position) pairs) are shown as
    ``[F3]``. With ``window``, only the columns within ``window`` of a mark are shown."""
    marks = set(marks)
    show: Callable[[Action], str] = (lambda a: a.long) if schedule.virtual_stages > 1 else str
    width = max((len(show(a)) for row in schedule.rows for a in row), default=2) + 2
    ncols = max((len(r) for r in schedule.rows), default=0)
    lo, hi = 0, ncols
    if window is not None and marks:
        cols = [p for _, p in marks]
        lo, hi = max(0, min(cols) - window), min(ncols, max(cols) + window + 1)
    elif window is not None and ncols > 4 * window:
        hi = 4 * window
    label_w = len(f"stage {schedule.num_stages - 1}")
    head = " " * label_w + " |" + "".join(f"{p:>{width}}" for p in range(lo, hi))
    lines = [head + (" …" if hi < ncols else "")]
    if lo > 0:
        lines[0] = " " * label_w + " |" + f" … (steps from {lo})"
        lines.append(head)
    for s, row in enumerate(schedule.rows):
        cells = []
        for p in range(lo, hi):
            if p >= len(row):
                cells.append(" " * width)
                continue
            text = show(row[p])
            text = f"[{text}]" if (s, p) in marks else f" {text} "
            cells.append(f"{text:>{width}}")
        more = " …" if len(row) > hi else ""
        lines.append(f"{'stage ' + str(s):<{label_w}} |" + "".join(cells) + more)
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Validation


def _fail(schedule: Schedule, msg: str, cells: Sequence[tuple[int, int]]) -> ScheduleError:
    stage = pos = action = None
    if cells:
        stage, pos = cells[0]
        if 0 <= stage < len(schedule.rows) and 0 <= pos < len(schedule.rows[stage]):
            action = schedule.rows[stage][pos]
    grid = render_grid(schedule, cells)
    return ScheduleError(
        f"schedule {schedule.name!r} ({schedule.num_stages} stages × "
        f"{schedule.num_microbatches} micro-batches): {msg}\n{grid}",
        stage=stage,
        position=pos,
        action=action,
    )


def _where(s: int, p: int, a: Action) -> str:
    """Where cell (s, p) is; an action of another chunk than the row's own names it."""
    return f"stage {s}, position {p} ({a if a.stage == s else a.long})"


def _required_kinds(schedule: Schedule, j: int, lowered: bool) -> list[ActionKind]:
    """What chunk ``j`` (the stage itself without virtual stages) runs per micro-batch."""
    C = schedule.num_chunks
    kinds = [ActionKind.F, ActionKind.B]
    if schedule.split_backward:
        kinds.append(ActionKind.W)
    if lowered:
        if j > 0:
            kinds += [ActionKind.RECV_F, ActionKind.SEND_B]
        if j < C - 1:
            kinds += [ActionKind.SEND_F, ActionKind.RECV_B]
    return kinds


Key = tuple[ActionKind, int, int]  # (kind, micro-batch, chunk)


# (earlier, later): on every stage the first must precede the second for the same micro-batch
_LOCAL_ORDER = (
    (ActionKind.F, ActionKind.B, "backward before its forward"),
    (ActionKind.B, ActionKind.W, "weight gradient before its input-gradient backward"),
    (ActionKind.RECV_F, ActionKind.F, "forward before the receive of its activation"),
    (ActionKind.F, ActionKind.SEND_F, "activation sent before the forward computed it"),
    (ActionKind.RECV_B, ActionKind.B, "backward before the receive of its gradient"),
    (ActionKind.B, ActionKind.SEND_B, "gradient sent before the backward computed it"),
)


def validate(schedule: Schedule, *, fifo_channels: bool = True) -> None:
    """Raise :class:`ScheduleError` unless ``schedule`` is complete, locally ordered,
    channel-ordered (lowered schedules with ``fifo_channels``) and deadlock-free (see the
    module docstring). Returns ``None`` when it is valid."""
    S, M = schedule.num_stages, schedule.num_microbatches
    if S < 1 or M < 1 or len(schedule.rows) != S:
        raise ScheduleError(
            f"schedule {schedule.name!r} declares {S} stages × {M} micro-batches but has "
            f"{len(schedule.rows)} rows"
        )
    lowered = schedule.lowered
    pos: list[dict[Key, int]] = []
    # 1. well-formed cells, exactly once
    for s, row in enumerate(schedule.rows):
        required = {j: _required_kinds(schedule, j, lowered) for j in schedule.chunks_of(s)}
        allowed = {j: set(k) for j, k in required.items()}
        seen: dict[Key, int] = {}
        for p, a in enumerate(row):
            key = (a.kind, a.microbatch, a.stage)
            if a.kind not in allowed.get(a.stage, ()) or not 0 <= a.microbatch < M or key in seen:
                raise _cell_error(schedule, s, p, allowed, seen)
            seen[key] = p
        if len(seen) != sum(len(k) for k in required.values()) * M:
            missing = next(Action(k, m, j) for j, kinds in required.items() for k in kinds
                           for m in range(M) if (k, m, j) not in seen)
            what = "chunk" if schedule.virtual_stages > 1 else "stage"
            err = _fail(
                schedule,
                f"stage {s}: {missing.long if schedule.virtual_stages > 1 else missing} is missing "
                f"(every {what} needs {'/'.join(k.value for k in required[missing.stage])} for "
                f"micro-batches 0..{M - 1})",
                [(s, len(row) - 1)] if row else [],
            )
            err.stage, err.position, err.action = s, None, missing
            raise err
        pos.append(seen)
    # 2. same-stage dependencies
    for s in range(S):
        where = pos[s]
        for first, second, why in _LOCAL_ORDER:
            for j in schedule.chunks_of(s):
                if (first, 0, j) not in where or (second, 0, j) not in where:
                    continue
                _check_local_order(schedule, s, j, where, first, second, why)
    # 3. FIFO channels
    if lowered and fifo_channels:
        _check_channels(schedule)
    # 4. deadlock (acyclicity of program order + cross-stage edges)
    _check_deadlock(schedule, pos)


def _check_local_order(schedule: Schedule, s: int, j: int, where: dict[Key, int],
                       first: ActionKind, second: ActionKind, why: str) -> None:
    """On row ``s``, ``first`` precedes ``second`` of chunk ``j`` for every micro-batch."""
    for m in range(schedule.num_microbatches):
        p1, p2 = where[(first, m, j)], where[(second, m, j)]
        if p2 < p1:
            a = schedule.rows[s][p2]
            raise _fail(
                schedule,
                f"{_where(s, p2, a)}: {why} {schedule.rows[s][p1]} (position {p1})",
                [(s, p2), (s, p1)],
            )


def _cell_error(
    schedule: Schedule,
    s: int,
    p: int,
    allowed: dict[int, set[ActionKind]],
    seen: dict[Key, int],
) -> ScheduleError:
    """Explain why cell (s, p) is not acceptable (the slow path of :func:`validate`)."""
    a, M = schedule.rows[s][p], schedule.num_microbatches
    if a.stage not in allowed:
        owner = f"stage {a.stage}" if schedule.virtual_stages == 1 else (
            f"chunk {a.stage}, not one of this stage's chunks {sorted(allowed)}")
        return _fail(schedule, f"{_where(s, p, a)} belongs to {owner}", [(s, p)])
    if not 0 <= a.microbatch < M:
        return _fail(
            schedule,
            f"{_where(s, p, a)}: micro-batch {a.microbatch} out of range 0..{M - 1}",
            [(s, p)],
        )
    if a.kind not in allowed[a.stage]:
        why = "W without split_backward" if a.kind is ActionKind.W else "no neighbouring stage on that side"
        return _fail(schedule, f"{_where(s, p, a)}: action not allowed here ({why})", [(s, p)])
    first = seen[(a.kind, a.microbatch, a.stage)]
    return _fail(
        schedule,
        f"{_where(s, p, a)}: duplicate, already at position {first}",
        [(s, p), (s, first)],
    )


def _cross_dep(C: int, lowered: bool, a: Action) -> tuple[int, ActionKind, int] | None:
    """The action of another chunk that ``a`` waits for, as (chunk, kind, microbatch);
    ``C`` chunks (the stages without virtual stages)."""
    s, m, k = a.stage, a.microbatch, a.kind
    if k is ActionKind.RECV_F:
        return (s - 1, ActionKind.SEND_F, m)
    if k is ActionKind.RECV_B:
        return (s + 1, ActionKind.SEND_B, m)
    if not lowered:
        if k is ActionKind.F and s > 0:
            return (s - 1, ActionKind.F, m)
        if k is ActionKind.B and s < C - 1:
            return (s + 1, ActionKind.B, m)
    return None


def _check_channels(schedule: Schedule) -> None:
    """One link per pair of consecutive chunks and direction (the stages without virtual
    stages): its receives come in the order of its sends."""
    S, C = schedule.num_stages, schedule.num_chunks
    links = [(j, j + 1, ActionKind.SEND_F, ActionKind.RECV_F) for j in range(C - 1)]
    links += [(j + 1, j, ActionKind.SEND_B, ActionKind.RECV_B) for j in range(C - 1)]
    for src, dst, send, recv in links:
        sends = [a.microbatch for a in schedule.rows[src % S] if a.kind is send and a.stage == src]
        recvs = [(p, a) for p, a in enumerate(schedule.rows[dst % S])
                 if a.kind is recv and a.stage == dst]
        for n, (p, a) in enumerate(recvs):
            if a.microbatch != sends[n]:
                raise _fail(
                    schedule,
                    f"{_where(dst % S, p, a)}: receive #{n} on link {src}→{dst} expects "
                    f"micro-batch {a.microbatch} but send #{n} carries {sends[n]} "
                    f"(messages on one link are matched in order)",
                    [(dst % S, p)],
                )


def _check_deadlock(schedule: Schedule, pos: list[dict[Key, int]]) -> None:
    S, C, lowered = schedule.num_stages, schedule.num_chunks, schedule.lowered
    # deps[s][p] = (stage, position) of the cross-stage action that cell (s, p) waits for
    deps = []
    for row in schedule.rows:
        drow = []
        for a in row:
            dep = _cross_dep(C, lowered, a)
            drow.append(None if dep is None else (dep[0] % S, pos[dep[0] % S][(dep[1], dep[2], dep[0])]))
        deps.append(drow)
    ptr = [0] * S
    lengths = [len(r) for r in schedule.rows]
    progress = True
    while progress:
        progress = False
        for s in range(S):
            p, n, drow = ptr[s], lengths[s], deps[s]
            while p < n:
                d = drow[p]
                if d is not None and d[1] >= ptr[d[0]]:
                    break
                p += 1
            if p != ptr[s]:
                ptr[s] = p
                progress = True
    blocked = [s for s in range(S) if ptr[s] < lengths[s]]
    if not blocked:
        return
    cells, waits = [], []
    for s in blocked:
        a = schedule.rows[s][ptr[s]]
        ds, dp = deps[s][ptr[s]]  # type: ignore[misc]
        cells.append((s, ptr[s]))
        waits.append(
            f"{_where(s, ptr[s], a)} waits for {schedule.rows[ds][dp]} on stage {ds} "
            f"(position {dp}), but stage {ds} is stuck at position {ptr[ds]} "
            f"({schedule.rows[ds][ptr[ds]]})"
        )
    raise _fail(schedule, "deadlock: no stage can proceed.\n  " + "\n  ".join(waits), cells)


def schedule_actions(name: str, stages: int, microbatches: int) -> dict[str, list[str]]:
    """Per-stage action lists (``"F3"`` = forward of micro-batch 3, ``"B3"`` its backward)
    of the lead's generators (:func:`formulations.schedules.make_schedule`)."""
    rows = make_schedule(name, stages, microbatches).to_strings()
    return {str(i): row for i, row in enumerate(rows)}
