"""Remove everything a namespace left on shared servers: its streams and its Redis keys.

Tests and benchmarks run under a namespace of their own on the machine's NATS and Redis, and call
this when they end."""

from services.runtime import settings as settings_mod
from services.runtime import streams

DELETE_BATCH = 1000


async def purge(nats_url: str, redis_url: str, namespace: str) -> None:
    import nats
    import redis.asyncio as aioredis

    s = settings_mod.load({"ITO_NAMESPACE": namespace, "ITO_NATS_URL": nats_url, "ITO_REDIS_URL": redis_url})
    nc = await nats.connect(nats_url, connect_timeout=2)
    try:
        await streams.delete(nc.jetstream(), s)
    finally:
        await nc.close()
    r = aioredis.Redis.from_url(redis_url)
    try:
        keys = [k async for k in r.scan_iter(match=f"{namespace}:*", count=DELETE_BATCH)]
        for i in range(0, len(keys), DELETE_BATCH):
            await r.delete(*keys[i:i + DELETE_BATCH])
    finally:
        await r.aclose()
