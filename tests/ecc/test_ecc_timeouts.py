"""`ecc`'s default timeouts live in one place (ecc/timeouts.py): the parser, its help and the
transport's `Client` all take them from there, so changing one number changes what a user sees."""

import subprocess
import sys

import pytest

from ecc import transport
from ecc.main import CONNECT_TIMEOUT_HELP, TIMEOUT_HELP, parser

VERBS = {
    "login": ["--account", "a"],
    "logout": [],
    "auth": [],
    "find": [],
    "plan": ["--booking", "b", "--manifest", "/m"],
    "confirm": ["--action", "train"],
    "train": ["--booking", "b", "--manifest", "/m", "--confirmation-ref", "c", "--idempotency-key", "k"],
    "runs": ["--state", "running", "--limit", "5"],
    "status": ["r"],
    "metrics": ["r"],
    "checkpoints": ["r"],
    "evals": ["r"],
    "cancel": ["r", "--confirmation-ref", "c", "--idempotency-key", "k"],
    "cleanup": ["r", "--confirmation-ref", "c", "--idempotency-key", "k"],
    "approve": ["r", "--idempotency-key", "k"],
    "audit": ["r"],
    "logs": ["r"],
    "export": ["r"],
    "download": ["r", "--to", "/tmp/x"],
    "sample": ["r", "--prompt", "2+2="],
    "models": [],
    "files": ["list"],
    "connections": [],
    "validate": ["--manifest", "/m"],
}


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_verb_defaults_to_the_transports_timeouts(verb):
    args = parser().parse_args(["ito", verb, *VERBS[verb]])
    assert args.connect_timeout == transport.DEFAULT_CONNECT_TIMEOUT_S
    assert args.timeout == transport.DEFAULT_TIMEOUT_S


def test_changing_the_one_value_changes_the_parser_its_help_and_the_client():
    """Run in a fresh interpreter: the values are read when the modules are imported."""
    code = (
        "import inspect, ecc.timeouts as t\n"
        "t.DEFAULT_CONNECT_TIMEOUT_S, t.DEFAULT_TIMEOUT_S = 0.5, 7.5\n"
        "from ecc import main, transport\n"
        "a = main.parser().parse_args(['ito', 'auth'])\n"
        "sig = inspect.signature(transport.Client).parameters\n"
        "print(a.connect_timeout, a.timeout)\n"
        "print(transport.DEFAULT_CONNECT_TIMEOUT_S, transport.DEFAULT_TIMEOUT_S)\n"
        "print(sig['connect_timeout_s'].default, sig['timeout_s'].default)\n"
        "print(main.CONNECT_TIMEOUT_HELP)\n"
        "print(main.TIMEOUT_HELP)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [
        "0.5 7.5",
        "0.5 7.5",
        "0.5 7.5",
        "seconds to wait for the connection (default 0.5)",
        "overall seconds for the call (default 7.5)",
    ]


def test_the_help_says_the_defaults_as_before():
    assert CONNECT_TIMEOUT_HELP == "seconds to wait for the connection (default 2)"
    assert TIMEOUT_HELP == "overall seconds for the call (default 15)"
