"""The confirmation service's entry point: config, build, run."""

import asyncio

from faststream import FastStream

from contracts import subjects
from contracts.internal import ConfirmationCreate, ConfirmationResolve
from services.confirmation.handlers import ConfirmationHandlers
from services.confirmation.store import ConfirmationStore
from services.runtime import settings as settings_mod
from services.runtime.service import Wiring, build_app, configure_logging, serve_requests


def register(w: Wiring) -> None:
    h = ConfirmationHandlers(ConfirmationStore(w.require_redis(), w.keys), w.settings.confirmation_ttl_s)
    serve_requests(
        w,
        [
            (subjects.CONFIRMATION_CREATE, ConfirmationCreate, h.create),
            (subjects.CONFIRMATION_RESOLVE, ConfirmationResolve, h.resolve),
        ],
    )


def build(settings: settings_mod.Settings | None = None) -> FastStream:
    return build_app("confirmation", settings or settings_mod.load(), register)


def main() -> None:
    configure_logging("confirmation")
    asyncio.run(build().run())
