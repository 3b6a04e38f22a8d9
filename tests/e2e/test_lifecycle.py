"""The tenant-scoped lifecycle through real `ecc` processes: metrics, checkpoints, evals, cancel,
cleanup (with and without releasing the booking), and a credential revoked while following."""

import asyncio
import json
import pathlib
import subprocess
import sys
import time

import pytest

from tests.support import run_status

pytestmark = pytest.mark.e2e
ECC = str(pathlib.Path(sys.executable).parent / "ecc")
LONG = {"tokens": 4000 * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003}


def confirm(stack, env, action, *target):
    rc, out = stack.ecc("confirm", "--action", action, *target, env=env)
    assert rc == 0, out
    return out["data"]["confirmation_ref"]


def start_run(stack, env, account, manifest, key, **overrides):
    booking = stack.booking(account)
    m = str(manifest(**overrides))
    ref = confirm(stack, env, "train", "--booking", booking, "--manifest", m)
    rc, out = stack.ecc(
        "train",
        "--booking",
        booking,
        "--manifest",
        m,
        "--confirmation-ref",
        ref,
        "--idempotency-key",
        key,
        env=env,
    )
    assert rc == 0, out
    return booking, out["data"]["run_id"]


def test_cancel_a_running_run_then_clean_it_up(stack, manifest):
    account, _, env = stack.account()
    booking, run_id = start_run(
        stack,
        env,
        account,
        manifest,
        "long-1",
        target=LONG,
        checkpoint={"interval_steps": 20, "keep_last": 2, "storage": "local"},
    )
    run_status(
        stack, env, run_id, lambda v: v["state"] == "running" and (v.get("last_checkpoint_step") or 0) >= 20
    )

    rc, out = stack.ecc(
        "cleanup", run_id, "--confirmation-ref", "cf_x", "--idempotency-key", "clean-early", env=env
    )
    assert out["error"]["code"] == "run_not_finished"

    rc, out = stack.ecc("cancel", run_id, "--confirmation-ref", "", "--idempotency-key", "c-0", env=env)
    assert out["error"]["code"] == "confirmation_required"
    ref = confirm(stack, env, "cancel", "--run", run_id)
    rc, out = stack.ecc("cancel", run_id, "--confirmation-ref", ref, "--idempotency-key", "c-1", env=env)
    assert rc == 0 and out["data"]["state"] in ("cancelling", "cancelled"), out
    assert (out["data"]["booking_id"], out["data"]["idempotency_key"]) == (booking, "c-1")
    assert len(out["data"]["manifest_digest"]) == 64
    final = run_status(stack, env, run_id, lambda v: v["state"] == "cancelled", timeout=30)
    assert "last checkpoint at step" in final["message"]
    assert final["step"] < final["total_steps"]

    rc, again = stack.ecc("cancel", run_id, "--confirmation-ref", ref, "--idempotency-key", "c-1", env=env)
    assert rc == 0 and again["data"]["replay"] is True and again["data"]["state"] == "cancelled"
    rc, out = stack.ecc("confirm", "--action", "cancel", "--run", run_id, env=env)  # nothing to confirm
    assert rc == 1 and out["error"]["code"] == "run_not_cancellable", out
    rc, out = stack.ecc("cancel", run_id, "--confirmation-ref", "", "--idempotency-key", "c-2", env=env)
    assert out["error"]["code"] == "run_not_cancellable"

    rc, cps = stack.ecc("checkpoints", run_id, env=env)
    assert rc == 0 and cps["data"]["checkpoints"], cps  # the last checkpoint stays listed
    assert all(c["bytes"] > 0 and c["stall_s"] >= 0 for c in cps["data"]["checkpoints"])
    rc, metrics = stack.ecc("metrics", run_id, env=env)
    assert rc == 0 and [p["step"] for p in metrics["data"]["points"]][:3] == [1, 2, 3]

    # cleanup without --release-booking: artifacts go, the booking stays as it was
    ref = confirm(stack, env, "cleanup", "--run", run_id)
    rc, out = stack.ecc("cleanup", run_id, "--confirmation-ref", ref, "--idempotency-key", "cl-1", env=env)
    assert rc == 0, out
    removed = out["data"]["removed"]
    assert removed and any("COMMITTED" in a["path"] for a in removed)
    assert out["data"]["booking_release_requested"] is False
    rc, again = stack.ecc("cleanup", run_id, "--confirmation-ref", ref, "--idempotency-key", "cl-1", env=env)
    assert again["data"]["replay"] is True and again["data"]["removed"] == removed
    for answer in (out, again):
        assert (answer["data"]["booking_id"], answer["data"]["idempotency_key"]) == (booking, "cl-1")
    rc, cps = stack.ecc("checkpoints", run_id, env=env)
    assert cps["data"]["checkpoints"] == [] and cps["data"]["cleaned_up"] is True
    _, found = stack.ecc("find", env=env)
    (view,) = [v for v in found["data"] if v["booking"]["booking_id"] == booking]
    assert view["booking"]["state"] == "completed" and view["allows_training"]


def test_cleanup_with_release_booking_needs_its_own_confirmation(stack, manifest):
    account, _, env = stack.account()
    booking, run_id = start_run(stack, env, account, manifest, "rel-1")
    run_status(stack, env, run_id, lambda v: v["state"] == "succeeded")
    ref = confirm(stack, env, "cleanup", "--run", run_id)
    _rc, out = stack.ecc(
        "cleanup", run_id, "--confirmation-ref", ref, "--idempotency-key", "r-1", "--release-booking", env=env
    )
    assert out["error"]["code"] == "confirmation_required"
    _rc, out = stack.ecc(
        "cleanup",
        run_id,
        "--confirmation-ref",
        ref,
        "--idempotency-key",
        "r-1",
        "--release-booking",
        "--release-confirmation-ref",
        ref,
        env=env,
    )  # a cleanup confirmation is not a release one
    assert out["error"]["code"] == "confirmation_action_mismatch"
    release = confirm(stack, env, "release_booking", "--booking", booking)

    async def cleanup_and_watch():
        nc = await stack.nats("compute")  # ito-compute's identity: the only one that may receive these
        sub = await nc.subscribe(f"{stack.env['ITO_NAMESPACE']}.compute.v1.requests.release")
        proc = await asyncio.create_subprocess_exec(
            *[
                ECC,
                "ito",
                "cleanup",
                run_id,
                "--confirmation-ref",
                ref,
                "--idempotency-key",
                "r-2",
                "--release-booking",
                "--release-confirmation-ref",
                release,
                "--json",
            ],
            env={**stack.env, **env},
            stdout=asyncio.subprocess.PIPE,
        )
        stdout, _ = await proc.communicate()
        msg = await sub.next_msg(timeout=5)
        await nc.close()
        return json.loads(stdout), json.loads(msg.data)

    out, request = asyncio.run(cleanup_and_watch())
    assert out["ok"] and out["data"]["booking_release_requested"] is True, out
    assert request == {"account": account, "booking_id": booking, "run_id": run_id}


def test_every_verb_is_tenant_scoped(stack, manifest):
    owner, _, env = stack.account()
    _, _, other = stack.account()
    _, run_id = start_run(stack, env, owner, manifest, "t-1")
    for args in (
        ["status", run_id],
        ["logs", run_id],
        ["metrics", run_id],
        ["checkpoints", run_id],
        ["evals", run_id],
        ["audit", run_id],
        ["cancel", run_id, "--confirmation-ref", "cf_x", "--idempotency-key", "x"],
        ["cleanup", run_id, "--confirmation-ref", "cf_x", "--idempotency-key", "x"],
        ["confirm", "--action", "cancel", "--run", run_id],
    ):
        rc, out = stack.ecc(*args, env=other)
        assert rc == 1 and out["error"]["code"] == "run_not_found", (args, out)
    rc, out = stack.ecc("evals", run_id, env=env)
    assert rc == 0 and out["data"]["run_id"] == run_id


def test_revocation_stops_follow_at_once(stack, manifest):
    account, _, env = stack.account()
    _, run_id = start_run(stack, env, account, manifest, "f-1", target=LONG)
    follow = subprocess.Popen(
        [ECC, "ito", "status", run_id, "--follow", "--json"],
        env={**stack.env, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    time.sleep(2)
    stack.ito("accounts", "revoke", account)
    try:
        stdout, _ = follow.communicate(timeout=15)  # it stops by itself, without prompting for a login
    finally:
        follow.kill()
    last = json.loads(stdout.strip().splitlines()[-1])
    assert follow.returncode == 1 and last["error"]["code"] == "credential_revoked"
    # the run itself is not the credential's to stop: cancel it through the lifecycle (cleanup of this test)
    key = stack.ito("accounts", "create", account)["api_key"]
    stack.ecc("login", "--account", account, input=key + "\n", env=env)
    ref = confirm(stack, env, "cancel", "--run", run_id)
    stack.ecc("cancel", run_id, "--confirmation-ref", ref, "--idempotency-key", "stop-f-1", env=env)


def test_cancel_a_queued_run_ends_it_at_once(make_stack, manifest):
    stack = make_stack("entitlement,confirmation,ledger,scheduler")  # no trainer: the run stays queued
    account, _, env = stack.account()
    _, run_id = start_run(stack, env, account, manifest, "q-1")
    ref = confirm(stack, env, "cancel", "--run", run_id)
    rc, out = stack.ecc("cancel", run_id, "--confirmation-ref", ref, "--idempotency-key", "qc-1", env=env)
    assert rc == 0 and out["data"]["state"] == "cancelled"
