"""Control-plane benchmarks: the latency of one gated train request against the bare round trips
it is built from, accepted requests per second with many clients, exactly-once run creation
under duplicate requests, and what authentication costs.

Everything runs with authentication on, on the stack's own servers (bench/stack.py): the client is
a tenant (its NKey, its own inbox, the account's own subjects), as `ecc` is. A gated train request
is timed from the client's NATS request to the scheduler's answer (run accepted and handed off to
the work queue). Confirmations are made beforehand and are not timed. The bare round trips are
measured in the same run on the same authenticated servers: a core NATS request to an echo
responder in this process (both ends as the operator identity), a JetStream publish awaiting its
PubAck, and a Redis EVALSHA of a one-line script through redis-py asyncio (the client library the
services use) as the admin ACL user. The ratio divides the gated p50 by the sum of the bare round
trips the request needs (counted below; the NATS count is checked against the messages a wildcard
subscriber sees). One hop through our own service plumbing around a do-nothing handler (signed by
the scheduler's key and verified, as every internal request is) is measured too, to read the gap
between the two.

The cost of authentication compares the same bare operations against a nats-server and a
redis-server without authentication, started here on loopback only for that comparison and
stopped right after (never the machine's shared servers).
"""

import asyncio
import json
import pathlib
import random
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench import stats
from bench.quotas import fairness as quota_fairness
from bench.stack import AUTH, ApiClient, Stack, confirmations, cpu_delta, cpu_seconds, drive, own_cpu_seconds

CONNECT_TIMEOUT_S = 2  # every NATS connection the comparison opens to the server without auth
RTT_TIMEOUT_S = 5  # one bare round trip; a timeout is an error, not a sample
# Before timing, the path must answer once: a just-created tenant's import of the API subjects is
# live only once nats-server has applied the reloaded config, which it does asynchronously.
READY_TIMEOUT_S = 10.0
CONNECT_WARMUP = 2  # connections opened before the timed ones (imports, first handshake)
MAX_CONNECT_SAMPLES = 200  # connections timed per variant: enough for a p50, cheap in full mode
AUTH_COST_ROUNDS = 4  # turns each side of an auth comparison takes (see _alternating)

# The fixed reference the gated latency is divided by (issue 15): 6 NATS request/replies, 1
# JetStream publish and 4 Redis round trips, each timed bare in the same run. Fixed, not the
# design's own count, so that fewer round trips show as a better ratio and never as a worse one.
REFERENCE = {"nats_request_reply": 6, "jetstream_publish": 1, "redis": 4}

# The round trips one gated train request makes today (a fresh idempotency key, a known booking),
# read from services/scheduler/api.py and the handlers it calls; `observed_hops` cross-checks the
# NATS ones with a wildcard subscriber and the Redis ones with MONITOR. Informative: the ratio
# uses REFERENCE.
NATS_ROUND_TRIPS = {
    "client -> scheduler (api.train)": 1,
    "entitlement eligibility": 1,
    "ledger accept (looks the key up, checks and consumes the confirmation, reserves the key)": 1,
    "ledger handed_off": 1,
}
JETSTREAM_ROUND_TRIPS = {
    "run created event (side by side with the view's creation)": 1,
    "work item publish (Nats-Msg-Id = run id)": 1,
    "audit record (all the request's gate decisions in one message)": 1,
}
REDIS_ROUND_TRIPS = {
    "scheduler rate and run quota: EVALSHA bucket script (the limits, SCARD open-runs inside)": 1,
    "scheduler authenticate: HGETALL apikeys:<account> (beside the bucket script)": 1,
    "entitlement eligibility: HGET booking": 1,
    "ledger accept: EVALSHA accept script (it records the confirmation's cost bound too)": 1,
    "hand-off RunStore.create (queued): pipeline(HSETNX view, HSETNX last_seq, HSETNX work, SET owner, ZADD)": 1,
    "ledger handed_off: pipeline(SREM pending, GET idem)": 1,
}
# Subjects of the needed hops above, as the wildcard tap sees them (the work item carries the run id).
NEEDED_SUBJECTS = {
    "v1.api.train",
    "v1.entitlement.eligibility",
    "v1.ledger.accept",
    "v1.ledger.handed_off",
    "v1.work.train.*",
    "v1.run.*.created",
    "v1.audit.*",
}
REDIS_PIPELINE_GAP_S = 20e-6  # see _round_trips
ECHO_PAYLOAD = b"x" * 256  # about the size of an internal request
CLIENTS = 64  # concurrent clients in the throughput and exactly-once runs (issue 8)


Connect = Callable[[], Awaitable[Any]]
"""Opens one connection: as one of the stack's identities, or to a server without authentication."""


async def _timed(op: Callable[[], Awaitable[Any]], samples: int) -> list[float]:
    """Seconds of each of `samples` sequential calls of `op`, after a warm-up of a tenth of them."""
    for _ in range(max(10, samples // 10)):
        await op()
    timings = []
    for _ in range(samples):
        started = time.perf_counter()
        await op()
        timings.append(time.perf_counter() - started)
    return timings


async def _answered(op: Callable[[], Awaitable[object]]) -> None:
    """`op` once it succeeds (untimed), retrying "no responders" for up to READY_TIMEOUT_S."""
    import nats.errors

    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            await op()
            return
        except nats.errors.NoRespondersError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def bare_nats_round_trips(
    responder_connect: Connect, requester_connect: Connect, subject: str, samples: int
) -> list[float]:
    """Core NATS request/reply to a trivial echo responder, each end on its own connection in this
    process (both authenticated on the stack's server, unless the comparison says otherwise)."""
    responder = await responder_connect()
    try:
        requester = await requester_connect()
        try:

            async def echo(msg) -> None:
                await msg.respond(msg.data)

            await responder.subscribe(subject, cb=echo)
            await responder.flush(timeout=RTT_TIMEOUT_S)
            await _answered(lambda: requester.request(subject, ECHO_PAYLOAD, timeout=RTT_TIMEOUT_S))
            return await _timed(
                lambda: requester.request(subject, ECHO_PAYLOAD, timeout=RTT_TIMEOUT_S), samples
            )
        finally:
            await requester.close()
    finally:
        await responder.close()


async def service_hop_round_trips(stack: Stack, samples: int) -> list[float]:
    """One request/reply hop through our services' own plumbing around a do-nothing handler: a
    `bus.Router` endpoint served by `bus.serve` on nats-py (the scheduler's signature verified,
    msgspec decode, Envelope encode), the request signed with the scheduler's key as `Peers`
    signs every internal request. Run in this process, like the bare echo; as the operator
    identity, the only one that may serve a subject outside the services' own."""
    import msgspec

    from contracts.endpoints import Endpoint
    from runtime.messaging.bus import Router, serve
    from runtime.messaging.service import scheduler_verifier
    from runtime.security.order_signatures import Signer
    from runtime.security.secrets import Secrets

    class Echo(msgspec.Struct):
        data: str

    async def echo(request: Echo) -> Echo:
        return request

    s = stack.settings()
    router = Router(stack.namespace)
    router.serve(Endpoint("bench.hop", Echo, Echo), echo, scheduler_verifier(s))
    subject = f"{stack.namespace}.bench.hop"
    signer = Signer(Secrets(s.secrets_dir).signing_key())
    payload = msgspec.json.encode(Echo(data="x" * 240))
    server = await stack.nats(allow_reconnect=False)
    try:
        await serve(server, router, queue="bench")
        requester = await stack.nats(allow_reconnect=False)
        try:

            async def hop():
                return await requester.request(
                    subject, payload, timeout=RTT_TIMEOUT_S, headers=signer.headers(subject, payload)
                )

            answer = msgspec.json.decode((await hop()).data)
            if not answer.get("ok"):  # a refused signature would time a refusal, not a hop
                raise RuntimeError(f"the echo hop refused the request: {answer.get('error')}")
            return await _timed(hop, samples)
        finally:
            await requester.close()
    finally:
        await server.close()


async def bare_jetstream_publish(stack: Stack, samples: int) -> list[float]:
    """A JetStream publish awaiting its PubAck, into a file-storage stream made for it (as the
    work queue and the audit stream are), deleted afterwards; as the operator identity (no
    service may create a stream)."""
    from nats.js.api import StorageType, StreamConfig

    stream, subject = f"{stack.settings().stream_prefix}_BENCH_ECHO", f"{stack.namespace}.bench.js"
    nc = await stack.nats(allow_reconnect=False)
    js = nc.jetstream(timeout=RTT_TIMEOUT_S)
    try:
        await js.add_stream(StreamConfig(name=stream, subjects=[subject + ".>"], storage=StorageType.FILE))
        for i in range(max(10, samples // 10)):  # warm-up
            await js.publish(f"{subject}.w", ECHO_PAYLOAD, headers={"Nats-Msg-Id": f"w{i}"})
        timings = []
        for i in range(samples):
            started = time.perf_counter()
            await js.publish(f"{subject}.m", ECHO_PAYLOAD, headers={"Nats-Msg-Id": f"m{i}"})
            timings.append(time.perf_counter() - started)
        return timings
    finally:
        try:
            await js.delete_stream(stream)
        finally:
            await nc.close()


async def bare_redis_evalsha(make_redis: Callable[[], Any], samples: int) -> list[float]:
    """EVALSHA of a trivial script through redis-py asyncio, one at a time."""
    r = make_redis()
    try:
        script = r.register_script("return 1")
        return await _timed(script, samples)  # the warm-up's first call loads the script
    finally:
        await r.aclose()


async def _nats_connect_times(connect: Connect, n: int) -> list[float]:
    """Seconds to open a NATS connection (TCP, INFO, CONNECT with the nkey's signature of the
    server's nonce when there is one, PING/PONG); closing is not timed."""
    timings = []
    for i in range(n + CONNECT_WARMUP):
        started = time.perf_counter()
        nc = await connect()
        elapsed = time.perf_counter() - started
        await nc.close()
        if i >= CONNECT_WARMUP:
            timings.append(elapsed)
    return timings


async def _redis_connect_times(make_redis: Callable[[], Any], n: int) -> list[float]:
    """Seconds from a new client to its first PING answered (TCP, AUTH when a user is set, PING)."""
    timings = []
    for i in range(n + CONNECT_WARMUP):
        r = make_redis()  # outside the timing: reading the password file is not a network cost
        try:
            started = time.perf_counter()
            await r.ping()
            elapsed = time.perf_counter() - started
        finally:
            await r.aclose()
        if i >= CONNECT_WARMUP:
            timings.append(elapsed)
    return timings


def _start_servers_without_auth(root: pathlib.Path) -> list:
    """A nats-server and a redis-server without authentication, for the comparison only: loopback,
    fresh ports, Redis with the same durability as the stack's (AOF, fsync always)."""
    from devstack import infra

    def plain_nats(port: int):
        config = root / "nats.conf"
        config.write_text(json.dumps({"listen": f"127.0.0.1:{port}"}) + "\n")  # no authorization block
        return infra.start_nats(config, port, root / "nats.log")

    acl = root / "redis.acl"
    acl.write_text("user default on nopass allkeys allchannels +@all\n")
    started = []
    try:
        started.append(infra.on_free_port(plain_nats, None))
        started.append(
            infra.on_free_port(
                lambda port: infra.start_redis(root / "redis", acl, port, root / "redis.log"), None
            )
        )
    except Exception:
        for s in started:
            infra.stop_pid(s.pid)
        raise
    return started


async def _alternating(
    variants: dict[str, Callable[[int], Awaitable[list[float]]]], samples: int
) -> dict[str, list[float]]:
    """Each variant measured in AUTH_COST_ROUNDS turns, taking turns with the others, so that a
    drift of the machine (another process, frequency) falls on every side alike."""
    out: dict[str, list[float]] = {name: [] for name in variants}
    per_round = max(10, samples // AUTH_COST_ROUNDS)
    for _ in range(AUTH_COST_ROUNDS):
        for name, measure in variants.items():
            out[name] += await measure(per_round)
    return out


async def auth_cost(stack: Stack, samples: int) -> dict:
    """What authentication adds: connecting and one round trip on the stack's servers (nkeys and
    allow-lists; ACL users) against the same on servers without authentication, started here for
    this comparison and stopped before it returns."""
    import nats
    import redis.asyncio as aioredis

    from devstack import infra
    from runtime.messaging import connections

    connects = max(10, min(samples, MAX_CONNECT_SAMPLES))
    root = pathlib.Path(tempfile.mkdtemp(prefix="ito-bench-noauth-"))
    servers = []
    try:
        servers = await asyncio.to_thread(_start_servers_without_auth, root)
        plain_nats_url, plain_redis_url = servers[0].url, servers[1].url

        def plain_nats():
            return nats.connect(plain_nats_url, connect_timeout=CONNECT_TIMEOUT_S, allow_reconnect=False)

        def plain_redis():
            return aioredis.Redis.from_url(
                plain_redis_url,
                socket_connect_timeout=connections.REDIS_CONNECT_TIMEOUT_S,
                socket_timeout=connections.REDIS_SOCKET_TIMEOUT_S,
            )

        def operator():
            return stack.nats(allow_reconnect=False)

        def tenant():
            return stack.tenant(allow_reconnect=False)

        echo = f"{stack.namespace}.bench.echo"
        # A tenant may publish only under its own API prefix: a verb no service serves, answered
        # into the tenant's own inbox, is the path every `ecc` request takes.
        tenant_echo = stack.api_subject("v1.api.benchecho")
        nats_connect = await _alternating(
            {
                "nkey": lambda n: _nats_connect_times(operator, n),
                "none": lambda n: _nats_connect_times(plain_nats, n),
            },
            connects,
        )
        nats_rtt = await _alternating(
            {
                "operator": lambda n: bare_nats_round_trips(operator, operator, echo, n),
                "tenant": lambda n: bare_nats_round_trips(operator, tenant, tenant_echo, n),
                "none": lambda n: bare_nats_round_trips(plain_nats, plain_nats, echo, n),
            },
            samples,
        )
        redis_connect = await _alternating(
            {
                "acl": lambda n: _redis_connect_times(stack.redis, n),
                "none": lambda n: _redis_connect_times(plain_redis, n),
            },
            connects,
        )
        redis_evalsha = await _alternating(
            {
                "acl": lambda n: bare_redis_evalsha(stack.redis, n),
                "none": lambda n: bare_redis_evalsha(plain_redis, n),
            },
            samples,
        )
    finally:
        for s in servers:
            await asyncio.to_thread(infra.stop_pid, s.pid)
        shutil.rmtree(root, ignore_errors=True)

    def extra(with_auth: list[float], without: list[float]) -> float:
        return stats.ms(stats.percentile(with_auth, 50) - stats.percentile(without, 50))

    def summaries(timings: dict[str, list[float]]) -> dict[str, dict]:
        return {name: stats.latency_summary(t) for name, t in timings.items()}

    return {
        "nats_connect": summaries(nats_connect),
        "nats_request_reply": summaries(nats_rtt),
        "redis_connect": summaries(redis_connect),
        "redis_evalsha": summaries(redis_evalsha),
        # p50 with authentication minus p50 without (noise can make a difference slightly negative).
        "nats_connect_extra_ms": extra(nats_connect["nkey"], nats_connect["none"]),
        "nats_request_reply_extra_ms": extra(nats_rtt["operator"], nats_rtt["none"]),
        "nats_tenant_request_reply_extra_ms": extra(nats_rtt["tenant"], nats_rtt["none"]),
        "redis_connect_extra_ms": extra(redis_connect["acl"], redis_connect["none"]),
        "redis_evalsha_extra_ms": extra(redis_evalsha["acl"], redis_evalsha["none"]),
    }


def _subject_kind(namespace: str, account: str, subject: str) -> str:
    """`<ns>.v1.ledger.lookup` -> `v1.ledger.lookup`; `<ns>.v1.api.train.<account>` ->
    `v1.api.train`; run ids in subjects become `*`."""
    parts = subject.removeprefix(namespace + ".").split(".")
    if parts[:2] == ["v1", "api"] and parts[-1] == account:
        parts = parts[:-1]
    return ".".join("*" if p.startswith("run_") else p for p in parts)


def _round_trips(commands: list[tuple[float, tuple[str, int]]]) -> int:
    """Redis round trips in a MONITOR log of one client's commands: a pipeline or MULTI/EXEC
    arrives in one write, so its commands are logged microseconds apart; a new round trip
    starts after a gap longer than any in-pipeline gap (loopback round trips take ~50+ us)."""
    trips, last = 0, {}
    for at, client in sorted(commands):
        if client not in last or at - last[client] > REDIS_PIPELINE_GAP_S:
            trips += 1
        last[client] = at
    return trips


async def observed_hops(stack: Stack, requests: int) -> dict:
    """What `requests` sequential gated requests send, per request: NATS messages on the
    namespace's subjects by kind (a wildcard subscriber as the operator identity; answers go to
    inboxes and are not seen), and Redis commands and round trips of the connections that touch
    the namespace's keys (Redis MONITOR, as the admin user). Not timed: MONITOR slows Redis down.

    The Redis figures include work a request sets off beside its own path: the scheduler's run
    event consumer applying the `created` event, and periodic sweeps that fall in the window."""
    refs = await confirmations(stack, requests, concurrency=1)
    counts: dict[str, int] = {}
    logged: list[tuple[float, tuple[str, int], str]] = []
    tap = await stack.nats(allow_reconnect=False)
    r = stack.redis()
    monitor = r.monitor()
    try:

        async def count(msg) -> None:
            kind = _subject_kind(stack.namespace, stack.account, msg.subject)
            counts[kind] = counts.get(kind, 0) + 1

        async def listen() -> None:
            async for entry in monitor.listen():
                if entry["client_type"] != "lua":  # a script's own commands run inside its EVALSHA
                    logged.append(
                        (entry["time"], (entry["client_address"], entry["client_port"]), entry["command"])
                    )

        await tap.subscribe(f"{stack.namespace}.>", cb=count)
        await tap.flush(timeout=RTT_TIMEOUT_S)
        await monitor.connect()
        await monitor.connection.send_command("MONITOR")
        assert await monitor.connection.read_response() in (b"OK", "OK")
        listener = asyncio.create_task(listen())
        async with ApiClient(stack) as client:
            for i, ref in enumerate(refs):
                out = await client.train(ref, f"tap-{i}")
                assert out["ok"], out
        await asyncio.sleep(0.3)  # the last audit publishes and MONITOR lines are still on their way
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
    finally:
        await tap.close()
        await monitor.connection.disconnect()
        await r.aclose()
    ours = {client for _, client, command in logged if f"{stack.namespace}:" in command}
    commands = [(at, client) for at, client, _ in logged if client in ours]
    return {
        "nats_messages": {kind: round(n / requests, 2) for kind, n in sorted(counts.items())},
        "redis_commands": round(len(commands) / requests, 2),
        "redis_round_trips": round(_round_trips(commands) / requests, 2),
    }


async def gated_latency(stack: Stack, samples: int) -> tuple[list[float], dict[str, int]]:
    """Sequential gated train requests, each with a new key and its own confirmation."""
    warmup = max(5, samples // 10)
    refs = await confirmations(stack, samples + warmup)
    timings, errors = [], {}
    async with ApiClient(stack) as client:
        for i, ref in enumerate(refs):
            started = time.perf_counter()
            out = await client.train(ref, f"lat-{i}")
            elapsed = time.perf_counter() - started
            if not out["ok"]:
                errors[out["error"]["code"]] = errors.get(out["error"]["code"], 0) + 1
            elif i >= warmup:
                timings.append(elapsed)
    return timings, errors


async def latency(stack: Stack, samples: int) -> dict:
    def operator():
        return stack.nats(allow_reconnect=False)

    nats_rtt = await bare_nats_round_trips(operator, operator, f"{stack.namespace}.bench.echo", samples)
    js_rtt = await bare_jetstream_publish(stack, samples)
    redis_rtt = await bare_redis_evalsha(stack.redis, samples)
    hop_rtt = await service_hop_round_trips(stack, samples)
    gated, errors = await gated_latency(stack, samples)
    observed = await observed_hops(stack, requests=5)
    auth = await auth_cost(stack, samples)
    messages = observed["nats_messages"]
    # Publishes beyond the hops listed above (none expected): round trips nobody accounted for.
    extra = {kind: n for kind, n in messages.items() if kind not in NEEDED_SUBJECTS}
    n_nats, n_js = sum(NATS_ROUND_TRIPS.values()), sum(JETSTREAM_ROUND_TRIPS.values())
    n_redis = sum(REDIS_ROUND_TRIPS.values())
    nats_p50, js_p50 = stats.percentile(nats_rtt, 50), stats.percentile(js_rtt, 50)
    redis_p50 = stats.percentile(redis_rtt, 50)
    reference = (
        REFERENCE["nats_request_reply"] * nats_p50
        + REFERENCE["jetstream_publish"] * js_p50
        + REFERENCE["redis"] * redis_p50
    )
    made = n_nats * nats_p50 + n_js * js_p50 + n_redis * redis_p50
    gated_p50 = stats.percentile(gated, 50)
    return {
        "auth": AUTH,
        "gated": stats.latency_summary(gated),
        "gated_errors": errors,
        "bare_nats_request_reply": stats.latency_summary(nats_rtt),
        "bare_jetstream_publish": stats.latency_summary(js_rtt),
        "bare_redis_evalsha": stats.latency_summary(redis_rtt),
        # Not a bare figure: the framework cost of one hop, for reading the gap above the bare sum.
        "service_hop_echo": stats.latency_summary(hop_rtt),
        "round_trips_needed": {
            "nats_request_reply": n_nats,
            "jetstream_publish": n_js,
            "redis": n_redis,
            "nats_detail": NATS_ROUND_TRIPS,
            "jetstream_detail": JETSTREAM_ROUND_TRIPS,
            "redis_detail": REDIS_ROUND_TRIPS,
        },
        "observed_per_request": observed,
        "needed_hops_seen_once_each": all(messages.get(kind) == 1.0 for kind in NEEDED_SUBJECTS),
        "extra_publishes_per_request": sum(extra.values()),
        "extra_publishes_detail": extra,
        "audit_publishes_per_request": messages.get("v1.audit.*", 0.0),
        # The ratio to the fixed reference (REFERENCE: 6 NATS + 1 JetStream + 4 Redis, bare).
        "reference": REFERENCE,
        "bare_sum_ms": stats.ms(reference),
        "ratio_p50_to_bare_sum": round(gated_p50 / reference, 2),
        # The same bare figures summed over the round trips the request really makes (above).
        "bare_sum_with_extra_publishes_ms": stats.ms(made),
        "ratio_p50_to_bare_sum_with_extra_publishes": round(gated_p50 / made, 2),
        "auth_cost": auth,
    }


def _error_codes(answers: list[dict]) -> dict[str, int]:
    codes: dict[str, int] = {}
    for out in answers:
        if not out["ok"]:
            codes[out["error"]["code"]] = codes.get(out["error"]["code"], 0) + 1
    return codes


async def throughput(stack: Stack, requests: int, clients: int = CLIENTS) -> dict:
    """Accepted gated train requests per second, every request a new key with its own confirmation.
    Also the CPU each service spent per request (from /proc), the budget on a 2-core machine, and
    apart from it the CPU of the stack's own nats-server and redis-server (where checking the
    credentials and permissions happens)."""
    refs = await confirmations(stack, requests)
    jobs = [(ref, f"tput-{i}") for i, ref in enumerate(refs)]
    pids, servers = stack.service_pids(), stack.infra_pids()
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    servers_before = {name: cpu_seconds(pid) for name, pid in servers.items()}
    own_before = own_cpu_seconds()
    answers, wall = await drive(stack, jobs, clients)
    cpu = {name: cpu_delta(cpu_seconds(pid), cpu_before[name]) for name, pid in pids.items()}
    cpu["bench client"] = cpu_delta(own_cpu_seconds(), own_before)
    server_cpu = {name: cpu_delta(cpu_seconds(pid), servers_before[name]) for name, pid in servers.items()}
    accepted = sum(1 for out in answers if out["ok"] and not out["data"]["replay"])

    def per_request(usage: dict[str, tuple[float, float]]) -> dict[str, dict[str, float]]:
        return {
            name: {"user": round(1000 * u / requests, 3), "system": round(1000 * s / requests, 3)}
            for name, (u, s) in usage.items()
        }

    return {
        "auth": AUTH,
        "clients": clients,
        "requests": requests,
        "accepted": accepted,
        "errors": _error_codes(answers),
        "wall_s": round(wall, 3),
        "accepted_per_s": round(accepted / wall, 1),
        "cpu_ms_per_request": per_request(cpu),
        "cpu_ms_per_request_total": round(sum(1000 * (u + s) / requests for u, s in cpu.values()), 3),
        # Cores our processes kept busy (services + this client; not the NATS or Redis server).
        "cpu_cores_busy": round(sum(u + s for u, s in cpu.values()) / wall, 2),
        # The stack's own servers, kept out of the totals above so those compare across runs.
        "server_cpu_ms_per_request": per_request(server_cpu),
        "server_cpu_cores_busy": round(sum(u + s for u, s in server_cpu.values()) / wall, 2),
    }


async def exactly_once(stack: Stack, requests: int, keys: int, clients: int = CLIENTS) -> dict:
    """`requests` train requests over `keys` idempotency keys (each key's requests share its one
    confirmation), shuffled and sent concurrently: every key must create exactly one run."""
    refs = await confirmations(stack, keys)
    jobs = [(refs[i % keys], f"once-{i % keys}") for i in range(requests)]
    random.Random(0).shuffle(jobs)
    queued_before = await stack.work_queued()
    answers, wall = await drive(stack, jobs, clients)
    queued = await stack.work_queued() - queued_before
    runs_by_key: dict[str, set[str]] = {}
    for out in answers:
        if out["ok"]:
            runs_by_key.setdefault(out["key"], set()).add(out["data"]["run_id"])
    run_ids = set().union(*runs_by_key.values()) if runs_by_key else set()
    created = sum(1 for out in answers if out["ok"] and not out["data"]["replay"])
    return {
        "clients": clients,
        "requests": requests,
        "keys": keys,
        "runs": len(run_ids),
        "created_answers": created,  # answers that said "new run" rather than "replay"
        # Extra runs seen from any side (distinct run ids, "new run" answers, work items) ...
        "duplicates": max(len(run_ids) - len(runs_by_key), created - len(runs_by_key), queued - keys, 0),
        # ... and keys left without a run (no answer named one, or no work item for it).
        "lost": max(keys - len(runs_by_key), keys - queued, 0),
        "work_queue_messages": queued,
        "errors": _error_codes(answers),
        "wall_s": round(wall, 3),
        "requests_per_s": round(requests / wall, 1),
        "exactly_once": len(run_ids) == keys == queued == created == len(runs_by_key),
    }


async def run_all(
    stack: Stack, *, latency_samples: int, throughput_requests: int, once_requests: int, once_keys: int
) -> dict[str, dict]:
    from bench import cpu_profile

    return {
        "control_plane_latency": await latency(stack, latency_samples),
        "control_plane_throughput": await throughput(stack, throughput_requests),
        # after the timed figures: py-spy's sampling slows the services it samples
        "control_plane_profile": await cpu_profile.profile(stack, min(throughput_requests, 1000), CLIENTS),
        "exactly_once": await exactly_once(stack, once_requests, once_keys),
        "quota_fairness": await quota_fairness(stack, max(30, latency_samples // 5)),
    }
