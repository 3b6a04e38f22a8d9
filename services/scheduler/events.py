"""Consume the trainer's run events and fold them into run views, logs, metrics, checkpoints.

What is applied: an event whose subject names its own kind (NATS lets only the trainer publish the
trainer's kinds and only the scheduler its own), and a trainer event only from the current lease
epoch's holder (epoch 0 included: with no lease held, nobody may report), in (epoch, seq) order
with no implausible jump (the store decides, RunStore.update). The scheduler's own events
(creation, interruptions) change no view and are not ordered against the trainer's.
"""

import logging
import pathlib
import typing
from typing import Any

import msgspec

from contracts.api import LogLineView, RunView
from contracts.runs import (
    CheckpointSaved,
    Interruption,
    LogLine,
    Metrics,
    RunCreated,
    RunEvent,
    StateChanged,
)
from contracts.states import TERMINAL_STATES, RunState
from services.scheduler import lifecycle
from services.scheduler.store import RunRecords

log = logging.getLogger("ito.scheduler.events")


def admissible(event: RunEvent, subject: str | None) -> str | None:
    """Why an event must not be applied, or None (pure; the lease and order checks are the store's)."""
    kind = type(event).__struct_config__.tag
    if subject is not None and subject.rsplit(".", 1)[-1] != kind:
        return f"a {kind} event on a subject for another kind"
    if subject is not None and subject.split(".")[-2:-1] != [event.run_id]:
        return "an event on another run's subject"
    return None


def requeue_count(event: StateChanged) -> dict[str, Any]:
    """The view fields a state change sets beside the state: a lost gang's requeue count, only on
    the `interrupted` that requeues it (set, not added: a redelivered event counts once)."""
    if event.gang_requeues is None or event.state is not RunState.interrupted:
        return {}
    return {"gang_requeues": event.gang_requeues}


def from_trainer(event: RunEvent) -> bool:
    return not isinstance(event, RunCreated | Interruption)


SCHEDULERS_OWN = (RunCreated, Interruption)
TRAINER_KINDS: tuple[str, ...] = tuple(
    str(t.__struct_config__.tag) for t in typing.get_args(RunEvent) if t not in SCHEDULERS_OWN
)
"""The run event kinds the scheduler applies: its durable is delivered only these (its own events,
for the run's history, were fetched, decoded and acked for nothing: one per accepted run)."""


class RunEvents:
    def __init__(self, runs: RunRecords) -> None:
        self.runs = runs

    async def on_event(self, event: RunEvent, subject: str | None = None) -> None:
        refused = admissible(event, subject)
        if refused is not None:
            log.warning("run %s: event refused (%s)", event.run_id, refused)
            return
        if not from_trainer(event):  # the scheduler's own: for the run's history, never its view
            return
        account = await self.runs.owner(event.run_id)
        if account is None:
            log.error("event for unknown run %s ignored", event.run_id)
            return
        try:
            view, applied = await self._apply(account, event)
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
                await self.runs.append_log(
                    account,
                    event.run_id,
                    LogLineView(index=index, at=event.at, level=event.level, message=event.message),
                )
            case Metrics():
                await self.runs.append_metrics(account, event.run_id, event)
            case CheckpointSaved():
                shown = in_run(event.path, view.checkpoint_dir if view is not None else None)
                await self.runs.append_checkpoint(
                    account, event.run_id, msgspec.structs.replace(event, path=shown)
                )

    async def _apply(self, account: str, event: RunEvent) -> tuple[RunView | None, bool]:
        """A state change through the store's `move` (lifecycle.move), anything else through
        `update`; a trainer's event only in its lease epoch's order (the store decides)."""
        seq, epoch = (event.seq, event.epoch) if from_trainer(event) else (None, None)
        if isinstance(event, StateChanged):
            return await self.runs.move(
                account,
                event.run_id,
                event.state,
                at=event.at,
                seq=seq,
                holder_epoch=epoch,
                stage=event.stage,
                message=event.message,
                total_steps=event.total_steps,
                **requeue_count(event),
            )
        return await self.runs.update(
            account, event.run_id, seq, lambda view: lifecycle.apply_event(view, event), epoch
        )


def in_run(path: str, run_dir: str | None) -> str:
    """A checkpoint's path as the tenant reads it (`ecc ito checkpoints`): below its run's directory
    (`pretrain/step-00000012`), never the server's directories (issue 39)."""
    if run_dir and path.startswith(run_dir.rstrip("/") + "/"):
        return path[len(run_dir.rstrip("/")) + 1 :]
    return "/".join(pathlib.PurePosixPath(path).parts[-2:])
