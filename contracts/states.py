"""Run states, the one table of transitions between them, and the sets the scheduler moves runs by.

The table is data; the scheduler's `lifecycle.move` is the single place that applies it (its run
store exposes no other way to change a run's state).
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
    # The run's spend reached its limit (budget_cap_usd, or the booking plus its allowed incremental
    # cost): stopped by the scheduler with a checkpoint committed, before the limit was crossed.
    budget_exhausted = "budget_exhausted"


TERMINAL_STATES: frozenset[RunState] = frozenset(
    {RunState.succeeded, RunState.failed, RunState.gate_failed, RunState.cancelled, RunState.budget_exhausted}
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
    RunState.cancelling: frozenset({RunState.cancelled, RunState.failed, RunState.budget_exhausted}),
    RunState.succeeded: frozenset(),
    RunState.failed: frozenset(),
    RunState.gate_failed: frozenset(),
    RunState.cancelled: frozenset(),
    RunState.budget_exhausted: frozenset(),
}

LEASABLE: frozenset[RunState] = frozenset(
    {RunState.accepted, RunState.queued, RunState.running, RunState.interrupted}
)
"""A trainer may (keep) training a run in these states; in any other it stops or skips the item."""

CANCEL_TO: dict[RunState, RunState] = {
    RunState.accepted: RunState.cancelled,  # no trainer works on these: cancelled at once
    RunState.queued: RunState.cancelled,
    RunState.interrupted: RunState.cancelled,
    RunState.awaiting_approval: RunState.cancelled,
    RunState.running: RunState.cancelling,  # the trainer stops after its step and reports `cancelled`
}
"""Where a cancel moves a run, by its current state; a run in no other state can be cancelled."""

CANCELLABLE: frozenset[RunState] = frozenset(CANCEL_TO)
CANCEL_AT_ONCE: frozenset[RunState] = frozenset(s for s, to in CANCEL_TO.items() if to is RunState.cancelled)
