"""The confirmation service's entry point: config, build, run."""

import asyncio

from faststream import FastStream

from contracts import endpoints
from services.confirmation.handlers import ConfirmationHandlers
from services.confirmation.store import Confirmations, ConfirmationStore
from services.runtime import settings as settings_mod
from services.runtime.service import Wiring, build_app, configure_logging, serve_requests


def register(w: Wiring, store: Confirmations | None = None) -> None:
    """Wire the handlers to `store` (the bootstrap); by default the Redis one."""
    store = store if store is not None else ConfirmationStore(w.require_redis(), w.keys)
    h = ConfirmationHandlers(store, w.settings.confirmation_ttl_s)
    serve_requests(
        w,
        [
            (endpoints.CONFIRMATION_CREATE, h.create),
            (endpoints.CONFIRMATION_RESOLVE, h.resolve),
        ],
    )


def build(settings: settings_mod.Settings | None = None) -> FastStream:
    return build_app("confirmation", settings or settings_mod.load(), register)


def main() -> None:
    configure_logging("confirmation")
    asyncio.run(build().run())
