"""The confirmation service's entry point: config, build, run."""

import asyncio

from faststream import FastStream
from faststream.nats import NatsMessage

from contracts import subjects
from services.confirmation.handlers import ConfirmationHandlers, create_decoder, resolve_decoder
from services.confirmation.store import ConfirmationStore
from services.runtime import settings as settings_mod
from services.runtime.codec import answer
from services.runtime.service import Wiring, build_app, configure_logging


def register(w: Wiring) -> None:
    h = ConfirmationHandlers(ConfirmationStore(w.redis, w.keys), w.settings.confirmation_ttl_s)

    @w.broker.subscriber(w.settings.subject(subjects.CONFIRMATION_CREATE))
    async def create(msg: NatsMessage) -> bytes:
        return await answer(h.create, msg.body, create_decoder)

    @w.broker.subscriber(w.settings.subject(subjects.CONFIRMATION_RESOLVE))
    async def resolve(msg: NatsMessage) -> bytes:
        return await answer(h.resolve, msg.body, resolve_decoder)


def build(settings: settings_mod.Settings | None = None) -> FastStream:
    return build_app("confirmation", settings or settings_mod.load(), register)


def main() -> None:
    configure_logging("confirmation")
    asyncio.run(build().run())
