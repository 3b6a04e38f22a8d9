"""The MCP tools `validate` and `manifest_schema` through a real MCP client against `ecc mcp`, with
no login and no server: the agent reads the manifest's fields from the schema and gets every
problem of a manifest at once (path, line, column, allowed values), for a file or for its text."""

import json
import os
import pathlib

import pytest

from contracts import manifest_check
from tests.e2e.test_mcp import agent

pytestmark = pytest.mark.e2e
REPO = pathlib.Path(__file__).resolve().parents[2]
TINY = json.loads((REPO / "examples" / "manifests" / "tiny.json").read_text())


async def test_an_agent_reads_the_schema_and_gets_every_problem_at_once(tmp_path):
    env = {**os.environ, "ECC_CONFIG_DIR": str(tmp_path / "nobody"), "ITO_NATS_URL": "nats://127.0.0.1:1"}
    async with agent(env) as a:
        listed = {t.name: t for t in await a.tools()}
        for name in ("validate", "manifest_schema"):
            assert "\n" not in listed[name].description and listed[name].annotations.read_only_hint

        schema = await a("manifest_schema")
        assert schema["ok"] and not schema["live_api_contacted"]
        assert schema["data"] == json.loads(manifest_check.schema_text())

        two = {k: v for k, v in TINY.items() if k != "target"} | {"epochs": 3}
        checked = await a("validate", manifest_json=json.dumps(two, indent=2))
        message = checked["error"]["message"]
        assert checked["error"]["code"] == "manifest_invalid" and not checked["live_api_contacted"]
        assert "missing required field `target`" in message and "$.epochs (line " in message

        path = tmp_path / "size.json"
        path.write_text(json.dumps(TINY | {"model": TINY["model"] | {"size": "13B"}}))
        path.chmod(0o600)
        sized = await a("validate", manifest=str(path))
        assert "allowed: 150M, 1B, 70B, 8B, tiny, null" in sized["error"]["message"]

        good = await a("validate", manifest=str(REPO / "examples" / "manifests" / "tiny.json"))
        assert good["ok"] and good["data"]["valid"], good
        both = await a("validate", manifest=str(path), manifest_json="{}")
        assert both["error"]["code"] == "request_invalid"
