"""A user's first hour, through real `ecc` processes against a real stack: find your runs again
(`ecc ito runs`, and the MCP tool `runs`), see what a confirmation authorises, be told when a
confirmation is for another action, and pipe an answer into `head` without a traceback."""

import os
import subprocess

import pytest
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client

from tests.conftest import BIN
from tests.support import confirm_and_train, run_state

pytestmark = pytest.mark.e2e
FINAL = ("succeeded", "failed", "gate_failed", "cancelled")
LONG = {
    "tokens": 4000 * 8 * 32,
    "seq_len": 32,
    "batch_size": 8,
    "learning_rate": 0.003,
}  # still going when cancelled


def listed(out: dict) -> tuple[list[str], str | None]:
    assert out["ok"], out
    return [r["run_id"] for r in out["data"]["runs"]], out["data"]["next"]


def test_runs_lists_only_your_own_newest_first_in_pages(stack, manifest):
    account, _, env = stack.account()
    other, _, other_env = stack.account()
    booking, second_booking = stack.booking(account), stack.booking(account)
    rc, out = stack.ecc("runs", env=env)
    assert rc == 0 and listed(out) == ([], None)

    first = confirm_and_train(stack, env, booking, str(manifest()), "runs-1")["data"]["run_id"]
    second = confirm_and_train(stack, env, second_booking, str(manifest()), "runs-2")["data"]["run_id"]
    theirs = confirm_and_train(stack, other_env, stack.booking(other), str(manifest()), "runs-1")["data"][
        "run_id"
    ]

    rc, out = stack.ecc("runs", env=env)
    assert rc == 0 and listed(out) == ([second, first], None)  # never the other account's
    rc, out = stack.ecc("runs", env=other_env)
    assert rc == 0 and listed(out) == ([theirs], None)
    rc, out = stack.ecc("runs", "--limit", "1", env=env)
    page, cursor = listed(out)
    assert page == [second] and cursor
    rc, out = stack.ecc("runs", "--limit", "1", "--cursor", cursor, env=env)
    assert listed(out) == ([first], None)
    rc, out = stack.ecc("runs", "--booking", booking, env=env)
    assert listed(out) == ([first], None)
    assert out["data"]["runs"][0]["idempotency_key"] == "runs-1"

    for run_id, e in ((first, env), (second, env)):
        run_state(stack, e, run_id, FINAL)
    rc, out = stack.ecc("runs", "--state", "succeeded", env=env)
    assert listed(out) == ([second, first], None)
    rc, out = stack.ecc("runs", "--state", "running", env=env)
    assert listed(out) == ([], None)

    text = stack.run("ecc", "ito", "runs", env=env)  # what a person reads: a table, newest first
    assert text.returncode == 0, text.stderr
    header, *rows = text.stdout.splitlines()
    assert header.split()[:3] == ["RUN", "STATE", "BOOKING"]
    assert [r.split()[:2] for r in rows] == [[second, "succeeded"], [first, "succeeded"]]
    bad = stack.run("ecc", "ito", "runs", "--limit", "1000", env=env)
    assert bad.returncode == 1 and "request_invalid" in bad.stderr


async def test_the_runs_tool_lists_the_agents_accounts_runs(stack, manifest):
    account, _, env = stack.account()
    run_id = confirm_and_train(stack, env, stack.booking(account), str(manifest()), "mcp-runs")["data"][
        "run_id"
    ]
    params = StdioServerParameters(command=str(BIN / "ecc"), args=["mcp"], env={**stack.env, **env})
    async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
        await session.initialize()
        result = await session.call_tool("runs", {"limit": 5}, read_timeout_seconds=60)
    env_out = result.structured_content
    assert not result.is_error and [r["run_id"] for r in env_out["data"]["runs"]] == [run_id]


def test_confirm_shows_what_it_authorises_and_another_actions_ref_says_so(stack, manifest):
    account, _, env = stack.account()
    booking = stack.booking(account)
    m = str(manifest(target=LONG))
    shown = stack.run(
        "ecc", "ito", "confirm", "--action", "train", "--booking", booking, "--manifest", m, env=env
    )
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].startswith("confirmation_ref: cf_")
    assert lines[1] == f"  authorises: train on booking {booking}, once"
    assert lines[2].startswith("  manifest: sha256 ") and len(lines[2].split()[-1]) == 64
    assert lines[3].startswith("  cost bound: at most ") and lines[3].endswith(" USD")
    assert lines[4].startswith("  expires: ")
    rc, as_json = stack.ecc("confirm", "--action", "train", "--booking", booking, "--manifest", m, env=env)
    assert set(as_json["data"]) == {
        "confirmation_ref",
        "action",
        "target",
        "manifest_digest",
        "max_cost_usd",
        "expires_at",
    }

    ref = lines[0].removeprefix("confirmation_ref: ")
    rc, out = stack.ecc(
        "train",
        "--booking",
        booking,
        "--manifest",
        m,
        "--confirmation-ref",
        ref,
        "--idempotency-key",
        "t-1",
        env=env,
    )
    assert rc == 0, out
    run_id = out["data"]["run_id"]
    # the train confirmation (now used) given to a cancel: the wrong action, not "consumed ... confirm again"
    rc, out = stack.ecc("cancel", run_id, "--confirmation-ref", ref, "--idempotency-key", "c-1", env=env)
    assert rc == 1 and out["error"]["code"] == "confirmation_action_mismatch"
    assert out["error"]["message"] == (
        "this confirmation is for action train, not cancel: get one for cancel with "
        f"`ecc ito confirm --action cancel --run {run_id}`"
    )
    assert stack.ecc("status", run_id, env=env)[1]["data"]["state"] in ("queued", "running")  # untouched
    shown = stack.run("ecc", "ito", "confirm", "--action", "cancel", "--run", run_id, env=env)
    lines = shown.stdout.splitlines()
    assert lines[1:2] == [f"  authorises: cancel on run {run_id}, once"] and lines[2].startswith(
        "  expires: "
    )
    right = lines[0].removeprefix("confirmation_ref: ")
    rc, out = stack.ecc("cancel", run_id, "--confirmation-ref", right, "--idempotency-key", "c-1", env=env)
    assert rc == 0 and out["data"]["state"] in ("cancelling", "cancelled"), out
    run_state(stack, env, run_id, ("cancelled",))


def test_an_answer_piped_into_a_reader_that_stops_early_exits_quietly(stack, manifest):
    """`ecc ito audit RUN | head -1`: the reader is gone before ecc writes, and ecc says nothing."""
    account, _, env = stack.account()
    run_id = confirm_and_train(stack, env, stack.booking(account), str(manifest()), "pipe-1")["data"][
        "run_id"
    ]
    full = stack.run("ecc", "ito", "audit", run_id, env=env)
    assert full.returncode == 0 and len(full.stdout.splitlines()) > 1, full.stderr
    for args in (["audit", run_id], ["audit", run_id, "--json"], ["runs"]):
        read, write = os.pipe()
        os.close(read)
        try:
            done = subprocess.run(
                [str(BIN / "ecc"), "ito", *args],
                stdout=write,
                stderr=subprocess.PIPE,
                env={**stack.env, **env},
                timeout=60,
                check=False,
            )
        finally:
            os.close(write)
        assert done.stderr == b"", done.stderr.decode()[-2000:]
        assert done.returncode == 1  # not everything reached the reader: not 0 (ecc/main.py PIPE_CLOSED)
    run_state(stack, env, run_id, FINAL)
