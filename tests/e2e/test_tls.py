"""TLS where traffic leaves the host (docs/tls.md): one stack started with `up --tls --desk`.

NATS refuses a plain-text client; `ecc` logs in with the CA it was given and later calls verify the
server with it; without the CA, or with another deployment's, `ecc` refuses to connect, names the
address and what to set, and stores nothing. The desk and `/metrics` serve HTTPS with the stack's
certificate; plain HTTP gets no page and no metric."""

import http.client
import json
import pathlib
import socket
import ssl
import urllib.request
import uuid

import pytest

from runtime.security.tls import Certs
from tests.conftest import Stack, new_namespace

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tls_stack(tmp_path_factory):
    import os

    from tests.conftest import BIN

    data_dir = tmp_path_factory.mktemp("tls-stack")
    env = {
        **os.environ,
        "ITO_NAMESPACE": new_namespace(),
        "ITO_DATA_DIR": str(data_dir),
        "ITO_SECRETS_DIR": str(data_dir / "secrets"),
        "ECC_CONNECTION_FILE": str(data_dir / "connection.json"),  # `up` writes it: never into $HOME
        "PATH": f"{BIN}:{os.environ['PATH']}",
    }
    for name in ("ITO_NATS_URL", "ITO_REDIS_URL", "ITO_TLS", "ITO_NATS_CA"):  # `up` starts its own
        env.pop(name, None)
    s = Stack(env, data_dir)
    up = s.run(
        "ito-training", "up", "--tls", "--desk", "--services", "scheduler", "--detach", "--json", timeout=180
    )
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        started = json.loads(up.stdout.strip().splitlines()[-1])
        s.env["ITO_NATS_URL"], s.env["ITO_REDIS_URL"] = started["nats_url"], started["redis_url"]
        s.started = started  # type: ignore[attr-defined]
        yield s
    finally:
        s.run("ito-training", "down", timeout=60)


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory) -> pathlib.Path:
    """Another deployment's CA: a certificate chain that is valid, but not this stack's."""
    certs = Certs(tmp_path_factory.mktemp("other") / "tls")
    certs.ensure()
    return certs.ca


def ca_of(stack: Stack) -> pathlib.Path:
    return pathlib.Path(stack.started["ca"])  # type: ignore[attr-defined]


def host_port(url: str) -> tuple[str, int]:
    host, port = url.split("://", 1)[1].rstrip("/").rsplit(":", 1)
    return host, int(port)


def test_up_tls_reports_the_ca_and_https_addresses(tls_stack):
    started = tls_stack.started
    assert started["tls"] is True and ca_of(tls_stack) == Certs(tls_stack.settings.tls_dir).ca
    assert started["desk_url"].startswith("https://")


def test_nats_refuses_a_plain_text_client(tls_stack):
    with socket.create_connection(host_port(tls_stack.env["ITO_NATS_URL"]), timeout=5) as sock:
        sock.settimeout(5)
        info = json.loads(sock.makefile("rb").readline().split(b" ", 1)[1])
        assert info["tls_required"] is True and info["auth_required"] is True
        sock.sendall(b'CONNECT {"verbose":false,"pedantic":false}\r\nPING\r\n')
        answer = b""
        try:
            while chunk := sock.recv(4096):
                answer += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    # the server waits for a TLS handshake: the plain CONNECT is not one, and it hangs up unanswered
    assert answer == b"", answer


def test_ecc_with_the_ca_logs_in_and_later_calls_verify_with_the_stored_ca(tls_stack):
    account = "acct-" + uuid.uuid4().hex[:8]
    key = tls_stack.ito("accounts", "create", account)["api_key"]
    env = {"ECC_CONFIG_DIR": str(tls_stack.data_dir / "ecc" / account)}
    rc, out = tls_stack.ecc(
        "login", "--account", account, "--ca", str(ca_of(tls_stack)), input=key + "\n", env=env
    )
    assert rc == 0 and out["ok"], out
    stored = json.loads((pathlib.Path(env["ECC_CONFIG_DIR"]) / "credentials.json").read_text())
    assert stored["ca"] == str(ca_of(tls_stack))
    rc, out = tls_stack.ecc("auth", env=env)  # no --ca, no ITO_NATS_CA: the login's CA
    assert rc == 0 and out["ok"] and out["data"]["account"] == account, out


@pytest.mark.parametrize("which", ["no CA", "another CA"])
def test_ecc_without_the_ca_or_with_another_refuses_and_says_what_to_set(tls_stack, other_ca, which):
    account = "acct-" + uuid.uuid4().hex[:8]
    key = tls_stack.ito("accounts", "create", account)["api_key"]
    config = tls_stack.data_dir / "ecc" / account
    env = {"ECC_CONFIG_DIR": str(config), **({"ITO_NATS_CA": str(other_ca)} if which == "another CA" else {})}
    rc, out = tls_stack.ecc("login", "--account", account, input=key + "\n", env=env)
    assert rc != 0 and not out["ok"] and out["error"]["code"] == "tls_untrusted", out
    message = out["error"]["message"]
    assert tls_stack.env["ITO_NATS_URL"] in message  # the address
    assert "ITO_NATS_CA" in message and "--ca" in message  # what to set
    assert (str(other_ca) in message) == (which == "another CA")
    assert key not in message and not (config / "credentials.json").exists()  # nothing stored


def https_get(url: str, ca: pathlib.Path, headers: dict | None = None) -> tuple[int, str]:
    context = ssl.create_default_context(cafile=str(ca))
    request = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(request, timeout=5, context=context) as answer:
        return answer.status, answer.read().decode()


def plain_http_fails(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            answer.read()
    except (OSError, http.client.HTTPException):
        return True
    return False


def test_the_desk_serves_https_with_the_stacks_certificate_and_no_plain_http(tls_stack, other_ca):
    url = tls_stack.started["desk_url"].rstrip("/")
    assert https_get(url + "/healthz", ca_of(tls_stack))[0] == 200
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        https_get(url + "/healthz", other_ca)
    assert plain_http_fails(url.replace("https://", "http://") + "/healthz")


def test_metrics_serve_https_behind_the_token_and_no_plain_http(tls_stack):
    address = tls_stack.started["metrics"]["scheduler"]
    token = pathlib.Path(tls_stack.started["metrics_token_file"]).read_text().strip()
    status, text = https_get(
        f"https://{address}/metrics", ca_of(tls_stack), {"Authorization": f"Bearer {token}"}
    )
    assert status == 200 and "ito_" in text
    assert plain_http_fails(f"http://{address}/metrics")


def nats_presented_cert(url: str, ca: pathlib.Path) -> bytes:
    """The DER certificate the NATS server shows a client that upgrades after its INFO line."""
    host, port = host_port(url)
    with socket.create_connection((host, port), timeout=5) as raw:
        raw.settimeout(5)
        line = b""
        while not line.endswith(b"\r\n"):
            line += raw.recv(1)
        context = ssl.create_default_context(cafile=str(ca))
        with context.wrap_socket(raw, server_hostname=host) as tls:
            der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def test_rotate_keeps_the_ca_and_the_running_nats_presents_the_new_certificate(tls_stack):
    """Last in the module: it replaces the stack's server certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding

    url, ca = tls_stack.env["ITO_NATS_URL"], ca_of(tls_stack)
    before = nats_presented_cert(url, ca)
    out = tls_stack.ito("certs", "--rotate")
    assert out["rotated"] and out["reloaded"], out
    new = x509.load_pem_x509_certificate(Certs(tls_stack.settings.tls_dir).server_cert.read_bytes())
    after = nats_presented_cert(url, ca)  # verified with the same ca.pem: clients need nothing new
    assert after != before and after == new.public_bytes(Encoding.DER)


def test_ecc_with_a_ca_refuses_a_server_that_speaks_no_tls(own_infra, other_ca, monkeypatch):
    """A CA is set, the server answers in plain text (a downgrade, or the wrong address): refused
    before any request, though the server knows the credential."""
    import asyncio

    from contracts.api import AuthRequest
    from contracts.endpoints import API
    from ecc.transport import KEY_PREFIX, Client
    from runtime.security.secrets import Secrets

    monkeypatch.setenv("ITO_NATS_URL", own_infra.nats_url)
    monkeypatch.setenv("ITO_NAMESPACE", own_infra.settings.namespace)
    monkeypatch.setenv("ECC_CONFIG_DIR", str(pathlib.Path(str(other_ca)).parent / "ecc"))
    seed = (
        Secrets(own_infra.settings.secrets_dir).seed("operator").decode()
    )  # a credential the server accepts

    async def call():
        async with Client(
            2.0, 5.0, credential=("acct", KEY_PREFIX + seed), fresh=True, ca=str(other_ca)
        ) as c:
            return await c.call(API["auth"], AuthRequest())

    answer = asyncio.run(call())
    assert not answer.ok and answer.error.code == "tls_untrusted", answer
    assert "does not speak TLS" in answer.error.message and own_infra.nats_url in answer.error.message
