"""Quotas end to end (docs/quotas.md) on the session's stack: the operator sets an account's limits
with `ito-training accounts quota`, `ecc ito auth` shows them with what the account uses, and a
tenant over its request rate is answered `rate_limited` with a retry-after through the real
services, while another tenant is not."""

import pytest

pytestmark = pytest.mark.e2e


def test_the_operators_quotas_are_shown_and_enforced(stack, manifest):
    account, _, env = stack.account()
    other, _, other_env = stack.account()
    shown = stack.ito("accounts", "quota", account, "--rate", "0.01", "--burst", "2", "--runs", "3")
    assert shown["quotas"]["rate_per_s"] == 0.01 and shown["quotas"]["runs"] == 3

    rc, out = stack.ecc("auth", env=env)
    assert rc == 0 and out["ok"], out
    quotas = out["data"]["quotas"]
    assert quotas["limits"]["burst"] == 2 and quotas["limits"]["runs"] == 3
    assert quotas["usage"] == {
        "tokens": 2.0,
        "confirmations": 0,
        "runs": 0,
        "queued": 0,
        "file_bytes": 0,
        "files": 0,
        "models": 0,
    }

    m = str(manifest())
    for _ in range(2):  # the burst (each plan refused on its own: no such booking)
        rc, out = stack.ecc("plan", "--booking", "bk-none", "--manifest", m, env=env)
        assert out["error"]["code"] == "booking_not_found", out
    rc, out = stack.ecc("plan", "--booking", "bk-none", "--manifest", m, env=env)
    assert rc != 0 and out["error"]["code"] == "rate_limited", out
    assert 90 < out["error"]["retry_after_s"] <= 100
    text = stack.run("ecc", "ito", "plan", "--booking", "bk-none", "--manifest", m, env=env)
    assert "error [rate_limited]" in text.stderr and "retry after:" in text.stderr
    rc, out = stack.ecc("plan", "--booking", "bk-none", "--manifest", m, env=other_env)
    assert out["error"]["code"] == "booking_not_found", out  # another tenant is admitted
    assert other != account
