"""Two instances of one service over the same state, as `ito-training up --cluster` runs them,
against the real NATS and Redis (one server each is enough: the instances, not the servers, are
under test here).

- One durable consumed by two instances applies its messages one at a time, in stream order
  (`max_ack_pending=1`), and the survivor carries on when the other stops.
- Two reconcilers finishing the same pending hand-off put one work item into the queue and one
  creation event into the run's history: idempotent by construction (the run view is created if
  absent, each publish carries its dedup id).
- Two liveness watchers finding the same silent run interrupt it once: one interruption record,
  one Interruption event (the store's compare-and-set picks the watcher whose move it is).
"""

import asyncio
import dataclasses
import json
import uuid
from datetime import UTC, datetime
from typing import Any

import msgspec

from contracts import subjects
from contracts.api import RunView
from contracts.internal import LedgerEntry
from contracts.states import LEASABLE, RunState
from runtime.configuration.keys import Keys
from runtime.configuration.timers import TIMERS
from runtime.messaging import connections
from runtime.messaging.bus import NatsBus
from runtime.messaging.service import Wiring, consume_in_order
from services.scheduler import leases
from services.scheduler.handoff import Handoff
from services.scheduler.publish import RunEventPublisher
from services.scheduler.store import RunStore
from tests.support import eventually_async
from tests.training.test_node_shares import work

NOW = datetime.now(UTC)
DURABLE = subjects.CONSUMER_SCHEDULER_RUNS


async def _messages(js, stream: str, subject: str) -> int:
    info = await js.stream_info(stream, subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def test_two_instances_on_one_durable_apply_in_stream_order_and_one_takes_over(own_infra):
    s = own_infra.settings
    applied: list[tuple[str, int]] = []
    in_flight = [0, 0]  # now, most ever: across both instances

    def wiring(name: str) -> Wiring:
        w = Wiring(
            settings=dataclasses.replace(s, instance=name),
            broker=connections.make_broker(s, "scheduler"),
            redis=None,
            keys=Keys(s),
            service="scheduler",
        )

        async def apply(event: dict[str, Any]) -> None:
            in_flight[0] += 1
            in_flight[1] = max(in_flight)
            await asyncio.sleep(0.02)  # long enough for the other instance to pull, were it allowed
            applied.append((name, event["i"]))
            in_flight[0] -= 1

        consume_in_order(w, subjects.RUN_EVENTS, subjects.STREAM_RUNS, DURABLE, apply, 30, dict)
        return w

    first, second = wiring("scheduler-1"), wiring("scheduler-2")
    nc = await own_infra.nats()
    js = nc.jetstream()
    subject = s.subject(f"{subjects.RUN_EVENTS}.run_order.log")
    try:
        await asyncio.gather(first.broker.start(), second.broker.start())
        for i in range(20):
            await js.publish(subject, json.dumps({"i": i}).encode())
        await eventually_async(lambda: _count(applied, 20), timeout=30, what="the first 20 applied")
        await first.broker.stop()  # one instance goes away: the other carries on alone
        for i in range(20, 40):
            await js.publish(subject, json.dumps({"i": i}).encode())
        await eventually_async(lambda: _count(applied, 40), timeout=30, what="all 40 applied")
        info = await js.consumer_info(s.stream(subjects.STREAM_RUNS), f"{s.namespace}-{DURABLE}")
    finally:
        await second.broker.stop()
        await first.broker.stop()
        await nc.close()
    assert [i for _, i in applied] == list(range(40))
    assert in_flight[1] == 1, "two messages of one durable were in flight at once"
    assert {name for name, i in applied if i >= 20} == {"scheduler-2"}
    assert info.config.max_ack_pending == 1


async def _count(applied: list, n: int) -> bool:
    return len(applied) >= n


class SharedLedger:
    """The ledger both instances ask (through the Peers port); the work queue is the real
    WORK stream, published with the item's dedup id as Peers.publish_work does."""

    def __init__(self, entry: LedgerEntry, bus: NatsBus, settings) -> None:
        self.entry = entry
        self.bus = bus
        self.settings = settings
        self.pending = True

    async def publish_work(self, run_id: str, body: bytes, msg_id: str) -> None:
        await self.bus.publish_once(
            self.settings.subject(f"{subjects.WORK_TRAIN}.{run_id}"),
            self.settings.stream(subjects.STREAM_WORK),
            body,
            msg_id,
            timeout=5,
        )

    async def ledger_handed_off(self, account: str, key: str) -> LedgerEntry:
        self.pending = False
        return self.entry

    async def ledger_pending(self, older_than_s: float) -> list[LedgerEntry]:
        return [self.entry] if self.pending else []


async def test_two_reconcilers_hand_a_pending_run_off_once(own_infra):
    s = own_infra.settings
    run_id = "run_" + uuid.uuid4().hex[:8]
    item = msgspec.structs.replace(work(1), run_id=run_id, account="acme")
    entry = LedgerEntry(
        account="acme",
        idempotency_key="k-" + run_id,
        fingerprint="f",
        run_id=run_id,
        action="train",
        handed_off=False,
        created_at=NOW,
        work=msgspec.json.encode(item),
    )
    r = own_infra.redis("scheduler")
    runs = RunStore(r, Keys(s))
    brokers = [connections.make_broker(s, "scheduler") for _ in range(2)]
    nc = await own_infra.nats()
    js = nc.jetstream()
    try:
        for b in brokers:
            await b.connect()
        buses = [NatsBus(b) for b in brokers]
        ledger = SharedLedger(entry, buses[0], s)
        instances = [Handoff(bus, s, runs, ledger) for bus in buses]  # type: ignore[arg-type]
        done = await asyncio.gather(*(h.reconcile_once() for h in instances))
        assert done == [1, 1]  # both saw the key pending and both finished the hand-off...
        work_items = await _messages(
            js, s.stream(subjects.STREAM_WORK), s.subject(f"{subjects.WORK_TRAIN}.{run_id}")
        )
        created = await _messages(
            js, s.stream(subjects.STREAM_RUNS), s.subject(f"{subjects.RUN_EVENTS}.{run_id}.created")
        )
        view = await runs.get("acme", run_id)
    finally:
        for b in brokers:
            await b.stop()
        await nc.close()
        await r.aclose()
    assert (work_items, created) == (1, 1)  # ...and the queue holds one item, the history one creation
    assert view is not None and view.state is RunState.queued


class Racing:
    """A watcher's view of the run store whose `move` waits until both watchers have decided:
    both found the run silent before either moved it (the race two scheduler instances can run)."""

    def __init__(self, runs: RunStore, decided: asyncio.Barrier) -> None:
        self.runs = runs
        self.decided = decided

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runs, name)

    async def move(self, *args: Any, **kwargs: Any) -> tuple[RunView | None, bool]:
        await self.decided.wait()
        return await self.runs.move(*args, **kwargs)


async def test_two_watchers_interrupt_a_silent_run_once(own_infra):
    s = own_infra.settings
    r = own_infra.redis("scheduler")
    runs = RunStore(r, Keys(s))
    run_id = "run_" + uuid.uuid4().hex[:8]
    await runs.create(
        RunView(
            run_id=run_id,
            account="acme",
            booking_id="b",
            manifest_digest="d",
            idempotency_key="k",
            state=RunState.queued,
            created_at=NOW,
            updated_at=NOW,
        )
    )
    granted, _, _ = await runs.lease(
        "acme", run_id, "trainer-1", 0, 1000.0, TIMERS.silence_s, lambda v: v.state in LEASABLE
    )
    assert granted
    await runs.move("acme", run_id, RunState.running)
    broker = connections.make_broker(s, "scheduler")
    nc = await own_infra.nats()
    try:
        await broker.connect()
        events = RunEventPublisher(NatsBus(broker), s)
        decided = asyncio.Barrier(2)
        later = 1000.0 + TIMERS.silence_s
        # seconds apart, so that their events' dedup ids differ: the stream would not hide a second
        found = await asyncio.gather(
            leases.watch_once(Racing(runs, decided), later + 1.0, events),  # type: ignore[arg-type]
            leases.watch_once(Racing(runs, decided), later + 3.0, events),  # type: ignore[arg-type]
        )
        records = await runs.interruptions("acme", run_id)
        published = await _messages(
            nc.jetstream(),
            s.stream(subjects.STREAM_RUNS),
            s.subject(f"{subjects.RUN_EVENTS}.{run_id}.interruption"),
        )
        state = (await runs.get("acme", run_id)).state  # type: ignore[union-attr]
    finally:
        await broker.stop()
        await nc.close()
        await r.aclose()
    assert sorted(found) == [[], [run_id]]
    assert (len(records), published, state) == (1, 1, RunState.interrupted)


async def test_the_schedulers_durable_is_delivered_only_the_trainers_event_kinds(own_infra):
    # issue 30: the scheduler fetched, decoded and acked its own `created` event for every accepted
    # run, only to ignore it; the server filters them out now.
    from services.scheduler.events import TRAINER_KINDS

    s = own_infra.settings
    applied: list[str] = []
    w = Wiring(
        settings=s,
        broker=connections.make_broker(s, "scheduler"),
        redis=None,
        keys=Keys(s),
        service="scheduler",
    )

    async def apply(event: dict[str, Any], subject: str) -> None:
        applied.append(subject.rsplit(".", 1)[-1])

    durable = DURABLE  # the scheduler identity may make no other
    consume_in_order(
        w,
        subjects.RUN_EVENTS,
        subjects.STREAM_RUNS,
        durable,
        apply,
        30,
        dict,
        with_subject=True,
        kinds=TRAINER_KINDS,
    )
    nc = await own_infra.nats()
    js = nc.jetstream()
    try:
        await w.broker.start()
        for kind in ("created", "log", "interruption", "state", "created", "metrics"):
            await js.publish(s.subject(f"{subjects.RUN_EVENTS}.run_filtered.{kind}"), b"{}")
        await eventually_async(lambda: _count(applied, 3), timeout=30, what="the trainer's three events")
        await asyncio.sleep(0.5)  # anything else would have come by now
        info = await js.consumer_info(s.stream(subjects.STREAM_RUNS), f"{s.namespace}-{durable}")
    finally:
        await w.broker.stop()
        await nc.close()
    assert applied == ["log", "state", "metrics"]
    assert "created" not in TRAINER_KINDS and "interruption" not in TRAINER_KINDS
    assert sorted(info.config.filter_subjects or []) == sorted(
        s.subject(f"{subjects.RUN_EVENTS}.*.{kind}") for kind in TRAINER_KINDS
    )
