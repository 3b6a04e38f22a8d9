"""The ledger service's entry point: config, build, run."""

import asyncio

from faststream import FastStream

from contracts import subjects
from contracts.internal import LedgerAccept, LedgerHandedOff, LedgerLookup, LedgerPending
from services.ledger.handlers import LedgerHandlers
from services.ledger.store import Ledger, LedgerStore
from services.runtime import settings as settings_mod
from services.runtime.service import Wiring, build_app, configure_logging, serve_requests


def register(w: Wiring, store: Ledger | None = None) -> None:
    """Wire the handlers to `store` (the bootstrap); by default the Redis one."""
    if store is None:
        store = LedgerStore(w.require_redis(), w.keys, w.settings.idempotency_retention_s)
    h = LedgerHandlers(store)
    serve_requests(
        w,
        [
            (subjects.LEDGER_LOOKUP, LedgerLookup, h.lookup),
            (subjects.LEDGER_ACCEPT, LedgerAccept, h.accept),
            (subjects.LEDGER_HANDED_OFF, LedgerHandedOff, h.handed_off),
            (subjects.LEDGER_PENDING, LedgerPending, h.pending),
        ],
    )


def build(settings: settings_mod.Settings | None = None) -> FastStream:
    return build_app("ledger", settings or settings_mod.load(), register)


def main() -> None:
    configure_logging("ledger")
    asyncio.run(build().run())
