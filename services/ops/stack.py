"""`up` and `down`: our own authenticated infra plus all services as processes, with state in
`<data_dir>/up.json`. `up` never uses a server it did not start: the machine's NATS and Redis on
the standard ports have no authentication."""

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from contracts.subjects import HEALTH, SERVICES
from services.ops import authority
from services.runtime import infra
from services.runtime.identities import OPERATOR
from services.runtime.settings import (
    ENV_DATA_DIR,
    ENV_NAMESPACE,
    ENV_NATS_URL,
    ENV_REDIS_URL,
    ENV_SECRETS_DIR,
    Settings,
    entitlement_key,
)

SERVICES_READY_TIMEOUT_S = 90.0  # the trainer imports torch; a cold 2-core machine is slow


def state_path(settings: Settings) -> pathlib.Path:
    return settings.data_dir / "up.json"


def read_state(settings: Settings) -> dict | None:
    try:
        return json.loads(state_path(settings).read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def write_state(settings: Settings, state: dict) -> None:
    path = state_path(settings)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, path)


async def _healthy(settings: Settings, nats_url: str, names: list[str]) -> set[str]:
    ok: set[str] = set()
    nc = await authority.connect(settings, OPERATOR, nats_url, allow_reconnect=False)
    try:
        for name in names:
            try:
                reply = await nc.request(settings.subject(f"{HEALTH}.{name}"), b"{}", timeout=0.5)
                if json.loads(reply.data).get("data", {}).get("ok"):
                    ok.add(name)
            except Exception:  # not ready yet
                pass
    finally:
        await nc.close()
    return ok


def up(settings: Settings, log, services: tuple[str, ...] = SERVICES) -> dict:
    existing = read_state(settings)
    if existing and any(_alive(p) for p in existing.get("services", {}).values()):
        raise RuntimeError(f"already up (see {state_path(settings)}); run `ito-training down` first")
    logs = settings.data_dir / "logs"
    nats, redis = authority.start_infra(settings, logs)
    for started in (nats, redis):
        log(f"{started.name}: {started.url} (started with authentication, pid {started.pid})")
    entitlement_key(settings)  # created once, before any service reads it
    env = dict(
        os.environ,
        **{
            ENV_NATS_URL: nats.url,
            ENV_REDIS_URL: redis.url,
            ENV_NAMESPACE: settings.namespace,
            ENV_DATA_DIR: str(settings.data_dir),
            ENV_SECRETS_DIR: str(settings.secrets_dir),
        },
    )
    state = {
        "nats_url": nats.url,
        "redis_url": redis.url,
        "namespace": settings.namespace,
        "secrets_dir": str(settings.secrets_dir),
        "logs": str(logs),
        "infra": {s.name: s.pid for s in (nats, redis) if s.pid},
        "services": {},
    }
    for name in services:
        out = open(logs / f"{name}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.ops.main", "serve", name],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        state["services"][name] = proc.pid
    write_state(settings, state)
    deadline = time.monotonic() + SERVICES_READY_TIMEOUT_S
    ready: set[str] = set()
    while time.monotonic() < deadline:
        ready = asyncio.run(_healthy(settings, nats.url, [n for n in services if n not in ready])) | ready
        if ready == set(services):
            log(f"services ready: {', '.join(services)} (logs in {logs})")
            return state
        dead = [n for n, pid in state["services"].items() if not _alive(pid) or _reaped(pid)]
        if dead:
            down(settings, log)
            raise RuntimeError(f"service(s) {', '.join(dead)} exited at start; see {logs}")
        time.sleep(0.3)
    down(settings, log)
    raise RuntimeError(
        f"services not ready within {SERVICES_READY_TIMEOUT_S:.0f}s: {sorted(set(services) - ready)}"
    )


def _reaped(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == pid
    except ChildProcessError:
        return False


def down(settings: Settings, log) -> dict:
    state = read_state(settings)
    if state is None:
        log("nothing to stop")
        return {"stopped": []}
    stopped = []
    for name, pid in state.get("services", {}).items():
        infra.stop_pid(pid)
        stopped.append(name)
    for name, pid in state.get("infra", {}).items():
        infra.stop_pid(pid)
        stopped.append(name)
    state_path(settings).unlink(missing_ok=True)
    log(f"stopped: {', '.join(stopped) or 'nothing'}")
    return {"stopped": stopped}


def wait_for_signal() -> None:
    received = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, f: received.append(s))
    while not received:
        time.sleep(0.2)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/")[0])


def restart_infra(settings: Settings, name: str) -> infra.Started:
    """Start `name` ("nats" or "redis") again on its port from its config (after a crash, say)."""
    state = read_state(settings)
    if state is None:
        raise RuntimeError("not up")
    logs = pathlib.Path(state["logs"])
    if name == "nats":
        started = authority.start_nats(settings, logs, state["redis_url"], port=_port(state["nats_url"]))
    else:
        started = authority.start_redis(settings, logs, port=_port(state["redis_url"]))
    state["infra"][name] = started.pid
    write_state(settings, state)
    return started


def apply_tenants(settings: Settings) -> bool:
    """After an account change: the running nats-server accepts exactly the active credentials.
    False when nothing is up here (the next `up` writes the config from the registry anyway)."""
    state = read_state(settings)
    if state is None or "nats" not in state.get("infra", {}) or not _alive(state["infra"]["nats"]):
        return False
    tenants = asyncio.run(authority.active_tenants(settings, state["redis_url"]))
    authority.apply_tenants(
        settings,
        state["infra"]["nats"],
        _port(state["nats_url"]),
        tenants,
        pathlib.Path(state["logs"]) / "nats.log",
    )
    return True


def reload_redis_acl(settings: Settings, admin_password: str) -> None:
    """Rewrite the ACL file from the current passwords and make the running Redis load it, as the
    admin user it knows now (ACL LOAD drops every client: restart a service whose password was
    rotated, since a client keeps its password in memory)."""
    import redis

    state = read_state(settings)
    authority.write_redis_acl(settings)
    r = redis.Redis.from_url(state["redis_url"], username="admin", password=admin_password, socket_timeout=5)
    try:
        r.execute_command("ACL", "LOAD")
    finally:
        r.close()
