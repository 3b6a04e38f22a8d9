"""The scheduler's entry point: config, build, run. The API subjects are core request/reply
(no stream captures them); run events arrive through a durable JetStream consumer.

`register` is the bootstrap: the handlers take their stores through ports (`Credentials`,
`RunRecords`), the Redis adapters by default, in-memory ones in handler tests."""

import asyncio
from dataclasses import dataclass

from faststream import FastStream

from contracts import endpoints, subjects
from contracts.runs import RunEvent
from runtime.configuration import settings as settings_mod
from runtime.messaging.bus import TenantHandler
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
from services.scheduler import leases, prices
from services.scheduler.account_reads import AccountReads
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
from services.scheduler.prices import PriceTable
from services.scheduler.run_reads import RunReads
from services.scheduler.store import RunRecords, RunStore
from services.scheduler.uploads import Uploads

API = ("plan", "confirm", "train")  # API verbs Api serves: price and create a run
ACCOUNT = ("auth", "find", "models")  # API verbs AccountReads serves: the caller's own account
READS = ("status", "logs", "audit", "metrics", "checkpoints", "evals")  # RunReads: one of the caller's runs
MUTATIONS = ("cancel", "cleanup", "approve")  # API verbs Mutations serves
UPLOADS = ("upload", "upload_part", "upload_commit", "files", "file", "file_delete", "connections")
"""API verbs Uploads serves: a tenant's own inputs (contracts/files.py)."""
OUTPUTS = ("export", "download", "sample")  # API verbs Outputs serves (no confirmation: they spend nothing)
LISTS = ("runs",)  # API verbs RunListing serves: the caller's own runs


@dataclass(frozen=True, slots=True)
class Stores:
    """The scheduler's ports: the Redis adapters in the service, in-memory ones in handler tests."""

    runs: RunRecords
    credentials: Credentials
    quotas: Quotas
    files: FileRecords


def stores(
    w: Wiring,
    runs: RunRecords | None,
    credentials: Credentials | None,
    quotas: Quotas | None,
    files: FileRecords | None,
) -> Stores:
    """The stores given, and the Redis one for each not given (`w.require_redis()`; quotas and file
    records in memory when the wiring has no Redis: handler tests)."""
    if quotas is None:
        quotas = RedisQuotas(w.redis, w.keys) if w.redis is not None else InMemoryQuotas()
    if files is None:
        files = RedisFileRecords(w.redis, w.keys) if w.redis is not None else InMemoryFileRecords()
    runs = runs if runs is not None else RunStore(w.require_redis(), w.keys)
    credentials = credentials if credentials is not None else RedisAccounts(w.require_redis(), w.keys)
    return Stores(runs, credentials, quotas, files)


def tenant_routes(table: dict[tuple[str, ...], object]) -> list[tuple[endpoints.Endpoint, TenantHandler]]:
    """Each verb of `table` (verbs -> the object that serves them, one method a verb, named as it)."""
    return [(endpoints.API[verb], getattr(served, verb)) for verbs, served in table.items() for verb in verbs]


def gated_api(
    w: Wiring,
    st: Stores,
    peers: Peers,
    handoff: Handoff,
    auditor: Auditor,
    model_store: ModelStore,
    slots: data_checks.CheckSlots,
) -> Api:
    """The verbs that price and create a run, on the settings' prices, roots and data checks."""
    s = w.settings
    return Api(
        st.credentials,
        peers,
        st.runs,
        handoff,
        auditor,
        prices.load_prices(),
        s.data_dir / "checkpoints",
        small_model_gangs=s.small_model_gangs,
        count_accepted=w.metrics.runs_accepted(),
        model_store=model_store,
        quotas=st.quotas,
        files=st.files,
        data_facts=DataFacts(s.file_root, s.secrets_dir, s.data_dir / "spool", slots),
        file_root=str(s.file_root) if s.file_root is not None else None,
        storage_roots=s.checkpoint_roots,
    )


def register(
    w: Wiring,
    runs: RunRecords | None = None,
    credentials: Credentials | None = None,
    quotas: Quotas | None = None,
    files: FileRecords | None = None,
) -> None:
    """Wire the scheduler's handlers over its stores (`stores`: the Redis ones unless given)."""
    s = w.settings
    st = stores(w, runs, credentials, quotas, files)
    slots = data_checks.CheckSlots()  # the data checks this instance runs at once, plans' and uploads'
    peers = Peers(w.bus, s, settings_mod.entitlement_key(s), Signer(Secrets(s.secrets_dir).signing_key()))
    handoff = Handoff(w.bus, s, st.runs, peers)
    auditor = Auditor(w.bus, w.broker, s)
    model_store = ModelStore(s.model_store)
    api = gated_api(w, st, peers, handoff, auditor, model_store, slots)
    file_store = tenant_files.open_store(s.file_store_url, s.data_dir, storage_options_endpoint())
    uploads = Uploads(st.credentials, st.files, file_store, st.quotas, peers, s, model_store, slots)
    table: dict[tuple[str, ...], object] = {
        API: api,
        ACCOUNT: AccountReads(st.credentials, st.quotas, st.runs, peers, st.files, model_store),
        READS: RunReads(st.credentials, st.runs, peers, handoff, auditor),
        MUTATIONS: Mutations(st.credentials, peers, st.runs),
        OUTPUTS: Outputs(st.credentials, peers, st.runs),
        LISTS: RunListing(st.credentials, st.runs),
        UPLOADS: uploads,
    }
    serve_tenant_requests(w, tenant_routes(table))
    serve_internal(w, st.runs, auditor, api.prices)
    consume_in_order(
        w,
        subjects.RUN_EVENTS,
        subjects.STREAM_RUNS,
        subjects.CONSUMER_SCHEDULER_RUNS,
        RunEvents(st.runs).on_event,
        ack_wait_s=30,
        message_type=RunEvent,
        with_subject=True,
        kinds=TRAINER_KINDS,
    )
    w.tasks.append(handoff.reconcile_forever)
    w.tasks.append(uploads.expire_forever)
    w.tasks.append(lambda: leases.watch_forever(st.runs, handoff.events))


def serve_internal(w: Wiring, runs: RunRecords, auditor: Auditor, prices: PriceTable) -> None:
    """The requests only a service identity may make (NATS permissions), unsigned: the trainers'
    lease queries, and the desk's two reads."""
    # Only trainers may publish lease queries; the answer is checked against the run.
    serve_requests(w, [(endpoints.RUN_LEASE, leases.Heartbeats(runs).heartbeat)], signed=False)
    # Only the desk may ask these, and only its own inbox hears the answer.
    desk = DeskReads(runs, auditor, prices)
    serve_requests(
        w,
        [(endpoints.DESK["runs"], desk.runs), (endpoints.DESK["run"], desk.run)],
        signed=False,
        reply_prefix=service_inbox(DESK) + ".",
    )


def storage_options_endpoint() -> str:
    """The S3-compatible endpoint the backend's own buckets are at ("" for AWS)."""
    import os

    return os.environ.get(ENV_S3_ENDPOINT_URL, "")


def build(settings: settings_mod.Settings | None = None) -> FastStream:
    return build_app("scheduler", settings or settings_mod.load(), register)


def main() -> None:
    configure_logging("scheduler")
    asyncio.run(build().run())
