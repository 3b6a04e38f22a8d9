"""The entitlement service's entry point: config, build, run."""

import asyncio
import logging

import msgspec

from faststream import AckPolicy, FastStream
from faststream.nats import ConsumerConfig, NatsMessage, PullSub

from contracts import subjects
from contracts.internal import BookingsQuery, EligibilityQuery
from services.entitlement.handlers import EntitlementHandlers, event_decoder
from services.entitlement.store import BookingStore
from services.runtime import settings as settings_mod
from services.runtime import faults, streams
from services.runtime.service import Wiring, build_app, configure_logging, serve_requests

log = logging.getLogger("ito.entitlement")
BOOKING_ACK_WAIT_S = 5  # applying an event takes milliseconds; a lost service's events come back fast


def register(w: Wiring) -> None:
    s = w.settings
    h = EntitlementHandlers(BookingStore(w.redis, w.keys), settings_mod.entitlement_key(s), s.eligibility_ttl_s)

    # Durable: a late or restarted service replays what it missed. Acked only after the Redis
    # write returned; an exception NAKs for redelivery (the apply is idempotent by version).
    @w.broker.subscriber(
        s.subject(subjects.BOOKING_EVENTS) + ".>",
        stream=streams.ref(s, subjects.STREAM_BOOKINGS),
        durable=f"{s.namespace}-{subjects.CONSUMER_ENTITLEMENT}",
        pull_sub=PullSub(batch_size=1, timeout=1.0),  # in order: FastStream runs a batch concurrently
        config=ConsumerConfig(ack_wait=BOOKING_ACK_WAIT_S),
        ack_policy=AckPolicy.NACK_ON_ERROR,
    )
    async def on_booking_event(msg: NatsMessage) -> None:
        try:
            event = event_decoder.decode(msg.body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            # A malformed event would be redelivered forever: acknowledge it, count it, say why.
            log.error("booking event rejected (acked, not applied): %s", exc)
            await w.redis.hincrby(w.keys.booking_stats(), "rejected_malformed", 1)
            return
        faults.crash_here(faults.ENTITLEMENT_BEFORE_APPLY)
        await h.on_event(event)

    serve_requests(w, [
        (subjects.ENTITLEMENT_ELIGIBILITY, EligibilityQuery, h.eligibility),
        (subjects.ENTITLEMENT_BOOKINGS, BookingsQuery, h.bookings),
    ])


def build(settings: settings_mod.Settings | None = None) -> FastStream:
    return build_app("entitlement", settings or settings_mod.load(), register)


def main() -> None:
    configure_logging("entitlement")
    asyncio.run(build().run())
