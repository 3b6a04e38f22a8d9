"""Run states and the one table of transitions between them.

The table is data; the scheduler's lifecycle module is the single place that enforces it.
"""

import enum


class RunState(enum.StrEnum):
    accepted = "accepted"  # ledger reserved the key and consumed the confirmation
    queued = "queued"  # handed to the trainer's work queue
    running = "running"
    interrupted = "interrupted"  # trainer lost; back on the queue to resume
    awaiting_approval = "awaiting_approval"  # paused, a proposal needs a confirmation
    cancelling = "cancelling"
    succeeded = "succeeded"
    failed = "failed"
    gate_failed = "gate_failed"  # an eval gate was not met; reported honestly, never overridden
    cancelled = "cancelled"


TERMINAL_STATES: frozenset[RunState] = frozenset(
    {RunState.succeeded, RunState.failed, RunState.gate_failed, RunState.cancelled}
)

ALLOWED_TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    RunState.accepted: frozenset({RunState.queued, RunState.failed, RunState.cancelling, RunState.cancelled}),
    RunState.queued: frozenset({RunState.running, RunState.failed, RunState.cancelling, RunState.cancelled}),
    RunState.running: frozenset(
        {
            RunState.succeeded,
            RunState.failed,
            RunState.gate_failed,
            RunState.interrupted,
            RunState.awaiting_approval,
            RunState.cancelling,
        }
    ),
    RunState.interrupted: frozenset(
        {RunState.queued, RunState.running, RunState.failed, RunState.cancelling, RunState.cancelled}
    ),
    RunState.awaiting_approval: frozenset(
        {RunState.queued, RunState.cancelling, RunState.cancelled, RunState.failed}
    ),
    RunState.cancelling: frozenset({RunState.cancelled, RunState.failed}),
    RunState.succeeded: frozenset(),
    RunState.failed: frozenset(),
    RunState.gate_failed: frozenset(),
    RunState.cancelled: frozenset(),
}
