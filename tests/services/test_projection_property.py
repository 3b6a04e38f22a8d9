"""Property: whatever order, duplication or redelivery upstream events arrive in, the projection
equals the event with the highest version, once the booking's `completed` has been seen."""

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.booking import BookingEvent, BookingEventKind, Fabric, Topology
from services.entitlement.handlers import EntitlementHandlers
from services.entitlement.projection import STATE_AFTER
from services.entitlement.store import BookingStore
from services.runtime import settings as settings_mod
from services.runtime.keys import Keys

KINDS = list(BookingEventKind)
NOW = datetime.now(UTC)


def event(booking: str, kind: BookingEventKind, version: int, account: str = "acme") -> BookingEvent:
    return BookingEvent(
        event_id=uuid.uuid4().hex, kind=kind, booking_id=booking, account=account, version=version,
        topology=Topology(nodes=1, gpus_per_node=version % 8 + 1, gpu_model="H200", gpu_memory_gb=141),
        region="r", fabric=Fabric.roce, window_start=NOW, window_end=NOW + timedelta(hours=1), emitted_at=NOW,
    )


# a history: distinct versions each with a kind; delivered in any order, some twice
histories = st.lists(st.tuples(st.integers(1, 50), st.sampled_from(KINDS)), min_size=1, max_size=12,
                     unique_by=lambda t: t[0])


@settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(history=histories, data=st.data())
def test_projection_is_the_last_event_by_version(infra_urls, history, data):
    deliveries = data.draw(st.permutations(history + data.draw(st.lists(st.sampled_from(history), max_size=4))))
    namespace = "p" + uuid.uuid4().hex[:8]
    booking = "b-" + uuid.uuid4().hex[:6]

    async def run():
        r = aioredis.Redis.from_url(infra_urls[1])
        keys = Keys(settings_mod.load({"ITO_NAMESPACE": namespace}))
        try:
            h = EntitlementHandlers(BookingStore(r, keys), b"k", 60)
            for version, kind in deliveries:
                await h.on_event(event(booking, kind, version))
            await h.on_event(event(booking, BookingEventKind.completed, 1, account="intruder"))  # foreign: rejected
            return await BookingStore(r, keys).get("acme", booking)
        finally:
            await r.delete(*[k async for k in r.scan_iter(match=f"{namespace}:*")] or ["-"])
            await r.aclose()

    projected = asyncio.run(run())
    if not any(kind is BookingEventKind.completed for _, kind in history):
        assert projected is None  # nothing is projected before upstream completes the booking
        return
    version, kind = max(history)
    assert projected is not None and projected.version == version and projected.state is STATE_AFTER[kind]
    assert projected.topology.gpus_per_node == version % 8 + 1
