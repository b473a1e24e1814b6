"""Schedule simulator: closed forms, overlap behaviour, timeline consistency, plotting."""

from __future__ import annotations

import json
import math

import pytest

from formulations.schedules import (
    SCHEDULE_NAMES,
    ActionKind,
    Schedule,
    ScheduleError,
    eager_1f1b,
    gpipe,
    lower,
    make_schedule,
    one_f_one_b,
    peak_inflight,
)
from formulations.simulator import StageDurations, plot_timeline, simulate


@pytest.mark.parametrize("S", [1, 2, 3, 5])
@pytest.mark.parametrize("M", [1, 2, 4, 7])
@pytest.mark.parametrize("f, b", [(1.0, 2.0), (0.5, 0.5)])
def test_gpipe_closed_form(S, M, f, b):
    """Equal stages, no communication: (S + M − 1)(f + b), bubble (S − 1)/(S + M − 1)."""
    r = simulate(gpipe(S, M), StageDurations.make(S, f, b))
    assert r.makespan_s == pytest.approx((S + M - 1) * (f + b))
    assert r.bubble_fraction == pytest.approx((S - 1) / (S + M - 1))


@pytest.mark.parametrize("S", range(1, 7))
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 12])
def test_zero_comm_1f1b_equals_eager(S, M):
    """Zhuang et al. §4: without communication cost the two schedules have the same latency
    (equal stages), and 1F1B matches GPipe's (S + M − 1)(f + b)."""
    for f, b in [(1.0, 2.0), (1.0, 1.0), (0.7, 1.9)]:
        d = StageDurations.make(S, f, b)
        one = simulate(one_f_one_b(S, M), d).makespan_s
        eager = simulate(eager_1f1b(S, M), d).makespan_s
        assert one == pytest.approx(eager)
        assert one == pytest.approx((S + M - 1) * (f + b))


@pytest.mark.parametrize(
    "S, M, f, b, c",
    [
        (4, 8, 1.0, 2.0, 0.3),
        (4, 8, 1.0, 2.0, 1.0),
        (4, 16, 1.0, 2.0, 0.5),
        (8, 32, 1.0, 2.0, 0.2),
        (3, 6, 1.0, 1.0, 0.8),
        (6, 12, 1.0, 3.0, 2.0),
    ],
)
def test_eager_hides_communication_with_overlap(S, M, f, b, c):
    d = StageDurations.make(S, f, b, activation_transfer=c)
    one = simulate(one_f_one_b(S, M), d, overlap=True).makespan_s
    eager = simulate(eager_1f1b(S, M), d, overlap=True).makespan_s
    assert eager <= one + 1e-9
    # and overlapping never hurts either schedule here
    assert one <= simulate(one_f_one_b(S, M), d, overlap=False).makespan_s + 1e-9
    assert eager <= simulate(eager_1f1b(S, M), d, overlap=False).makespan_s + 1e-9


def test_eager_example_values():
    """S = 4, M = 8, f = 1, b = 2, transfer 0.3 both ways: 1F1B pays the transfers on its
    critical path (37.8 s); eager-1F1B hides all but the first/last chain (34.8 s)."""
    d = StageDurations.make(4, 1.0, 2.0, activation_transfer=0.3)
    assert simulate(one_f_one_b(4, 8), d).makespan_s == pytest.approx(37.8)
    assert simulate(eager_1f1b(4, 8), d).makespan_s == pytest.approx(34.8)
    # the unhidable part: one forward and one backward transfer per boundary
    assert 34.8 == pytest.approx((4 + 8 - 1) * 3.0 + 2 * 3 * 0.3)


def test_counterexample_eager_slower_with_unequal_stages():
    """Documented counterexample to "eager ≤ 1F1B with overlap": the claim holds for equal
    stages, not in general. S = 3, M = 3, forward (1, 2, 1), backward (4, 3, 1), transfers
    0.1. Stage 1 (middle) runs F2 before B0 under eager-1F1B (3 warm-up forwards instead of
    2), which delays the gradient to stage 0, whose slow backwards (3 × 4 s) form the tail.
    Hand computation without communication: 1F1B 21 s, eager 22 s."""
    fw, bw = (1.0, 2.0, 1.0), (4.0, 3.0, 1.0)
    d0 = StageDurations.make(3, fw, bw)
    assert simulate(one_f_one_b(3, 3), d0).makespan_s == pytest.approx(21.0)
    assert simulate(eager_1f1b(3, 3), d0).makespan_s == pytest.approx(22.0)
    d = StageDurations.make(3, fw, bw, activation_transfer=0.1)
    one = simulate(one_f_one_b(3, 3), d, overlap=True).makespan_s
    eager = simulate(eager_1f1b(3, 3), d, overlap=True).makespan_s
    assert (one, eager) == (pytest.approx(21.4), pytest.approx(22.2))
    assert eager > one


@pytest.mark.parametrize("S, M", [(2, 2), (4, 4), (4, 8), (4, 16), (6, 12), (8, 9)])
@pytest.mark.parametrize("f, b, w", [(1.0, 1.0, 1.0), (2.0, 1.0, 1.0), (1.0, 2.0, 1.0), (2.0, 2.0, 1.0)])
def test_weight_delay_matches_zero_bubble_h1(S, M, f, b, w):
    """1F1B with split backward and delayed W reaches the ZB-H1 makespan (Qi et al., 2023)
    ``M(f + b + w) + (S − 1)(f + b − w)`` for M ≥ S and w ≤ min(f, b); plain 1F1B pays
    ``(S − 1)(f + b + w)`` of bubble."""
    d = StageDurations.make(S, f, b, weight=w)
    split = simulate(one_f_one_b(S, M, delay_weight_grad=True), d).makespan_s
    plain = simulate(one_f_one_b(S, M), d).makespan_s
    assert plain == pytest.approx(M * (f + b + w) + (S - 1) * (f + b + w))
    assert split == pytest.approx(M * (f + b + w) + (S - 1) * (f + b - w))


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("overlap", [False, True])
def test_timeline_is_consistent(name, split, overlap):
    S, M = 4, 6
    d = StageDurations.make(
        S,
        [1.0, 1.5, 0.5, 1.0],
        [2.0, 2.5, 1.0, 1.5],
        weight=0.5,
        activation_transfer=[0.2, 0.4, 0.1],
        gradient_transfer=[0.3, 0.2, 0.6],
    )
    sched = make_schedule(name, S, M, delay_weight_grad=split)
    r = simulate(sched, d, overlap=overlap)
    ev = {(e.stage, str(e.action)): e for e in r.timeline}
    low = lower(sched)
    assert len(r.timeline) == sum(len(row) for row in low.rows) - sum(
        a.kind in (ActionKind.RECV_F, ActionKind.RECV_B) for row in low.rows for a in row
    )
    # each (stage, stream) is a sequence of non-overlapping intervals in program order
    for s in range(S):
        for stream in ("compute", "comm"):
            xs = sorted((e for e in r.timeline if e.stage == s and e.stream == stream), key=lambda e: e.start)
            for a, b in zip(xs, xs[1:], strict=False):
                assert b.start >= a.end - 1e-12
    # dependencies: F(m, s) after the activation arrived, B(m, s) after the gradient arrived
    for s in range(S):
        for m in range(M):
            if s > 0:
                assert ev[(s, f"F{m}")].start >= ev[(s - 1, f"SF{m}")].end - 1e-12
            if s < S - 1:
                assert ev[(s, f"B{m}")].start >= ev[(s + 1, f"SB{m}")].end - 1e-12
            assert ev[(s, f"B{m}")].start >= ev[(s, f"F{m}")].end - 1e-12
            if split:
                assert ev[(s, f"W{m}")].start >= ev[(s, f"B{m}")].end - 1e-12
    busy = [
        sum(e.end - e.start for e in r.timeline if e.stage == s and e.action.kind.is_compute)
        for s in range(S)
    ]
    assert r.busy_s == pytest.approx(tuple(busy))
    assert r.bubble_fraction == pytest.approx(1 - sum(busy) / (S * r.makespan_s))
    assert r.makespan_s == pytest.approx(max(e.end for e in r.timeline))
    assert r.peak_inflight == peak_inflight(sched)
    sends = [e for e in r.timeline if e.action.kind.is_comm]
    assert all(e.stream == ("comm" if overlap else "compute") for e in sends)
    json.dumps(r.to_dict())


def test_no_overlap_send_occupies_the_stage():
    """Two stages, one micro-batch: F0 (1) → send (0.5, on the compute stream) → F0 (1) →
    B0 (2) → gradient (0.5) → B0 (2): everything is serial, 7 s either way; with two
    micro-batches the second forward on stage 0 waits for the first send without overlap."""
    d = StageDurations.make(2, 1.0, 2.0, activation_transfer=0.5)
    assert simulate(gpipe(2, 1), d, overlap=False).makespan_s == pytest.approx(7.0)
    assert simulate(gpipe(2, 1), d, overlap=True).makespan_s == pytest.approx(7.0)
    r = simulate(gpipe(2, 2), d, overlap=False)
    f1 = next(e for e in r.timeline if e.stage == 0 and str(e.action) == "F1")
    assert f1.start == pytest.approx(1.5)
    r = simulate(gpipe(2, 2), d, overlap=True)
    f1 = next(e for e in r.timeline if e.stage == 0 and str(e.action) == "F1")
    assert f1.start == pytest.approx(1.0)


def test_peak_inflight_follows_the_schedule():
    d = StageDurations.make(4, 1.0, 2.0, activation_transfer=0.1)
    assert simulate(one_f_one_b(4, 8), d).peak_inflight == (4, 3, 2, 1)
    assert simulate(eager_1f1b(4, 8), d).peak_inflight == (7, 5, 3, 1)
    assert simulate(gpipe(4, 8), d).peak_inflight == (8, 8, 8, 8)


def test_simulate_rejects_bad_inputs():
    with pytest.raises(ScheduleError, match="describe 3 stages"):
        simulate(gpipe(2, 2), StageDurations.make(3, 1.0, 1.0))
    with pytest.raises(ScheduleError, match="expected 2 values"):
        StageDurations.make(3, 1.0, 1.0, activation_transfer=[0.1])
    with pytest.raises(ScheduleError, match="non-negative"):
        StageDurations.make(2, -1.0, 1.0)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(Schedule.from_strings(["F0 B0 F1 B1", "F1 F0 B0 B1"]), StageDurations.make(2, 1.0, 1.0))


def test_plot_timeline_writes_png(tmp_path):
    d = StageDurations.make(3, 1.0, 2.0, weight=0.5, activation_transfer=0.3)
    r = simulate(eager_1f1b(3, 5, delay_weight_grad=True), d)
    path = plot_timeline(r, str(tmp_path / "t.png"))
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert math.isfinite(r.makespan_s)
