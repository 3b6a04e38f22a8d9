"""`up` and `down`: infra plus all five services as processes, with state in `<data_dir>/up.json`."""

import asyncio
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from contracts.subjects import HEALTH, SERVICES
from services.runtime import infra
from services.runtime.settings import (
    ENV_DATA_DIR,
    ENV_NAMESPACE,
    ENV_NATS_URL,
    ENV_REDIS_URL,
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


async def _healthy(settings: Settings, nats_url: str, names: list[str]) -> set[str]:
    import nats

    ok: set[str] = set()
    nc = await nats.connect(nats_url, connect_timeout=2, allow_reconnect=False)
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
    nats, redis = infra.ensure(settings.nats_url, settings.redis_url, settings.data_dir, logs)
    for started in (nats, redis):
        how = f"started embedded, pid {started.pid}" if started.pid else "already running"
        log(f"{started.name}: {started.url} ({how})")
    entitlement_key(settings)  # created once, before any service reads it
    env = dict(os.environ, **{ENV_NATS_URL: nats.url, ENV_REDIS_URL: redis.url,
                              ENV_NAMESPACE: settings.namespace, ENV_DATA_DIR: str(settings.data_dir)})
    state = {"nats_url": nats.url, "redis_url": redis.url, "namespace": settings.namespace,
             "infra": {s.name: s.pid for s in (nats, redis) if s.pid}, "services": {}}
    for name in services:
        out = open(logs / f"{name}.log", "ab")
        proc = subprocess.Popen([sys.executable, "-m", "services.ops.main", "serve", name], env=env,
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        state["services"][name] = proc.pid
    state_path(settings).write_text(json.dumps(state, indent=2))
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
    raise RuntimeError(f"services not ready within {SERVICES_READY_TIMEOUT_S:.0f}s: {sorted(set(services) - ready)}")


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
