"""One work item, start to end: announce, train in a thread, report, acknowledge.

The message is acknowledged only after the run's final state is published. While training, the
worker tells JetStream it is still working (`in_progress`) so the message is not redelivered; if
the process dies, the message comes back after AckWait and the run resumes from its last
committed checkpoint.
"""

import asyncio
import logging
import os
import pathlib

import msgspec
from faststream.nats import NatsBroker, NatsMessage

from contracts.manifest import Manifest
from contracts.runs import TrainWork
from contracts.states import RunState
from services.runtime.settings import ENV_TRAINER_THREADS, Settings
from services.trainer.emitter import Emitter
from services.trainer.pipeline import run_pipeline

log = logging.getLogger("ito.trainer.worker")

WORK_ACK_WAIT_S = 30  # redelivery delay after a trainer dies silently
IN_PROGRESS_EVERY_S = 10.0  # well inside WORK_ACK_WAIT_S

work_decoder = msgspec.json.Decoder(TrainWork)
manifest_decoder = msgspec.json.Decoder(Manifest)


class Worker:
    def __init__(self, broker: NatsBroker, settings: Settings) -> None:
        self.broker = broker
        self.settings = settings
        self.threads = int(os.environ.get(ENV_TRAINER_THREADS) or os.cpu_count() or 1)

    async def _keep_alive(self, msg: NatsMessage) -> None:
        while True:
            await asyncio.sleep(IN_PROGRESS_EVERY_S)
            try:
                await msg.raw_message.in_progress()
            except Exception:  # a bus outage: retry next tick; JetStream may redeliver meanwhile
                log.warning("could not extend the work item's ack deadline")

    async def handle(self, msg: NatsMessage) -> None:
        try:
            work = work_decoder.decode(msg.body)
            manifest = manifest_decoder.decode(work.manifest_text.encode())
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.error("work item rejected (terminated, not trained): %s", exc)
            await msg.raw_message.term()
            return
        emitter = Emitter(self.broker, self.settings, work.run_id, asyncio.get_running_loop())
        keep_alive = asyncio.create_task(self._keep_alive(msg))
        try:
            await emitter.state(RunState.running, stage="pretrain", message="training started")
            result = await asyncio.to_thread(
                run_pipeline, manifest, pathlib.Path(work.checkpoint_dir), emitter.from_thread,
                lambda: False, self.threads,
            )
            await emitter.log(result.summary)
            await emitter.state(RunState.succeeded, stage=result.last_stage, message=result.summary)
        except Exception as exc:  # the run failed; report it as state and stop redelivery
            log.exception("run %s failed", work.run_id)
            await emitter.state(RunState.failed, message=f"training failed: {type(exc).__name__}")
        finally:
            keep_alive.cancel()
        await msg.ack()
