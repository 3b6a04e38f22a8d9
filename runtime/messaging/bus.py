"""Core request/reply, served and called on nats-py directly.

A service's endpoints are plain async functions of a typed request (contracts/endpoints.py names
each one's request and answer types). A `Router` holds them: it checks who may call (the
scheduler's signature on internal endpoints; the account the NATS server authenticated on API
endpoints, whose answer must go to that account's own inbox), decodes the request at the edge,
calls the handler and turns the outcome into the Envelope (`codec.answer`, the one place a refusal
becomes an envelope). With a `ServiceMetrics` it also times each answer and counts each refusal by
its code (runtime/messaging/metrics.py), through children made once per endpoint. `serve`
subscribes a router's subjects on a nats-py connection in a queue group, with a bounded number of
handlers running at once; tests call `Router.handle` with no broker at all.

The `Bus` port is what a service sends with: a request awaiting its reply, a core publish, and a
JetStream publish with its dedup id (`NatsBus` on nats-py; FastStream stays for the JetStream
consumers, where its acking and retry policies earn their place).
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from contracts.endpoints import Endpoint
from contracts.errors import ErrorCode
from runtime.messaging import codec
from runtime.messaging.codec import Refusal
from runtime.messaging.publishing import headers_for
from runtime.security.identities import tenant_inbox
from runtime.security.order_signatures import Verifier

if TYPE_CHECKING:  # the request path needs only the children it is handed; the CLIs no FastStream
    from faststream.nats import NatsBroker

    from runtime.messaging.metrics import EndpointStats, ServiceMetrics

log = logging.getLogger("ito.bus")

REQUEST_CONCURRENCY = 64
"""Handlers one service runs at once; a message beyond that waits in the subscription's queue."""
PENDING_LIMIT = 65536  # messages a subscription buffers before the server sees it as a slow consumer

Handler = Callable[[Any], Awaitable[Any]]
TenantHandler = Callable[[str, Any], Awaitable[Any]]


Answer = tuple[bytes, ErrorCode | None]
"""An envelope and its refusal's code (None: ok), as `codec.answer_coded` builds them."""


@dataclass(slots=True)
class _Route:
    handler: Callable[[bytes, str], Awaitable[Answer]]  # (body, the subject's last token) -> envelope
    verifier: Verifier | None  # internal: the scheduler's signature is required (None: not checked)
    tenant: bool  # an API verb: the last subject token is the authenticated caller's account
    reply_prefix: str = ""  # internal: answered only to replies under this inbox ("" = any)
    stats: "EndpointStats | None" = None  # its latency and refusals (None: not counted)


@dataclass(slots=True)
class Router:
    """Endpoints by full subject (an API verb's subject without its account token)."""

    namespace: str
    routes: dict[str, _Route] = field(default_factory=dict)
    metrics: "ServiceMetrics | None" = None
    """Where each endpoint's latency and refusals are counted; None: nowhere (tests, bench)."""

    def _subject(self, suffix: str) -> str:
        return f"{self.namespace}.{suffix}"

    def serve(
        self,
        endpoint: Endpoint,
        handler: Handler,
        verifier: Verifier | None = None,
        reply_prefix: str = "",
    ) -> None:
        """An internal endpoint; with a verifier only what the scheduler signed (recently) is
        answered; with a `reply_prefix` only a request whose answer goes to that inbox (one
        identity's: the server lets nobody else subscribe there) is answered at all."""
        decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(endpoint.request)

        async def call(body: bytes, _last: str) -> Answer:
            return await codec.answer_coded(handler, body, decoder)

        self._add(
            self._subject(endpoint.subject), _Route(call, verifier, tenant=False, reply_prefix=reply_prefix)
        )

    def serve_tenant(self, endpoint: Endpoint, handler: TenantHandler) -> None:
        """An API verb on `<ns>.<verb>.<account>`, called as handler(account, request)."""
        decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(endpoint.request)

        async def call(body: bytes, account: str) -> Answer:
            return await codec.answer_coded(lambda req: handler(account, req), body, decoder)

        self._add(self._subject(endpoint.subject), _Route(call, None, tenant=True))

    def _add(self, subject: str, route: _Route) -> None:
        if subject in self.routes:
            raise ValueError(f"{subject} is served twice")
        if self.metrics is not None:
            route.stats = self.metrics.endpoint(self.namespace, subject)
        self.routes[subject] = route

    def subscriptions(self) -> list[str]:
        return sorted(s + ".*" if r.tenant else s for s, r in self.routes.items())

    async def handle(
        self, subject: str, body: bytes, reply: str = "", headers: Mapping[str, str] | None = None
    ) -> bytes | None:
        """The envelope to answer with, or None when nothing may be answered (the request is
        then not acted on either)."""
        route = self.routes.get(subject)
        if route is not None and not route.tenant:
            if route.reply_prefix and not reply.startswith(route.reply_prefix):
                log.warning(
                    "a request on %s asked for its answer outside %s; unanswered", subject, route.reply_prefix
                )
                if route.stats is not None:
                    route.stats.unanswered()
                return None
            started = time.perf_counter()
            if route.verifier is not None and not route.verifier.valid(subject, body, dict(headers or {})):
                log.warning("refused an unsigned or stale request on %s", subject)
                answer: Answer = (
                    codec.fail(ErrorCode.forbidden, "only the scheduler may call this service"),
                    ErrorCode.forbidden,
                )
            else:
                answer = await route.handler(body, "")
            return _counted(route, answer, started)
        prefix, _, account = subject.rpartition(".")
        route = self.routes.get(prefix)
        if route is None or not route.tenant:
            return None
        # The server does not check reply subjects: another tenant could aim our answer at a victim.
        if reply and not reply.startswith(tenant_inbox(account) + "."):
            log.warning("a request of account %s asked for its answer in another inbox; unanswered", account)
            if route.stats is not None:
                route.stats.unanswered()
            return None
        started = time.perf_counter()
        return _counted(route, await route.handler(body, account), started)


def _counted(route: _Route, answer: Answer, started: float) -> bytes:
    if route.stats is not None:
        route.stats.observe(time.perf_counter() - started, answer[1])
    return answer[0]


INSTANCE_HEADER = "Ito-Instance"
"""On every answer of a named instance (`up --cluster`): which of a service's instances answered."""


async def serve(
    nc: NatsClient, router: Router, queue: str, limit: int = REQUEST_CONCURRENCY, instance: str = ""
) -> list[Any]:
    """Subscribe every route of `router` in queue group `queue` (several instances share the
    load); at most `limit` handlers run at once, the rest wait in the subscription. A named
    `instance` says so in a header of each answer (the envelope stays the same)."""
    slots = asyncio.Semaphore(limit)
    running: set[asyncio.Task] = set()
    if router.metrics is not None:
        router.metrics.in_flight(lambda: len(running))

    async def one(msg: Msg) -> None:
        try:
            answer = await router.handle(msg.subject, msg.data, msg.reply, msg.headers)
            if answer is not None and msg.reply:
                # as Msg.respond does (the request's headers come back), plus the instance's name
                headers = {**(msg.headers or {}), INSTANCE_HEADER: instance} if instance else msg.headers
                await nc.publish(msg.reply, answer, headers=headers)
        except Exception:  # a dropped connection mid-answer: the caller times out and asks again
            log.exception("answering %s failed", msg.subject)
        finally:
            slots.release()

    async def dispatch(msg: Msg) -> None:
        await slots.acquire()  # back-pressure: the subscription stops taking messages at the limit
        task = asyncio.create_task(one(msg))
        running.add(task)
        task.add_done_callback(running.discard)

    subs = [
        await nc.subscribe(subject, queue=queue, cb=dispatch, pending_msgs_limit=PENDING_LIMIT)
        for subject in router.subscriptions()
    ]
    await nc.flush()
    return subs


class Bus(Protocol):
    """What a service sends with."""

    async def request(
        self, subject: str, body: bytes, headers: dict[str, str] | None, timeout: float
    ) -> bytes:
        """The reply's bytes; `NoAnswer` when nobody answered in time."""
        ...

    async def publish(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        """Core NATS, fire and forget."""
        ...

    async def publish_once(
        self,
        subject: str,
        stream: str,
        body: bytes,
        msg_id: str,
        timeout: float,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        """A JetStream publish with its dedup id (`Nats-Msg-Id`), its PubAck awaited."""
        ...


class NoAnswer(Exception):
    """Nobody answered in time (no responders, or a timeout): the caller fails closed."""


class NatsBus:
    """The Bus on the broker's own nats-py connection (one connection per service)."""

    def __init__(self, broker: "NatsBroker") -> None:
        self.broker = broker
        self._nc: NatsClient | None = None

    async def client(self) -> NatsClient:
        if self._nc is None:
            self._nc = await self.broker.connect()
        return self._nc

    async def request(
        self, subject: str, body: bytes, headers: dict[str, str] | None, timeout: float
    ) -> bytes:
        nc = await self.client()
        try:
            reply = await nc.request(subject, body, timeout=timeout, headers=headers)
        except (NoRespondersError, NatsTimeout, TimeoutError):
            raise NoAnswer(subject) from None
        return reply.data

    async def publish(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        await (await self.client()).publish(subject, body, headers=headers)

    async def publish_once(
        self,
        subject: str,
        stream: str,
        body: bytes,
        msg_id: str,
        timeout: float,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        js = (await self.client()).jetstream(timeout=timeout)
        await js.publish(subject, body, timeout=timeout, stream=stream, headers=headers_for(msg_id, headers))


async def call(
    bus: Bus, subject: str, body: bytes, headers: dict[str, str] | None, timeout: float, service: str
) -> bytes:
    """A request whose silence is `backend_unavailable` (fails closed, never "allow")."""
    try:
        return await bus.request(subject, body, headers, timeout)
    except NoAnswer:
        raise Refusal(
            ErrorCode.backend_unavailable, f"the {service} service did not answer in time"
        ) from None


class LocalBus:
    """The Bus in one process, for handler tests: a request goes straight to a Router (no broker,
    no connection); publishes go to `broker` (FastStream's in-memory TestNatsBroker hands stream
    messages to the JetStream consumers registered on it)."""

    def __init__(self, router: Router, broker: "NatsBroker") -> None:
        self.router = router
        self.broker = broker

    async def request(
        self, subject: str, body: bytes, headers: dict[str, str] | None, timeout: float
    ) -> bytes:
        try:
            answer = await asyncio.wait_for(self.router.handle(subject, body, "", headers), timeout)
        except TimeoutError:
            raise NoAnswer(subject) from None
        if answer is None:
            raise NoAnswer(subject)
        return answer

    async def publish(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        await self.broker.publish(body, subject, headers=headers)

    async def publish_once(
        self,
        subject: str,
        stream: str,
        body: bytes,
        msg_id: str,
        timeout: float,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        await self.broker.publish(
            body, subject, stream=stream, headers=headers_for(msg_id, headers), timeout=timeout
        )
