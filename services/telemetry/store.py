"""Telemetry's store: each run's events (idempotent by (epoch, seq, kind)) and finished runs by
rollup key. The port (`Telemetry`), its Redis adapter and an in-memory one for handler tests."""

from typing import Protocol

import msgspec

from contracts.runs import RunEvent
from contracts.telemetry import RunTelemetry
from runtime.configuration.keys import Keys
from runtime.messaging.connections import RedisClient

EVENTS_TTL_S = 7 * 24 * 3600  # a run's raw events are kept a week after its last one

_event_decoder = msgspec.json.Decoder(RunEvent)
_run_decoder = msgspec.json.Decoder(RunTelemetry)


def event_name(event: RunEvent) -> str:
    """(epoch, seq, kind) names an event: trainer counters restart with each lease epoch."""
    return f"{event.epoch}:{event.seq}:{type(event).__struct_config__.tag}"


class Telemetry(Protocol):
    async def add_event(self, event: RunEvent) -> None:
        """Keep the event under its name (`event_name`): a redelivery replaces, never adds."""
        ...

    async def events(self, run_id: str) -> list[RunEvent]: ...

    async def put_run(self, by: str, key: str, run: RunTelemetry) -> list[RunTelemetry]: ...


class TelemetryStore:
    def __init__(self, r: RedisClient, keys: Keys) -> None:
        self.r = r
        self.keys = keys

    async def add_event(self, event: RunEvent) -> None:
        key = self.keys.telemetry_events(event.run_id)
        async with self.r.pipeline(transaction=True) as pipe:  # one key, so one slot on a cluster
            pipe.hset(key, event_name(event), msgspec.json.encode(event))
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


class InMemoryTelemetry:
    """The same port in dicts (no expiry: a test's runs end long before a week)."""

    def __init__(self) -> None:
        self.by_run: dict[str, dict[str, RunEvent]] = {}
        self.finished: dict[tuple[str, str], dict[str, RunTelemetry]] = {}

    async def add_event(self, event: RunEvent) -> None:
        self.by_run.setdefault(event.run_id, {})[event_name(event)] = event

    async def events(self, run_id: str) -> list[RunEvent]:
        return list(self.by_run.get(run_id, {}).values())

    async def put_run(self, by: str, key: str, run: RunTelemetry) -> list[RunTelemetry]:
        runs = self.finished.setdefault((by, key), {})
        runs[run.run_id] = run
        return list(runs.values())
