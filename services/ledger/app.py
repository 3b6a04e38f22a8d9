"""The ledger service's entry point: config, build, run."""

import asyncio

from faststream import FastStream
from faststream.nats import NatsMessage

from contracts import subjects
from services.ledger.handlers import (
    LedgerHandlers,
    accept_decoder,
    handed_off_decoder,
    lookup_decoder,
    pending_decoder,
)
from services.ledger.store import LedgerStore
from services.runtime import settings as settings_mod
from services.runtime.codec import answer
from services.runtime.service import Wiring, build_app, configure_logging


def register(w: Wiring) -> None:
    h = LedgerHandlers(LedgerStore(w.redis, w.keys, w.settings.idempotency_retention_s))

    @w.broker.subscriber(w.settings.subject(subjects.LEDGER_LOOKUP))
    async def lookup(msg: NatsMessage) -> bytes:
        return await answer(h.lookup, msg.body, lookup_decoder)

    @w.broker.subscriber(w.settings.subject(subjects.LEDGER_ACCEPT))
    async def accept(msg: NatsMessage) -> bytes:
        return await answer(h.accept, msg.body, accept_decoder)

    @w.broker.subscriber(w.settings.subject(subjects.LEDGER_HANDED_OFF))
    async def handed_off(msg: NatsMessage) -> bytes:
        return await answer(h.handed_off, msg.body, handed_off_decoder)

    @w.broker.subscriber(w.settings.subject(subjects.LEDGER_PENDING))
    async def pending(msg: NatsMessage) -> bytes:
        return await answer(h.pending, msg.body, pending_decoder)


def build(settings: settings_mod.Settings | None = None) -> FastStream:
    return build_app("ledger", settings or settings_mod.load(), register)


def main() -> None:
    configure_logging("ledger")
    asyncio.run(build().run())
