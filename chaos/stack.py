"""The stacks `make chaos` breaks (chaos/scenarios.py, chaos/cluster.py): `ito-training
up` under a fresh namespace with its own authenticated NATS and Redis, one tenant logged in for
`ecc`, and the tenant connection the bursts send on (as `ecc` makes one, kept across an outage)."""

import asyncio
import json
import os
import pathlib
import subprocess
import sys
import time
import uuid

from contracts import subjects
from runtime.configuration import settings as settings_mod
from runtime.configuration.settings import (
    ENV_DATA_DIR,
    ENV_NAMESPACE,
    ENV_NATS_URL,
    ENV_REDIS_URL,
    ENV_SECRETS_DIR,
    ENV_TRAINER_THREADS,
)

BIN = pathlib.Path(sys.executable).parent
REPO = pathlib.Path(__file__).resolve().parents[1]
CONTROL_PLANE = "entitlement,confirmation,ledger,scheduler"
UP_TIMEOUT_S = 180  # `up` waits up to 90 s for health; the trainer imports torch
BURST_REQUEST_TIMEOUT_S = 8  # one request of the burst; an outage answers as a transport error
BURST_RECONNECT_WAIT_S = 0.2
BURST_MAX_RECONNECTS = 150  # ~30 s of outage, well past the restart, then the client gives up
PROBE_TIMEOUT_S = 5  # a stream info probe


UNLIMITED_QUOTA = (
    "--rate",
    "1000000",
    "--burst",
    "1000000",
    "--confirmations",
    "1000000",
    "--runs",
    "1000000",
    "--queued",
    "1000000",
)


class Stack:
    """`ito-training up` (its own authenticated NATS and Redis) under a fresh namespace and data
    dir, one tenant account logged in for `ecc`."""

    def __init__(
        self, root: pathlib.Path, services: str | None = None, env: dict | None = None, cluster: bool = False
    ) -> None:
        self.ns = "chaos" + uuid.uuid4().hex[:8]
        self.dir = root / self.ns
        self.env = {
            **os.environ,
            ENV_NAMESPACE: self.ns,
            ENV_DATA_DIR: str(self.dir),
            ENV_SECRETS_DIR: str(self.dir / "secrets"),
            "ECC_CONFIG_DIR": str(self.dir / "ecc"),
            ENV_TRAINER_THREADS: "1",
            **(env or {}),
        }
        for name in (ENV_NATS_URL, ENV_REDIS_URL):  # `up` starts its own servers; never the machine's
            self.env.pop(name, None)
        args = ["up", "--detach", "--json"] + (["--services", services] if services else [])
        args += ["--cluster"] if cluster else []  # chaos/cluster.py
        started = self.cli("ito-training", *args, timeout=UP_TIMEOUT_S)
        # Every later CLI and service process of this stack talks to these servers.
        self.env[ENV_NATS_URL], self.env[ENV_REDIS_URL] = started["nats_url"], started["redis_url"]
        self.account = "chaos"
        try:
            # `accounts create` also reloads the stack's nats-server so that it accepts the new NKey.
            key = self.cli("ito-training", "accounts", "create", self.account, "--json")["api_key"]
            # The scenarios measure recovery, not the quotas (docs/quotas.md): a burst of a thousand
            # requests would otherwise meet the default request rate. The tenant is unlimited here.
            self.cli("ito-training", "accounts", "quota", self.account, *UNLIMITED_QUOTA, "--json")
            self.cli(
                "ecc", "ito", "login", "--account", self.account, "--json", input=key + "\n"
            )  # stdin, not argv
        except Exception:  # the scenario never gets the stack, so it cannot stop it: stop it here
            self.down()
            raise
        self.key = key  # the tenant's API key (its NKey seed): in memory only, never printed

    def cli(self, exe: str, *args: str, input: str | None = None, timeout: float = 60, check: bool = True):
        proc = subprocess.run(
            [str(BIN / exe), *args],
            env=self.env,
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"{exe} {' '.join(args[:2])}: {proc.stderr[-500:] or proc.stdout[-500:]}")
        lines = proc.stdout.strip().splitlines()
        return json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}

    def settings(self) -> settings_mod.Settings:
        return settings_mod.load(self.env)

    def ecc(self, *args: str, timeout: float = 60) -> dict:
        return self.cli("ecc", "ito", *args, "--json", timeout=timeout, check=False)

    def booking(self, nodes: int = 1) -> str:
        booking = "bk-" + uuid.uuid4().hex[:6]
        topology = ["--nodes", str(nodes), "--gpus-per-node", "1"] if nodes > 1 else []
        self.cli(
            "ito-training",
            "simulate-booking",
            "--account",
            self.account,
            "--booking",
            booking,
            "--event",
            "completed",
            *topology,
            "--json",
        )
        return booking

    def manifest(self, steps: int, gpus: int = 1, interval: int = 50, nodes: int = 1) -> pathlib.Path:
        raw = json.loads((REPO / "examples" / "manifests" / "tiny.json").read_text())
        raw["target"] = {"tokens": steps * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003}
        raw["checkpoint"] = {"interval_steps": interval, "keep_last": 2, "storage": "local"}
        raw["resources"] = {"nodes": nodes, "gpus_per_node": gpus}
        path = self.dir / f"manifest-{steps}-{gpus}-{nodes}.json"
        path.write_text(json.dumps(raw))
        path.chmod(0o644)
        return path

    def train(self, booking: str, manifest: pathlib.Path, key: str) -> dict:
        ref = self.ecc("confirm", "--action", "train", "--booking", booking, "--manifest", str(manifest))
        return self.ecc(
            "train",
            "--booking",
            booking,
            "--manifest",
            str(manifest),
            "--confirmation-ref",
            ref["data"]["confirmation_ref"],
            "--idempotency-key",
            key,
            "--timeout",
            "5",
        )

    def status(self, run_id: str) -> dict:
        return self.ecc("status", run_id)["data"]

    def _state(self) -> dict:
        return json.loads((self.dir / "up.json").read_text())

    def pids(self) -> dict:
        return self._state()["services"]

    def infra_pid(self, name: str) -> int:
        """The stack's own `nats` or `redis` server (restart_infra records a restarted one here)."""
        return self._state()["infra"][name]

    def queued(self) -> int:
        async def count():
            from devstack.authority import connect
            from runtime.security.identities import OPERATOR

            s = self.settings()
            nc = await connect(s, OPERATOR, allow_reconnect=False)  # the stream probe is operator tooling
            try:
                info = await nc.jetstream(timeout=PROBE_TIMEOUT_S).stream_info(s.stream(subjects.STREAM_WORK))
                return info.state.messages
            finally:
                await nc.close()

        return asyncio.run(count())

    def down(self) -> None:
        self.cli("ito-training", "down", check=False)


def wait(predicate, timeout: float, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError("condition not reached")


async def tenant_connection(stack: Stack):
    """A tenant connection exactly as `ecc` makes one, but kept across the outage (reconnecting)."""
    import nats

    from ecc.transport import seed_of, tenant_inbox

    async def outage(exc: Exception) -> None:
        pass  # refused reconnects while the server is down are the scenario, not news (nats-py prints each)

    seed = seed_of(stack.key)
    assert seed is not None, "the stack's tenant key is an ito-training API key"
    return await nats.connect(
        settings_mod.nats_servers(stack.env[ENV_NATS_URL]),  # a cluster's pool: nats-py fails over
        connect_timeout=2,
        nkeys_seed_str=seed.decode(),
        inbox_prefix=tenant_inbox(stack.account),
        max_reconnect_attempts=BURST_MAX_RECONNECTS,
        reconnect_time_wait=BURST_RECONNECT_WAIT_S,
        error_cb=outage,
    )


def fmt(value) -> str:
    return "-" if value is None else (f"{value:.1f}" if isinstance(value, float) else str(value))
