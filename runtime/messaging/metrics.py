"""Prometheus metrics of one service process: every metric's definition (one place, `ito_` names),
the counting hooks the request path and the consumers call, the consumer-lag refresher, and the
`/metrics` endpoint itself.

What it owns:
- `ServiceMetrics`: one `CollectorRegistry` per service (never prometheus_client's global default,
  so that tests and several services in one process keep apart) and every family on it.
- `EndpointStats`: one request/reply endpoint's labelled children, made once when the endpoint is
  served (runtime/messaging/bus.py `Router`), so counting a request costs no label lookup: a
  histogram observation, and a counter increment when the answer is a refusal (its code as
  `codec.answer_coded` built the envelope with, never decoded again).
- `authorized`, `metrics_endpoint`, `metrics_app`: GET /metrics in the Prometheus text format,
  refused (401, no metric text) without `Authorization: Bearer <token>`; the token is compared in
  constant time and never logged. The desk app mounts the same handler with its own registry.
  Beside it, GET /healthz without any credential (container healthchecks, Kubernetes probes):
  200 `ok` or 503 `unhealthy`, nothing else (no metric, no name, no secret), from `healthy()`.
- `MetricsServer`: uvicorn inside the service's own event loop (runtime/messaging/service.py
  starts it after start-up and stops it on shutdown). It never takes SIGTERM or SIGINT:
  FastStream owns them, and its shutdown stops this server.

Labels never carry an account, a run id or anything else a caller chooses: the number of series
stays bounded (services x endpoints x error codes), and a scrape names no customer.
"""

import asyncio
import contextlib
import hmac
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, generate_latest

from contracts.errors import ErrorCode

log = logging.getLogger("ito.metrics")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds: a gated train request takes ~5 ms here, an internal hop ~1 ms, a timeout 2 s."""
CONSUMER_REFRESH_S = 5.0  # one CONSUMER.INFO per durable this often; Prometheus scrapes every 15 s or so
START_TIMEOUT_S = 5.0  # uvicorn listening on a socket already bound: milliseconds
STOP_TIMEOUT_S = 3  # a scrape in flight finishes; then the service's shutdown goes on
MAX_SCRAPES_AT_ONCE = 8  # uvicorn answers 503 beyond it: a scraper cannot pile up handlers
PATH = "/metrics"
HEALTH_PATH = "/healthz"  # no credential: a probe must not need the scrape token
HEALTH_TIMEOUT_S = 2.0  # a probe's check (a Redis PING) never hangs the probe


def endpoint_label(namespace: str, subject: str) -> str:
    """An endpoint's label: its subject without the namespace (`t1.v1.api.train` ->
    `v1.api.train`), so one endpoint has one label value whatever the deployment's namespace. An
    API verb's subject is its route's, without the caller's account token."""
    prefix = namespace + "."
    return subject[len(prefix) :] if subject.startswith(prefix) else subject


class EndpointStats:
    """One endpoint's children of the request families, made once; `observe` per request."""

    __slots__ = ("_labels", "_latency", "_refusal_family", "_refusals", "_unanswered")

    def __init__(self, metrics: "ServiceMetrics", endpoint: str) -> None:
        self._labels = (metrics.service, endpoint)
        self._latency = metrics.request_seconds.labels(*self._labels)
        self._refusal_family = metrics.refusals
        self._refusals: dict[ErrorCode, Any] = {}  # code -> child, made at a code's first refusal
        self._unanswered = metrics.unanswered.labels(*self._labels)

    def observe(self, seconds: float, code: ErrorCode | None) -> None:
        """One answered request: its handling time, and its refusal's code (None: it was ok)."""
        self._latency.observe(seconds)
        if code is not None:
            child = self._refusals.get(code)
            if child is None:  # a series only for codes this endpoint has answered with
                child = self._refusals[code] = self._refusal_family.labels(*self._labels, code.value)
            child.inc()

    def unanswered(self) -> None:
        """A request left unanswered (and not acted on): its answer was aimed at another inbox."""
        self._unanswered.inc()


class _ConsumerGauges:
    __slots__ = (
        "ack_pending",
        "durable",
        "failing",
        "failures",
        "pending",
        "redelivered",
        "refreshed",
        "stream",
    )

    def __init__(self, m: "ServiceMetrics", stream: str, durable: str) -> None:
        self.stream, self.durable = stream, durable
        self.pending = m.consumer_pending.labels(stream, durable)
        self.ack_pending = m.consumer_ack_pending.labels(stream, durable)
        self.redelivered = m.consumer_redelivered.labels(stream, durable)
        self.refreshed = m.consumer_refreshed.labels(stream, durable)
        self.failures = m.consumer_info_failures.labels(stream, durable)
        self.failing = False  # logged once per streak of failures, not every few seconds


class ServiceMetrics:
    """Every metric one service process exposes, on a registry of its own."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry()
        r = self.registry
        self.request_seconds = Histogram(
            "ito_request_seconds",
            "Time to answer a request/reply endpoint (signature check, decode, handler, encode).",
            ["service", "endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.refusals = Counter(
            "ito_refusals",
            "Requests answered with a refusal, by the refusal's stable error code.",
            ["service", "endpoint", "code"],
            registry=r,
        )
        self.unanswered = Counter(
            "ito_requests_unanswered",
            "Requests left unanswered and not acted on: the answer was aimed at another's inbox.",
            ["service", "endpoint"],
            registry=r,
        )
        self.in_flight_requests = Gauge(
            "ito_requests_in_flight", "Request handlers running now.", ["service"], registry=r
        )
        self.accepted = Counter(
            "ito_runs_accepted",
            "Runs created by a train request (replays not counted).",
            ["service"],
            registry=r,
        )
        self.malformed = Counter(
            "ito_malformed_messages",
            "Stream messages that did not decode: acknowledged, never applied.",
            ["service", "consumer"],
            registry=r,
        )
        self.unsigned = Counter(
            "ito_unsigned_messages",
            "Messages without the scheduler's valid signature: dropped (work items terminated).",
            ["service", "consumer"],
            registry=r,
        )
        consumer = ["stream", "consumer"]
        self.consumer_pending = Gauge(
            "ito_consumer_pending_messages",
            "Messages in the stream the durable consumer has not delivered yet.",
            consumer,
            registry=r,
        )
        self.consumer_ack_pending = Gauge(
            "ito_consumer_ack_pending_messages",
            "Messages delivered to the durable consumer and not acknowledged yet.",
            consumer,
            registry=r,
        )
        self.consumer_redelivered = Gauge(
            "ito_consumer_redelivered_messages",
            "Messages the durable consumer has redelivered and not had acknowledged yet.",
            consumer,
            registry=r,
        )
        self.consumer_refreshed = Gauge(
            "ito_consumer_info_timestamp_seconds",
            "When the consumer's figures were last read (Unix time): stale figures show here.",
            consumer,
            registry=r,
        )
        self.consumer_info_failures = Counter(
            "ito_consumer_info_failures", "Consumer info requests that failed.", consumer, registry=r
        )
        ProcessCollector(registry=r)  # CPU seconds, resident memory, open files: read at scrape time
        self._consumers: list[_ConsumerGauges] = []

    def endpoint(self, namespace: str, subject: str) -> EndpointStats:
        """The children of the endpoint served on `subject` (an API verb's without the account)."""
        return EndpointStats(self, endpoint_label(namespace, subject))

    def runs_accepted(self) -> Callable[[], None]:
        """What counts one new run (its series exists, at 0, from this call on)."""
        return self.accepted.labels(self.service).inc

    def malformed_messages(self, consumer: str) -> Callable[[], None]:
        return self.malformed.labels(self.service, consumer).inc

    def unsigned_messages(self, consumer: str) -> Callable[[], None]:
        return self.unsigned.labels(self.service, consumer).inc

    def in_flight(self, count: Callable[[], float]) -> None:
        """Read `count()` at scrape time (nothing to do per request)."""
        self.in_flight_requests.labels(self.service).set_function(count)

    def watch_consumer(self, stream: str, durable: str) -> None:
        """A durable this process pulls from: its lag is read every CONSUMER_REFRESH_S."""
        self._consumers.append(_ConsumerGauges(self, stream, durable))

    @property
    def consumers(self) -> list[tuple[str, str]]:
        return [(c.stream, c.durable) for c in self._consumers]

    async def refresh_consumers(self, js: Any) -> None:
        """One `$JS.API.CONSUMER.INFO.<stream>.<durable>` per watched durable (each service's
        identity may ask it of its own durables: runtime/security/identities.py `_durable`);
        `js` is a nats-py JetStream context whose timeout bounds each request."""
        import nats.errors

        for c in self._consumers:
            try:
                info = await js.consumer_info(c.stream, c.durable)
            except (nats.errors.Error, TimeoutError) as exc:
                c.failures.inc()
                if not c.failing:
                    log.warning(
                        "consumer info of %s on %s failed: %s", c.durable, c.stream, type(exc).__name__
                    )
                c.failing = True
                continue
            c.failing = False
            c.pending.set(info.num_pending or 0)
            c.ack_pending.set(info.num_ack_pending or 0)
            c.redelivered.set(info.num_redelivered or 0)
            c.refreshed.set(time.time())

    async def refresh_forever(self, js: Any, interval_s: float = CONSUMER_REFRESH_S) -> None:
        while True:
            await self.refresh_consumers(js)
            await asyncio.sleep(interval_s)


def authorized(headers: Mapping[str, str], token: str) -> bool:
    """Whether `headers` (Starlette's case-insensitive Headers, or names in lower case) carry
    `Authorization: Bearer <token>`: the scheme in any case (RFC 7235), the token compared in
    constant time. An empty token authorizes nobody."""
    if not token:
        return False
    scheme, _, given = (headers.get("authorization") or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


def metrics_endpoint(registry: CollectorRegistry, token: str) -> Callable[[Any], Awaitable[Any]]:
    """The Starlette endpoint: the registry in the Prometheus text format, or 401 and no metric
    text when the request lacks the token. For a Route of another app (the desk's)."""
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, Response

    if not token:
        raise ValueError("A /metrics endpoint needs a token; an empty one would let nobody in.")

    async def metrics(request: Request) -> Response:
        if not authorized(request.headers, token):
            return PlainTextResponse(
                "unauthorized\n", status_code=401, headers={"WWW-Authenticate": 'Bearer realm="metrics"'}
            )
        return Response(generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    return metrics


async def _always() -> bool:
    return True


def health_endpoint(healthy: Callable[[], Awaitable[bool]]) -> Callable[[Any], Awaitable[Any]]:
    """GET /healthz: 200 when `healthy()` says so within HEALTH_TIMEOUT_S, else 503. The body is
    one word either way: an unauthenticated caller learns nothing but up or down."""
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, Response

    async def healthz(_request: Request) -> Response:
        try:
            ok = await asyncio.wait_for(healthy(), HEALTH_TIMEOUT_S)
        except Exception:  # a failing check is an unhealthy service, never a 500 with a traceback
            ok = False
        return PlainTextResponse("ok\n" if ok else "unhealthy\n", status_code=200 if ok else 503)

    return healthz


def metrics_app(
    registry: CollectorRegistry, token: str, healthy: Callable[[], Awaitable[bool]] = _always
) -> Any:
    """An ASGI app serving GET /metrics (bearer token) and GET /healthz (none); 404 elsewhere."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    return Starlette(
        routes=[
            Route(PATH, metrics_endpoint(registry, token), methods=["GET"]),
            Route(HEALTH_PATH, health_endpoint(healthy), methods=["GET"]),
        ]
    )


def _listening(host: str, port: int) -> socket.socket:
    """Bound here rather than by uvicorn: a port in use is an exception at start-up, where
    uvicorn would call sys.exit from inside a task."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(64)
    sock.setblocking(False)
    return sock


def _server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, quiet between scrapes and deaf to signals."""

        stopping: asyncio.Event

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            # uvicorn's own would replace SIGTERM/SIGINT with its handle_exit, and raise them again
            # when it stops; FastStream owns both, and its shutdown stops this server.
            yield

        async def main_loop(self) -> None:
            # uvicorn's wakes every 0.1 s to refresh the Date header and look at should_exit
            # (~3 ms of CPU a second in every process); this one sleeps until `stop` (no Date).
            await self.on_tick(0)
            await self.stopping.wait()

    return Server


class MetricsServer:
    """`app` served by uvicorn in the running event loop on `host:port` (0: any free port)."""

    def __init__(self, app: Any, host: str, port: int, tls_files: tuple[str, str] | None = None) -> None:
        """`tls_files`: (certificate, key): HTTPS only (runtime/security/tls.py), else plain HTTP."""
        self.app, self.host, self.port = app, host, port
        self.tls_files = tls_files
        self._server: Any = None
        self._task: asyncio.Task | None = None

    async def start(self, timeout_s: float = START_TIMEOUT_S) -> None:
        import uvicorn

        sock = _listening(self.host, self.port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_config=None,  # the service's logging stays as it configured it
            log_level="warning",
            access_log=False,
            lifespan="off",
            interface="asgi3",
            proxy_headers=False,
            server_header=False,
            date_header=False,  # set once at start otherwise (see main_loop); Prometheus needs none
            limit_concurrency=MAX_SCRAPES_AT_ONCE,
            timeout_graceful_shutdown=STOP_TIMEOUT_S,
            ssl_certfile=self.tls_files[0] if self.tls_files else None,
            ssl_keyfile=self.tls_files[1] if self.tls_files else None,
        )
        self._server = _server_class()(config)
        self._server.stopping = asyncio.Event()
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if self._task.done():
                self._task.result()  # its exception, if it failed
                raise RuntimeError("the metrics server stopped at start")
            if time.monotonic() > deadline:
                await self.stop()
                raise RuntimeError(f"the metrics server did not start within {timeout_s:g}s")
            await asyncio.sleep(0.01)
        scheme = "https" if self.tls_files else "http"
        log.info("metrics on %s://%s:%d%s", scheme, self.host, self.port, PATH)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        self._server.stopping.set()
        task, self._task = self._task, None
        try:
            await asyncio.wait_for(task, STOP_TIMEOUT_S + 1.0)  # cancelled when it takes longer
        except TimeoutError:
            log.warning("the metrics server did not stop within %gs; cancelled", STOP_TIMEOUT_S + 1.0)
