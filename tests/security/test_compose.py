"""compose.yaml keeps the zero-trust shape: every service mounts its own credentials only, Redis is
not published, NATS publishes only its client port and runs from the generated auth config."""

import pathlib

import yaml

from services.runtime.identities import REDIS_SERVICES, SERVICE_IDENTITIES

COMPOSE = yaml.safe_load((pathlib.Path(__file__).resolve().parents[2] / "compose.yaml").read_text())


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


def test_no_secret_value_is_inline():
    for name, spec in COMPOSE["secrets"].items():
        assert set(spec) == {"file"}, name
