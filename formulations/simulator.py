"""Dry-run simulation of a pipeline schedule with the cost model's durations.

Model (what the timeline means)
-------------------------------
* Every stage ``s`` has one *compute* stream and one *comm* stream. Actions run in the
  stage's program order (the schedule row, lowered with :func:`schedules.lower` if needed).
* Interleaved schedules: the durations are per chunk (``S·v`` entries, transfers per
  boundary between consecutive chunks); stage ``s``'s streams run its chunks'
  actions, so ``forward[j]`` below reads as chunk ``j``'s.
* ``F``/``B``/``W`` occupy the compute stream for ``forward[s]``, ``backward[s]`` and
  ``weight[s]`` seconds. Without split backward (no W in the schedule) a B costs
  ``backward[s] + weight[s]``: ``backward`` is the input-gradient part and ``weight`` the
  weight-gradient part of one backward.
* A send across boundary ``k`` (between stages ``k`` and ``k+1``) takes
  ``activation_transfer[k]`` (``SF``, forward direction) or ``gradient_transfer[k]`` (``SB``).
  Buffers are unbounded: a send never waits for its receiver.

  - ``overlap=True``: the send is issued when the compute stream reaches it and runs on the
    sender's comm stream as soon as that stream is free (a stage's sends are serialised in
    program order; sending and receiving are separate resources, so receives never queue).
    The compute stream continues at once.
  - ``overlap=False``: the send occupies the sender's compute stream for its duration (its
    event is recorded on the ``compute`` stream).
* ``RF``/``RB`` make the compute stream wait until the matching transfer has arrived.

Since every stream executes in program order and every cross-stage edge is a send → receive,
start times are the longest paths of a DAG: the result does not depend on the order the
simulator visits the stages in, and a schedule that passes :func:`schedules.validate` always
completes.

Reported figures
----------------
* ``makespan_s`` — end of the last event.
* ``bubble_fraction`` — ``1 − Σ_s busy_s / (S · makespan)`` with ``busy_s`` the F/B/W time of
  stage ``s``: idle compute time, including time a non-overlapped send holds the stream.
* ``peak_inflight`` — per stage, the largest number of micro-batches whose forward has run
  and whose backward (W when split) has not finished (activations held).

For GPipe with equal stages and zero communication the makespan is ``(S + M − 1)(f + b)``
and the bubble fraction ``(S − 1)/(S + M − 1)``. Interleaved 1F1B with ``v`` equal chunks per
stage (each ``f/v``, ``b/v``) takes ``(M + (S − 1)/v)(f + b)``: a bubble of ``(S − 1)/(v·M)``
of the ideal ``M(f + b)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from formulations.schedules import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    lower,
    make_schedule,
    peak_inflight,
    validate,
)

STREAMS = ("compute", "comm")


def _tuple(x: float | Sequence[float], n: int, what: str) -> tuple[float, ...]:
    t = tuple(float(v) for v in x) if isinstance(x, Sequence) else (float(x),) * n
    if len(t) != n:
        raise ScheduleError(f"{what}: expected {n} values, got {len(t)}")
    if any(v < 0 for v in t):
        raise ScheduleError(f"{what}: durations must be non-negative, got {t}")
    return t


@dataclass(frozen=True)
class StageDurations:
    """Seconds per micro-batch. ``forward``/``backward``/``weight`` have one entry per
    stage; ``activation_transfer``/``gradient_transfer`` one per boundary (``S − 1``)."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    weight: tuple[float, ...]
    activation_transfer: tuple[float, ...]
    gradient_transfer: tuple[float, ...]

    def __post_init__(self) -> None:
        S = len(self.forward)
        if S < 1:
            raise ScheduleError("StageDurations needs at least one stage")
        for name, n in (
            ("forward", S),
            ("backward", S),
            ("weight", S),
            ("activation_transfer", S - 1),
            ("gradient_transfer", S - 1),
        ):
            object.__setattr__(self, name, _tuple(getattr(self, name), n, f"StageDurations.{name}"))

    @property
    def num_stages(self) -> int:
        return len(self.forward)

    @classmethod
    def make(
        cls,
        num_stages: int,
        forward: float | Sequence[float],
        backward: float | Sequence[float],
        weight: float | Sequence[float] = 0.0,
        activation_transfer: float | Sequence[float] = 0.0,
        gradient_transfer: float | Sequence[float] | None = None,
    ) -> StageDurations:
        """Scalars are broadcast; ``gradient_transfer`` defaults to ``activation_transfer``
        (the gradient of an activation has its size)."""
        S = num_stages
        if gradient_transfer is None:
            gradient_transfer = activation_transfer
        return cls(
            _tuple(forward, S, "forward"),
            _tuple(backward, S, "backward"),
            _tuple(weight, S, "weight"),
            _tuple(activation_transfer, S - 1, "activation_transfer"),
            _tuple(gradient_transfer, S - 1, "gradient_transfer"),
        )

    def to_dict(self) -> dict:
        return {
            "forward": list(self.forward),
            "backward": list(self.backward),
            "weight": list(self.weight),
            "activation_transfer": list(self.activation_transfer),
            "gradient_transfer": list(self.gradient_transfer),
        }


@dataclass(frozen=True)
class Event:
    """One interval of the timeline."""

    stage: int
    action: Action
    start: float
    end: float
    stream: str

    def to_dict(self) -> dict:
        return {
            "stage": self.stage,
            "action": str(self.action),
            "start": self.start,
            "end": self.end,
            "stream": self.stream,
        }


@dataclass(frozen=True)
class SimResult:
    schedule: str
    num_stages: int
    num_microbatches: int
    overlap: bool
    split_backward: bool
    timeline: tuple[Event, ...]
    makespan_s: float
    bubble_fraction: float
    busy_s: tuple[float, ...]
    peak_inflight: tuple[int, ...]
    virtual_stages: int = 1  # chunks per stage (interleaved 1F1B); busy_s, peak_inflight per stage

    def to_dict(self, *, timeline: bool = True) -> dict:
        d = {
            "schedule": self.schedule,
            "stages": self.num_stages,
            "microbatches": self.num_microbatches,
            "overlap": self.overlap,
            "split_backward": self.split_backward,
            "makespan_s": self.makespan_s,
            "bubble_fraction": self.bubble_fraction,
            "busy_s": list(self.busy_s),
            "peak_inflight": list(self.peak_inflight),
        }
        if self.virtual_stages > 1:
            d["virtual_stages"] = self.virtual_stages
        if timeline:
            d["timeline"] = [e.to_dict() for e in self.timeline]
        return d


def simulate(
    schedule: Schedule,
    durations: StageDurations,
    *,
    overlap: bool = True,
    check: bool = True,
) -> SimResult:
    """Run ``schedule`` (lowered here if it has no send/recv) against ``durations``.

    ``check`` validates the schedule first (a :class:`ScheduleError` names the bad cell)."""
    if durations.num_stages != schedule.num_chunks:
        raise ScheduleError(
            f"durations describe {durations.num_stages} stages but schedule "
            f"{schedule.name!r} has {schedule.num_chunks}"
            + (f" chunks ({schedule.num_stages} stages × {schedule.virtual_stages} virtual)"
               if schedule.virtual_stages > 1 else "")
        )
    sched = lower(schedule)
    if check:
        validate(sched, fifo_channels=False)
    S = sched.num_stages
    replay = _Replay.of(durations, sched.split_backward, overlap, S)
    remaining = sum(len(r) for r in sched.rows)
    while remaining:
        ran = sum(replay.advance(s, sched.rows[s]) for s in range(S))
        if not ran:  # only reachable with check=False on an invalid schedule
            stuck = ", ".join(
                f"stage {s} at {sched.rows[s][replay.ptr[s]]}" for s in range(S)
                if replay.ptr[s] < len(sched.rows[s])
            )
            raise ScheduleError(f"simulation of {sched.name!r} deadlocked: {stuck}")
        remaining -= ran
    events = replay.events
    makespan = max((e.end for e in events), default=0.0)
    bubble = 1.0 - sum(replay.busy) / (S * makespan) if makespan > 0 else 0.0
    events.sort(key=lambda e: (e.stage, e.stream, e.start, e.end))
    return SimResult(
        schedule=sched.name,
        num_stages=S,
        num_microbatches=sched.num_microbatches,
        overlap=overlap,
        split_backward=sched.split_backward,
        timeline=tuple(events),
        makespan_s=makespan,
        bubble_fraction=bubble,
        busy_s=tuple(replay.busy),
        peak_inflight=peak_inflight(sched),
        virtual_stages=sched.virtual_stages,
    )


def simulate_named(
    name: str,
    num_stages: int,
    num_microbatches: int,
    forward: float | Sequence[float],
    backward: float | Sequence[float],
    *,
    virtual_stages: int = 1,
    activation_transfer: float | Sequence[float] = 0.0,
    gradient_transfer: float | Sequence[float] | None = None,
    overlap: bool = True,
) -> SimResult:
    """Price the schedule ``name`` (``gpipe``, ``1f1b``, ``eager-1f1b``,
    ``interleaved-1f1b``) from seconds per micro-batch: ``forward``/``backward`` per chunk
    (``num_stages · virtual_stages`` values, chunk ``j`` on stage ``j mod num_stages``; a
    scalar is every chunk's), transfers per boundary between consecutive chunks (``C − 1``
    values or a scalar). What a caller pricing a given configuration (``--compare``'s
    Megatron ``pp``/``vpp``) needs without building a :class:`Schedule`."""
    sched = make_schedule(name, num_stages, num_microbatches, virtual_stages=virtual_stages)
    C = sched.num_chunks
    durations = StageDurations.make(C, forward, backward, 0.0, activation_transfer, gradient_transfer)
    return simulate(sched, durations, overlap=overlap)


# destination stage and matching receive of each send kind
_DEST = {ActionKind.SEND_F: (1, ActionKind.RECV_F), ActionKind.SEND_B: (-1, ActionKind.RECV_B)}


@dataclass
class _Replay:
    """:func:`simulate`'s clock: what each action lasts (``dur`` per compute kind, ``xfer``
    per send kind and boundary), per stage its next action (``ptr``), when its compute and
    communication streams are free and its busy compute time; each receive's arrival time
    by (stage, kind, micro-batch); and the events so far."""

    dur: dict[ActionKind, tuple[float, ...]]
    xfer: dict[ActionKind, tuple[float, ...]]
    overlap: bool
    ptr: list[int]
    compute_free: list[float]
    comm_free: list[float]
    busy: list[float]
    arrival: dict[tuple[int, ActionKind, int], float]
    events: list[Event]

    @classmethod
    def of(cls, durations: StageDurations, split: bool, overlap: bool, S: int) -> _Replay:
        """The clock of ``S`` stages (rows) running ``durations``' chunks."""
        dur = {
            ActionKind.F: durations.forward,
            ActionKind.B: durations.backward
            if split
            else tuple(b + w for b, w in zip(durations.backward, durations.weight, strict=True)),
            ActionKind.W: durations.weight,
        }
        xfer = {ActionKind.SEND_F: durations.activation_transfer,
                ActionKind.SEND_B: durations.gradient_transfer}
        return cls(dur, xfer, overlap, [0] * S, [0.0] * S, [0.0] * S, [0.0] * S, {}, [])

    def advance(self, s: int, row: Sequence[Action]) -> int:
        """Run stage ``s``'s actions until one waits for a receive not yet sent; how many
        ran."""
        ran = 0
        while self.ptr[s] < len(row) and self._run(s, row[self.ptr[s]]):
            self.ptr[s] += 1
            ran += 1
        return ran

    def _run(self, s: int, a: Action) -> bool:
        """Action ``a`` of stage ``s`` timed and recorded; False for a receive whose send
        has not run yet."""
        k, j = a.kind, a.stage  # j: the chunk (the stage itself without virtual stages)
        if k is ActionKind.RECV_F or k is ActionKind.RECV_B:
            t = self.arrival.get((j, k, a.microbatch))
            if t is None:
                return False
            self.compute_free[s] = max(self.compute_free[s], t)
        elif k is ActionKind.SEND_F or k is ActionKind.SEND_B:
            step, recv = _DEST[k]
            d = self.xfer[k][j if step == 1 else j - 1]
            if self.overlap:
                start = max(self.compute_free[s], self.comm_free[s])
                self.comm_free[s] = start + d
                stream = "comm"
            else:
                start = self.compute_free[s]
                self.compute_free[s] = start + d
                stream = "compute"
            self.events.append(Event(s, a, start, start + d, stream))
            self.arrival[(j + step, recv, a.microbatch)] = start + d
        else:
            d = self.dur[k][j]
            start = self.compute_free[s]
            self.compute_free[s] = start + d
            self.busy[s] += d
            self.events.append(Event(s, a, start, start + d, "compute"))
        return True


_COLOURS = {
    "F": "#4C72B0",
    "B": "#55A868",
    "W": "#DD8452",
    "SF": "#9DB9E0",
    "SB": "#A8D5B0",
}


def plot_formats() -> list[str]:
    """The file extensions :func:`plot_timeline` writes (matplotlib's, sorted)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    return sorted(Figure().canvas.get_supported_filetypes())


def can_plot(path: str) -> bool:
    """Whether :func:`plot_timeline` can write ``path`` (its extension is one it writes)."""
    name = path.replace("\\", "/").rsplit("/", 1)[-1]
    return "." in name and name.rsplit(".", 1)[-1].lower() in plot_formats()


def plot_timeline(
    timeline: SimResult | Sequence[Event],
    path: str,
    *,
    num_stages: int | None = None,
    title: str | None = None,
) -> str:
    """Gantt chart as PNG: per stage one row for compute and one for comm (top = stage 0).
    Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if isinstance(timeline, SimResult):
        if title is None:
            title = (
                f"{timeline.schedule}{' (B/W split)' if timeline.split_backward else ''}: "
                f"S={timeline.num_stages}, M={timeline.num_microbatches}, "
                f"overlap={timeline.overlap}, makespan={timeline.makespan_s:.4g} s, "
                f"bubble={timeline.bubble_fraction:.1%}"
            )
        num_stages = num_stages or timeline.num_stages
        events: Sequence[Event] = timeline.timeline
    else:
        events = timeline
    S = num_stages or (1 + max((e.stage for e in events), default=0))
    makespan = max((e.end for e in events), default=1.0) or 1.0
    fig, ax = plt.subplots(figsize=(min(24, 6 + len(events) / 12), 1.0 + 0.8 * S))
    for e in events:
        if e.end <= e.start:
            continue
        row = 2 * e.stage + (1 if e.stream == "comm" else 0)
        colour = _COLOURS[e.action.kind.value]
        ax.broken_barh(
            [(e.start, e.end - e.start)],
            (row - 0.4, 0.8),
            facecolors=colour,
            edgecolors="black",
            linewidth=0.3,
        )
        if (e.end - e.start) / makespan > 0.012:
            ax.text(
                (e.start + e.end) / 2, row, str(e.action.microbatch), ha="center", va="center", fontsize=6
            )
    ax.set_yticks(range(2 * S))
    ax.set_yticklabels([f"stage {s} {st}" for s in range(S) for st in STREAMS])
    ax.invert_yaxis()
    ax.set_xlim(0, makespan)
    ax.set_xlabel("time (s)")
    if title:
        ax.set_title(title, fontsize=9)
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in _COLOURS.items()],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.25 if S < 3 else -0.12),
        fontsize=7,
        ncol=5,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
