"""Publish a run's events to JetStream, from the event loop or from the training thread.

`seq` counts this lease epoch's events from 1; (epoch, seq) orders a run's events across trainers
and restarts without any wall clock, so the scheduler drops redeliveries and duplicates by
comparing it, and a trainer whose clock is off loses nothing.
"""

import asyncio
import logging
from datetime import UTC, datetime

import msgspec

from contracts import subjects
from contracts.api import RestartProposal
from contracts.runs import LogLevel, LogLine, ProposalMade, RunEvent, StateChanged
from contracts.states import RunState
from runtime.configuration.settings import Settings
from runtime.messaging.bus import Bus
from training.engine.reporting import Reporter, check_event

log = logging.getLogger("ito.trainer.emitter")
THREAD_PUBLISH_TIMEOUT_S = 10.0  # the training thread waits at most this for one event to be stored


class Emitter:
    def __init__(
        self,
        bus: Bus,
        settings: Settings,
        run_id: str,
        loop: asyncio.AbstractEventLoop,
        epoch: int = 0,
    ) -> None:
        self.bus = bus
        self.settings = settings
        self.run_id = run_id
        self.loop = loop
        self.epoch = epoch  # the lease epoch: the scheduler drops events of a fenced epoch
        self._last = 0

    async def publish(self, event: RunEvent) -> None:
        # The seq is given here, on the event loop, in the order the publishes are sent: an event
        # built on the training thread can never overtake (and so shadow) one built later.
        self._last += 1
        event = msgspec.structs.replace(event, seq=self._last)
        kind = type(event).__struct_config__.tag
        await self.bus.publish_once(
            self.settings.subject(f"{subjects.RUN_EVENTS}.{self.run_id}.{kind}"),
            self.settings.stream(subjects.STREAM_RUNS),
            msgspec.json.encode(event),
            f"{self.run_id}:{self.epoch}:{event.seq}",
            self.settings.request_timeout_s,
        )

    async def state(
        self,
        state: RunState,
        stage: str | None = None,
        message: str | None = None,
        total_steps: int = 0,
        gang_requeues: int | None = None,
    ) -> None:
        await self.publish(
            StateChanged(
                run_id=self.run_id,
                seq=0,  # given at publish
                at=datetime.now(UTC),
                epoch=self.epoch,
                state=state,
                stage=stage,
                message=message,
                total_steps=total_steps,
                gang_requeues=gang_requeues,
            )
        )

    async def log(self, message: str, level: LogLevel = LogLevel.info) -> None:
        await self.publish(
            LogLine(
                run_id=self.run_id,
                seq=0,
                at=datetime.now(UTC),
                epoch=self.epoch,
                level=level,
                message=message,
            )
        )

    async def proposal(self, proposal: RestartProposal) -> None:
        await self.publish(
            ProposalMade(run_id=self.run_id, seq=0, at=datetime.now(UTC), epoch=self.epoch, proposal=proposal)
        )

    def reporter(self) -> Reporter:
        """The training thread's reporting interface, publishing through `from_thread`."""
        return Reporter(self.from_thread, run_id=self.run_id, epoch=self.epoch)

    def from_thread(self, event: RunEvent) -> None:
        """Publish a contract event built on the training thread, on the loop; wait (bounded) for it."""
        event = check_event(event)
        future = asyncio.run_coroutine_threadsafe(self.publish(event), self.loop)
        try:
            future.result(timeout=THREAD_PUBLISH_TIMEOUT_S)
        except Exception:  # the run goes on; a lost metric is not worth a lost run
            kind = type(event).__struct_config__.tag
            log.warning("run %s: a %s event could not be published", self.run_id, kind)
