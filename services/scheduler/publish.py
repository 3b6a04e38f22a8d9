"""Run events the scheduler itself publishes to the run stream (creation, interruptions), so that
every consumer of a run's history (desk telemetry) sees them in the one place."""

import time
from datetime import UTC, datetime

import msgspec
from faststream.nats import NatsBroker

from contracts import subjects
from contracts.runs import RunEvent
from services.runtime.publishing import publish_once
from services.runtime.settings import Settings


def seq_now() -> int:
    return time.time_ns() // 1000  # the trainer's events use the same clock-based sequence


class RunEventPublisher:
    def __init__(self, broker: NatsBroker, settings: Settings) -> None:
        self.broker = broker
        self.settings = settings

    def base(self, run_id: str) -> dict:
        return {"run_id": run_id, "seq": seq_now(), "at": datetime.now(UTC)}

    async def publish(self, event: RunEvent, msg_id: str) -> None:
        kind = type(event).__struct_config__.tag
        await publish_once(
            self.broker,
            self.settings,
            subject=self.settings.subject(f"{subjects.RUN_EVENTS}.{event.run_id}.{kind}"),
            stream=subjects.STREAM_RUNS,
            body=msgspec.json.encode(event),
            msg_id=msg_id,
        )
