"""Exactly-once run creation under concurrency and crashes, against the real services.

The control plane runs without a trainer here, so every run handed off stays on the work queue
where it can be counted: the queue is the trainer's only input.
"""

import asyncio
import json
import pathlib
import subprocess
import sys
import time
import uuid

import pytest

from contracts import subjects
from runtime.configuration import faults
from tests.support import eventually

pytestmark = pytest.mark.e2e
CONTROL_PLANE = "entitlement,confirmation,ledger,scheduler"
ITO_TRAINING = str(pathlib.Path(sys.executable).parent / "ito-training")


def manifest_request(path):
    import hashlib

    data = path.read_bytes()
    return data.decode(), hashlib.sha256(data).hexdigest()


class Bus:
    """Direct requests to the API, as many concurrent `ecc` processes would send them."""

    def __init__(self, stack, account, key):
        self.stack, self.account, self.key = stack, account, key
        self.ns = stack.env["ITO_NAMESPACE"]

    async def __aenter__(self):
        self.nc = await self.stack.tenant(self.account, self.key)  # authenticated as the tenant, like ecc
        self.ops = await self.stack.nats("operator")  # the test's eyes on the queue
        return self

    async def __aexit__(self, *exc):
        await self.nc.close()
        await self.ops.close()

    async def call(self, suffix, **body):
        reply = await self.nc.request(
            self.stack.api_subject(suffix, self.account), json.dumps(body).encode(), timeout=30
        )
        return json.loads(reply.data)

    async def confirm(self, booking, text, digest):
        out = await self.call(
            subjects.API_CONFIRM,
            action="train",
            booking_id=booking,
            manifest_text=text,
            manifest_digest=digest,
        )
        assert out["ok"], out
        return out["data"]["confirmation_ref"]

    async def train(self, booking, text, digest, ref, key):
        return await self.call(
            subjects.API_TRAIN,
            booking_id=booking,
            manifest_text=text,
            manifest_digest=digest,
            confirmation_ref=ref,
            idempotency_key=key,
        )

    async def queued(self) -> int:
        js = self.ops.jetstream()
        info = await js.stream_info(f"{self.ns.upper()}_WORK")
        return info.state.messages


def test_50_parallel_trains_with_one_key_create_one_run(make_stack, manifest):
    stack = make_stack(CONTROL_PLANE)
    account, key, _ = stack.account()
    booking = stack.booking(account)
    text, digest = manifest_request(manifest())

    async def scenario():
        async with Bus(stack, account, key) as bus:
            ref = await bus.confirm(booking, text, digest)
            outs = await asyncio.gather(
                *(bus.train(booking, text, digest, ref, "same-key") for _ in range(50))
            )
            return outs, await bus.queued()

    outs, queued = asyncio.run(scenario())
    run_ids = {o["data"]["run_id"] for o in outs if o["ok"]}
    assert len(run_ids) == 1, [o.get("error") for o in outs if not o["ok"]][:3]
    assert all(o["ok"] for o in outs), [o["error"] for o in outs if not o["ok"]][:3]
    assert sum(not o["data"]["replay"] for o in outs) == 1
    assert queued == 1


def test_200_distinct_keys_in_parallel_create_200_runs(make_stack, manifest):
    stack = make_stack(CONTROL_PLANE)
    account, key, _ = stack.account()
    booking = stack.booking(account)
    text, digest = manifest_request(manifest())

    async def scenario():
        async with Bus(stack, account, key) as bus:
            refs = await asyncio.gather(*(bus.confirm(booking, text, digest) for _ in range(200)))
            outs = await asyncio.gather(
                *(bus.train(booking, text, digest, ref, f"key-{i}") for i, ref in enumerate(refs))
            )
            return outs, await bus.queued()

    outs, queued = asyncio.run(scenario())
    assert all(o["ok"] for o in outs), [o["error"] for o in outs if not o["ok"]][:3]
    assert len({o["data"]["run_id"] for o in outs}) == 200
    assert queued == 200


def test_scheduler_killed_between_reservation_and_handoff(make_stack, manifest):
    """The accept is durable; the reconciler of the restarted scheduler finishes the hand-off once."""
    stack = make_stack("entitlement,confirmation,ledger")
    m = str(manifest())
    crashing = subprocess.Popen(
        [ITO_TRAINING, "serve", "scheduler"],
        env={**stack.env, faults.ENV_FAULT_POINT: faults.SCHEDULER_AFTER_ACCEPT},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        account, key = "crash-" + uuid.uuid4().hex[:6], None
        key = stack.ito("accounts", "create", account)["api_key"]
        env = {"ECC_CONFIG_DIR": str(stack.data_dir / "ecc" / account)}
        eventually(
            lambda: stack.ecc("login", "--account", account, input=key + "\n", env=env)[0] == 0,
            timeout=30,
            interval=0.2,
            what="the scheduler answers a login",
        )
        booking = stack.booking(account)
        _, conf = stack.ecc("confirm", "--action", "train", "--booking", booking, "--manifest", m, env=env)
        rc, out = stack.ecc(
            "train",
            "--booking",
            booking,
            "--manifest",
            m,
            "--confirmation-ref",
            conf["data"]["confirmation_ref"],
            "--idempotency-key",
            "crash-1",
            "--timeout",
            "5",
            env=env,
        )
        assert crashing.wait(timeout=10) == 137  # it died at the fault point
        assert rc == 1 and out["error"]["code"] == "transport_ambiguous", out
    finally:
        crashing.kill()
    healthy = subprocess.Popen(
        [ITO_TRAINING, "serve", "scheduler"],
        env=stack.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def handed_off():
            rc, status = stack.ecc("status", "--idempotency-key", "crash-1", env=env)
            return status if rc == 0 and status["data"]["state"] == "queued" else None

        status = eventually(handed_off, timeout=60, interval=0.5, what="the crashed accept handed off")

        async def queued():
            async with Bus(stack, account, key) as bus:
                return await bus.queued()

        assert asyncio.run(queued()) == 1
        rc, again = stack.ecc(
            "train",
            "--booking",
            booking,
            "--manifest",
            m,
            "--confirmation-ref",
            "cf_x",
            "--idempotency-key",
            "crash-1",
            env=env,
        )
        assert rc == 0 and again["data"]["run_id"] == status["data"]["run_id"] and again["data"]["replay"]
        assert asyncio.run(queued()) == 1
    finally:
        healthy.terminate()
        healthy.wait(timeout=15)


def test_entitlement_down_is_backend_unavailable_within_the_timeout(make_stack, manifest):
    stack = make_stack("confirmation,ledger,scheduler")
    _account, _, env = stack.account()
    m = str(manifest())
    started = time.monotonic()
    rc, out = stack.ecc(
        "train",
        "--booking",
        "bk-" + uuid.uuid4().hex[:6],
        "--manifest",
        m,
        "--confirmation-ref",
        "cf_x",
        "--idempotency-key",
        "down-1",
        "--timeout",
        "10",
        env=env,
    )
    assert rc == 1 and out["error"]["code"] == "backend_unavailable", out
    assert time.monotonic() - started < 10 + 5  # inside the CLI's timeout, with process start-up slack
    rc, out = stack.ecc("status", "--idempotency-key", "down-1", env=env)
    assert out["error"]["code"] == "run_not_found"


def test_plan_creates_nothing(make_stack, manifest):
    """No run, no consumed confirmation, no ledger entry, nothing on the trainer's queue."""

    stack = make_stack(CONTROL_PLANE)
    account, key, env = stack.account()
    booking = stack.booking(account)
    m = str(manifest())
    ref = json.loads(
        json.dumps(
            stack.ecc("confirm", "--action", "train", "--booking", booking, "--manifest", m, env=env)[1]
        )
    )["data"]["confirmation_ref"]
    r = stack.redis()
    ns = stack.env["ITO_NAMESPACE"]

    def state():
        keys = sorted(k.decode() for k in r.scan_iter(match=f"{ns}:{{{account}}}:*"))
        confirmations = {k: r.hget(k, "consumed") for k in keys if ":conf:" in k}

        async def queued():
            async with Bus(stack, account, key) as bus:
                return await bus.queued()

        return keys, confirmations, asyncio.run(queued())

    before = state()
    for _ in range(3):
        rc, out = stack.ecc("plan", "--booking", booking, "--manifest", m, env=env)
        assert rc == 0, out
    assert state() == before
    assert before[2] == 0 and not any(":idem:" in k or ":run:" in k for k in before[0])
    assert list(before[1].values()) == [b"0"] and ref
