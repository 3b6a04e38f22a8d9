"""The ledger service's entry point: config, build, run."""

import asyncio

from faststream import FastStream

from contracts import endpoints
from runtime.configuration import settings as settings_mod
from runtime.messaging.service import Wiring, build_app, configure_logging, serve_requests
from services.ledger.handlers import LedgerHandlers
from services.ledger.store import Ledger, LedgerStore


def register(w: Wiring, store: Ledger | None = None) -> None:
    """Wire the handlers to `store` (the bootstrap); by default the Redis one."""
    if store is None:
        store = LedgerStore(w.require_redis(), w.keys, w.settings.idempotency_retention_s)
    h = LedgerHandlers(store)
    serve_requests(
        w,
        [
            (endpoints.LEDGER_LOOKUP, h.lookup),
            (endpoints.LEDGER_ACCEPT, h.accept),
            (endpoints.LEDGER_HANDED_OFF, h.handed_off),
            (endpoints.LEDGER_PENDING, h.pending),
        ],
    )


def build(settings: settings_mod.Settings | None = None) -> FastStream:
    return build_app("ledger", settings or settings_mod.load(), register)


def main() -> None:
    configure_logging("ledger")
    asyncio.run(build().run())
