"""JetStream stream definitions, declared by the operator identity when the stack starts (idempotent).

Subscribers refer to them by name with `JStream(name, declare=False)`, so the config lives here
only. Request/reply subjects stay out of every filter (see contracts.subjects). Every stream has
`settings.nats_replicas` replicas: 1 on one server, 3 on the cluster `up --cluster` starts.
"""

import logging
from typing import TYPE_CHECKING

from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from contracts import subjects
from runtime.configuration.settings import Settings

if TYPE_CHECKING:  # the services' subscribers; `up` and the CLIs declare streams on nats-py alone
    from faststream.nats import JStream

DUPLICATE_WINDOW_S = 120.0  # dedup by Nats-Msg-Id; the ledger, not this window, makes runs exactly-once
RUN_EVENTS_MAX_AGE_S = 30 * 24 * 3600.0  # run events are replayable for a month
AUDIT_MAX_AGE_S = 365 * 24 * 3600.0  # gate decisions are kept for a year
log = logging.getLogger("ito.streams")


def configs(settings: Settings) -> list[StreamConfig]:
    def cfg(name: str, subject_root: str, **extra) -> StreamConfig:
        return StreamConfig(
            name=settings.stream(name),
            subjects=[f"{subject_root}.>"],
            storage=StorageType.FILE,
            duplicate_window=DUPLICATE_WINDOW_S,
            num_replicas=settings.nats_replicas,  # R3 on a 3-node cluster: any one server may die
            **extra,
        )

    return [
        cfg(subjects.STREAM_BOOKINGS, settings.subject(subjects.BOOKING_EVENTS)),
        cfg(
            subjects.STREAM_WORK, settings.subject(subjects.WORK_TRAIN), retention=RetentionPolicy.WORK_QUEUE
        ),
        cfg(subjects.STREAM_RUNS, settings.subject(subjects.RUN_EVENTS), max_age=RUN_EVENTS_MAX_AGE_S),
        cfg(subjects.STREAM_DESK, settings.desk_subject_root()),
        # Append-only: no identity, not even the operator, can purge it or delete a message from it.
        cfg(
            subjects.STREAM_AUDIT,
            settings.subject(subjects.AUDIT),
            max_age=AUDIT_MAX_AGE_S,
            deny_delete=True,
            deny_purge=True,
        ),
    ]


async def declare(js: JetStreamContext, settings: Settings) -> None:
    for config in configs(settings):
        try:
            await js.add_stream(config=config)
        except BadRequestError:  # exists with another config: bring it to ours
            log.info("updating stream %s to the declared config", config.name)
            await js.update_stream(config=config)


async def delete(js: JetStreamContext, settings: Settings) -> None:
    """Remove this namespace's streams (tests clean up after themselves on a shared server)."""
    for config in configs(settings):
        assert config.name is not None, "configs() names every stream"
        try:
            await js.delete_stream(config.name)
        except Exception:  # already gone
            pass


def ref(settings: Settings, name: str) -> "JStream":
    from faststream.nats import JStream

    return JStream(settings.stream(name), declare=False)
