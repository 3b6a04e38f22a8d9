"""Publish an ito-compute booking event exactly as upstream would (demos and tests)."""

import time
import uuid
from datetime import UTC, datetime, timedelta

import msgspec

from contracts import subjects
from contracts.booking import BookingEvent, BookingEventKind, Fabric, Topology
from runtime.configuration.settings import Settings
from runtime.messaging.publishing import headers_for

GPU_MEMORY_GB = {"H200": 141, "H100": 80, "A100": 80, "L40S": 48}


def event(
    *,
    account: str,
    booking: str,
    kind: str,
    nodes: int,
    gpus_per_node: int,
    gpu_model: str,
    region: str,
    fabric: str,
    hours: float,
    version: int | None = None,
    start: datetime | None = None,
) -> BookingEvent:
    now = datetime.now(UTC)
    start = start or now - timedelta(minutes=1)
    return BookingEvent(
        event_id=str(uuid.uuid4()),
        kind=BookingEventKind(kind),
        booking_id=booking,
        account=account,
        version=version if version is not None else time.time_ns() // 1000,  # grows with every change
        topology=Topology(
            nodes=nodes,
            gpus_per_node=gpus_per_node,
            gpu_model=gpu_model,
            gpu_memory_gb=GPU_MEMORY_GB.get(gpu_model, 80),
        ),
        region=region,
        fabric=Fabric(fabric),
        window_start=start,
        window_end=start + timedelta(hours=hours),
        emitted_at=now,
    )


async def publish(settings: Settings, ev: BookingEvent) -> dict:
    from devstack.authority import connect
    from runtime.security.identities import COMPUTE

    nc = await connect(settings, COMPUTE, allow_reconnect=False)  # ito-compute's own identity
    try:
        js = nc.jetstream(timeout=settings.request_timeout_s)
        ack = await js.publish(
            settings.subject(f"{subjects.BOOKING_EVENTS}.{ev.kind.value}"),
            msgspec.json.encode(ev),
            headers=headers_for(ev.event_id),
        )
    finally:
        await nc.close()
    return {
        "event_id": ev.event_id,
        "booking_id": ev.booking_id,
        "kind": ev.kind.value,
        "version": ev.version,
        "stream": ack.stream,
        "seq": ack.seq,
        "duplicate": bool(ack.duplicate),
    }
