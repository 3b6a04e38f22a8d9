"""What the desk reads through the scheduler: every run (not one account's), one run in detail.

The desk identity (runtime/security/identities.py) may ask these two endpoints and read the DESK
stream, nothing else: no tenant verb, no Redis. Answers carry the same views a tenant sees of its
own runs, plus the history only the desk needs (state changes, interruptions, the audit trail).
"""

from datetime import datetime

from contracts.api import LogLineView, RunView
from contracts.audit import GateDecision
from contracts.base import Contract, Internal
from contracts.runs import CheckpointSaved, Metrics
from contracts.states import RunState


class DeskRunsRequest(Contract, frozen=True, kw_only=True):
    limit: int = 200  # the newest runs first; capped by the scheduler


class DeskRuns(Internal, frozen=True, kw_only=True):
    runs: list[RunView]  # newest first
    prices: dict[str, float] = {}  # GPU model -> the desk's price per GPU-hour (USD)
    at: datetime


class StateRecord(Internal, frozen=True, kw_only=True):
    """One move of a run's state, as the scheduler applied it."""

    state: RunState
    at: datetime
    message: str | None = None


class InterruptionRecord(Internal, frozen=True, kw_only=True):
    """The liveness watcher's record of a trainer gone silent (scheduler/liveness.py)."""

    detected_at: float  # epoch seconds
    silent_s: float
    cause: str
    step: int = 0
    stage: str | None = None


class DeskRunRequest(Contract, frozen=True, kw_only=True):
    run_id: str
    metrics_since: int = 0  # index of the first metric point wanted (a page, like `ecc ito metrics`)
    metrics_limit: int = 5000
    logs_since: int = 0
    audit: bool = False  # the audit trail replays a stream (~0.3 s): asked for only when wanted


class DeskRun(Internal, frozen=True, kw_only=True):
    view: RunView
    metrics: list[Metrics]
    metrics_next: int
    checkpoints: list[CheckpointSaved]
    states: list[StateRecord]
    interruptions: list[InterruptionRecord]
    logs: list[LogLineView]
    logs_next: int
    audit: list[GateDecision] | None = None  # None when not asked for
