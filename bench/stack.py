"""The system under test: infra, a stack of services under a unique namespace, one account with a
booking, a client that talks to the API over NATS as `ecc` does, and the purge afterwards.

Infra is the NATS and Redis at ITO_NATS_URL / ITO_REDIS_URL when they answer (the machine's own
are shared, so everything here lives under a fresh namespace and is removed at the end), else
embedded servers started in a temp dir and stopped by their pid.
"""

import asyncio
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

import msgspec

from contracts import subjects
from contracts.api import Action, ConfirmRequest, Credential, TrainRequest
from services.runtime import infra
from services.runtime.namespaces import purge
from services.runtime.settings import DEFAULT_NATS_URL, DEFAULT_REDIS_URL, ENV_NATS_URL, ENV_REDIS_URL

REPO = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent
CONTROL_PLANE = "entitlement,confirmation,ledger,scheduler"  # no trainer: runs pile up on the work queue
UP_TIMEOUT_S = 180.0  # `up` waits up to 90 s for health; a cold 2-core machine imports slowly
REQUEST_TIMEOUT_S = 30.0  # one API call from the bench client; generous, a timeout is an error
BOOKING_READY_TIMEOUT_S = 30.0  # the entitlement projection applies the simulated booking

_encoder = msgspec.json.Encoder()


@dataclass(slots=True)
class Infra:
    nats_url: str
    redis_url: str
    embedded_pids: list[int] = field(default_factory=list)

    def stop(self) -> None:
        for pid in self.embedded_pids:
            infra.stop_pid(pid)


def ensure_infra(state_dir: pathlib.Path) -> Infra:
    nats_url = os.environ.get(ENV_NATS_URL) or DEFAULT_NATS_URL
    redis_url = os.environ.get(ENV_REDIS_URL) or DEFAULT_REDIS_URL
    nats, redis = infra.ensure(nats_url, redis_url, state_dir, state_dir / "logs")
    return Infra(nats.url, redis.url, [s.pid for s in (nats, redis) if s.pid])


async def infra_facts(i: Infra) -> dict:
    """What the figures depend on: server versions, Redis durability, reused or embedded."""
    import nats
    import redis.asyncio as aioredis

    nc = await nats.connect(i.nats_url, connect_timeout=2)
    try:
        nats_version = str(nc.connected_server_version)
    finally:
        await nc.close()
    r = aioredis.Redis.from_url(i.redis_url, decode_responses=True)
    try:
        version = (await r.info("server"))["redis_version"]
        appendonly = (await r.config_get("appendonly")).get("appendonly")
        appendfsync = (await r.config_get("appendfsync")).get("appendfsync")
    finally:
        await r.aclose()
    return {"nats_url": i.nats_url, "nats_server": nats_version, "redis_url": i.redis_url, "redis_server": version,
            "redis_appendonly": appendonly, "redis_appendfsync": appendfsync,
            "embedded": bool(i.embedded_pids)}


def new_namespace() -> str:
    return "bench" + uuid.uuid4().hex[:8]


def manifest_text() -> str:
    """The tiny example manifest, shortened as the tests shorten it (a few dozen steps)."""
    base = json.loads((REPO / "examples" / "manifests" / "tiny.json").read_text())
    base["target"] = {"tokens": 30 * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003}
    base["checkpoint"] = {"interval_steps": 10, "keep_last": 2, "storage": "local"}
    return json.dumps(base, indent=2)


class Stack:
    """`ito-training up --detach` under a fresh namespace and data dir; `close` stops and purges."""

    def __init__(self, infra_: Infra, services: str = CONTROL_PLANE) -> None:
        self.infra = infra_
        self.services = services
        self.namespace = new_namespace()
        self.data_dir = pathlib.Path(tempfile.mkdtemp(prefix="ito-bench-stack-"))
        self.env = {**os.environ, ENV_NATS_URL: infra_.nats_url, ENV_REDIS_URL: infra_.redis_url,
                    "ITO_NAMESPACE": self.namespace, "ITO_DATA_DIR": str(self.data_dir),
                    "ECC_CONFIG_DIR": str(self.data_dir / "ecc"), "PATH": f"{BIN}:{os.environ.get('PATH', '')}"}
        self.account = ""
        self.api_key = ""
        self.booking = ""

    def up(self) -> None:
        proc = subprocess.run([str(BIN / "ito-training"), "up", "--detach", "--json", "--services", self.services],
                              env=self.env, cwd=REPO, capture_output=True, text=True, timeout=UP_TIMEOUT_S)
        if proc.returncode != 0:
            raise RuntimeError(f"ito-training up failed: {proc.stderr[-2000:]}")

    def service_pids(self) -> dict[str, int]:
        return json.loads((self.data_dir / "up.json").read_text())["services"]

    def settings(self):
        from services.runtime import settings as settings_mod

        return settings_mod.load(self.env)

    async def provision(self) -> None:
        """One account (key created in Redis as `ito-training accounts create` does) with one
        completed booking, and wait until the entitlement service has projected it."""
        from services.ops import booking_sim
        from services.runtime import accounts, connections
        from services.runtime.keys import Keys

        s = self.settings()
        self.account = "bench-" + uuid.uuid4().hex[:8]
        r = connections.make_redis(s)
        try:
            self.api_key, _ = await accounts.create(r, Keys(s), self.account)
        finally:
            await r.aclose()
        self.booking = "bk-" + uuid.uuid4().hex[:8]
        event = booking_sim.event(account=self.account, booking=self.booking, kind="completed", nodes=1,
                                  gpus_per_node=8, gpu_model="H200", region="eu-central-1", fabric="infiniband",
                                  hours=24.0)
        await booking_sim.publish(s, event)
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
        proc = subprocess.run([str(BIN / "ecc"), "ito", "login", "--account", self.account, "--json"],
                              input=self.api_key + "\n", env=self.env, cwd=REPO, capture_output=True, text=True,
                              timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"ecc login failed: {proc.stdout[-1000:]} {proc.stderr[-1000:]}")

    async def work_queued(self) -> int:
        """Messages on this namespace's WORK stream: the trainer's only input."""
        import nats

        nc = await nats.connect(self.infra.nats_url, connect_timeout=2)
        try:
            info = await nc.jetstream().stream_info(self.settings().stream(subjects.STREAM_WORK))
            return info.state.messages
        finally:
            await nc.close()

    def close(self) -> None:
        subprocess.run([str(BIN / "ito-training"), "down", "--json"], env=self.env, cwd=REPO,
                       capture_output=True, text=True, timeout=60)
        asyncio.run(purge(self.infra.nats_url, self.infra.redis_url, self.namespace))
        shutil.rmtree(self.data_dir, ignore_errors=True)


class ApiClient:
    """One NATS connection to the API, as one `ecc` process holds; answers are decoded envelopes."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.prefix = stack.namespace + "."
        self.credential = Credential(account=stack.account, api_key=stack.api_key)
        self.text = manifest_text()
        self.digest = hashlib.sha256(self.text.encode()).hexdigest()
        self.nc = None

    async def __aenter__(self) -> "ApiClient":
        import nats

        self.nc = await nats.connect(self.stack.infra.nats_url, connect_timeout=2, name="ito-bench")
        return self

    async def __aexit__(self, *exc) -> None:
        await self.nc.close()

    async def call(self, suffix: str, request: msgspec.Struct) -> dict:
        reply = await self.nc.request(self.prefix + suffix, _encoder.encode(request), timeout=REQUEST_TIMEOUT_S)
        return msgspec.json.decode(reply.data)

    async def confirm(self) -> dict:
        return await self.call(subjects.API_CONFIRM, ConfirmRequest(
            credential=self.credential, action=Action.train, booking_id=self.stack.booking,
            manifest_text=self.text, manifest_digest=self.digest))

    async def train(self, confirmation_ref: str, idempotency_key: str) -> dict:
        return await self.call(subjects.API_TRAIN, TrainRequest(
            credential=self.credential, booking_id=self.stack.booking, manifest_text=self.text,
            manifest_digest=self.digest, idempotency_key=idempotency_key, confirmation_ref=confirmation_ref))


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
