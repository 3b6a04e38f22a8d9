"""NATS and Redis restarted under load: no accepted request lost, no duplicate run, no consumed
confirmation usable again, and every answer the CLI gives during the outage is a stable code."""

import asyncio
import json
import os
import signal
import time
import uuid

import pytest

from tests.support import eventually

pytestmark = pytest.mark.e2e
CONTROL_PLANE = "entitlement,confirmation,ledger,scheduler"


def restart(stack, name, down_s, during=None):
    """SIGKILL the stack's own `nats` or `redis`, wait, and start it again on its port."""
    os.kill(stack.infra_pid(name), signal.SIGKILL)
    outcome = during() if during else None
    time.sleep(down_s)
    stack.restart_infra(name)
    return outcome


async def burst(stack, account, key, booking, text, digest, n, prefix):
    nc = await stack.tenant(account, key, max_reconnect_attempts=-1, reconnect_time_wait=0.2)

    async def call(suffix, **body):
        try:
            reply = await nc.request(stack.api_subject(suffix, account), json.dumps(body).encode(), timeout=8)
            return json.loads(reply.data)
        except Exception as exc:  # the outage: the answer is lost, the effect is unknown
            return {"ok": False, "transport": type(exc).__name__}

    async def one(i):
        conf = await call(
            "v1.api.confirm", action="train", booking_id=booking, manifest_text=text, manifest_digest=digest
        )
        if not conf["ok"]:
            return f"{prefix}{i}", None, conf
        ref = conf["data"]["confirmation_ref"]
        out = await call(
            "v1.api.train",
            booking_id=booking,
            manifest_text=text,
            manifest_digest=digest,
            confirmation_ref=ref,
            idempotency_key=f"{prefix}{i}",
        )
        return f"{prefix}{i}", ref, out

    results = []
    for i in range(n):  # a steady stream, so that the restart lands in its middle
        results.append(await one(i))
        await asyncio.sleep(0.05)
    await nc.close()
    return results


async def statuses(stack, account, key, keys):
    """`status --idempotency-key K` for each of `keys`, as the CLI asks it (the tenant's own
    connection, the status endpoint): {key: the answer envelope}."""
    nc = await stack.tenant(account, key)
    try:
        subject = stack.api_subject("v1.api.status", account)
        replies = [
            await nc.request(subject, json.dumps({"idempotency_key": k}).encode(), timeout=8) for k in keys
        ]
        return {k: json.loads(r.data) for k, r in zip(keys, replies, strict=True)}
    finally:
        await nc.close()


@pytest.mark.parametrize("victim", ["nats", "redis"])
def test_restart_during_a_burst_keeps_exactly_once(make_stack, manifest, victim):
    stack = make_stack(CONTROL_PLANE)
    account, key, env = stack.account()
    booking = stack.booking(account)
    path = manifest()
    text, digest = path.read_text(), __import__("hashlib").sha256(path.read_bytes()).hexdigest()

    def cli_during_outage():
        started = time.monotonic()
        rc, out = stack.ecc(
            "status", "--idempotency-key", "k0", "--timeout", "3", "--connect-timeout", "1", env=env
        )
        return rc, out, time.monotonic() - started

    async def scenario():
        task = asyncio.create_task(burst(stack, account, key, booking, text, digest, 60, "k"))
        await asyncio.sleep(1.0)
        during = await asyncio.to_thread(
            restart, stack, victim, 1.0, cli_during_outage if victim == "nats" else None
        )
        return await task, during

    results, during = asyncio.run(scenario())
    if during is not None:  # NATS down: the CLI says so, with a stable code, inside its timeout
        rc, out, _ = during
        assert rc == 1 and out["error"]["code"] in ("backend_unavailable", "transport_ambiguous"), out
    accepted = {k: out["data"]["run_id"] for k, _, out in results if out.get("ok")}
    assert accepted, results[:3]
    lost_answers = [k for k, _, out in results if not out.get("ok")]
    assert all(
        "transport" in out or out["error"]["code"] in {"backend_unavailable", "timeout", "internal"}
        for _, _, out in results
        if not out.get("ok")
    ), [o for _, _, o in results if not o.get("ok")][:3]

    # every accepted request is there, by its key, with the same run; status tells the truth for the rest
    # (the CLI asks for one key; the API the CLI calls, for all of them at once: 60 CLI starts were
    # half this test's time)
    first = next(iter(accepted))
    rc, out = stack.ecc("status", "--idempotency-key", first, env=env)
    assert rc == 0 and out["data"]["run_id"] == accepted[first], out
    answers = asyncio.run(statuses(stack, account, key, list(accepted)))
    for k, run_id in accepted.items():
        assert answers[k]["ok"] and answers[k]["data"]["run_id"] == run_id, (k, answers[k])
    found = dict(accepted)

    def settled():
        """Each lost answer's status once it is an answer: the run, or run_not_found."""
        answers = asyncio.run(statuses(stack, account, key, lost_answers))
        done = all(a["ok"] or a["error"]["code"] == "run_not_found" for a in answers.values())
        return answers if done else None

    lost = (
        eventually(settled, timeout=60, interval=0.5, what="status of the lost answers")
        if lost_answers
        else {}
    )
    for k, out in lost.items():
        if out["ok"]:
            found[k] = out["data"]["run_id"]

    # no duplicate: the work queue holds exactly one item per run (the reconciler finishes hand-offs)
    async def queued():
        nc = await stack.nats("operator")
        try:
            return (
                await nc.jetstream().stream_info(f"{stack.env['ITO_NAMESPACE'].upper()}_WORK")
            ).state.messages
        finally:
            await nc.close()

    def one_item_per_run():
        n = asyncio.run(queued())
        assert n <= len(found), (n, len(found))  # never more items than runs
        return n == len(found)

    eventually(one_item_per_run, timeout=30, interval=1, what="one work item per run")
    assert len(set(found.values())) == len(found)

    # a consumed confirmation stays consumed across the restart
    k, ref, _ = next(r for r in results if r[0] in accepted)
    rc, out = stack.ecc(
        "train",
        "--booking",
        booking,
        "--manifest",
        str(path),
        "--confirmation-ref",
        ref,
        "--idempotency-key",
        "fresh-" + uuid.uuid4().hex[:6],
        env=env,
    )
    assert out["error"]["code"] == "confirmation_consumed"
