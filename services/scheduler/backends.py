"""Bounded request/reply calls from the scheduler to entitlement, confirmation and ledger.

A service that does not answer in time is `backend_unavailable`: the request fails closed and
nothing that depends on the answer is done. There is no path on which silence means "allow".
"""

import hashlib
import hmac
from datetime import UTC, datetime, timedelta
from typing import TypeVar

import msgspec
from faststream.nats import NatsBroker
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from contracts import subjects
from contracts.api import Action, CleanupOrder, CleanupResult, ConfirmationIssued
from contracts.errors import ErrorCode
from contracts.internal import (
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
    LedgerPendingAnswer,
)
from contracts.manifest import Manifest
from services.runtime import codec
from services.runtime.codec import Refusal
from services.runtime.publishing import publish_once
from services.runtime.settings import Settings
from services.runtime.signing import Signer

T = TypeVar("T")
CLEANUP_TIMEOUT_S = 30.0  # removing a large checkpoint tree takes longer than one control hop
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


class Backends:
    def __init__(
        self, broker: NatsBroker, settings: Settings, entitlement_key: bytes, signer: Signer
    ) -> None:
        self.broker = broker
        self.settings = settings
        self._key = entitlement_key
        self.signer = signer  # every order and internal request carries the scheduler's signature

    async def _call(
        self,
        suffix: str,
        request: msgspec.Struct,
        data_type: type[T],
        service: str,
        timeout: float | None = None,
    ) -> T:
        return codec.unwrap(await self._request(suffix, request, service, timeout), data_type)

    async def _request(
        self, suffix: str, request: msgspec.Struct, service: str, timeout: float | None = None
    ) -> bytes:
        """The signed request's raw reply; `backend_unavailable` when nobody answers in time."""
        body, subject = codec.encode(request), self.settings.subject(suffix)
        try:
            reply = await self.broker.request(
                body,
                subject,
                headers=self.signer.headers(subject, body),
                timeout=timeout or self.settings.request_timeout_s,
            )
        except (NoRespondersError, NatsTimeout, TimeoutError):
            raise Refusal(
                ErrorCode.backend_unavailable, f"the {service} service did not answer in time"
            ) from None
        return bytes(reply.body)

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
        return await self._call(subjects.ENTITLEMENT_ELIGIBILITY, query, EligibilityStatement, "entitlement")

    async def verified_eligibility(
        self, account: str, booking_id: str, manifest: Manifest
    ) -> EligibilityBody:
        stmt = await self.eligibility(account, booking_id, manifest)
        return verify_statement(stmt, self._key, account, booking_id, datetime.now(UTC))

    def still_fresh(self, body: EligibilityBody, now: datetime) -> bool:
        return now < body.expires_at

    async def bookings(self, account: str) -> BookingsAnswer:
        return await self._call(
            subjects.ENTITLEMENT_BOOKINGS, BookingsQuery(account=account), BookingsAnswer, "entitlement"
        )

    async def create_confirmation(self, req: ConfirmationCreate) -> ConfirmationIssued:
        return await self._call(subjects.CONFIRMATION_CREATE, req, ConfirmationIssued, "confirmation")

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
        return await self._call(subjects.CONFIRMATION_RESOLVE, req, ConfirmationIssued, "confirmation")

    async def ledger_lookup(self, account: str, key: str) -> LedgerEntry | None:
        raw = await self._request(
            subjects.LEDGER_LOOKUP, LedgerLookup(account=account, idempotency_key=key), "ledger"
        )
        data = codec.unwrap(raw, object)  # the entry, or None when the key is unknown
        return None if data is None else msgspec.convert(data, LedgerEntry)

    async def ledger_accept(self, req: LedgerAccept) -> LedgerEntry:
        return await self._call(subjects.LEDGER_ACCEPT, req, LedgerEntry, "ledger")

    async def ledger_handed_off(self, account: str, key: str) -> LedgerEntry:
        return await self._call(
            subjects.LEDGER_HANDED_OFF,
            LedgerHandedOff(account=account, idempotency_key=key),
            LedgerEntry,
            "ledger",
        )

    async def ledger_pending(self, older_than_s: float) -> list[LedgerEntry]:
        answer = await self._call(
            subjects.LEDGER_PENDING, LedgerPending(older_than_s=older_than_s), LedgerPendingAnswer, "ledger"
        )
        return answer.entries

    async def trainer_cleanup(self, order: CleanupOrder) -> CleanupResult:
        return await self._call(
            subjects.TRAINER_CLEANUP, order, CleanupResult, "trainer", timeout=CLEANUP_TIMEOUT_S
        )

    async def notify_cancel(self, run_id: str) -> None:
        """Core NATS, fire and forget: trainers also poll the lease, so a lost notice only delays."""
        subject = self.settings.subject(f"{subjects.CONTROL_CANCEL}.{run_id}")
        await self.broker.publish(b"{}", subject, headers=self.signer.headers(subject, b"{}"))

    async def request_release(self, account: str, booking_id: str, run_id: str) -> None:
        body = msgspec.json.encode({"account": account, "booking_id": booking_id, "run_id": run_id})
        subject = self.settings.subject(subjects.BOOKING_RELEASE_REQUESTS)
        await self.broker.publish(body, subject, headers=self.signer.headers(subject, body))

    async def publish_work(self, run_id: str, work: bytes, msg_id: str) -> None:
        """A work item for the trainer's queue (an approved restart; hand-offs go through Handoff)."""
        subject = self.settings.subject(f"{subjects.WORK_TRAIN}.{run_id}")
        await publish_once(
            self.broker,
            self.settings,
            subject=subject,
            stream=subjects.STREAM_WORK,
            body=work,
            msg_id=msg_id,
            extra_headers=self.signer.headers(subject, work),
        )
