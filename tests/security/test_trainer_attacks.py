"""Attacks on runs below the API: forged run events, cancel notices, work items and cleanup orders.
Each is refused by the NATS permissions for a tenant, and by the code for an identity that may
publish there (defence in depth): nothing about the victim's run changes."""

import asyncio
import json
import os
import pathlib
import time

import msgspec
import pytest

from contracts import subjects
from contracts.runs import LogLine, RunCreated, StateChanged, TrainWork
from contracts.states import RunState
from runtime.security.order_signatures import Signer
from runtime.security.secrets import Secrets
from tests.e2e.test_lifecycle import LONG, confirm, start_run
from tests.security.conftest import settle
from tests.support import eventually_async, run_status

pytestmark = pytest.mark.e2e
CONTROL_PLANE = "entitlement,confirmation,ledger,scheduler"


def now_us() -> int:
    return time.time_ns() // 1000


def event_subject(stack, run_id, kind):
    return f"{stack.env['ITO_NAMESPACE']}.{subjects.RUN_EVENTS}.{run_id}.{kind}"


def signer(stack) -> Signer:
    """The scheduler's key, read the way only the scheduler (and this test) can."""
    return Signer(Secrets(stack.settings.secrets_dir).signing_key())


def test_forged_run_events_change_nothing(make_stack, manifest, as_tenant, as_identity):
    """The attack: a forged `state` event (epoch 0) marked another tenant's run `succeeded`, and a
    forged log line showed in `ecc ito logs`."""
    stack = make_stack(CONTROL_PLANE)  # no trainer: the run stays queued and nobody holds a lease
    victim, _, env = stack.account()
    attacker, key, _ = stack.account()
    _, run_id = start_run(stack, env, victim, manifest, "v-1")
    stream = f"{stack.env['ITO_NAMESPACE'].upper()}_RUNS"
    at = "2026-01-01T00:00:00Z"
    forged_state = msgspec.json.encode(
        StateChanged(run_id=run_id, seq=now_us(), at=at, epoch=0, state=RunState.succeeded, message="pwned")
    )
    forged_log = msgspec.json.encode(
        LogLine(run_id=run_id, seq=now_us() + 1, at=at, level="info", message="pwned")
    )
    far_future = msgspec.json.encode(
        LogLine(run_id=run_id, seq=now_us() * 10, at=at, level="info", message="pwned")
    )
    created_as_state = msgspec.json.encode(
        RunCreated(
            run_id=run_id,
            seq=now_us() + 2,
            at=at,
            account=attacker,
            booking_id="b",
            region="r",
            gpu_model="g",
            gpus=1,
            accepted_at=at,
        )
    )

    async def attack():
        t = await as_tenant(stack, attacker, key)
        await t.nc.publish(event_subject(stack, run_id, "state"), forged_state)
        await settle(t)
        await t.close()
        trainer = await as_identity(stack, "trainer")  # the only identity allowed on these subjects
        js = trainer.nc.jetstream(timeout=2)
        for kind, body in (
            ("state", forged_state),
            ("log", forged_log),
            ("log", far_future),
            ("state", created_as_state),
        ):
            await js.publish(event_subject(stack, run_id, kind), body)
        await trainer.close()
        ops = await as_identity(stack, "operator")
        js = ops.nc.jetstream(timeout=2)
        consumer = f"{stack.env['ITO_NAMESPACE']}-scheduler-runs"

        async def caught_up():
            info = await js.consumer_info(stream, consumer)
            return info.num_pending == 0 and info.num_ack_pending == 0

        # until the scheduler's consumer has seen all of them
        await eventually_async(caught_up, timeout=10, what="the scheduler's run consumer caught up")
        await ops.close()
        return t

    t = asyncio.run(attack())
    assert t.denied(event_subject(stack, run_id, "state"))
    _rc, status = stack.ecc("status", run_id, env=env)
    assert status["data"]["state"] == "queued" and status["data"]["message"] != "pwned", status
    _rc, logs = stack.ecc("logs", run_id, env=env)
    assert not any(line["message"] == "pwned" for line in logs["data"]["lines"])


def test_cancel_notices_work_items_and_cleanup_orders_need_the_scheduler(
    make_stack, manifest, as_tenant, as_identity, tmp_path
):
    """The attacks: a cancel notice stopped a run with no confirmation; a forged work item with the
    victim's run id trained into an attacker-chosen directory; a cleanup order deleted any directory."""
    stack = make_stack()
    ns = stack.env["ITO_NAMESPACE"]
    victim, _, env = stack.account()
    attacker, key, _ = stack.account()
    _, run_id = start_run(
        stack,
        env,
        victim,
        manifest,
        "long-v",
        target=LONG,
        checkpoint={"interval_steps": 20, "keep_last": 2, "storage": "local"},
    )
    running = run_status(stack, env, run_id, lambda v: v["state"] == "running" and v["step"] > 5)
    cancel_subject = f"{ns}.{subjects.CONTROL_CANCEL}.{run_id}"
    evil_dir = tmp_path / "evil"
    work = msgspec.json.decode(stack.redis().hget(f"{ns}:{{{victim}}}:run:{run_id}", "work"), type=TrainWork)
    redirected = msgspec.json.encode(msgspec.structs.replace(work, checkpoint_dir=str(evil_dir)))
    rebound = msgspec.json.encode(
        msgspec.structs.replace(work, account=attacker, checkpoint_dir=str(evil_dir))
    )
    work_subject = f"{ns}.{subjects.WORK_TRAIN}.{run_id}"
    outside = tmp_path / "precious"
    outside.mkdir()
    (outside / "data").write_text("keep me")

    async def attack():
        t = await as_tenant(stack, attacker, key)
        await t.nc.publish(cancel_subject, b"{}")
        await t.nc.publish(work_subject, redirected)
        with pytest.raises(Exception):
            await t.nc.request(f"{ns}.{subjects.TRAINER_CLEANUP}", b"{}", timeout=1)
        await settle(t)
        await t.close()
        ops = await as_identity(stack, "operator")  # may publish anywhere: the code must still refuse
        await ops.nc.publish(cancel_subject, b"{}")  # unsigned
        await ops.nc.publish(
            cancel_subject, b"{}", headers=signer(stack).headers(cancel_subject, b"{}")
        )  # signed, but no cancel was accepted
        js = ops.nc.jetstream(timeout=2)
        await js.publish(work_subject, redirected, headers={"Nats-Msg-Id": "evil-1"})  # unsigned
        await js.publish(
            work_subject,
            rebound,
            headers={"Nats-Msg-Id": "evil-2", **signer(stack).headers(work_subject, rebound)},
        )
        answers = []
        for order in (
            {"account": "..", "run_id": "precious", "checkpoint_dir": str(outside), "storage": str(tmp_path)},
            {
                "account": victim,
                "run_id": "../../precious",
                "checkpoint_dir": str(outside),
                "storage": str(tmp_path),
            },
        ):
            body = json.dumps(order).encode()
            subject = f"{ns}.{subjects.TRAINER_CLEANUP}"
            for headers in ({}, signer(stack).headers(subject, body)):
                reply = await ops.nc.request(subject, body, headers=headers, timeout=10)
                answers.append(json.loads(reply.data))
        await ops.close()
        return t, answers

    t, answers = asyncio.run(attack())
    assert (
        t.denied(cancel_subject) and t.denied(work_subject) and t.denied(f"{ns}.{subjects.TRAINER_CLEANUP}")
    )
    assert [a["error"]["code"] for a in answers] == ["forbidden"] * 4, answers
    assert (outside / "data").read_text() == "keep me"

    time.sleep(3)  # a real cancel would have stopped it within a step
    later = run_status(stack, env, run_id, lambda v: True)
    assert later["state"] == "running" and later["step"] > running["step"], later

    # the real cancel, through the gates; then the forged items reach the trainer and are refused
    ref = confirm(stack, env, "cancel", "--run", run_id)
    rc, out = stack.ecc(
        "cancel", run_id, "--confirmation-ref", ref, "--idempotency-key", "real-cancel", env=env
    )
    assert rc == 0, out
    run_status(stack, env, run_id, lambda v: v["state"] == "cancelled", timeout=60)

    async def queue_drained():
        ops = await as_identity(stack, "operator")
        js = ops.nc.jetstream(timeout=2)

        async def empty():
            return (await js.stream_info(f"{ns.upper()}_WORK")).state.messages == 0

        try:
            await eventually_async(empty, timeout=60, interval=0.5, what="the work queue drained")
        finally:
            await ops.close()

    asyncio.run(queue_drained())
    assert not evil_dir.exists()
    rc, final = stack.ecc("status", run_id, env=env)
    assert final["data"]["state"] == "cancelled"

    # what the trainer wrote is private to it
    ckpt = stack.data_dir / "checkpoints" / victim / run_id
    files = [p for p in ckpt.rglob("*")]
    assert files
    for path in [ckpt, *files]:
        mode = path.stat().st_mode & 0o777
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


def test_cleanup_refuses_a_linked_run_directory(tmp_path):
    """Cleanup resolves paths: a run directory that is a link (or under one) out of the root is refused."""
    from runtime.storage.checkpoint_paths import inside

    root = tmp_path / "checkpoints"
    (root / "acme").mkdir(parents=True)
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.symlink(target, root / "acme" / "run_1")
    os.symlink(target, root / "linked")
    assert not inside(root, root / "linked" / "run_2")
    assert not inside(root, root / ".." / "elsewhere")
    assert not inside(root, root)
    assert inside(root, root / "acme" / "run_3")
    assert pathlib.Path(os.path.realpath(root / "acme" / "run_1")) == target
