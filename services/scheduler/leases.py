"""The trainer's lease and heartbeat, and the watcher that marks a run with a lost trainer `interrupted`.

A trainer leases a run before it trains it (epoch 0 asks for the next epoch, with its work item's
binding) and renews the lease every `renew_every_s`; each renewal is its heartbeat (`heartbeat`,
on the RUN_LEASE subject). The watcher marks a run silent for `silence_s` as interrupted and records
the interruption (for desk telemetry). A multi-node run's nodes each hold a lease of their own
(`LeaseQuery.node_rank`, below the run's `nodes`): node 0's is the run's (its holder alone reports
events; the watcher follows it); another node's lease fences that node's agents alike, and its
holder reports its share's failure through it (`LeaseQuery.failure`): the run fails naming the node
(`node_failure_message`), through `move` as every transition. The work item itself comes back from JetStream when its ack
deadline passes, and the next trainer leases the run with a higher epoch: the old holder, if it was
only cut off, is fenced (its renewals and its events are refused) and has stopped by itself before
the new one can start. The timers and their ordering: runtime/configuration/timers.py.
"""

import asyncio
import logging
import time
from datetime import UTC, datetime
from typing import Any

import msgspec

from contracts.api import LeaseAnswer, LeaseQuery, RunView
from contracts.errors import ErrorCode
from contracts.runs import Interruption
from contracts.states import LEASABLE, TERMINAL_STATES, RunState
from domain import budget
from runtime.configuration.timers import TIMERS
from runtime.messaging import codec
from services.scheduler.publish import RunEventPublisher
from services.scheduler.store import Runs

log = logging.getLogger("ito.scheduler.liveness")

SILENCE_S = TIMERS.silence_s  # no renewal for this long: the trainer is lost
WATCH_EVERY_S = TIMERS.watch_every_s
_RUNNING = frozenset({RunState.running})


FAILABLE_BY_NODE = frozenset({RunState.accepted, RunState.queued, RunState.running})
# not `interrupted`: node 0 was lost, and with it the Lighthouse and rendezvous a follower needs
MAX_FAILURE_CHARS = 300  # a node's own sentence, capped: it becomes the run's message


def node_failure_message(node_rank: int, failure: str) -> str:
    """The run's message when node `node_rank`'s share failed."""
    said = " ".join(failure.split())[:MAX_FAILURE_CHARS] or "no reason given"
    return f"training failed: node {node_rank} failed: {said}"


def binding_matches(view: RunView, req: LeaseQuery) -> bool:
    """Is the work item in the trainer's hands this run's (account, booking, manifest, plan)?"""
    return (req.account, req.booking_id, req.manifest_digest, req.plan_sha256) == (
        view.account,
        view.booking_id,
        view.manifest_digest,
        codec.digest(view.plan),
    )


_METERED = frozenset({RunState.running, RunState.cancelling})  # cancelling: the last reading, at the stop


def metering(req: LeaseQuery, view: RunView | None, epoch: int) -> bool:
    """Is this a meter reading to keep: node 0's renewal at the lease's current epoch, of a run
    that holds its GPUs (running, or stopping)?"""
    return (
        view is not None
        and req.held_gpus > 0
        and req.epoch > 0
        and req.epoch == epoch
        and req.node_rank == 0
        and view.state in _METERED
    )


class Heartbeats:
    """Answers a trainer's lease queries (RUN_LEASE): a new lease, or a renewal, its heartbeat."""

    def __init__(self, runs: Runs) -> None:
        self.runs = runs

    async def heartbeat(self, req: LeaseQuery) -> LeaseAnswer:
        account = await self.runs.owner(req.run_id)
        if account is None:
            return LeaseAnswer(run_id=req.run_id, proceed=False)
        if req.epoch == 0 or req.node_rank:  # a new lease: the work item must be this run's
            view = await self.runs.get(account, req.run_id)
            if view is None or not 0 <= req.node_rank < view.nodes:
                log.warning("run %s: lease refused, the run has no node %d", req.run_id, req.node_rank)
                return LeaseAnswer(run_id=req.run_id, proceed=False)
            if req.epoch == 0 and not binding_matches(view, req):
                log.warning("run %s: lease refused, the work item does not match the run record", req.run_id)
                return LeaseAnswer(run_id=req.run_id, proceed=False)
        granted, current, epoch = await self.runs.lease(
            account,
            req.run_id,
            req.trainer_id,
            req.epoch,
            time.time(),
            SILENCE_S,
            lambda v: v.state in LEASABLE,
            node=req.node_rank,
        )
        if granted and req.failure and req.node_rank and req.epoch:
            return await self._node_failed(account, req, epoch)
        if metering(req, current, epoch) and current is not None:
            current = await self._metered(account, req, current)
            granted = granted and current.state in LEASABLE
        spend = current.spend if current else None
        return LeaseAnswer(
            run_id=req.run_id,
            proceed=granted,
            state=current.state if current else None,
            epoch=epoch,
            gang_requeues=current.gang_requeues if current else 0,
            held_gpu_s=spend.held_gpu_s if spend else 0.0,
            stop_code=current.stop_code if current else "",
        )

    async def _metered(self, account: str, req: LeaseQuery, view: RunView) -> RunView:
        """Node 0's meter reading, kept (it only grows), and the budget decided on it: a run whose
        spend would reach its limit before a clean stop is over moves to `cancelling` with
        `stop_code` budget_exhausted; its trainer stops with a checkpoint (domain/budget.py)."""
        if view.plan is None or view.spend is None:
            return view
        cost, limit = view.plan.cost, view.spend.limit_usd
        held_gpu_s = max(view.spend.held_gpu_s, req.held_gpu_s)
        spend = msgspec.structs.replace(
            view.spend,
            held_gpus=req.held_gpus,
            held_gpu_s=held_gpu_s,
            spent_usd=round(budget.spend_usd(held_gpu_s, cost), 6),
            at=datetime.now(UTC),
        )
        updated, _ = await self.runs.update(
            account, req.run_id, None, lambda v: msgspec.structs.replace(v, spend=spend)
        )
        view = updated or view
        v = budget.verdict(req.held_gpus, held_gpu_s, req.stop_s, cost, limit, TIMERS.renew_every_s)
        if not v.stop or view.state is not RunState.running:
            return view
        message = budget.stopping_message(v)
        moved, _ = await self.runs.move(
            account,
            req.run_id,
            RunState.cancelling,
            allowed_from=_RUNNING,
            message=message,
            stop_code=ErrorCode.budget_exhausted.value,
        )
        log.warning("run %s: %s", req.run_id, message)
        return moved or view

    async def _node_failed(self, account: str, req: LeaseQuery, epoch: int) -> LeaseAnswer:
        """Node n > 0's holder (at its epoch, just renewed) says its share failed: the run fails
        naming the node, unless it moved on meanwhile (finished, paused, cancelling)."""
        message = node_failure_message(req.node_rank, req.failure)
        updated, _ = await self.runs.move(
            account, req.run_id, RunState.failed, allowed_from=FAILABLE_BY_NODE, message=message
        )
        log.warning("run %s: %s", req.run_id, message)
        return LeaseAnswer(
            run_id=req.run_id,
            proceed=False,
            state=updated.state if updated else None,
            epoch=epoch,
            gang_requeues=updated.gang_requeues if updated else 0,
        )


async def silent_for(runs: Runs, run_id: str, account: str, now: float) -> float | None:
    """How long a running run's trainer has been silent past SILENCE_S, or None (a finished run
    leaves the lease index here)."""
    view = await runs.get(account, run_id)
    if view is None or view.state in TERMINAL_STATES:
        await runs.release_lease(run_id)
        return None
    seen = await runs.lease_seen(account, run_id)
    if view.state is not RunState.running or seen is None or now - seen <= SILENCE_S:
        return None
    return now - seen


async def interrupt(
    runs: Runs, run_id: str, account: str, silent: float, now: float, events: RunEventPublisher | None
) -> bool:
    """Move a silent run to `interrupted` and record why; False when it moved on meanwhile.

    Every scheduler instance runs a watcher. When two find the same silent run, the store's
    compare-and-set lets one move it; the other's move finds it interrupted already and leaves it
    as it is, yet is answered with the view: only the watcher whose own move (its `at`) the view
    carries records the interruption and publishes its event, so there is one of each."""
    at = datetime.now(UTC)
    updated, applied = await runs.move(
        account,
        run_id,
        RunState.interrupted,
        allowed_from=_RUNNING,
        at=at,
        message=f"trainer silent for {silent:.1f}s; resuming from the last checkpoint",
    )
    if (
        not applied
        or updated is None
        or updated.state is not RunState.interrupted
        or updated.updated_at != at
    ):
        return False
    record: dict[str, Any] = {
        "detected_at": now,
        "silent_s": round(silent, 3),
        "cause": "trainer_lost",
        "step": updated.step,
        "stage": updated.stage,
    }
    await runs.record_interruption(account, run_id, record)
    if events is not None:
        await events.publish(
            Interruption(
                **events.base(run_id), cause="trainer_lost", silent_s=round(silent, 3), step=updated.step
            ),
            f"{run_id}:interruption:{int(now)}",
        )
    log.warning("run %s: trainer silent for %.1fs; marked interrupted", run_id, silent)
    return True


async def watch_once(runs: Runs, now: float, events: RunEventPublisher | None = None) -> list[str]:
    """Mark silent running runs interrupted; returns their ids."""
    interrupted = []
    for run_id, account in (await runs.leased()).items():
        silent = await silent_for(runs, run_id, account, now)
        if silent is not None and await interrupt(runs, run_id, account, silent, now, events):
            interrupted.append(run_id)
    return interrupted


async def watch_forever(runs: Runs, events: RunEventPublisher) -> None:
    while True:
        await asyncio.sleep(WATCH_EVERY_S)
        try:
            await watch_once(runs, time.time(), events)
        except Exception:  # an outage must not end the watcher; it retries on the next tick
            log.exception("liveness pass failed; retrying")
