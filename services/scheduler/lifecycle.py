"""The run state machine, enforced here and only here, and how run events change a run view.

`move` is the one writer of a run's state: the run store applies it inside its transaction
(`RunStore.move`), and its `update` refuses any other change of state (`NotAMove`). Every
transition (hand-off, cancel, approval, a silent trainer, a trainer's own report) goes through it.
"""

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

import msgspec

from contracts.api import Parallelism, RunView
from contracts.evals import Provenance, StageGate
from contracts.runs import (
    CheckpointSaved,
    DataProvenance,
    EvalResult,
    Interruption,
    LogLine,
    Metrics,
    ParallelismStarted,
    ProposalMade,
    RunCreated,
    RunEvent,
    StageStarted,
    StateChanged,
)
from contracts.states import ALLOWED_TRANSITIONS, RunState


class NotAMove(Exception):
    """A change of a run's state outside `move` (a programming error, never applied)."""

    def __init__(self, current: RunState, wanted: RunState) -> None:
        super().__init__(f"{current.value} -> {wanted.value} outside lifecycle.move")


class IllegalTransition(Exception):
    def __init__(self, current: RunState, wanted: RunState) -> None:
        super().__init__(f"illegal transition {current.value} -> {wanted.value}")
        self.current = current
        self.wanted = wanted


def transition(
    view: RunView,
    state: RunState,
    at: datetime,
    *,
    stage: str | None = None,
    message: str | None = None,
    total_steps: int = 0,
) -> RunView:
    """The run in its new state, or IllegalTransition: never applied when not in the table."""
    if state == view.state:
        return view
    if state not in ALLOWED_TRANSITIONS[view.state]:
        raise IllegalTransition(view.state, state)
    return msgspec.structs.replace(
        view,
        state=state,
        stage=stage or view.stage,
        message=message,
        total_steps=total_steps or view.total_steps,
        updated_at=at,
    )


def move(
    view: RunView,
    to: RunState | Mapping[RunState, RunState],
    at: datetime,
    *,
    allowed_from: frozenset[RunState] | None = None,
    stage: str | None = None,
    message: str | None = None,
    total_steps: int = 0,
    **fields: Any,
) -> RunView:
    """The run moved to `to` (or, given a mapping, to where it routes the current state).

    A run outside `allowed_from` (or the mapping's keys) is returned unchanged: someone moved it
    first, so this move no longer applies. Otherwise the table decides (IllegalTransition).
    `fields` are other view fields set in the same write (e.g. `proposal=None`)."""
    if isinstance(to, Mapping):
        allowed_from = frozenset(to) if allowed_from is None else allowed_from & frozenset(to)
        target = to.get(view.state)
    else:
        target = to
    if target is None or (allowed_from is not None and view.state not in allowed_from):
        return view
    moved = transition(view, target, at, stage=stage, message=message, total_steps=total_steps)
    return msgspec.structs.replace(moved, **fields) if fields and moved is not view else moved


def keeping_state(change: Callable[[RunView], RunView]) -> Callable[[RunView], RunView]:
    """`change` as a store's `update` applies it: a change of state raises NotAMove (only `move`
    changes a run's state). Both run store adapters wrap their `update` with it."""

    def kept(view: RunView) -> RunView:
        new = change(view)
        if new.state != view.state:
            raise NotAMove(view.state, new.state)
        return new

    return kept


def mover(
    to: RunState | Mapping[RunState, RunState],
    at: datetime,
    *,
    allowed_from: frozenset[RunState] | None = None,
    **details: Any,
) -> Callable[[RunView], RunView]:
    """The change a store's `move` applies inside its write: `move(view, to, at, ...)`."""
    return lambda view: move(view, to, at, allowed_from=allowed_from, **details)


def apply_event(view: RunView, event: RunEvent) -> RunView:
    """Fold one trainer event into the run's view (logs and checkpoints are stored beside it)."""
    match event:
        case StateChanged():
            return move(
                view,
                event.state,
                event.at,
                stage=event.stage,
                message=event.message,
                total_steps=event.total_steps,
            )
        case Metrics():
            return msgspec.structs.replace(
                view,
                stage=event.stage,
                step=event.step,
                total_steps=event.total_steps,
                loss=event.loss,
                updated_at=event.at,
            )
        case StageStarted():
            return msgspec.structs.replace(
                view, stage=event.stage, step=0, total_steps=event.total_steps, loss=None, updated_at=event.at
            )
        case EvalResult():
            gate = StageGate(
                stage=event.stage, passed=event.passed, metrics=event.metrics, findings=event.findings
            )
            gates = [g for g in view.gates if g.stage != event.stage] + [gate]
            return msgspec.structs.replace(view, gates=gates, updated_at=event.at)
        case DataProvenance():
            provenance = Provenance(
                steps=event.steps, input_digest=event.input_digest, output_digest=event.output_digest
            )
            return msgspec.structs.replace(view, provenance=provenance, updated_at=event.at)
        case CheckpointSaved():
            return msgspec.structs.replace(view, last_checkpoint_step=event.step, updated_at=event.at)
        case ProposalMade():
            return msgspec.structs.replace(view, proposal=event.proposal, updated_at=event.at)
        case ParallelismStarted():
            used = Parallelism(
                strategy=event.strategy,
                world_size=event.world_size,
                mesh=event.mesh,
                nodes=event.nodes,
                stage=event.stage,
            )
            return msgspec.structs.replace(view, parallelism=used, updated_at=event.at)
        case LogLine() | RunCreated() | Interruption():
            return view
    raise TypeError(f"unknown run event {type(event).__name__}")
