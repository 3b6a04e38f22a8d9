"""Requests between services: scheduler -> entitlement, confirmation and ledger.

Every internal reply is an `Envelope` whose `data` decodes into the type named beside each request.
"""

from datetime import datetime

from contracts.api import Action
from contracts.base import Internal
from contracts.booking import Booking, Fabric, Topology


class EligibilityQuery(Internal, frozen=True, kw_only=True):  # -> EligibilityStatement
    account: str
    booking_id: str
    nodes: int
    gpus_per_node: int
    region: str | None = None
    fabric: Fabric | None = None


class EligibilityBody(Internal, frozen=True, kw_only=True):
    account: str
    booking_id: str
    booking_version: int
    topology: Topology
    region: str
    fabric: Fabric
    window_start: datetime
    window_end: datetime
    issued_at: datetime
    expires_at: datetime


class EligibilityStatement(Internal, frozen=True, kw_only=True):
    """`body` signed by the entitlement service: HMAC-SHA256 over msgspec's JSON of `body`."""

    body: EligibilityBody
    signature: str  # hex


class BookingsQuery(Internal, frozen=True, kw_only=True):  # -> list[Booking]
    account: str


class BookingsAnswer(Internal, frozen=True, kw_only=True):
    bookings: list[Booking]


class ConfirmationCreate(Internal, frozen=True, kw_only=True):  # -> ConfirmationIssued
    account: str
    action: Action
    target: str
    manifest_digest: str | None = None
    max_cost_usd: float | None = None


class OutstandingQuery(Internal, frozen=True, kw_only=True):  # -> Outstanding
    account: str


class Outstanding(Internal, frozen=True, kw_only=True):
    """An account's confirmations issued and neither consumed nor expired, and its limit."""

    confirmations: int
    limit: int


# -> ConfirmationIssued (checks the binding, consumes nothing)
class ConfirmationResolve(Internal, frozen=True, kw_only=True):
    account: str
    confirmation_ref: str
    action: Action
    target: str
    manifest_digest: str | None = None
    cost_usd: float | None = None


class LedgerLookup(Internal, frozen=True, kw_only=True):  # -> LedgerEntry | None
    account: str
    idempotency_key: str


class LedgerEntry(Internal, frozen=True, kw_only=True):
    account: str
    idempotency_key: str
    fingerprint: str
    run_id: str
    action: Action
    handed_off: bool
    created_at: datetime
    work: bytes = b""  # the encoded hand-off message, so a reconciler can finish a lost hand-off
    # The cost bound of the confirmation the accept consumed (what the person authorised the run to
    # spend), recorded by the ledger's accept script; the hand-off writes it into the work item.
    # Last, and null until the script fills it in (services/ledger/store.py).
    cost_bound_usd: float | None = None


class LedgerAccept(Internal, frozen=True, kw_only=True):  # -> LedgerEntry (fresh or existing on replay)
    """Atomically: consume the confirmation (re-checking its binding) and reserve the key."""

    account: str
    idempotency_key: str
    fingerprint: str
    run_id: str
    action: Action
    confirmation_ref: str
    target: str
    manifest_digest: str | None = None
    cost_usd: float | None = None
    work: bytes = b""


class LedgerHandedOff(Internal, frozen=True, kw_only=True):  # -> LedgerEntry
    account: str
    idempotency_key: str


class LedgerPending(Internal, frozen=True, kw_only=True):  # -> LedgerPendingAnswer
    """Accepted runs whose hand-off to the trainer is not confirmed, older than `older_than_s`."""

    older_than_s: float


class LedgerPendingAnswer(Internal, frozen=True, kw_only=True):
    entries: list[LedgerEntry]


class Health(Internal, frozen=True, kw_only=True):
    service: str
    ok: bool


class HealthQuery(Internal, frozen=True, kw_only=True):  # -> Health
    """`v1.health.<service>`: is the service subscribed, connected and its store answering?"""


class BookingRelease(Internal, frozen=True, kw_only=True):
    """scheduler -> ito-compute (`compute.v1.requests.release`, core NATS): release this booking,
    confirmed separately by its owner, after this run's cleanup."""

    account: str
    booking_id: str
    run_id: str
