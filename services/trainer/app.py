"""The trainer's entry point: config, build, run. One run at a time per process.

Work items and cancel notices count only with the scheduler's signature; every file the trainer
writes (checkpoints above all) is private to its user (umask 077: files 0600, directories 0700)."""

import asyncio
import logging
import os

import msgspec
from faststream import AckPolicy, FastStream
from faststream.nats import ConsumerConfig, NatsMessage, PullSub

from contracts import endpoints, subjects
from runtime.configuration import settings as settings_mod
from runtime.messaging import streams
from runtime.messaging.service import Wiring, build_app, configure_logging, scheduler_verifier
from services.trainer import trainer_settings
from services.trainer.worker import WORK_ACK_WAIT_S, Worker, decode_work


def register(w: Wiring) -> None:
    s = w.settings
    # The agent's own settings, read from the environment once, here: the worker reads none.
    worker = Worker(w.bus, s, trainer_settings.load(os.environ, settings_mod.usable_cpus()))
    verifier = scheduler_verifier(s)
    log = logging.getLogger("ito.trainer")
    durable = f"{s.namespace}-{subjects.CONSUMER_TRAINER}"
    w.metrics.watch_consumer(s.stream(subjects.STREAM_WORK), durable)
    unsigned_work, malformed_work = (
        w.metrics.unsigned_messages(durable),
        w.metrics.malformed_messages(durable),
    )
    unsigned_cancel = w.metrics.unsigned_messages("cancel")

    @w.broker.subscriber(
        s.subject(subjects.WORK_TRAIN) + ".>",
        stream=streams.ref(s, subjects.STREAM_WORK),
        durable=durable,
        pull_sub=PullSub(batch_size=1, timeout=1.0),
        config=ConsumerConfig(ack_wait=WORK_ACK_WAIT_S),
        ack_policy=AckPolicy.MANUAL,
        inbox_prefix=w.inbox_prefix(),
    )
    async def on_work(msg: NatsMessage) -> None:
        # Work items wait in the queue, so no age limit; the lease then checks the run record too.
        if not verifier.valid(msg.raw_message.subject, msg.body, msg.headers, max_age_s=None):
            log.error(
                "work item without the scheduler's signature on %s: terminated, not trained",
                msg.raw_message.subject,
            )
            unsigned_work()
            await msg.raw_message.term()
            return
        try:  # decoded here, at the edge, only once the signature over these bytes held
            work, manifest = decode_work(msg.body)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.error("work item rejected (terminated, not trained): %s", exc)
            malformed_work()
            await msg.raw_message.term()
            return
        await worker.handle(msg, work, manifest)

    @w.broker.subscriber(s.subject(subjects.CONTROL_CANCEL) + ".*")
    async def on_cancel(msg: NatsMessage) -> None:
        if not verifier.valid(msg.raw_message.subject, msg.body, msg.headers):
            log.warning("cancel notice without the scheduler's signature ignored")
            unsigned_cancel()
            return
        await worker.cancel(msg.raw_message.subject.rsplit(".", 1)[-1])

    # Any one trainer answers (the trainers' queue group): checkpoint storage is shared by them.
    w.router.serve(endpoints.TRAINER_CLEANUP, worker.cleanup, verifier)
    w.router.serve(endpoints.TRAINER_EXPORT, worker.export, verifier)
    w.router.serve(endpoints.TRAINER_DOWNLOAD, worker.download, verifier)
    w.router.serve(endpoints.TRAINER_SAMPLE, worker.sample, verifier)


def build(settings: settings_mod.Settings | None = None) -> FastStream:
    return build_app("trainer", settings or settings_mod.load(), register)


def main() -> None:
    os.umask(0o077)
    configure_logging("trainer")
    asyncio.run(build().run())
