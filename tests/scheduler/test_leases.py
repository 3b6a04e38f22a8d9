"""Leases against the real Redis: one holder at a time, a growing epoch, fencing of the old holder,
and the watcher marking a silent run interrupted."""

import asyncio
import uuid
from datetime import UTC, datetime

import pytest

from contracts.api import RunView
from contracts.states import LEASABLE, RunState
from runtime.configuration.keys import Keys
from services.scheduler import leases
from services.scheduler.store import RunStore

NOW = datetime.now(UTC)


@pytest.fixture
async def runs(own_redis):
    r = own_redis.redis("scheduler")  # the scheduler's own ACL user: these are its keys and commands
    yield RunStore(r, Keys(own_redis.settings))
    await r.aclose()


async def new_run(runs: RunStore, state=RunState.queued) -> str:
    run_id = "run_" + uuid.uuid4().hex[:8]
    await runs.create(
        RunView(
            run_id=run_id,
            account="acme",
            booking_id="b",
            manifest_digest="d",
            idempotency_key="k",
            state=state,
            created_at=NOW,
            updated_at=NOW,
        )
    )
    return run_id


def leasable(view):
    return view.state in LEASABLE


async def test_two_trainers_racing_for_one_run_one_wins(runs):
    run_id = await new_run(runs, RunState.interrupted)
    answers = await asyncio.gather(
        *(runs.lease("acme", run_id, f"trainer-{i}", 0, 1000.0, 5.0, leasable) for i in range(8))
    )
    assert [granted for granted, _, _ in answers].count(True) == 1
    assert {epoch for granted, _, epoch in answers if granted} == {1}


async def test_a_new_holder_fences_the_old_one(runs):
    run_id = await new_run(runs)
    granted, _, epoch = await runs.lease("acme", run_id, "old", 0, 1000.0, 5.0, leasable)
    assert granted and epoch == 1
    assert (await runs.lease("acme", run_id, "new", 0, 1002.0, 5.0, leasable))[0] is False  # old one is alive
    granted, _, epoch = await runs.lease(
        "acme", run_id, "new", 0, 1010.0, 5.0, leasable
    )  # old one went silent
    assert granted and epoch == 2
    assert (await runs.lease("acme", run_id, "old", 1, 1011.0, 5.0, leasable))[0] is False  # fenced renewal
    assert (await runs.lease("acme", run_id, "new", 2, 1011.0, 5.0, leasable))[0] is True
    # an event from the fenced epoch is not applied, nor one claiming epoch 0 or a future epoch
    for epoch in (1, 0, 3):
        _, applied = await runs.update("acme", run_id, 1, lambda v: v, holder_epoch=epoch)
        assert applied is False, epoch
    _, applied = await runs.update("acme", run_id, 1, lambda v: v, holder_epoch=2)
    assert applied is True


async def test_no_trainer_event_applies_before_any_lease(runs):
    run_id = await new_run(runs, RunState.running)
    _, applied = await runs.update("acme", run_id, 1, lambda v: v, holder_epoch=0)
    assert applied is False


@pytest.mark.parametrize(
    "epoch, seq, last_epoch, last_seq, ok",
    [
        (1, 1, 0, 0, True),  # the first event of the first lease
        (1, 5, 1, 4, True),
        (1, 4, 1, 4, False),
        (1, 3, 1, 4, False),  # in order; duplicate; redelivered
        (2, 1, 1, 900, True),  # a new lease starts its own count
        (1, 950, 2, 3, False),  # a fenced epoch, whatever its count
        (1, 4 + 100_001, 1, 4, False),
        (3, 100_001, 2, 7, False),  # an implausible jump (forged)
    ],
)
def test_event_order_is_epoch_then_counter(epoch, seq, last_epoch, last_seq, ok):
    from services.scheduler.store import in_order

    assert in_order(epoch, seq, last_epoch, last_seq) is ok


async def test_a_trainer_clock_ten_minutes_off_still_has_every_event_applied(runs):
    """No wall clock orders events: a trainer whose clock is 10 minutes behind (or ahead) reports
    a run's whole life and every event applies, in order, duplicates dropped."""
    from contracts.runs import LogLine, RunCreated, StateChanged
    from services.scheduler.events import RunEvents
    from services.scheduler.publish import seq_now

    for skew in (-600, 600):
        run_id = await new_run(runs)
        granted, _, epoch = await runs.lease("acme", run_id, "t", 0, 1000.0, 5.0, leasable)
        assert granted
        at = datetime.fromtimestamp(NOW.timestamp() + skew, UTC)
        subject = f"ns.v1.run.{run_id}"
        created = RunCreated(
            run_id=run_id,
            seq=seq_now(),
            at=NOW,
            account="acme",
            booking_id="b",
            region="r",
            gpu_model="g",
            gpus=1,
            accepted_at=NOW,
        )  # the scheduler's own event, its own clock
        events = [
            created,
            StateChanged(run_id=run_id, seq=1, at=at, epoch=epoch, state=RunState.running),
            LogLine(run_id=run_id, seq=2, at=at, epoch=epoch, level="info", message="step 1"),
            LogLine(run_id=run_id, seq=2, at=at, epoch=epoch, level="info", message="step 1"),  # duplicate
            LogLine(run_id=run_id, seq=3, at=at, epoch=epoch, level="info", message="step 2"),
            StateChanged(run_id=run_id, seq=4, at=at, epoch=epoch, state=RunState.succeeded),
        ]
        consumer = RunEvents(runs)
        for e in events:
            await consumer.on_event(e, f"{subject}.{type(e).__struct_config__.tag}")
        assert (await runs.get("acme", run_id)).state is RunState.succeeded
        assert [line.message for line in await runs.logs("acme", run_id, 0, 10)] == ["step 1", "step 2"]


async def test_a_cancelled_run_cannot_be_leased(runs):
    run_id = await new_run(runs, RunState.cancelled)
    assert (await runs.lease("acme", run_id, "t", 0, 1000.0, 5.0, leasable))[0] is False


async def test_watcher_marks_a_silent_run_interrupted_once(runs):
    run_id = await new_run(runs)
    await runs.lease("acme", run_id, "t", 0, 1000.0, 5.0, leasable)
    await runs.move("acme", run_id, RunState.running)
    assert await leases.watch_once(runs, 1004.0) == []  # within the silence allowance
    assert await leases.watch_once(runs, 1006.0) == [run_id]
    assert await leases.watch_once(runs, 1007.0) == []
    assert (await runs.get("acme", run_id)).state is RunState.interrupted
    (record,) = await runs.interruptions("acme", run_id)
    assert record["cause"] == "trainer_lost" and record["silent_s"] == 6.0


async def test_the_store_has_no_writer_of_state_but_move(runs):
    """`update` refuses a change of state: a transition outside lifecycle.move cannot be written."""
    import msgspec

    from services.scheduler.lifecycle import NotAMove

    run_id = await new_run(runs)
    with pytest.raises(NotAMove):
        await runs.update("acme", run_id, None, lambda v: msgspec.structs.replace(v, state=RunState.running))
    assert (await runs.get("acme", run_id)).state is RunState.queued
    view, applied = await runs.move(
        "acme", run_id, RunState.cancelled, allowed_from=frozenset({RunState.running})
    )
    assert applied and view.state is RunState.queued  # not in allowed_from: unchanged
