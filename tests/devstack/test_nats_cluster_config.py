"""The NATS cluster's configs (devstack/nats_cluster.py) as pure functions: each node's name,
ports, store and routes; the route secret in 0600 files only, never in a server's arguments."""

import json
import os
import pathlib
import subprocess

import pytest

from devstack import infra, nats_cluster
from runtime.configuration.settings import load, nats_servers
from runtime.security.identities import NATS_IDENTITIES

PORTS = [14222, 14223, 14224, 16222, 16223, 16224]
SECRET = "ab" * 32


def nodes(tmp_path: pathlib.Path) -> list[nats_cluster.Node]:
    return nats_cluster.local_nodes(tmp_path, PORTS)


def base(port: int) -> str:
    # what identities.nats_config writes, reduced to what node_config must keep
    users = [{"nkey": "UA", "permissions": {"publish": {"allow": ["x"]}}}]
    return json.dumps({"listen": f"127.0.0.1:{port}", "authorization": {"users": users, "timeout": 2}})


def test_three_nodes_each_with_its_own_name_ports_and_store(tmp_path):
    ns = nodes(tmp_path)
    assert [n.name for n in ns] == ["nats-1", "nats-2", "nats-3"]
    assert [(n.client_port, n.cluster_port) for n in ns] == [(14222, 16222), (14223, 16223), (14224, 16224)]
    assert len({n.store_dir for n in ns}) == 3
    assert nats_cluster.pool_url(ns) == "nats://127.0.0.1:14222,nats://127.0.0.1:14223,nats://127.0.0.1:14224"
    assert nats_servers(nats_cluster.pool_url(ns)) == [n.url for n in ns]


def test_ports_must_be_distinct(tmp_path):
    with pytest.raises(AssertionError):
        nats_cluster.local_nodes(tmp_path, [1, 2, 3, 4, 5, 5])


@pytest.mark.parametrize("index", [0, 1, 2])
def test_a_node_routes_to_the_other_two_with_the_route_credential(tmp_path, index):
    ns = nodes(tmp_path)
    me = ns[index]
    config = json.loads(nats_cluster.node_config(base(me.client_port), me, ns, SECRET))
    assert config["server_name"] == me.name
    assert config["jetstream"] == {"store_dir": me.store_dir}
    assert config["listen"] == f"127.0.0.1:{me.client_port}"  # the base's client listener, kept
    assert config["authorization"]["users"][0]["nkey"] == "UA"  # the same users and permissions
    cluster = config["cluster"]
    assert cluster["name"] == nats_cluster.CLUSTER_NAME
    assert cluster["listen"] == f"127.0.0.1:{me.cluster_port}"
    assert cluster["authorization"] == {"user": nats_cluster.ROUTE_USER, "password": SECRET, "timeout": 2}
    others = [n for n in ns if n.name != me.name]
    assert cluster["routes"] == [f"nats-route://route:{SECRET}@127.0.0.1:{n.cluster_port}" for n in others]


def test_containers_route_by_service_name_and_listen_on_every_interface():
    ns = nats_cluster.container_nodes()
    me = ns[0]
    config = json.loads(nats_cluster.node_config(base(4222), me, ns, SECRET))
    assert config["cluster"]["listen"] == "0.0.0.0:6222"
    assert config["cluster"]["routes"] == [
        f"nats-route://route:{SECRET}@nats-2:6222",
        f"nats-route://route:{SECRET}@nats-3:6222",
    ]
    assert nats_cluster.pool_url(ns) == "nats://nats-1:4222,nats://nats-2:4222,nats://nats-3:4222"


def test_configs_and_the_route_secret_are_0600_and_share_one_secret(tmp_path):
    s = load({"ITO_DATA_DIR": str(tmp_path), "ITO_NAMESPACE": "tcfg"})
    ns = nodes(tmp_path)
    paths = nats_cluster.write_configs(s, ns, tenants=[("acme", "UTENANT")])
    secret = nats_cluster.route_secret(s)
    assert len(secret) == 64 and secret == nats_cluster.route_secret(s)  # generated once
    for path in [*paths, s.secrets_dir / nats_cluster.ROUTE_SECRET]:
        assert os.stat(path).st_mode & 0o777 == 0o600, path
    configs = [json.loads(p.read_text()) for p in paths]
    assert {c["cluster"]["authorization"]["password"] for c in configs} == {secret}
    # every identity and the tenant on every node: the cluster has the single server's authorization
    for c in configs:
        assert len(c["authorization"]["users"]) == len(NATS_IDENTITIES) + 1


def test_a_node_starts_with_its_config_path_only_in_its_arguments(tmp_path, monkeypatch):
    seen: list[list[str]] = []

    class Proc:
        pid = 4242

        def __init__(self, argv, **kwargs):
            seen.append(argv)

        def poll(self):
            return None

    monkeypatch.setattr(subprocess, "Popen", Proc)
    monkeypatch.setattr(infra, "nats_answers", lambda url, timeout: True)
    config = tmp_path / "nats-1.conf"
    started = infra.start_nats(config, 14222, tmp_path / "nats-1.log")
    assert started.url == "nats://127.0.0.1:14222"
    assert seen == [[infra.nats_binary(), "-c", str(config)]]  # no secret, no route URL
