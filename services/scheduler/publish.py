"""Run events the scheduler itself publishes to the run stream (creation, interruptions), so that
every consumer of a run's history (desk telemetry) sees them in the one place."""

import time
from datetime import UTC, datetime

import msgspec

from contracts import subjects
from contracts.runs import RunEvent
from runtime.configuration.settings import Settings
from runtime.messaging.bus import Bus


def seq_now() -> int:
    return time.time_ns() // 1000  # the trainer's events use the same clock-based sequence


class RunEventPublisher:
    def __init__(self, bus: Bus, settings: Settings) -> None:
        self.bus = bus
        self.settings = settings

    def base(self, run_id: str) -> dict:
        return {"run_id": run_id, "seq": seq_now(), "at": datetime.now(UTC)}

    async def publish(self, event: RunEvent, msg_id: str) -> None:
        kind = type(event).__struct_config__.tag
        await self.bus.publish_once(
            self.settings.subject(f"{subjects.RUN_EVENTS}.{event.run_id}.{kind}"),
            self.settings.stream(subjects.STREAM_RUNS),
            msgspec.json.encode(event),
            msg_id,
            self.settings.request_timeout_s,
        )
