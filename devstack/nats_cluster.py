"""A 3-node NATS cluster for `ito-training up --cluster`: the nodes' configs, start, reload.

Each node is the single server's config (runtime/security/identities.py: the same nkeys and
per-identity permissions, written by `nats_config`) plus its own `server_name`, JetStream
`store_dir`, client port and cluster port, and a `cluster` block: routes to the other nodes on
loopback, authenticated with one generated route secret. The secret lives in a 0600 file
(`<secrets dir>/nats-route.pw`) and in the nodes' configs (0600 too, beside the other secrets);
never in an argument, an environment variable or a log line (nats-server redacts route URLs).

Clients get every node's URL (`pool_url`, comma-separated in ITO_NATS_URL): nats-py picks one at
random, fails over to another when it dies, and learns the cluster's other URLs from the server.
Streams are declared with `num_replicas = CLUSTER_SIZE` (runtime/messaging/streams.py), so any one
node may die with nothing lost. Configs are pure functions of the nodes (tested as tables);
`start` and `apply_tenants` do the I/O.
"""

import asyncio
import dataclasses
import json
import os
import pathlib
import secrets as _random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from devstack import authority, infra
from runtime.configuration.settings import Settings
from runtime.messaging import streams
from runtime.security import tls
from runtime.security.identities import NATS_IDENTITIES, OPERATOR, nats_config
from runtime.security.secrets import read_private, write_once

CLUSTER_SIZE = 3  # the smallest that survives one node's loss with a JetStream quorum (2 of 3)
CLUSTER_NAME = "ito"
ROUTE_USER = "route"
ROUTE_SECRET = "nats-route.pw"
CONTAINER_CLIENT_PORT = 4222
CONTAINER_CLUSTER_PORT = 6222
JETSTREAM_READY_TIMEOUT_S = 30.0  # a meta leader is elected in < 0.5 s here; a loaded CI is slower
START_ATTEMPTS = 3


@dataclass(frozen=True, slots=True)
class Node:
    """One nats-server of the cluster."""

    name: str
    """Its `server_name`, log file and key in `up`'s state (`nats-1`)."""
    client_port: int
    cluster_port: int
    store_dir: str
    listen_host: str = "127.0.0.1"
    """Where it listens for clients and routes (every interface in a container)."""
    route_host: str = "127.0.0.1"
    """How the other nodes and the clients reach it (its service name under compose)."""

    @property
    def url(self) -> str:
        return f"nats://{self.route_host}:{self.client_port}"


def local_nodes(data_dir: pathlib.Path, ports: list[int]) -> list[Node]:
    """CLUSTER_SIZE nodes on loopback: client ports first, then cluster ports, from `ports`."""
    assert len(ports) == 2 * CLUSTER_SIZE and len(set(ports)) == len(ports), f"need distinct ports: {ports}"
    return [
        Node(
            name=f"nats-{i + 1}",
            client_port=ports[i],
            cluster_port=ports[CLUSTER_SIZE + i],
            store_dir=str(data_dir / f"nats-{i + 1}"),
        )
        for i in range(CLUSTER_SIZE)
    ]


def container_nodes() -> list[Node]:
    """The compose profile's nodes: services `nats-1..3`, the standard ports, stores on /data."""
    return [
        Node(
            name=f"nats-{i + 1}",
            client_port=CONTAINER_CLIENT_PORT,
            cluster_port=CONTAINER_CLUSTER_PORT,
            store_dir="/data",
            listen_host="0.0.0.0",
            route_host=f"nats-{i + 1}",
        )
        for i in range(CLUSTER_SIZE)
    ]


def route_urls(nodes: list[Node], me: Node, secret: str) -> list[str]:
    """The routes `me` dials: every other node's cluster port, with the route credential."""
    return [
        f"nats-route://{ROUTE_USER}:{secret}@{n.route_host}:{n.cluster_port}"
        for n in nodes
        if n.name != me.name
    ]


def node_config(base: str, node: Node, nodes: list[Node], secret: str) -> str:
    """`base` (the single server's config for this node's listen address, as `nats_config`
    writes it) made a cluster member: its name, its store, and authenticated routes."""
    config = json.loads(base)
    config["server_name"] = node.name
    config["jetstream"] = {"store_dir": node.store_dir}
    config["cluster"] = {
        "name": CLUSTER_NAME,
        "listen": f"{node.listen_host}:{node.cluster_port}",
        # a route without this user and secret is refused; clients' users are not valid here
        "authorization": {"user": ROUTE_USER, "password": secret, "timeout": 2},
        "routes": route_urls(nodes, node, secret),
    }
    if "tls" in config:  # clients speak TLS: so do the routes, both ends showing the CA's certificate
        config["cluster"]["tls"] = {**config["tls"], "verify": True}
    return json.dumps(config, indent=1) + "\n"


def pool_url(nodes: list[Node]) -> str:
    """ITO_NATS_URL for the clients: every node, comma-separated (settings.nats_servers)."""
    return ",".join(n.url for n in nodes)


def route_secret(s: Settings) -> str:
    """The routes' shared secret: generated once (0600, O_EXCL), read back afterwards."""
    path = s.secrets_dir / ROUTE_SECRET
    write_once(path, _random.token_hex(32).encode())  # hex: safe inside a route URL
    return read_private(path).decode()


def config_path(s: Settings, node: Node) -> pathlib.Path:
    return s.secrets_dir / f"{node.name}.conf"


def write_configs(
    s: Settings, nodes: list[Node], tenants: list[tuple[str, str]], tls_dir: str | None = None
) -> list[pathlib.Path]:
    """Every node's config (0600: it holds the route secret), with the active tenants; with TLS
    (`tls_dir`, or `s.tls`: the secrets dir's certificates) on client and route listeners."""
    sec = authority.secrets(s)
    if tls_dir is None and s.tls:
        tls_dir = str(authority.ensure_certs(s).root)
    services = {i: sec.public_nkey(i) for i in NATS_IDENTITIES}
    secret = route_secret(s)
    paths = []
    for node in nodes:
        base = nats_config(
            s,
            port=node.client_port,
            store_dir=node.store_dir,
            host=node.listen_host,
            services=services,
            tenants=tenants,
            tls_dir=tls_dir,
        )
        path = config_path(s, node)
        authority.write_private(path, node_config(base, node, nodes, secret))
        paths.append(path)
    return paths


def _free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = infra.free_port()
        if port not in ports:
            ports.append(port)
    return ports


def start(
    s: Settings, log_dir: pathlib.Path, redis_url: str, nodes: list[Node] | None = None
) -> tuple[list[Node], list[infra.Started]]:
    """The cluster's nodes side by side, each answering on its client port: (nodes, started). On
    fresh free ports unless `nodes` is given (retried when another process took a port first)."""
    tenants = asyncio.run(authority.active_tenants(s, redis_url))
    for attempt in range(START_ATTEMPTS):
        chosen = nodes or local_nodes(s.data_dir, _free_ports(2 * CLUSTER_SIZE))
        for node in chosen:
            pathlib.Path(node.store_dir).mkdir(parents=True, exist_ok=True, mode=0o700)
        with authority.config_lock(s):
            configs = write_configs(s, chosen, tenants)
        with ThreadPoolExecutor(len(chosen)) as pool:
            futures = [
                pool.submit(infra.start_nats, config, node.client_port, log_dir / f"{node.name}.log")
                for node, config in zip(chosen, configs, strict=True)
            ]
            outcomes = [f.exception() or f.result() for f in futures]
        started = [
            dataclasses.replace(o, name=node.name)
            for node, o in zip(chosen, outcomes, strict=True)
            if isinstance(o, infra.Started)
        ]
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if not failed:
            return chosen, started
        infra.stop_pids([x.pid for x in started if x.pid is not None])
        if nodes is not None or attempt == START_ATTEMPTS - 1 or not isinstance(failed[0], infra.PortTaken):
            raise failed[0]
    raise AssertionError("unreachable")


def start_node(
    s: Settings, log_dir: pathlib.Path, redis_url: str, nodes: list[Node], name: str
) -> infra.Started:
    """One node again on its ports from a rewritten config (after it died): it rejoins the cluster
    and catches its streams up from the others."""
    tenants = asyncio.run(authority.active_tenants(s, redis_url))
    with authority.config_lock(s):
        configs = dict(zip((n.name for n in nodes), write_configs(s, nodes, tenants), strict=True))
    node = next(n for n in nodes if n.name == name)
    started = infra.start_nats(configs[name], node.client_port, log_dir / f"{name}.log")
    return dataclasses.replace(started, name=name)


async def declare_streams(s: Settings, url: str, timeout: float = JETSTREAM_READY_TIMEOUT_S) -> None:
    """The streams, replicated, once the cluster has a JetStream meta leader and its peers: until
    then the server answers with an error or not at all, so the declaration is retried (bounded)."""
    nc = await authority.connect(s, OPERATOR, url)
    deadline = time.monotonic() + timeout
    try:
        js = nc.jetstream(timeout=s.request_timeout_s)
        while True:
            try:
                await streams.declare(js, s)
                return
            except Exception:  # no meta leader yet, or too few peers for the replicas: retry
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.25)
    finally:
        await nc.close()


def apply_tenants(
    s: Settings,
    nodes: list[Node],
    pids: dict[str, int],
    tenants: list[tuple[str, str]],
    log_dir: pathlib.Path,
) -> None:
    """Every node's config rewritten with these tenants and reloaded (SIGHUP); returns once each
    running node says it reloaded (bounded). A node that is down reads the new config at start."""
    with authority.config_lock(s):
        running = {n.name: pids[n.name] for n in nodes if n.name in pids and infra.alive(pids[n.name])}
        logs = {name: log_dir / f"{name}.log" for name in running}
        before = {name: authority.reloads_logged(path) for name, path in logs.items()}
        write_configs(s, nodes, tenants)
        for pid in running.values():
            os.kill(pid, signal.SIGHUP)
        deadline = time.monotonic() + authority.RELOAD_TIMEOUT_S
        while any(authority.reloads_logged(logs[name]) <= before[name] for name in running):
            if time.monotonic() > deadline:
                raise RuntimeError("a nats-server did not confirm the config reload; see its log")
            time.sleep(0.05)


def nodes_from_state(entries: list[dict]) -> list[Node]:
    return [Node(**e) for e in entries]


def nodes_to_state(nodes: list[Node]) -> list[dict]:
    return [dataclasses.asdict(n) for n in nodes]


def write_for_containers(s: Settings, tenants: list[tuple[str, str]]) -> list[pathlib.Path]:
    """compose.yaml's secrets: the credentials, plus a nats.conf listening on every interface of the
    container with its store on the /data volume, the Redis ACL file, and the `cluster` profile's
    nats-1..3.conf (routes by service name). Traffic leaves the host
    there: the CA and certificates are created too (when missing), and every config requires TLS
    with them as compose mounts them (tls.CONTAINER_DIR)."""
    written = [
        *authority.ensure_certs(s).files(),
        authority.write_nats_config(
            s, 4222, tenants, host="0.0.0.0", store_dir="/data", tls_dir=tls.CONTAINER_DIR
        ),
        authority.write_redis_acl(s),
    ]
    written += write_configs(s, container_nodes(), tenants, tls_dir=tls.CONTAINER_DIR)
    return written
