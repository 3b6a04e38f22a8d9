"""The telemetry service's entry point: config, build, run."""

import asyncio

from faststream import FastStream

from contracts import subjects
from contracts.runs import RunEvent
from runtime.configuration import settings as settings_mod
from runtime.messaging.service import Wiring, build_app, configure_logging, consume_in_order
from services.telemetry.handlers import TelemetryHandlers
from services.telemetry.store import Telemetry, TelemetryStore


def register(w: Wiring, store: Telemetry | None = None) -> None:
    """Wire the handlers to `store` (the bootstrap); by default the Redis one."""
    s = w.settings
    store = store if store is not None else TelemetryStore(w.require_redis(), w.keys)
    h = TelemetryHandlers(store, w.bus, s)

    consume_in_order(
        w,
        subjects.RUN_EVENTS,
        subjects.STREAM_RUNS,
        subjects.CONSUMER_TELEMETRY,
        h.on_event,
        ack_wait_s=30,
        message_type=RunEvent,
    )


def build(settings: settings_mod.Settings | None = None) -> FastStream:
    return build_app("telemetry", settings or settings_mod.load(), register)


def main() -> None:
    configure_logging("telemetry")
    asyncio.run(build().run())
