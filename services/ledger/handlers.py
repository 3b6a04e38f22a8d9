"""Ledger handlers: decode, call the store (the `Ledger` port: Redis in the service, dicts in
table tests), answer. No policy beyond the binding rules the store applies, and the run's cost
bound written into its work item from the confirmation it consumes (`bounded_work`)."""

from datetime import UTC, datetime, timedelta

import msgspec

from contracts.api import Action
from contracts.errors import ErrorCode
from contracts.internal import (
    LedgerAccept,
    LedgerEntry,
    LedgerHandedOff,
    LedgerLookup,
    LedgerPending,
    LedgerPendingAnswer,
)
from contracts.runs import TrainWork
from services.ledger.store import Ledger
from services.runtime.codec import Refusal

_work_decoder = msgspec.json.Decoder(TrainWork)


def bounded_work(work: bytes, authorised: float | None) -> bytes:
    """The work item with the consumed confirmation's cost bound (what the person authorised the
    run to spend) in place of the scheduler's estimate; unchanged when the confirmation binds no
    cost (the accept refuses then anyway: a train's binding holds the estimate under a bound).
    Written here, at the accept, so the item the ledger keeps for a hand-off after a crash and the
    one handed off now carry the same bound, and no request asks the confirmation service first."""
    if not work or authorised is None:
        return work
    item = _work_decoder.decode(work)
    if item.cost_bound_usd == authorised:
        return work
    return msgspec.json.encode(msgspec.structs.replace(item, cost_bound_usd=authorised))


class LedgerHandlers:
    def __init__(self, store: Ledger) -> None:
        self.store = store

    async def lookup(self, req: LedgerLookup) -> LedgerEntry | None:
        return await self.store.lookup(req.account, req.idempotency_key)

    async def accept(self, req: LedgerAccept) -> tuple[LedgerEntry, str | None]:
        work = req.work
        if work and req.action is Action.train and req.confirmation_ref:
            work = bounded_work(work, await self.store.authorised_cost(req.account, req.confirmation_ref))
        entry = LedgerEntry(
            account=req.account,
            idempotency_key=req.idempotency_key,
            fingerprint=req.fingerprint,
            run_id=req.run_id,
            action=req.action,
            handed_off=False,
            created_at=datetime.now(UTC),
            work=work,
        )
        stored, created = await self.store.accept(req, entry)
        if created:
            return stored, None
        if stored.fingerprint != req.fingerprint:
            raise Refusal(
                ErrorCode.idempotency_key_conflict, "this idempotency key was used for another request"
            )
        return stored, "replay: this idempotency key already created this run"

    async def handed_off(self, req: LedgerHandedOff) -> LedgerEntry:
        entry = await self.store.mark_handed_off(req.account, req.idempotency_key)
        if entry is None:
            raise Refusal(ErrorCode.run_not_found, "no ledger entry for this key")
        return entry

    async def pending(self, req: LedgerPending) -> LedgerPendingAnswer:
        cutoff = datetime.now(UTC) - timedelta(seconds=req.older_than_s)
        return LedgerPendingAnswer(entries=[e for e in await self.store.pending() if e.created_at <= cutoff])
