"""The trainer's entry point: config, build, run. One run at a time per process."""

import asyncio

from faststream import AckPolicy, FastStream
from faststream.nats import ConsumerConfig, NatsMessage, PullSub

from contracts import subjects
from contracts.api import CleanupOrder
from services.runtime import settings as settings_mod
from services.runtime import streams
from services.runtime.service import Wiring, build_app, configure_logging, replier
from services.trainer.worker import WORK_ACK_WAIT_S, Worker


def register(w: Wiring) -> None:
    s = w.settings
    worker = Worker(w.broker, s)

    @w.broker.subscriber(
        s.subject(subjects.WORK_TRAIN) + ".>",
        stream=streams.ref(s, subjects.STREAM_WORK),
        durable=f"{s.namespace}-{subjects.CONSUMER_TRAINER}",
        pull_sub=PullSub(batch_size=1, timeout=1.0),
        config=ConsumerConfig(ack_wait=WORK_ACK_WAIT_S),
        ack_policy=AckPolicy.MANUAL,
    )
    async def on_work(msg: NatsMessage) -> None:
        await worker.handle(msg)

    @w.broker.subscriber(s.subject(subjects.CONTROL_CANCEL) + ".*")
    async def on_cancel(msg: NatsMessage) -> None:
        worker.cancel(msg.raw_message.subject.rsplit(".", 1)[-1])

    # Any one trainer answers (a queue group): checkpoint storage is shared by the trainers.
    w.broker.subscriber(s.subject(subjects.TRAINER_CLEANUP), queue=subjects.TRAINER_QUEUE)(
        replier(worker.cleanup, CleanupOrder))


def build(settings: settings_mod.Settings | None = None) -> FastStream:
    return build_app("trainer", settings or settings_mod.load(), register)


def main() -> None:
    configure_logging("trainer")
    asyncio.run(build().run())
