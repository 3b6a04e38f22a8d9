"""Fold run events; when a run ends, account it and publish the run and its rollups."""

import logging
from datetime import UTC, datetime

import msgspec
from faststream.nats import NatsBroker

from contracts import subjects
from contracts.runs import RunCreated, RunEvent, StateChanged
from contracts.states import TERMINAL_STATES
from services.runtime.publishing import publish_once
from services.runtime.settings import Settings
from services.telemetry import accounting
from services.telemetry.store import Telemetry

log = logging.getLogger("ito.telemetry")
ROLLUPS = ("booking", "region", "gpu_model")


class TelemetryHandlers:
    def __init__(self, store: Telemetry, broker: NatsBroker, settings: Settings) -> None:
        self.store = store
        self.broker = broker
        self.settings = settings

    async def _publish(self, suffix: str, body, msg_id: str) -> None:
        await publish_once(
            self.broker,
            self.settings,
            subject=f"{self.settings.desk_subject_root()}.{suffix}",
            stream=subjects.STREAM_DESK,
            body=msgspec.json.encode(body),
            msg_id=msg_id,
        )

    async def on_event(self, event: RunEvent) -> None:
        await self.store.add_event(event)
        if isinstance(event, StateChanged) and event.state in TERMINAL_STATES:
            await self.finish(event.run_id, event.at, event.state.value)

    async def finish(self, run_id: str, ended_at: datetime, state: str) -> None:
        events = await self.store.events(run_id)
        created = next((e for e in events if isinstance(e, RunCreated)), None)
        if created is None:
            log.error("run %s ended without a creation record; not accounted", run_id)
            return
        run = accounting.account(
            created, [e for e in events if not isinstance(e, RunCreated)], ended_at, state
        )
        await self._publish(f"run.{run_id}", run, f"run:{run_id}")
        now = datetime.now(UTC)
        for by in ROLLUPS:
            key = getattr(run, {"booking": "booking_id"}.get(by, by))
            runs = await self.store.put_run(by, key, run)
            await self._publish(
                f"rollup.{by}.{_token(key)}",
                accounting.rollup(by, key, runs, now),
                f"rollup:{by}:{key}:{len(runs)}:{run_id}",
            )
        log.info("run %s: goodput %.1f%% of %.1fs", run_id, 100 * run.goodput, run.wall_s)


def _token(key: str) -> str:
    """A rollup key as one subject token."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in key) or "_"
