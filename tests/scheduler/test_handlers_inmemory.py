"""Every service's handlers in one process: requests go straight to the services' routers
(`LocalBus`), stream messages through FastStream's in-memory TestNatsBroker; registered
through each service's bootstrap (`register(w, stores...)`) twice: on the in-memory adapters of
their ports (no Redis process, no connection: milliseconds), and as the contract run on the Redis
adapters against a real Redis (ACLs on; the handlers share the admin user here, the security suite
tests each service's own). The same tests must pass on both."""

import contextlib
import dataclasses
import errno
import io
import os
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from unittest import mock

import msgspec
import pytest
import redis.asyncio as aioredis
from faststream.nats import TestNatsBroker
from redis.asyncio.connection import AbstractConnection

from contracts import subjects
from contracts.api import (
    Action,
    AuthInfo,
    AuthRequest,
    BookingView,
    CancelRequest,
    ConfirmationIssued,
    ConfirmRequest,
    Credential,
    FindRequest,
    MutationResult,
    PlanRequest,
    RunAccepted,
    RunList,
    RunsRequest,
    RunView,
    StatusRequest,
    TrainRequest,
)
from contracts.booking import BookingEvent, BookingEventKind, BookingState, Fabric, Topology
from contracts.envelope import Envelope
from contracts.errors import ErrorCode
from contracts.plans import Plan
from contracts.states import RunState
from runtime.configuration import settings as settings_mod
from runtime.configuration.keys import Keys
from runtime.messaging import codec, connections
from runtime.messaging.bus import LocalBus
from runtime.messaging.service import Wiring
from runtime.security.identities import NATS_IDENTITIES
from runtime.security.secrets import Secrets
from runtime.tenancy.accounts import InMemoryAccounts, RedisAccounts
from runtime.tenancy.quota_stores import InMemoryQuotas, Quotas, RedisQuotas
from services.confirmation import app as confirmation_app
from services.confirmation.store import ConfirmationStore, InMemoryConfirmations
from services.entitlement import app as entitlement_app
from services.entitlement.store import Bookings, BookingStore, InMemoryBookings
from services.ledger import app as ledger_app
from services.ledger.store import InMemoryLedger, LedgerStore
from services.scheduler import app as scheduler_app
from services.scheduler.manifests import digest_of
from services.scheduler.memory import InMemoryRuns
from services.scheduler.store import RunStore
from tests.conftest import new_namespace, start_infra

REPO_MANIFEST = (
    __import__("pathlib").Path(__file__).resolve().parents[2] / "examples" / "manifests" / "tiny.json"
)
T = TypeVar("T")


@dataclasses.dataclass
class Bus:
    br: Any  # the TestNatsBroker's in-memory broker
    w: Wiring
    accounts: InMemoryAccounts | RedisAccounts  # the operator's registry (create, revoke)
    bookings: Bookings  # the entitlement projection's store (its counters)
    touched_redis: list[str]  # memory param: every attempt to connect to Redis (must stay empty)
    quotas: Quotas  # the operator's quotas (what `ito-training accounts quota` writes)


def register_all(
    w: Wiring, redis: aioredis.Redis | None
) -> tuple[InMemoryAccounts | RedisAccounts, Bookings, Quotas]:
    """Every service's bootstrap with one kind of adapter: in memory when `redis` is None."""
    s = w.settings
    if redis is None:
        confirmations = InMemoryConfirmations()
        credentials: InMemoryAccounts | RedisAccounts = InMemoryAccounts()
        bookings: Bookings = InMemoryBookings()
        quotas: Quotas = InMemoryQuotas()  # one store: the scheduler's and the confirmation service's
        entitlement_app.register(w, bookings)
        confirmation_app.register(w, confirmations, quotas)
        # the ledger consumes the confirmation service's records (one Redis hash each, there)
        ledger_app.register(w, InMemoryLedger(confirmations.records, clock=confirmations.clock))
        scheduler_app.register(w, runs=InMemoryRuns(), credentials=credentials, quotas=quotas)
        return credentials, bookings, quotas
    credentials, bookings = RedisAccounts(redis, w.keys), BookingStore(redis, w.keys)
    quotas = RedisQuotas(redis, w.keys)
    entitlement_app.register(w, bookings)
    confirmation_app.register(w, ConfirmationStore(redis, w.keys), quotas)
    ledger_app.register(w, LedgerStore(redis, w.keys, s.idempotency_retention_s))
    scheduler_app.register(w, runs=RunStore(redis, w.keys), credentials=credentials, quotas=quotas)
    return credentials, bookings, quotas


@pytest.fixture(scope="module")
def redis_infra(tmp_path_factory):
    """One Redis for the module's contract runs; each test has a namespace of its own in it."""
    i = start_infra(tmp_path_factory.mktemp("handlers") / "infra", new_namespace(), nats=False)
    yield i
    i.stop()


@pytest.fixture(params=["memory", "redis"])
async def bus(request, namespace, tmp_path, monkeypatch):
    monkeypatch.setenv(settings_mod.ENV_ENTITLEMENT_KEY, "in-memory-test-key")
    touched: list[str] = []
    redis: aioredis.Redis | None = None
    if request.param == "memory":  # no Redis server is started, and any connection attempt fails
        s = settings_mod.load({"ITO_NAMESPACE": namespace, "ITO_DATA_DIR": str(tmp_path)})
        Secrets(s.secrets_dir).ensure(NATS_IDENTITIES, ())  # nkeys and the signing key; no Redis password

        async def no_redis(self, *args, **kwargs):
            touched.append(f"{self.host}:{self.port}")
            raise AssertionError("the memory param connected to Redis")

        monkeypatch.setattr(AbstractConnection, "connect_check_health", no_redis)
    else:
        infra = request.getfixturevalue("redis_infra")
        s = dataclasses.replace(infra.settings, namespace=namespace)
        redis = infra.redis("admin")
    broker = connections.make_broker(s, "scheduler")
    w = Wiring(settings=s, broker=broker, redis=redis, keys=Keys(s))
    w.bus = LocalBus(w.router, broker)  # requests straight to the handlers; streams in memory
    credentials, bookings, quotas = register_all(w, redis)
    async with TestNatsBroker(broker) as br:
        yield Bus(br, w, credentials, bookings, touched, quotas)
    if redis is not None:
        await redis.aclose()
    assert touched == [], f"the memory param tried to reach Redis at {touched}"


async def call(bus: Bus, suffix: str, request, account: str = "acme") -> Envelope:
    """An API request on the tenant's own subject (in memory, as if NATS had authenticated `account`)."""
    subject = bus.w.settings.subject(suffix) + (f".{account}" if suffix.startswith("v1.api.") else "")
    reply = await bus.w.bus.request(subject, codec.encode(request), None, timeout=10)
    return codec.decode_envelope(reply)


def data(out: Envelope, data_type: type[T]) -> T:
    """The answer's data as its contract type (the answer must be ok)."""
    assert out.ok, out.error
    return msgspec.convert(out.data, data_type)


def code(out: Envelope) -> ErrorCode | None:
    return None if out.error is None else out.error.code


def booking_event(account, booking, kind="completed", version=1, gpus=8):
    now = datetime.now(UTC)
    return BookingEvent(
        event_id=uuid.uuid4().hex,
        kind=BookingEventKind(kind),
        booking_id=booking,
        account=account,
        version=version,
        topology=Topology(nodes=1, gpus_per_node=gpus, gpu_model="H200", gpu_memory_gb=141),
        region="eu-central-1",
        fabric=Fabric.infiniband,
        window_start=now - timedelta(minutes=1),
        window_end=now + timedelta(hours=2),
        emitted_at=now,
    )


async def publish_booking(bus: Bus, ev: BookingEvent) -> None:
    await bus.br.publish(
        msgspec.json.encode(ev),
        bus.w.settings.subject(f"{subjects.BOOKING_EVENTS}.{ev.kind.value}"),
        stream=bus.w.settings.stream(subjects.STREAM_BOOKINGS),
    )


async def login(bus: Bus, name: str = "acme") -> None:
    await bus.accounts.create(name)
    return None  # the account comes from the authenticated subject; nothing secret travels


async def confirmed_run(
    bus: Bus,
    booking: str,
    key: str,
    account: str = "acme",
    max_cost_usd: float | None = None,
    confirmed: Callable[[], object] = lambda: None,
) -> tuple[TrainRequest, RunAccepted]:
    """A booking, a train confirmation (bound to `max_cost_usd` when given) and the run it
    authorizes (accepted, handed off); `confirmed` is called between the two."""
    await publish_booking(bus, booking_event(account, booking))
    text = REPO_MANIFEST.read_text()
    digest = digest_of(text.encode())
    confirm = ConfirmRequest(
        action=Action.train,
        booking_id=booking,
        manifest_text=text,
        manifest_digest=digest,
        max_cost_usd=max_cost_usd,
    )
    issued = data(await call(bus, subjects.API_CONFIRM, confirm, account), ConfirmationIssued)
    assert (issued.action, issued.target, issued.manifest_digest) == (Action.train, booking, digest)
    train = TrainRequest(
        booking_id=booking,
        manifest_text=text,
        manifest_digest=digest,
        confirmation_ref=issued.confirmation_ref,
        idempotency_key=key,
    )
    confirmed()
    return train, data(await call(bus, subjects.API_TRAIN, train, account), RunAccepted)


async def test_every_api_verb_is_served_by_the_schedulers_table(bus):
    # app.register serves a table of verbs -> the object that serves them: each verb once (the
    # router refuses a subject served twice), and none left out
    from contracts import endpoints
    from services.scheduler import app

    table = (app.API, app.ACCOUNT, app.READS, app.MUTATIONS, app.UPLOADS, app.OUTPUTS, app.LISTS)
    verbs = [verb for verbs in table for verb in verbs]
    assert sorted(verbs) == sorted(endpoints.API)
    served = {subject for subject, route in bus.w.router.routes.items() if route.tenant}
    assert served == {bus.w.settings.subject(e.subject) for e in endpoints.API.values()}


async def test_auth(bus):
    cred = await login(bus)
    info = data(await call(bus, subjects.API_AUTH, AuthRequest(credential=cred)), AuthInfo)
    assert info.account == "acme" and info.key_id
    out = await call(bus, subjects.API_AUTH, AuthRequest(), account="nobody")
    assert code(out) is ErrorCode.unauthenticated
    # a key on the wire is refused, and a credential block naming another account too
    out = await call(
        bus, subjects.API_AUTH, AuthRequest(credential=Credential(account="acme", api_key="nope"))
    )
    assert code(out) is ErrorCode.request_invalid
    out = await call(bus, subjects.API_AUTH, AuthRequest(credential=Credential(account="other")))
    assert code(out) is ErrorCode.unauthenticated
    assert await bus.accounts.revoke("acme") == 1
    out = await call(bus, subjects.API_AUTH, AuthRequest(credential=cred))
    assert code(out) is ErrorCode.credential_revoked
    assert await bus.accounts.revoke("acme") == 0  # nothing left to revoke


async def test_unknown_field_is_request_invalid(bus):
    subject = bus.w.settings.subject(subjects.API_AUTH) + ".a"
    reply = await bus.w.bus.request(subject, b'{"credential": {"account": "a"}, "x": 1}', None, timeout=5)
    out = codec.decode_envelope(reply)
    assert not out.ok and code(out) is ErrorCode.request_invalid
    # the same request without the unknown field is decoded (and refused for its unknown account)
    reply = await bus.w.bus.request(subject, b'{"credential": {"account": "a"}}', None, timeout=5)
    assert code(codec.decode_envelope(reply)) is ErrorCode.unauthenticated


async def test_booking_projection_is_versioned_and_parks_early_events(bus):
    cred = await login(bus)
    await publish_booking(bus, booking_event("acme", "b1", "modified", version=2, gpus=4))
    text = REPO_MANIFEST.read_text()
    plan = PlanRequest(
        credential=cred, booking_id="b1", manifest_text=text, manifest_digest=digest_of(text.encode())
    )
    out = await call(bus, subjects.API_PLAN, plan)
    assert code(out) is ErrorCode.booking_incomplete  # `modified` arrived before `completed`: parked

    await publish_booking(bus, booking_event("acme", "b1", "completed", version=1, gpus=8))
    (view,) = data(await call(bus, subjects.API_FIND, FindRequest(credential=cred)), list[BookingView])
    assert view.booking.version == 2 and view.booking.topology.gpus_per_node == 4 and view.allows_training

    await publish_booking(bus, booking_event("acme", "b1", "revoked", version=1))  # older: ignored
    (view,) = data(await call(bus, subjects.API_FIND, FindRequest(credential=cred)), list[BookingView])
    assert view.booking.state is BookingState.completed
    assert await bus.bookings.counted("stale_ignored") == 1
    assert await bus.bookings.counted("parked") == 1


async def test_plan_confirm_train_status(bus):
    await login(bus)
    train, run = await confirmed_run(bus, "b2", "k1")
    assert run.state is RunState.queued and not run.replay
    assert (run.booking_id, run.idempotency_key) == ("b2", "k1")
    status = StatusRequest(idempotency_key="k1")
    view = data(await call(bus, subjects.API_STATUS, status), RunView)
    assert view.run_id == run.run_id and view.plan is not None
    assert view.plan.manifest_digest == train.manifest_digest
    # the same key again is a replay of the same run; the consumed confirmation under a new key is not
    again = data(await call(bus, subjects.API_TRAIN, train), RunAccepted)
    assert again.run_id == run.run_id and again.replay
    out = await call(bus, subjects.API_TRAIN, msgspec.structs.replace(train, idempotency_key="k2"))
    assert code(out) is ErrorCode.confirmation_consumed


def tree(root) -> set[str]:
    """Every path under `root` (the redis param's Redis appends to its own files there)."""
    return {str(path.relative_to(root)) for path in root.rglob("*")}


@contextlib.contextmanager
def read_only_filesystem():
    """Every write this process tries refused, as on a read-only tree (the suite runs as root, whom
    a read-only mode bit does not stop, so the refusal is the test's own); yields what was tried."""
    tried: list[str] = []
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    real_os_open, real_io_open = os.open, io.open

    def refuse(path, *args, **kwargs):
        tried.append(str(path))
        raise PermissionError(errno.EROFS, "Read-only file system", str(path))

    def os_open(path, flags, *args, **kwargs):
        return refuse(path) if flags & writes else real_os_open(path, flags, *args, **kwargs)

    def io_open(file, mode="r", *args, **kwargs):
        return refuse(file) if set(mode) & set("wax+") else real_io_open(file, mode, *args, **kwargs)

    patches = {"open": os_open, "mkdir": refuse, "makedirs": refuse, "rename": refuse, "replace": refuse}
    with (
        mock.patch.multiple(os, **patches),
        mock.patch("builtins.open", io_open),
        mock.patch("io.open", io_open),
    ):
        yield tried


async def test_plan_creates_nothing_on_disk_and_says_the_room_the_trainer_needs(bus):
    # issue 29: `plan` made the account's checkpoint directory (its docstring says it creates
    # nothing) and measured the scheduler's disk; the storage is the trainer's, checked there.
    await login(bus)
    await publish_booking(bus, booking_event("acme", "bd"))
    root = bus.w.settings.data_dir
    before = tree(root)
    with read_only_filesystem() as tried:  # provably: on a tree that takes no write, plan still answers
        p = data(await call(bus, subjects.API_PLAN, plan_request("bd")), Plan)
    assert tried == []
    assert p.ok and p.checkpoint_bytes > 0
    (check,) = [c for c in p.checks if c.name == "checkpoint_storage"]
    assert check.ok and "the trainer checks its storage" in check.reason
    assert tree(root) - before == set()


async def test_a_train_asks_the_confirmation_service_nothing_the_ledger_reads_the_bound(bus, monkeypatch):
    # issue 30: the scheduler asked the confirmation service for the bound on every train (one
    # more NATS round trip and a second service's CPU); the ledger's accept writes it in now.
    from services.scheduler.peers import Peers

    async def no_resolve(self, *args, **kwargs):
        raise AssertionError("a train asked the confirmation service")

    await login(bus)
    monkeypatch.setattr(Peers, "resolve_confirmation", no_resolve)  # confirm does not resolve either
    _, run = await confirmed_run(bus, "bn", "kn", max_cost_usd=0.5)
    view = data(await call(bus, subjects.API_STATUS, StatusRequest(run_id=run.run_id)), RunView)
    assert view.spend is not None and view.spend.limit_usd == pytest.approx(0.5)


async def test_a_train_plans_the_manifests_stages_once(bus, monkeypatch):
    # issue 29/30: one train request planned the manifest's stages five times (the inputs gate, the
    # estimate, the gates, the checkpoint interval, the data-parallel alternative)
    from domain import curriculum
    from services.scheduler import inputs, planning
    from services.scheduler.api import Api

    calls: list[curriculum.Curriculum] = []
    items = []

    def counted(manifest, base=None):
        calls.append(curriculum.curriculum_of(manifest, base))
        return calls[-1]

    def count_from_now() -> None:
        monkeypatch.setattr(planning, "curriculum_of", counted)
        monkeypatch.setattr(inputs, "curriculum_of", counted)

    work = Api._work

    def kept(self, *args, **kwargs):
        items.append(work(self, *args, **kwargs))
        return items[-1]

    monkeypatch.setattr(Api, "_work", kept)
    await login(bus)
    await confirmed_run(bus, "bp", "kp", confirmed=count_from_now)
    assert len(calls) == 1
    # and the signed work item carries the digest of that curriculum, the one the plan priced: the
    # trainer trains these stages or none (tests/trainer/test_trainer_inmemory.py)
    (item,) = items
    assert item.curriculum_digest == curriculum.curriculum_digest(calls[0])


@pytest.mark.parametrize("verb", ["plan", "confirm"])
async def test_plan_and_confirm_plan_the_manifests_stages_once(bus, monkeypatch, verb):
    # issue 44: plan and confirm planned the stages in the manifest-inputs gate, threw them away
    # and planned them again for the estimate; they price the stages that gate checked, as train does
    from domain import curriculum
    from services.scheduler import inputs, planning

    calls: list[curriculum.Curriculum] = []

    def counted(manifest, base=None):
        calls.append(curriculum.curriculum_of(manifest, base))
        return calls[-1]

    await login(bus)
    await publish_booking(bus, booking_event("acme", "bo"))
    monkeypatch.setattr(planning, "curriculum_of", counted)
    monkeypatch.setattr(inputs, "curriculum_of", counted)
    asked = plan_request("bo")
    if verb == "plan":
        p = data(await call(bus, subjects.API_PLAN, asked), Plan)
        assert p.ok and [g.stage for g in p.gates] == [s.name for s in calls[0].stages]
    else:
        confirm = ConfirmRequest(
            action=Action.train,
            booking_id="bo",
            manifest_text=asked.manifest_text,
            manifest_digest=asked.manifest_digest,
        )
        issued = data(await call(bus, subjects.API_CONFIRM, confirm), ConfirmationIssued)
        assert issued.manifest_digest == asked.manifest_digest
    assert len(calls) == 1


async def test_the_run_is_bounded_by_what_its_confirmation_authorised(bus):
    """The confirmation's cost bound rides on the run (its spend limit never above it): a bound the
    person gave is the run's limit when it is lower than the cap; without one, the bound is what the
    manifest and the booking allow, which is what confirm shows."""
    await login(bus)
    await publish_booking(bus, booking_event("acme", "b9", gpus=8))
    text = REPO_MANIFEST.read_text()
    digest = digest_of(text.encode())
    limits = []
    for key, max_cost in (("bound-1", None), ("bound-2", 0.5)):
        confirm = ConfirmRequest(
            action=Action.train,
            booking_id="b9",
            manifest_text=text,
            manifest_digest=digest,
            max_cost_usd=max_cost,
        )
        issued = data(await call(bus, subjects.API_CONFIRM, confirm), ConfirmationIssued)
        train = TrainRequest(
            booking_id="b9",
            manifest_text=text,
            manifest_digest=digest,
            confirmation_ref=issued.confirmation_ref,
            idempotency_key=key,
        )
        run = data(await call(bus, subjects.API_TRAIN, train), RunAccepted)
        view = data(await call(bus, subjects.API_STATUS, StatusRequest(run_id=run.run_id)), RunView)
        assert view.spend is not None and view.plan is not None
        limits.append((issued.max_cost_usd, view.spend.limit_usd, view.plan.cost.total_usd))
    (default_bound, default_limit, estimate), (given, given_limit, _) = limits
    cap = msgspec.json.decode(text)["budget_cap_usd"]
    assert default_bound == pytest.approx(cap) and default_limit == pytest.approx(cap) and estimate < cap
    assert given == 0.5 and given_limit == pytest.approx(0.5)  # lower than the cap: the run's limit


async def test_cancel_is_confirmed_and_idempotent(bus):
    await login(bus)
    _, run = await confirmed_run(bus, "b3", "k1")
    cancel = CancelRequest(run_id=run.run_id, idempotency_key="c1")
    assert code(await call(bus, subjects.API_CANCEL, cancel)) is ErrorCode.confirmation_required
    confirm = ConfirmRequest(action=Action.cancel, run_id=run.run_id)
    issued = data(await call(bus, subjects.API_CONFIRM, confirm), ConfirmationIssued)
    cancel = msgspec.structs.replace(cancel, confirmation_ref=issued.confirmation_ref)
    done = data(await call(bus, subjects.API_CANCEL, cancel), MutationResult)
    assert (done.run_id, done.action, done.state, done.replay) == (
        run.run_id,
        Action.cancel,
        RunState.cancelled,
        False,
    )
    replay = data(await call(bus, subjects.API_CANCEL, cancel), MutationResult)
    assert replay.replay and replay.state is RunState.cancelled
    # a run that cannot be cancelled any more: confirm says so before any person confirms
    assert code(await call(bus, subjects.API_CONFIRM, confirm)) is ErrorCode.run_not_cancellable
    # another account sees no such run, whatever it names
    await login(bus, "other")
    out = await call(bus, subjects.API_CANCEL, cancel, account="other")
    assert code(out) is ErrorCode.run_not_found


async def test_memory_param_never_touches_redis(bus, request):
    """The memory param: no Redis in the wiring, no Redis fixture requested, no server started,
    and a whole train request answered without one connection attempt (the fixture checks that)."""
    if request.node.callspec.params["bus"] != "memory":
        assert bus.w.redis is not None and "redis_infra" in request.fixturenames
        return
    assert bus.w.redis is None
    assert not {"redis_infra", "own_redis", "own_infra"} & set(request.fixturenames)
    with pytest.raises(RuntimeError):
        bus.w.require_redis()
    await login(bus)
    _, run = await confirmed_run(bus, "b4", "k1")
    assert run.state is RunState.queued
    assert bus.touched_redis == []


async def test_a_replay_answers_its_run_whatever_a_gate_says_now(bus):
    """The ledger answers a replay (its accept script looks the key up first); a replay refused
    by a gate on the way (no reference, a booking no longer eligible) is still its key's run, and
    the key with another manifest is a conflict, never a second run."""
    await login(bus)
    train, run = await confirmed_run(bus, "b3", "k-replay")
    without_ref = msgspec.structs.replace(train, confirmation_ref=None)
    again = data(await call(bus, subjects.API_TRAIN, without_ref), RunAccepted)
    assert again.run_id == run.run_id and again.replay
    await publish_booking(bus, booking_event("acme", "b3", "revoked", version=2))
    again = data(await call(bus, subjects.API_TRAIN, train), RunAccepted)
    assert again.run_id == run.run_id and again.replay
    text = train.manifest_text.replace('"name": "', '"name": "x', 1)
    other = msgspec.structs.replace(train, manifest_text=text, manifest_digest=digest_of(text.encode()))
    assert code(await call(bus, subjects.API_TRAIN, other)) is ErrorCode.idempotency_key_conflict


async def test_another_accounts_reference_is_a_mismatch_not_an_unknown_one(bus):
    await login(bus)
    await login(bus, "globex")
    await publish_booking(bus, booking_event("globex", "g1"))
    train, _ = await confirmed_run(bus, "b4", "k-acme")
    theirs = msgspec.structs.replace(train, booking_id="g1", idempotency_key="k-globex")
    assert code(await call(bus, subjects.API_TRAIN, theirs, "globex")) is ErrorCode.confirmation_mismatch
    unknown = msgspec.structs.replace(theirs, confirmation_ref="cf_no_such_reference")
    assert code(await call(bus, subjects.API_TRAIN, unknown, "globex")) is ErrorCode.confirmation_not_found


async def test_runs_lists_the_callers_own_runs_newest_first_in_pages(bus):
    """`ecc ito runs`: only the caller's runs (another account's never, whatever it asks), newest
    first, paged by a cursor that neither repeats nor skips a run, and filtered by state or booking."""
    await login(bus)
    await login(bus, "globex")
    made = [
        (await confirmed_run(bus, booking, key))[1].run_id for booking, key in [("b5", "k1"), ("b5", "k2")]
    ]
    made.append((await confirmed_run(bus, "b6", "k3"))[1].run_id)
    (_, theirs) = await confirmed_run(bus, "g1", "k1", account="globex")

    def listed(out: Envelope) -> tuple[list[str], str | None]:
        page = data(out, RunList)
        return [r.run_id for r in page.runs], page.next

    newest_first = made[::-1]
    assert listed(await call(bus, subjects.API_RUNS, RunsRequest())) == (newest_first, None)
    assert listed(await call(bus, subjects.API_RUNS, RunsRequest(), "globex")) == ([theirs.run_id], None)
    first, cursor = listed(await call(bus, subjects.API_RUNS, RunsRequest(limit=2)))
    assert first == newest_first[:2] and cursor is not None
    assert listed(await call(bus, subjects.API_RUNS, RunsRequest(limit=2, cursor=cursor))) == (
        newest_first[2:],
        None,
    )
    # a cursor is a position in time, not a key: another account's reads its own older runs (none)
    assert listed(await call(bus, subjects.API_RUNS, RunsRequest(cursor=cursor), "globex")) == ([], None)

    page = data(await call(bus, subjects.API_RUNS, RunsRequest(booking_id="b5")), RunList)
    assert [r.run_id for r in page.runs] == made[1::-1]
    assert all((r.booking_id, r.state) == ("b5", RunState.queued) for r in page.runs)
    assert page.runs[0].estimate_usd is not None and page.runs[0].idempotency_key == "k2"
    assert listed(await call(bus, subjects.API_RUNS, RunsRequest(booking_id="g1"))) == ([], None)
    assert listed(await call(bus, subjects.API_RUNS, RunsRequest(state=RunState.running))) == ([], None)
    queued = await call(bus, subjects.API_RUNS, RunsRequest(state=RunState.queued, limit=1))
    assert listed(queued)[0] == newest_first[:1]

    for bad in (RunsRequest(cursor="not-a-cursor"), RunsRequest(cursor="nan:run_x"), RunsRequest(limit=0)):
        assert code(await call(bus, subjects.API_RUNS, bad)) is ErrorCode.request_invalid
    assert code(await call(bus, subjects.API_RUNS, RunsRequest(), "nobody")) is ErrorCode.unauthenticated


async def test_a_confirmation_for_another_action_says_so_and_how_to_get_the_right_one(bus):
    """Cancelling with the run's (consumed) train confirmation is `confirmation_action_mismatch`,
    naming both actions and the command, not `confirmation_consumed ... confirm again`; nothing
    changes, and the right confirmation then cancels the run."""
    await login(bus)
    train, run = await confirmed_run(bus, "b7", "k1")
    cancel = CancelRequest(run_id=run.run_id, idempotency_key="c1", confirmation_ref=train.confirmation_ref)
    out = await call(bus, subjects.API_CANCEL, cancel)
    assert code(out) is ErrorCode.confirmation_action_mismatch
    assert out.error is not None and out.error.message == (
        "this confirmation is for action train, not cancel: get one for cancel with "
        f"`ecc ito confirm --action cancel --run {run.run_id}`"
    )
    assert (
        data(await call(bus, subjects.API_STATUS, StatusRequest(run_id=run.run_id)), RunView).state
        is run.state
    )
    issued = data(
        await call(bus, subjects.API_CONFIRM, ConfirmRequest(action=Action.cancel, run_id=run.run_id)),
        ConfirmationIssued,
    )
    right = msgspec.structs.replace(cancel, confirmation_ref=issued.confirmation_ref)
    assert data(await call(bus, subjects.API_CANCEL, right), MutationResult).state is RunState.cancelled


# --- quotas (docs/quotas.md): the operator's limits, enforced by the scheduler and the confirmation
# service, on both adapters ---


def plan_request(booking: str) -> PlanRequest:
    text = REPO_MANIFEST.read_text()
    return PlanRequest(booking_id=booking, manifest_text=text, manifest_digest=digest_of(text.encode()))


async def test_a_tenant_over_its_request_rate_is_rate_limited_with_a_retry_after_and_another_is_not(bus):
    await login(bus)
    await login(bus, "other")
    await bus.quotas.set_limits("acme", {"rate_per_s": 0.01, "burst": 2})  # no refill during the test
    for _ in range(2):  # the bucket admits its burst (the plan itself is refused: no such booking)
        assert code(await call(bus, subjects.API_PLAN, plan_request("nope"))) is ErrorCode.booking_not_found
    out = await call(bus, subjects.API_PLAN, plan_request("nope"))
    assert code(out) is ErrorCode.rate_limited and out.error is not None
    assert out.error.retry_after_s is not None and 90 < out.error.retry_after_s <= 100
    assert "retry in" in out.error.message
    confirm = ConfirmRequest(action=Action.train, booking_id="nope", manifest_text="{}", manifest_digest="x")
    assert code(await call(bus, subjects.API_CONFIRM, confirm)) is ErrorCode.rate_limited
    # another tenant, on the same services, is admitted as before
    for _ in range(5):
        out = await call(bus, subjects.API_PLAN, plan_request("nope"), account="other")
        assert code(out) is ErrorCode.booking_not_found


async def test_over_its_outstanding_confirmations_a_confirm_is_refused_until_one_is_used(bus):
    await login(bus)
    await bus.quotas.set_limits("acme", {"confirmations": 2})
    await publish_booking(bus, booking_event("acme", "bq"))
    text = REPO_MANIFEST.read_text()
    digest = digest_of(text.encode())
    confirm = ConfirmRequest(action=Action.train, booking_id="bq", manifest_text=text, manifest_digest=digest)
    first = data(await call(bus, subjects.API_CONFIRM, confirm), ConfirmationIssued)
    data(await call(bus, subjects.API_CONFIRM, confirm), ConfirmationIssued)
    out = await call(bus, subjects.API_CONFIRM, confirm)
    assert code(out) is ErrorCode.quota_exceeded and out.error is not None and out.error.quota is not None
    assert (out.error.quota.quota, out.error.quota.current, out.error.quota.limit) == ("confirmations", 2, 2)
    assert "confirmations" in out.error.message
    info = data(await call(bus, subjects.API_AUTH, AuthRequest()), AuthInfo)
    assert info.quotas is not None and info.quotas.usage.confirmations == 2
    train = TrainRequest(
        booking_id="bq",
        manifest_text=text,
        manifest_digest=digest,
        confirmation_ref=first.confirmation_ref,
        idempotency_key="kq",
    )
    data(await call(bus, subjects.API_TRAIN, train), RunAccepted)  # consumes one
    data(await call(bus, subjects.API_CONFIRM, confirm), ConfirmationIssued)  # room again


async def test_far_below_its_run_quotas_a_train_reads_no_run_state(bus, monkeypatch):
    # issue 30: the quota gate read every open run's view on each train request, so the request
    # path grew with the account's open runs (a bench's thousands of queued runs: 98 % of the
    # scheduler's CPU). Below both limits the open-run count alone decides.
    await login(bus)
    _, run = await confirmed_run(bus, "bf1", "k1")

    async def no_states(self, account):
        raise AssertionError("the run states were read far below the quotas")

    monkeypatch.setattr(RunStore, "open_states", no_states)
    monkeypatch.setattr(InMemoryRuns, "open_states", no_states)
    _, other = await confirmed_run(bus, "bf2", "k2")
    assert other.run_id != run.run_id and not other.replay


async def test_over_its_runs_or_queued_quota_train_is_refused_before_anything_is_reserved(bus):
    await login(bus)
    await bus.quotas.set_limits("acme", {"runs": 1})
    first, run = await confirmed_run(bus, "br1", "k1")
    confirm = ConfirmRequest(
        action=Action.train,
        booking_id="br1",
        manifest_text=first.manifest_text,
        manifest_digest=first.manifest_digest,
    )
    issued = data(await call(bus, subjects.API_CONFIRM, confirm), ConfirmationIssued)
    second = msgspec.structs.replace(first, confirmation_ref=issued.confirmation_ref, idempotency_key="k2")
    out = await call(bus, subjects.API_TRAIN, second)
    assert code(out) is ErrorCode.quota_exceeded and out.error is not None and out.error.quota is not None
    assert (out.error.quota.quota, out.error.quota.current, out.error.quota.limit) == ("runs", 1, 1)
    # the replay of the run the account has is still answered
    assert data(await call(bus, subjects.API_TRAIN, first), RunAccepted).run_id == run.run_id
    await bus.quotas.set_limits("acme", {"runs": 5, "queued": 1})
    out = await call(bus, subjects.API_TRAIN, second)
    assert code(out) is ErrorCode.quota_exceeded and out.error is not None and out.error.quota is not None
    assert (out.error.quota.quota, out.error.quota.current, out.error.quota.limit) == ("queued", 1, 1)
    # nothing was reserved: the same confirmation and key are accepted once the quota allows
    await bus.quotas.set_limits("acme", {"queued": 5})
    accepted_second = data(await call(bus, subjects.API_TRAIN, second), RunAccepted)
    assert not accepted_second.replay and accepted_second.run_id != run.run_id
    info = data(await call(bus, subjects.API_AUTH, AuthRequest()), AuthInfo)
    assert info.quotas is not None
    assert (info.quotas.limits.runs, info.quotas.limits.queued) == (5, 5)
    assert (info.quotas.usage.runs, info.quotas.usage.queued, info.quotas.usage.confirmations) == (2, 2, 0)
    # a finished run leaves the count
    cancel = ConfirmRequest(action=Action.cancel, run_id=run.run_id)
    ref = data(await call(bus, subjects.API_CONFIRM, cancel), ConfirmationIssued).confirmation_ref
    req = CancelRequest(run_id=run.run_id, idempotency_key="c1", confirmation_ref=ref)
    assert data(await call(bus, subjects.API_CANCEL, req), MutationResult).state is RunState.cancelled
    info = data(await call(bus, subjects.API_AUTH, AuthRequest()), AuthInfo)
    assert info.quotas is not None and (info.quotas.usage.runs, info.quotas.usage.queued) == (1, 1)
