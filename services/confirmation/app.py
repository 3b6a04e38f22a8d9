"""The confirmation service's entry point: config, build, run."""

import asyncio

from faststream import FastStream

from contracts import endpoints
from runtime.configuration import settings as settings_mod
from runtime.messaging.service import Wiring, build_app, configure_logging, serve_requests
from runtime.tenancy.quota_stores import InMemoryQuotas, Quotas, RedisQuotas
from services.confirmation.handlers import ConfirmationHandlers
from services.confirmation.store import Confirmations, ConfirmationStore


def register(w: Wiring, store: Confirmations | None = None, quotas: Quotas | None = None) -> None:
    """Wire the handlers to `store` and `quotas` (the bootstrap); by default the Redis ones (with no
    Redis in the wiring, handler tests: quotas in memory)."""
    store = store if store is not None else ConfirmationStore(w.require_redis(), w.keys)
    if quotas is None:
        quotas = RedisQuotas(w.redis, w.keys) if w.redis is not None else InMemoryQuotas()
    h = ConfirmationHandlers(store, w.settings.confirmation_ttl_s, quotas)
    serve_requests(
        w,
        [
            (endpoints.CONFIRMATION_CREATE, h.create),
            (endpoints.CONFIRMATION_RESOLVE, h.resolve),
            (endpoints.CONFIRMATION_OUTSTANDING, h.outstanding),
        ],
    )


def build(settings: settings_mod.Settings | None = None) -> FastStream:
    return build_app("confirmation", settings or settings_mod.load(), register)


def main() -> None:
    configure_logging("confirmation")
    asyncio.run(build().run())
