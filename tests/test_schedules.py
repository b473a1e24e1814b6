"""Pipeline schedules as data: string forms, generators, warm-up formulas, lowering, validation."""

from __future__ import annotations

import json

import pytest

from formulations.schedules import (
    SCHEDULE_NAMES,
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    default_weight_lags,
    eager_1f1b,
    gpipe,
    inflight_microbatches,
    lower,
    make_schedule,
    one_f_one_b,
    peak_inflight,
    validate,
    warmup_forwards,
)
from tests.helpers.oracles import strip_comm


def _warmup_of(row) -> int:
    """Forwards before the first backward in a generated row."""
    n = 0
    for a in row:
        if a.kind is ActionKind.B:
            return n
        n += a.kind is ActionKind.F
    return n


# ------------------------------------------------------------------------------ string forms


@pytest.mark.parametrize("kind", list(ActionKind))
def test_action_string_round_trip(kind):
    a = Action(kind, 7, 2)
    assert str(a) == f"{kind.value}7"
    assert Action.parse(str(a), stage=2) == a
    assert a.long == f"2{kind.value}7"
    assert Action.parse(a.long) == a


def test_action_compact_examples():
    assert str(Action(ActionKind.SEND_F, 1, 0)) == "SF1"
    assert Action.parse("W2", 3) == Action(ActionKind.W, 2, 3)
    assert Action.parse("2F0").stage == 2
    assert Action(ActionKind.F, 0, 0) != Action(ActionKind.B, 0, 0)


@pytest.mark.parametrize(
    "text, stage, match",
    [
        ("X3", 0, "cannot parse"),
        ("F", 0, "cannot parse"),
        ("F3", None, "no stage"),
        ("1F3", 2, "names stage 1"),
    ],
)
def test_action_parse_errors(text, stage, match):
    with pytest.raises(ScheduleError, match=match):
        Action.parse(text, stage)


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("split", [False, True])
def test_schedule_round_trips_through_strings_and_json(name, split):
    sched = lower(make_schedule(name, 4, 6, delay_weight_grad=split))
    again = Schedule.from_strings(sched.to_strings(), name=name, num_microbatches=6)
    assert again == sched
    assert Schedule.from_dict(json.loads(json.dumps(sched.to_dict()))) == sched


# ------------------------------------------------------------------------------ warm-up counts


@pytest.mark.parametrize("S", range(1, 9))
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 13, 32])
def test_warmup_counts_match_the_formulas(S, M):
    for s in range(S):
        i = s + 1  # the papers number stages 1..S
        expect = {
            "gpipe": M,
            "1f1b": min(S - i + 1, M),
            "eager-1f1b": min(2 * (S - i) + 1, M),
        }
        for name in SCHEDULE_NAMES:
            sched = make_schedule(name, S, M)
            assert warmup_forwards(name, S, s, M) == expect[name]
            assert _warmup_of(sched.rows[s]) == expect[name], (name, S, M, s)
            # without weight delaying the peak in-flight count is the warm-up count, and the
            # stage DP's position-from-the-end formula gives the same number
            assert peak_inflight(sched)[s] == expect[name]
            assert inflight_microbatches(name, S - s, M) == expect[name]


def test_eager_warms_up_more_than_1f1b():
    assert [_warmup_of(r) for r in one_f_one_b(4, 16).rows] == [4, 3, 2, 1]
    assert [_warmup_of(r) for r in eager_1f1b(4, 16).rows] == [7, 5, 3, 1]
    assert [_warmup_of(r) for r in gpipe(4, 16).rows] == [16] * 4


# ------------------------------------------------------------------------------ generators valid


def test_every_generated_schedule_is_valid():
    """All three schedules, with and without weight delaying, S ≤ 8, M ≤ 32, both as compute
    orders and lowered with send/recv."""
    for S in range(1, 9):
        for M in range(1, 33):
            for name in SCHEDULE_NAMES:
                for split in (False, True):
                    sched = make_schedule(name, S, M, delay_weight_grad=split)
                    validate(sched)
                    validate(lower(sched))
                    if split:  # delayed W's keep at most lag + 1 extra activations
                        lags = default_weight_lags(S, M)
                        for s, peak in enumerate(peak_inflight(sched)):
                            assert peak <= min(warmup_forwards(name, S, s, M) + lags[s] + 1, M)


def test_lowering_is_a_pure_invertible_pass():
    sched = eager_1f1b(3, 5, delay_weight_grad=True)
    low = lower(sched)
    assert lower(low) is low
    assert strip_comm(low) == sched
    assert low.rows[1][:3] == tuple(Action.parse(t, 1) for t in ("RF0", "F0", "SF0"))
    # first stage receives no activation, last stage sends none
    assert not any(a.kind in (ActionKind.RECV_F, ActionKind.SEND_B) for a in low.rows[0])
    assert not any(a.kind in (ActionKind.SEND_F, ActionKind.RECV_B) for a in low.rows[-1])


def test_weight_delay_splits_backward_and_keeps_at_most_lag_pending():
    S, M = 4, 8
    sched = one_f_one_b(S, M, delay_weight_grad=True)
    assert sched.split_backward
    lags = default_weight_lags(S, M)
    assert lags == (0, 1, 2, 3)
    for s, row in enumerate(sched.rows):
        assert sum(a.kind is ActionKind.W for a in row) == M
        pending = 0
        for a in row:
            pending += (a.kind is ActionKind.B) - (a.kind is ActionKind.W)
            if a.kind is ActionKind.F and pending:
                assert pending <= lags[s] + 1
        # the last stage defers its lag W's to the very end (filling the drain bubble)
    assert [str(a) for a in sched.rows[3][-3:]] == ["W5", "W6", "W7"]
    custom = one_f_one_b(S, M, delay_weight_grad=(0, 0, 0, 0))
    validate(lower(custom))
    with pytest.raises(ScheduleError, match="one non-negative lag per stage"):
        one_f_one_b(S, M, delay_weight_grad=(1, 2))


def test_out_of_order_microbatches_are_valid_without_fifo():
    # stage 1 handles micro-batch 1 first: legal for tagged messages, not for FIFO links
    sched = Schedule.from_strings(["F0 F1 B0 B1", "F1 B1 F0 B0"])
    validate(sched)
    validate(lower(sched), fifo_channels=False)
    with pytest.raises(ScheduleError, match="matched in order") as err:
        validate(lower(sched))
    assert err.value.stage == 1 and err.value.position == 0


def test_generator_rejects_empty_pipelines():
    with pytest.raises(ScheduleError, match="at least one stage"):
        gpipe(0, 4)
    with pytest.raises(ScheduleError, match="unknown pipeline schedule"):
        make_schedule("interleaved", 2, 2)


# ------------------------------------------------------------------------------ broken schedules

BROKEN = [
    # (id, rows, micro-batches, split, message part, stage, position, action)
    ("missing", ["F0 F1 B0 B1", "F0 B0 B1"], 2, False, "F1 is missing", 1, None, "F1"),
    ("duplicate", ["F0 F1 B0 B1", "F0 F1 B1 B1"], 2, False, "duplicate", 1, 3, "B1"),
    (
        "backward-before-forward",
        ["F0 F1 B0 B1", "F0 B1 F1 B0"],
        2,
        False,
        "backward before its forward",
        1,
        1,
        "B1",
    ),
    ("weight-before-backward", ["F0 B0 W0", "F0 W0 B0"], 1, True, "weight gradient before", 1, 1, "W0"),
    ("W-without-split", ["F0 B0 W0", "F0 B0"], 1, False, "W without split_backward", 0, 2, "W0"),
    ("microbatch-range", ["F0 B0 F5", "F0 B0"], 1, False, "out of range", 0, 2, "F5"),
    (
        "recv-after-forward",
        ["F0 SF0 RB0 B0", "F0 RF0 B0 SB0"],
        1,
        False,
        "forward before the receive",
        1,
        0,
        "F0",
    ),
    (
        "send-on-last-stage",
        ["F0 SF0 RB0 B0", "RF0 F0 SF0 B0 SB0"],
        1,
        False,
        "no neighbouring stage",
        1,
        2,
        "SF0",
    ),
    ("deadlock", ["F0 B0 F1 B1", "F1 F0 B0 B1"], 2, False, "deadlock", 0, 1, "B0"),
    ("deadlock-3-stages", ["F0 F1 B0 B1", "F0 B0 F1 B1", "F1 B1 F0 B0"], 2, False, "deadlock", 0, 2, "B0"),
]


@pytest.mark.parametrize("case", BROKEN, ids=[c[0] for c in BROKEN])
def test_validator_rejects_broken_schedules(case):
    _, rows, M, split, match, stage, position, action = case
    sched = Schedule.from_strings(rows, num_microbatches=M, split_backward=split)
    with pytest.raises(ScheduleError, match=match) as err:
        validate(sched)
    e = err.value
    assert (e.stage, e.position, str(e.action)) == (stage, position, action)
    lines = str(e).splitlines()
    row_line = next(ln for ln in lines if ln.startswith(f"stage {stage} |"))
    if position is not None:  # the failing cell is marked in the printed grid
        assert f"[{action}]" in row_line


def test_deadlock_message_names_every_blocked_stage():
    sched = Schedule.from_strings(["F0 B0 F1 B1", "F1 F0 B0 B1"])
    with pytest.raises(ScheduleError) as err:
        validate(sched)
    msg = str(err.value)
    assert "stage 0, position 1 (B0) waits for B0 on stage 1" in msg
    assert "stage 1, position 0 (F1) waits for F1 on stage 0" in msg
    # the same order lowered deadlocks through the send/recv pairs too
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(lower(sched), fifo_channels=False)


def test_grid_marks_the_failing_cell():
    sched = Schedule.from_strings(["F0 F1 B0 B1", "F0 F1 B1 B1"])
    with pytest.raises(ScheduleError) as err:
        validate(sched)
    lines = str(err.value).splitlines()
    assert lines[-1].startswith("stage 1 |") and "[B1][B1]" in lines[-1].replace(" ", "")
    assert "[" not in lines[-2]
