"""Bounded request/reply calls from the scheduler to entitlement, confirmation and ledger.

A service that does not answer in time is `backend_unavailable`: the request fails closed and
nothing that depends on the answer is done. There is no path on which silence means "allow".
"""

import hashlib
import hmac
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar, cast

import msgspec

from contracts import endpoints, subjects
from contracts.api import Action, CleanupOrder, CleanupResult, ConfirmationIssued
from contracts.endpoints import Endpoint
from contracts.errors import ErrorCode
from contracts.exports import DownloadChunk, DownloadOrder, ExportOrder, ExportView, SampleOrder, SampleResult
from contracts.internal import (
    BookingRelease,
    BookingsAnswer,
    BookingsQuery,
    ConfirmationCreate,
    ConfirmationResolve,
    EligibilityBody,
    EligibilityQuery,
    EligibilityStatement,
    LedgerAccept,
    LedgerEntry,
    LedgerHandedOff,
    LedgerLookup,
    LedgerPending,
    Outstanding,
    OutstandingQuery,
)
from contracts.manifest import Manifest
from runtime.configuration.settings import Settings
from runtime.messaging import bus, codec
from runtime.messaging.bus import Bus
from runtime.messaging.codec import Refusal
from runtime.security.order_signatures import Signer

T = TypeVar("T")
CLEANUP_TIMEOUT_S = 30.0  # removing a large checkpoint tree takes longer than one control hop
EXPORT_TIMEOUT_S = 30.0  # an export order only looks and starts a job; the job itself runs in the background
DOWNLOAD_TIMEOUT_S = 30.0  # one chunk (DOWNLOAD_CHUNK_MAX) read from the shared storage
SAMPLE_TIMEOUT_S = 60.0  # loading a checkpoint and generating up to 512 tokens on the trainer's CPU
CLOCK_SKEW = timedelta(seconds=5)  # hosts' clocks may differ a little; never stretches expires_at


def verify_statement(
    stmt: EligibilityStatement, key: bytes, account: str, booking_id: str, now: datetime
) -> EligibilityBody:
    """The statement's body when the entitlement service issued it for this request and it is fresh."""
    expected = hmac.new(key, msgspec.json.encode(stmt.body), hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, stmt.signature):
        raise Refusal(ErrorCode.eligibility_stale, "the eligibility statement's signature does not verify")
    body = stmt.body
    if body.account != account or body.booking_id != booking_id:
        raise Refusal(
            ErrorCode.eligibility_stale, "the eligibility statement is for another account or booking"
        )
    if not body.issued_at - CLOCK_SKEW <= now < body.expires_at:
        raise Refusal(ErrorCode.eligibility_stale, "the eligibility statement is not fresh")
    return body


class Peers:
    """The scheduler's client for its peer services (entitlement, confirmation, ledger, the work
    queue): every call bounded, signed, and answered with a typed value or a refusal."""

    def __init__(self, bus: Bus, settings: Settings, entitlement_key: bytes, signer: Signer) -> None:
        self.bus = bus
        self.settings = settings
        self._key = entitlement_key
        self.signer = signer  # every order and internal request carries the scheduler's signature

    async def _call(
        self,
        endpoint: Endpoint[Any, T],
        request: msgspec.Struct,
        service: str,
        timeout: float | None = None,
    ) -> T:
        """The endpoint's typed answer, or the refusal it carries; `backend_unavailable` when
        nobody answers in time."""
        body, subject = codec.encode(request), self.settings.subject(endpoint.subject)
        raw = await bus.call(
            self.bus,
            subject,
            body,
            self.signer.headers(subject, body),
            timeout or self.settings.request_timeout_s,
            service,
        )
        return cast(T, codec.unwrap(raw, endpoint.answer))

    async def eligibility(self, account: str, booking_id: str, manifest: Manifest) -> EligibilityStatement:
        r = manifest.resources
        query = EligibilityQuery(
            account=account,
            booking_id=booking_id,
            nodes=r.nodes,
            gpus_per_node=r.gpus_per_node,
            region=r.region,
            fabric=r.fabric,
        )
        return await self._call(endpoints.ELIGIBILITY, query, "entitlement")

    async def verified_eligibility(
        self, account: str, booking_id: str, manifest: Manifest
    ) -> EligibilityBody:
        stmt = await self.eligibility(account, booking_id, manifest)
        return verify_statement(stmt, self._key, account, booking_id, datetime.now(UTC))

    def still_fresh(self, body: EligibilityBody, now: datetime) -> bool:
        return now < body.expires_at

    async def bookings(self, account: str) -> BookingsAnswer:
        return await self._call(endpoints.BOOKINGS, BookingsQuery(account=account), "entitlement")

    async def create_confirmation(self, req: ConfirmationCreate) -> ConfirmationIssued:
        return await self._call(endpoints.CONFIRMATION_CREATE, req, "confirmation")

    async def outstanding_confirmations(self, account: str) -> Outstanding:
        return await self._call(
            endpoints.CONFIRMATION_OUTSTANDING, OutstandingQuery(account=account), "confirmation"
        )

    async def resolve_confirmation(
        self, account: str, ref: str, action: Action, target: str, digest: str | None, cost: float | None
    ) -> ConfirmationIssued:
        req = ConfirmationResolve(
            account=account,
            confirmation_ref=ref,
            action=action,
            target=target,
            manifest_digest=digest,
            cost_usd=cost,
        )
        return await self._call(endpoints.CONFIRMATION_RESOLVE, req, "confirmation")

    async def ledger_lookup(self, account: str, key: str) -> LedgerEntry | None:
        """The entry, or None when the key is unknown."""
        return await self._call(
            endpoints.LEDGER_LOOKUP, LedgerLookup(account=account, idempotency_key=key), "ledger"
        )

    async def ledger_accept(self, req: LedgerAccept) -> LedgerEntry:
        return await self._call(endpoints.LEDGER_ACCEPT, req, "ledger")

    async def ledger_handed_off(self, account: str, key: str) -> LedgerEntry:
        return await self._call(
            endpoints.LEDGER_HANDED_OFF, LedgerHandedOff(account=account, idempotency_key=key), "ledger"
        )

    async def ledger_pending(self, older_than_s: float) -> list[LedgerEntry]:
        answer = await self._call(
            endpoints.LEDGER_PENDING, LedgerPending(older_than_s=older_than_s), "ledger"
        )
        return answer.entries

    async def trainer_cleanup(self, order: CleanupOrder) -> CleanupResult:
        return await self._call(endpoints.TRAINER_CLEANUP, order, "trainer", timeout=CLEANUP_TIMEOUT_S)

    async def trainer_export(self, order: ExportOrder) -> ExportView:
        return await self._call(endpoints.TRAINER_EXPORT, order, "trainer", timeout=EXPORT_TIMEOUT_S)

    async def trainer_download(self, order: DownloadOrder) -> DownloadChunk:
        return await self._call(endpoints.TRAINER_DOWNLOAD, order, "trainer", timeout=DOWNLOAD_TIMEOUT_S)

    async def trainer_sample(self, order: SampleOrder) -> SampleResult:
        return await self._call(endpoints.TRAINER_SAMPLE, order, "trainer", timeout=SAMPLE_TIMEOUT_S)

    async def notify_cancel(self, run_id: str) -> None:
        """Core NATS, fire and forget: trainers also poll the lease, so a lost notice only delays."""
        subject = self.settings.subject(f"{subjects.CONTROL_CANCEL}.{run_id}")
        await self.bus.publish(subject, b"{}", self.signer.headers(subject, b"{}"))

    async def request_release(self, account: str, booking_id: str, run_id: str) -> None:
        body = msgspec.json.encode(BookingRelease(account=account, booking_id=booking_id, run_id=run_id))
        subject = self.settings.subject(subjects.BOOKING_RELEASE_REQUESTS)
        await self.bus.publish(subject, body, self.signer.headers(subject, body))

    async def publish_work(self, run_id: str, work: bytes, msg_id: str) -> None:
        """A work item for the trainer's queue, signed, with its dedup id (hand-offs and approved
        restarts alike)."""
        subject = self.settings.subject(f"{subjects.WORK_TRAIN}.{run_id}")
        await self.bus.publish_once(
            subject,
            self.settings.stream(subjects.STREAM_WORK),
            work,
            msg_id,
            self.settings.request_timeout_s,
            self.signer.headers(subject, work),
        )
