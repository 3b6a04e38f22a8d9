"""compose.yaml keeps the zero-trust shape: every service mounts its own credentials only, Redis is
not published, NATS publishes only its client port and runs from the generated auth config."""

import pathlib
import shutil
import subprocess

import pytest
import yaml

from runtime.security.identities import REDIS_SERVICES, SERVICE_IDENTITIES

COMPOSE_PATH = pathlib.Path(__file__).resolve().parents[2] / "compose.yaml"
COMPOSE = yaml.safe_load(COMPOSE_PATH.read_text())


def targets(service: str) -> set[str]:
    out = set()
    for s in COMPOSE["services"][service].get("secrets", []):
        out.add(s if isinstance(s, str) else s["target"])
    return out


def test_servers_run_with_their_auth_config_and_publish_only_the_client_port():
    nats, redis = COMPOSE["services"]["nats"], COMPOSE["services"]["redis"]
    assert nats["command"] == ["-c", "/run/secrets/nats_conf"] and nats["ports"] == ["4222:4222"]
    assert "ports" not in redis and "--aclfile" in redis["command"] and "always" in redis["command"]


def test_each_service_mounts_only_its_own_credentials():
    for name in SERVICE_IDENTITIES:
        mine = targets(name)
        assert f"nats/{name}.nk" in mine
        assert {t for t in mine if t.startswith("nats/")} == {f"nats/{name}.nk"}
        assert {t for t in mine if t.startswith("redis/")} == (
            {f"redis/{name}.pw"} if name in REDIS_SERVICES else set()
        )
        assert ("signing/scheduler.ed25519" in mine) == (name == "scheduler")
        assert COMPOSE["services"][name]["environment"]["ITO_SECRETS_DIR"] == "/run/secrets"


TLS_SERVER = {"tls/ca.pem", "tls/server.pem", "tls/server.key"}


def test_the_desk_mounts_its_read_only_identity_its_token_and_the_server_certificate_only():
    desk = COMPOSE["services"]["desk"]
    # no Redis, no signing key; the server certificate: it serves HTTPS itself (ITO_TLS); the
    # metrics token lets Prometheus scrape its /metrics too
    assert targets("desk") == {"nats/desk.nk", "tokens/desk.token", "tokens/metrics.token", *TLS_SERVER}
    assert desk["command"][:2] == ["desk", "serve"]
    assert desk["ports"] == ["127.0.0.1:8765:8765"]


def test_no_secret_value_is_inline():
    for name, spec in COMPOSE["secrets"].items():
        assert set(spec) == {"file"}, name


CLUSTER = {name: spec for name, spec in COMPOSE["services"].items() if "cluster" in spec.get("profiles", [])}


def test_the_cluster_profile_has_three_nats_nodes_six_redis_nodes_and_two_of_each_service():
    assert {f"nats-{i}" for i in (1, 2, 3)} | {f"redis-{i}" for i in range(1, 7)} <= set(CLUSTER)
    assert "redis-cluster-init" in CLUSTER
    for name in SERVICE_IDENTITIES:
        for i in (1, 2):
            spec = CLUSTER[f"{name}-{i}"]
            assert spec["command"] == ["serve", name] and spec["environment"]["ITO_INSTANCE"] == f"{name}-{i}"
            assert targets(f"{name}-{i}") == targets(name)  # its own credentials only, as the single one
            servers = spec["environment"]["ITO_NATS_URL"].split(",")
            assert servers == [f"nats://nats-{n}:4222" for n in (1, 2, 3)]
            assert spec["environment"]["ITO_NATS_REPLICAS"] == "3"


def test_the_cluster_publishes_one_client_port_and_no_route_redis_or_monitoring_port():
    published = {name: spec["ports"] for name, spec in CLUSTER.items() if "ports" in spec}
    assert published == {"nats-1": ["4223:4222"]}
    for i in (1, 2, 3):
        node = CLUSTER[f"nats-{i}"]
        assert node["command"] == ["-c", f"/run/secrets/nats_{i}_conf"]  # nkeys, permissions, route auth
        assert targets(f"nats-{i}") == {f"nats_{i}_conf", *TLS_SERVER}


def test_the_cluster_redis_nodes_run_with_acls_and_aof_always_and_take_passwords_from_files():
    for i in range(1, 7):
        script = CLUSTER[f"redis-{i}"]["command"][-1]
        assert "--aclfile /run/secrets/redis_acl" in script and "--appendfsync always" in script
        assert "--cluster-enabled yes" in script
        assert "$$(cat /run/secrets/redis_replication)" in script  # from its file, into a 0600 config
        assert "--masterauth" not in script  # never an argument
    init = CLUSTER["redis-cluster-init"]["command"][-1]
    assert "REDISCLI_AUTH=" in init and "$$(cat /run/secrets/redis_admin)" in init and " -a " not in init


# --- TLS (docs/tls.md) ---


def test_nats_mounts_the_server_certificate_and_every_stack_runs_with_tls_on():
    assert targets("nats") == {"nats_conf", *TLS_SERVER}  # nats.conf's `tls {}` points at /run/secrets/tls
    for name, spec in COMPOSE["services"].items():
        env = spec.get("environment")
        if isinstance(env, dict) and "ITO_NATS_URL" in env:
            assert env["ITO_TLS"] == "1", name


def test_every_service_verifies_nats_with_the_ca_and_holds_no_server_key():
    for name in SERVICE_IDENTITIES:
        for instance in (name, f"{name}-1", f"{name}-2"):
            mine = targets(instance)
            assert "tls/ca.pem" in mine, instance
            assert "tls/server.key" not in mine and "tls/ca.key" not in mine, instance


def test_no_ca_key_is_mounted_anywhere():
    for s in COMPOSE["secrets"].values():
        assert not s["file"].endswith("ca.key")


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_compose_config_is_valid():
    proc = subprocess.run(
        ["docker-compose", "-f", str(COMPOSE_PATH), "config", "-q"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
