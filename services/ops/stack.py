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
from collections.abc import Callable
from typing import Any

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

Log = Callable[[str], None]
"""Where progress lines go: stdout for a person, stderr under --json."""


def state_path(settings: Settings) -> pathlib.Path:
    return settings.data_dir / "up.json"


def read_state(settings: Settings) -> dict[str, Any] | None:
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


def write_state(settings: Settings, state: dict[str, Any]) -> None:
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


def up(settings: Settings, log: Log, services: tuple[str, ...] = SERVICES) -> dict[str, Any]:
    """Infra of our own, then each service as a process; returns the recorded state once every
    service answers its health check (or stops everything and raises)."""
    existing = read_state(settings)
    if existing and any(_alive(p) for p in existing.get("services", {}).values()):
        raise RuntimeError(f"already up (see {state_path(settings)}); run `ito-training down` first")
    logs = settings.data_dir / "logs"
    nats, redis = authority.start_infra(settings, logs)
    for started in (nats, redis):
        log(f"{started.name}: {started.url} (started with authentication, pid {started.pid})")
    entitlement_key(settings)  # created once, before any service reads it
    env = _service_env(settings, nats.url, redis.url)
    pids = {name: _spawn(name, env, logs) for name in services}
    state: dict[str, Any] = {
        "nats_url": nats.url,
        "redis_url": redis.url,
        "namespace": settings.namespace,
        "secrets_dir": str(settings.secrets_dir),
        "logs": str(logs),
        "infra": {s.name: s.pid for s in (nats, redis) if s.pid},
        "services": pids,
    }
    write_state(settings, state)
    _wait_ready(settings, log, nats.url, pids, logs)
    return state


def _service_env(settings: Settings, nats_url: str, redis_url: str) -> dict[str, str]:
    """The environment every service starts with: where the infra is, its namespace and dirs."""
    return dict(
        os.environ,
        **{
            ENV_NATS_URL: nats_url,
            ENV_REDIS_URL: redis_url,
            ENV_NAMESPACE: settings.namespace,
            ENV_DATA_DIR: str(settings.data_dir),
            ENV_SECRETS_DIR: str(settings.secrets_dir),
        },
    )


def _spawn(name: str, env: dict[str, str], logs: pathlib.Path) -> int:
    """`ito-training serve <name>` in a session of its own, logging to `<logs>/<name>.log`."""
    out = open(logs / f"{name}.log", "ab")  # the child keeps it open; ours closes when `up` exits
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.ops.main", "serve", name],
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    return proc.pid


def _wait_ready(
    settings: Settings, log: Log, nats_url: str, pids: dict[str, int], logs: pathlib.Path
) -> None:
    """Until every service answers its health check; a service that exits, or the deadline, stops
    everything and raises."""
    services = list(pids)
    deadline = time.monotonic() + SERVICES_READY_TIMEOUT_S
    ready: set[str] = set()
    while time.monotonic() < deadline:
        ready = asyncio.run(_healthy(settings, nats_url, [n for n in services if n not in ready])) | ready
        if ready == set(services):
            log(f"services ready: {', '.join(services)} (logs in {logs})")
            return
        dead = [n for n, pid in pids.items() if not _alive(pid) or _reaped(pid)]
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


def down(settings: Settings, log: Log) -> dict[str, list[str]]:
    state = read_state(settings)
    if state is None:
        log("nothing to stop")
        return {"stopped": []}
    # The services together (each finishes its in-flight work on SIGTERM), then NATS and Redis
    # together, once nothing is left to talk to them.
    services, servers = state.get("services", {}), state.get("infra", {})
    infra.stop_pids(list(services.values()))
    infra.stop_pids(list(servers.values()))
    stopped = [*services, *servers]
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
    if state is None:
        raise RuntimeError("not up")
    authority.write_redis_acl(settings)
    r = redis.Redis.from_url(state["redis_url"], username="admin", password=admin_password, socket_timeout=5)
    try:
        r.execute_command("ACL", "LOAD")
    finally:
        r.close()
