"""What a follower node (n > 0 of a multi-node run) decides about its own share, as pure decisions
the worker applies: how an approved loss-spike restart rewinds the node's directory, what its
failure says to the run, and what becomes of its work item when its share is over.

What a user can expect of a run on N nodes (the run's state is the scheduler's, node 0 reports it):
  - An approved `restart_from_checkpoint` restarts every node (the scheduler republishes every
    node's work item with the restart). Each follower rewinds its own directory to the proposal's
    checkpoint step and skip window, as node 0 does, so that no replica group is ahead of the
    rewound one (torchft heals a lagging group from the furthest peer: a follower left ahead would
    undo node 0's rewind). A follower that no longer keeps that step (pruned while it trained on
    alone) sets aside every later checkpoint, starts from its newest one before it and heals from
    node 0 at the first quorum. The stage's recorded verdict and every later stage's directory are
    set aside too: node 0 trains them again, and so must the follower.
  - While the run awaits approval, a follower's lease is withdrawn: its loop stops, commits a
    checkpoint and its work item is acknowledged (the approval brings a fresh one); it never
    trains on a paused run.
  - A follower whose share raised (not because it was asked to stop) fails the run, with a
    message naming the node, unless the run was interrupted meanwhile (node 0 lost: its Lighthouse
    and rendezvous went with it, which is often why a follower fails); the follower reports only
    after the scheduler's watcher had time to notice a lost node 0 (the worker's
    NODE_FAILURE_GRACE_S), and an interrupted run's follower is requeued and rejoins when node 0
    resumes. A follower's agent lost outright is redelivered and rejoins (the lease decides).
"""

import enum
import pathlib
from collections.abc import Sequence

from contracts.api import LeaseAnswer, RestartProposal
from contracts.states import LEASABLE, RunState
from training.engine.checkpoint_dir import (
    DISCARDED,
    committed_positions,
    discard_from,
    list_checkpoints,
    mark_skip,
    rewind,
    set_aside,
)
from training.engine.distributed import ParallelismError
from training.launch.elastic import GangFailed, GangLost
from training.recipes.gate_reports import GATE_RECORD


class ItemEnd(enum.StrEnum):
    """What a follower does with its work item once its share is over."""

    ack = "ack"  # the share is over for good (the run finished, paused or failed)
    requeue = "requeue"  # given back with a delay: it rejoins (or asks again) later
    leave = "leave"  # neither: another agent holds this node's share, or will after AckWait


def rewind_share(node_dir: pathlib.Path, restart: RestartProposal, later_stages: Sequence[str]) -> str:
    """Carry out an approved restart in follower node `node_dir`: the same checkpoint step and
    skip window as node 0's. Returns what was done, as a log line."""
    stage_dir = node_dir / restart.stage
    stage_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    set_aside(stage_dir / GATE_RECORD, stage_dir / DISCARDED / GATE_RECORD)
    redone = [s for s in later_stages if set_aside(node_dir / s, node_dir / DISCARDED / s)]
    again = f"; set aside the later stages {', '.join(redone)}" if redone else ""
    step = restart.checkpoint_step
    window = f"skipping batches [{restart.skip_from}, {restart.skip_to})"
    if step == 0 or step in committed_positions(stage_dir):
        try:
            moved = rewind(stage_dir, step, restart.skip_from, restart.skip_to)
            return (
                f"approved restart: {restart.stage} from checkpoint step {step} (set aside later ones: "
                f"{moved}), {window}{again}"
            )
        except ValueError:  # this node recorded another data position there: heal from node 0 instead
            pass
    moved = discard_from(stage_dir, step)
    mark_skip(stage_dir, restart.skip_from, restart.skip_to)
    kept = [c.step for c in list_checkpoints(stage_dir)]
    start = f"its checkpoint step {max(kept)}" if kept else "the start"
    return (
        f"approved restart: {restart.stage} from checkpoint step {step}, which this node no longer "
        f"keeps (set aside: {moved}): resuming from {start} and healing from node 0, {window}{again}"
    )


def share_failure(exc: BaseException) -> str:
    """What a follower's failure says to the run: our own sentences as they are, any other error
    by its type alone (its text may hold paths or data). The scheduler makes it one capped line
    (liveness.node_failure_message)."""
    if isinstance(exc, ParallelismError | GangFailed | GangLost):
        return str(exc)
    return type(exc).__name__


def after_share(answer: LeaseAnswer | None, failed: bool) -> ItemEnd:
    """A follower's work item once its share stopped early (asked to, or `failed` and reported
    through its lease): `answer` is the lease's last word, None when the scheduler did not answer."""
    if answer is None:
        return ItemEnd.requeue if failed else ItemEnd.leave  # a failure is reported again on redelivery
    if answer.state is None or answer.state not in LEASABLE:
        return ItemEnd.ack  # finished, failed, paused for approval or being cancelled
    if failed and answer.state is RunState.interrupted:
        return ItemEnd.requeue  # node 0 was lost: rejoin when it resumes
    return ItemEnd.leave
