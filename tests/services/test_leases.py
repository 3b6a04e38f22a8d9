"""Leases against the real Redis: one holder at a time, a growing epoch, fencing of the old holder,
and the watcher marking a silent run interrupted."""

import asyncio
import uuid
from datetime import UTC, datetime

import pytest
import redis.asyncio as aioredis

from contracts.api import RunView
from contracts.states import RunState
from services.runtime import settings as settings_mod
from services.runtime.keys import Keys
from services.scheduler import liveness
from services.scheduler.mutations import LEASABLE
from services.scheduler.store import RunStore

NOW = datetime.now(UTC)


@pytest.fixture
async def runs(infra_urls, namespace, apurge):
    r = aioredis.Redis.from_url(infra_urls[1])
    yield RunStore(r, Keys(settings_mod.load({"ITO_NAMESPACE": namespace})))
    await r.aclose()
    await apurge(*infra_urls, namespace)


async def new_run(runs: RunStore, state=RunState.queued) -> str:
    run_id = "run_" + uuid.uuid4().hex[:8]
    await runs.create(RunView(run_id=run_id, account="acme", booking_id="b", manifest_digest="d", idempotency_key="k",
                              state=state, created_at=NOW, updated_at=NOW))
    return run_id


def leasable(view):
    return view.state in LEASABLE


async def test_two_trainers_racing_for_one_run_one_wins(runs):
    run_id = await new_run(runs, RunState.interrupted)
    answers = await asyncio.gather(*(runs.lease("acme", run_id, f"trainer-{i}", 0, 1000.0, 5.0, leasable)
                                     for i in range(8)))
    assert [granted for granted, _, _ in answers].count(True) == 1
    assert {epoch for granted, _, epoch in answers if granted} == {1}


async def test_a_new_holder_fences_the_old_one(runs):
    run_id = await new_run(runs)
    granted, _, epoch = await runs.lease("acme", run_id, "old", 0, 1000.0, 5.0, leasable)
    assert granted and epoch == 1
    assert (await runs.lease("acme", run_id, "new", 0, 1002.0, 5.0, leasable))[0] is False  # old one is alive
    granted, _, epoch = await runs.lease("acme", run_id, "new", 0, 1010.0, 5.0, leasable)  # old one went silent
    assert granted and epoch == 2
    assert (await runs.lease("acme", run_id, "old", 1, 1011.0, 5.0, leasable))[0] is False  # fenced renewal
    assert (await runs.lease("acme", run_id, "new", 2, 1011.0, 5.0, leasable))[0] is True
    # an event from the fenced epoch is not applied
    _, applied = await runs.update("acme", run_id, 10**15, lambda v: v, epoch=1)
    assert applied is False
    _, applied = await runs.update("acme", run_id, 10**15, lambda v: v, epoch=2)
    assert applied is True


async def test_a_cancelled_run_cannot_be_leased(runs):
    run_id = await new_run(runs, RunState.cancelled)
    assert (await runs.lease("acme", run_id, "t", 0, 1000.0, 5.0, leasable))[0] is False


async def test_watcher_marks_a_silent_run_interrupted_once(runs):
    run_id = await new_run(runs)
    await runs.lease("acme", run_id, "t", 0, 1000.0, 5.0, leasable)
    await runs.update("acme", run_id, None, lambda v: __import__("msgspec").structs.replace(v, state=RunState.running))
    assert await liveness.watch_once(runs, 1004.0) == []  # within the silence allowance
    assert await liveness.watch_once(runs, 1006.0) == [run_id]
    assert await liveness.watch_once(runs, 1007.0) == []
    assert (await runs.get("acme", run_id)).state is RunState.interrupted
    (record,) = await runs.interruptions("acme", run_id)
    assert record["cause"] == "trainer_lost" and record["silent_s"] == 6.0
