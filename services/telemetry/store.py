"""Redis access for telemetry: each run's events (idempotent by seq) and finished runs by rollup key."""

import msgspec
import redis.asyncio as aioredis

from contracts.runs import RunEvent
from contracts.telemetry import RunTelemetry
from services.runtime.keys import Keys

EVENTS_TTL_S = 7 * 24 * 3600  # a run's raw events are kept a week after its last one

_event_decoder = msgspec.json.Decoder(RunEvent)
_run_decoder = msgspec.json.Decoder(RunTelemetry)


class TelemetryStore:
    def __init__(self, r: aioredis.Redis, keys: Keys) -> None:
        self.r = r
        self.keys = keys

    async def add_event(self, event: RunEvent) -> None:
        key = self.keys.telemetry_events(event.run_id)
        async with self.r.pipeline(transaction=True) as pipe:
            # (epoch, seq, kind) names an event: trainer counters restart with each lease epoch
            pipe.hset(
                key,
                f"{event.epoch}:{event.seq}:{type(event).__struct_config__.tag}",
                msgspec.json.encode(event),
            )
            pipe.expire(key, EVENTS_TTL_S)
            await pipe.execute()

    async def events(self, run_id: str) -> list[RunEvent]:
        raw = await self.r.hvals(self.keys.telemetry_events(run_id))
        return [_event_decoder.decode(x) for x in raw]

    async def put_run(self, by: str, key: str, run: RunTelemetry) -> list[RunTelemetry]:
        """Record a finished run under a rollup key; returns every run under that key."""
        name = self.keys.telemetry_runs(by, key)
        await self.r.hset(name, run.run_id, msgspec.json.encode(run))
        return [_run_decoder.decode(x) for x in await self.r.hvals(name)]
