"""One work item, start to end: lease, announce, train in a thread, report, acknowledge.

The message is acknowledged only after the run's final state is published. While training, the
worker tells JetStream it is still working (`in_progress`) so the message is not redelivered, and
re-checks its lease with the scheduler; if the process dies, the message comes back after AckWait
and the run resumes from its last committed checkpoint. A cancel notice (or a lost lease) stops
the loop within a step; the in-flight checkpoint is committed first.
"""

import asyncio
import logging
import os
import pathlib
import shutil
import socket
import threading
import time
import uuid

import msgspec
from faststream.nats import NatsBroker, NatsMessage

from contracts import subjects
from contracts.api import CleanupOrder, CleanupResult, LeaseAnswer, LeaseQuery, RemovedArtifact, RestartProposal
from contracts.errors import ErrorCode
from contracts.manifest import Manifest
from contracts.runs import ProposalMade, TrainWork
from contracts.states import RunState
from services.runtime import codec, faults
from services.runtime.codec import Refusal
from services.runtime.settings import ENV_TRAINER_THREADS, Settings
from services.trainer import spikes
from services.trainer.checkpoint import list_checkpoints, rewind
from services.trainer.emitter import Emitter
from services.trainer.pipeline import run_pipeline

log = logging.getLogger("ito.trainer.worker")

WORK_ACK_WAIT_S = 10  # a dead trainer's item comes back this long after its last in_progress
IN_PROGRESS_EVERY_S = 2.0  # well inside WORK_ACK_WAIT_S
RENEW_EVERY_S = 1.0  # the lease renewal is the heartbeat the scheduler's watcher listens for
SELF_FENCE_S = 3.0  # no renewal for this long: stop, since the scheduler declares us lost at 5 s
RETRY_LEASE_AFTER_S = 5  # the scheduler did not answer: give the item back, try again later

work_decoder = msgspec.json.Decoder(TrainWork)
manifest_decoder = msgspec.json.Decoder(Manifest)


def last_committed_step(checkpoint_dir: pathlib.Path) -> int | None:
    """The newest committed checkpoint's step across the run's stage directories, if any."""
    steps = [c.step for d in [checkpoint_dir, *checkpoint_dir.glob("*/")] if d.is_dir() for c in list_checkpoints(d)]
    return max(steps) if steps else None


class Stop:
    """Why the loop must stop: set once, read by the training thread between steps."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: str | None = None

    def set(self, reason: str) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


WATCHED_STAGES = frozenset({"pretrain", "midtrain", "long_context"})  # PaLM's remedy is for LM training;
# post-training losses (DPO margins, policy-gradient losses) swing by design and would page people for nothing


class SpikeWatch:
    """Sits between the pipeline and the bus: every step's loss goes through the spike detector; a
    spike stops the loop (its checkpoint is committed first) so the run can be paused for approval."""

    def __init__(self, emit, stop: Stop, planted: bool = False) -> None:
        self._emit = emit
        self.stop = stop
        self.detector = spikes.SpikeDetector()
        self.planted_from = int(os.environ.get(faults.ENV_SPIKE_STEP, "60")) if planted else None
        self.stage, self.spike_step, self.total_steps, self.reason = "", 0, 0, ""
        self._stage_seen = ""

    def emit(self, kind: str, payload: dict) -> None:
        if kind == "metrics" and payload["stage"] in WATCHED_STAGES:
            if payload["stage"] != self._stage_seen:  # each stage has its own loss scale
                self._stage_seen, self.detector = payload["stage"], spikes.SpikeDetector()
            if self.planted_from is not None and payload["step"] >= self.planted_from:
                payload = {**payload, "loss": payload["loss"] * 10.0}  # fault injection (tests, make chaos)
            if self.detector.observe(payload["step"], payload["loss"], payload["grad_norm"]) and not self.stop.is_set():
                self.stage, self.total_steps = payload["stage"], payload["total_steps"]
                self.spike_step = self.detector.first_spike_step or payload["step"]
                self.reason = (f"loss above mean + {spikes.K_SIGMA:g} sigma of the last {spikes.WINDOW} steps "
                               f"for {spikes.CONSECUTIVE} steps")
                self.stop.set("loss_spike")
        self._emit(kind, payload)


class Worker:
    def __init__(self, broker: NatsBroker, settings: Settings) -> None:
        self.broker = broker
        self.settings = settings
        self.threads = int(os.environ.get(ENV_TRAINER_THREADS) or os.cpu_count() or 1)
        self.trainer_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.stops: dict[str, Stop] = {}

    def cancel(self, run_id: str) -> None:
        stop = self.stops.get(run_id)
        if stop is not None:
            log.info("run %s: cancel notice received; stopping after this step", run_id)
            stop.set("cancelled")

    async def lease(self, run_id: str, epoch: int = 0) -> LeaseAnswer | None:
        """Ask for (epoch 0) or renew a run's lease; None when the scheduler did not answer."""
        try:
            query = LeaseQuery(run_id=run_id, trainer_id=self.trainer_id, epoch=epoch)
            reply = await self.broker.request(codec.encode(query),
                                              self.settings.subject(subjects.RUN_LEASE),
                                              timeout=self.settings.request_timeout_s)
            return codec.unwrap(reply.body, LeaseAnswer)
        except Exception:  # no answer is not a yes
            return None

    async def _keep_alive(self, msg: NatsMessage, run_id: str, epoch: int, stop: Stop) -> None:
        last_renewed = last_progress = time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(RENEW_EVERY_S)
            now = time.monotonic()
            if now - last_progress >= IN_PROGRESS_EVERY_S:
                try:
                    await msg.raw_message.in_progress()
                    last_progress = now
                except Exception:  # a bus outage: retry next tick; JetStream may redeliver meanwhile
                    log.warning("run %s: could not extend the work item's ack deadline", run_id)
            answer = await self.lease(run_id, epoch)
            if answer is None:
                if time.monotonic() - last_renewed > SELF_FENCE_S:
                    log.warning("run %s: no lease renewal for %.0fs; stopping (fenced)", run_id, SELF_FENCE_S)
                    stop.set("fenced")
            elif answer.proceed:
                last_renewed = time.monotonic()
            else:
                cancelled = answer.state in (RunState.cancelling, RunState.cancelled)
                log.info("run %s: lease withdrawn (%s); stopping", run_id, answer.state)
                stop.set("cancelled" if cancelled else "fenced")

    async def handle(self, msg: NatsMessage) -> None:
        try:
            work = work_decoder.decode(msg.body)
            manifest = manifest_decoder.decode(work.manifest_text.encode())
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.error("work item rejected (terminated, not trained): %s", exc)
            await msg.raw_message.term()
            return
        answer = await self.lease(work.run_id)  # a new lease: epoch 0 asks for the next epoch
        if answer is None:
            log.warning("run %s: the scheduler did not answer the lease; retrying in %ds", work.run_id,
                        RETRY_LEASE_AFTER_S)
            await msg.raw_message.nak(delay=RETRY_LEASE_AFTER_S)
            return
        if not answer.proceed:
            log.info("run %s is %s; not training it", work.run_id, answer.state)
            await msg.ack()
            return
        await self._train(msg, work, manifest, answer.epoch)

    async def _train(self, msg: NatsMessage, work: TrainWork, manifest: Manifest, epoch: int) -> None:
        emitter = Emitter(self.broker, self.settings, work.run_id, asyncio.get_running_loop(), epoch)
        stop = self.stops[work.run_id] = Stop()
        keep_alive = asyncio.create_task(self._keep_alive(msg, work.run_id, epoch, stop))
        checkpoint_dir = pathlib.Path(work.checkpoint_dir)
        watch = SpikeWatch(emitter.from_thread, stop, planted=faults.active(faults.TRAINER_LOSS_SPIKE)
                           and work.restart is None)
        try:
            if work.restart is not None:
                r = work.restart
                moved = rewind(checkpoint_dir / r.stage, r.checkpoint_step, r.skip_from, r.skip_to)
                await emitter.log(f"approved restart: {r.stage} from checkpoint step {r.checkpoint_step} "
                                  f"(set aside later ones: {moved}), skipping batches [{r.skip_from}, {r.skip_to})")
            await emitter.state(RunState.running, message="training started")
            result = await asyncio.to_thread(run_pipeline, manifest, checkpoint_dir, watch.emit,
                                             stop.is_set, self.threads)
            if stop.reason == "fenced":
                # Another trainer holds (or will hold) the run: report nothing, acknowledge nothing.
                log.warning("run %s: fenced at epoch %d; leaving it to the new lease holder", work.run_id, epoch)
                return
            await emitter.log(result.summary)
            if stop.reason == "loss_spike":
                await self._propose(emitter, checkpoint_dir, watch)
            elif stop.is_set():
                step = last_committed_step(checkpoint_dir)
                kept = f"; last checkpoint at step {step}" if step is not None else "; no checkpoint yet"
                await emitter.state(RunState.cancelled, stage=result.last_stage, message="cancelled" + kept)
            elif getattr(result, "outcome", "succeeded") == "gate_failed":
                await emitter.state(RunState.gate_failed, stage=result.last_stage, message=result.summary)
            else:
                await emitter.state(RunState.succeeded, stage=result.last_stage, message=result.summary)
        except Exception as exc:  # the run failed; report it as state and stop redelivery
            log.exception("run %s failed", work.run_id)
            await emitter.state(RunState.failed, message=f"training failed: {type(exc).__name__}")
        finally:
            keep_alive.cancel()
            self.stops.pop(work.run_id, None)
        if stop.reason != "fenced":
            await msg.ack()

    async def _propose(self, emitter: Emitter, checkpoint_dir: pathlib.Path, watch: "SpikeWatch") -> None:
        """Pause the run with PaLM's remedy as a proposal; only a confirmed approval restarts it."""
        committed = [c.step for c in list_checkpoints(checkpoint_dir / watch.stage)]
        proposal = spikes.propose(watch.stage, watch.spike_step, watch.total_steps, committed, watch.reason) or \
            RestartProposal(stage=watch.stage, checkpoint_step=0, skip_from=0, skip_to=watch.spike_step,
                            spike_step=watch.spike_step, reason=watch.reason + "; no checkpoint before it")
        await emitter.publish(ProposalMade(**emitter.base(), proposal=proposal))
        await emitter.state(RunState.awaiting_approval, stage=watch.stage, message=(
            f"loss spike at {watch.stage} step {watch.spike_step} ({watch.reason}); proposed: restart from "
            f"checkpoint step {proposal.checkpoint_step}, skipping batches [{proposal.skip_from}, {proposal.skip_to}). "
            "Waiting for a restart_from_checkpoint confirmation."))

    async def cleanup(self, order: CleanupOrder) -> CleanupResult:
        """Remove a finished run's artifacts and say what was removed. Only a directory that is
        named for this account and run is ever touched."""
        path = pathlib.Path(order.checkpoint_dir)
        if not path.is_absolute() or path.parts[-2:] != (order.account, order.run_id) or path.is_symlink():
            raise Refusal(ErrorCode.forbidden, "the checkpoint directory is not this run's")
        removed = []
        if path.exists():
            for file in sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink()):
                removed.append(RemovedArtifact(path=str(file), bytes=file.stat().st_size))
            shutil.rmtree(path)
        log.info("run %s: cleanup removed %d artifacts", order.run_id, len(removed))
        return CleanupResult(run_id=order.run_id, removed=removed)
