"""What every service's entry point shares: build a FastStream app with a health answer, serve
request/reply endpoints (internal ones only when the scheduler signed the request; tenant ones
with the account the NATS server authenticated), and close Redis on the way out.

Streams are declared by the operator identity (`ito-training up`), never by a service: services
have no right to create, change, purge or delete a stream."""

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis.asyncio as aioredis
from faststream import FastStream
from faststream.nats import NatsBroker, NatsMessage

from contracts.errors import ErrorCode
from contracts.internal import Health
from contracts.subjects import HEALTH
from services.runtime import codec, connections
from services.runtime.identities import REDIS_SERVICES, service_inbox, tenant_inbox
from services.runtime.keys import Keys
from services.runtime.secrets import Secrets
from services.runtime.settings import Settings
from services.runtime.signing import Verifier

log = logging.getLogger("ito.service")


@dataclass(slots=True)
class Wiring:
    """The dependencies a service's handlers close over (cosmicpython's bootstrap, in one object)."""

    settings: Settings
    broker: NatsBroker
    redis: aioredis.Redis | None
    """None for the trainer: it keeps no state in Redis and holds no Redis credential."""
    keys: Keys
    tasks: list[Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=list)
    """Background loops started after the broker and cancelled before it stops."""
    service: str = ""
    """The identity it connects as: its JetStream deliveries come to this identity's own inbox."""

    def inbox_prefix(self) -> bytes:
        return (service_inbox(self.service) + ".").encode()

    def require_redis(self) -> aioredis.Redis:
        """The Redis connection of a service that keeps state (every one but the trainer)."""
        if self.redis is None:
            raise RuntimeError(f"the {self.service} service holds no Redis credential")
        return self.redis


Route = tuple[str, type, Callable[[Any], Coroutine[Any, Any, Any]]]
"""(subject suffix, request contract, async handler): one core request/reply endpoint."""
TenantRoute = tuple[str, type, Callable[[str, Any], Coroutine[Any, Any, Any]]]
"""(subject suffix, request contract, async handler(account, request)): one API endpoint."""


def replier(
    handler: Callable[[Any], Coroutine[Any, Any, Any]], request_type: type, verifier: Verifier | None = None
):
    """A subscriber that decodes the request at the edge and answers with an Envelope. With a
    verifier, a request the scheduler did not sign (recently) is refused before it is decoded.
    A factory, so that FastStream sees only the message argument."""
    decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(request_type)

    async def reply(msg: NatsMessage) -> bytes:
        if verifier is not None and not verifier.valid(msg.raw_message.subject, msg.body, msg.headers):
            log.warning("refused an unsigned or stale request on %s", msg.raw_message.subject)
            return codec.fail(ErrorCode.forbidden, "only the scheduler may call this service")
        return await codec.answer(handler, msg.body, decoder)

    reply.__name__ = handler.__name__
    return reply


class ForeignReply(Exception):
    """A tenant asked for the answer to be delivered into someone else's inbox: refused, unanswered."""


def tenant_replier(handler: Callable[[str, Any], Coroutine[Any, Any, Any]], request_type: type):
    """An API endpoint: the caller's account is the last subject token, which only that account's
    credential may publish on; the reply must go to that account's own inbox (the server does not
    check reply subjects, so another tenant could otherwise aim our answer at a victim)."""
    decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(request_type)

    async def reply(msg: NatsMessage) -> bytes:
        account = msg.raw_message.subject.rsplit(".", 1)[-1]
        reply_to = msg.raw_message.reply or ""
        if reply_to and not reply_to.startswith(tenant_inbox(account) + "."):
            # Raising (not returning) means FastStream publishes no answer at all, and nothing was done.
            raise ForeignReply(f"a request of account {account} asked for its answer in another inbox")
        return await codec.answer(lambda req: handler(account, req), msg.body, decoder)

    reply.__name__ = handler.__name__
    return reply


REQUEST_CONCURRENCY = 64  # requests one endpoint handles at once; FastStream's default is one at a time


def scheduler_verifier(settings: Settings) -> Verifier:
    return Verifier(Secrets(settings.secrets_dir).verify_key())


def serve_requests(w: "Wiring", routes: Sequence[Route], signed: bool = True) -> None:
    """Internal endpoints. `signed`: only requests the scheduler signed are answered."""
    verifier = scheduler_verifier(w.settings) if signed else None
    for suffix, request_type, handler in routes:
        w.broker.subscriber(w.settings.subject(suffix), max_workers=REQUEST_CONCURRENCY)(
            replier(handler, request_type, verifier)
        )


def serve_tenant_requests(w: "Wiring", routes: Sequence[TenantRoute]) -> None:
    """API endpoints on `<ns>.<verb>.<account>`; the handler is called as handler(account, request)."""
    for suffix, request_type, handler in routes:
        w.broker.subscriber(w.settings.subject(suffix) + ".*", max_workers=REQUEST_CONCURRENCY)(
            tenant_replier(handler, request_type)
        )


def consume_in_order(
    w: "Wiring",
    subject_suffix: str,
    stream: str,
    consumer: str,
    handler: Callable[..., Coroutine[Any, Any, None]],
    ack_wait_s: float,
    with_subject: bool = False,
) -> None:
    """A durable JetStream consumer that applies messages one at a time, in stream order (FastStream
    runs a fetched batch concurrently, so the batch is one). Acked after `handler` returns; an
    exception NAKs for redelivery, so handlers must be idempotent. A late or restarted service
    replays what it missed."""
    from faststream import AckPolicy
    from faststream.nats import ConsumerConfig, PullSub

    from services.runtime import streams

    s = w.settings

    async def consume(msg: NatsMessage) -> None:
        if with_subject:  # the subject says who may have published it (NATS permissions are per subject)
            await handler(msg.body, msg.raw_message.subject)
        else:
            await handler(msg.body)

    consume.__name__ = f"consume_{consumer.replace('-', '_')}"
    w.broker.subscriber(
        s.subject(subject_suffix) + ".>",
        stream=streams.ref(s, stream),
        durable=f"{s.namespace}-{consumer}",
        pull_sub=PullSub(batch_size=1, timeout=0.5),
        config=ConsumerConfig(ack_wait=ack_wait_s),
        ack_policy=AckPolicy.NACK_ON_ERROR,
        inbox_prefix=w.inbox_prefix(),
    )(consume)


def build_app(service: str, settings: Settings, register: Callable[[Wiring], None]) -> FastStream:
    broker = connections.make_broker(settings, service)
    redis = connections.make_redis(settings, service) if service in REDIS_SERVICES else None
    wiring = Wiring(settings=settings, broker=broker, redis=redis, keys=Keys(settings), service=service)
    register(wiring)

    @broker.subscriber(settings.subject(f"{HEALTH}.{service}"))
    async def health(msg: NatsMessage) -> bytes:
        try:
            if wiring.redis is not None:
                await asyncio.wait_for(wiring.redis.ping(), timeout=settings.request_timeout_s)
        except Exception:  # not ready: Redis does not answer
            return codec.ok(Health(service=service, ok=False))
        return codec.ok(Health(service=service, ok=True))

    app = FastStream(broker, logger=logging.getLogger(f"ito.{service}"))

    @app.on_startup
    async def refuse_open_servers() -> None:
        nc = await broker.connect()
        if not nc._server_info.get("auth_required"):  # a server without authentication is not ours
            raise RuntimeError(
                f"the NATS server at {settings.nats_url} does not require authentication; refusing it"
            )

    running: list[asyncio.Task] = []

    @app.after_startup
    async def start_tasks() -> None:
        running.extend(asyncio.create_task(task()) for task in wiring.tasks)

    @app.on_shutdown
    async def stop_tasks() -> None:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)

    @app.after_shutdown
    async def close_redis() -> None:
        if wiring.redis is not None:
            await wiring.redis.aclose()

    return app


def configure_logging(service: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
    )
