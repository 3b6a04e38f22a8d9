"""Consume the trainer's run events and fold them into run views, logs, metrics, checkpoints."""

import logging

import msgspec

from contracts.api import LogLineView
from contracts.runs import CheckpointSaved, LogLine, Metrics, RunEvent
from contracts.states import TERMINAL_STATES
from services.scheduler import lifecycle
from services.scheduler.store import RunStore

log = logging.getLogger("ito.scheduler.events")
event_decoder = msgspec.json.Decoder(RunEvent)


class RunEvents:
    def __init__(self, runs: RunStore) -> None:
        self.runs = runs

    async def on_event(self, raw: bytes) -> None:
        try:
            event = event_decoder.decode(raw)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.error("run event rejected (acked, not applied): %s", exc)
            return
        account = await self.runs.owner(event.run_id)
        if account is None:
            log.error("event for unknown run %s ignored", event.run_id)
            return
        try:
            view, applied = await self.runs.update(account, event.run_id, event.seq,
                                                   lambda view: lifecycle.apply_event(view, event), epoch=event.epoch)
        except lifecycle.IllegalTransition as exc:
            log.warning("run %s: %s refused, not applied", event.run_id, exc)
            return
        if not applied:
            return
        if view is not None and view.state in TERMINAL_STATES:
            await self.runs.release_lease(event.run_id)
        match event:
            case LogLine():
                index = await self.runs.log_count(account, event.run_id)
                await self.runs.append_log(account, event.run_id, LogLineView(
                    index=index, at=event.at, level=event.level, message=event.message))
            case Metrics():
                await self.runs.append_metrics(account, event.run_id, event)
            case CheckpointSaved():
                await self.runs.append_checkpoint(account, event.run_id, event)
