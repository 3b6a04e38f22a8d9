"""Connections with bounded timeouts: the NATS broker, Redis, and the JetStream stream configs."""

import logging

import redis.asyncio as aioredis
from faststream.nats import NatsBroker
from fast_depends.msgspec import MsgSpecSerializer
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from services.runtime.settings import Settings

NATS_CONNECT_TIMEOUT_S = 2
NATS_RECONNECT_WAIT_S = 1  # bounded backoff between reconnect attempts
NATS_MAX_RECONNECTS = 120  # ~2 minutes of outage before a service gives up and exits
REDIS_CONNECT_TIMEOUT_S = 2.0
REDIS_SOCKET_TIMEOUT_S = 5.0
REDIS_RETRIES = 5


def make_broker(settings: Settings, service: str) -> NatsBroker:
    log = logging.getLogger(f"ito.{service}.nats")

    async def disconnected() -> None:
        log.warning("disconnected from NATS; reconnecting with backoff")

    async def reconnected() -> None:
        log.warning("reconnected to NATS")

    return NatsBroker(
        settings.nats_url,
        name=f"ito-{service}",
        connect_timeout=NATS_CONNECT_TIMEOUT_S,
        reconnect_time_wait=NATS_RECONNECT_WAIT_S,
        max_reconnect_attempts=NATS_MAX_RECONNECTS,
        disconnected_cb=disconnected,
        reconnected_cb=reconnected,
        serializer=MsgSpecSerializer(),
        graceful_timeout=5.0,
        log_level=logging.DEBUG,  # per-message Received/Processed lines are noise at INFO
    )


def make_redis(settings: Settings) -> aioredis.Redis:
    return aioredis.Redis.from_url(
        settings.redis_url,
        socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
        socket_timeout=REDIS_SOCKET_TIMEOUT_S,
        retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), REDIS_RETRIES),
        retry_on_timeout=True,
        decode_responses=False,
    )
