"""The telemetry service's entry point: config, build, run."""

import asyncio

from faststream import AckPolicy, FastStream
from faststream.nats import ConsumerConfig, NatsMessage, PullSub

from contracts import subjects
from services.runtime import settings as settings_mod
from services.runtime import streams
from services.runtime.service import Wiring, build_app, configure_logging
from services.telemetry.handlers import TelemetryHandlers
from services.telemetry.store import TelemetryStore


def register(w: Wiring) -> None:
    s = w.settings
    h = TelemetryHandlers(TelemetryStore(w.redis, w.keys), w.broker, s)

    @w.broker.subscriber(
        s.subject(subjects.RUN_EVENTS) + ".>",
        stream=streams.ref(s, subjects.STREAM_RUNS),
        durable=f"{s.namespace}-{subjects.CONSUMER_TELEMETRY}",
        pull_sub=PullSub(batch_size=1, timeout=0.5),  # in order: FastStream runs a batch concurrently
        config=ConsumerConfig(ack_wait=30),
        ack_policy=AckPolicy.NACK_ON_ERROR,
    )
    async def on_run_event(msg: NatsMessage) -> None:
        await h.on_event(msg.body)


def build(settings: settings_mod.Settings | None = None) -> FastStream:
    return build_app("telemetry", settings or settings_mod.load(), register)


def main() -> None:
    configure_logging("telemetry")
    asyncio.run(build().run())
