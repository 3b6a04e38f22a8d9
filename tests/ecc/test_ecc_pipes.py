"""`ecc` with a reader that stops early (`ecc ito audit RUN | head -1`): it exits quietly, with the
status ecc/main.py documents (PIPE_CLOSED), never a BrokenPipeError traceback. The reader here is
gone before `ecc` writes its first byte, so every write fails, whatever the buffering."""

import os
import subprocess
import sys

import pytest

from ecc.main import PIPE_CLOSED

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def closed_early(args: list[str], config_dir: str) -> subprocess.CompletedProcess[bytes]:
    """Run `ecc ARGS` with stdout a pipe whose reading end is already closed."""
    read, write = os.pipe()
    os.close(read)
    env = {**os.environ, "ECC_CONFIG_DIR": config_dir, "PYTHONPATH": REPO}
    try:
        return subprocess.run(
            [sys.executable, "-m", "ecc.main", *args],
            stdout=write,
            stderr=subprocess.PIPE,
            env=env,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write)


@pytest.mark.parametrize(
    "args",
    [["ito", "logout"], ["ito", "logout", "--json"]],  # an answer made locally: no server to reach
    ids=["text", "json"],
)
def test_a_reader_that_left_early_gets_a_quiet_exit(args, tmp_path):
    done = closed_early(args, str(tmp_path))
    assert done.stderr.decode() == ""  # no traceback, no "Exception ignored ... BrokenPipeError"
    assert done.returncode == PIPE_CLOSED


def test_an_open_reader_still_gets_everything(tmp_path):
    env = {**os.environ, "ECC_CONFIG_DIR": str(tmp_path), "PYTHONPATH": REPO}
    done = subprocess.run(
        [sys.executable, "-m", "ecc.main", "ito", "logout", "--json"],
        capture_output=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert (done.returncode, done.stdout, done.stderr) == (
        0,
        b'{"ok":true,"live_api_contacted":false,"notice":null,"data":{"logged_out":false}}\n',
        b"",
    )
