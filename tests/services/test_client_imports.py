"""`ecc` stays light: no torch, no faststream, and `--help` needs neither NATS nor msgspec; the MCP
SDK loads for `ecc mcp` only (the tools' own rules, ecc/tools.py, need none of it)."""

import subprocess
import sys

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
        "import ecc.main, ecc.verbs, ecc.render, ecc.transport, ecc.manifest_file, ecc.tools"
    )
    assert not {m for m in loaded if m.split(".")[0] in (*HEAVY, "mcp", "mcp_types", "pydantic")}


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
    assert not {m for m in loaded if m.split(".")[0] in (*HEAVY, "nats", "msgspec", "mcp")}
