"""Shared fixtures: real NATS and Redis with authentication on (started here, never the
machine's unauthenticated ones on the standard ports), and full stacks of the services.

A stack is `ito-training up` in a data dir of its own: its own nats-server and redis-server with
generated credentials, under a namespace unique to the test run. `down` stops all of it.
"""

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import uuid

import pytest

from tests.support import THREADS

# Before torch is imported anywhere in this process or the processes tests start (stacks, torchrun,
# the bench): OpenMP and torch use this worker's share of the cores, not all of them. Set, not
# defaulted: xdist's workers inherit the controller's value, made for one process.
os.environ["OMP_NUM_THREADS"] = str(THREADS)

from devstack import infra, redis_cluster
from runtime.configuration import settings as settings_mod

REPO = pathlib.Path(__file__).resolve().parent.parent
BIN = pathlib.Path(sys.executable).parent


class Infra:
    """An authenticated NATS and Redis of our own for one namespace, started exactly as
    `ito-training up` starts them (devstack/authority.py): no test talks to a server without
    authentication. `settings` carries the URLs and the secrets dir; connect as any identity."""

    def __init__(self, settings, started) -> None:
        self.settings = settings
        self.started = started

    @property
    def nats_url(self) -> str:
        return self.settings.nats_url

    @property
    def redis_url(self) -> str:
        return self.settings.redis_url

    def redis(self, identity: str = "admin"):
        from runtime.messaging import connections

        return connections.make_redis(self.settings, identity)

    async def nats(self, identity: str = "operator", **options):
        from devstack.authority import connect

        return await connect(self.settings, identity, **options)

    def stop(self) -> None:
        for started in self.started:
            infra.stop_pid(started.pid)


def start_infra(directory: pathlib.Path, namespace: str, nats: bool = True) -> Infra:
    import dataclasses

    from devstack import authority

    s = settings_mod.load({"ITO_NAMESPACE": namespace, "ITO_DATA_DIR": str(directory)})
    if nats:
        nats_server, redis_server = authority.start_infra(s, directory / "logs")
        started = [nats_server, redis_server]
        s = dataclasses.replace(s, nats_url=nats_server.url, redis_url=redis_server.url)
    else:
        (directory / "logs").mkdir(parents=True, exist_ok=True)
        redis_server = authority.start_redis(s, directory / "logs")
        started = [redis_server]
        s = dataclasses.replace(s, redis_url=redis_server.url)
    return Infra(s, started)


@pytest.fixture
def own_infra(tmp_path, namespace):
    """NATS (JetStream, nkeys) and Redis (ACLs, AOF always) for this test's namespace."""
    i = start_infra(tmp_path / "infra", namespace)
    yield i
    i.stop()


@pytest.fixture
def own_redis(tmp_path, namespace):
    """Only Redis (ACLs, AOF always), for tests of stores and in-memory handlers."""
    i = start_infra(tmp_path / "infra", namespace, nats=False)
    yield i
    i.stop()


def new_namespace() -> str:
    return "t" + uuid.uuid4().hex[:10]


class Stack:
    """A running set of services and a way to drive them with the real CLIs."""

    def __init__(self, env: dict[str, str], data_dir: pathlib.Path) -> None:
        self.env = env
        self.data_dir = data_dir

    @property
    def settings(self):
        return settings_mod.load(self.env)

    def redis(self, identity: str = "admin"):
        """A synchronous Redis client as one identity (admin: the test's eyes, not a service's)."""
        import redis

        from runtime.security.secrets import Secrets

        return redis.Redis.from_url(
            self.env["ITO_REDIS_URL"],
            username=identity,
            password=Secrets(self.settings.secrets_dir).password(identity),
        )

    async def nats(self, identity: str = "operator", **options):
        from devstack.authority import connect

        return await connect(self.settings, identity, **options)

    async def tenant(self, account: str, api_key: str, **options):
        """A NATS connection as a tenant, exactly as `ecc` makes it (its NKey, its own inbox)."""
        import nats

        from ecc.transport import seed_of, tenant_inbox

        return await nats.connect(
            self.env["ITO_NATS_URL"],
            connect_timeout=2,
            nkeys_seed_str=seed_of(api_key).decode(),
            inbox_prefix=tenant_inbox(account),
            **options,
        )

    def api_subject(self, suffix: str, account: str) -> str:
        return f"{self.env['ITO_NAMESPACE']}.{suffix}.{account}"

    def restart_infra(self, name: str):
        """Start the stack's `nats` or `redis` again on its port (after the test killed it)."""
        from devstack import stack as ops_stack

        return ops_stack.restart_infra(self.settings, name)

    def run_dir(self, run_id: str) -> pathlib.Path:
        """A run's directory on the stack's disk (the test's eyes: a tenant's answers never say it)."""
        found = list((self.data_dir / "checkpoints").glob(f"*/{run_id}"))
        assert len(found) == 1, f"run {run_id} has {len(found)} directories under the stack's checkpoints"
        return found[0]

    def file_root(self, account: str) -> pathlib.Path:
        """Where `account`'s `file:` data refs may point on this (embedded) stack: `<data dir>/
        file-root/<account>` (ITO_FILE_ROOT, which `up` sets), made here as the operator would."""
        root = self.data_dir / "file-root" / account
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        return root

    def infra_pid(self, name: str) -> int:
        return json.loads((self.data_dir / "up.json").read_text())["infra"][name]

    def run(
        self, exe: str, *args: str, input: str | None = None, env: dict | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(BIN / exe), *args],
            input=input,
            capture_output=True,
            text=True,
            env={**self.env, **(env or {})},
            timeout=timeout,
            cwd=REPO,
        )

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


def start_stack(data_dir: pathlib.Path, services: str | None = None, env: dict | None = None) -> Stack:
    ns = new_namespace()
    full_env = {
        **os.environ,
        "ITO_NAMESPACE": ns,
        "ITO_DATA_DIR": str(data_dir),
        "ITO_SECRETS_DIR": str(data_dir / "secrets"),
        "ITO_TRAINER_THREADS": "1",
        "ECC_CONNECTION_FILE": str(data_dir / "connection.json"),  # `up` writes it: never into $HOME
        # `up`'s own default, said here so that an agent the test starts itself has it too
        "ITO_FILE_ROOT": str(data_dir / "file-root"),
        "PATH": f"{BIN}:{os.environ['PATH']}",
        **(env or {}),
    }
    for name in ("ITO_NATS_URL", "ITO_REDIS_URL"):  # `up` starts its own; never the machine's
        full_env.pop(name, None)
    s = Stack(full_env, data_dir)
    args = ["up", "--detach", "--json"] + (["--services", services] if services else [])
    up = s.run("ito-training", *args, timeout=180)
    assert up.returncode == 0, up.stderr[-3000:]
    started = json.loads(up.stdout.strip().splitlines()[-1])
    s.env["ITO_NATS_URL"], s.env["ITO_REDIS_URL"] = started["nats_url"], started["redis_url"]
    return s


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """All services, shared by the tests of a session (each test uses its own accounts)."""
    s = start_stack(tmp_path_factory.mktemp("stack"))
    try:
        yield s
    finally:
        s.run("ito-training", "down", timeout=60)


@pytest.fixture
def make_stack(tmp_path_factory):
    """Start a dedicated stack (a subset of services, extra env); stopped after the test."""
    started: list[Stack] = []

    def make(services: str | None = None, env: dict | None = None) -> Stack:
        s = start_stack(tmp_path_factory.mktemp("stack"), services, env)
        started.append(s)
        return s

    yield make
    for s in started:
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


# The suite runs side by side under pytest-xdist (`make test`: `-n 2 --dist loadgroup`): most e2e
# time is waiting on stacks, not CPU. The fault scenarios are timing-sensitive under load, so they
# share one group: one worker runs them one after another while the other takes the rest. A module
# whose tests share an expensive module-scoped fixture (a stack, the quick bench, a built model, a
# reference curve) is a group of its own, so that fixture is made once, not once per worker.
SERIAL_FILES = (
    "tests/e2e/test_multinode_faults.py",
    "tests/e2e/test_gang_faults.py",
    "tests/e2e/test_cluster_chaos.py",
    "tests/e2e/test_fault_tolerance.py",
    "tests/e2e/test_infra_faults.py",
    "tests/e2e/test_budget.py",  # the budget stop's margin is seconds: a slow stop under load would cross
)
"""The fault scenarios: their detection and recovery windows are timed, so they run one at a time.
The multi-process trainings (tests/distributed, the gang and multi-node e2e) compare curves and
states, not times; each file's tests stay together (their module fixtures), beside the others."""


def module_scoped(item) -> bool:
    """Does the test use a fixture made once per module?"""
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d.scope == "module" for chain in defs for d in chain)


def xdist_group(path: str, item) -> str | None:
    if path.startswith(SERIAL_FILES):
        return "serial"
    if module_scoped(item):
        return path
    return None


def grouped(item, group: str) -> None:
    """Put `item` in xdist group `group`. pytest-xdist 3.8 marks a group by appending `@group` to
    the item's `_nodeid`, which pytest 9 no longer reads (a node's id is `_id`): every group was
    silently ignored, the serial one included (tests/house/test_xdist_groups.py). The suffix is
    written here the way pytest 9 keeps it; the scheduler then sends the group to one worker."""
    item.add_marker(pytest.mark.xdist_group(group))
    try:
        from _pytest.nodeid import coerce_node_id  # pytest 9
    except ImportError:  # pytest 8: xdist's own suffix on `_nodeid` works
        return
    if not item.nodeid.endswith(f"@{group}"):
        item._id = coerce_node_id(f"{item.nodeid}@{group}")


def pytest_collection_modifyitems(config, items):
    loadgroup = getattr(config.option, "loadgroup", False)  # set on xdist's workers only
    for item in items:
        group = xdist_group(pathlib.Path(str(item.fspath)).relative_to(REPO).as_posix(), item)
        if group is None:
            continue
        if loadgroup:  # an xdist worker under --dist loadgroup
            grouped(item, group)
        else:
            item.add_marker(pytest.mark.xdist_group(group))


# A Redis Cluster of our own (3 primaries, a replica each; ACLs, AOF always), started once for the
# session by the first test that asks for it: the store contracts run on it as on a single server.
class ClusterInfra:
    """The cluster and the settings that name it (`redis_cluster` on): connect as any identity.
    `cluster` is replaced when a test restarts a node, so that the teardown stops the new process."""

    def __init__(self, settings: settings_mod.Settings, cluster: redis_cluster.Cluster) -> None:
        self.settings = settings
        self.cluster = cluster

    def redis(self, identity: str = "admin"):
        from runtime.messaging import connections

        return connections.make_redis(self.settings, identity)


@pytest.fixture(scope="session")
def cluster_infra(tmp_path_factory):
    from devstack import authority

    root = tmp_path_factory.mktemp("redis-cluster")
    s = settings_mod.load(
        {"ITO_NAMESPACE": new_namespace(), "ITO_DATA_DIR": str(root), "ITO_REDIS_CLUSTER": "1"}
    )
    aclfile = authority.write_redis_acl(s)  # as `up` writes it: the credentials, then the users
    cluster = redis_cluster.start_cluster(root / "redis-cluster", aclfile, s.secrets_dir, root / "logs")
    infra = ClusterInfra(dataclasses.replace(s, redis_url=cluster.url), cluster)
    yield infra
    redis_cluster.stop_cluster(infra.cluster)
