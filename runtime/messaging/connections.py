"""Authenticated connections with bounded timeouts: the NATS broker and Redis, per identity.

Every connection names its identity: NATS with the identity's nkey seed file (challenge-response)
and its own inbox prefix, Redis with the identity's ACL user and password file. There is no
anonymous path: a missing secret file is an error at start, never a fallback."""

import logging
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from runtime.configuration.settings import Settings
from runtime.messaging.bus import REQUEST_CONCURRENCY
from runtime.security.identities import service_inbox
from runtime.security.secrets import Secrets
from runtime.security.tls import Certs, client_context

if TYPE_CHECKING:
    from faststream.nats import NatsBroker

NATS_CONNECT_TIMEOUT_S = 2
NATS_RECONNECT_WAIT_S = 1  # bounded backoff between reconnect attempts
NATS_MAX_RECONNECTS = 120  # ~2 minutes of outage before a service gives up and exits
REDIS_CONNECT_TIMEOUT_S = 2.0
REDIS_SOCKET_TIMEOUT_S = 5.0
REDIS_RETRIES = 5
REDIS_MAX_CONNECTIONS = 4 * REQUEST_CONCURRENCY
"""Connections one client may hold (redis-py's default is 100): a service runs up to
REQUEST_CONCURRENCY handlers at once, each with a few commands or pipelines in flight, plus its
consumers and background loops."""

RedisClient = aioredis.Redis | RedisCluster
"""What the stores take: one server, or a cluster (every store command and script touches the keys
of one slot, so both run them alike)."""


def nats_auth(settings: Settings, identity: str) -> dict:
    """nats-py connect options that authenticate as `identity` (no secret in them: a file path)
    and, with TLS on, verify the server: its certificate must chain to the deployment's CA
    (`<secrets dir>/tls/ca.pem`) and name the host dialled."""
    path = Secrets(settings.secrets_dir).seed_path(identity)
    Secrets(settings.secrets_dir).seed(identity)  # fail early, and on an unsafe mode, before connecting
    options: dict = {"nkeys_seed": str(path), "inbox_prefix": service_inbox(identity)}
    if settings.tls:
        options["tls"] = client_context(Certs(settings.tls_dir).ca)
    return options


def make_broker(settings: Settings, service: str) -> "NatsBroker":
    """A service's broker. FastStream is imported here, by the services only: the operator CLI
    (`accounts create`, `simulate-booking`) needs Redis and plain NATS, and FastStream's import
    was most of its start."""
    from fast_depends.msgspec import MsgSpecSerializer
    from faststream.nats import NatsBroker
    from faststream.nats.security import NatsNKey

    log = logging.getLogger(f"ito.{service}.nats")
    auth = nats_auth(settings, service)

    async def disconnected() -> None:
        log.warning("disconnected from NATS; reconnecting with backoff")

    async def reconnected() -> None:
        log.warning("reconnected to NATS")

    async def errored(exc: Exception) -> None:  # permission violations arrive here, not as exceptions
        log.warning("NATS error: %s", exc)

    return NatsBroker(
        settings.nats_servers,  # a cluster's pool: nats-py picks one at random and fails over
        name=f"ito-{settings.instance or service}",
        connect_timeout=NATS_CONNECT_TIMEOUT_S,
        reconnect_time_wait=NATS_RECONNECT_WAIT_S,
        max_reconnect_attempts=NATS_MAX_RECONNECTS,
        disconnected_cb=disconnected,
        reconnected_cb=reconnected,
        serializer=MsgSpecSerializer(),
        graceful_timeout=5.0,
        log_level=logging.DEBUG,  # per-message Received/Processed lines are noise at INFO
        error_cb=errored,
        security=NatsNKey(auth["nkeys_seed"], ssl_context=auth.get("tls")),
        inbox_prefix=auth["inbox_prefix"],
    )


def redis_nodes(url: str) -> list[tuple[str, int]]:
    """(host, port) of every node a Redis URL setting names (`redis://h:p[/0]`, comma-separated)."""
    nodes = []
    for part in (u.strip() for u in url.split(",")):
        if part:
            parsed = urlparse(part if "://" in part else f"redis://{part}")
            nodes.append((parsed.hostname or "127.0.0.1", parsed.port or 6379))
    if not nodes:
        raise ValueError(f"The Redis URL names no server: {url!r}.")
    return nodes


def make_redis(settings: Settings, identity: str) -> RedisClient:
    """A client as `identity`: to the one server of `redis_url`, or with `redis_cluster` to the
    cluster those nodes belong to (the client reads the slot map from the first that answers)."""
    password = Secrets(settings.secrets_dir).password(identity)
    retry = Retry(ExponentialBackoff(cap=2.0, base=0.05), REDIS_RETRIES)
    if settings.redis_cluster:
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in redis_nodes(settings.redis_url)],
            username=identity,
            password=password,
            socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
            socket_timeout=REDIS_SOCKET_TIMEOUT_S,
            retry=retry,  # its count bounds the retries after a MOVED, a lost node or a failover
            # a shard between its primary's death and its replica's promotion fails its own keys
            # only: the client still starts and serves the other shards meanwhile
            require_full_coverage=False,
            max_connections=REDIS_MAX_CONNECTIONS,  # per node
            decode_responses=False,
        )
    # A handler past the pool's size waits (bounded) for a connection instead of failing.
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=REDIS_MAX_CONNECTIONS,
        timeout=REDIS_SOCKET_TIMEOUT_S,
        username=identity,
        password=password,
        socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
        socket_timeout=REDIS_SOCKET_TIMEOUT_S,
        retry=retry,
        retry_on_timeout=True,
        decode_responses=False,
    )
    return aioredis.Redis(connection_pool=pool)
