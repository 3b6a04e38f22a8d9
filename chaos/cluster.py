"""`make chaos`, the cluster section: exactly-once train requests on `ito-training up --cluster`
while a NATS node, a Redis primary and a scheduler instance die, one at a time and then together.

One cluster for the whole section, the control plane only (two instances each of entitlement,
confirmation, ledger and scheduler; no trainer, so every run handed off stays on the WORK stream,
where it can be counted). Each row is one burst on it: REQUESTS train requests over KEYS
idempotency keys (fresh ones per row) from CLIENTS tenant connections, which nats-py spreads over
the three nodes. A key's requests share its one confirmation (asked for by its first request). An
attempt answered with a transport error or a RETRYABLE code is sent again with the same key and
confirmation after a backoff, as a client must (bounded by MAX_ATTEMPTS). FAULT_AT into the burst
the row's faults are injected:

- `nats`: SIGKILL the node leading the WORK stream; it starts again on its ports NATS_DOWN_S later;
- `redis`: fail a primary over (`redis_cluster.fail_over`: SIGKILL, its replica elected in its
  place), then start the old one again, which rejoins as a replica;
- `scheduler-N`: SIGKILL that instance (its pid from `up`'s state); it stays dead. For the row
  with all three, a replacement instance (`scheduler-3`) is started first, so that one is left.

Measured per row: detection (the kill until a client could first tell: an attempt that failed, or
one still unanswered after SLOW_S), recovery (the kill until the first good answer to an attempt
sent after the last bad one), requests answered, attempts retried; runs: distinct run ids
answered; duplicates: keys answered with more than one run id, plus work items beyond the runs;
lost: keys answered whose run the scheduler cannot find by key afterwards (or finds another), keys
never answered, plus runs without a work item. Exactly once: runs == records == work items == keys.

tests/e2e/test_cluster_chaos.py runs a small burst of this (`fault_row`) in CI. A training run that
survives the loss of the NATS node its trainer is connected to: tests/e2e/test_cluster_e2e.py.
"""

import asyncio
import collections
import hashlib
import json
import os
import pathlib
import signal
import subprocess
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from chaos import stack as chaos_stack
from contracts import subjects
from contracts.errors import ErrorCode
from runtime.configuration.settings import ENV_INSTANCE, ENV_NATS_REPLICAS, ENV_REDIS_CLUSTER
from runtime.messaging.bus import INSTANCE_HEADER

REQUESTS, KEYS, CLIENTS = 10_000, 1_000, 64  # the burst; the CI subset runs 1,000 over 100
KEY_BLOCK = 50  # keys sent together: their requests interleave, so a key's requests overlap in time
REQUEST_TIMEOUT_S = 5.0  # one attempt; a killed node or instance answers nothing, the client moves on
SLOW_S = 2.0  # an attempt unanswered this long counts as a fault noticed (steady state here: < 1 s)
RETRY_BACKOFF_S = 0.2  # times the attempt number, up to RETRY_BACKOFF_MAX_S
RETRY_BACKOFF_MAX_S = 2.0
MAX_ATTEMPTS = 30  # per request: well past a Redis failover (~4 s) and a NATS node restart
FAULT_AT = 0.2  # the share of the burst's requests taken when the faults are injected
NATS_DOWN_S = 3.0  # a killed NATS node stays down this long, then starts again on its ports
WORK_SETTLE_S = 60.0  # until every run's work item is on the stream (a killed instance's accepts
# are handed off by the other's reconciler)
RESTART_ATTEMPTS, RESTART_BACKOFF_S = 10, 1.0  # restarting a node: past a Redis failover (~4 s)
READY_TIMEOUT_S = 60.0  # the replacement scheduler answering its health check
RETRYABLE = {"timeout", "transport_ambiguous", "backend_unavailable", "idempotency_in_progress", "internal"}
"""Answers sent again. A lost Redis node answers `backend_unavailable` (codec.STORE_UNAVAILABLE);
`internal` is retried too, defensively: the same idempotency key makes a retry safe whatever was
committed."""
FINAL_CODES = {c.value for c in ErrorCode} - RETRYABLE
"""Refusals a client takes as the answer; anything else (a transport error too) is sent again."""
REPLACEMENT = "scheduler-3"

FAULTS: dict[str, tuple[str, ...]] = {
    "NATS node SIGKILL (WORK stream leader)": ("nats",),
    "Redis primary failover": ("redis",),
    "scheduler-1 SIGKILL": ("scheduler-1",),
    "NATS node + Redis primary + scheduler-2 together": ("nats", "redis", "scheduler-2"),
}
"""Row name -> the faults injected together during its burst."""


@dataclass(frozen=True, slots=True)
class Burst:
    requests: int
    keys: int
    clients: int
    prefix: str
    """Of this burst's idempotency keys: every burst on a stack needs its own."""

    def __post_init__(self) -> None:
        if self.requests % self.keys:
            raise ValueError("A burst sends the same number of requests for every key.")


@dataclass(frozen=True, slots=True)
class Attempt:
    key: str
    started: float
    ended: float
    outcome: str
    """"ok", the error code answered, or the transport exception's name."""
    run_id: str | None

    @property
    def bad_at(self) -> float | None:
        """When a client could tell that this attempt went wrong; None when it went well."""
        if self.ended - self.started > SLOW_S:
            return self.started + SLOW_S
        return None if self.outcome == "ok" else self.ended


def order(burst: Burst) -> list[int]:
    """Key indexes in sending order: KEY_BLOCK keys at a time, round-robin, so that runs are
    created all through the burst and a key's requests race each other."""
    out: list[int] = []
    for first in range(0, burst.keys, KEY_BLOCK):
        block = range(first, min(first + KEY_BLOCK, burst.keys))
        for _ in range(burst.requests // burst.keys):
            out.extend(block)
    return out


class Client:
    """The burst's requests, as tenants send them, and every attempt's outcome."""

    def __init__(self, stack: chaos_stack.Stack, booking: str, manifest: pathlib.Path) -> None:
        self.stack, self.booking = stack, booking
        self.text = manifest.read_text()
        self.digest = hashlib.sha256(manifest.read_bytes()).hexdigest()
        self.attempts: list[Attempt] = []
        self.confirmations: dict[str, asyncio.Task] = {}
        self.taken = 0  # requests taken by a worker so far

    async def call(self, nc, suffix: str, key: str, **body) -> tuple[Attempt, dict]:
        """One attempt, on the account's own subject, with no credential in the body."""
        started = time.monotonic()
        try:
            reply = await nc.request(
                f"{self.stack.ns}.{suffix}.{self.stack.account}",
                json.dumps(body).encode(),
                timeout=REQUEST_TIMEOUT_S,
            )
            out = json.loads(reply.data)
            outcome = "ok" if out.get("ok") else str(out.get("error", {}).get("code", "internal"))
        except Exception as exc:  # no answer (a node or an instance died, a reconnect): retried
            out, outcome = {}, type(exc).__name__
        return Attempt(key, started, time.monotonic(), outcome, (out.get("data") or {}).get("run_id")), out

    async def until_answered(self, nc, suffix: str, key: str, record: bool, **body) -> dict:
        """Send until answered with anything but a retryable failure (bounded): same key, same body."""
        out: dict = {}
        for n in range(1, MAX_ATTEMPTS + 1):
            attempt, out = await self.call(nc, suffix, key, **body)
            if record:
                self.attempts.append(attempt)
            if attempt.outcome == "ok" or attempt.outcome in FINAL_CODES:
                return out
            await asyncio.sleep(min(RETRY_BACKOFF_S * n, RETRY_BACKOFF_MAX_S))
        return out

    async def train(self, nc, key: str) -> None:
        if key not in self.confirmations:  # the key's first request asks for its one confirmation
            self.confirmations[key] = asyncio.create_task(self._confirm(nc, key))
        try:
            ref = await self.confirmations[key]
        except RuntimeError:  # the confirmation was never answered: so is this request
            now = time.monotonic()
            self.attempts.append(Attempt(key, now, now, "no_confirmation", None))
            return
        await self.until_answered(
            nc,
            subjects.API_TRAIN,
            key,
            record=True,
            booking_id=self.booking,
            manifest_text=self.text,
            manifest_digest=self.digest,
            confirmation_ref=ref,
            idempotency_key=key,
        )

    async def _confirm(self, nc, key: str) -> str:
        out = await self.until_answered(
            nc,
            subjects.API_CONFIRM,
            key,
            record=False,
            action="train",
            booking_id=self.booking,
            manifest_text=self.text,
            manifest_digest=self.digest,
        )
        if not out.get("ok"):
            raise RuntimeError(f"no confirmation for {key}: {out.get('error') or 'no answer'}")
        return out["data"]["confirmation_ref"]

    async def lookup(self, nc, key: str) -> str | None:
        """The run the scheduler has for `key` now (None: none)."""
        out = await self.until_answered(nc, subjects.API_STATUS, key, record=False, idempotency_key=key)
        return (out.get("data") or {}).get("run_id") if out.get("ok") else None

    async def burst(self, burst: Burst, inject: Callable[[], Coroutine[Any, Any, dict[str, float]]]):
        """Every request of `burst` sent (CLIENTS at a time, each on its own connection) while
        `inject` kills; then every key looked up. (kill times by fault, {key: run found})."""
        conns = await asyncio.gather(
            *(chaos_stack.tenant_connection(self.stack) for _ in range(burst.clients))
        )
        queue = collections.deque(f"{burst.prefix}-{k}" for k in order(burst))

        async def worker(nc) -> None:
            while queue:
                key = queue.popleft()
                self.taken += 1
                await self.train(nc, key)

        try:
            faults = asyncio.create_task(inject())
            await asyncio.gather(*(worker(nc) for nc in conns))
            kills = await faults
            keys = collections.deque(f"{burst.prefix}-{k}" for k in range(burst.keys))
            found: dict[str, str | None] = {}

            async def looker(nc) -> None:
                while keys:
                    key = keys.popleft()
                    found[key] = await self.lookup(nc, key)

            await asyncio.gather(*(looker(nc) for nc in conns))
        finally:
            await asyncio.gather(*(nc.close() for nc in conns), return_exceptions=True)
        return kills, found


class Faults:
    """The kills of one row, injected together once FAULT_AT of the burst's requests are taken;
    each restores what it killed (a NATS node, a Redis node) before it returns."""

    def __init__(
        self, stack: chaos_stack.Stack, client: Client, burst: Burst, names: tuple[str, ...]
    ) -> None:
        self.stack, self.client, self.burst, self.names = stack, client, burst, names
        self.kills: dict[str, float] = {}
        self.notes: list[str] = []
        self.state_lock = asyncio.Lock()  # restart_infra rewrites up.json: one at a time

    async def __call__(self) -> dict[str, float]:
        while self.client.taken < FAULT_AT * self.burst.requests:
            await asyncio.sleep(0.01)
        await asyncio.gather(*(self._inject(name) for name in self.names))
        return self.kills

    async def _inject(self, name: str) -> None:
        if name == "nats":
            await self._kill_nats()
        elif name == "redis":
            await self._fail_over_redis()
        else:
            os.kill(self.stack.pids()[name], signal.SIGKILL)
            self.kills[name] = time.monotonic()
            self.notes.append(f"{name} killed")

    async def _kill_nats(self) -> None:
        node = await _work_leader(self.stack)
        os.kill(self.stack.infra_pid(node), signal.SIGKILL)
        self.kills["nats"] = time.monotonic()
        await asyncio.sleep(NATS_DOWN_S)
        await self._restart(node)
        self.notes.append(
            f"{node} (WORK leader) killed, back after {time.monotonic() - self.kills['nats']:.1f} s"
        )

    async def _fail_over_redis(self) -> None:
        from devstack import redis_cluster

        cluster = redis_cluster.Cluster.from_dict(self.stack._state()["redis_nodes"])
        roles = await asyncio.gather(
            *(asyncio.to_thread(redis_cluster.role, cluster, n) for n in cluster.nodes)
        )
        primary = [n for n, r in zip(cluster.nodes, roles, strict=True) if r == "master"][-1]
        done = await asyncio.to_thread(redis_cluster.fail_over, cluster, primary)
        self.kills["redis"] = time.monotonic() - done.seconds
        await self._restart(f"redis-{primary.index + 1}")  # it rejoins as its replica's replica
        self.notes.append(f"redis-{primary.index + 1} failed over in {done.seconds:.1f} s, rejoined")

    async def _restart(self, name: str) -> None:
        """`restart_infra`, retried (bounded): a NATS node reads the tenants from Redis to start,
        which fails while a primary is failing over."""
        from devstack.stack import restart_infra

        for n in range(1, RESTART_ATTEMPTS + 1):
            try:
                async with self.state_lock:
                    await asyncio.to_thread(restart_infra, self.stack.settings(), name)
                return
            except Exception:
                if n == RESTART_ATTEMPTS:
                    raise
                await asyncio.sleep(RESTART_BACKOFF_S)


async def _work_leader(stack: chaos_stack.Stack) -> str:
    """The NATS node leading the WORK stream (its loss moves the stream's leader too)."""
    from devstack.authority import connect
    from runtime.security.identities import OPERATOR

    s = stack.settings()
    nc = await connect(s, OPERATOR, allow_reconnect=False)
    try:
        info = await nc.jetstream(timeout=chaos_stack.PROBE_TIMEOUT_S).stream_info(
            s.stream(subjects.STREAM_WORK)
        )
        return (info.cluster and info.cluster.leader) or "nats-1"
    finally:
        await nc.close()


def fault_row(stack: chaos_stack.Stack, burst: Burst, names: tuple[str, ...], scenario: str = "") -> dict:
    """One burst with `names` injected mid-way, counted (see the module docstring)."""
    booking, manifest = stack.booking(), stack.manifest(10)
    before = stack.queued()
    client = Client(stack, booking, manifest)
    faults = Faults(stack, client, burst, names)
    began = time.monotonic()
    kills, found = asyncio.run(client.burst(burst, faults))
    seconds = time.monotonic() - began
    attempts = [a for a in client.attempts if not a.outcome.startswith("confirm")]
    answered: dict[str, set[str]] = collections.defaultdict(set)
    for a in attempts:
        if a.outcome == "ok" and a.run_id:
            answered[a.key].add(a.run_id)
    runs = set().union(*answered.values()) if answered else set()
    records = {r for r in found.values() if r}
    settle = time.monotonic()
    try:
        work = chaos_stack.wait(
            lambda: (q := _work_items(stack, before)) >= len(records) and q, WORK_SETTLE_S, 0.5
        )
    except TimeoutError:  # counted as they are: fewer than the records is lost runs
        work = _work_items(stack, before)
    settled = time.monotonic() - settle
    duplicates = sum(len(v) > 1 for v in answered.values()) + max(0, work - len(records))
    lost = (
        sum(1 for k, v in answered.items() if found.get(k) not in v)
        + (burst.keys - len(answered))
        + max(0, len(records) - work)
    )
    detection, recovery = times(attempts, min(kills.values()) if kills else None)
    errors = collections.Counter(a.outcome for a in attempts if a.outcome != "ok")
    return {
        "scenario": scenario or "cluster: " + " + ".join(names),
        "detection_s": detection,
        "resume_s": recovery,
        "runs_lost": lost,
        "duplicate_runs": duplicates,
        "steps_lost": 0,
        "requests": burst.requests,
        "keys": burst.keys,
        "answered": sum(a.outcome == "ok" for a in attempts),
        "retried": len(attempts) - burst.requests,
        "runs": len(runs),
        "records": len(records),
        "work_items": work,
        "burst_s": round(seconds, 1),
        "note": "; ".join(faults.notes)
        + (f"; errors {dict(errors.most_common(4))}" if errors else "")
        + f"; {burst.requests} requests in {seconds:.0f} s, work items counted after {settled:.1f} s",
    }


def _work_items(stack: chaos_stack.Stack, before: int) -> int:
    """Work items on the WORK stream since `before`; -1 when the stream does not answer (its
    leader is being elected again after a node came back, say)."""
    try:
        return stack.queued() - before
    except Exception:  # a probe timing out is no count
        return -1


def times(attempts: list[Attempt], killed: float | None) -> tuple[float | None, float | None]:
    """(detection, recovery) in seconds from the kill: the first moment a client could tell, and
    the first good answer to an attempt sent after the last bad one. (None, None) when no client
    noticed anything."""
    if killed is None:
        return None, None
    bad = [a for a in attempts if (t := a.bad_at) is not None and t >= killed]
    if not bad:
        return None, None
    detected = min(a.bad_at or 0.0 for a in bad) - killed
    last = max(a.started for a in bad)
    good = [a.ended for a in attempts if a.outcome == "ok" and a.bad_at is None and a.started > last]
    return detected, (min(good) - killed) if good else None


def fault_rows(root: pathlib.Path) -> list[dict]:
    """Every FAULTS row, each its own burst, on one `up --cluster` (control plane only)."""
    stack = chaos_stack.Stack(root, chaos_stack.CONTROL_PLANE, cluster=True)
    replacement = None
    rows = []
    try:
        for i, (name, names) in enumerate(FAULTS.items()):
            if "scheduler-2" in names:  # one scheduler must be left: a replacement for scheduler-1
                replacement = start_replacement(stack)
            try:
                burst = Burst(REQUESTS, KEYS, CLIENTS, prefix=f"c{i}")
                rows.append(fault_row(stack, burst, names, f"cluster: {name}"))
            except Exception as exc:  # one failed row is reported, the others still run
                rows.append({"scenario": f"cluster: {name}", "error": f"{type(exc).__name__}: {exc}"[:200]})
    finally:
        if replacement is not None:
            replacement.terminate()
            replacement.wait(timeout=30)
        stack.down()
    return rows


def start_replacement(stack: chaos_stack.Stack) -> subprocess.Popen:
    """Another scheduler instance, as `up --cluster` starts one; returns once it answers."""
    env = {**stack.env, ENV_REDIS_CLUSTER: "1", ENV_NATS_REPLICAS: "3", ENV_INSTANCE: REPLACEMENT}
    log = open(pathlib.Path(stack._state()["logs"]) / f"{REPLACEMENT}.log", "ab")
    proc = subprocess.Popen(
        [str(chaos_stack.BIN / "ito-training"), "serve", "scheduler"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()
    try:
        chaos_stack.wait(lambda: asyncio.run(_answers(stack, REPLACEMENT)), READY_TIMEOUT_S, 0.5)
    except TimeoutError:
        proc.kill()
        raise
    return proc


async def _answers(stack: chaos_stack.Stack, instance: str) -> bool:
    """Whether `instance` answered one of a few scheduler health checks (a queue group picks one)."""
    from devstack.authority import connect
    from runtime.security.identities import OPERATOR

    s = stack.settings()
    nc = await connect(s, OPERATOR, allow_reconnect=False)
    try:
        for _ in range(8):
            try:
                reply = await nc.request(s.subject(f"{subjects.HEALTH}.scheduler"), b"{}", timeout=1)
            except Exception:  # not yet
                continue
            if (reply.headers or {}).get(INSTANCE_HEADER) == instance:
                return True
        return False
    finally:
        await nc.close()


def scenarios(root: pathlib.Path) -> list[tuple[str, Callable[[], list[dict]]]]:
    """For chaos.main: the whole section, one entry (one cluster), a row per fault."""
    return [("cluster: NATS node, Redis primary, scheduler instance during bursts", lambda: fault_rows(root))]


CLUSTER_HEADER = (
    "scenario",
    "detection_s",
    "resume_s",
    "answered",
    "retried",
    "runs",
    "duplicate_runs",
    "runs_lost",
)


def print_table(rows: list[dict]) -> None:
    """The cluster rows again, with their burst's counts."""
    cluster = [r for r in rows if r["scenario"].startswith("cluster") and not r.get("error")]
    if cluster:
        print("\n" + " | ".join(CLUSTER_HEADER))
        for row in cluster:
            print(" | ".join(chaos_stack.fmt(row.get(h)) for h in CLUSTER_HEADER))
