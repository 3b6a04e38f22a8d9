"""The entitlement gate through real `ecc` calls: every booking code, fail-closed, and a service
killed between receiving an event and acknowledging it."""

import pathlib
import subprocess
import sys
import time

import pytest

from runtime.configuration import faults
from tests.hf_checkpoints import word_tokenizer
from tests.support import eventually

pytestmark = pytest.mark.e2e
ITO_TRAINING = str(pathlib.Path(sys.executable).parent / "ito-training")


def code_of(stack, env, booking, m):
    _rc, out = stack.ecc("plan", "--booking", booking, "--manifest", str(m), env=env)
    return out["error"]["code"] if not out["ok"] else "ok"


def test_every_booking_code(stack, manifest):
    account, _, env = stack.account()
    m = manifest()
    assert code_of(stack, env, "bk-never", m) == "booking_not_found"
    early = stack.booking(account, event="modified")  # `modified` before its `completed`
    assert code_of(stack, env, early, m) == "booking_incomplete"
    for event, expected in [
        ("expired", "booking_expired"),
        ("released", "booking_released"),
        ("revoked", "booking_revoked"),
    ]:
        booking = stack.booking(account)
        assert code_of(stack, env, booking, m) == "ok"
        stack.booking(account, booking, event=event)
        assert code_of(stack, env, booking, m) == expected
    window_over = stack.booking(account, hours=0.001)
    time.sleep(0.1)
    assert code_of(stack, env, window_over, m) == "booking_expired"


def test_modified_to_fewer_gpus_no_longer_fits(stack, manifest, tmp_path):
    account, _, env = stack.account()
    booking = stack.booking(account, nodes=2, gpus_per_node=8)
    tokenizer = stack.ito("models", "add", str(word_tokenizer(tmp_path / "tok-32k", 32_000)))["digest"]
    big = manifest(
        model={
            "size": "150M",
            "revision": "r",
            "tokenizer": tokenizer,
        },  # bytes would fill 256 of 32,000 rows
        resources={"nodes": 1, "gpus_per_node": 8},
        target={"tokens": 10**9, "seq_len": 2048, "batch_size": 8},
        budget_cap_usd=10**6,
    )
    assert code_of(stack, env, booking, big) == "ok"
    stack.booking(account, booking, event="modified", nodes=1, gpus_per_node=4)
    assert code_of(stack, env, booking, big) == "booking_mismatch"
    other_fabric = stack.booking(account, fabric="roce")
    assert (
        code_of(stack, env, other_fabric, manifest(resources={"fabric": "infiniband"})) == "booking_mismatch"
    )


def test_find_is_tenant_scoped(stack):
    a, _, env_a = stack.account()
    b, _, _env_b = stack.account()
    mine, theirs = stack.booking(a), stack.booking(b)
    _, found = stack.ecc("find", env=env_a)
    assert [v["booking"]["booking_id"] for v in found["data"]] == [mine]
    assert theirs not in str(found)


def test_stale_statement_is_refused(make_stack, manifest):
    stack = make_stack("entitlement,confirmation,ledger,scheduler", env={"ITO_ELIGIBILITY_TTL_S": "0.000001"})
    account, _, env = stack.account()
    booking = stack.booking(account)
    assert code_of(stack, env, booking, manifest()) == "eligibility_stale"


def test_entitlement_killed_between_receive_and_ack(make_stack, manifest):
    """The event is redelivered to the restarted service; the projection ends up as upstream says."""
    stack = make_stack("confirmation,ledger,scheduler")
    crashing = subprocess.Popen(
        [ITO_TRAINING, "serve", "entitlement"],
        env={**stack.env, faults.ENV_FAULT_POINT: faults.ENTITLEMENT_BEFORE_APPLY},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    account, _, env = stack.account()
    time.sleep(2)  # let it subscribe
    booking = stack.booking(account)
    assert crashing.wait(timeout=20) == 137
    assert code_of(stack, env, booking, manifest()) == "backend_unavailable"  # fails closed, never "allow"
    healthy = subprocess.Popen(
        [ITO_TRAINING, "serve", "entitlement"],
        env=stack.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        eventually(lambda: code_of(stack, env, booking, manifest()) == "ok", timeout=30, interval=0.5)
        stack.booking(account, booking, event="revoked")
        eventually(
            lambda: code_of(stack, env, booking, manifest()) == "booking_revoked", timeout=10, interval=0.2
        )
    finally:
        healthy.terminate()
        healthy.wait(timeout=15)
