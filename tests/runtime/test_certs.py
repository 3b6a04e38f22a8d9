"""`ito-training certs`: the deployment's CA and certificates (runtime/security/tls.py), and the
nats-server configs that require TLS with them (single server, cluster nodes, compose)."""

import json
import pathlib
import subprocess
import sys

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from runtime.configuration import settings as settings_mod
from runtime.security.tls import Certs, names_in, server_names

REPO = pathlib.Path(__file__).resolve().parents[2]
FILES = (
    "ca.pem",
    "ca.key",
    "server.pem",
    "server.key",
    "client.pem",
    "client.key",
    "metrics.pem",
    "metrics.key",
)
COMPOSE_NAMES = ("nats", "nats-1", "nats-2", "nats-3", "desk", "scheduler", "scheduler-2")


def certs_command(data_dir: pathlib.Path, *args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "ops.main", "certs", *args, "--json"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "ITO_DATA_DIR": str(data_dir)},
        cwd=REPO,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def load(path: pathlib.Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


@pytest.fixture(scope="module")
def issued(tmp_path_factory) -> tuple[pathlib.Path, dict]:
    data_dir = tmp_path_factory.mktemp("certs")
    return data_dir, certs_command(data_dir, "--san", "ito.example.com", "--san", "203.0.113.7")


def test_certs_writes_the_ca_and_certificates_each_0600_in_a_0700_dir(issued):
    data_dir, out = issued
    tls_dir = data_dir / "secrets" / "tls"
    assert out["tls_dir"] == str(tls_dir) and out["ca"] == str(tls_dir / "ca.pem")
    assert sorted(pathlib.Path(p).name for p in out["written"]) == sorted(FILES)
    assert tls_dir.stat().st_mode & 0o777 == 0o700
    for name in FILES:
        assert (tls_dir / name).stat().st_mode & 0o777 == 0o600, name


def test_the_server_certificate_names_compose_loopback_and_the_given_hosts(issued):
    data_dir, out = issued
    names = names_in((data_dir / "secrets" / "tls" / "server.pem").read_bytes())
    assert {"localhost", "127.0.0.1", "::1", *COMPOSE_NAMES, "ito.example.com", "203.0.113.7"} <= set(names)
    assert out["server_names"] == names


def test_keys_are_p256_and_leaves_chain_to_the_ca_for_their_use(issued):
    data_dir, _ = issued
    tls_dir = data_dir / "secrets" / "tls"
    ca, server, client = (load(tls_dir / f) for f in ("ca.pem", "server.pem", "client.pem"))
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for cert in (ca, server, client):
        key = cert.public_key()
        assert isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1"
    for leaf, usages in (
        (server, {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}),  # routes dial with it
        (client, {ExtendedKeyUsageOID.CLIENT_AUTH}),
    ):
        leaf.verify_directly_issued_by(ca)
        assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        assert set(leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == usages
        days = (leaf.not_valid_after_utc - leaf.not_valid_before_utc).days
        assert 300 <= days <= 398, days  # rotate yearly; browsers refuse longer than 398 days


def test_certs_again_keeps_everything_and_rotate_keeps_the_ca_only(issued, tmp_path):
    data_dir, _ = issued
    tls_dir = data_dir / "secrets" / "tls"
    before = {f: (tls_dir / f).read_bytes() for f in FILES}
    assert certs_command(data_dir)["written"] == []
    assert {f: (tls_dir / f).read_bytes() for f in FILES} == before
    out = certs_command(data_dir, "--rotate", "--san", "ito.example.com")
    assert out["rotated"] and not out["reloaded"]  # nothing running here
    after = {f: (tls_dir / f).read_bytes() for f in FILES}
    assert after["ca.pem"] == before["ca.pem"] and after["ca.key"] == before["ca.key"]
    for f in ("server.pem", "server.key", "client.pem", "client.key", "metrics.pem", "metrics.key"):
        assert after[f] != before[f], f
        assert (tls_dir / f).stat().st_mode & 0o777 == 0o600
    load(tls_dir / "server.pem").verify_directly_issued_by(load(tls_dir / "ca.pem"))
    assert "ito.example.com" in names_in(after["server.pem"])


def test_rotate_without_a_ca_is_refused(tmp_path):
    from runtime.security.tls import CertError

    with pytest.raises(CertError, match="run `ito-training certs` first"):
        Certs(tmp_path / "tls").rotate()


def test_server_names_start_with_loopback_and_drop_duplicates():
    names = server_names(["desk", " extra.example ", ""])
    assert names[:3] == ["localhost", "127.0.0.1", "::1"]
    assert names.count("desk") == 1 and names[-1] == "extra.example"


# --- nats-server configs with TLS ---


def test_containers_get_certificates_and_configs_that_require_tls_on_clients_and_routes(tmp_path):
    from devstack import nats_cluster
    from runtime.security.tls import CONTAINER_DIR

    s = settings_mod.load({"ITO_DATA_DIR": str(tmp_path), "ITO_NAMESPACE": "tc"})
    written = {p.name for p in nats_cluster.write_for_containers(s, [])}
    assert set(FILES) <= written
    expected = {
        "cert_file": f"{CONTAINER_DIR}/server.pem",
        "key_file": f"{CONTAINER_DIR}/server.key",
        "ca_file": f"{CONTAINER_DIR}/ca.pem",
    }
    single = json.loads((s.secrets_dir / "nats.conf").read_text())
    assert expected.items() <= single["tls"].items()
    for i in (1, 2, 3):
        node = json.loads((s.secrets_dir / f"nats-{i}.conf").read_text())
        assert expected.items() <= node["tls"].items()
        assert expected.items() <= node["cluster"]["tls"].items() and node["cluster"]["tls"]["verify"] is True


def test_a_local_config_requires_tls_only_when_tls_is_on(tmp_path):
    import dataclasses

    from devstack import authority

    s = settings_mod.load({"ITO_DATA_DIR": str(tmp_path), "ITO_NAMESPACE": "tl"})
    plain = json.loads(authority.write_nats_config(s, 4999, []).read_text())
    assert "tls" not in plain  # loopback embedded mode stays plain
    on = json.loads(authority.write_nats_config(dataclasses.replace(s, tls=True), 4999, []).read_text())
    assert on["tls"]["cert_file"] == str(s.tls_dir / "server.pem")
    assert (s.tls_dir / "ca.pem").exists()  # created on the way
    assert settings_mod.load({"ITO_DATA_DIR": str(tmp_path), "ITO_TLS": "1"}).tls


def test_the_metrics_certificate_names_the_services_only_and_serves_only(issued):
    """A service container holds it for its HTTPS /metrics instead of the server key (compose.yaml):
    it names loopback and the services, never NATS or the desk, and is no client certificate."""
    data_dir, _ = issued
    tls_dir = data_dir / "secrets" / "tls"
    metrics = load(tls_dir / "metrics.pem")
    metrics.verify_directly_issued_by(load(tls_dir / "ca.pem"))
    names = set(names_in((tls_dir / "metrics.pem").read_bytes()))
    assert {"127.0.0.1", "localhost", "scheduler", "scheduler-2", "trainer-1"} <= names
    assert not names & {"nats", "nats-1", "desk", "ito.example.com"}
    assert set(metrics.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == {
        ExtendedKeyUsageOID.SERVER_AUTH
    }
