"""`ecc` stays light: no torch, no faststream, `--help` needs neither NATS nor msgspec, rich (the
progress bars) loads only when a terminal follows a run (never for --json, a pipe, or --help), and
the MCP SDK loads for `ecc mcp` only (the tools' own rules, ecc/tools.py, need none of it)."""

import subprocess
import sys

import pytest

HEAVY = ("torch", "faststream", "redis", "numpy")


def modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(out.stdout.split())


def test_every_client_module_imports_without_heavy_packages():
    loaded = modules_after(
        "import ecc.main, ecc.verbs, ecc.render, ecc.transport, ecc.manifest_file, ecc.charts, ecc.progress, ecc.tools"
    )
    assert not {m for m in loaded if m.split(".")[0] in (*HEAVY, "rich", "mcp", "mcp_types", "pydantic")}


# `ecc ito status --follow` of a run that has ended, with the network cut out (`render._call` answers).
FOLLOW = """
import argparse, asyncio, contextlib, io, sys
from datetime import UTC, datetime
from contracts.api import LogPage, RunView, StatusRequest
from contracts.endpoints import API
from contracts.envelope import Envelope
from contracts.runs import MetricsPage
from ecc import render

AT = datetime(2026, 12, 2, tzinfo=UTC)
ANSWERS = {
    API["status"].subject: RunView(run_id="r", account="a", booking_id="b", manifest_digest="d",
        idempotency_key="k", state="succeeded", stage="pretrain", step=1, total_steps=1, created_at=AT,
        updated_at=AT),
    API["logs"].subject: LogPage(run_id="r", lines=[], next=0),
    API["metrics"].subject: MetricsPage(run_id="r", points=[], next=0),
}

async def call(args, endpoint, request):
    return Envelope(ok=True, live_api_contacted=True, notice=None, data=ANSWERS[endpoint.subject])

render._call = call
if TERMINAL:
    render.on_terminal = lambda args: True
args = argparse.Namespace(json=JSON, connect_timeout=1.0, timeout=1.0)
with contextlib.redirect_stdout(io.StringIO()):
    assert asyncio.run(render.follow(args, StatusRequest(run_id="r"))).ok
"""


@pytest.mark.parametrize(
    "terminal, as_json, draws",
    [(False, True, False), (False, False, False), (True, False, True)],
    ids=["json", "pipe", "terminal"],
)
def test_rich_loads_only_when_a_terminal_follows_a_run(terminal, as_json, draws):
    loaded = modules_after(f"TERMINAL, JSON = {terminal}, {as_json}\n" + FOLLOW)
    assert ("rich" in loaded) is draws
    assert ("ecc.progress" in loaded) is draws


def test_the_mcp_server_imports_without_heavy_packages():
    loaded = modules_after("import ecc.mcp_server")
    assert "mcp.server.lowlevel" in loaded
    assert not {m for m in loaded if m.split(".")[0] in HEAVY}


def test_help_imports_neither_nats_nor_msgspec():
    loaded = modules_after(
        "import contextlib, io\n"
        "from ecc.main import main\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['--help'])\n"
        "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['mcp', '--help'])"
    )
    assert "ecc.main" in loaded
    assert not {m for m in loaded if m.split(".")[0] in (*HEAVY, "nats", "msgspec", "rich", "mcp")}
