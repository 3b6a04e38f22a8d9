"""Desk telemetry accounting: goodput plus every badput category is 100 % of a run's wall time,
on a hand-built timeline with known answers and on arbitrary generated ones."""

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.runs import (
    CheckpointSaved,
    EvalResult,
    Interruption,
    Metrics,
    RunCreated,
    StageStarted,
    StateChanged,
)
from contracts.states import RunState
from contracts.telemetry import BADPUT
from domain.accounting import account, rollup

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
CREATED = RunCreated(
    run_id="r",
    seq=0,
    at=T0,
    account="a",
    booking_id="b",
    region="eu",
    gpu_model="H200",
    gpus=8,
    accepted_at=T0,
)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def state(s, st_, seq):
    return StateChanged(run_id="r", seq=seq, at=at(s), state=st_)


def step(s, n, seq, data_wait=0.0):
    return Metrics(
        run_id="r",
        seq=seq,
        at=at(s),
        stage="pretrain",
        step=n,
        total_steps=4,
        loss=1.0,
        learning_rate=1e-3,
        tokens_per_s=1.0,
        grad_norm=1.0,
        data_wait_s=data_wait,
    )


def test_a_hand_built_timeline_with_one_interruption():
    events = [
        state(2, RunState.running, 1),  # queued 2 s
        StageStarted(run_id="r", seq=2, at=at(3), stage="pretrain", total_steps=4),  # startup 1 s
        step(5, 1, 3),  # startup 2 s (first step of the attempt)
        step(6, 2, 4, data_wait=0.25),  # 0.75 s step 2, 0.25 s data
        CheckpointSaved(run_id="r", seq=5, at=at(6.5), step=2, path="p", bytes=100, stall_s=0.5, save_s=0.5),
        step(8, 3, 6),  # 2 s: 0.5 s stall + 1.5 s step 3 (redone: lost)
        Interruption(run_id="r", seq=7, at=at(14), cause="trainer_lost", silent_s=6.0),  # recovery 6 s
        state(20, RunState.running, 8),  # recovery 6 s
        step(23, 3, 9),  # restore 3 s (resumed at step 3)
        step(24, 4, 10),  # 1 s step 4
        EvalResult(run_id="r", seq=11, at=at(25), stage="pretrain", metrics=[], passed=True),  # eval 1 s
        state(26, RunState.succeeded, 12),  # other 1 s
    ]
    t = account(CREATED, events, at(26), "succeeded")
    assert t.wall_s == 26.0
    assert t.badput_s["queued"] == 2.0
    assert t.badput_s["startup"] == 3.0
    assert t.badput_s["data_loading"] == 0.25
    assert t.badput_s["checkpoint_stall"] == 0.5
    assert t.badput_s["recovery"] == 12.0
    assert t.badput_s["checkpoint_restore"] == 3.0
    assert t.badput_s["eval"] == 1.0 and t.badput_s["other"] == 1.0
    assert t.badput_s["lost_to_interruptions"] == 1.5  # step 3 ran again after the resume
    assert t.goodput_s == pytest.approx(0.75 + 1.0)
    assert t.interruptions == 1 and t.interruption_causes == {"trainer_lost": 1}
    assert t.goodput_s + sum(t.badput_s.values()) == pytest.approx(t.wall_s)
    assert t.checkpoint_bytes_per_s_p50 == 200.0 and t.gpu_hours == pytest.approx(26 * 8 / 3600)


def test_a_step_redone_after_an_interruption_is_lost_work():
    events = [
        state(0, RunState.running, 1),
        step(1, 1, 2),
        step(2, 2, 3),
        step(3, 3, 4),
        Interruption(run_id="r", seq=5, at=at(9), cause="trainer_lost", silent_s=6.0),
        state(10, RunState.running, 6),
        step(11, 2, 7),
        step(12, 3, 8),
        step(13, 4, 9),
        state(14, RunState.succeeded, 10),
    ]
    t = account(CREATED, events, at(14), "succeeded")
    # steps 2 and 3 ran twice: their first runs are lost; the resume's first step is restore time
    assert t.badput_s["lost_to_interruptions"] == 2.0
    assert t.badput_s["checkpoint_restore"] == 1.0
    assert t.goodput_s == 2.0  # steps 3 and 4 of the second attempt
    assert t.goodput_s + sum(t.badput_s.values()) == pytest.approx(14.0)


KINDS = st.sampled_from(["running", "stage", "step", "checkpoint", "eval", "interruption", "log"])


def one_event(kind, base, n, x):
    """One event of the given kind, built only when chosen."""
    makers = {
        "running": lambda: StateChanged(**base, state=RunState.running),
        "stage": lambda: StageStarted(**base, stage="pretrain", total_steps=6),
        "step": lambda: Metrics(
            **base,
            stage="pretrain",
            step=n,
            total_steps=6,
            loss=1.0,
            learning_rate=1.0,
            tokens_per_s=1.0,
            grad_norm=1.0,
            data_wait_s=x,
        ),
        "checkpoint": lambda: CheckpointSaved(**base, step=n, path="p", bytes=10, stall_s=x, save_s=x),
        "eval": lambda: EvalResult(**base, stage="pretrain", metrics=[], passed=True),
        "interruption": lambda: Interruption(**base, cause="trainer_lost", silent_s=x),
        "log": lambda: StateChanged(**base, state=RunState.queued),
    }
    return makers[kind]()


@settings(max_examples=200, deadline=None, database=None)
@given(
    st.lists(st.tuples(KINDS, st.floats(0, 30), st.integers(1, 6), st.floats(0, 3)), max_size=40),
    st.floats(0, 100),
)
def test_goodput_and_badput_always_add_up_to_the_wall_time(spec, tail):
    events, t = [], 0.0
    for i, (kind, gap, n, x) in enumerate(spec):
        t += gap
        base = {"run_id": "r", "seq": i + 1, "at": at(t)}
        events.append(one_event(kind, base, n, x))
    end = at(t + tail)
    r = account(CREATED, events, end, "succeeded")
    assert set(r.badput_s) == set(BADPUT)
    assert all(v >= 0 for v in r.badput_s.values()) and r.goodput_s >= 0
    assert r.goodput_s + sum(r.badput_s.values()) == pytest.approx(r.wall_s, abs=1e-6)
    assert r.interruptions == sum(1 for k, *_ in spec if k == "interruption")
    roll = rollup("booking", "b", [r, r], end)
    assert roll.goodput_gpu_hours + sum(roll.badput_gpu_hours.values()) == pytest.approx(roll.wall_gpu_hours)
