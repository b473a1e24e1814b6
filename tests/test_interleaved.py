"""Interleaved 1F1B (virtual stages): generator, lowering with the wrap-around, validation,
in-flight counts, and the simulator against the closed form (Narayanan et al. SC'21 §2.2.2)."""

from __future__ import annotations

import json

import pytest

from formulations.schedules import (
    INTERLEAVED,
    ActionKind,
    Schedule,
    ScheduleError,
    inflight_interleaved,
    lower,
    make_schedule,
    peak_inflight,
    validate,
    warmup_forwards,
)
from formulations.simulator import StageDurations, simulate, simulate_named

GRID = [(p, v, m) for p in (1, 2, 3, 4) for v in (1, 2, 3) for m in (p, 2 * p, 3 * p)]


def test_rows_by_hand_two_stages_two_chunks():
    """p = 2, v = 2, M = 4 worked by hand from Megatron's rule: stage 0 warms up with
    2(p − 1) + (v − 1)p = 4 chunk forwards (chunk 0 for micro-batches 0, 1, then chunk 2 for
    0, 1), stage 1 with 2; then one forward, one backward; backwards from the last chunk."""
    sched = make_schedule(INTERLEAVED, 2, 4, virtual_stages=2)
    assert sched.num_chunks == 4 and sched.chunks_of(1) == (1, 3)
    assert [" ".join(r) for r in sched.to_strings()] == [
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3",
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3",
    ]


def test_lowering_sends_across_the_wrap_around():
    """Chunk 1 (last stage) sends to chunk 2 on stage 0; chunk 2's gradient goes back."""
    low = lower(make_schedule(INTERLEAVED, 2, 2, virtual_stages=2)).to_strings()
    assert "1SF0" in low[1] and "2RF0" in low[0]
    assert "2SB0" in low[0] and "1RB0" in low[1]
    assert "0RF0" not in low[0] and "3SF0" not in low[1]  # the ends of the model
    assert low[0][:3] == ["0F0", "0SF0", "0F1"]


@pytest.mark.parametrize("p, v, m", GRID)
def test_generated_schedules_validate(p, v, m):
    sched = make_schedule(INTERLEAVED, p, m, virtual_stages=v)
    validate(sched)
    validate(lower(sched))  # FIFO per chunk link, deadlock-free with the transfers
    for s, row in enumerate(sched.rows):
        for j in sched.chunks_of(s):  # each chunk runs its micro-batches in order
            assert [a.microbatch for a in row if a.stage == j and a.kind is ActionKind.F] == list(range(m))


@pytest.mark.parametrize("p, v, m", GRID)
def test_peak_inflight_is_the_formula(p, v, m):
    sched = make_schedule(INTERLEAVED, p, m, virtual_stages=v)
    assert peak_inflight(sched) == tuple(inflight_interleaved(p, s, m, v) for s in range(p))


def test_inflight_grows_with_interleaving():
    """Stage 0 of 4, v = 2, M = 8: 2·3 + 4 + 1 = 11 half-stage activations (5.5 stages'
    worth) where 1F1B holds 4."""
    assert inflight_interleaved(4, 0, 8, 2) == 11
    assert peak_inflight(make_schedule("1f1b", 4, 8))[0] == 4


def test_round_trips_through_strings_and_json():
    sched = lower(make_schedule(INTERLEAVED, 3, 6, virtual_stages=2))
    again = Schedule.from_strings(sched.to_strings(), num_microbatches=6, name=INTERLEAVED,
                                  virtual_stages=2)
    assert again == sched
    assert Schedule.from_dict(json.loads(json.dumps(sched.to_dict()))) == sched


def _broken(rows: list[str], m: int = 2) -> Schedule:
    return Schedule.from_strings(rows, num_microbatches=m, name=INTERLEAVED, virtual_stages=2)


def test_validate_rejects_deadlock():
    """Stage 0 runs chunk 2's forward before chunk 0's: chunk 2 waits for chunk 1, which
    waits for chunk 0 on stage 0 — a cycle."""
    rows = [" ".join(r) for r in make_schedule(INTERLEAVED, 2, 2, virtual_stages=2).to_strings()]
    rows[0] = rows[0].replace("0F0 0F1 2F0", "2F0 0F0 0F1")
    with pytest.raises(ScheduleError, match="deadlock") as err:
        validate(_broken(rows))
    assert err.value.stage is not None


def test_validate_rejects_a_missing_or_misplaced_chunk():
    rows = [" ".join(r) for r in make_schedule(INTERLEAVED, 2, 2, virtual_stages=2).to_strings()]
    with pytest.raises(ScheduleError, match="3B1 is missing"):
        validate(_broken([rows[0], rows[1].replace(" 3B1", "")]))
    with pytest.raises(ScheduleError, match="names chunk 1 but sits in the row of stage 0"):
        _broken([rows[0].replace("0F0", "1F0"), rows[1]])


def test_validate_rejects_receives_out_of_order_on_the_wrap_around_link():
    """Stage 0 receives chunk 2's activations for micro-batch 1 before 0 while stage 1
    sends them in order: the link 1→2 matches messages in order."""
    low = [" ".join(r) for r in lower(make_schedule(INTERLEAVED, 2, 2, virtual_stages=2)).to_strings()]
    swapped = low[0].replace("2RF0 2F0 2SF0 2RF1 2F1 2SF1", "2RF1 2F1 2SF1 2RF0 2F0 2SF0")
    assert swapped != low[0]
    sched = _broken([swapped, low[1]])
    validate(sched, fifo_channels=False)
    with pytest.raises(ScheduleError, match="link 1→2"):
        validate(sched)


def test_requirements_are_stated():
    with pytest.raises(ScheduleError, match="must be a multiple of the pipeline stages"):
        make_schedule(INTERLEAVED, 4, 6, virtual_stages=2)
    with pytest.raises(ScheduleError, match="needs the number of virtual stages"):
        warmup_forwards(INTERLEAVED, 4, 0, 8)
    with pytest.raises(ScheduleError, match="needs 'interleaved-1f1b'"):
        make_schedule("1f1b", 2, 4, virtual_stages=2)


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (3, 3, 9), (8, 2, 16)])
@pytest.mark.parametrize("f, b", [(1.0, 2.0), (0.5, 0.5)])
def test_bubble_is_the_closed_form(p, v, m, f, b):
    """Equal chunks of f/v and b/v, no communication: the step is (M + (p − 1)/v)(f + b),
    a bubble of (p − 1)/(v·M) of the ideal M(f + b) — v times smaller than 1F1B's."""
    res = simulate_named(INTERLEAVED, p, m, f / v, b / v, virtual_stages=v)
    ideal = m * (f + b)
    assert res.makespan_s == pytest.approx((m + (p - 1) / v) * (f + b))
    assert (res.makespan_s - ideal) / ideal == pytest.approx((p - 1) / (v * m))
    assert res.bubble_fraction == pytest.approx(1 - ideal / res.makespan_s)
    plain = simulate_named("1f1b", p, m, f, b)
    assert (plain.makespan_s - ideal) / ideal == pytest.approx((p - 1) / m)


def test_wrap_around_transfer_is_charged():
    """p = 2, v = 2, M = 2, chunks of 1 s forward and 1 s backward: without communication
    (2 + 1/2)·4 = 10 s. A 5 s transfer on the wrap-around boundary alone (chunk 1 on stage 1
    → chunk 2 on stage 0): chunk 1's forwards end at 2 s and 3 s, its sends share stage 1's
    communication stream, [2, 7] and [7, 12], so chunk 2's forwards start at 7 s and 12 s."""
    base = simulate_named(INTERLEAVED, 2, 2, 1.0, 1.0, virtual_stages=2)
    assert base.makespan_s == pytest.approx(10.0)
    slow = simulate(make_schedule(INTERLEAVED, 2, 2, virtual_stages=2),
                    StageDurations.make(4, 1.0, 1.0, activation_transfer=[0, 5, 0],
                                        gradient_transfer=[0, 0, 0]))
    starts = {(e.stage, str(e.action), e.action.stage): e.start for e in slow.timeline}
    assert starts[(0, "F0", 2)] == pytest.approx(7.0)
    assert starts[(0, "F1", 2)] == pytest.approx(12.0)
    assert slow.makespan_s > base.makespan_s + 4.0


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "eager-1f1b"])
def test_simulate_named_is_simulate(name):
    direct = simulate(make_schedule(name, 3, 6), StageDurations.make(3, [1, 2, 1], [2, 3, 2], 0, 0.1))
    assert simulate_named(name, 3, 6, [1, 2, 1], [2, 3, 2], activation_transfer=0.1).makespan_s \
        == pytest.approx(direct.makespan_s)
