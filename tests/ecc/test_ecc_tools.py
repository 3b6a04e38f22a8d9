"""The agents' door without the SDK (ecc/tools.py): which tools exist, that their schemas are the
API's own types, and a call's local rules as tables: no login -> `unauthenticated`, a mutation
without a person's confirmation -> `confirmation_required` with the exact command, nothing sent;
`wait` bounded and stopped by any refusal; never the stored key in an answer."""

import asyncio
import json
import shlex
import stat
from datetime import UTC, datetime

import jsonschema
import msgspec
import pytest

from contracts.api import RunView, StatusRequest
from contracts.endpoints import API
from contracts.envelope import Envelope
from contracts.errors import ApiError, ErrorCode
from contracts.states import RunState
from ecc import credentials, manifest_store, tools, transport, verbs
from ecc.verb_help import VERB_HELP, for_tools
from tests.conftest import write_manifest

BOUNDS = verbs.Bounds(1.0, 1.0)
KEY = "ito_sk_SUAFAKESEEDFORTESTSONLYNOTAREALKEY0000000000000000000000"
NOW = datetime(2026, 12, 2, 7, 30, tzinfo=UTC)


def view(state: RunState = RunState.running) -> RunView:
    return RunView(
        run_id="run-1",
        account="acme",
        booking_id="bk-1",
        manifest_digest="d" * 64,
        idempotency_key="key-1",
        state=state,
        created_at=NOW,
        updated_at=NOW,
    )


@pytest.fixture
def logged_in(tmp_path, monkeypatch):
    monkeypatch.setenv(credentials.ENV_CONFIG_DIR, str(tmp_path / "ecc"))
    credentials.save("acme", KEY)


@pytest.fixture
def nothing_sent(monkeypatch):
    """Every call to the API fails the test: what these tests check is answered locally."""

    async def call(self, endpoint, request):
        raise AssertionError(f"{endpoint.subject} was called")

    monkeypatch.setattr(transport.Client, "call", call)


def test_the_tools_are_the_api_verbs_but_confirm_plus_wait():
    assert set(tools.TOOLS) == (set(API) - {"confirm"} - tools.FOLDED) | {"wait"}
    assert not {"confirm", "login", "logout"} & set(tools.TOOLS)
    for tool in tools.TOOLS.values():
        assert tool.description.startswith(for_tools(VERB_HELP[tool.verb]))


@pytest.mark.parametrize("name", sorted(tools.TOOLS))
def test_each_input_schema_is_its_request_type_less_credential_with_a_manifest_path(name):
    tool = tools.TOOLS[name]
    schema = tools.input_schema(tool)
    fields = set(tool.request.__struct_fields__) - {"credential"}
    if tool.reads_manifest:  # a path or the text: exactly one, checked by decode
        fields = fields - {"manifest_text", "manifest_digest"} | {"manifest", "manifest_json"}
        assert not {"manifest", "manifest_json"} & set(schema["required"])
    assert set(schema["properties"]) == fields
    assert schema["type"] == "object" and schema["additionalProperties"] is False
    assert "credential" not in json.dumps(schema).lower()
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.Draft202012Validator.check_schema(tools.output_schema(tool))


@pytest.mark.parametrize(
    "name, arguments, code",
    [
        ("status", {"run_id": "r", "credential": {"account": "acme"}}, "request_invalid"),
        ("status", {"run_id": "r", "api_key": KEY}, "request_invalid"),
        ("train", {"booking_id": "b", "idempotency_key": "k"}, "request_invalid"),  # no manifest
        (
            "train",
            {"booking_id": "b", "idempotency_key": "k", "manifest": "rel.json"},
            "manifest_not_absolute",
        ),
        ("plan", {"booking_id": "b", "manifest_text": "{}", "manifest_digest": "0" * 64}, "request_invalid"),
        ("logs", {"run_id": 7}, "request_invalid"),
        ("wait", {"run_id": "r", "max_wait_s": 10_000}, "request_invalid"),  # over MAX_WAIT_S
        ("plan", {"booking_id": "b", "manifest": "/m.json", "manifest_json": "{}"}, "request_invalid"),
        ("plan", {"booking_id": "b", "manifest_json": "x" * (1024 * 1024 + 1)}, "manifest_too_large"),
        ("plan", {"booking_id": "b", "manifest_json": "\ud800"}, "manifest_invalid"),  # not UTF-8 text
        ("status", {}, "request_invalid"),  # neither run_id nor idempotency_key
        ("nope", {}, "request_invalid"),
    ],
)
def test_arguments_that_are_not_the_tools_are_refused_locally(logged_in, nothing_sent, name, arguments, code):
    env = asyncio.run(tools.call(name, arguments, BOUNDS))
    assert not env.ok and not env.live_api_contacted and env.error.code == code, env
    assert KEY not in json.dumps(msgspec.to_builtins(env))


def test_a_manifest_is_read_by_the_safe_reader_into_the_request(tmp_path):
    path = write_manifest(tmp_path)
    request, where = tools.decode(tools.TOOLS["plan"], {"booking_id": "b", "manifest": str(path)})
    assert where == str(path) and request.manifest_text == path.read_text()
    assert request.manifest_digest == verbs.load_manifest(str(path))[1]
    link = tmp_path / "link.json"
    link.symlink_to(path)
    env = tools.decode(tools.TOOLS["plan"], {"booking_id": "b", "manifest": str(link)})
    assert isinstance(env, Envelope) and env.error.code == ErrorCode.manifest_symlink


@pytest.mark.parametrize("name", sorted(tools.TOOLS))
def test_without_a_login_every_tool_says_a_person_must_log_in(name, tmp_path, monkeypatch, nothing_sent):
    monkeypatch.setenv(credentials.ENV_CONFIG_DIR, str(tmp_path))
    env = asyncio.run(tools.call(name, {}, BOUNDS))
    assert not env.ok and not env.live_api_contacted and env.error.code == ErrorCode.unauthenticated
    assert "a person must run `ecc ito login" in env.error.message


MANIFEST = "/srv/manifests/my run.json"  # a space: the command quotes it


@pytest.mark.parametrize(
    "request_, commands",
    [
        (
            {"train": {"booking_id": "bk-1", "idempotency_key": "k"}},
            [f"ecc ito confirm --action train --booking bk-1 --manifest {shlex.quote(MANIFEST)}"],
        ),
        ({"train": {"booking_id": "bk-1", "idempotency_key": "k", "confirmation_ref": "cf_1"}}, []),
        (
            {"cancel": {"run_id": "run-1", "idempotency_key": "k"}},
            ["ecc ito confirm --action cancel --run run-1"],
        ),
        (
            {"cancel": {"run_id": "run-1", "idempotency_key": "k", "confirmation_ref": ""}},
            ["ecc ito confirm --action cancel --run run-1"],
        ),
        (
            {"cleanup": {"run_id": "run-1", "idempotency_key": "k"}},
            ["ecc ito confirm --action cleanup --run run-1"],
        ),
        (
            {
                "cleanup": {
                    "run_id": "run-1",
                    "idempotency_key": "k",
                    "confirmation_ref": "cf_1",
                    "release_booking": True,
                }
            },
            ["ecc ito confirm --action release_booking --booking BOOKING_ID"],
        ),
        (
            {
                "cleanup": {
                    "run_id": "run-1",
                    "idempotency_key": "k",
                    "confirmation_ref": "cf_1",
                    "release_booking": True,
                    "release_confirmation_ref": "cf_2",
                }
            },
            [],
        ),
        (
            {"approve": {"run_id": "run-1", "idempotency_key": "k"}},
            ["ecc ito confirm --action restart_from_checkpoint --run run-1"],
        ),
        ({"approve": {"run_id": "run-1", "idempotency_key": "k", "reject": True}}, []),
        ({"status": {"run_id": "run-1"}}, []),
    ],
)
def test_which_confirmations_a_person_must_create(request_, commands):
    ((verb, fields),) = request_.items()
    extra = {"manifest_text": "{}", "manifest_digest": "0" * 64} if verb == "train" else {}
    request = msgspec.convert({**fields, **extra}, API[verb].request)
    assert tools.confirmations_needed(request, MANIFEST if verb == "train" else None) == commands


def test_a_mutation_without_a_ref_is_answered_here_with_the_command(logged_in, nothing_sent, tmp_path):
    path = write_manifest(tmp_path)
    args = {"booking_id": "bk-1", "manifest": str(path), "idempotency_key": "mcp-1"}
    env = asyncio.run(tools.call("train", args, BOUNDS))
    assert not env.ok and not env.live_api_contacted and env.error.code == ErrorCode.confirmation_required
    assert f"`ecc ito confirm --action train --booking bk-1 --manifest {path}`" in env.error.message
    assert "mcp-1" in env.error.message and KEY not in env.error.message


def test_an_answer_holding_the_stored_key_is_withheld(logged_in):
    for leak in (KEY, KEY.removeprefix(transport.KEY_PREFIX)):
        env = Envelope(ok=True, live_api_contacted=True, notice=f"here: {leak}", data=None)
        out = tools.guarded(env)
        assert not out.ok and out.error.code == ErrorCode.internal and leak not in out.error.message
    clean = Envelope(ok=True, live_api_contacted=True, notice=None, data=view())
    assert tools.guarded(clean) is clean


def _scripted_status(monkeypatch, answers: list[Envelope]) -> list[StatusRequest]:
    """`verbs.answer` answering status from `answers` in order (the last one repeats)."""
    asked: list[StatusRequest] = []

    async def answer(verb, request, bounds):
        assert verb == "status" and type(request) is StatusRequest
        asked.append(request)
        return answers[min(len(asked), len(answers)) - 1]

    monkeypatch.setattr(verbs, "answer", answer)
    monkeypatch.setattr(tools, "POLL_EVERY_S", 0.01)
    return asked


def ok(state: RunState) -> Envelope:
    return Envelope(ok=True, live_api_contacted=True, notice=None, data=view(state))


def refused(code: ErrorCode) -> Envelope:
    return transport.local_error(code, "no", contacted=True)


@pytest.mark.parametrize(
    "answers, polls, code, state",
    [
        ([ok(RunState.queued), ok(RunState.running), ok(RunState.succeeded)], 3, None, "succeeded"),
        ([ok(RunState.running), ok(RunState.awaiting_approval)], 2, None, "awaiting_approval"),
        ([ok(RunState.running), refused(ErrorCode.credential_revoked)], 2, "credential_revoked", None),
        ([refused(ErrorCode.timeout), ok(RunState.gate_failed)], 2, None, "gate_failed"),  # a lost poll
        ([refused(ErrorCode.run_not_found)], 1, "run_not_found", None),
    ],
)
def test_wait_polls_until_the_run_stops_or_a_refusal(logged_in, monkeypatch, answers, polls, code, state):
    asked = _scripted_status(monkeypatch, answers)
    env = asyncio.run(tools.call("wait", {"run_id": "run-1", "max_wait_s": 30}, BOUNDS))
    assert len(asked) == polls and asked[0] == StatusRequest(run_id="run-1")
    assert (env.error.code if env.error else None) == code
    assert (env.data.state if env.ok else None) == state


def test_wait_answers_the_run_as_it_is_when_the_bound_passes(logged_in, monkeypatch):
    _scripted_status(monkeypatch, [ok(RunState.running)])
    env = asyncio.run(tools.call("wait", {"idempotency_key": "key-1", "max_wait_s": 0.05}, BOUNDS))
    assert env.ok and env.data.state == RunState.running
    assert env.notice == "still running after 0.05 s: call wait again to keep watching"
    _scripted_status(monkeypatch, [refused(ErrorCode.timeout)])
    env = asyncio.run(tools.call("wait", {"run_id": "run-1", "max_wait_s": 0.05}, BOUNDS))
    assert not env.ok and env.error.code == ErrorCode.timeout


@pytest.mark.parametrize(
    "name, env",
    [
        ("status", ok(RunState.running)),
        ("wait", ok(RunState.succeeded)),
        ("train", refused(ErrorCode.transport_ambiguous)),
        (
            "find",
            Envelope(
                ok=False, live_api_contacted=False, notice=None, error=ApiError(code="timeout", message="x")
            ),
        ),
    ],
)
def test_a_result_is_the_envelope_its_output_schema_describes(name, env):
    structured, text = tools.result(env)
    assert json.loads(text) == structured
    assert text == msgspec.json.encode(env).decode()  # the line `ecc ito --json` prints
    jsonschema.validate(structured, tools.output_schema(tools.TOOLS[name]))


@pytest.mark.parametrize(
    "name, arguments, code",
    [
        (
            "cancel",
            {"run_id": "run-1", "idempotency_key": "k", "confirmation_ref": "cf_1"},
            "transport_ambiguous",
        ),
        ("approve", {"run_id": "run-1", "idempotency_key": "k", "reject": True}, "transport_ambiguous"),
        ("status", {"run_id": "run-1"}, "timeout"),  # a read changed nothing: it says so
    ],
)
def test_a_lost_answer_is_the_clis_rule_for_the_verb(logged_in, monkeypatch, name, arguments, code):
    async def call(self, endpoint, request):
        raise transport.SentButUnanswered()

    monkeypatch.setattr(transport.Client, "call", call)
    env = asyncio.run(tools.call(name, arguments, BOUNDS))
    assert not env.ok and env.live_api_contacted and env.error.code == code


def test_runs_takes_the_states_by_name_and_sends_the_request(logged_in, monkeypatch):
    from contracts.api import RunList, RunsRequest

    schema = tools.input_schema(tools.TOOLS["runs"])
    assert (
        set(schema["properties"]) == {"state", "booking_id", "limit", "cursor"} and schema["required"] == []
    )
    assert "running" in json.dumps(schema)  # the allowed states are in the schema, for the agent
    asked = []

    async def call(self, endpoint, request):
        asked.append((endpoint.subject, request))
        return Envelope(ok=True, live_api_contacted=True, notice=None, data=RunList(runs=[]))

    monkeypatch.setattr(transport.Client, "call", call)
    env = asyncio.run(tools.call("runs", {"state": "running", "limit": 5}, BOUNDS))
    assert env.ok and asked == [(API["runs"].subject, RunsRequest(state=RunState.running, limit=5))]
    env = asyncio.run(tools.call("runs", {"state": "bogus"}, BOUNDS))
    assert not env.ok and env.error.code == "request_invalid" and len(asked) == 1


def test_a_manifest_given_by_content_is_stored_0600_and_read_as_the_same_file(
    logged_in, nothing_sent, tmp_path
):
    path = write_manifest(tmp_path)
    text = path.read_text()
    request, where = tools.decode(tools.TOOLS["plan"], {"booking_id": "b", "manifest_json": text})
    digest = verbs.load_manifest(str(path))[1]
    assert (request.manifest_text, request.manifest_digest) == (text, digest)  # the file's own digest
    stored = manifest_store.directory() / f"{digest}.json"
    assert where == str(stored) and stored.read_text() == text
    assert stat.S_IMODE(stored.stat().st_mode) == 0o600
    assert stat.S_IMODE(stored.parent.stat().st_mode) == 0o700
    args = {"booking_id": "bk-1", "manifest_json": text, "idempotency_key": "mcp-1"}
    env = asyncio.run(tools.call("train", args, BOUNDS))  # the person confirms the stored file
    assert env.error.code == ErrorCode.confirmation_required and not env.live_api_contacted
    assert f"`ecc ito confirm --action train --booking bk-1 --manifest {stored}`" in env.error.message


def test_content_over_the_limit_writes_nothing_and_the_directory_stays_bounded(logged_in, monkeypatch):
    env = tools.decode(tools.TOOLS["plan"], {"booking_id": "b", "manifest_json": " " * (1024 * 1024 + 1)})
    assert isinstance(env, Envelope) and env.error.code == ErrorCode.manifest_too_large
    assert not manifest_store.directory().exists()
    monkeypatch.setattr(manifest_store, "KEEP", 2)
    paths = [manifest_store.store(f'{{"n": {n}}}') for n in range(3)]
    kept = sorted(str(p) for p in manifest_store.directory().iterdir())
    assert len(kept) == 2 and paths[-1] in kept


def _scripted_mutation(monkeypatch, answer_: Envelope) -> list:
    asked: list = []

    async def answer(verb, request, bounds):
        asked.append((verb, request))
        return answer_

    monkeypatch.setattr(verbs, "answer", answer)
    return asked


@pytest.mark.parametrize(
    "name, arguments, server, code, contacted",
    [
        # a finished run: the server's refusal, and no person is asked to confirm anything
        (
            "cancel",
            {"run_id": "run-1", "idempotency_key": "k"},
            "run_not_cancellable",
            "run_not_cancellable",
            True,
        ),
        (
            "cleanup",
            {"run_id": "run-1", "idempotency_key": "k"},
            "run_not_finished",
            "run_not_finished",
            True,
        ),
        (
            "approve",
            {"run_id": "run-1", "idempotency_key": "k"},
            "proposal_not_found",
            "proposal_not_found",
            True,
        ),
        # the run can change: only then the command for the person
        (
            "cancel",
            {"run_id": "run-1", "idempotency_key": "k"},
            "confirmation_required",
            "confirmation_required",
            True,
        ),
        (
            "cancel",
            {"run_id": "run-1", "idempotency_key": "k"},
            "transport_ambiguous",
            "confirmation_required",
            False,
        ),
    ],
)
def test_a_run_mutation_without_a_ref_is_checked_by_the_server_before_a_person_is_asked(
    logged_in, monkeypatch, name, arguments, server, code, contacted
):
    asked = _scripted_mutation(monkeypatch, refused(ErrorCode(server)))
    env = asyncio.run(tools.call(name, arguments, BOUNDS))
    assert [verb for verb, _ in asked] == [name]
    assert not env.ok and env.error.code == code and env.live_api_contacted is contacted
    if code == "confirmation_required":
        assert f"`ecc ito confirm --action {name} --run run-1`" in env.error.message


def test_a_replayed_cancel_without_a_ref_is_the_servers_replay(logged_in, monkeypatch):
    from contracts.api import Action, MutationResult

    done = MutationResult(
        run_id="run-1",
        action=Action.cancel,
        state=RunState.cancelled,
        replay=True,
        booking_id="bk-1",
        manifest_digest="d" * 64,
        idempotency_key="k",
    )
    _scripted_mutation(monkeypatch, Envelope(ok=True, live_api_contacted=True, notice=None, data=done))
    env = asyncio.run(tools.call("cancel", {"run_id": "run-1", "idempotency_key": "k"}, BOUNDS))
    assert env.ok and env.data.replay is True


def running(step: int, state: RunState = RunState.running) -> Envelope:
    v = msgspec.structs.replace(view(state), stage="pretrain", step=step, total_steps=30, loss=2.5)
    return Envelope(ok=True, live_api_contacted=True, notice=None, data=v)


def test_wait_reports_progress_on_every_change_and_takes_a_bound_over_300_s(logged_in, monkeypatch):
    answers = [ok(RunState.queued), running(1), running(1), running(7), ok(RunState.succeeded)]
    asked = _scripted_status(monkeypatch, answers)
    heard: list[tuple[float, float | None, str]] = []

    async def progress(done, total, message):
        heard.append((done, total, message))

    env = asyncio.run(tools.call("wait", {"run_id": "run-1", "max_wait_s": 900}, BOUNDS, progress))
    assert env.ok and env.data.state == RunState.succeeded and len(asked) == 5
    assert [m for _, _, m in heard] == [
        "queued",
        "running pretrain: step 1/30, loss 2.5",
        "running pretrain: step 7/30, loss 2.5",
    ]
    assert all(total == 900 for _, total, _ in heard)
    assert [d for d, _, _ in heard] == sorted({d for d, _, _ in heard})  # it only grows
    env = asyncio.run(tools.call("wait", {"run_id": "run-1", "max_wait_s": tools.MAX_WAIT_S + 1}, BOUNDS))
    assert env.error.code == ErrorCode.request_invalid


def test_the_listed_output_schema_holds_every_answer_the_full_one_does():
    for env in (ok(RunState.running), refused(ErrorCode.timeout)):
        structured, _ = tools.result(env)
        jsonschema.validate(structured, tools.LISTED_OUTPUT_SCHEMA)
        jsonschema.validate(structured, tools.output_schema(tools.TOOLS["status"]))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"ok": True, "notice": None}, tools.LISTED_OUTPUT_SCHEMA)
