"""Booking events as ito-compute publishes them, and the projection the entitlement service keeps."""

import enum
from datetime import datetime

from contracts.base import Contract, Internal


class BookingEventKind(enum.StrEnum):
    completed = "completed"
    modified = "modified"
    revoked = "revoked"
    expired = "expired"
    released = "released"


class Fabric(enum.StrEnum):
    infiniband = "infiniband"
    roce = "roce"
    ethernet = "ethernet"


class Topology(Contract, frozen=True, kw_only=True):
    nodes: int
    gpus_per_node: int
    gpu_model: str  # e.g. "H200"
    gpu_memory_gb: int


class BookingEvent(Contract, frozen=True, kw_only=True):
    """One upstream change to a booking. `version` grows with every change upstream."""

    event_id: str
    kind: BookingEventKind
    booking_id: str
    account: str
    version: int
    topology: Topology
    region: str
    fabric: Fabric
    window_start: datetime
    window_end: datetime
    emitted_at: datetime


class BookingState(enum.StrEnum):
    completed = "completed"
    revoked = "revoked"
    expired = "expired"
    released = "released"


class Booking(Internal, frozen=True, kw_only=True):
    """The entitlement service's projection of one booking (the last event by version)."""

    booking_id: str
    account: str
    state: BookingState
    version: int
    topology: Topology
    region: str
    fabric: Fabric
    window_start: datetime
    window_end: datetime
    updated_at: datetime
