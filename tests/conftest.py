"""Shared fixtures: real NATS and Redis (the machine's, or embedded ones started here), and a
full stack of the five services under a namespace unique to this test run.

Everything a run creates carries its namespace: streams `<NS>_*`, subjects `<ns>.*`, Redis keys
`<ns>:*`. They are removed at the end, so runs on a shared server never see each other.
"""

import asyncio
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import uuid

import pytest

from services.runtime import infra, namespaces
from services.runtime.settings import DEFAULT_NATS_URL, DEFAULT_REDIS_URL

REPO = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent


@pytest.fixture(scope="session")
def infra_urls():
    """(nats_url, redis_url): the standard ports when they answer, else embedded servers."""
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="ito-infra-"))
    nats_url = os.environ.get("ITO_NATS_URL") or DEFAULT_NATS_URL
    redis_url = os.environ.get("ITO_REDIS_URL") or DEFAULT_REDIS_URL
    nats, redis = infra.ensure(nats_url, redis_url, tmp, tmp / "logs")
    yield nats.url, redis.url
    for started in (nats, redis):
        if started.pid:
            infra.stop_pid(started.pid)
    shutil.rmtree(tmp, ignore_errors=True)


def new_namespace() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def purge():
    return lambda nats_url, redis_url, ns: asyncio.run(namespaces.purge(nats_url, redis_url, ns))


class Stack:
    """A running set of services and a way to drive them with the real CLIs."""

    def __init__(self, env: dict[str, str], data_dir: pathlib.Path) -> None:
        self.env = env
        self.data_dir = data_dir

    def run(self, exe: str, *args: str, input: str | None = None, env: dict | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(BIN / exe), *args], input=input, capture_output=True, text=True,
                              env={**self.env, **(env or {})}, timeout=timeout, cwd=REPO)

    def ecc(self, *args: str, input: str | None = None, env: dict | None = None, timeout: float = 120):
        """(exit code, the JSON envelope) of `ecc ito ARGS --json`."""
        proc = self.run("ecc", "ito", *args, "--json", input=input, env=env, timeout=timeout)
        lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
        assert lines, f"ecc printed nothing; stderr: {proc.stderr[-2000:]}"
        return proc.returncode, json.loads(lines[-1])

    def ito(self, *args: str, timeout: float = 120) -> dict:
        proc = self.run("ito-training", *args, "--json", timeout=timeout)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def account(self, name: str | None = None) -> tuple[str, str, dict]:
        """A new account, logged in under its own ECC_CONFIG_DIR: (account, api key, env)."""
        name = name or "acct-" + uuid.uuid4().hex[:8]
        key = self.ito("accounts", "create", name)["api_key"]
        env = {"ECC_CONFIG_DIR": str(self.data_dir / "ecc" / name)}
        rc, out = self.ecc("login", "--account", name, input=key + "\n", env=env)
        assert rc == 0 and out["ok"], out
        return name, key, env

    def booking(self, account: str, booking: str | None = None, event: str = "completed", **opts) -> str:
        booking = booking or "bk-" + uuid.uuid4().hex[:8]
        args = ["simulate-booking", "--account", account, "--booking", booking, "--event", event]
        for k, v in opts.items():
            args += [f"--{k.replace('_', '-')}", str(v)]
        self.ito(*args)
        return booking


def start_stack(nats_url: str, redis_url: str, data_dir: pathlib.Path, services: str | None = None,
                env: dict | None = None) -> Stack:
    ns = new_namespace()
    full_env = {**os.environ, "ITO_NATS_URL": nats_url, "ITO_REDIS_URL": redis_url, "ITO_NAMESPACE": ns,
                "ITO_DATA_DIR": str(data_dir), "ITO_TRAINER_THREADS": "1", "PATH": f"{BIN}:{os.environ['PATH']}",
                **(env or {})}
    s = Stack(full_env, data_dir)
    args = ["up", "--detach", "--json"] + (["--services", services] if services else [])
    up = s.run("ito-training", *args, timeout=180)
    assert up.returncode == 0, up.stderr[-3000:]
    return s


@pytest.fixture(scope="session")
def stack(infra_urls, purge, tmp_path_factory):
    """All five services, shared by the tests of a session (each test uses its own accounts)."""
    s = start_stack(*infra_urls, tmp_path_factory.mktemp("stack"))
    try:
        yield s
    finally:
        s.run("ito-training", "down", timeout=60)
        purge(*infra_urls, s.env["ITO_NAMESPACE"])


@pytest.fixture
def make_stack(infra_urls, purge, tmp_path_factory):
    """Start a dedicated stack (a subset of services, extra env); stopped and purged after the test."""
    started: list[Stack] = []

    def make(services: str | None = None, env: dict | None = None) -> Stack:
        s = start_stack(*infra_urls, tmp_path_factory.mktemp("stack"), services, env)
        started.append(s)
        return s

    yield make
    for s in started:
        s.run("ito-training", "down", timeout=60)
        purge(*infra_urls, s.env["ITO_NAMESPACE"])


@pytest.fixture
def make_stack_on(purge, tmp_path_factory):
    """Like make_stack, on NATS and Redis URLs the test chose (its own servers, say)."""
    started: list[tuple[Stack, str, str]] = []

    def make(nats_url: str, redis_url: str, services: str | None = None, env: dict | None = None) -> Stack:
        s = start_stack(nats_url, redis_url, tmp_path_factory.mktemp("stack"), services, env)
        started.append((s, nats_url, redis_url))
        return s

    yield make
    for s, nats_url, redis_url in started:
        s.run("ito-training", "down", timeout=60)


def write_manifest(directory: pathlib.Path, filename: str | None = None, **overrides) -> pathlib.Path:
    """A small valid manifest (tiny model, a few dozen steps) with overrides merged at top level."""
    base = json.loads((REPO / "examples" / "manifests" / "tiny.json").read_text())
    base["target"] = {"tokens": 30 * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003}
    base["checkpoint"] = {"interval_steps": 10, "keep_last": 2, "storage": "local"}
    for key, value in overrides.items():
        base[key] = value
    path = directory / (filename or f"manifest-{uuid.uuid4().hex[:8]}.json")
    path.write_text(json.dumps(base, indent=2))
    path.chmod(0o644)
    return path


@pytest.fixture
def manifest(tmp_path):
    return lambda **overrides: write_manifest(tmp_path, **overrides)


@pytest.fixture
def namespace():
    return new_namespace()


@pytest.fixture(scope="session")
def apurge():
    """`purge` for async fixtures, which already run inside an event loop."""
    return namespaces.purge
