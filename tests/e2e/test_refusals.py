"""Refusals through the real CLI: each gate fails closed with a stable code and changes nothing."""

import asyncio
import json
import os
import time
import uuid

import pytest

pytestmark = pytest.mark.e2e


def confirm(stack, env, booking, m):
    rc, out = stack.ecc("confirm", "--action", "train", "--booking", booking, "--manifest", str(m), env=env)
    assert rc == 0, out
    return out["data"]["confirmation_ref"]


def train(stack, env, booking, m, ref, key=None):
    return stack.ecc(
        "train",
        "--booking",
        booking,
        "--manifest",
        str(m),
        "--confirmation-ref",
        ref,
        "--idempotency-key",
        key or uuid.uuid4().hex,
        env=env,
    )


def code(out):
    assert out["ok"] is False, out
    return out["error"]["code"]


def test_not_logged_in_is_unauthenticated(stack, tmp_path):
    rc, out = stack.ecc("auth", env={"ECC_CONFIG_DIR": str(tmp_path / "nobody")})
    assert rc == 1 and code(out) == "unauthenticated" and out["live_api_contacted"] is False


def test_wrong_key_and_revoked_key(stack, tmp_path):
    account, _key, env = stack.account()
    rc, out = stack.ecc(
        "login", "--account", account, input="ito_sk_wrong\n", env={"ECC_CONFIG_DIR": str(tmp_path / "x")}
    )
    assert rc == 1 and code(out) == "unauthenticated"
    assert "ito_sk_wrong" not in json.dumps(out)
    stack.ito("accounts", "revoke", account)
    rc, out = stack.ecc("auth", env=env)
    assert rc == 1 and code(out) == "credential_revoked"


def test_booking_gates(stack, manifest):
    account, _, env = stack.account()
    other, _, _other_env = stack.account()
    m = manifest()
    rc, out = stack.ecc("plan", "--booking", "bk-none", "--manifest", str(m), env=env)
    assert code(out) == "booking_not_found"
    theirs = stack.booking(other)
    rc, out = stack.ecc("plan", "--booking", theirs, "--manifest", str(m), env=env)
    assert code(out) == "booking_not_found"  # another tenant's booking leaks nothing
    small = stack.booking(account, gpus_per_node=1)
    rc, out = stack.ecc(
        "plan",
        "--booking",
        small,
        "--manifest",
        str(manifest(resources={"nodes": 1, "gpus_per_node": 2})),
        env=env,
    )
    assert code(out) == "booking_mismatch"
    revoked = stack.booking(account)
    ref = confirm(stack, env, revoked, m)
    stack.booking(account, revoked, event="revoked")
    rc, out = train(stack, env, revoked, m, ref)
    assert rc == 1 and code(out) == "booking_revoked"


def test_confirmation_gates(stack, manifest):
    account, _, env = stack.account()
    other, _, other_env = stack.account()
    booking = stack.booking(account)
    m = manifest()
    rc, out = stack.ecc(
        "train",
        "--booking",
        booking,
        "--manifest",
        str(m),
        "--confirmation-ref",
        "",
        "--idempotency-key",
        "k-none",
        env=env,
    )
    assert code(out) == "confirmation_required"
    rc, out = train(stack, env, booking, m, "cf_does_not_exist")
    assert code(out) == "confirmation_not_found"
    ref = confirm(stack, env, booking, m)
    other_booking = stack.booking(other)
    rc, out = train(stack, other_env, other_booking, m, ref)
    assert code(out) == "confirmation_mismatch"  # account A's confirmation used by account B
    rc, out = train(stack, env, booking, m, ref, key="conf-1")
    assert rc == 0, out
    rc, out = train(stack, env, booking, m, ref, key="conf-2")  # the same confirmation, a new key
    assert code(out) == "confirmation_consumed"
    edited = manifest(seed=7)  # edited after confirm
    ref2 = confirm(stack, env, booking, m)
    rc, out = train(stack, env, booking, edited, ref2)
    assert code(out) == "manifest_digest_mismatch"


def test_idempotency_gates(stack, manifest):
    account, _, env = stack.account()
    booking = stack.booking(account)
    m = manifest()
    rc, out = train(stack, env, booking, m, confirm(stack, env, booking, m), key="x" * 256)
    assert code(out) == "idempotency_key_invalid"
    rc, out = train(stack, env, booking, m, confirm(stack, env, booking, m), key="idem-1")
    assert rc == 0
    rc, out = train(stack, env, booking, manifest(seed=3), "cf_any", key="idem-1")
    assert code(out) == "idempotency_key_conflict"


def test_manifest_gates(stack, manifest, tmp_path):
    account, _, env = stack.account()
    booking = stack.booking(account)
    _rc, out = stack.ecc("plan", "--booking", booking, "--manifest", "relative.json", env=env)
    assert code(out) == "manifest_not_absolute" and out["live_api_contacted"] is False
    secret = "AKIA" + "Q" * 16
    m = manifest(name=f"run {secret}")
    _rc, out = stack.ecc("plan", "--booking", booking, "--manifest", str(m), env=env)
    assert code(out) == "manifest_contains_secret" and secret not in json.dumps(out)
    _rc, out = stack.ecc("plan", "--booking", booking, "--manifest", str(manifest(unknown_field=1)), env=env)
    assert code(out) == "manifest_invalid" and "unknown_field" in out["error"]["message"]
    link = tmp_path / "link.json"
    link.symlink_to(manifest())
    _rc, out = stack.ecc("plan", "--booking", booking, "--manifest", str(link), env=env)
    assert code(out) == "manifest_symlink"


def test_a_manifest_the_trainer_would_refuse_is_refused_before_anything_is_consumed(stack, manifest):
    """Accepted then refused: `recipe: ["sftt"]` and midtrain tokens above target.tokens used to plan
    `ok`, consume the confirmation and reserve the key, and only then fail in the trainer."""
    account, _, env = stack.account()
    booking = stack.booking(account)
    good = manifest()
    ref = confirm(stack, env, booking, good)  # a confirmation the bad manifests must not be able to burn
    for bad, where in (
        (manifest(post_training={"recipe": ["sftt"]}), "post_training.recipe"),
        (manifest(stages={"midtrain": {"tokens": 10**9}}), "target.tokens"),
    ):
        for verb in (["plan"], ["confirm", "--action", "train"]):
            rc, out = stack.ecc(*verb, "--booking", booking, "--manifest", str(bad), env=env)
            assert code(out) == "manifest_invalid" and where in out["error"]["message"], out
        rc, out = train(stack, env, booking, bad, ref, key="bad-" + where)
        assert code(out) == "manifest_invalid", out
        rc, out = stack.ecc("status", "--idempotency-key", "bad-" + where, env=env)
        assert code(out) == "run_not_found"
    rc, out = train(stack, env, booking, good, ref, key="good-after-bad")
    assert rc == 0, out  # the confirmation was not consumed by the refused requests


@pytest.mark.parametrize(
    "payload, why",
    [
        (b'{"credential": {"account": "a", "api_key": "k"}, "surprise": 1}', "unknown field"),
        (b'{"credential": {"account": "a", "api_key": 5}}', "wrong type"),
        (b"not json", "not JSON"),
        (b'{"credential": {"account": "a", "api_key": "' + b"k" * (3 * 1024 * 1024) + b'"}}', "oversized"),
    ],
)
def test_bad_requests_get_request_invalid(stack, payload, why):
    account, key, _ = stack.account()

    async def ask():
        nc = await stack.tenant(account, key)
        try:
            reply = await nc.request(stack.api_subject("v1.api.auth", account), payload, timeout=5)
            return json.loads(reply.data)
        finally:
            await nc.close()

    try:
        out = asyncio.run(ask())
    except Exception as exc:  # the server's max_payload refused it before any service saw it
        assert why == "oversized" and "payload" in str(exc).lower()
        return
    assert out["ok"] is False and out["error"]["code"] == "request_invalid", (why, out)


def test_unsafe_manifest_files(stack, manifest, tmp_path):
    account, _, env = stack.account()
    booking = stack.booking(account)

    def plan_code(path):
        _rc, out = stack.ecc("plan", "--booking", booking, "--manifest", str(path), env=env, timeout=30)
        return code(out)

    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert plan_code(fifo) == "manifest_not_regular"  # and it did not hang
    assert plan_code(tmp_path) == "manifest_not_regular"
    writable = manifest()
    writable.chmod(0o666)
    assert plan_code(writable) == "manifest_unsafe_permissions"
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    inside = open_dir / "m.json"
    inside.write_bytes(manifest().read_bytes())
    inside.chmod(0o644)
    assert plan_code(inside) == "manifest_unsafe_permissions"
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (1024 * 1024 + 1))
    big.chmod(0o644)
    assert plan_code(big) == "manifest_too_large"
    pem = manifest(name="-----BEGIN RSA PRIVATE KEY-----\nMIIEow\n-----END RSA PRIVATE KEY-----")
    _rc, out = stack.ecc("plan", "--booking", booking, "--manifest", str(pem), env=env)
    assert code(out) == "manifest_contains_secret" and "MIIEow" not in json.dumps(out)


def test_expired_confirmation(make_stack, manifest):
    stack = make_stack("entitlement,confirmation,ledger,scheduler", env={"ITO_CONFIRMATION_TTL_S": "1"})
    account, _, env = stack.account()
    booking = stack.booking(account)
    m = manifest()
    ref = confirm(stack, env, booking, m)
    time.sleep(1.5)
    _rc, out = train(stack, env, booking, m, ref)
    assert code(out) == "confirmation_expired"
