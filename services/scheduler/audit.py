"""Record every gate decision of a request and publish it to the JetStream audit stream.

A trail is per request: gates are recorded as they pass or refuse, and the whole trail is
published as one message (an AuditRecord) when the request ends, whatever the outcome. Decisions carry codes, never messages,
so no secret can ride along.
"""

import logging
from collections.abc import Awaitable
from datetime import UTC, datetime
from typing import NoReturn, TypeVar

import msgspec
from faststream.nats import NatsBroker
from nats.js.api import ConsumerConfig, DeliverPolicy

from contracts import subjects
from contracts.api import Action
from contracts.audit import AuditRecord, GateDecision
from runtime.configuration.settings import Settings
from runtime.messaging.bus import Bus
from runtime.messaging.codec import Refusal
from runtime.messaging.publishing import MSG_ID_HEADER

T = TypeVar("T")
log = logging.getLogger("ito.scheduler.audit")
MAX_DECISIONS_READ = 500
_record_decoder = msgspec.json.Decoder(AuditRecord)
_decision_decoder = msgspec.json.Decoder(GateDecision)


def indexed_decisions(data: bytes, headers: dict[str, str] | None) -> list[tuple[int, GateDecision]]:
    """One stored audit message's decisions with their index in the request: a record holds them
    all in order; a message written before records holds one, its index in its message id."""
    try:
        return list(enumerate(_record_decoder.decode(data).decisions))
    except msgspec.ValidationError:
        index = int((headers or {}).get(MSG_ID_HEADER, ":0").rsplit(":", 1)[1])
        return [(index, _decision_decoder.decode(data))]


class Trail:
    def __init__(self, request_id: str, account: str, action: Action, booking_id: str | None) -> None:
        self.request_id = request_id
        self.account = account
        self.action = action
        self.booking_id = booking_id
        self.digest: str | None = None
        self.decisions: list[GateDecision] = []

    def record(self, gate: str, ok: bool, code: str | None = None) -> None:
        self.decisions.append(
            GateDecision(
                request_id=self.request_id,
                at=datetime.now(UTC),
                account=self.account,
                action=self.action,
                gate=gate,
                ok=ok,
                code=code,
                booking_id=self.booking_id,
                manifest_digest=self.digest,
            )
        )

    async def gate(self, name: str, awaitable: Awaitable[T]) -> T:
        try:
            result = await awaitable
        except Refusal as refusal:
            self.record(name, False, refusal.code.value)
            raise
        self.record(name, True)
        return result

    def refuse(self, name: str, refusal: Refusal) -> NoReturn:
        """Record a failed synchronous gate and raise its refusal."""
        self.record(name, False, refusal.code.value)
        raise refusal

    def check(self, name: str, refusal: Refusal | None) -> None:
        """Record a synchronous gate; raise its refusal if it has one."""
        self.record(name, refusal is None, None if refusal is None else refusal.code.value)
        if refusal is not None:
            raise refusal


class Auditor:
    def __init__(self, bus: Bus, broker: NatsBroker, settings: Settings) -> None:
        self.bus = bus
        self.broker = broker  # its connection reads the stream back (`read`)
        self.settings = settings

    async def publish(self, trail: Trail) -> None:
        """All of a trail's decisions in one message, with the request id as its dedup id."""
        if not trail.decisions:
            return
        try:
            await self.bus.publish_once(
                self.settings.subject(f"{subjects.AUDIT}.{trail.request_id}"),
                self.settings.stream(subjects.STREAM_AUDIT),
                msgspec.json.encode(AuditRecord(request_id=trail.request_id, decisions=trail.decisions)),
                trail.request_id,
                self.settings.request_timeout_s,
            )
        except Exception:  # the request's outcome stands; the gap is logged, not hidden
            log.error("audit: the decisions of request %s were not published", trail.request_id)

    async def read(self, request_id: str) -> list[GateDecision]:
        """A request's decisions in the order they were made. A stream written before one record
        per request holds one decision per message, indexed by its message id: read both."""
        nc = await self.broker.connect()
        js = nc.jetstream(timeout=self.settings.request_timeout_s)
        sub = await js.pull_subscribe(
            self.settings.subject(f"{subjects.AUDIT}.{request_id}"),
            stream=self.settings.stream(subjects.STREAM_AUDIT),
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL, inactive_threshold=30.0),
        )
        indexed: list[tuple[int, GateDecision]] = []
        try:
            while len(indexed) < MAX_DECISIONS_READ:
                try:
                    msgs = await sub.fetch(batch=100, timeout=0.3)
                except TimeoutError:
                    break
                for m in msgs:
                    indexed += indexed_decisions(m.data, m.headers)
                    await m.ack()
        finally:
            await sub.unsubscribe()
        return [d for _, d in sorted(indexed, key=lambda pair: pair[0])]
