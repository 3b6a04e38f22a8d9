"""What every service's entry point shares: build a FastStream app with a health answer, serve
request/reply endpoints on nats-py (runtime/messaging/bus.py: internal ones only when the scheduler
signed the request; tenant ones with the account the NATS server authenticated), consume JetStream
streams through FastStream, serve Prometheus' `/metrics` on `ITO_METRICS_PORT` (runtime/
metrics.py: each endpoint's latency and refusals, each durable's lag), and close Redis on the way out.

Streams are declared by the operator identity (`ito-training up`), never by a service: services
have no right to create, change, purge or delete a stream."""

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from faststream import FastStream
from faststream.nats import NatsBroker, NatsMessage

from contracts.endpoints import Endpoint
from contracts.internal import Health, HealthQuery
from contracts.subjects import HEALTH
from runtime.configuration.keys import Keys
from runtime.configuration.settings import Settings
from runtime.messaging import connections
from runtime.messaging.bus import Bus, Handler, NatsBus, Router, TenantHandler, serve
from runtime.messaging.metrics import MetricsServer, ServiceMetrics, metrics_app
from runtime.security.identities import REDIS_SERVICES, service_inbox
from runtime.security.order_signatures import Verifier
from runtime.security.secrets import Secrets
from runtime.security.tls import Certs

log = logging.getLogger("ito.service")

IN_ORDER_MAX_ACK_PENDING = 1  # one message in flight per durable, whatever the number of instances


@dataclass(slots=True)
class Wiring:
    """The dependencies a service's handlers close over (cosmicpython's bootstrap, in one object)."""

    settings: Settings
    broker: NatsBroker
    redis: connections.RedisClient | None
    """None for the trainer: it keeps no state in Redis and holds no Redis credential."""
    keys: Keys
    tasks: list[Callable[[], Coroutine[Any, Any, None]]] = field(default_factory=list)
    """Background loops started after the broker and cancelled before it stops."""
    service: str = ""
    """The identity it connects as: its JetStream deliveries come to this identity's own inbox."""
    router: Router = None  # type: ignore[assignment]  # set in __post_init__
    """Its request/reply endpoints, served on nats-py once the broker is connected (bus.serve)."""
    bus: Bus = None  # type: ignore[assignment]  # set in __post_init__
    """What it sends requests and publishes with (NatsBus on the broker's connection)."""
    metrics: ServiceMetrics = None  # type: ignore[assignment]  # set in __post_init__
    """Its Prometheus registry and counters; the router counts every endpoint's answers on it."""

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = ServiceMetrics(self.service)
        if self.router is None:
            self.router = Router(self.settings.namespace, metrics=self.metrics)
        if self.bus is None:
            self.bus = NatsBus(self.broker)

    def inbox_prefix(self) -> bytes:
        return (service_inbox(self.service) + ".").encode()

    def require_redis(self) -> connections.RedisClient:
        """The Redis connection of a service that keeps state (every one but the trainer)."""
        if self.redis is None:
            raise RuntimeError(f"the {self.service} service holds no Redis credential")
        return self.redis


def scheduler_verifier(settings: Settings) -> Verifier:
    return Verifier(Secrets(settings.secrets_dir).verify_key())


def serve_requests(
    w: "Wiring", routes: Sequence[tuple[Endpoint, Handler]], signed: bool = True, reply_prefix: str = ""
) -> None:
    """Internal endpoints. `signed`: only requests the scheduler signed are answered;
    `reply_prefix`: only requests whose answer goes to that (one identity's) inbox."""
    verifier = scheduler_verifier(w.settings) if signed else None
    for endpoint, handler in routes:
        w.router.serve(endpoint, handler, verifier, reply_prefix)


def serve_tenant_requests(w: "Wiring", routes: Sequence[tuple[Endpoint, TenantHandler]]) -> None:
    """API endpoints on `<ns>.<verb>.<account>`; the handler is called as handler(account, request)."""
    for endpoint, handler in routes:
        w.router.serve_tenant(endpoint, handler)


def consume_in_order(
    w: "Wiring",
    subject_suffix: str,
    stream: str,
    consumer: str,
    handler: Callable[..., Coroutine[Any, Any, None]],
    ack_wait_s: float,
    message_type: Any,
    with_subject: bool = False,
    on_malformed: Callable[[], Coroutine[Any, Any, None]] | None = None,
    kinds: Sequence[str] = (),
) -> None:
    """A durable JetStream consumer that applies messages one at a time, in stream order (FastStream
    runs a fetched batch concurrently, so the batch is one). Each message is decoded here into
    `message_type` (a tagged union where one stream carries several kinds) and the handler gets the
    typed value (and its subject, `with_subject`). A malformed message would be redelivered for
    ever: it is acked, logged and counted (`ito_malformed_messages_total`, and `on_malformed`),
    never applied. Acked after `handler` returns; an exception NAKs for redelivery, so handlers
    must be idempotent. A late or restarted service replays what it missed. The durable's lag is
    watched (`ito_consumer_pending_messages`).

    Several instances of a service pull from the one durable: `max_ack_pending=1` keeps a single
    message in flight across all of them, so the order holds there too (the run store refuses an
    event older than the last applied one); the others wait, and take over when the holder dies
    (its message comes back after `ack_wait_s`)."""
    from faststream import AckPolicy
    from faststream.nats import ConsumerConfig, PullSub

    from runtime.messaging import streams

    s = w.settings
    decoder: msgspec.json.Decoder[Any] = msgspec.json.Decoder(message_type)
    durable = f"{s.namespace}-{consumer}"
    malformed = w.metrics.malformed_messages(durable)
    w.metrics.watch_consumer(s.stream(stream), durable)

    async def consume(msg: NatsMessage) -> None:
        try:
            message = decoder.decode(msg.body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.error(
                "%s: message on %s rejected (acked, not applied): %s", consumer, msg.raw_message.subject, exc
            )
            malformed()
            if on_malformed is not None:
                await on_malformed()
            return
        if with_subject:  # the subject says who may have published it (NATS permissions are per subject)
            await handler(message, msg.raw_message.subject)
        else:
            await handler(message)

    consume.__name__ = f"consume_{consumer.replace('-', '_')}"
    w.broker.subscriber(
        s.subject(subject_suffix) + ".>",
        stream=streams.ref(s, stream),
        durable=durable,
        pull_sub=PullSub(batch_size=1, timeout=0.5),
        config=ConsumerConfig(
            ack_wait=ack_wait_s,
            max_ack_pending=IN_ORDER_MAX_ACK_PENDING,
            filter_subjects=kind_filters(s.subject(subject_suffix), kinds),
        ),
        ack_policy=AckPolicy.NACK_ON_ERROR,
        inbox_prefix=w.inbox_prefix(),
    )(consume)


def kind_filters(prefix: str, kinds: Sequence[str]) -> list[str]:
    """A durable's filter subjects for the kinds it applies (`<prefix>.<id>.<kind>`), so the server
    delivers it nothing else; none given: everything under the prefix (the subscriber's subject).
    A durable made before keeps its filter (nats-py binds to it unchanged) until it is recreated."""
    return [f"{prefix}.*.{kind}" for kind in kinds]


def build_app(service: str, settings: Settings, register: Callable[[Wiring], None]) -> FastStream:
    broker = connections.make_broker(settings, service)
    redis = connections.make_redis(settings, service) if service in REDIS_SERVICES else None
    wiring = Wiring(settings=settings, broker=broker, redis=redis, keys=Keys(settings), service=service)
    register(wiring)

    async def health(_query: HealthQuery) -> Health:
        try:
            if wiring.redis is not None:
                await asyncio.wait_for(wiring.redis.ping(), timeout=settings.request_timeout_s)
        except Exception:  # not ready: Redis does not answer
            return Health(service=service, ok=False)
        return Health(service=service, ok=True)

    wiring.router.serve(Endpoint(f"{HEALTH}.{service}", HealthQuery, Health), health)

    app = FastStream(broker, logger=logging.getLogger(f"ito.{service}"))
    # Read before anything connects: a configured endpoint without its token does not start.
    scrape_token = Secrets(settings.secrets_dir).metrics_token() if settings.metrics_port else ""
    metrics_server: list[MetricsServer] = []

    @app.on_startup
    async def refuse_open_servers() -> None:
        nc = await broker.connect()
        if not nc._server_info.get("auth_required"):  # a server without authentication is not ours
            raise RuntimeError(
                f"the NATS server at {settings.nats_url} does not require authentication; refusing it"
            )
        if settings.tls and not nc._server_info.get("tls_required"):  # TLS expected, a plain server
            raise RuntimeError(f"the NATS server at {settings.nats_url} does not speak TLS; refusing it")

    running: list[asyncio.Task] = []

    @app.after_startup
    async def start_tasks() -> None:
        # Core request/reply on the broker's own connection; one queue group per service, so that
        # several instances of it share the requests.
        await serve(
            await broker.connect(),
            wiring.router,
            queue=f"{settings.namespace}-{service}",
            instance=settings.instance,
        )
        running.extend(asyncio.create_task(task()) for task in wiring.tasks)
        if settings.metrics_port:
            await start_metrics()

    async def start_metrics() -> None:
        async def healthy() -> bool:
            # what a probe may ask unauthenticated: connected to NATS, and Redis answers a PING
            nc = await broker.connect()
            if not nc.is_connected:
                return False
            return wiring.redis is None or bool(await wiring.redis.ping())

        server = MetricsServer(
            metrics_app(wiring.metrics.registry, scrape_token, healthy),
            settings.metrics_host,
            settings.metrics_port,
            Certs(settings.tls_dir).metrics_files() if settings.tls else None,  # HTTPS only, with TLS on
        )
        await server.start()
        metrics_server.append(server)
        if wiring.metrics.consumers:  # each durable's lag, on this identity's own CONSUMER.INFO right
            js = (await broker.connect()).jetstream(timeout=settings.request_timeout_s)
            running.append(asyncio.create_task(wiring.metrics.refresh_forever(js)))

    @app.on_shutdown
    async def stop_tasks() -> None:
        for server in metrics_server:
            await server.stop()
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
