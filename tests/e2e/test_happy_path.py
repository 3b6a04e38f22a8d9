"""The whole path with real processes: ecc -> scheduler -> entitlement / confirmation / ledger ->
trainer -> a tiny torch model that trains -> `succeeded`."""

import json

import pytest

from tests.support import run_state

pytestmark = pytest.mark.e2e


def test_train_to_succeeded_and_replay(stack, manifest):
    account, _, env = stack.account()
    booking = stack.booking(account)
    m = str(manifest())

    rc, found = stack.ecc("find", env=env)
    assert rc == 0 and [b["booking"]["booking_id"] for b in found["data"]] == [booking]
    assert found["data"][0]["allows_training"] is True

    rc, plan = stack.ecc("plan", "--booking", booking, "--manifest", m, env=env)
    assert rc == 0 and plan["ok"] and plan["data"]["ok"], plan
    assert {c["name"] for c in plan["data"]["checks"]} >= {
        "fabric",
        "data_policy",
        "budget_cap",
        "checkpoint_storage",
    }

    rc, conf = stack.ecc("confirm", "--action", "train", "--booking", booking, "--manifest", m, env=env)
    assert rc == 0, conf
    ref = conf["data"]["confirmation_ref"]
    assert conf["data"]["manifest_digest"] == plan["data"]["manifest_digest"]

    rc, train = stack.ecc(
        "train",
        "--booking",
        booking,
        "--manifest",
        m,
        "--confirmation-ref",
        ref,
        "--idempotency-key",
        "happy-1",
        env=env,
    )
    assert rc == 0 and train["ok"] and train["live_api_contacted"], train
    run_id = train["data"]["run_id"]
    assert train["data"]["replay"] is False

    # the same key again: the same run, no second run, no confirmation needed again
    rc, again = stack.ecc(
        "train",
        "--booking",
        booking,
        "--manifest",
        m,
        "--confirmation-ref",
        "cf_unused",
        "--idempotency-key",
        "happy-1",
        env=env,
    )
    assert rc == 0 and again["data"]["run_id"] == run_id and again["data"]["replay"] is True
    # the spec's identifiers, on the first answer and the replay alike
    for answer in (train, again):
        assert {
            k: answer["data"][k] for k in ("booking_id", "run_id", "manifest_digest", "idempotency_key")
        } == {
            "booking_id": booking,
            "run_id": run_id,
            "manifest_digest": plan["data"]["manifest_digest"],
            "idempotency_key": "happy-1",
        }
        assert answer["data"]["state"] in ("accepted", "queued", "running", "succeeded")
    assert "replay" in again["notice"]

    final = run_state(stack, env, run_id, {"succeeded", "failed"})
    assert final["state"] == "succeeded", final
    assert final["step"] == final["total_steps"] == 30
    assert final["plan"]["manifest_digest"] == plan["data"]["manifest_digest"]

    rc, by_key = stack.ecc("status", "--idempotency-key", "happy-1", env=env)
    assert rc == 0 and by_key["data"]["run_id"] == run_id

    rc, logs = stack.ecc("logs", run_id, env=env)
    assert rc == 0
    messages = [ln["message"] for ln in logs["data"]["lines"]]
    assert any("pretrain finished" in msg for msg in messages), messages
    first, last = (float(x) for x in messages[-1].split("loss ")[1].split(",")[0].split(" -> "))
    assert last < first, messages[-1]  # the model really learned


def test_follow_json_prints_one_event_per_line(stack, manifest):
    account, _, env = stack.account()
    booking = stack.booking(account)
    m = str(manifest())
    _, conf = stack.ecc("confirm", "--action", "train", "--booking", booking, "--manifest", m, env=env)
    _, train = stack.ecc(
        "train",
        "--booking",
        booking,
        "--manifest",
        m,
        "--confirmation-ref",
        conf["data"]["confirmation_ref"],
        "--idempotency-key",
        "follow-1",
        env=env,
    )
    proc = stack.run(
        "ecc", "ito", "status", train["data"]["run_id"], "--follow", "--json", env=env, timeout=240
    )
    assert proc.returncode == 0, proc.stderr
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert events[-1]["ok"] is True and events[-1]["data"]["state"] == "succeeded"
    assert any(e.get("event") == "status" for e in events[:-1])


def test_audit_shows_every_gate_and_is_tenant_scoped(stack, manifest):
    account, _, env = stack.account()
    _, _, other_env = stack.account()
    booking = stack.booking(account)
    m = str(manifest())
    _, conf = stack.ecc("confirm", "--action", "train", "--booking", booking, "--manifest", m, env=env)
    rc, train = stack.ecc(
        "train",
        "--booking",
        booking,
        "--manifest",
        m,
        "--confirmation-ref",
        conf["data"]["confirmation_ref"],
        "--idempotency-key",
        "audit-1",
        env=env,
    )
    assert rc == 0, train
    run_id = train["data"]["run_id"]
    rc, audit = stack.ecc("audit", run_id, env=env)
    assert rc == 0, audit
    gates = [(d["gate"], d["ok"]) for d in audit["data"]["decisions"]]
    for gate in (
        "authenticate",
        "manifest",
        "ledger_lookup",
        "eligibility",
        "plan.budget_cap",
        "confirmation",
        "ledger_accept",
        "hand_off",
    ):
        assert (gate, True) in gates, gates
    assert {d["account"] for d in audit["data"]["decisions"]} == {account}
    assert {d["manifest_digest"] for d in audit["data"]["decisions"][2:]} == {conf["data"]["manifest_digest"]}
    rc, out = stack.ecc("audit", run_id, env=other_env)
    assert rc == 1 and out["error"]["code"] == "run_not_found"
