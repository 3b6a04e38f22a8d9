"""Hand an accepted run to the trainer's work queue, exactly once, and finish lost hand-offs.

The ledger entry carries the encoded work item, so the request path and the reconciler share this
one code path: create the run view (idempotent), publish with Nats-Msg-Id = run id (JetStream
drops a duplicate inside its window), move the run to `queued`, and tell the ledger. If the
scheduler dies anywhere in between, the reconciler finds the key still pending and repeats the
steps; each is idempotent, so no run is lost and none is duplicated.
"""

import asyncio
import logging

import msgspec
from faststream.nats import NatsBroker

from contracts.api import RunView
from contracts.internal import LedgerEntry
from contracts.runs import RunCreated, TrainWork
from contracts.states import RunState
from services.runtime.settings import Settings
from services.scheduler.backends import Backends
from services.scheduler.publish import RunEventPublisher
from services.scheduler.store import RunRecords

log = logging.getLogger("ito.scheduler.handoff")

RECONCILE_EVERY_S = 5.0
RECONCILE_AFTER_S = 5.0  # leave a live request time to finish its own hand-off

_work_decoder = msgspec.json.Decoder(TrainWork)


class Handoff:
    def __init__(self, broker: NatsBroker, settings: Settings, runs: RunRecords, backends: Backends) -> None:
        self.broker = broker
        self.settings = settings
        self.runs = runs
        self.backends = backends
        self.events = RunEventPublisher(broker, settings)

    def view_from(self, entry: LedgerEntry) -> RunView:
        work = _work_decoder.decode(entry.work)
        return RunView(
            run_id=work.run_id,
            account=work.account,
            booking_id=work.booking_id,
            manifest_digest=work.manifest_digest,
            idempotency_key=entry.idempotency_key,
            state=RunState.accepted,
            created_at=entry.created_at,
            updated_at=entry.created_at,
            plan=work.plan,
            checkpoint_dir=work.checkpoint_dir,
        )

    async def hand_off(self, entry: LedgerEntry) -> RunView:
        view = self.view_from(entry)
        await self.runs.create(view)
        plan = view.plan
        await self.events.publish(
            RunCreated(  # before the work item: its history starts here
                **self.events.base(view.run_id),
                account=view.account,
                booking_id=view.booking_id,
                region=plan.region if plan else "",
                gpu_model=plan.gpu_model if plan else "",
                gpus=plan.cost.gpus if plan else 1,
                accepted_at=view.created_at,
            ),
            f"{view.run_id}:created",
        )
        await self.runs.remember(view.account, view.run_id, "work", entry.work)  # for an approved restart
        await self.backends.publish_work(entry.run_id, entry.work, entry.run_id)

        updated, _ = await self.runs.move(  # unless the trainer already moved it on
            entry.account, entry.run_id, RunState.queued, allowed_from=frozenset({RunState.accepted})
        )
        await self.backends.ledger_handed_off(entry.account, entry.idempotency_key)
        return updated or view

    async def reconcile_once(self) -> int:
        """Finish the hand-offs the ledger still holds as pending after RECONCILE_AFTER_S."""
        done = 0
        for entry in await self.backends.ledger_pending(RECONCILE_AFTER_S):
            log.warning("reconciler: finishing the hand-off of run %s", entry.run_id)
            await self.hand_off(entry)
            done += 1
        return done

    async def reconcile_forever(self) -> None:
        while True:
            await asyncio.sleep(RECONCILE_EVERY_S)
            try:
                await self.reconcile_once()
            except Exception:  # the loop must survive an outage; it retries on the next tick
                log.exception("reconciler pass failed; retrying in %.0fs", RECONCILE_EVERY_S)
