"""Entitlement handlers: apply booking events to the projection; answer eligibility queries."""

import logging
from datetime import UTC, datetime, timedelta

from contracts.booking import BookingEvent, BookingEventKind
from contracts.internal import (
    BookingsAnswer,
    BookingsQuery,
    EligibilityBody,
    EligibilityQuery,
    EligibilityStatement,
)
from runtime.messaging.codec import Refusal
from services.entitlement import projection, statements
from services.entitlement.store import Bookings

log = logging.getLogger("ito.entitlement")


class EntitlementHandlers:
    def __init__(self, store: Bookings, key: bytes, ttl_s: float) -> None:
        self.store = store
        self._key = key
        self.ttl = timedelta(seconds=ttl_s)

    async def on_event(self, event: BookingEvent) -> str:
        """Apply one upstream event. Returns what happened (for logs and tests)."""
        owner = await self.store.owner(event.booking_id)
        if owner is not None and owner != event.account:
            await self.store.count("rejected_foreign_account")
            log.warning(
                "event %s for booking %s names another account; rejected", event.event_id, event.booking_id
            )
            return "rejected"
        current = await self.store.get(event.account, event.booking_id)
        if current is None and event.kind is not BookingEventKind.completed:
            await self.store.park(event)  # kept until its `completed` arrives
            await self.store.count("parked")
            return "parked"
        await self.store.claim_owner(event.booking_id, event.account)
        outcome = await self.store.apply(projection.project(event))
        if outcome is projection.Outcome.stale:
            await self.store.count("stale_ignored")
        if current is None and outcome is projection.Outcome.applied:
            for parked in await self.store.parked(event.booking_id):
                if parked.account == event.account:  # another account's early event never applies
                    await self.store.apply(projection.project(parked))
            await self.store.clear_parked(event.booking_id)
        log.info("booking %s v%d %s: %s", event.booking_id, event.version, event.kind.value, outcome.value)
        return outcome

    async def eligibility(self, query: EligibilityQuery) -> EligibilityStatement:
        booking = await self.store.get(query.account, query.booking_id)
        parked = booking is None and any(
            e.account == query.account for e in await self.store.parked(query.booking_id)
        )  # only the caller's own early events say "incomplete"; others' leak nothing
        now = datetime.now(UTC)
        refusal = projection.eligibility(booking, query, now, parked=parked)
        if refusal is not None:
            raise Refusal(*refusal)
        assert booking is not None
        body = EligibilityBody(
            account=booking.account,
            booking_id=booking.booking_id,
            booking_version=booking.version,
            topology=booking.topology,
            region=booking.region,
            fabric=booking.fabric,
            window_start=booking.window_start,
            window_end=booking.window_end,
            issued_at=now,
            expires_at=now + self.ttl,
        )
        return statements.sign(body, self._key)

    async def bookings(self, query: BookingsQuery) -> BookingsAnswer:
        return BookingsAnswer(bookings=await self.store.of_account(query.account))
