"""`up` and `down`: our own authenticated infra plus all services as processes, with state in
`<data_dir>/up.json`. `up` never uses a server it did not start: the machine's NATS and Redis on
the standard ports have no authentication.

`up --cluster`: a 3-node NATS cluster (devstack/nats_cluster.py, every stream R3) and
CLUSTER_INSTANCES instances of every service (`scheduler-1`, `scheduler-2`, ...), each with the
whole server pool. The instances of a service share its requests (one queue group per service) and
its durable consumers (one message in flight per durable: runtime/messaging/service.py); `up`
returns once every instance has answered a health check itself.

Every service process (every instance) serves Prometheus' `/metrics` on a free loopback port of its
own (`ITO_METRICS_PORT`); up.json records them under `metrics` (`"scheduler": "127.0.0.1:PORT"`),
beside the bearer token's file (`metrics_token_file`), for a scrape config (README).
"""

import asyncio
import dataclasses
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
from devstack import authority, infra, nats_cluster
from runtime.configuration.settings import (
    EMBEDDED_FILE_ROOT,
    ENV_DATA_DIR,
    ENV_DESK_PORT,
    ENV_FILE_ROOT,
    ENV_INSTANCE,
    ENV_METRICS_HOST,
    ENV_METRICS_PORT,
    ENV_NAMESPACE,
    ENV_NATS_REPLICAS,
    ENV_NATS_URL,
    ENV_REDIS_CLUSTER,
    ENV_REDIS_URL,
    ENV_SECRETS_DIR,
    ENV_TLS,
    Settings,
    entitlement_key,
    nats_servers,
)
from runtime.messaging.bus import INSTANCE_HEADER
from runtime.security.identities import OPERATOR
from runtime.security.secrets import DESK_TOKEN, Secrets
from runtime.security.tls import Certs

SERVICES_READY_TIMEOUT_S = 90.0  # the trainer imports torch; a cold 2-core machine is slow
CLUSTER_INSTANCES = 2  # of every service under `up --cluster`: one may die, the other serves
HEALTH_ASKS_PER_NODE = 3  # per service and node: a queue group picks one instance per request
METRICS_HOST = "127.0.0.1"  # every /metrics of a stack on this machine: loopback only

Log = Callable[[str], None]
"""Where progress lines go: stdout for a person, stderr under --json."""


def state_path(settings: Settings) -> pathlib.Path:
    return settings.data_dir / "up.json"


def read_state(settings: Settings) -> dict[str, Any] | None:
    try:
        return json.loads(state_path(settings).read_text())
    except (OSError, ValueError):
        return None


def write_state(settings: Settings, state: dict[str, Any]) -> None:
    path = state_path(settings)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, path)


def service_of(name: str) -> str:
    """The service an instance runs: `scheduler-2` -> `scheduler` (service names have no '-')."""
    return name.split("-", 1)[0]


async def _healthy(settings: Settings, nats_url: str, names: list[str]) -> set[str]:
    """Which of `names` (services, or instances that name themselves in their answers) answered
    their service's health check. Asked through every server of the pool, several times on a
    cluster: a queue group hands each request to one instance, one on the asking node first."""
    ok: set[str] = set()
    servers = nats_servers(nats_url)
    asks = HEALTH_ASKS_PER_NODE if len(servers) > 1 else 1
    for url in servers:
        nc = await authority.connect(settings, OPERATOR, url, allow_reconnect=False)
        try:
            for service in sorted({service_of(n) for n in names}):
                for _ in range(asks):
                    try:
                        reply = await nc.request(settings.subject(f"{HEALTH}.{service}"), b"{}", timeout=0.5)
                    except Exception:  # not ready yet
                        break
                    if json.loads(reply.data).get("data", {}).get("ok"):
                        ok.add((reply.headers or {}).get(INSTANCE_HEADER, service))
        finally:
            await nc.close()
    return ok & set(names)


def up(
    settings: Settings,
    log: Log,
    services: tuple[str, ...] = SERVICES,
    cluster: bool = False,
    desk: bool = False,
    tls: bool = False,
) -> dict[str, Any]:
    """Infra of our own, then each service as a process (CLUSTER_INSTANCES of each on a cluster)
    and, with `desk`, the desk's web app; returns the recorded state once every one answers its
    health check (or stops everything and raises). With `tls` (or `settings.tls`): NATS requires
    TLS on its client (and route) listeners, the desk and every /metrics serve HTTPS, all with
    the certificates under `<secrets dir>/tls` (created when missing: runtime/security/tls.py)."""
    if tls:
        settings = dataclasses.replace(settings, tls=True)
    existing = read_state(settings)
    if existing and any(infra.alive(p) for p in existing.get("services", {}).values()):
        raise RuntimeError(f"already up (see {state_path(settings)}); run `ito-training down` first")
    logs = private_dirs(settings)
    began = time.monotonic()
    if settings.tls:
        authority.ensure_certs(settings)
    state = _start_cluster_infra(settings, logs) if cluster else _start_infra(settings, logs)
    if settings.tls:
        state["tls"] = True
        state["ca"] = str(Certs(settings.tls_dir).ca)  # what clients verify with (ecc ito login --ca)
    for name, pid in state["infra"].items():
        log(f"{name}: started with authentication, pid {pid}")
    log(f"NATS {state['nats_url']}; Redis {state['redis_url']}")
    entitlement_key(settings)  # created once, before any service reads it
    env = _service_env(settings, state["nats_url"], state["redis_url"])
    if ENV_FILE_ROOT not in os.environ:  # the embedded stack's `file:` root (off by default elsewhere)
        root = settings.data_dir / EMBEDDED_FILE_ROOT
        root.mkdir(mode=0o700, exist_ok=True)
        env[ENV_FILE_ROOT] = str(root)
    if settings.tls:
        env[ENV_TLS] = "1"
    if cluster:
        env[ENV_NATS_REPLICAS] = str(state["nats_replicas"])
        env[ENV_REDIS_CLUSTER] = "1"
        names = {f"{s}-{i + 1}": s for s in services for i in range(CLUSTER_INSTANCES)}
    else:
        names = {s: s for s in services}
    ports = metrics_ports(list(names))
    state["metrics"] = {name: f"{METRICS_HOST}:{port}" for name, port in ports.items()}
    state["metrics_token_file"] = str(authority.secrets(settings).metrics_token_path())
    state["services"] = {
        name: _spawn(name, service, {**env, ENV_METRICS_PORT: str(ports[name])}, logs)
        for name, service in names.items()
    }
    write_state(settings, state)
    _wait_ready(settings, log, state["nats_url"], state["services"], logs)
    if desk:
        try:
            state["desk"] = _start_desk(env, logs, Certs(settings.tls_dir).ca if settings.tls else None)
        except Exception:
            down(settings, log)
            raise
        # its /metrics takes the same scrape token: one more target for Prometheus
        state["metrics"]["desk"] = state["desk"]["url"].split("://", 1)[1].rstrip("/")
        write_state(settings, state)
        log(
            f"desk: {state['desk']['url']} (operator token in {Secrets(settings.secrets_dir).token_path(DESK_TOKEN)})"
        )
    state["ready_s"] = round(time.monotonic() - began, 2)
    write_state(settings, state)
    return state


def private_dirs(settings: Settings) -> pathlib.Path:
    """The data dir and its logs, the service user's alone (issue 39: 0755 and 0644 let a local user
    read every tenant's run ids, accounts and bookings in scheduler.log): 0700 directories, 0600
    files, and the same for everything `up` and the services it starts make afterwards (umask)."""
    os.umask(0o077)
    logs = settings.data_dir / "logs"
    for directory in (settings.data_dir, logs):
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(directory, 0o700)
    for old in logs.glob("*.log"):  # a log an earlier stack left keeps no wider mode
        os.chmod(old, 0o600)
    return logs


def _start_infra(settings: Settings, logs: pathlib.Path) -> dict[str, Any]:
    """One nats-server and one redis-server; the state `up` records of them."""
    nats, redis = authority.start_infra(settings, logs)
    return {
        "nats_url": nats.url,
        "redis_url": redis.url,
        "namespace": settings.namespace,
        "secrets_dir": str(settings.secrets_dir),
        "logs": str(logs),
        "infra": {s.name: s.pid for s in (nats, redis) if s.pid},
    }


def _redis_name(index: int) -> str:
    return f"redis-{index + 1}"


def _start_redis_cluster(settings: Settings, logs: pathlib.Path) -> dict[str, Any]:
    """The Redis Cluster (devstack/redis_cluster.py: 3 primaries, a replica each, the
    same ACL file on every node), as `up` records it (`Cluster.as_dict`: no secret in it)."""
    from devstack import redis_cluster

    aclfile = authority.write_redis_acl(settings)
    root = settings.data_dir / "redis-cluster"
    return redis_cluster.start_cluster(root, aclfile, settings.secrets_dir, logs).as_dict()


def _start_cluster_infra(settings: Settings, logs: pathlib.Path) -> dict[str, Any]:
    """The Redis Cluster, then the 3-node NATS cluster with every stream declared R3; the state
    `up` records of them (the NATS nodes' ports: to restart one, to reload their configs)."""
    logs.mkdir(parents=True, exist_ok=True)
    settings = dataclasses.replace(settings, redis_cluster=True)  # the registry is read through it
    redis = _start_redis_cluster(settings, logs)
    redis_pids = {_redis_name(i): int(n["pid"]) for i, n in enumerate(redis["nodes"])}
    try:
        nodes, started = nats_cluster.start(settings, logs, redis["url"])
        pool = nats_cluster.pool_url(nodes)
        replicated = dataclasses.replace(settings, nats_replicas=nats_cluster.CLUSTER_SIZE)
        try:
            asyncio.run(nats_cluster.declare_streams(replicated, pool))
        except Exception:
            infra.stop_pids([s.pid for s in started if s.pid is not None])
            raise
    except Exception:
        infra.stop_pids(list(redis_pids.values()))
        raise
    return {
        "cluster": True,
        "redis_cluster": True,
        "redis_nodes": redis,
        "nats_url": pool,
        "redis_url": redis["url"],
        "nats_replicas": replicated.nats_replicas,
        "nats_nodes": nats_cluster.nodes_to_state(nodes),
        "namespace": settings.namespace,
        "secrets_dir": str(settings.secrets_dir),
        "logs": str(logs),
        "infra": {**{s.name: s.pid for s in started if s.pid}, **redis_pids},
    }


def metrics_ports(names: list[str]) -> dict[str, int]:
    """A free loopback port for each process's `/metrics`, no two alike (a port the kernel hands
    out twice in a row would stop the second service at start)."""
    ports: dict[str, int] = {}
    for name in names:
        port = infra.free_port()
        while port in ports.values():
            port = infra.free_port()
        ports[name] = port
    return ports


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
            ENV_METRICS_HOST: METRICS_HOST,
        },
    )


def _spawn(name: str, service: str, env: dict[str, str], logs: pathlib.Path) -> int:
    """`ito-training serve <service>` in a session of its own, logging to `<logs>/<name>.log`;
    an instance (`name` is not the service's) knows its name (ITO_INSTANCE)."""
    out = open(logs / f"{name}.log", "ab")  # the child keeps it open; ours closes when `up` exits
    proc = subprocess.Popen(
        [sys.executable, "-m", "ops.main", "serve", service],
        env={**env, ENV_INSTANCE: name if name != service else ""},
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
        dead = [n for n, pid in pids.items() if not infra.alive(pid) or _reaped(pid)]
        if dead:
            down(settings, log)
            raise RuntimeError(f"service(s) {', '.join(dead)} exited at start; see {logs}")
        time.sleep(0.3)
    down(settings, log)
    raise RuntimeError(
        f"services not ready within {SERVICES_READY_TIMEOUT_S:.0f}s: {sorted(set(services) - ready)}"
    )


DESK_PORT = 8765  # the desk app's port when free (else any free one): `ITO_DESK_PORT` chooses another
DESK_READY_TIMEOUT_S = 30.0


def _start_desk(env: dict[str, str], logs: pathlib.Path, ca: pathlib.Path | None = None) -> dict[str, Any]:
    """`ito-training desk serve` as a process of its own, once its /healthz answers: its pid and URL
    (https, verified with `ca`, when the stack speaks TLS). The preferred port first; a desk that
    exits at start (another stack's desk took the port between the check and the bind) is started
    again on any free port, up to `DESK_ATTEMPTS` times."""
    preferred: int | None = int(env.get(ENV_DESK_PORT) or DESK_PORT)
    for _ in range(DESK_ATTEMPTS):
        try:
            return _desk_on(infra.free_port(preferred), env, logs, ca)
        except _ExitedAtStart:
            preferred = None  # any free port next time
    raise RuntimeError(f"the desk app exited at start; see {logs / 'desk.log'}")


DESK_ATTEMPTS = 3


class _ExitedAtStart(Exception):
    pass


def _desk_on(port: int, env: dict[str, str], logs: pathlib.Path, ca: pathlib.Path | None) -> dict[str, Any]:
    import urllib.request

    from runtime.security.tls import client_context

    context = client_context(ca) if ca is not None else None
    with open(logs / "desk.log", "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ops.main", "desk", "serve", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    url = f"{'https' if ca is not None else 'http'}://127.0.0.1:{port}"
    deadline = time.monotonic() + DESK_READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise _ExitedAtStart()
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1, context=context) as answer:
                if answer.status == 200:
                    return {"pid": proc.pid, "url": url + "/"}
        except OSError:  # not listening yet
            time.sleep(0.2)
    infra.stop_pid(proc.pid)
    raise RuntimeError(
        f"the desk app did not answer within {DESK_READY_TIMEOUT_S:.0f}s; see {logs / 'desk.log'}"
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
    if "desk" in state:  # it reads from the services: first to go
        infra.stop_pid(state["desk"]["pid"])
        services = {"desk": state["desk"]["pid"], **services}
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


def _as_recorded(settings: Settings, state: dict[str, Any]) -> Settings:
    """`settings` speaking to Redis and NATS as `up` started them: one server or a cluster, TLS
    or not (a config rewritten for a reload keeps its `tls {}`)."""
    return dataclasses.replace(
        settings, redis_cluster=bool(state.get("redis_cluster")), tls=settings.tls or bool(state.get("tls"))
    )


def restart_infra(settings: Settings, name: str) -> infra.Started:
    """Start `name` ("nats", "redis", or a cluster's "nats-2") again on its port from its config
    (after a crash, say)."""
    state = read_state(settings)
    if state is None:
        raise RuntimeError("not up")
    settings = _as_recorded(settings, state)
    logs = pathlib.Path(state["logs"])
    if "nats_nodes" in state and name.startswith("nats-"):
        nodes = nats_cluster.nodes_from_state(state["nats_nodes"])
        started = nats_cluster.start_node(settings, logs, state["redis_url"], nodes, name)
    elif "redis_nodes" in state and name.startswith("redis-"):
        started = _restart_redis_node(state, name)
    elif name == "nats":
        started = authority.start_nats(settings, logs, state["redis_url"], port=_port(state["nats_url"]))
    else:
        started = authority.start_redis(settings, logs, port=_port(state["redis_url"]))
    state["infra"][name] = started.pid
    write_state(settings, state)
    return started


def _restart_redis_node(state: dict[str, Any], name: str) -> infra.Started:
    """A Redis Cluster node again from its directory, on its port (a failed-over primary rejoins
    as a replica); the recorded cluster gets its new pid."""
    from devstack import redis_cluster

    cluster = redis_cluster.Cluster.from_dict(state["redis_nodes"])
    node = next(n for n in cluster.nodes if _redis_name(n.index) == name)
    state["redis_nodes"] = redis_cluster.restart_node(cluster, node).as_dict()
    return infra.Started(name, node.url, int(state["redis_nodes"]["nodes"][node.index]["pid"]))


def apply_tenants(settings: Settings) -> bool:
    """After an account change: the running nats-server accepts exactly the active credentials.
    False when nothing is up here (the next `up` writes the config from the registry anyway)."""
    state = read_state(settings)
    if state is not None:
        settings = _as_recorded(settings, state)
    if state is not None and "nats_nodes" in state:  # a cluster: every node's config, reloaded
        pids = state.get("infra", {})
        nodes = nats_cluster.nodes_from_state(state["nats_nodes"])
        if not any(n.name in pids and infra.alive(pids[n.name]) for n in nodes):
            return False
        tenants = asyncio.run(authority.active_tenants(settings, state["redis_url"]))
        nats_cluster.apply_tenants(settings, nodes, pids, tenants, pathlib.Path(state["logs"]))
        return True
    if state is None or "nats" not in state.get("infra", {}) or not infra.alive(state["infra"]["nats"]):
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
    aclfile = authority.write_redis_acl(settings)
    if "redis_nodes" in state:  # every node: its replication login and the ACL file
        from devstack import redis_cluster

        redis_cluster.apply_credentials(
            redis_cluster.Cluster.from_dict(state["redis_nodes"]), aclfile, admin_password
        )
        return
    r = redis.Redis.from_url(state["redis_url"], username="admin", password=admin_password, socket_timeout=5)
    try:
        r.execute_command("ACL", "LOAD")
    finally:
        r.close()
