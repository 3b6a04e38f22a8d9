"""The system under test: a stack of services started by `ito-training up`, one tenant account
with a booking, a client that talks to the API over NATS exactly as `ecc` does, and the teardown.

Authentication is on everywhere: `up` starts a nats-server (nkeys, per-identity allow-lists) and a
redis-server (ACL users, `default` off) of its own under a fresh data dir, and `down` stops them.
The machine's NATS and Redis on the standard ports have no authentication and are never used, so
ITO_NATS_URL / ITO_REDIS_URL are dropped from the environment before `up`. The load clients are
tenants (their NKey, their own inbox prefix, requests on the account's own subjects, no credential
in a body); probes connect as the operator (NATS) and admin (Redis) identities.
"""

import asyncio
import hashlib
import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import msgspec

from contracts import subjects
from contracts.api import Action, ConfirmRequest, TrainRequest
from devstack import infra
from runtime.configuration.settings import (
    ENV_DATA_DIR,
    ENV_NAMESPACE,
    ENV_NATS_URL,
    ENV_REDIS_URL,
    ENV_SECRETS_DIR,
)

REPO = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent
CONTROL_PLANE = "entitlement,confirmation,ledger,scheduler"  # no trainer: runs pile up on the work queue
AUTH = "nkeys+acl"  # NATS: nkey challenge-response + allow-lists; Redis: ACL users, default user off
UP_TIMEOUT_S = 180.0  # `up` waits up to 90 s for health; a cold 2-core machine imports slowly
UNLIMITED = ("--rate", "1000000", "--burst", "1000000", "--confirmations", "1000000")
UNLIMITED += ("--runs", "1000000", "--queued", "1000000")
CLI_TIMEOUT_S = 60.0  # one `ito-training` / `ecc` command (accounts create reloads the NATS config)
REQUEST_TIMEOUT_S = 30.0  # one API call from the bench client; generous, a timeout is an error
BOOKING_READY_TIMEOUT_S = 30.0  # the entitlement projection applies the simulated booking
PROBE_TIMEOUT_S = 5.0  # a stream info or server info probe

_encoder = msgspec.json.Encoder()


def new_namespace() -> str:
    return "bench" + uuid.uuid4().hex[:8]


def manifest_text() -> str:
    """The tiny example manifest, shortened as the tests shorten it (a few dozen steps)."""
    base = json.loads((REPO / "examples" / "manifests" / "tiny.json").read_text())
    base["target"] = {"tokens": 30 * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003}
    base["checkpoint"] = {"interval_steps": 10, "keep_last": 2, "storage": "local"}
    return json.dumps(base, indent=2)


class Stack:
    """`ito-training up --detach` (its own authenticated infra) under a fresh namespace and data
    dir; `close` stops all of it and removes the dir."""

    def __init__(self, services: str = CONTROL_PLANE) -> None:
        self.services = services
        self.namespace = new_namespace()
        self.data_dir = pathlib.Path(tempfile.mkdtemp(prefix="ito-bench-stack-"))
        self.env = {
            **os.environ,
            ENV_NAMESPACE: self.namespace,
            ENV_DATA_DIR: str(self.data_dir),
            ENV_SECRETS_DIR: str(self.data_dir / "secrets"),
            "ECC_CONFIG_DIR": str(self.data_dir / "ecc"),
            "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
        }
        for name in (ENV_NATS_URL, ENV_REDIS_URL):  # `up` starts its own servers; never the machine's
            self.env.pop(name, None)
        self.nats_url = ""
        self.redis_url = ""
        self.account = ""
        self.api_key = ""  # the tenant's NKey seed as an API key: kept in memory, never logged
        self.booking = ""

    def ito(self, *args: str, timeout: float = CLI_TIMEOUT_S) -> dict:
        """`ito-training ARGS --json` -> its JSON answer (the last line of stdout)."""
        proc = subprocess.run(
            [str(BIN / "ito-training"), *args, "--json"],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"ito-training {args[0]} failed: {proc.stderr[-2000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def up(self) -> None:
        started = self.ito("up", "--detach", "--services", self.services, timeout=UP_TIMEOUT_S)
        self.nats_url, self.redis_url = started["nats_url"], started["redis_url"]
        # Every later CLI and service process of this stack talks to these servers.
        self.env[ENV_NATS_URL], self.env[ENV_REDIS_URL] = self.nats_url, self.redis_url

    def _state(self) -> dict:
        return json.loads((self.data_dir / "up.json").read_text())

    def service_pids(self) -> dict[str, int]:
        return self._state()["services"]

    def infra_pids(self) -> dict[str, int]:
        """The stack's own nats-server and redis-server (CPU accounting; the servers are ours)."""
        return self._state()["infra"]

    def settings(self):
        from runtime.configuration import settings as settings_mod

        return settings_mod.load(self.env)

    async def nats(self, identity: str = "operator", **options):
        """A plain nats-py connection as one of the stack's identities (operator: the probes)."""
        from devstack.authority import connect

        return await connect(self.settings(), identity, **options)

    def redis(self, identity: str = "admin"):
        """An asyncio Redis client as one ACL user (admin: the probes; MONITOR, INFO, CONFIG GET)."""
        from runtime.messaging import connections

        return connections.make_redis(self.settings(), identity)

    async def tenant(self, **options):
        """A NATS connection as this stack's tenant, exactly as `ecc` makes it: its NKey (the seed
        inside the API key signs the server's challenge, it never crosses the wire) and replies
        only under the tenant's own inbox prefix."""
        import nats

        from ecc.transport import seed_of, tenant_inbox

        return await nats.connect(
            self.nats_url,
            connect_timeout=2,
            nkeys_seed_str=seed_of(self.api_key).decode(),
            inbox_prefix=tenant_inbox(self.account),
            **options,
        )

    def api_subject(self, suffix: str) -> str:
        """`<ns>.<verb>.<account>`: the only subjects this tenant may publish on."""
        return f"{self.namespace}.{suffix}.{self.account}"

    async def provision(self) -> None:
        """One account (made by `ito-training accounts create`, which also reloads the NATS server
        so that it accepts the new NKey) with one completed booking, and wait until the
        entitlement service has projected it."""
        from devstack import booking_sim

        self.account = "bench-" + uuid.uuid4().hex[:8]
        created = await asyncio.to_thread(self.ito, "accounts", "create", self.account)
        if not created.get("server_reloaded"):
            raise RuntimeError("the stack's nats-server was not reloaded with the new account")
        self.api_key = created["api_key"]
        # The bench measures the services, not the quotas (docs/quotas.md): its tenant is unlimited.
        await asyncio.to_thread(self.ito, "accounts", "quota", self.account, *UNLIMITED)
        self.booking = "bk-" + uuid.uuid4().hex[:8]
        event = booking_sim.event(
            account=self.account,
            booking=self.booking,
            kind="completed",
            nodes=1,
            gpus_per_node=8,
            gpu_model="H200",
            region="eu-central-1",
            fabric="infiniband",
            hours=24.0,
        )
        await booking_sim.publish(self.settings(), event)  # as the `compute` identity, as upstream would
        async with ApiClient(self) as client:
            deadline = time.monotonic() + BOOKING_READY_TIMEOUT_S
            while True:
                out = await client.confirm()
                if out["ok"]:
                    return
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the booking never became eligible: {out['error']}")
                await asyncio.sleep(0.2)

    def ecc_login(self) -> None:
        # The key goes on stdin, never in an argument (argv is visible to every local user).
        proc = subprocess.run(
            [str(BIN / "ecc"), "ito", "login", "--account", self.account, "--json"],
            input=self.api_key + "\n",
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=CLI_TIMEOUT_S,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"ecc login failed: {proc.stdout[-1000:]} {proc.stderr[-1000:]}")

    async def work_queued(self) -> int:
        """Messages on this namespace's WORK stream: the trainer's only input."""
        nc = await self.nats(allow_reconnect=False)
        try:
            info = await nc.jetstream(timeout=PROBE_TIMEOUT_S).stream_info(
                self.settings().stream(subjects.STREAM_WORK)
            )
            return info.state.messages
        finally:
            await nc.close()

    def close(self) -> None:
        """`down` (services, then the stack's own servers); if it could not, stop what up.json names."""
        try:
            leftover = self._state()
        except (OSError, ValueError):
            leftover = None  # `up` never wrote its state: nothing was started, or `up` cleaned up itself
        try:
            subprocess.run(
                [str(BIN / "ito-training"), "down", "--json"],
                env=self.env,
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=CLI_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            pass
        if leftover is not None and (self.data_dir / "up.json").exists():
            for pid in [*leftover.get("services", {}).values(), *leftover.get("infra", {}).values()]:
                infra.stop_pid(pid)
        shutil.rmtree(self.data_dir, ignore_errors=True)


async def infra_facts(stack: Stack) -> dict:
    """What the figures depend on: server versions, Redis durability, and that auth was on."""
    nc = await stack.nats(allow_reconnect=False)
    try:
        nats_version = str(nc.connected_server_version)
    finally:
        await nc.close()
    r = stack.redis()
    try:
        version = (await r.info("server"))["redis_version"]
        appendonly = (await r.config_get("appendonly")).get("appendonly")  # redis-py gives str pairs here
        appendfsync = (await r.config_get("appendfsync")).get("appendfsync")
    finally:
        await r.aclose()
    return {
        "nats_url": stack.nats_url,
        "nats_server": nats_version,
        "redis_url": stack.redis_url,
        "redis_server": version,
        "redis_appendonly": appendonly,
        "redis_appendfsync": appendfsync,
        "embedded": True,  # always servers of the stack's own (`up` never reuses one)
        "auth": AUTH,
    }


class ApiClient:
    """One tenant NATS connection to the API, as one `ecc` process holds; answers are decoded
    envelopes. Requests go to `<ns>.<verb>.<account>` and carry no credential: the server
    authenticated the connection, and the subject says which account is asking."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.text = manifest_text()
        self.digest = hashlib.sha256(self.text.encode()).hexdigest()
        self.nc = None

    async def __aenter__(self) -> "ApiClient":
        self.nc = await self.stack.tenant(name="ito-bench")
        return self

    async def __aexit__(self, *exc) -> None:
        await self.nc.close()

    async def call(self, suffix: str, request: msgspec.Struct) -> dict:
        reply = await self.nc.request(
            self.stack.api_subject(suffix), _encoder.encode(request), timeout=REQUEST_TIMEOUT_S
        )
        return msgspec.json.decode(reply.data)

    async def confirm(self) -> dict:
        return await self.call(
            subjects.API_CONFIRM,
            ConfirmRequest(
                action=Action.train,
                booking_id=self.stack.booking,
                manifest_text=self.text,
                manifest_digest=self.digest,
            ),
        )

    async def train(self, confirmation_ref: str, idempotency_key: str) -> dict:
        return await self.call(
            subjects.API_TRAIN,
            TrainRequest(
                booking_id=self.stack.booking,
                manifest_text=self.text,
                manifest_digest=self.digest,
                idempotency_key=idempotency_key,
                confirmation_ref=confirmation_ref,
            ),
        )


async def confirmations(stack: Stack, n: int, concurrency: int = 16) -> list[str]:
    """`n` fresh confirmation references (made before any timed request: confirm is not timed)."""
    refs: list[str] = []

    async def worker(count: int) -> None:
        async with ApiClient(stack) as client:
            for _ in range(count):
                out = await client.confirm()
                if not out["ok"]:
                    raise RuntimeError(f"confirm refused: {out['error']}")
                refs.append(out["data"]["confirmation_ref"])

    shares = [n // concurrency + (1 if i < n % concurrency else 0) for i in range(concurrency)]
    await asyncio.gather(*(worker(c) for c in shares if c))
    return refs


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_delta(after: tuple[float, float], before: tuple[float, float]) -> tuple[float, float]:
    return after[0] - before[0], after[1] - before[1]


def own_cpu_seconds() -> tuple[float, float]:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


async def drive(stack: Stack, jobs: list[tuple[str, str]], clients: int) -> tuple[list[dict], float]:
    """Send (confirmation ref, key) jobs from `clients` connections; (answers, wall seconds)."""
    queue = iter(jobs)
    answers: list[dict] = []

    async def client_loop(client: ApiClient) -> None:
        for ref, key in queue:  # a shared iterator: each job goes to exactly one client
            out = await client.train(ref, key)
            out["key"] = key
            answers.append(out)

    conns = [ApiClient(stack) for _ in range(clients)]
    await asyncio.gather(*(c.__aenter__() for c in conns))
    try:
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(c) for c in conns))
        return answers, time.perf_counter() - started
    finally:
        await asyncio.gather(*(c.__aexit__(None, None, None) for c in conns))
