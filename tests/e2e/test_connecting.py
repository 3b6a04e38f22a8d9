"""`make up`, then `ecc ito login`, with nothing set: `ito-training up` writes the client's
connection file where `ecc` looks by default (beside its stored login), `ecc` reads it, and the
export line `up` prints lets another shell (another HOME) find the same stack; `down` removes the
file. One stack (the scheduler alone: login asks `auth`), in a HOME of its own."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.conftest import new_namespace

pytestmark = pytest.mark.e2e
BIN = pathlib.Path(sys.executable).parent
REPO = pathlib.Path(__file__).resolve().parents[2]
CLEARED = ("ITO_NATS_URL", "ITO_REDIS_URL", "ITO_NAMESPACE", "ECC_CONFIG_DIR", "ECC_CONNECTION_FILE")


def run(env: dict[str, str], exe: str, *args: str, input: str | None = None, timeout: float = 60):
    return subprocess.run(
        [str(BIN / exe), *args],
        input=input,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=REPO,
    )


def last_json(proc: subprocess.CompletedProcess) -> dict:
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-3000:]
    return json.loads(lines[-1])


def test_up_then_login_finds_the_stack_with_nothing_set(tmp_path):
    home, other = tmp_path / "home", tmp_path / "other-home"
    home.mkdir(mode=0o700)
    other.mkdir(mode=0o700)
    base = {k: v for k, v in os.environ.items() if k not in CLEARED}
    base["PATH"] = f"{BIN}:{base['PATH']}"
    # The operator's shell: where the stack lives and under which namespace; ecc's never sees these.
    ops = {
        **base,
        "HOME": str(home),
        "ITO_DATA_DIR": str(tmp_path / "data"),
        "ITO_NAMESPACE": new_namespace(),
    }
    up = run(ops, "ito-training", "up", "--detach", "--json", "--services", "scheduler", timeout=180)
    assert up.returncode == 0, up.stderr[-3000:]
    try:
        started = json.loads(up.stdout.strip().splitlines()[-1])
        file = home / ".config" / "ecc" / "connection.json"
        assert started["connection_file"] == str(file)
        assert started["connection_export"] == f"export ECC_CONNECTION_FILE={file}"
        assert json.loads(file.read_text())["url"] == started["nats_url"]
        assert file.stat().st_mode & 0o077 == 0
        key = last_json(run(ops, "ito-training", "accounts", "create", "alice", "--json"))["api_key"]

        user = {**base, "HOME": str(home)}  # no ITO_NATS_URL, no ITO_NAMESPACE, no ECC_*
        login = run(user, "ecc", "ito", "login", "--account", "alice", "--json", input=key + "\n")
        assert login.returncode == 0 and last_json(login)["ok"], login.stdout + login.stderr
        auth = last_json(run(user, "ecc", "ito", "auth", "--json"))
        assert auth["ok"] and auth["data"]["account"] == "alice", auth

        # Another shell, another HOME: the one export line `up` printed.
        name, value = started["connection_export"].removeprefix("export ").split("=", 1)
        elsewhere = {**base, "HOME": str(other), name: value}
        login = run(elsewhere, "ecc", "ito", "login", "--account", "alice", "--json", input=key + "\n")
        assert login.returncode == 0 and last_json(login)["ok"], login.stdout + login.stderr
    finally:
        down = run(ops, "ito-training", "down", "--json", timeout=60)
    assert down.returncode == 0, down.stderr[-2000:]
    assert not file.exists()  # it named the stack that went down
