"""One work item, start to end: lease, announce, train in a thread, report, acknowledge.

The message is acknowledged only after the run's final state is published. While training, the
worker tells JetStream it is still working (`in_progress`) so the message is not redelivered, and
re-checks its lease with the scheduler; if the process dies, the message comes back after AckWait
and the run resumes from its last committed checkpoint. A cancel notice (or a lost lease) stops
the loop within a step; the in-flight checkpoint is committed first. A gang lost past its
launcher's restarts interrupts the run the same way: the item is given back and resumes from the
last committed checkpoint, at most `ITO_GANG_MAX_REQUEUES` times (then the run fails); the count is
the run's (`gang_requeues`, kept by the scheduler and read from the lease), so a redelivery for any
other reason (a lost agent, a fence, a lease retry) costs none of them.

A multi-node run comes as one work item per node (training/launch/multinode.py). Node 0's is handled
as any run's: it reports the run's events and final state. Another node leases its own share
(`LeaseQuery.node_rank`, fenced alike), trains as a replica group, writes its events to a per-node
log (`<run dir>/node-<n>/node.jsonl`) and publishes nothing; its item is acknowledged when its
share is over (trained, or the run finished, failed or paused meanwhile). The run's state is node
0's: a node's agent lost mid-run is a replica group the others train on without (torchft) until its
item is redelivered, not a failed run; a node whose share raised fails the run through its lease,
naming the node; an approved restart rewinds every node alike (services/trainer/follower.py).
"""

import asyncio
import logging
import os
import pathlib
import shutil
import socket
import time
import uuid
from functools import partial
from typing import Any

import msgspec
from faststream.nats import NatsMessage

from contracts import subjects
from contracts.api import (
    CleanupOrder,
    CleanupResult,
    LeaseAnswer,
    LeaseQuery,
    RemovedArtifact,
)
from contracts.errors import ErrorCode
from contracts.exports import DownloadChunk, DownloadOrder, ExportOrder, ExportView, SampleOrder, SampleResult
from contracts.manifest import Manifest
from contracts.runs import RunEvent, StopReason, TrainWork
from contracts.states import LEASABLE, TERMINAL_STATES, RunState
from domain.curriculum import Curriculum, CurriculumMismatch, bound_curriculum
from runtime.configuration import faults
from runtime.configuration.settings import Settings
from runtime.configuration.timers import TIMERS
from runtime.messaging import codec
from runtime.messaging.bus import Bus
from runtime.messaging.codec import Refusal
from runtime.storage.checkpoint_paths import inside, run_dir, storage_root
from runtime.storage.model_store import ModelStore
from services.trainer import exports, follower, sampling, storage
from services.trainer.emitter import Emitter
from services.trainer.endings import (
    SpikeWatch,
    Stop,
    final_state,
    lost_gang_state,
    pause_for_approval,
    spent,
)
from services.trainer.inputs import InputsUnavailable, materialize
from services.trainer.meter import Meter
from services.trainer.storage import StorageUnavailable
from services.trainer.trainer_settings import TrainerSettings
from training.engine.checkpoint_dir import rewind
from training.engine.distributed import ParallelismError
from training.engine.reporting import EventFile, Reporter
from training.engine.speed import data_parallel_of, speed_for_plan
from training.launch import launcher, multinode
from training.launch.elastic import GangFailed, GangLost
from training.recipes.pipeline import run_pipeline

log = logging.getLogger("ito.trainer.worker")

# The liveness timers and their ordering live in one checked object (runtime/configuration/timers.py).
WORK_ACK_WAIT_S = TIMERS.ack_wait_s  # a dead trainer's item comes back this long after its last in_progress
IN_PROGRESS_EVERY_S = TIMERS.in_progress_every_s
RENEW_EVERY_S = TIMERS.renew_every_s  # the lease renewal is the heartbeat the scheduler's watcher listens for
SELF_FENCE_S = TIMERS.self_fence_s  # no renewal for this long: stop; the scheduler's silence_s is longer
RETRY_LEASE_AFTER_S = 5  # the scheduler did not answer: give the item back, try again later
FINAL_STATE_WAIT_S = 15.0  # the item is acked only once the scheduler shows the final state
REQUEUE_AFTER_S = 5  # an interrupted gang's work item is delivered again after this long
# A follower that failed reports it only this long after, lease kept: a lost node 0 is noticed first
NODE_FAILURE_GRACE_S = TIMERS.silence_s + 2 * TIMERS.watch_every_s

work_decoder = msgspec.json.Decoder(TrainWork)
manifest_decoder = msgspec.json.Decoder(Manifest)


def decode_work(body: bytes) -> tuple[TrainWork, Manifest]:
    """A work item and the manifest it carries, or msgspec's error (the item is then terminated)."""
    work = work_decoder.decode(body)
    return work, manifest_decoder.decode(work.manifest_text.encode())


class Worker:
    def __init__(self, bus: Bus, settings: Settings, trainer_settings: TrainerSettings) -> None:
        self.bus = bus  # lease queries and run events (runtime/messaging/bus.py)
        self.settings = settings
        self.trainer_settings = trainer_settings  # the agent's own, read once at start (app.register)
        self.threads = trainer_settings.threads
        self.trainer_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.stops: dict[str, Stop] = {}
        self.epochs: dict[str, int] = {}
        self.node_ranks: dict[str, int] = {}  # a multi-node run's share this agent holds (0 otherwise)
        self.meters: dict[str, Meter] = {}  # node 0's meter of each run it trains
        self.checkpoint_root = settings.data_dir / "checkpoints"
        self.exports = exports.Exports(settings.model_store, self.trainer_id)
        self.sampler = sampling.Sampler(settings.model_store)

    async def cancel(self, run_id: str) -> None:
        """A (signed) cancel notice is a hint to look now: the lease says whether the run really
        is being cancelled, so a notice alone never stops a run."""
        stop, epoch = self.stops.get(run_id), self.epochs.get(run_id)
        if stop is None or epoch is None:
            return
        answer = await self.lease(run_id, epoch, node_rank=self.node_ranks.get(run_id, 0))
        if (
            answer is not None
            and not answer.proceed
            and answer.state in (RunState.cancelling, RunState.cancelled)
        ):
            log.info("run %s: cancel confirmed by the lease; stopping after this step", run_id)
            stop.set(StopReason.cancelled)
        else:
            log.warning("run %s: cancel notice not backed by the run's state; training on", run_id)

    async def lease(
        self,
        run_id: str,
        epoch: int = 0,
        work: TrainWork | None = None,
        node_rank: int = 0,
        failure: str = "",
    ) -> LeaseAnswer | None:
        """Ask for (epoch 0, with the work item's binding) or renew a run's lease (of node
        `node_rank`'s share, saying its `failure` if it failed; node 0's renewal carries its meter);
        None when the scheduler did not answer."""
        meter = self.meters.get(run_id) if epoch and not node_rank else None
        try:
            binding = (
                {}
                if work is None
                else {
                    "account": work.account,
                    "booking_id": work.booking_id,
                    "manifest_digest": work.manifest_digest,
                    "plan_sha256": codec.digest(work.plan),
                }
            )
            query = LeaseQuery(
                run_id=run_id,
                trainer_id=self.trainer_id,
                epoch=epoch,
                node_rank=work.node_rank if work is not None else node_rank,
                failure=failure,
                held_gpus=meter.held_gpus if meter is not None else 0,
                held_gpu_s=round(meter.held_gpu_s(), 3) if meter is not None else 0.0,
                stop_s=round(meter.stop_s(), 3) if meter is not None else 0.0,
                **binding,
            )
            reply = await self.bus.request(
                self.settings.subject(subjects.RUN_LEASE),
                codec.encode(query),
                None,
                self.settings.request_timeout_s,
            )
            return codec.unwrap(reply, LeaseAnswer)
        except Exception:  # no answer is not a yes
            return None

    async def _keep_alive(
        self, msg: NatsMessage, run_id: str, epoch: int, stop: Stop, node_rank: int = 0
    ) -> None:
        last_renewed = last_progress = time.monotonic()
        # Until cancelled, a stop included: the training thread may take a while to stop (its checkpoint
        # commits; node 0 of a multi-node run waits for the other nodes to finish the stage), and a
        # lease silent meanwhile would have the run marked interrupted and the item redelivered.
        while True:
            await asyncio.sleep(RENEW_EVERY_S)
            now = time.monotonic()
            if now - last_progress >= IN_PROGRESS_EVERY_S:
                try:
                    await msg.raw_message.in_progress()
                    last_progress = now
                except Exception:  # a bus outage: retry next tick; JetStream may redeliver meanwhile
                    log.warning("run %s: could not extend the work item's ack deadline", run_id)
            answer = await self.lease(run_id, epoch, node_rank=node_rank)
            if answer is None:
                if time.monotonic() - last_renewed > SELF_FENCE_S and not stop.is_set():
                    log.warning("run %s: no lease renewal for %.0fs; stopping (fenced)", run_id, SELF_FENCE_S)
                    stop.set(StopReason.fenced)
            elif answer.proceed:
                last_renewed = time.monotonic()
            elif not stop.is_set():
                cancelled = answer.state in (RunState.cancelling, RunState.cancelled)
                log.info("run %s: lease withdrawn (%s); stopping", run_id, answer.state)
                if cancelled and answer.stop_code == ErrorCode.budget_exhausted.value:
                    stop.set(StopReason.budget_exhausted)
                else:
                    stop.set(StopReason.cancelled if cancelled else StopReason.fenced)

    async def handle(self, msg: NatsMessage, work: TrainWork, manifest: Manifest) -> None:
        """Train one work item, decoded and its signature checked at the edge (app.on_work); `msg`
        is kept for its acknowledgement."""
        answer = await self.lease(work.run_id, work=work)  # a new lease: epoch 0 asks for the next epoch
        if answer is None:
            log.warning(
                "run %s: the scheduler did not answer the lease; retrying in %ds",
                work.run_id,
                RETRY_LEASE_AFTER_S,
            )
            await msg.raw_message.nak(delay=RETRY_LEASE_AFTER_S)
            return
        if not answer.proceed and answer.state in LEASABLE:
            # Another trainer held this share within the silence window (a paused run's node that
            # just stopped, when an approved restart's item comes to another agent): ask again once
            # its lease lapses, instead of dropping the item.
            log.info("run %s: node %d's lease is held elsewhere; retrying", work.run_id, work.node_rank)
            await msg.raw_message.nak(delay=RETRY_LEASE_AFTER_S)
            return
        if not answer.proceed:
            log.info("run %s is %s; not training it", work.run_id, answer.state)
            await msg.ack()
            return
        if work.node_rank:
            await self._train_share(msg, work, manifest, answer.epoch)
        else:
            slow = self.trainer_settings.fault(faults.TRAINER_SLOW_STEPS)  # fault injection (chaos tests)
            delay_s = self.trainer_settings.fault_step_delay_s if slow else 0.0
            self.meters[work.run_id] = Meter(work.plan.cost.gpus, answer.held_gpu_s, delay_s)
            await self._train(msg, work, manifest, answer.epoch, answer.gang_requeues)

    async def _train(
        self, msg: NatsMessage, work: TrainWork, manifest: Manifest, epoch: int, gang_requeues: int = 0
    ) -> None:
        emitter = Emitter(self.bus, self.settings, work.run_id, asyncio.get_running_loop(), epoch)
        stop = self.stops[work.run_id] = Stop()
        self.epochs[work.run_id] = epoch
        keep_alive = asyncio.create_task(self._keep_alive(msg, work.run_id, epoch, stop))
        # Derived from our own root, never taken from the message.
        checkpoint_dir = run_dir(self.checkpoint_root, manifest.checkpoint.storage, work.account, work.run_id)
        final: RunState | None = None
        try:
            await self._prepare_storage(manifest, checkpoint_dir, work)
            final = await self._run(emitter, work, manifest, checkpoint_dir, stop)
        except GangLost as exc:  # past the launcher's restarts: interrupted and requeued, within a bound
            final, message, requeues = lost_gang_state(
                exc, gang_requeues, self.trainer_settings.gang_max_requeues
            )
            log.warning("run %s: %s", work.run_id, message)
            await emitter.state(final, message=message, gang_requeues=requeues)
        except (StorageUnavailable, CurriculumMismatch, InputsUnavailable) as exc:  # before the first step
            log.warning("run %s: %s", work.run_id, exc)
            final = RunState.failed
            await emitter.state(final, message=f"training failed: {exc}")
        except (ParallelismError, GangFailed) as exc:  # a plan this node cannot realise, or a lost gang
            log.warning("run %s failed: %s", work.run_id, exc)
            final = RunState.failed
            await emitter.state(final, message=f"training failed: {exc}")
        except Exception as exc:  # the run failed; report it as state and stop redelivery
            log.exception("run %s failed", work.run_id)
            final = RunState.failed
            await emitter.state(final, message=f"training failed: {type(exc).__name__}")
        finally:
            keep_alive.cancel()
            self.stops.pop(work.run_id, None)
            self.epochs.pop(work.run_id, None)
            self.meters.pop(work.run_id, None)
        if stop.reason is StopReason.fenced:  # another trainer holds (or will hold) the run: ack nothing,
            answer = await self.lease(work.run_id, epoch)  # unless the run is over (a node failed it)
            if answer is not None and answer.state in TERMINAL_STATES:
                await msg.ack()
            return
        if await self._applied(work.run_id, epoch, final):
            if final is RunState.interrupted:  # requeued: the item comes back and resumes
                await msg.raw_message.nak(delay=REQUEUE_AFTER_S)
            else:
                await msg.ack()
        else:  # refused or unseen: never ack; the item comes back and the lease decides what happens
            log.warning(
                "run %s: the scheduler does not show %s; leaving the work item unacknowledged",
                work.run_id,
                final,
            )
            await msg.raw_message.nak(delay=RETRY_LEASE_AFTER_S)

    async def _prepare_storage(
        self, manifest: Manifest, checkpoint_dir: pathlib.Path, work: TrainWork
    ) -> None:
        """The run's directory made and its storage checked on this trainer's disk, before the first
        step (services/trainer/storage.py); `StorageUnavailable` when it cannot take the checkpoints."""
        policy = manifest.checkpoint.storage
        await asyncio.to_thread(
            storage.prepare,
            storage_root(self.checkpoint_root, policy),
            checkpoint_dir,
            work.plan.checkpoint_bytes,
            os.path.isabs(policy),
            self.settings.checkpoint_roots,
        )

    async def _run(
        self, emitter: Emitter, work: TrainWork, manifest: Manifest, checkpoint_dir: pathlib.Path, stop: Stop
    ) -> RunState | None:
        """Train (in a thread) and report the final state; None when fenced (nothing reported)."""
        planted = self.trainer_settings.fault(faults.TRAINER_LOSS_SPIKE) and work.restart is None
        planted_from = self.trainer_settings.fault_spike_step if planted else None  # fault injection
        watch = SpikeWatch(emitter.from_thread, stop, planted_from, checkpoint_dir)
        if work.restart is not None:
            r = work.restart
            moved = rewind(checkpoint_dir / r.stage, r.checkpoint_step, r.skip_from, r.skip_to)
            await emitter.log(
                f"approved restart: {r.stage} from checkpoint step {r.checkpoint_step} "
                f"(set aside later ones: {moved}), skipping batches [{r.skip_from}, {r.skip_to})"
            )
        # the run's stages, planned once here and passed down (ValueError, in a sentence, before
        # anything trains), and only the ones the scheduler priced and signed; a refused plan trains nothing
        run = bound_curriculum(manifest, work.base, work.curriculum_digest)
        local = await asyncio.to_thread(materialize, work, manifest, checkpoint_dir, self.settings)
        how = launcher.launch(work, manifest, run, checkpoint_dir, self.threads, emitter.epoch)
        await emitter.state(RunState.running, message="training started")
        meter = self.meters.get(work.run_id)

        def sink(event: RunEvent) -> None:
            watch.send(event)
            if meter is not None:
                meter.observe(event)

        report = emitter.reporter().with_sink(sink)
        try:
            result = await asyncio.to_thread(
                partial(run_pipeline, **self._inputs(work, manifest, run), local_inputs=local),
                manifest,
                checkpoint_dir,
                report,
                stop.is_set,
                self.threads,
                how.trainers,
            )
        finally:
            how.close()
        if stop.reason is StopReason.fenced:  # report nothing
            log.warning(
                "run %s: fenced at epoch %d; leaving it to the new lease holder", work.run_id, emitter.epoch
            )
            return None
        await emitter.log(result.summary)
        if stop.reason is StopReason.loss_spike:
            await pause_for_approval(emitter, checkpoint_dir, watch)
            return RunState.awaiting_approval
        await self.lease(work.run_id, emitter.epoch)  # the meter's last reading before release
        final, message = final_state(result, stop, checkpoint_dir, spent(work, manifest, meter))
        await emitter.state(final, stage=result.last_stage, message=message)
        return final

    def _inputs(self, work: TrainWork, manifest: Manifest, run: Curriculum) -> dict[str, Any]:
        """What the pipeline takes beside the manifest: the run's plan (made once, in the agent), the
        base model the scheduler resolved (its Hugging Face directory in the model store, by digest),
        the store's root (tokenizer entries), and the speed the scheduler's plan and the operator's
        compile switch ask for (micro-batch, activation checkpointing, compile)."""
        store = ModelStore(self.settings.model_store)
        base_dir = store.path(work.base.digest) if work.base is not None else None
        return {
            "plan": run,
            "base": work.base,
            "base_dir": base_dir,
            "store_root": store.root,
            "speed": speed_for_plan(work.plan, compile=self.trainer_settings.compile),
            "data_parallel": data_parallel_of(work.plan, manifest.target.batch_size),
        }

    async def _train_share(self, msg: NatsMessage, work: TrainWork, manifest: Manifest, epoch: int) -> None:
        """Node n > 0 of a multi-node run: train this node's share under its own lease; events go to
        the node's log, never to the bus (node 0 reports the run). An approved restart rewinds the
        node's directory as node 0's; a failure fails the run naming the node (services/trainer/
        follower.py says what a user can expect)."""
        run_id = work.run_id
        root = run_dir(self.checkpoint_root, manifest.checkpoint.storage, work.account, run_id)
        checkpoint_dir = multinode.node_checkpoint_dir(root, work.node_rank)
        try:
            await self._prepare_storage(manifest, checkpoint_dir, work)
        except StorageUnavailable as exc:  # before the first step: the run fails naming this node
            log.warning("run %s: node %d: %s", run_id, work.node_rank, exc)
            await self._share_ended(msg, work, epoch, str(exc))
            return
        stop = self.stops[run_id] = Stop()
        self.epochs[run_id], self.node_ranks[run_id] = epoch, work.node_rank
        keep_alive = asyncio.create_task(self._keep_alive(msg, run_id, epoch, stop, work.node_rank))
        node_log = EventFile(checkpoint_dir / "node.jsonl")
        report = Reporter(node_log, run_id=run_id, epoch=epoch)
        how: launcher.Launch | None = None
        failure: str | None = None
        try:
            run = bound_curriculum(manifest, work.base, work.curriculum_digest)  # once, passed down
            if work.restart is not None:
                names = run.stage_names
                later = names[names.index(work.restart.stage) + 1 :] if work.restart.stage in names else []
                report.log(follower.rewind_share(checkpoint_dir, work.restart, later))
            local = await asyncio.to_thread(materialize, work, manifest, checkpoint_dir, self.settings)
            how = launcher.launch(work, manifest, run, checkpoint_dir, self.threads, epoch)
            if self.trainer_settings.fault(faults.TRAINER_SHARE_FAILS):  # fault injection (tests, make chaos)
                raise RuntimeError("planted fault: this node's share fails")
            result = await asyncio.to_thread(
                partial(run_pipeline, **self._inputs(work, manifest, run), local_inputs=local),
                manifest,
                checkpoint_dir,
                report,
                stop.is_set,
                self.threads,
                how.trainers,
            )
            report.log(f"node {work.node_rank}: {result.outcome.value}: {result.summary}")
        except Exception as exc:  # a stop explains a failure on the way out; anything else fails the run
            log.exception("run %s: node %d's share failed", run_id, work.node_rank)
            report.log(f"node {work.node_rank} failed: {type(exc).__name__}: {exc}"[:500])
            if not stop.is_set():  # node 0 lost takes its Lighthouse and store along, and this share may
                # fail of it before the watcher marks the run interrupted: the watcher goes first
                await asyncio.sleep(NODE_FAILURE_GRACE_S)
            failure = None if stop.is_set() else follower.share_failure(exc)
        finally:
            keep_alive.cancel()
            if how is not None:
                how.close()
            self.stops.pop(run_id, None)
            self.epochs.pop(run_id, None)
            self.node_ranks.pop(run_id, None)
            node_log.close()
        if failure is None and not stop.is_set():  # trained to its end
            await msg.ack()
            return
        await self._share_ended(msg, work, epoch, failure)

    async def _share_ended(self, msg: NatsMessage, work: TrainWork, epoch: int, failure: str | None) -> None:
        """A share that did not train to its end: its failure (None: stopped) said through its lease,
        and its work item acked, requeued or left to its holder as the answer says."""
        run_id = work.run_id
        answer = await self.lease(run_id, epoch, node_rank=work.node_rank, failure=failure or "")
        match follower.after_share(answer, failed=failure is not None):
            case follower.ItemEnd.ack:
                await msg.ack()
            case follower.ItemEnd.requeue:
                await msg.raw_message.nak(delay=REQUEUE_AFTER_S)
            case follower.ItemEnd.leave:
                log.info("run %s: node %d's item left to its holder", run_id, work.node_rank)

    async def _applied(self, run_id: str, epoch: int, final: RunState | None) -> bool:
        """Did the scheduler apply our final transition? Asked through the lease (bounded)."""
        deadline = time.monotonic() + FINAL_STATE_WAIT_S
        while time.monotonic() < deadline:
            answer = await self.lease(run_id, epoch)
            if answer is not None and answer.state is final:
                return True
            await asyncio.sleep(0.2)
        return False

    async def cleanup(self, order: CleanupOrder) -> CleanupResult:
        """Remove a finished run's artifacts and say what was removed. The directory is derived
        from our own root (never taken from the order), and with every link resolved it must still
        be that root's `<account>/<run_id>`."""
        root = storage_root(self.checkpoint_root, order.storage)
        path = run_dir(self.checkpoint_root, order.storage, order.account, order.run_id)
        if (
            not root.is_absolute()
            or path.is_symlink()
            or path.parent.is_symlink()
            or not inside(root, path)
            or pathlib.Path(os.path.realpath(path))
            != pathlib.Path(os.path.realpath(root)) / order.account / order.run_id
        ):
            raise Refusal(ErrorCode.forbidden, "the checkpoint directory is not this run's")
        removed = []
        if path.exists():
            for file in sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink()):
                removed.append(
                    RemovedArtifact(path=file.relative_to(path).as_posix(), bytes=file.stat().st_size)
                )
            shutil.rmtree(path)
        log.info("run %s: cleanup removed %d artifacts", order.run_id, len(removed))
        return CleanupResult(run_id=order.run_id, removed=removed)

    # Exports, downloads and samples (services/trainer/exports.py, sampling.py): thin handlers.

    async def export(self, order: ExportOrder) -> ExportView:
        return await asyncio.to_thread(exports.answer_export, self.exports, self.checkpoint_root, order)

    async def download(self, order: DownloadOrder) -> DownloadChunk:
        return await asyncio.to_thread(exports.answer_download, self.checkpoint_root, order)

    async def sample(self, order: SampleOrder) -> SampleResult:
        return await asyncio.to_thread(sampling.answer_sample, self.sampler, self.checkpoint_root, order)
