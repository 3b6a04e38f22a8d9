"""The MCP tools for a trained model (ecc/tools.py): `export` is idempotent and needs no person,
`sample` only reads, `download` takes the directory the agent names and runs the CLI's own
downloader (ecc/download.py); none of them asks for a confirmation."""

import asyncio

import pytest

from contracts.envelope import Envelope
from ecc import credentials, download, tools
from ecc.verbs import Bounds

KEY = "ito_sk_SUAFAKESEEDFORTESTSONLYNOTAREALKEY0000000000000000000000"
BOUNDS = Bounds(1.0, 2.0)


@pytest.fixture
def logged_in(tmp_path, monkeypatch):
    monkeypatch.setenv(credentials.ENV_CONFIG_DIR, str(tmp_path / "ecc"))
    credentials.save("acme", KEY)


def test_hints_say_what_each_does():
    assert tools.TOOLS["sample"].hints == {"read_only_hint": True}
    for name in ("export", "download"):  # they write files, idempotently, and destroy nothing
        assert tools.TOOLS[name].hints == {
            "read_only_hint": False,
            "destructive_hint": False,
            "idempotent_hint": True,
        }
    for name in ("export", "download", "sample"):
        assert "confirmation_ref" not in tools.input_schema(tools.TOOLS[name])["properties"]
        assert "No confirmation" in tools.TOOLS[name].description


def test_download_takes_a_directory_not_a_chunk():
    schema = tools.input_schema(tools.TOOLS["download"])
    assert set(schema["properties"]) == {"run_id", "to", "export_id"}
    assert schema["required"] == ["run_id", "to"]


def test_download_runs_the_clis_downloader_with_the_tools_bounds(logged_in, monkeypatch, tmp_path):
    seen = []

    async def fake(run_id, export, to, connect_timeout_s, timeout_s):
        seen.append((run_id, export, to, connect_timeout_s, timeout_s))
        return Envelope(ok=True, live_api_contacted=True, notice=None, data=None)

    monkeypatch.setattr(download, "download", fake)
    env = asyncio.run(tools.call("download", {"run_id": "r", "to": str(tmp_path / "m")}, BOUNDS))
    assert env.ok and seen == [("r", None, str(tmp_path / "m"), 1.0, 2.0)]
    bad = asyncio.run(tools.call("download", {"run_id": "r", "to": "/x", "path": "config.json"}, BOUNDS))
    assert not bad.ok and bad.error.code == "request_invalid" and len(seen) == 1


def test_a_sample_out_of_bounds_is_refused_here(logged_in, monkeypatch):
    async def never(*a, **k):
        raise AssertionError("sent")

    monkeypatch.setattr(tools.verbs, "answer", never)
    for args in ({"run_id": "r", "prompt": ""}, {"run_id": "r", "prompt": "x", "max_new_tokens": 513}):
        env = asyncio.run(tools.call("sample", args, BOUNDS))
        assert not env.ok and env.error.code == "request_invalid", args
