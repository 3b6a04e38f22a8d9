"""Property: whatever order, duplication or redelivery upstream events arrive in, the projection
equals the event with the highest version, once the booking's `completed` has been seen."""

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contracts.booking import BookingEvent, BookingEventKind, Fabric, Topology
from runtime.configuration.keys import Keys
from services.entitlement.handlers import EntitlementHandlers
from services.entitlement.projection import STATE_AFTER
from services.entitlement.store import BookingStore
from tests.conftest import start_infra

KINDS = list(BookingEventKind)
NOW = datetime.now(UTC)


def event(booking: str, kind: BookingEventKind, version: int, account: str = "acme") -> BookingEvent:
    return BookingEvent(
        event_id=uuid.uuid4().hex,
        kind=kind,
        booking_id=booking,
        account=account,
        version=version,
        topology=Topology(nodes=1, gpus_per_node=version % 8 + 1, gpu_model="H200", gpu_memory_gb=141),
        region="r",
        fabric=Fabric.roce,
        window_start=NOW,
        window_end=NOW + timedelta(hours=1),
        emitted_at=NOW,
    )


# a history: distinct versions each with a kind; delivered in any order, some twice
histories = st.lists(
    st.tuples(st.integers(1, 50), st.sampled_from(KINDS)), min_size=1, max_size=12, unique_by=lambda t: t[0]
)


@pytest.fixture(scope="module")
def projection_redis(tmp_path_factory):
    i = start_infra(tmp_path_factory.mktemp("projection"), "prop", nats=False)
    yield i
    i.stop()


@settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(history=histories, data=st.data())
def test_projection_is_the_last_event_by_version(projection_redis, history, data):
    deliveries = data.draw(
        st.permutations(history + data.draw(st.lists(st.sampled_from(history), max_size=4)))
    )
    booking = "b-" + uuid.uuid4().hex[:6]

    async def run():
        r = projection_redis.redis("entitlement")  # the entitlement service's own ACL user
        admin = projection_redis.redis("admin")
        keys = Keys(projection_redis.settings)
        try:
            h = EntitlementHandlers(BookingStore(r, keys), b"k", 60)
            for version, kind in deliveries:
                await h.on_event(event(booking, kind, version))
            await h.on_event(
                event(booking, BookingEventKind.completed, 1, account="intruder")
            )  # foreign: rejected
            return await BookingStore(r, keys).get("acme", booking)
        finally:
            await admin.delete(*[k async for k in admin.scan_iter(match="prop:*")] or ["-"])
            await r.aclose()
            await admin.aclose()

    projected = asyncio.run(run())
    if not any(kind is BookingEventKind.completed for _, kind in history):
        assert projected is None  # nothing is projected before upstream completes the booking
        return
    version, kind = max(history)
    assert projected is not None and projected.version == version and projected.state is STATE_AFTER[kind]
    assert projected.topology.gpus_per_node == version % 8 + 1
