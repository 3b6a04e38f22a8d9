"""The scheduler's entry point: config, build, run. The API subjects are core request/reply
(no stream captures them); run events arrive through a durable JetStream consumer.

`register` is the bootstrap: the handlers take their stores through ports (`Credentials`,
`RunRecords`), the Redis adapters by default, in-memory ones in handler tests."""

import asyncio

from faststream import FastStream

from contracts import subjects
from contracts.api import (
    ApproveRequest,
    AuthRequest,
    CancelRequest,
    CleanupRequest,
    ConfirmRequest,
    FindRequest,
    LeaseQuery,
    LogsRequest,
    MetricsRequest,
    PlanRequest,
    RunItemsRequest,
    StatusRequest,
    TrainRequest,
)
from contracts.audit import AuditRequest
from services.runtime import settings as settings_mod
from services.runtime.accounts import Credentials, RedisAccounts
from services.runtime.secrets import Secrets
from services.runtime.service import (
    Wiring,
    build_app,
    configure_logging,
    consume_in_order,
    serve_requests,
    serve_tenant_requests,
)
from services.runtime.signing import Signer
from services.scheduler import liveness, planning
from services.scheduler.api import Api
from services.scheduler.audit import Auditor
from services.scheduler.backends import Backends
from services.scheduler.events import RunEvents
from services.scheduler.handoff import Handoff
from services.scheduler.mutations import Mutations
from services.scheduler.store import RunRecords, RunStore

ROUTES = [  # (subject, request type, Api method name)
    (subjects.API_AUTH, AuthRequest, "auth"),
    (subjects.API_FIND, FindRequest, "find"),
    (subjects.API_PLAN, PlanRequest, "plan"),
    (subjects.API_CONFIRM, ConfirmRequest, "confirm"),
    (subjects.API_TRAIN, TrainRequest, "train"),
    (subjects.API_STATUS, StatusRequest, "status"),
    (subjects.API_LOGS, LogsRequest, "logs"),
    (subjects.API_AUDIT, AuditRequest, "audit"),
    (subjects.API_METRICS, MetricsRequest, "metrics"),
    (subjects.API_CHECKPOINTS, RunItemsRequest, "checkpoints"),
    (subjects.API_EVALS, RunItemsRequest, "evals"),
]


def register(w: Wiring, runs: RunRecords | None = None, credentials: Credentials | None = None) -> None:
    """Wire the scheduler's handlers; a store not given is the Redis one (`w.require_redis()`)."""
    s = w.settings
    backends = Backends(
        w.broker, s, settings_mod.entitlement_key(s), Signer(Secrets(s.secrets_dir).signing_key())
    )
    runs = runs if runs is not None else RunStore(w.require_redis(), w.keys)
    credentials = credentials if credentials is not None else RedisAccounts(w.require_redis(), w.keys)
    handoff = Handoff(w.broker, s, runs, backends)
    api = Api(
        credentials,
        backends,
        runs,
        handoff,
        Auditor(w.broker, s),
        planning.load_prices(),
        s.data_dir / "checkpoints",
        small_model_gangs=s.small_model_gangs,
    )
    run_events = RunEvents(runs)

    mutations = Mutations(credentials, backends, runs)
    serve_tenant_requests(
        w,
        [(suffix, request_type, getattr(api, method)) for suffix, request_type, method in ROUTES]
        + [
            (subjects.API_CANCEL, CancelRequest, mutations.cancel),
            (subjects.API_CLEANUP, CleanupRequest, mutations.cleanup),
            (subjects.API_APPROVE, ApproveRequest, mutations.approve),
        ],
    )
    # Only trainers may publish lease queries (NATS permissions); the answer is checked against the run.
    serve_requests(w, [(subjects.RUN_LEASE, LeaseQuery, liveness.Heartbeats(runs).heartbeat)], signed=False)

    consume_in_order(
        w,
        subjects.RUN_EVENTS,
        subjects.STREAM_RUNS,
        subjects.CONSUMER_SCHEDULER_RUNS,
        run_events.on_event,
        ack_wait_s=30,
        with_subject=True,
    )

    w.tasks.append(handoff.reconcile_forever)
    w.tasks.append(lambda: liveness.watch_forever(runs, handoff.events))


def build(settings: settings_mod.Settings | None = None) -> FastStream:
    return build_app("scheduler", settings or settings_mod.load(), register)


def main() -> None:
    configure_logging("scheduler")
    asyncio.run(build().run())
