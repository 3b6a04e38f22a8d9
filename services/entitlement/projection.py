"""Pure decisions: how an event changes a booking, and whether a booking allows a training run."""

import enum
from datetime import datetime

from contracts.booking import Booking, BookingEvent, BookingEventKind, BookingState
from contracts.errors import ErrorCode
from contracts.internal import EligibilityQuery

STATE_AFTER: dict[BookingEventKind, BookingState] = {
    BookingEventKind.completed: BookingState.completed,
    BookingEventKind.modified: BookingState.completed,
    BookingEventKind.revoked: BookingState.revoked,
    BookingEventKind.expired: BookingState.expired,
    BookingEventKind.released: BookingState.released,
}


class Outcome(enum.StrEnum):
    """What applying a projected booking did (the store's Lua script returns the same words)."""

    applied = "applied"
    duplicate = "duplicate"  # the same version again: a redelivery
    stale = "stale"  # an older version: ignored


def apply_outcome(current: int | None, version: int) -> Outcome:
    """Only a newer version is written; the projection never goes back."""
    if current is None or version > current:
        return Outcome.applied
    return Outcome.duplicate if version == current else Outcome.stale


def project(event: BookingEvent) -> Booking:
    return Booking(
        booking_id=event.booking_id,
        account=event.account,
        state=STATE_AFTER[event.kind],
        version=event.version,
        topology=event.topology,
        region=event.region,
        fabric=event.fabric,
        window_start=event.window_start,
        window_end=event.window_end,
        updated_at=event.emitted_at,
    )


def eligibility(
    booking: Booking | None, query: EligibilityQuery, now: datetime, parked: bool = False
) -> tuple[ErrorCode, str] | None:
    """None when the booking allows this run; else the refusal. Unknown and foreign look alike."""
    if booking is None or booking.account != query.account:
        if parked and booking is None:
            return ErrorCode.booking_incomplete, "the booking is not completed yet"
        return ErrorCode.booking_not_found, "no such booking for this account"
    if booking.state is BookingState.revoked:
        return ErrorCode.booking_revoked, "the booking was revoked"
    if booking.state is BookingState.released:
        return ErrorCode.booking_released, "the booking was released"
    if booking.state is BookingState.expired or now >= booking.window_end:
        return ErrorCode.booking_expired, "the booking's window is over"
    t = booking.topology
    if query.nodes > t.nodes or query.gpus_per_node > t.gpus_per_node:
        return ErrorCode.booking_mismatch, (
            f"the manifest asks for {query.nodes}x{query.gpus_per_node} GPUs; "
            f"the booking has {t.nodes}x{t.gpus_per_node} {t.gpu_model}"
        )
    if query.region is not None and query.region != booking.region:
        return (
            ErrorCode.booking_mismatch,
            f"the manifest asks for region {query.region}; the booking is in {booking.region}",
        )
    if query.fabric is not None and query.fabric != booking.fabric:
        return (
            ErrorCode.booking_mismatch,
            f"the manifest asks for {query.fabric.value}; the booking has {booking.fabric.value}",
        )
    return None
