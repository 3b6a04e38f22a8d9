"""The agents' door without the SDK: which verbs an agent may call, their schemas, a call's rules.

A tool is an `ecc ito` verb (contracts/endpoints.py `API`) less what an agent may never do: there
is no `confirm` (a confirmation authorises spending; a person creates it and hands the agent its
opaque reference) and no `login`/`logout` (a person logs in; the agent never sees a key). `wait`
is added: `status` polled until the run ends, with a bound.

Each tool's input schema is msgspec's JSON Schema of its verb's request type less the deprecated
`credential` field, with `manifest` (an absolute path, read by the CLI's own safe reader) or
`manifest_json` (the manifest's text, stored 0600 by ecc/manifest_store.py and then read as a path)
in place of `manifest_text`/`manifest_digest`. `output_schema` is the Envelope of the verb's answer
type; the tool list carries `LISTED_OUTPUT_SCHEMA`, the envelope alone, the same for every tool:
the catalogue is an agent's context, and a full answer schema per tool weighed ~65 KB of it
(`CATALOGUE_MAX_BYTES` bounds it). Its description is the CLI's help (ecc/verb_help.py) and what an
agent must know besides; what every tool shares is said once, in `INSTRUCTIONS`.

A call: the stored login, or `unauthenticated` saying a person must log in; the arguments decoded
into the request type (an argument the schema does not list is `request_invalid`); a mutation
without a confirmation_ref answered `confirmation_required` with the exact `ecc ito confirm`
command for the person (a train here, nothing sent; a cancel, cleanup or approve after the server
has checked the run, so a finished run is `run_not_cancellable` before any person is asked); then
`verbs.answer`, the CLI's own bounded call. `wait` reports progress while it polls. No answer ever
carries the stored key (`guarded`). The SDK's wiring is `ecc.mcp_server`.
"""

import asyncio
import functools
import shlex
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from contracts.api import ApproveRequest, CancelRequest, CleanupRequest, RunView, StatusRequest, TrainRequest
from contracts.endpoints import API
from contracts.envelope import Envelope
from contracts.errors import ErrorCode
from contracts.files import (
    FileDeleteRequest,
    FileList,
    FilePurpose,
    FileRequest,
    FilesRequest,
    FileView,
    UploadKind,
    UploadView,
)
from contracts.manifest import DataFormat
from contracts.states import TERMINAL_STATES, RunState
from ecc import credentials, manifest_store, render, verbs
from ecc.transport import KEY_PREFIX, local_error
from ecc.verb_help import OPTION_HELP, VERB_HELP, for_tools, option_help

POLL_EVERY_S = 1.0  # as `ecc ito status --follow` polls
DEFAULT_WAIT_S = 30.0  # under the tool-call timeout of common MCP clients (about a minute)
MAX_WAIT_S = 3600.0  # an hour: a long stage in one call where the client allows it (progress keeps it alive)
PROGRESS_EVERY_S = 10.0  # a progress notification at least this often, and on every change of the run
CATALOGUE_MAX_BYTES = 20_000  # every tool definition together (tools/list as JSON): an agent's context
BOOKING_PLACEHOLDER = "BOOKING_ID"  # cleanup names a run, not its booking: the person fills it in
STOP_WAITING = TERMINAL_STATES | {RunState.awaiting_approval}  # awaiting_approval: a person decides


class WaitRequest(StatusRequest, frozen=True, kw_only=True):
    """`wait`'s arguments: `status`'s, and how long to poll for."""

    max_wait_s: Annotated[
        float,
        msgspec.Meta(
            gt=0,
            le=MAX_WAIT_S,
            description=f"stop polling after this many seconds (default {DEFAULT_WAIT_S:g}, "
            f"at most {MAX_WAIT_S:g}) and answer the run as it is",
        ),
    ] = DEFAULT_WAIT_S


Progress = Callable[[float, float | None, str], Awaitable[None]]
"""Reports `wait`'s progress: (seconds waited, max_wait_s, the run's state in words)."""


class DownloadToolRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`download`'s arguments: the whole ready export into a directory the agent names (the CLI's
    `ecc ito download`, chunked, resumable and digest-checked), not one chunk."""

    run_id: str
    to: str
    export_id: str | None = None


class UploadToolRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`upload`'s arguments: a whole file (or a checkpoint directory) on this machine, sent in parts
    and committed (the CLI's `ecc ito files upload` / `models upload`), not one part."""

    path: str
    kind: Literal["data", "model"] = "data"
    name: str | None = None
    purpose: Literal["train", "eval"] = "train"
    format: Literal["jsonl", "parquet"] | None = None


class FilesToolRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`files`' arguments: every file and upload under way, or one file by its id (the `file` verb)."""

    file_id: str | None = None


LOGIN_NOTE = (
    "unauthenticated or credential_revoked: a person must log in (`ecc ito login`); stop and ask, "
    "never retry."
)
MUTATIONS_SAID_ONCE = (
    "A mutation (train, cancel, cleanup, approve, file_delete) needs a confirmation_ref your person "
    "makes with `ecc ito confirm` (you cannot); without one: confirmation_required with the command to "
    "ask for (a run is checked first: e.g. run_not_cancellable asks no one). A new idempotency_key "
    "per request, the same on a retry; transport_ambiguous: ask status first."
)
AGENT_NOTES: dict[str, str] = {
    "auth": "",
    "find": "allows_training true: can be planned and trained on.",
    "plan": "Creates and spends nothing: show the plan, checks and cost to your person.",
    "train": "The manifest the person confirmed (its path or its text).",
    "runs": "next null: no more.",
    "status": "idempotency_key: the train's (resolves a transport_ambiguous train).",
    "wait": f"Polls every {POLL_EVERY_S:g} s until the run ends or awaits_approval, a refusal, or "
    "max_wait_s (then call again); progress notifications when asked.",
    "logs": "next: the since of later lines.",
    "metrics": "since: skip the points you have.",
    "checkpoints": "",
    "evals": "",
    "audit": "",
    "models": "digest: a manifest's model.revision; name: its model.base.",
    "cancel": "",
    "cleanup": "release_booking: its own confirmation.",
    "approve": "",  # its help says both ways
    "export": "Call again until state is ready (or failed); then download.",
    "download": "to: a directory here.",
    "sample": "Seeded: the same arguments give the same text.",
    "upload": "",
    "files": "",
    "file_delete": "",
    "connections": "",
}
"""What an agent must know beyond the CLI's help line, by tool."""

INSTRUCTIONS = (
    "ito-training: managed LLM training on booked GPU compute. You can find bookings, upload your "
    "person's data and models, plan, train, watch, cancel and clean up runs, and export, download "
    "and sample a trained model; you can never "
    "authorise spending. A person logs in (`ecc ito "
    "login`) and creates each confirmation (`ecc ito confirm ...`) and hands you "
    "its opaque confirmation_ref: a mutation without one answers confirmation_required with the "
    "command to ask them to run. " + MUTATIONS_SAID_ONCE + " " + LOGIN_NOTE + " A manifest is an "
    "absolute path on the machine "
    "this server runs on (manifest) or its JSON text (manifest_json), stored here 0600 and read as "
    "a file: the same bytes have the same digest either way. Every answer is {ok, "
    "live_api_contacted, notice, data | error{code, message}}: the data is the JSON `ecc ito --json` "
    "prints."
)
"""The server's instructions to the agent (MCP `initialize`): the division of labour."""


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    verb: str  # the API verb it calls (`wait` calls status)
    request: type  # what its arguments decode into
    answer: Any  # its Envelope's data type
    reads_manifest: bool
    read_only: bool
    destructive: bool = False

    @property
    def description(self) -> str:
        line = VERB_HELP[self.verb]
        if self.name == "wait":
            line += f"; {OPTION_HELP['status']['follow']}, within a bound"
        return for_tools(f"{line}. {AGENT_NOTES[self.name]}".strip())

    @property
    def hints(self) -> dict[str, bool]:
        """MCP tool annotations: a mutation with the same idempotency key has no further effect."""
        if self.read_only:
            return {"read_only_hint": True}
        return {"read_only_hint": False, "destructive_hint": self.destructive, "idempotent_hint": True}


def _tool(name: str, verb: str | None = None, **kind: bool) -> Tool:
    endpoint = API[verb or name]
    request = WaitRequest if name == "wait" else endpoint.request
    read_only = not kind.pop("mutation", False)
    return Tool(name, verb or name, request, endpoint.answer, read_only=read_only, **kind)


TOOLS: dict[str, Tool] = {
    t.name: t
    for t in (
        _tool("auth", reads_manifest=False),
        _tool("find", reads_manifest=False),
        _tool("plan", reads_manifest=True),
        _tool("train", reads_manifest=True, mutation=True),
        _tool("runs", reads_manifest=False),
        _tool("status", reads_manifest=False),
        _tool("wait", "status", reads_manifest=False),
        _tool("logs", reads_manifest=False),
        _tool("metrics", reads_manifest=False),
        _tool("checkpoints", reads_manifest=False),
        _tool("evals", reads_manifest=False),
        _tool("audit", reads_manifest=False),
        _tool("models", reads_manifest=False),
        _tool("cancel", reads_manifest=False, mutation=True, destructive=True),
        _tool("cleanup", reads_manifest=False, mutation=True, destructive=True),
        _tool("approve", reads_manifest=False, mutation=True, destructive=True),
        _tool("export", reads_manifest=False, mutation=True),  # writes the export; spends nothing
        Tool(
            "download",
            "download",
            DownloadToolRequest,
            render.Downloaded,
            reads_manifest=False,
            read_only=False,
        ),
        _tool("sample", reads_manifest=False),
        Tool("upload", "upload", UploadToolRequest, UploadView, reads_manifest=False, read_only=False),
        Tool("files", "files", FilesToolRequest, FileList, reads_manifest=False, read_only=True),
        _tool("file_delete", reads_manifest=False, mutation=True, destructive=True),
        _tool("connections", reads_manifest=False),
    )
}
"""Every tool: the API verbs but `confirm` (a person's), and `wait`; `download` fetches a whole export,
`upload` sends a whole file (its parts and commit are not tools of their own: FOLDED)."""
FOLDED = frozenset({"upload_part", "upload_commit", "file"})
"""API verbs an agent reaches through another tool (`upload`; `files` with a file_id), never by themselves."""


def _inline_root(schema: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the root object's schema, the other definitions) of msgspec's `{"$ref", "$defs"}`."""
    defs = dict(schema.get("$defs", {}))
    root = defs.pop(schema["$ref"].rsplit("/", 1)[1]) if "$ref" in schema else schema
    return root, defs


def _used(defs: dict[str, Any], within: Any) -> dict[str, Any]:
    """The definitions `within` refers to, directly or through each other."""
    kept: dict[str, Any] = {}
    pending = [within]
    while pending:
        text = msgspec.json.encode(pending.pop()).decode()
        for name, definition in defs.items():
            if name not in kept and f'"#/$defs/{name}"' in text:
                kept[name] = definition
                pending.append(definition)
    return kept


def compact(schema: Any) -> Any:
    """The same JSON Schema in fewer bytes, for the catalogue: `anyOf` of plain types as one `type`
    list, no null default (an optional field's default), no `title` (a definition is named by its key)."""
    if isinstance(schema, list):
        return [compact(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: compact(v) for k, v in schema.items() if k != "title" and not (k == "default" and v is None)}
    options = out.get("anyOf")
    if options and all(
        isinstance(o, dict) and set(o) == {"type"} and isinstance(o["type"], str) for o in options
    ):
        del out["anyOf"]
        out["type"] = [o["type"] for o in options]
    return out


MANIFEST_JSON_HELP = "the manifest's JSON text itself, instead of manifest (stored 0600 on this machine)"


@functools.cache  # a pure function of the types; callers read it, never change it
def input_schema(tool: Tool) -> dict[str, Any]:
    """The request type's JSON Schema as the tool takes it: no `credential`, the manifest as a
    path (`manifest`) or as its text (`manifest_json`), exactly one of them."""
    root, defs = _inline_root(msgspec.json.schema(tool.request))
    properties: dict[str, Any] = {}
    for field, spec in root["properties"].items():
        if field == "credential" or (tool.reads_manifest and field == "manifest_digest"):
            continue
        if tool.reads_manifest and field == "manifest_text":
            field, spec = "manifest", {"type": "string"}
        words = option_help(tool.verb, field)
        words = for_tools(words) if words else None
        properties[field] = {**spec, "description": words} if words and "description" not in spec else spec
        if tool.reads_manifest and field == "manifest":
            properties["manifest_json"] = {"type": "string", "description": MANIFEST_JSON_HELP}
    required = [f for f in root.get("required", []) if f in properties]
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }
    used = _used(defs, properties)
    return compact({**schema, "$defs": used} if used else schema)


@functools.cache
def output_schema(tool: Tool) -> dict[str, Any]:
    """The Envelope of the tool's answer type, with its root inlined (MCP wants an object there):
    every answer validates against it (tests/ecc/test_ecc_tools.py)."""
    root, defs = _inline_root(msgspec.json.schema(Envelope[tool.answer]))  # type: ignore[name-defined]  # a type held in a value
    return {**root, "$defs": defs}


LISTED_OUTPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "live_api_contacted": {"type": "boolean"},
        "notice": {"type": ["string", "null"]},
        "data": {},
        "error": {"type": ["object", "null"]},  # {code, message}: INSTRUCTIONS says so once
    },
    "required": ["ok", "live_api_contacted", "notice"],
}
"""What `tools/list` gives every tool as its output schema: the Envelope (contracts/envelope.py)
with `data` left open. Each tool's full schema (`output_schema`) is ~2-9 KB, mostly the same error
codes and types again: listed per tool they were most of a ~65 KB catalogue."""


def _invalid(message: str) -> Envelope[Any]:
    return local_error(ErrorCode.request_invalid, message)


def _manifest_path(fields: dict[str, Any]) -> str | Envelope[Any]:
    """The manifest's path: `manifest` as given, or where `manifest_json`'s text was stored."""
    path, text = fields.pop("manifest", None), fields.pop("manifest_json", None)
    if path is not None and text is not None:
        return _invalid("give manifest (a path) or manifest_json (the text), not both")
    if isinstance(text, str):
        return manifest_store.store(text)
    if not isinstance(path, str):
        return _invalid(
            "manifest (the absolute path of the reviewed manifest) or manifest_json (its text) is required"
        )
    return path


def decode(tool: Tool, arguments: dict[str, Any]) -> tuple[Any, str | None] | Envelope[Any]:
    """(the typed request, the manifest path when the tool reads one) or why not; the manifest is
    read here, by the safe reader (a `manifest_json` from the file it was stored in)."""
    unknown = sorted(set(arguments) - set(input_schema(tool)["properties"]))
    if unknown:
        why = "; the server uses the stored login: no credential is ever an argument"
        return _invalid(f"unknown argument {', '.join(unknown)}" + (why if "credential" in unknown else ""))
    fields, path = dict(arguments), None
    if tool.reads_manifest:
        where = _manifest_path(fields)
        if isinstance(where, Envelope):
            return where
        path = where
        read = verbs.load_manifest(path)
        if isinstance(read, Envelope):
            return read
        fields["manifest_text"], fields["manifest_digest"] = read
    try:
        return msgspec.convert(fields, tool.request), path
    except msgspec.ValidationError as exc:  # names the field and the type it wants; an enum's (runs' state) quotes the agent's own value back, and `guarded` withholds a key
        return _invalid(f"invalid arguments: {exc}")


def _confirm_command(action: str, **target: str) -> str:
    """The command a person runs: every value quoted for a shell, none of them secret."""
    words = ["ecc", "ito", "confirm", "--action", action]
    for flag, value in target.items():
        words += [f"--{flag}", shlex.quote(value)]
    return " ".join(words)


def confirmations_needed(request: Any, manifest_path: str | None) -> list[str]:
    """The `ecc ito confirm` commands a person must run before this request can go: none when it
    carries every confirmation it needs (the server still checks each)."""
    match request:
        case TrainRequest(confirmation_ref=ref) if not ref:
            assert manifest_path is not None, "train reads its manifest by path"
            return [_confirm_command("train", booking=request.booking_id, manifest=manifest_path)]
        case CancelRequest(confirmation_ref=ref) if not ref:
            return [_confirm_command("cancel", run=request.run_id)]
        case CleanupRequest():
            needed = [] if request.confirmation_ref else [_confirm_command("cleanup", run=request.run_id)]
            if request.release_booking and not request.release_confirmation_ref:
                needed.append(_confirm_command("release_booking", booking=BOOKING_PLACEHOLDER))
            return needed
        case ApproveRequest(confirmation_ref=ref, reject=False) if not ref:
            return [_confirm_command("restart_from_checkpoint", run=request.run_id)]
        case FileDeleteRequest(confirmation_ref=ref) if not ref:
            return [_confirm_command("delete_file", file=request.file_id)]
    return []


def _confirmation_required(commands: list[str], request: Any, checked: bool = False) -> Envelope[Any]:
    """`checked`: the server looked at the run and refused only for want of a confirmation."""
    ask = " and ".join(f"`{c}`" for c in commands)
    booking = (
        f" ({BOOKING_PLACEHOLDER}: the run's booking_id, from status)" if BOOKING_PLACEHOLDER in ask else ""
    )
    return local_error(
        ErrorCode.confirmation_required,
        f"this needs a person's confirmation, which you cannot create: ask your person to run "
        f"{ask}{booking}, then call again with the confirmation_ref they give you and the same "
        f"idempotency_key ({request.idempotency_key}). "
        + ("Nothing was changed." if checked else "Nothing was sent."),
        contacted=checked,
    )


async def _checked_first(
    tool: Tool, request: Any, commands: list[str], bounds: verbs.Bounds
) -> Envelope[Any]:
    """A run mutation without its confirmation is sent as it is: the server checks the run (found,
    a replay of this key, in a state this can change) before the confirmation, and without one it
    changes nothing. Only its `confirmation_required` becomes the commands for the person; a lost
    answer, which cannot have changed anything either, does too."""
    env = await verbs.answer(tool.verb, request, bounds)
    if env.ok or env.error is None:
        return env
    if env.error.code == ErrorCode.confirmation_required:
        return _confirmation_required(commands, request, checked=True)
    if env.error.code == ErrorCode.transport_ambiguous:
        return _confirmation_required(commands, request)
    return env


def _unauthenticated() -> Envelope[Any]:
    return local_error(
        ErrorCode.unauthenticated,
        "not logged in: a person must run `ecc ito login --account ACCOUNT` on this machine (an agent "
        "never handles the API key); nothing was sent",
    )


async def call(
    name: str, arguments: dict[str, Any], bounds: verbs.Bounds, progress: Progress | None = None
) -> Envelope[Any]:
    """One tool call, answered as the envelope; never the stored key in it. `progress`: where
    `wait` reports while it polls (the MCP client's progress token), if anywhere."""
    tool = TOOLS.get(name)
    if tool is None:
        return _invalid(f"no tool {name!r}; the tools are {', '.join(TOOLS)}")
    if credentials.load() is None:
        return _unauthenticated()
    decoded = decode(tool, arguments)
    if isinstance(decoded, Envelope):
        return guarded(decoded)
    request, path = decoded
    commands = confirmations_needed(request, path)
    if commands and tool.verb in verbs.MUTATIONS:
        return guarded(await _checked_first(tool, request, commands, bounds))
    if commands:
        return guarded(_confirmation_required(commands, request))
    if tool.verb == "status" and not (request.run_id or request.idempotency_key):
        return _invalid("give run_id or idempotency_key")
    if tool.name == "wait":
        return guarded(await wait(request, bounds, progress))
    if tool.name == "upload":
        return guarded(await _upload(request, bounds))
    if tool.name == "files":
        if request.file_id is None:
            return guarded(await verbs.answer("files", FilesRequest(), bounds))
        one = await verbs.answer("file", FileRequest(file_id=request.file_id), bounds)
        if one.ok and isinstance(one.data, FileView):  # the whole list's answer type: that file alone
            one = msgspec.structs.replace(one, data=FileList(files=[one.data]))
        return guarded(one)
    if tool.name == "download":
        from ecc import download

        return guarded(
            await download.download(
                request.run_id, request.export_id, request.to, bounds.connect_timeout_s, bounds.timeout_s
            )
        )
    return guarded(await verbs.answer(tool.verb, request, bounds))


async def _upload(request: UploadToolRequest, bounds: verbs.Bounds) -> Envelope[Any]:
    """The whole upload the CLI makes (ecc/upload.py); the path is the agent's machine's."""
    import pathlib

    from ecc import upload

    where = pathlib.Path(request.path).expanduser()
    if not where.is_absolute():
        return _invalid("path: an absolute path on this machine")
    try:
        if request.kind == "model":
            files = upload.model_files(where)
            kind = UploadKind.model
        else:
            files, kind = [(where, where.name)], UploadKind.data
    except upload.UploadFailed as exc:
        return local_error(exc.code, exc.message)
    return await upload.upload(
        kind,
        request.name or where.name,
        files,
        bounds.connect_timeout_s,
        bounds.timeout_s,
        purpose=FilePurpose(request.purpose),
        fmt=DataFormat(request.format) if request.format else None,
        progress=lambda _sent, _total: None,
    )


def progress_words(view: RunView) -> str:
    """A run's state as a progress notification says it: `running pretrain: step 12/30, loss 2.31`."""
    words = view.state.value + (f" {view.stage}" if view.stage else "")
    if view.total_steps:
        words += f": step {view.step}/{view.total_steps}"
    if view.loss is not None:
        words += f", loss {view.loss:.4g}"
    return words


async def wait(request: WaitRequest, bounds: verbs.Bounds, progress: Progress | None = None) -> Envelope[Any]:
    """Status every POLL_EVERY_S until the run stops or pauses, a refusal, or `max_wait_s`.

    A poll whose answer was lost is tried again on the next tick; any other refusal is returned at
    once (credential_revoked: no login is attempted, the agent gets control back). `progress` hears
    of every change of the run's state, stage or step, and at least every PROGRESS_EVERY_S; its
    value is the seconds waited (it only grows, as MCP requires), its total `max_wait_s`."""
    status = StatusRequest(run_id=request.run_id, idempotency_key=request.idempotency_key)
    started = time.monotonic()
    deadline = started + request.max_wait_s
    last: Envelope[Any] | None = None
    said: tuple[str, float] | None = None  # the last words reported, and when
    while True:
        env = await verbs.answer("status", status, bounds)
        lost = not env.ok and env.error is not None and env.error.code is ErrorCode.timeout
        if not env.ok and not lost:
            return env
        if env.ok:
            last = env
            assert isinstance(env.data, RunView), "status answers a RunView"
            if env.data.state in STOP_WAITING:
                return env
            words, now = progress_words(env.data), time.monotonic()
            if progress is not None and (
                said is None or said[0] != words or now - said[1] >= PROGRESS_EVERY_S
            ):
                await progress(round(now - started, 3), request.max_wait_s, words)
                said = (words, now)
        if time.monotonic() + POLL_EVERY_S >= deadline:
            break
        await asyncio.sleep(POLL_EVERY_S)
    if last is None:
        return local_error(
            ErrorCode.timeout,
            f"no status answer within {request.max_wait_s:g} s; nothing changed",
            contacted=True,
        )
    assert isinstance(last.data, RunView)
    return Envelope(
        ok=True,
        live_api_contacted=True,
        notice=f"still {last.data.state} after {request.max_wait_s:g} s: call wait again to keep watching",
        data=last.data,
    )


_encoder = msgspec.json.Encoder()


def guarded(env: Envelope[Any]) -> Envelope[Any]:
    """The envelope, unless it holds the stored API key (or the seed inside it): then `internal`,
    and the answer is withheld. No answer has ever held one; this makes sure none can."""
    stored = credentials.load()
    if stored is None:
        return env
    key = stored[1]
    text = _encoder.encode(env).decode()
    secrets = {key, key.removeprefix(KEY_PREFIX)} - {""}
    if any(s in text for s in secrets):
        return local_error(
            ErrorCode.internal,
            "the answer held the stored credential and was withheld",
            contacted=env.live_api_contacted,
        )
    return env


def result(env: Envelope[Any]) -> tuple[dict[str, Any], str]:
    """The envelope as MCP structured content and as text: the same JSON `ecc ito --json` prints."""
    return msgspec.to_builtins(env), _encoder.encode(env).decode()
