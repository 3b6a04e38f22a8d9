"""Every service's handlers on one in-memory broker (FastStream's TestNatsBroker), against a real
Redis (ACLs on; the handlers share the admin user here, the security suite tests each service's
own): the decisions and the Redis scripts, without processes or a NATS server."""

import uuid
from datetime import UTC, datetime, timedelta

import msgspec
import pytest
from faststream.nats import TestNatsBroker

from contracts import subjects
from contracts.api import (
    Action,
    AuthRequest,
    ConfirmRequest,
    Credential,
    FindRequest,
    PlanRequest,
    StatusRequest,
    TrainRequest,
)
from contracts.booking import BookingEvent, BookingEventKind, Fabric, Topology
from services.confirmation import app as confirmation_app
from services.entitlement import app as entitlement_app
from services.ledger import app as ledger_app
from services.runtime import accounts, codec, connections
from services.runtime import settings as settings_mod
from services.runtime.keys import Keys
from services.runtime.service import Wiring
from services.scheduler import app as scheduler_app
from services.scheduler.manifests import digest_of

REPO_MANIFEST = (
    __import__("pathlib").Path(__file__).resolve().parents[2] / "examples" / "manifests" / "tiny.json"
)


@pytest.fixture
async def bus(own_redis, monkeypatch):
    monkeypatch.setenv(settings_mod.ENV_ENTITLEMENT_KEY, "in-memory-test-key")
    s = own_redis.settings
    broker = connections.make_broker(s, "scheduler")
    w = Wiring(settings=s, broker=broker, redis=own_redis.redis("admin"), keys=Keys(s))
    for module in (entitlement_app, confirmation_app, ledger_app, scheduler_app):
        module.register(w)
    async with TestNatsBroker(broker) as br:
        yield br, w
    await w.redis.aclose()


async def call(br, w, suffix, request, account="acme"):
    """An API request on the tenant's own subject (in memory, as if NATS had authenticated `account`)."""
    subject = w.settings.subject(suffix) + (f".{account}" if suffix.startswith("v1.api.") else "")
    reply = await br.request(codec.encode(request), subject, timeout=10)
    return codec.decode_envelope(reply.body)


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


async def publish_booking(br, w, ev):
    await br.publish(
        msgspec.json.encode(ev),
        w.settings.subject(f"{subjects.BOOKING_EVENTS}.{ev.kind.value}"),
        stream=w.settings.stream(subjects.STREAM_BOOKINGS),
    )


async def login(w, name="acme"):
    await accounts.create(w.redis, w.keys, name)
    return None  # the account comes from the authenticated subject; nothing secret travels


async def test_auth(bus):
    br, w = bus
    cred = await login(w)
    out = await call(br, w, subjects.API_AUTH, AuthRequest(credential=cred))
    assert out.ok and out.data["account"] == "acme"
    out = await call(br, w, subjects.API_AUTH, AuthRequest(), account="nobody")
    assert not out.ok and out.error.code == "unauthenticated"
    # a key on the wire is refused, and a credential block naming another account too
    out = await call(
        br, w, subjects.API_AUTH, AuthRequest(credential=Credential(account="acme", api_key="nope"))
    )
    assert out.error.code == "request_invalid"
    out = await call(br, w, subjects.API_AUTH, AuthRequest(credential=Credential(account="other")))
    assert out.error.code == "unauthenticated"
    await accounts.revoke(w.redis, w.keys, "acme")
    out = await call(br, w, subjects.API_AUTH, AuthRequest(credential=cred))
    assert out.error.code == "credential_revoked"


async def test_unknown_field_is_request_invalid(bus):
    br, w = bus
    reply = await br.request(
        b'{"credential": {"account": "a", "api_key": "k"}, "x": 1}',
        w.settings.subject(subjects.API_AUTH) + ".a",
        timeout=5,
    )
    out = codec.decode_envelope(reply.body)
    assert not out.ok and out.error.code == "request_invalid" and "x" in out.error.message


async def test_booking_projection_is_versioned_and_parks_early_events(bus):
    br, w = bus
    cred = await login(w)
    await publish_booking(br, w, booking_event("acme", "b1", "modified", version=2, gpus=4))
    text = REPO_MANIFEST.read_text()
    plan = PlanRequest(
        credential=cred, booking_id="b1", manifest_text=text, manifest_digest=digest_of(text.encode())
    )
    out = await call(br, w, subjects.API_PLAN, plan)
    assert out.error.code == "booking_incomplete"  # `modified` arrived before `completed`: parked

    await publish_booking(br, w, booking_event("acme", "b1", "completed", version=1, gpus=8))
    out = await call(br, w, subjects.API_FIND, FindRequest(credential=cred))
    (view,) = out.data
    assert view["booking"]["version"] == 2 and view["booking"]["topology"]["gpus_per_node"] == 4

    await publish_booking(br, w, booking_event("acme", "b1", "revoked", version=1))  # older: ignored
    out = await call(br, w, subjects.API_FIND, FindRequest(credential=cred))
    assert out.data[0]["booking"]["state"] == "completed"
    assert int(await w.redis.hget(w.keys.booking_stats(), "stale_ignored")) == 1


async def test_plan_confirm_train_status(bus):
    br, w = bus
    cred = await login(w)
    await publish_booking(br, w, booking_event("acme", "b2"))
    text = REPO_MANIFEST.read_text()
    digest = digest_of(text.encode())
    out = await call(
        br,
        w,
        subjects.API_CONFIRM,
        ConfirmRequest(
            credential=cred, action=Action.train, booking_id="b2", manifest_text=text, manifest_digest=digest
        ),
    )
    assert out.ok, out
    ref = out.data["confirmation_ref"]
    train = TrainRequest(
        credential=cred,
        booking_id="b2",
        manifest_text=text,
        manifest_digest=digest,
        confirmation_ref=ref,
        idempotency_key="k1",
    )
    out = await call(br, w, subjects.API_TRAIN, train)
    assert out.ok and out.data["state"] == "queued", out
    run_id = out.data["run_id"]
    out = await call(br, w, subjects.API_STATUS, StatusRequest(credential=cred, idempotency_key="k1"))
    assert out.data["run_id"] == run_id and out.data["plan"]["manifest_digest"] == digest
    out = await call(br, w, subjects.API_TRAIN, msgspec.structs.replace(train, idempotency_key="k2"))
    assert out.error.code == "confirmation_consumed"
