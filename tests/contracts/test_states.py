"""The run state table (contracts/states.py) and its one enforcer (services/scheduler/lifecycle.py)."""

import itertools
from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from contracts.api import RunView
from contracts.runs import CheckpointSaved, LogLine, Metrics, StateChanged
from contracts.states import ALLOWED_TRANSITIONS, TERMINAL_STATES, RunState
from services.scheduler.lifecycle import IllegalTransition, apply_event, transition

T0 = datetime(2025, 1, 1, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)

ALL_PAIRS = list(itertools.product(RunState, RunState))
ALLOWED = [(a, b) for a, b in ALL_PAIRS if b in ALLOWED_TRANSITIONS[a]]
DISALLOWED = [(a, b) for a, b in ALL_PAIRS if a != b and b not in ALLOWED_TRANSITIONS[a]]


def pair_id(pair) -> str:
    return f"{pair[0].value}->{pair[1].value}"


def view(state: RunState, **kw) -> RunView:
    base = dict(
        run_id="run_1",
        account="acct_a",
        booking_id="bk_1",
        manifest_digest="ab" * 32,
        idempotency_key="key-1",
        state=state,
        stage="pretrain",
        step=7,
        total_steps=100,
        loss=2.0,
        created_at=T0,
        updated_at=T0,
        message="before",
    )
    return RunView(**(base | kw))


# --- the table ---


@pytest.mark.parametrize("state", list(RunState), ids=lambda s: s.value)
def test_every_state_has_an_entry(state):
    assert state in ALLOWED_TRANSITIONS


def test_table_names_only_run_states():
    assert set(ALLOWED_TRANSITIONS) == set(RunState)
    assert all(isinstance(t, RunState) for targets in ALLOWED_TRANSITIONS.values() for t in targets)


@pytest.mark.parametrize("state", sorted(TERMINAL_STATES), ids=lambda s: s.value)
def test_terminal_states_have_no_exits(state):
    assert ALLOWED_TRANSITIONS[state] == frozenset()


@pytest.mark.parametrize("state", [s for s in RunState if s not in TERMINAL_STATES], ids=lambda s: s.value)
def test_non_terminal_states_can_end(state):
    # every live run can at least fail: there is no state a run can get stuck in
    assert RunState.failed in ALLOWED_TRANSITIONS[state]


def test_terminal_states_are_exactly_the_dead_ends():
    assert TERMINAL_STATES == {s for s, exits in ALLOWED_TRANSITIONS.items() if not exits}
    assert TERMINAL_STATES == {
        RunState.succeeded,
        RunState.failed,
        RunState.gate_failed,
        RunState.cancelled,
        RunState.budget_exhausted,
    }


@pytest.mark.parametrize("state", list(RunState), ids=lambda s: s.value)
def test_no_state_lists_itself(state):
    assert state not in ALLOWED_TRANSITIONS[state]


def test_every_state_is_reachable_from_accepted():
    seen, frontier = {RunState.accepted}, [RunState.accepted]
    while frontier:
        for nxt in ALLOWED_TRANSITIONS[frontier.pop()] - seen:
            seen.add(nxt)
            frontier.append(nxt)
    assert seen == set(RunState)


def test_pairs_are_partitioned():
    n = len(RunState)
    assert len(ALLOWED) + len(DISALLOWED) + n == n * n
    assert len(ALLOWED) > 0 and len(DISALLOWED) > 0


# --- transition() enforces it ---


@pytest.mark.parametrize("pair", ALLOWED, ids=pair_id)
def test_allowed_transition_is_applied(pair):
    current, wanted = pair
    new = transition(view(current), wanted, T1, stage="sft", message="moved", total_steps=200)
    assert (new.state, new.stage, new.message, new.total_steps, new.updated_at) == (
        wanted,
        "sft",
        "moved",
        200,
        T1,
    )
    assert (new.run_id, new.step, new.loss, new.created_at) == ("run_1", 7, 2.0, T0)


@pytest.mark.parametrize("pair", DISALLOWED, ids=pair_id)
def test_disallowed_transition_raises(pair):
    current, wanted = pair
    before = view(current)
    with pytest.raises(IllegalTransition) as info:
        transition(before, wanted, T1)
    assert (info.value.current, info.value.wanted) == (current, wanted)
    assert str(info.value) == f"illegal transition {current.value} -> {wanted.value}"
    assert before.state is current  # frozen view untouched


@pytest.mark.parametrize("state", list(RunState), ids=lambda s: s.value)
def test_same_state_is_a_no_op(state):
    before = view(state)
    assert transition(before, state, T1, stage="other", message="ignored", total_steps=999) is before


def test_transition_keeps_stage_and_total_steps_when_not_given():
    new = transition(view(RunState.running), RunState.succeeded, T1)
    assert (new.stage, new.total_steps, new.message) == ("pretrain", 100, None)


# --- apply_event folds trainer events ---


def metrics(**kw) -> Metrics:
    base = dict(
        run_id="run_1",
        seq=10,
        at=T1,
        stage="sft",
        step=42,
        total_steps=300,
        loss=1.25,
        learning_rate=3e-4,
        tokens_per_s=900.0,
        grad_norm=0.5,
    )
    return Metrics(**(base | kw))


def test_metrics_fold_step_loss_and_stage():
    new = apply_event(view(RunState.running), metrics())
    assert (new.stage, new.step, new.total_steps, new.loss, new.updated_at) == ("sft", 42, 300, 1.25, T1)
    assert new.state is RunState.running


def test_metrics_do_not_change_state():
    new = apply_event(view(RunState.queued), metrics())
    assert new.state is RunState.queued and new.step == 42


@pytest.mark.parametrize("pair", ALLOWED, ids=pair_id)
def test_state_changed_applies_allowed_transitions(pair):
    current, wanted = pair
    event = StateChanged(
        run_id="run_1", seq=11, at=T1, state=wanted, stage="eval", message="m", total_steps=50
    )
    new = apply_event(view(current), event)
    assert (new.state, new.stage, new.message, new.total_steps, new.updated_at) == (
        wanted,
        "eval",
        "m",
        50,
        T1,
    )


@pytest.mark.parametrize("pair", DISALLOWED, ids=pair_id)
def test_state_changed_refuses_disallowed_transitions(pair):
    current, wanted = pair
    event = StateChanged(run_id="run_1", seq=11, at=T1, state=wanted)
    with pytest.raises(IllegalTransition):
        apply_event(view(current), event)


def test_logs_leave_the_view_alone():
    before = view(RunState.running)
    assert apply_event(before, LogLine(run_id="run_1", seq=12, at=T1, message="hello")) == before


def test_a_checkpoint_records_its_step_only():
    before = view(RunState.running)
    after = apply_event(
        before,
        CheckpointSaved(
            run_id="run_1", seq=13, at=T1, step=40, path="/ckpt/40", bytes=10, stall_s=0.1, save_s=0.2
        ),
    )
    assert after.last_checkpoint_step == 40
    assert msgspec.structs.replace(after, last_checkpoint_step=None, updated_at=before.updated_at) == before


def test_a_sequence_of_events_folds_in_order():
    events = [
        StateChanged(run_id="run_1", seq=1, at=T0, state=RunState.queued),
        StateChanged(run_id="run_1", seq=2, at=T0, state=RunState.running, stage="pretrain", total_steps=10),
        metrics(seq=3, stage="pretrain", step=5, total_steps=10, loss=3.0),
        metrics(seq=4, stage="pretrain", step=10, total_steps=10, loss=2.0),
        StateChanged(run_id="run_1", seq=5, at=T1, state=RunState.succeeded, message="done"),
    ]
    v = view(RunState.accepted, stage=None, step=0, total_steps=0, loss=None, message=None)
    for e in events:
        v = apply_event(v, e)
    assert (v.state, v.stage, v.step, v.total_steps, v.loss, v.message) == (
        RunState.succeeded,
        "pretrain",
        10,
        10,
        2.0,
        "done",
    )


def test_unknown_event_type_is_a_type_error():
    class Stranger(msgspec.Struct):
        run_id: str = "run_1"

    with pytest.raises(TypeError, match="Stranger"):
        apply_event(view(RunState.running), Stranger())
