"""Fold run events; when a run ends, account it and publish the run and its rollups. While a run
goes, its goodput so far is published live for the desk (core NATS `desk.live.<run>`, not kept: at
most every LIVE_EVERY_S per run, and at once when its state or stage moves)."""

import logging
import time
from datetime import UTC, datetime

import msgspec

from contracts import subjects
from contracts.runs import EvalResult, Interruption, RunCreated, RunEvent, StageStarted, StateChanged
from contracts.states import TERMINAL_STATES
from contracts.telemetry import ROLLUP_BY
from domain import accounting
from runtime.configuration.settings import Settings
from runtime.messaging.bus import Bus
from services.telemetry.store import Telemetry

log = logging.getLogger("ito.telemetry")
ROLLUPS = tuple(ROLLUP_BY)
LIVE_EVERY_S = 2.0  # a live snapshot re-reads the run's events: often enough for a person watching
LIVE_AT_ONCE = (StateChanged, StageStarted, EvalResult, Interruption)  # moves a person wants to see now


class TelemetryHandlers:
    def __init__(self, store: Telemetry, bus: Bus, settings: Settings) -> None:
        self.store = store
        self.bus = bus
        self.settings = settings
        self._live_at: dict[str, float] = {}  # run -> when its last live snapshot went out (monotonic)

    async def _publish(self, suffix: str, body, msg_id: str) -> None:
        await self.bus.publish_once(
            f"{self.settings.desk_subject_root()}.{suffix}",
            self.settings.stream(subjects.STREAM_DESK),
            msgspec.json.encode(body),
            msg_id,
            self.settings.request_timeout_s,
        )

    async def on_event(self, event: RunEvent) -> None:
        await self.store.add_event(event)
        if isinstance(event, StateChanged) and event.state in TERMINAL_STATES:
            self._live_at.pop(event.run_id, None)
            await self.finish(event.run_id, event.at, event.state.value)
        elif self._live_due(event, time.monotonic()):
            await self.live(event.run_id)

    def _live_due(self, event: RunEvent, now: float) -> bool:
        last = self._live_at.get(event.run_id)
        if isinstance(event, LIVE_AT_ONCE) or last is None or now - last >= LIVE_EVERY_S:
            self._live_at[event.run_id] = now
            return True
        return False

    async def live(self, run_id: str) -> None:
        """The run's accounting up to now, for the desk's live pages; a failure is logged only
        (the run's final accounting does not depend on it)."""
        events = await self.store.events(run_id)
        created = next((e for e in events if isinstance(e, RunCreated)), None)
        if created is None:
            return
        moves = sorted((e for e in events if isinstance(e, StateChanged)), key=lambda e: (e.at, e.seq))
        state = moves[-1].state.value if moves else "queued"
        now = datetime.now(UTC)
        run = accounting.account(created, [e for e in events if not isinstance(e, RunCreated)], now, state)
        try:
            await self.bus.publish(f"{self.settings.desk_live_root()}.{run_id}", msgspec.json.encode(run))
        except Exception:  # a lost snapshot is replaced by the next one
            log.warning("run %s: live telemetry not published", run_id)

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
            key = getattr(run, ROLLUP_BY[by])
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
