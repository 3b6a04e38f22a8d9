"""The scheduler's entry point: config, build, run. The API subjects are core request/reply
(no stream captures them); run events arrive through a durable JetStream consumer.

`register` is the bootstrap: the handlers take their stores through ports (`Credentials`,
`RunRecords`), the Redis adapters by default, in-memory ones in handler tests."""

import asyncio

from faststream import FastStream

from contracts import endpoints, subjects
from contracts.runs import RunEvent
from runtime.configuration import settings as settings_mod
from runtime.messaging.service import (
    Wiring,
    build_app,
    configure_logging,
    consume_in_order,
    serve_requests,
    serve_tenant_requests,
)
from runtime.security.identities import DESK, service_inbox
from runtime.security.order_signatures import Signer
from runtime.security.secrets import Secrets
from runtime.storage import data_checks, tenant_files
from runtime.storage.checkpoint_store import ENV_S3_ENDPOINT_URL
from runtime.storage.model_store import ModelStore
from runtime.tenancy.accounts import Credentials, RedisAccounts
from runtime.tenancy.quota_stores import InMemoryQuotas, Quotas, RedisQuotas
from services.scheduler import leases, planning
from services.scheduler.api import Api
from services.scheduler.audit import Auditor
from services.scheduler.data_facts import DataFacts
from services.scheduler.desk_reads import DeskReads
from services.scheduler.events import TRAINER_KINDS, RunEvents
from services.scheduler.exports import Outputs
from services.scheduler.file_records import FileRecords, InMemoryFileRecords, RedisFileRecords
from services.scheduler.handoff import Handoff
from services.scheduler.listing import RunListing
from services.scheduler.mutations import Mutations
from services.scheduler.peers import Peers
from services.scheduler.store import RunRecords, RunStore
from services.scheduler.uploads import Uploads

ROUTES = {  # API verb -> Api method name (contracts/endpoints.py: the verb's subject and types)
    "auth": "auth",
    "find": "find",
    "plan": "plan",
    "confirm": "confirm",
    "train": "train",
    "status": "status",
    "logs": "logs",
    "audit": "audit",
    "metrics": "metrics",
    "checkpoints": "checkpoints",
    "evals": "evals",
    "models": "models",
}
MUTATIONS = ("cancel", "cleanup", "approve")  # API verbs Mutations serves
UPLOADS = ("upload", "upload_part", "upload_commit", "files", "file", "file_delete", "connections")
"""API verbs Uploads serves: a tenant's own inputs (contracts/files.py)."""
OUTPUTS = ("export", "download", "sample")  # API verbs Outputs serves (no confirmation: they spend nothing)
LISTS = ("runs",)  # API verbs RunListing serves: the caller's own runs


def register(
    w: Wiring,
    runs: RunRecords | None = None,
    credentials: Credentials | None = None,
    quotas: Quotas | None = None,
    files: FileRecords | None = None,
) -> None:
    """Wire the scheduler's handlers; a store not given is the Redis one (`w.require_redis()`;
    quotas and file records in memory when the wiring has no Redis: handler tests)."""
    s = w.settings
    if quotas is None:
        quotas = RedisQuotas(w.redis, w.keys) if w.redis is not None else InMemoryQuotas()
    if files is None:
        files = RedisFileRecords(w.redis, w.keys) if w.redis is not None else InMemoryFileRecords()
    slots = data_checks.CheckSlots()  # the data checks this instance runs at once, plans' and uploads'
    peers = Peers(w.bus, s, settings_mod.entitlement_key(s), Signer(Secrets(s.secrets_dir).signing_key()))
    runs = runs if runs is not None else RunStore(w.require_redis(), w.keys)
    credentials = credentials if credentials is not None else RedisAccounts(w.require_redis(), w.keys)
    handoff = Handoff(w.bus, s, runs, peers)
    api = Api(
        credentials,
        peers,
        runs,
        handoff,
        Auditor(w.bus, w.broker, s),
        planning.load_prices(),
        s.data_dir / "checkpoints",
        small_model_gangs=s.small_model_gangs,
        count_accepted=w.metrics.runs_accepted(),
        model_store=ModelStore(s.model_store),
        quotas=quotas,
        files=files,
        data_facts=DataFacts(s.file_root, s.secrets_dir, s.data_dir / "spool", slots),
        file_root=str(s.file_root) if s.file_root is not None else None,
        storage_roots=s.checkpoint_roots,
    )
    run_events = RunEvents(runs)
    auditor = api.auditor

    mutations = Mutations(credentials, peers, runs)
    outputs = Outputs(credentials, peers, runs)
    listing = RunListing(credentials, runs)
    store = tenant_files.open_store(s.file_store_url, s.data_dir, storage_options_endpoint())
    uploads = Uploads(credentials, files, store, quotas, peers, s, ModelStore(s.model_store), slots)
    serve_tenant_requests(
        w,
        [(endpoints.API[verb], getattr(api, method)) for verb, method in ROUTES.items()]
        + [(endpoints.API[verb], getattr(mutations, verb)) for verb in MUTATIONS]
        + [(endpoints.API[verb], getattr(outputs, verb)) for verb in OUTPUTS]
        + [(endpoints.API[verb], getattr(listing, verb)) for verb in LISTS]
        + [(endpoints.API[verb], getattr(uploads, verb)) for verb in UPLOADS],
    )
    # Only trainers may publish lease queries (NATS permissions); the answer is checked against the run.
    serve_requests(w, [(endpoints.RUN_LEASE, leases.Heartbeats(runs).heartbeat)], signed=False)
    # Only the desk may ask these (NATS permissions), and only its own inbox hears the answer.
    desk = DeskReads(runs, auditor, api.prices)
    serve_requests(
        w,
        [(endpoints.DESK["runs"], desk.runs), (endpoints.DESK["run"], desk.run)],
        signed=False,
        reply_prefix=service_inbox(DESK) + ".",
    )

    consume_in_order(
        w,
        subjects.RUN_EVENTS,
        subjects.STREAM_RUNS,
        subjects.CONSUMER_SCHEDULER_RUNS,
        run_events.on_event,
        ack_wait_s=30,
        message_type=RunEvent,
        with_subject=True,
        kinds=TRAINER_KINDS,
    )

    w.tasks.append(handoff.reconcile_forever)
    w.tasks.append(uploads.expire_forever)
    w.tasks.append(lambda: leases.watch_forever(runs, handoff.events))


def storage_options_endpoint() -> str:
    """The S3-compatible endpoint the backend's own buckets are at ("" for AWS)."""
    import os

    return os.environ.get(ENV_S3_ENDPOINT_URL, "")


def build(settings: settings_mod.Settings | None = None) -> FastStream:
    return build_app("scheduler", settings or settings_mod.load(), register)


def main() -> None:
    configure_logging("scheduler")
    asyncio.run(build().run())
