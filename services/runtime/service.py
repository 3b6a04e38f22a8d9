"""What every service's entry point shares: build a FastStream app with a health answer,
declare the streams before subscribing, and close Redis on the way out."""

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import msgspec
import redis.asyncio as aioredis
from faststream import FastStream
from faststream.nats import NatsBroker, NatsMessage

from contracts.internal import Health
from contracts.subjects import HEALTH
from services.runtime import codec, connections, streams
from services.runtime.keys import Keys
from services.runtime.settings import Settings


@dataclass(slots=True)
class Wiring:
    """The dependencies a service's handlers close over (cosmicpython's bootstrap, in one object)."""

    settings: Settings
    broker: NatsBroker
    redis: aioredis.Redis
    keys: Keys
    tasks: list[Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=list)
    """Background loops started after the broker and cancelled before it stops."""


Route = tuple[str, type, Callable[[Any], Coroutine[Any, Any, Any]]]
"""(subject suffix, request contract, async handler): one core request/reply endpoint."""


def replier(handler: Callable[[Any], Coroutine[Any, Any, Any]], request_type: type):
    """A subscriber that decodes the request at the edge and answers with an Envelope. A factory,
    so that FastStream sees only the message argument."""
    decoder = msgspec.json.Decoder(request_type)

    async def reply(msg: NatsMessage) -> bytes:
        return await codec.answer(handler, msg.body, decoder)

    reply.__name__ = handler.__name__
    return reply


REQUEST_CONCURRENCY = 64  # requests one endpoint handles at once; FastStream's default is one at a time


def serve_requests(w: "Wiring", routes: list[Route]) -> None:
    for suffix, request_type, handler in routes:
        w.broker.subscriber(w.settings.subject(suffix), max_workers=REQUEST_CONCURRENCY)(replier(handler, request_type))


def consume_in_order(w: "Wiring", subject_suffix: str, stream: str, consumer: str,
                     handler: Callable[[bytes], Coroutine[Any, Any, None]], ack_wait_s: float) -> None:
    """A durable JetStream consumer that applies messages one at a time, in stream order (FastStream
    runs a fetched batch concurrently, so the batch is one). Acked after `handler` returns; an
    exception NAKs for redelivery, so handlers must be idempotent. A late or restarted service
    replays what it missed."""
    from faststream import AckPolicy
    from faststream.nats import ConsumerConfig, PullSub

    from services.runtime import streams

    s = w.settings

    async def consume(msg: NatsMessage) -> None:
        await handler(msg.body)

    consume.__name__ = f"consume_{consumer.replace('-', '_')}"
    w.broker.subscriber(
        s.subject(subject_suffix) + ".>", stream=streams.ref(s, stream), durable=f"{s.namespace}-{consumer}",
        pull_sub=PullSub(batch_size=1, timeout=0.5), config=ConsumerConfig(ack_wait=ack_wait_s),
        ack_policy=AckPolicy.NACK_ON_ERROR,
    )(consume)


def build_app(service: str, settings: Settings, register: Callable[[Wiring], None]) -> FastStream:
    broker = connections.make_broker(settings, service)
    wiring = Wiring(settings=settings, broker=broker, redis=connections.make_redis(settings), keys=Keys(settings))
    register(wiring)

    @broker.subscriber(settings.subject(f"{HEALTH}.{service}"))
    async def health(msg: NatsMessage) -> bytes:
        try:
            await asyncio.wait_for(wiring.redis.ping(), timeout=settings.request_timeout_s)
        except Exception:  # not ready: Redis does not answer
            return codec.ok(Health(service=service, ok=False))
        return codec.ok(Health(service=service, ok=True))

    app = FastStream(broker, logger=logging.getLogger(f"ito.{service}"))

    @app.on_startup
    async def declare_streams() -> None:
        nc = await broker.connect()
        await streams.declare(nc.jetstream(), settings)

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
        await wiring.redis.aclose()

    return app


def configure_logging(service: str) -> None:
    logging.basicConfig(
        level=logging.INFO,
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
    )
