"""Every attack seen on the open bus, against a real authenticated stack: with no credential, with
a tenant's own credential, and with another identity's where it matters. Each asserts the refusal
(auth error, permissions violation, typed refusal) and that nothing changed."""

import asyncio
import json
import pathlib
import uuid

import msgspec
import nats
import pytest
import redis

from contracts import subjects
from contracts.api import Action
from contracts.desk import DeskRunsRequest
from contracts.internal import ConfirmationCreate, LedgerAccept
from devstack import booking_sim
from tests.security.conftest import settle
from tests.support import eventually_async

pytestmark = pytest.mark.e2e


def test_no_credential_no_connection(stack):
    async def anonymous():
        await nats.connect(
            stack.env["ITO_NATS_URL"], connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0
        )

    with pytest.raises(Exception) as refused:
        asyncio.run(anonymous())
    assert "authorization" in str(refused.value).lower()

    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(stack.env["ITO_REDIS_URL"]).ping()
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(stack.env["ITO_REDIS_URL"], username="ledger", password="guess").ping()


def test_an_unknown_nkey_is_refused(stack):
    from runtime.security.secrets import new_nkey_seed

    async def stranger():
        await nats.connect(
            stack.env["ITO_NATS_URL"],
            connect_timeout=2,
            allow_reconnect=False,
            max_reconnect_attempts=0,
            nkeys_seed_str=new_nkey_seed().decode(),
        )

    with pytest.raises(Exception) as refused:
        asyncio.run(stranger())
    assert "authorization" in str(refused.value).lower()


def test_a_tenant_cannot_call_the_ledger_or_the_confirmation_service(stack, as_tenant):
    """The attack: confirmation.create then ledger.accept, called directly, created a run with no gate."""
    account, key, _ = stack.account()
    ns = stack.env["ITO_NAMESPACE"]
    create = msgspec.json.encode(
        ConfirmationCreate(
            account=account, action=Action.train, target="bk-none", manifest_digest="d" * 64, max_cost_usd=0.0
        )
    )
    accept = msgspec.json.encode(
        LedgerAccept(
            account=account,
            idempotency_key="evil",
            fingerprint="f",
            run_id="run_evil",
            action=Action.train,
            confirmation_ref="cf_x",
            target="bk-none",
            manifest_digest="d" * 64,
            cost_usd=0.0,
            work=b"{}",
        )
    )

    async def attack():
        w = await as_tenant(stack, account, key)
        for subject, body in (
            (f"{ns}.{subjects.CONFIRMATION_CREATE}", create),
            (f"{ns}.{subjects.LEDGER_ACCEPT}", accept),
        ):
            with pytest.raises(Exception):  # dropped by the server: no answer ever comes
                await w.nc.request(subject, body, timeout=1)
        await settle(w)
        await w.close()
        return w

    w = asyncio.run(attack())
    assert w.denied(f"{ns}.{subjects.CONFIRMATION_CREATE}") and w.denied(f"{ns}.{subjects.LEDGER_ACCEPT}")
    r = stack.redis()
    left = [k for k in r.scan_iter(match=f"{ns}:{{{account}}}:*") if not k.endswith(b":bucket")]
    assert not left  # no confirmation, no reservation, no run (the rate bucket counts the account's own
    # earlier requests: it is no record of these)
    assert r.get(f"{ns}:run-owner:run_evil") is None


def test_internal_services_refuse_what_the_scheduler_did_not_sign(stack, as_identity):
    """Defence in depth: even an identity the server lets publish anywhere (the operator's) gets
    `forbidden` from the ledger and the confirmation service without the scheduler's signature."""
    ns = stack.env["ITO_NAMESPACE"]
    account = "acct-" + uuid.uuid4().hex[:6]
    accept = msgspec.json.encode(
        LedgerAccept(
            account=account,
            idempotency_key="evil",
            fingerprint="f",
            run_id="run_evil2",
            action=Action.train,
            confirmation_ref="cf_x",
            target="bk",
            manifest_digest="d" * 64,
            cost_usd=0.0,
            work=b"{}",
        )
    )
    create = msgspec.json.encode(
        ConfirmationCreate(
            account=account, action=Action.train, target="bk", manifest_digest="d" * 64, max_cost_usd=0.0
        )
    )

    async def attack():
        w = await as_identity(stack, "operator")
        answers = []
        for subject, body in (
            (subjects.LEDGER_ACCEPT, accept),
            (subjects.CONFIRMATION_CREATE, create),
            (subjects.TRAINER_CLEANUP, b'{"account": "a", "run_id": "r", "checkpoint_dir": "/"}'),
        ):
            reply = await w.nc.request(f"{ns}.{subject}", body, timeout=5)
            answers.append(json.loads(reply.data))
        await w.close()
        return answers

    for answer in asyncio.run(attack()):
        assert answer["ok"] is False and answer["error"]["code"] == "forbidden", answer
    assert not list(stack.redis().scan_iter(match=f"{ns}:{{{account}}}:*"))


def test_no_one_reads_another_tenants_traffic_and_no_key_travels(stack, as_tenant, as_identity):
    """The attack: a subscription to `<ns>.>` captured another tenant's API key and replies."""
    ns = stack.env["ITO_NAMESPACE"]
    victim, victim_key, victim_env = stack.account()
    spy, spy_key, _ = stack.account()

    async def attack():
        w = await as_tenant(stack, spy, spy_key)
        subs = [await w.nc.subscribe(s) for s in (f"{ns}.>", ">", f"_INBOX_t_{victim}.>", "_INBOX.>")]
        tap = await as_identity(stack, "operator")  # the wire as seen by the server's own eyes
        wire = await tap.nc.subscribe(f"{ns}.v1.api.>")
        await settle(w)
        proc = await asyncio.create_subprocess_exec(
            str(stack.env["PATH"].split(":")[0] + "/ecc"),
            "ito",
            "find",
            "--json",
            env={**stack.env, **victim_env},
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await proc.communicate()
        await asyncio.sleep(0.5)
        seen = [m async for m in _drain(subs)]
        sniffed = [m async for m in _drain([wire])]
        await w.close()
        await tap.close()
        return w, json.loads(out), seen, sniffed

    w, out, seen, sniffed = asyncio.run(attack())
    assert out["ok"], out
    assert (
        w.denied(f'"{ns}.>"')
        and w.denied('">"')
        and w.denied(f"_inbox_t_{victim}")
        and w.denied('"_inbox.>"')
    )
    assert seen == []
    assert sniffed and all(m.subject.endswith(f".{victim}") for m in sniffed)
    leaked = any(victim_key.encode() in m.data or b"api_key" in m.data for m in sniffed)
    assert not leaked  # the request carries no key: nothing to replay


async def _drain(subs):
    for s in subs:
        while True:
            try:
                yield await s.next_msg(timeout=0.2)
            except Exception:  # nothing more (or a subscription the server refused)
                break


def test_a_reply_cannot_be_aimed_at_another_tenants_inbox(stack, as_tenant):
    ns = stack.env["ITO_NAMESPACE"]
    victim, victim_key, _ = stack.account()
    attacker, attacker_key, _ = stack.account()

    async def attack():
        v = await as_tenant(stack, victim, victim_key)
        inbox = await v.nc.subscribe(f"_INBOX_t_{victim}.trap")
        a = await as_tenant(stack, attacker, attacker_key)
        await a.nc.publish(f"{ns}.{subjects.API_FIND}.{attacker}", b"{}", reply=f"_INBOX_t_{victim}.trap")
        await a.nc.flush()
        try:
            got = await inbox.next_msg(timeout=2)
        except Exception:
            got = None
        await v.close()
        await a.close()
        return got

    assert asyncio.run(attack()) is None


def test_forged_booking_events_are_refused(stack, as_tenant):
    """The attack: a forged `completed` gave a 64-node booking; a forged `revoked` took a victim's."""
    ns = stack.env["ITO_NAMESPACE"]
    attacker, key, env = stack.account()
    victim, _, victim_env = stack.account()
    victim_booking = stack.booking(victim)
    forged = [
        booking_sim.event(
            account=attacker,
            booking="bk-forged",
            kind="completed",
            nodes=64,
            gpus_per_node=8,
            gpu_model="H200",
            region="eu-central-1",
            fabric="infiniband",
            hours=24,
        ),
        booking_sim.event(
            account=victim,
            booking=victim_booking,
            kind="revoked",
            nodes=1,
            gpus_per_node=8,
            gpu_model="H200",
            region="eu-central-1",
            fabric="infiniband",
            hours=24,
            version=2**62,
        ),
    ]

    async def attack():
        w = await as_tenant(stack, attacker, key)
        for ev in forged:
            subject = f"{ns}.{subjects.BOOKING_EVENTS}.{ev.kind.value}"
            await w.nc.publish(subject, msgspec.json.encode(ev))
            with pytest.raises(Exception):
                await w.nc.jetstream(timeout=1).publish(subject, msgspec.json.encode(ev))
        await settle(w)
        await w.close()
        return w

    w = asyncio.run(attack())
    assert w.denied(f"{ns}.{subjects.BOOKING_EVENTS}.completed") and w.denied(
        f"{ns}.{subjects.BOOKING_EVENTS}.revoked"
    )
    rc, out = stack.ecc("find", env=env)
    assert rc == 0 and out["data"] == []
    rc, out = stack.ecc("find", env=victim_env)
    assert [b["booking"]["state"] for b in out["data"]] == ["completed"]


def test_the_audit_trail_is_append_only_and_the_scheduler_alone_appends(
    stack, manifest, as_tenant, as_identity
):
    """The attack: the JetStream API let anyone append to and purge the AUDIT stream."""
    ns = stack.env["ITO_NAMESPACE"]
    stream = f"{ns.upper()}_AUDIT"
    account, key, env = stack.account()
    _rc, out = stack.ecc(
        "train",
        "--booking",
        "bk-none",
        "--manifest",
        str(manifest()),
        "--confirmation-ref",
        "cf_x",
        "--idempotency-key",
        "k",
        env=env,
    )  # refused, and so a trail is written
    assert out["error"]["code"] == "booking_not_found", out

    async def count():
        ops = await as_identity(stack, "operator")
        n = (await ops.nc.jetstream(timeout=2).stream_info(stream)).state.messages
        await ops.close()
        return n

    async def attack():
        results = {}
        t = await as_tenant(stack, account, key)
        for what, call in (
            ("purge", lambda js: js.purge_stream(stream)),
            ("delete", lambda js: js.delete_stream(stream)),
            ("append", lambda js: js.publish(f"{ns}.{subjects.AUDIT}.run_x", b"{}")),
        ):
            try:
                await call(t.nc.jetstream(timeout=1))
                results[("tenant", what)] = "done"
            except Exception as exc:
                results[("tenant", what)] = type(exc).__name__
        await t.close()
        for identity in ("scheduler", "operator"):
            w = await as_identity(stack, identity)
            for what, call in (
                ("purge", lambda js: js.purge_stream(stream)),
                ("delete_msg", lambda js: js.delete_msg(stream, 1)),
            ):
                try:
                    await call(w.nc.jetstream(timeout=1))
                    results[(identity, what)] = "done"
                except Exception as exc:
                    results[(identity, what)] = type(exc).__name__
            await w.close()
        return results

    before = asyncio.run(count())
    assert before > 0
    results = asyncio.run(attack())
    assert "done" not in results.values(), results
    assert asyncio.run(count()) == before


def test_each_redis_identity_is_confined_to_its_keys_and_commands(stack):
    ns = stack.env["ITO_NAMESPACE"]
    attempts = [
        ("ledger", lambda r: r.hset(f"{ns}:apikeys:acme", "UEVIL", b"{}")),  # impersonate a tenant
        (
            "entitlement",
            lambda r: r.hset(f"{ns}:{{acme}}:conf:cf_evil", "account", "acme"),
        ),  # forge a confirmation
        ("telemetry", lambda r: r.hset(f"{ns}:{{acme}}:run:r1", "view", b"{}")),  # forge a run state
        ("confirmation", lambda r: r.hgetall(f"{ns}:apikeys:acme")),
        ("confirmation", lambda r: r.get(f"{ns}:{{acme}}:idem:k")),
        ("scheduler", lambda r: r.hset(f"{ns}:{{acme}}:conf:cf_evil", "consumed", "0")),
        ("scheduler", lambda r: r.keys("*")),
        ("scheduler", lambda r: r.flushall()),
        ("ledger", lambda r: r.config_get("*")),
        ("accounts", lambda r: r.execute_command("ACL", "LIST")),
        ("entitlement", lambda r: r.get(f"{ns}:{{acme}}:run:r1")),
    ]
    for identity, attempt in attempts:
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt(stack.redis(identity))
    assert stack.redis().hget(f"{ns}:apikeys:acme", "UEVIL") is None
    assert not stack.redis().exists(f"{ns}:{{acme}}:conf:cf_evil")


def test_secret_files_are_private(stack):
    secrets = stack.data_dir / "secrets"
    for path in [secrets, *secrets.rglob("*")]:
        if path.name in (".lock",) or path.name.endswith(".pub"):
            continue
        mode = path.stat().st_mode & 0o777
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))


def test_a_revoked_credential_is_dropped_at_once_and_refused_after(stack, as_tenant):
    account, key, env = stack.account()

    async def scenario():
        w = await as_tenant(stack, account, key, allow_reconnect=False)
        stack.ito("accounts", "revoke", account)  # rewrites the server config and reloads it

        async def closed():
            return w.nc.is_closed

        dropped = await eventually_async(
            closed, timeout=5, interval=0.05, what="the revoked connection dropped"
        )
        try:
            await stack.tenant(account, key, allow_reconnect=False, max_reconnect_attempts=0)
            refused = False
        except Exception as exc:
            refused = "authorization" in str(exc).lower()
        return dropped, refused

    dropped, refused = asyncio.run(scenario())
    assert dropped and refused
    rc, out = stack.ecc("auth", env=env)
    assert rc == 1 and out["error"]["code"] == "credential_revoked"


def test_clients_refuse_a_server_without_authentication(tmp_path):
    """`ecc` (and every service) refuses to talk to a NATS server that anyone may use: its
    requests would be readable by all. A throwaway open server on loopback, stopped after."""
    import os
    import subprocess
    import sys

    from devstack import infra

    port = infra.free_port()
    config = tmp_path / "open.conf"
    config.write_text(f'listen: "127.0.0.1:{port}"\n')
    server = infra.start_nats(config, port, tmp_path / "open.log")
    try:
        env = {
            **os.environ,
            "ITO_NATS_URL": f"nats://127.0.0.1:{port}",
            "ECC_CONFIG_DIR": str(tmp_path / "ecc"),
        }
        from runtime.security.secrets import new_nkey_seed

        login = subprocess.run(
            [str(pathlib.Path(sys.executable).parent / "ecc"), "ito", "login", "--account", "a", "--json"],
            input="ito_sk_" + new_nkey_seed().decode() + "\n",
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        out = json.loads(login.stdout.strip().splitlines()[-1])
        assert login.returncode == 1 and out["error"]["code"] == "backend_unavailable", out
        assert "does not require authentication" in out["error"]["message"]
        assert not (tmp_path / "ecc" / "credentials.json").exists()
    finally:
        infra.stop_pid(server.pid)


def test_the_desk_reads_every_run_and_no_one_else_may_ask(stack, as_tenant, as_identity):
    """The scheduler's desk reads list every account's runs: a tenant may not ask them (the server
    drops the request), another service may not either, and an answer aimed at an inbox that is not
    the desk's own is never sent (the server does not check reply subjects)."""
    ns = stack.env["ITO_NAMESPACE"]
    account, key, _ = stack.account()
    body = msgspec.json.encode(DeskRunsRequest(limit=5))

    async def attack():
        t = await as_tenant(stack, account, key)
        try:
            await t.nc.request(f"{ns}.{subjects.DESK_RUNS}", body, timeout=1)
            tenant_answered = True
        except Exception:
            tenant_answered = False
        await settle(t)
        entitlement = await as_identity(stack, "entitlement")
        try:
            await entitlement.nc.request(f"{ns}.{subjects.DESK_RUNS}", body, timeout=1)
            service_answered = True
        except Exception:
            service_answered = False
        await settle(entitlement)
        desk = await as_identity(stack, "desk")
        # A subject the desk may hear but that is not its inbox: the scheduler's answer (a list of
        # every account's runs) would land there for any listener.
        elsewhere = f"{ns}.desk.live.elsewhere"
        trap = await desk.nc.subscribe(elsewhere)
        await desk.nc.publish(f"{ns}.{subjects.DESK_RUNS}", body, reply=elsewhere)
        await desk.nc.flush()
        try:
            aimed = await trap.next_msg(timeout=1.5)
        except Exception:
            aimed = None
        answer = await desk.nc.request(f"{ns}.{subjects.DESK_RUNS}", body, timeout=5)
        await settle(desk)
        for w in (t, entitlement, desk):
            await w.close()
        return tenant_answered, t, service_answered, entitlement, aimed, answer

    tenant_answered, t, service_answered, entitlement, aimed, answer = asyncio.run(attack())
    assert not tenant_answered and t.denied(f"{ns}.{subjects.DESK_RUNS}")
    assert not service_answered and entitlement.denied(f"{ns}.{subjects.DESK_RUNS}")
    assert aimed is None
    assert json.loads(answer.data)["ok"] is True  # the desk itself is answered, in its own inbox
