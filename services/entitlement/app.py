"""The entitlement service's entry point: config, build, run."""

import asyncio
import logging

from faststream import FastStream

from contracts import endpoints, subjects
from contracts.booking import BookingEvent
from runtime.configuration import faults
from runtime.configuration import settings as settings_mod
from runtime.messaging.service import (
    Wiring,
    build_app,
    configure_logging,
    consume_in_order,
    serve_requests,
)
from services.entitlement.handlers import EntitlementHandlers
from services.entitlement.store import Bookings, BookingStore

log = logging.getLogger("ito.entitlement")
BOOKING_ACK_WAIT_S = 5  # applying an event takes milliseconds; a lost service's events come back fast


def register(w: Wiring, store: Bookings | None = None) -> None:
    """Wire the handlers to `store` (the bootstrap); by default the Redis one."""
    s = w.settings
    bookings = store if store is not None else BookingStore(w.require_redis(), w.keys)
    h = EntitlementHandlers(bookings, settings_mod.entitlement_key(s), s.eligibility_ttl_s)

    # Acked only after the Redis write returned (the apply is idempotent by version).
    async def on_booking_event(event: BookingEvent) -> None:
        faults.crash_here(faults.ENTITLEMENT_BEFORE_APPLY)
        await h.on_event(event)

    consume_in_order(
        w,
        subjects.BOOKING_EVENTS,
        subjects.STREAM_BOOKINGS,
        subjects.CONSUMER_ENTITLEMENT,
        on_booking_event,
        ack_wait_s=BOOKING_ACK_WAIT_S,
        message_type=BookingEvent,
        on_malformed=lambda: bookings.count("rejected_malformed"),
    )

    serve_requests(w, [(endpoints.ELIGIBILITY, h.eligibility), (endpoints.BOOKINGS, h.bookings)])


def build(settings: settings_mod.Settings | None = None) -> FastStream:
    return build_app("entitlement", settings or settings_mod.load(), register)


def main() -> None:
    configure_logging("entitlement")
    asyncio.run(build().run())
