"""Detect a lost trainer in seconds: a run whose lease holder stopped renewing is `interrupted`.

A trainer renews its lease every RENEW_EVERY_S (services/trainer/worker.py); the renewal is its
heartbeat. The watcher marks a run silent for SILENCE_S as interrupted and records the
interruption (for desk telemetry). The work item itself comes back from JetStream when its ack
deadline passes, and the next trainer leases the run with a higher epoch: the old holder, if it was
only cut off, is fenced (its renewals and its events are refused) and stops by itself before the
new one can start, because it gives up after SELF_FENCE_S < SILENCE_S without a renewal.
"""

import asyncio
import logging
import time
from datetime import UTC, datetime

from contracts.api import RunView
from contracts.runs import Interruption
from contracts.states import TERMINAL_STATES, RunState
from services.scheduler import lifecycle
from services.scheduler.publish import RunEventPublisher
from services.scheduler.store import RunStore

log = logging.getLogger("ito.scheduler.liveness")

SILENCE_S = 5.0  # no renewal for this long: the trainer is lost (the target: detect within 10 s)
WATCH_EVERY_S = 1.0


async def watch_once(runs: RunStore, now: float, events: RunEventPublisher | None = None) -> list[str]:
    """Mark silent running runs interrupted; returns their ids."""
    interrupted = []
    for run_id, account in (await runs.leased()).items():
        view = await runs.get(account, run_id)
        if view is None or view.state in TERMINAL_STATES:
            await runs.release_lease(run_id)
            continue
        seen = await runs.lease_seen(account, run_id)
        if view.state is not RunState.running or seen is None or now - seen <= SILENCE_S:
            continue
        silent = now - seen

        def to_interrupted(v: RunView, silent: float = silent) -> RunView:
            if v.state is not RunState.running:
                return v
            return lifecycle.transition(
                v,
                RunState.interrupted,
                datetime.now(UTC),
                message=f"trainer silent for {silent:.1f}s; resuming from the last checkpoint",
            )

        updated, applied = await runs.update(account, run_id, None, to_interrupted)
        if applied and updated is not None and updated.state is RunState.interrupted:
            await runs.record_interruption(
                account,
                run_id,
                {
                    "detected_at": now,
                    "silent_s": round(silent, 3),
                    "cause": "trainer_lost",
                    "step": updated.step,
                    "stage": updated.stage,
                },
            )
            if events is not None:
                await events.publish(
                    Interruption(
                        **events.base(run_id),
                        cause="trainer_lost",
                        silent_s=round(silent, 3),
                        step=updated.step,
                    ),
                    f"{run_id}:interruption:{int(now)}",
                )
            log.warning("run %s: trainer silent for %.1fs; marked interrupted", run_id, silent)
            interrupted.append(run_id)
    return interrupted


async def watch_forever(runs: RunStore, events: RunEventPublisher) -> None:
    while True:
        await asyncio.sleep(WATCH_EVERY_S)
        try:
            await watch_once(runs, time.time(), events)
        except Exception:  # an outage must not end the watcher; it retries on the next tick
            log.exception("liveness pass failed; retrying")
