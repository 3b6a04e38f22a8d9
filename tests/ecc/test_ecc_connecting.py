"""The real `ecc` as a subprocess, without a stack: where it looks for the API and what its errors
say (the address it tried, where that came from, the one thing to set), `ecc ito validate`
(every problem at once, no server), and missing flags that say how to get their value.

Each run has its own HOME and ECC_CONFIG_DIR, and no ITO_NATS_URL unless the test sets one: nothing
here reads the machine's servers or the person's own files."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from contracts.connection import Connection
from devstack import infra
from ecc import connection
from runtime.security.secrets import new_nkey_seed

BIN = pathlib.Path(sys.executable).parent
REPO = pathlib.Path(__file__).resolve().parents[2]
DEAD = "nats://127.0.0.1:1"  # nothing listens on port 1
CLEARED = ("ITO_NATS_URL", "ITO_NAMESPACE", "ECC_CONFIG_DIR", "ECC_CONNECTION_FILE", "XDG_CONFIG_HOME")


def clean_env(home: pathlib.Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    return {**env, "HOME": str(home), "PYTHONPATH": str(REPO), **extra}


def ecc(env: dict[str, str], *args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "ecc"), "ito", *args], input=input, capture_output=True, text=True, env=env, timeout=60
    )


def login(env: dict[str, str]) -> tuple[int, dict]:
    proc = ecc(env, "login", "--account", "a", "--json", input="ito_sk_" + new_nkey_seed().decode() + "\n")
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture
def home(tmp_path) -> pathlib.Path:
    h = tmp_path / "home"
    h.mkdir(mode=0o700)
    return h


def default_file(home: pathlib.Path) -> pathlib.Path:
    return home / ".config" / "ecc" / "connection.json"


def test_a_dead_port_from_the_env_names_the_address_and_what_to_set(home):
    rc, out = login(clean_env(home, ITO_NATS_URL=DEAD))
    message = out["error"]["message"]
    assert rc == 1 and out["error"]["code"] == "backend_unavailable"
    assert f"cannot reach the ito-training API at {DEAD} (from ITO_NATS_URL)" in message
    assert "Set ITO_NATS_URL to the API's address" in message
    assert not (home / ".config" / "ecc" / "credentials.json").exists()


def test_a_dead_stack_from_the_connection_file_names_the_file_and_what_to_do(home):
    file = connection.save(Connection(url=DEAD, namespace="tdead"), default_file(home))
    rc, out = login(clean_env(home))
    message = out["error"]["message"]
    assert rc == 1 and f"at {DEAD} (from the connection file {file})" in message
    assert "Start it with `make up`" in message and "ITO_NATS_URL" in message


def test_the_env_wins_over_the_connection_file(home):
    connection.save(Connection(url="nats://127.0.0.1:2", namespace="tfile"), default_file(home))
    _, out = login(clean_env(home, ITO_NATS_URL=DEAD))
    assert f"at {DEAD} (from ITO_NATS_URL)" in out["error"]["message"]


def test_ECC_CONNECTION_FILE_names_another_file(home, tmp_path):
    file = connection.save(Connection(url=DEAD), tmp_path / "elsewhere.json")
    _, out = login(clean_env(home, ECC_CONNECTION_FILE=str(file)))
    assert f"(from the connection file {file})" in out["error"]["message"]


def test_a_broken_connection_file_is_named_and_nothing_is_sent(home):
    file = default_file(home)
    file.parent.mkdir(parents=True)
    file.write_text("{not json")
    rc, out = login(clean_env(home))
    assert rc == 1 and out["error"]["code"] == "backend_unavailable"
    assert f"the connection file {file} is not valid" in out["error"]["message"]


def test_a_server_without_authentication_is_named_with_the_way_out(home, tmp_path):
    """A NATS that anyone may use (a throwaway one on loopback, stopped after) is never trusted;
    the error says which address that was and where it came from."""
    port = infra.free_port()
    config = tmp_path / "open.conf"
    config.write_text(f'listen: "127.0.0.1:{port}"\n')
    server = infra.start_nats(config, port, tmp_path / "open.log")
    try:
        url = f"nats://127.0.0.1:{port}"
        file = connection.save(Connection(url=url), default_file(home))
        _, out = login(clean_env(home))
    finally:
        infra.stop_pid(server.pid)
    message = out["error"]["message"]
    assert f"the server at {url} (from the connection file {file}) does not require authentication" in message
    assert "`make up`" in message


def test_with_nothing_set_the_default_says_there_is_no_connection_file(home, monkeypatch):
    """Without a network call (the default address is the machine's own NATS): what ecc resolves."""
    for name in CLEARED:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    resolved = connection.resolve()
    assert (resolved.url, resolved.source) == ("nats://127.0.0.1:4222", "the default")
    assert resolved.what_to_set().startswith(f"no connection file at {default_file(home)}: start the stack")


# --- ecc ito validate: no server, no login ---


@pytest.fixture
def manifests(tmp_path) -> pathlib.Path:
    d = tmp_path / "m"
    d.mkdir(mode=0o700)
    return d


def write(directory: pathlib.Path, name: str, text: str) -> pathlib.Path:
    path = directory / name
    path.write_text(text)
    path.chmod(0o600)
    return path


def validate(home: pathlib.Path, path: pathlib.Path) -> tuple[int, dict]:
    proc = ecc(clean_env(home, ITO_NATS_URL=DEAD), "validate", "--manifest", str(path), "--json")
    return proc.returncode, json.loads(proc.stdout.strip().splitlines()[-1])


TINY = json.loads((REPO / "examples" / "manifests" / "tiny.json").read_text())


def test_validate_reports_both_mistakes_with_path_line_and_column(home, manifests):
    doc = {k: v for k, v in TINY.items() if k != "target"} | {"epochs": 3}
    rc, out = validate(home, write(manifests, "two.json", json.dumps(doc, indent=2)))
    message = out["error"]["message"]
    assert rc == 1 and out["error"]["code"] == "manifest_invalid" and not out["live_api_contacted"]
    assert "invalid manifest, 2 problems:" in message
    assert "- $ (line 1, column 1): missing required field `target`" in message
    assert "- $.epochs (line " in message and "unknown field `epochs`; allowed: schema_version" in message


def test_validate_of_invalid_json_gives_line_and_column(home, manifests):
    rc, out = validate(home, write(manifests, "bad.json", '{\n  "name": "x",\n  "seed": 1,\n}\n'))
    assert rc == 1
    assert (
        out["error"]["message"]
        == "the manifest is not valid JSON: line 4, column 1: trailing comma in object"
    )


def test_validate_of_a_bad_size_lists_the_valid_sizes(home, manifests):
    doc = TINY | {"model": TINY["model"] | {"size": "13B"}}
    _, out = validate(home, write(manifests, "size.json", json.dumps(doc)))
    assert "$.model.size (line 1, column " in out["error"]["message"]
    assert "allowed: 150M, 1B, 70B, 8B, tiny, null" in out["error"]["message"]


def test_validate_of_a_good_manifest_is_ok_and_sends_nothing(home):
    rc, out = validate(home, REPO / "examples" / "manifests" / "tiny.json")
    assert rc == 0 and out["ok"] and not out["live_api_contacted"]
    assert out["data"]["valid"] and out["data"]["name"] == TINY["name"]


# --- missing flags say how to get the value ---


def test_a_missing_confirmation_ref_says_how_to_get_one(home):
    proc = ecc(clean_env(home), "train", "--booking", "b", "--manifest", "/m.json", "--idempotency-key", "k")
    assert proc.returncode == 2
    assert "the following arguments are required: --confirmation-ref" in proc.stderr
    assert (
        "--confirmation-ref: run `ecc ito confirm --action train --booking BOOKING --manifest PATH`"
        in proc.stderr
    )


def test_missing_flags_of_cancel_name_the_cancel_confirmation_and_the_key(home):
    proc = ecc(clean_env(home), "cancel", "run-1")
    assert "--confirmation-ref: run `ecc ito confirm --action cancel --run RUN`" in proc.stderr
    assert "--idempotency-key: a new unique string for this request" in proc.stderr


def test_the_clients_connection_and_manifest_modules_import_no_service():
    code = "import ecc.transport, ecc.connection, contracts.manifest_check, ecc.manifest_tools, ecc.verbs, ecc.main\n"
    out = subprocess.run(
        [sys.executable, "-c", code + "import sys; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert not [m for m in out.stdout.split() if m.split(".")[0] == "services"]


def test_the_ca_that_up_tls_wrote_into_the_connection_file_is_the_one_ecc_verifies_with(home, monkeypatch):
    """`up --tls` records its CA in the file (ops/main.py `_write_connection`); with no
    ITO_NATS_CA and no CA stored at login, the client verifies the server with that one."""
    from ecc.transport import Client

    for name in (*CLEARED, "ITO_NATS_CA"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    connection.save(Connection(url=DEAD, namespace="ttls", ca="/srv/ito/ca.pem"), default_file(home))
    client = Client(credential=("a", "k"))
    assert (client.url, client.namespace, client.ca) == (DEAD, "ttls", "/srv/ito/ca.pem")
    monkeypatch.setenv("ITO_NATS_CA", "/elsewhere/ca.pem")
    assert Client(credential=("a", "k")).ca == "/elsewhere/ca.pem"


def test_a_refused_address_is_answered_at_once_not_at_the_deadline(home):
    """Nothing listens: that is the answer, whatever `--timeout` allows (nats-py retried a refused
    address every 2 s until ecc's overall deadline, so a dead port took the whole --timeout)."""
    env = clean_env(home, ITO_NATS_URL=DEAD)
    seed = "ito_sk_" + new_nkey_seed().decode() + "\n"
    proc = subprocess.run(
        [str(BIN / "ecc"), "ito", "login", "--account", "a", "--json", "--timeout", "600"],
        input=seed,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,  # far below the 600 s the old client waited out
    )
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 1 and out["error"]["code"] == "backend_unavailable", out
