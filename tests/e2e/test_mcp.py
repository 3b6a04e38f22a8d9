"""The agents' door with a real MCP client (the SDK's stdio client) against `ecc mcp` and a real
stack: the tools are the verbs but confirm and login; plan creates nothing; train without a person's
confirmation is `confirmation_required` with the command the person runs; with the reference they
hand over, a run that reaches `succeeded`, replayed by its key; a revoked credential stops a wait.
A manifest sent by content trains like the same bytes from a file; `wait` reports progress and
takes a bound over 300 s; cancelling a finished run asks no one to confirm; the tool list fits its
budget. Every result and the tool list are scanned for the API key and a planted token."""

import contextlib
import json
import pathlib
import re
import shlex
import stat
from collections.abc import AsyncIterator

import jsonschema
import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from ecc.transport import KEY_PREFIX
from tests.conftest import BIN

pytestmark = pytest.mark.e2e
TOOLS = {"auth", "find", "plan", "train", "status", "wait", "logs", "metrics", "checkpoints", "evals"}
TOOLS |= {"audit", "cancel", "cleanup", "approve"}
TOOLS |= {"export", "download", "sample"}  # a trained model out (tests/e2e/test_export_e2e.py drives them)
TOOLS |= {"models"}
TOOLS |= {"runs"}  # the account's own runs (tests/e2e/test_runs_e2e.py drives it)
TOOLS |= {"upload", "files", "file_delete", "connections"}  # its own inputs (test_tenant_inputs_e2e.py)
LOCAL_TOOLS = {"validate", "manifest_schema"}  # no server, no login (tests/e2e/test_mcp_manifest.py)
TERMINAL = {"succeeded", "failed", "gate_failed", "cancelled"}
LONG = {"tokens": 4000 * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003}
PLANTED = "hf_" + "Zq7" * 12  # looks like a Hugging Face token: the server refuses the manifest


class Agent:
    """One MCP session with `ecc mcp`, keeping every text it received for the secrets scan."""

    def __init__(self, session: ClientSession, instructions: str | None) -> None:
        self.session = session
        self.instructions = instructions
        self.seen: list[str] = []
        self.schemas: dict[str, dict] = {}

    async def tools(self) -> list:
        listed = await self.session.list_tools()
        self.seen.append(listed.model_dump_json())
        self.schemas = {t.name: t.output_schema for t in listed.tools}
        return listed.tools

    async def __call__(self, name: str, wait_s: float = 60, on_progress=None, **arguments) -> dict:
        """The envelope a tool answered: structured content, the same JSON as text, and `isError`
        exactly when it is not ok; an ok one the SDK has validated against the output schema."""
        result = await self.session.call_tool(
            name, arguments, read_timeout_seconds=wait_s + 30, progress_callback=on_progress
        )
        self.seen.append(result.model_dump_json())
        env = result.structured_content
        assert [json.loads(c.text) for c in result.content] == [env]
        assert result.is_error is (not env["ok"]), env
        jsonschema.validate(env, self.schemas[name])  # the failed ones too (the SDK checks ok ones)
        return env


@contextlib.asynccontextmanager
async def agent(env: dict) -> AsyncIterator[Agent]:
    params = StdioServerParameters(command=str(BIN / "ecc"), args=["mcp"], env=env)
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        init = await session.initialize()
        a = Agent(session, init.instructions)
        await a.tools()
        yield a


def person_runs(stack, env: dict, message: str) -> str:
    """What a person does with `confirmation_required`: runs the command it names, exactly; the
    confirmation_ref they hand back."""
    (command,) = re.findall(r"`(ecc ito confirm [^`]*)`", message)
    exe, *args = shlex.split(command)
    proc = stack.run(exe, *args, "--json", env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])["data"]["confirmation_ref"]


def scan(seen: list[str], *secrets: str) -> None:
    for text in seen:
        for secret in secrets:
            assert secret not in text


async def test_an_agent_takes_a_run_from_find_to_succeeded_given_only_a_persons_ref(stack, manifest):
    account, key, env = stack.account()
    booking = stack.booking(account)
    m, leaky = str(manifest()), str(manifest(name=f"run {PLANTED}"))
    async with agent({**stack.env, **env}) as a:
        assert {t.name for t in await a.tools()} == TOOLS | LOCAL_TOOLS  # no confirm, no login, no logout
        found = await a("find")
        assert [v["booking"]["booking_id"] for v in found["data"]] == [booking]

        plan = await a("plan", booking_id=booking, manifest=m)
        assert plan["ok"] and plan["data"]["ok"], plan
        refused = await a("plan", booking_id=booking, manifest=leaky)
        assert refused["error"]["code"] == "manifest_contains_secret"
        assert (await a("status", idempotency_key="mcp-1"))["error"]["code"] == "run_not_found"

        asked = await a("train", booking_id=booking, manifest=m, idempotency_key="mcp-1")
        assert asked["error"]["code"] == "confirmation_required" and not asked["live_api_contacted"]
        assert (await a("status", idempotency_key="mcp-1"))["error"]["code"] == "run_not_found"
        ref = person_runs(stack, env, asked["error"]["message"])

        train = await a(
            "train", booking_id=booking, manifest=m, idempotency_key="mcp-1", confirmation_ref=ref
        )
        assert train["ok"] and train["data"]["replay"] is False, train
        run_id = train["data"]["run_id"]
        assert train["data"]["manifest_digest"] == plan["data"]["manifest_digest"]
        again = await a(
            "train", booking_id=booking, manifest=m, idempotency_key="mcp-1", confirmation_ref=ref
        )
        assert again["data"]["run_id"] == run_id and again["data"]["replay"] is True

        for _ in range(6):  # each wait is bounded; the agent keeps control between them
            waited = await a("wait", run_id=run_id, max_wait_s=60)
            assert waited["ok"], waited
            if waited["data"]["state"] in TERMINAL:
                break
        assert waited["data"]["state"] == "succeeded", waited
        assert waited["data"]["step"] == waited["data"]["total_steps"] == 30
        assert (await a("status", idempotency_key="mcp-1"))["data"]["run_id"] == run_id
        logs = await a("logs", run_id=run_id)
        assert any("pretrain finished" in ln["message"] for ln in logs["data"]["lines"])
        for name in ("metrics", "checkpoints", "evals", "audit"):
            assert (await a(name, run_id=run_id))["ok"], name

        asked = await a("cleanup", run_id=run_id, idempotency_key="mcp-clean")
        assert asked["error"]["code"] == "confirmation_required"
        ref = person_runs(stack, env, asked["error"]["message"])
        cleaned = await a("cleanup", run_id=run_id, idempotency_key="mcp-clean", confirmation_ref=ref)
        assert cleaned["ok"] and cleaned["data"]["removed"], cleaned
    scan(a.seen, key, key.removeprefix(KEY_PREFIX), PLANTED)


async def test_a_revoked_credential_stops_a_wait_and_a_new_login_is_a_persons(stack, manifest):
    import asyncio

    from tests.support import confirm_and_train

    account, key, env = stack.account()
    booking = stack.booking(account)
    run_id = confirm_and_train(stack, env, booking, str(manifest(target=LONG)), "mcp-long")["data"]["run_id"]
    async with agent({**stack.env, **env}) as a:
        waiting = asyncio.create_task(a("wait", run_id=run_id, max_wait_s=120))
        await asyncio.sleep(2)
        assert not waiting.done()
        stack.ito("accounts", "revoke", account)
        stopped = await asyncio.wait_for(waiting, timeout=60)  # well inside max_wait_s: it stopped
        assert stopped["error"]["code"] == "credential_revoked", stopped
        assert (await a("auth"))["error"]["code"] == "credential_revoked"

        # a person logs in again; the same server uses the new login, and the run stops by the lifecycle
        new_key = stack.ito("accounts", "create", account)["api_key"]
        rc, out = stack.ecc("login", "--account", account, input=new_key + "\n", env=env)
        assert rc == 0, out
        asked = await a("cancel", run_id=run_id, idempotency_key="mcp-stop")
        assert asked["error"]["code"] == "confirmation_required"
        ref = person_runs(stack, env, asked["error"]["message"])
        cancelled = await a("cancel", run_id=run_id, idempotency_key="mcp-stop", confirmation_ref=ref)
        assert cancelled["ok"] and cancelled["data"]["state"] in ("cancelling", "cancelled"), cancelled
    scan(a.seen, key, new_key, key.removeprefix(KEY_PREFIX), new_key.removeprefix(KEY_PREFIX))


async def test_without_a_login_every_tool_says_a_person_must_log_in(tmp_path):
    async with agent({"ECC_CONFIG_DIR": str(tmp_path)}) as a:
        assert "you can never authorise spending" in a.instructions
        for name in sorted(TOOLS):
            env = await a(name)
            assert env["error"]["code"] == "unauthenticated" and not env["live_api_contacted"], (name, env)
            assert "a person must run `ecc ito login" in env["error"]["message"]


async def test_a_manifest_sent_by_content_is_planned_confirmed_and_trained_like_the_file(
    stack, manifest, tmp_path
):
    """A remote agent has no path on the door's machine: it sends the text. The door stores it 0600
    and reads it back by the safe reader, so the digest is the file's; malformed or too big, the
    same refusal as the same bytes from a file."""
    account, key, env = stack.account()
    booking = stack.booking(account)
    path = manifest()
    text = path.read_text()
    async with agent({**stack.env, **env}) as a:
        by_file = await a("plan", booking_id=booking, manifest=str(path))
        by_content = await a("plan", booking_id=booking, manifest_json=text)
        assert by_file["ok"] and by_content["ok"], (by_file, by_content)
        digest = by_file["data"]["manifest_digest"]
        assert by_content["data"]["manifest_digest"] == digest
        stored = pathlib.Path(env["ECC_CONFIG_DIR"]) / "manifests" / f"{digest}.json"
        assert stored.read_text() == text and stat.S_IMODE(stored.stat().st_mode) == 0o600
        assert stat.S_IMODE(stored.parent.stat().st_mode) == 0o700

        for bad in ("{not json", text + " " * (1024 * 1024)):  # malformed; over the 1 MiB limit
            twin = tmp_path / f"bad-{len(bad)}.json"
            twin.write_text(bad)
            from_file = await a("plan", booking_id=booking, manifest=str(twin))
            from_text = await a("plan", booking_id=booking, manifest_json=bad)
            assert not from_text["ok"] and from_text["error"]["code"] == from_file["error"]["code"]
            assert from_text["live_api_contacted"] == from_file["live_api_contacted"]
        assert from_text["error"]["code"] == "manifest_too_large" and not from_text["live_api_contacted"]

        asked = await a("train", booking_id=booking, manifest_json=text, idempotency_key="mcp-text")
        assert asked["error"]["code"] == "confirmation_required", asked
        assert f"--manifest {stored}" in asked["error"]["message"]  # the person confirms the stored bytes
        ref = person_runs(stack, env, asked["error"]["message"])
        train = await a(
            "train", booking_id=booking, manifest_json=text, idempotency_key="mcp-text", confirmation_ref=ref
        )
        assert train["ok"] and train["data"]["manifest_digest"] == digest, train
        again = await a("status", idempotency_key="mcp-text")
        assert again["data"]["run_id"] == train["data"]["run_id"]
    scan(a.seen, key, key.removeprefix(KEY_PREFIX))


STEPS_150 = {"tokens": 150 * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003}


async def test_wait_reports_progress_within_a_long_bound_and_a_finished_run_asks_no_confirmation(
    stack, manifest
):
    """One wait for the whole run (a bound over 300 s), the SDK's progress callback hearing it go;
    then a cancel of the succeeded run is refused before anyone is asked to confirm, by the tool and
    by the CLI's `confirm`."""
    from tests.support import confirm_and_train

    account, key, env = stack.account()
    booking = stack.booking(account)
    m = str(manifest(target=STEPS_150))  # several seconds of steps: several polls see it move
    run_id = confirm_and_train(stack, env, booking, m, "mcp-progress")["data"]["run_id"]
    heard: list[tuple[float, float | None, str | None]] = []

    async def on_progress(done: float, total: float | None, message: str | None) -> None:
        heard.append((done, total, message))

    async with agent({**stack.env, **env}) as a:
        waited = await a("wait", wait_s=900, on_progress=on_progress, run_id=run_id, max_wait_s=900)
        assert waited["ok"] and waited["data"]["state"] == "succeeded", waited
        assert len(heard) >= 3, heard  # several notifications while it ran
        assert [d for d, _, _ in heard] == sorted({d for d, _, _ in heard})  # progress only grows
        assert {t for _, t, _ in heard} == {900} and any("step" in (m or "") for _, _, m in heard), heard

        cancel = await a("cancel", run_id=run_id, idempotency_key="mcp-late")
        assert cancel["error"]["code"] == "run_not_cancellable" and cancel["live_api_contacted"], cancel
        assert "ecc ito confirm" not in cancel["error"]["message"]
    rc, out = stack.ecc("confirm", "--action", "cancel", "--run", run_id, env=env)  # the CLI's person
    assert rc == 1 and out["error"]["code"] == "run_not_cancellable", out
    scan(a.seen, key, key.removeprefix(KEY_PREFIX))


HELPER_TOOLS = {"validate", "manifest_schema"}  # what the connect helper adds to the list
HELPER_HEADROOM = 2_000  # bytes kept for them until they are in the list


async def test_every_tool_definition_together_is_at_most_20_kb(tmp_path):
    import os

    source = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}  # this checkout's door
    async with agent({"ECC_CONFIG_DIR": str(tmp_path), **source}) as a:
        listed = await a.session.list_tools()
    size = len(listed.model_dump_json(by_alias=True, exclude_none=True))
    names = {t.name for t in listed.tools}
    assert size + (0 if HELPER_TOOLS <= names else HELPER_HEADROOM) <= 20_000, size
    for tool in listed.tools:  # every tool still says what it does and takes typed arguments
        assert tool.description and tool.input_schema["type"] == "object" and tool.output_schema
