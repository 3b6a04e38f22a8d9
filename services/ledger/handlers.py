"""Ledger handlers: decode, call the store (the `Ledger` port: Redis in the service, dicts in
table tests), answer. No policy beyond the binding rules the store applies."""

from datetime import UTC, datetime, timedelta

from contracts.errors import ErrorCode
from contracts.internal import (
    LedgerAccept,
    LedgerEntry,
    LedgerHandedOff,
    LedgerLookup,
    LedgerPending,
    LedgerPendingAnswer,
)
from runtime.messaging.codec import Refusal
from services.ledger.store import Ledger


class LedgerHandlers:
    def __init__(self, store: Ledger) -> None:
        self.store = store

    async def lookup(self, req: LedgerLookup) -> LedgerEntry | None:
        return await self.store.lookup(req.account, req.idempotency_key)

    async def accept(self, req: LedgerAccept) -> tuple[LedgerEntry, str | None]:
        entry = LedgerEntry(
            account=req.account,
            idempotency_key=req.idempotency_key,
            fingerprint=req.fingerprint,
            run_id=req.run_id,
            action=req.action,
            handed_off=False,
            created_at=datetime.now(UTC),
            work=req.work,
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
