"""The agents' door without the SDK: which verbs an agent may call, their schemas, a call's rules.

A tool is an `ecc ito` verb (contracts/endpoints.py `API`) less what an agent may never do: there
is no `confirm` (a confirmation authorises spending; a person creates it and hands the agent its
opaque reference) and no `login`/`logout` (a person logs in; the agent never sees a key). `wait`
is added: `status` polled until the run ends, with a bound.

Each tool's input schema is msgspec's JSON Schema of its verb's request type less the deprecated
`credential` field, with `manifest` (an absolute path, read by the CLI's own safe reader) in place
of `manifest_text`/`manifest_digest`; its output schema is the Envelope of the verb's answer type.
Its description is the CLI's help (ecc/verb_help.py) and what an agent must know besides.

A call: the stored login, or `unauthenticated` saying a person must log in; the arguments decoded
into the request type (an argument the schema does not list is `request_invalid`); a mutation
without a confirmation_ref answered `confirmation_required` here, nothing sent, with the exact
`ecc ito confirm` command for the person; then `verbs.answer`, the CLI's own bounded call. No
answer ever carries the stored key (`guarded`). The SDK's wiring is `ecc.mcp_server`.
"""

import asyncio
import functools
import shlex
import time
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from contracts.api import ApproveRequest, CancelRequest, CleanupRequest, RunView, StatusRequest, TrainRequest
from contracts.endpoints import API
from contracts.envelope import Envelope
from contracts.errors import ErrorCode
from contracts.states import TERMINAL_STATES, RunState
from ecc import credentials, render, verbs
from ecc.transport import KEY_PREFIX, local_error
from ecc.verb_help import OPTION_HELP, VERB_HELP, for_tools, option_help

POLL_EVERY_S = 1.0  # as `ecc ito status --follow` polls
DEFAULT_WAIT_S = 30.0  # under the tool-call timeout of common MCP clients (about a minute)
MAX_WAIT_S = 300.0  # a longer wait is a loop of calls: the agent keeps control between them
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


class DownloadToolRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`download`'s arguments: the whole ready export into a directory the agent names (the CLI's
    `ecc ito download`, chunked, resumable and digest-checked), not one chunk."""

    run_id: str
    to: str
    export_id: str | None = None


LOGIN_NOTE = (
    "unauthenticated or credential_revoked: a person must log in (`ecc ito login`); stop and ask, "
    "never retry."
)
MUTATION_NOTE = (
    "Spends or changes a run, so it needs a confirmation_ref that a person created with `ecc ito "
    "confirm`: you cannot create one. Without it this answers confirmation_required (nothing is sent) "
    "with the exact command for your person to run. Give each request its own idempotency_key and "
    "reuse it on a retry: it is applied at most once. transport_ambiguous: it may have taken effect; "
    "ask status first (a train by its idempotency_key, otherwise by run_id) and retry only with the "
    "same idempotency_key."
)
AGENT_NOTES: dict[str, str] = {
    "auth": "The account of the login a person made; no key is ever shown.",
    "find": "A booking with allows_training true can be planned and trained on.",
    "plan": "Creates nothing and spends nothing: show the plan, its checks and its cost to your "
    "person, who confirms it. manifest: an absolute path on this machine.",
    "train": "manifest: the same absolute path the person confirmed. " + MUTATION_NOTE,
    "runs": "Your account's runs only, newest first. Pages: pass the answer's next as cursor for the "
    "older ones (next null: no more); a filtered page may be short and still have a next.",
    "status": "By run_id, or by the idempotency_key a train was sent with (how a transport_ambiguous "
    "train is resolved).",
    "wait": f"Polls status every {POLL_EVERY_S:g} s until the run ends (succeeded, failed, gate_failed, "
    "cancelled) or pauses for a person's decision (awaiting_approval), or max_wait_s passes (then "
    "notice says it is still going: call wait again). Stops at once on any refusal, "
    "credential_revoked included, and returns it.",
    "logs": "Pages: pass the answer's next as since for the following lines.",
    "metrics": "Pages: pass since to skip the points you have.",
    "checkpoints": "",
    "evals": "",
    "audit": "",
    "models": "Each model's digest is what a manifest's model.revision must be; model.base is its name.",
    "cancel": MUTATION_NOTE,
    "cleanup": "release_booking needs its own release_booking confirmation. " + MUTATION_NOTE,
    "approve": "reject needs no confirmation; an approval needs a restart_from_checkpoint one. "
    + MUTATION_NOTE,
    "export": "Idempotent: call again with the same arguments until state is ready (or failed, with "
    "a message); then download it by its export_id.",
    "download": "to: a directory on this machine (made 0700 when new); an interrupted download "
    "resumes when called again with the same arguments. Answers the files and the verified digest.",
    "sample": "Deterministic for the same arguments (seed). The answer's text is the completion alone.",
}
"""What an agent must know beyond the CLI's help line, by tool."""

INSTRUCTIONS = (
    "ito-training: managed LLM training on booked GPU compute. You can find bookings, plan, train, "
    "watch, cancel and clean up runs, and export, download and sample a trained model; you can never "
    "authorise spending. A person logs in (`ecc ito "
    "login`) and creates each confirmation (`ecc ito confirm ...`) and hands you "
    "its opaque confirmation_ref: a mutation without one answers confirmation_required with the "
    "command to ask them to run. Every answer is {ok, live_api_contacted, notice, data | "
    "error{code, message}}."
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
        return for_tools(f"{line}.\n{AGENT_NOTES[self.name]}\n{LOGIN_NOTE}".replace("\n\n", "\n"))

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
    )
}
"""Every tool: the API verbs but `confirm` (a person's), and `wait`; `download` fetches a whole export."""


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


@functools.cache  # a pure function of the types; callers read it, never change it
def input_schema(tool: Tool) -> dict[str, Any]:
    """The request type's JSON Schema as the tool takes it: no `credential`, `manifest` a path."""
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
    required = [f for f in root.get("required", []) if f in properties]
    schema: dict[str, Any] = {
        "type": "object",
        "properties": properties,
        "required": required + (["manifest"] if tool.reads_manifest else []),
        "additionalProperties": False,
    }
    used = _used(defs, properties)
    return {**schema, "$defs": used} if used else schema


@functools.cache
def output_schema(tool: Tool) -> dict[str, Any]:
    """The Envelope of the tool's answer type, with its root inlined (MCP wants an object there)."""
    root, defs = _inline_root(msgspec.json.schema(Envelope[tool.answer]))  # type: ignore[name-defined]  # a type held in a value
    return {**root, "$defs": defs}


def _invalid(message: str) -> Envelope[Any]:
    return local_error(ErrorCode.request_invalid, message)


def decode(tool: Tool, arguments: dict[str, Any]) -> tuple[Any, str | None] | Envelope[Any]:
    """(the typed request, the manifest path when the tool reads one) or why not; the manifest is
    read here, by the safe reader."""
    unknown = sorted(set(arguments) - set(input_schema(tool)["properties"]))
    if unknown:
        why = "; the server uses the stored login: no credential is ever an argument"
        return _invalid(f"unknown argument {', '.join(unknown)}" + (why if "credential" in unknown else ""))
    fields, path = dict(arguments), None
    if tool.reads_manifest:
        path = fields.pop("manifest", None)
        if not isinstance(path, str):
            return _invalid("manifest (the absolute path of the reviewed manifest) is required")
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
    return []


def _confirmation_required(commands: list[str], request: Any) -> Envelope[Any]:
    ask = " and ".join(f"`{c}`" for c in commands)
    booking = (
        f" ({BOOKING_PLACEHOLDER}: the run's booking_id, from status)" if BOOKING_PLACEHOLDER in ask else ""
    )
    return local_error(
        ErrorCode.confirmation_required,
        f"this needs a person's confirmation, which you cannot create: ask your person to run "
        f"{ask}{booking}, then call again with the confirmation_ref they give you and the same "
        f"idempotency_key ({request.idempotency_key}). Nothing was sent.",
    )


def _unauthenticated() -> Envelope[Any]:
    return local_error(
        ErrorCode.unauthenticated,
        "not logged in: a person must run `ecc ito login --account ACCOUNT` on this machine (an agent "
        "never handles the API key); nothing was sent",
    )


async def call(name: str, arguments: dict[str, Any], bounds: verbs.Bounds) -> Envelope[Any]:
    """One tool call, answered as the envelope; never the stored key in it."""
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
    if commands:
        return guarded(_confirmation_required(commands, request))
    if tool.verb == "status" and not (request.run_id or request.idempotency_key):
        return _invalid("give run_id or idempotency_key")
    if tool.name == "wait":
        return guarded(await wait(request, bounds))
    if tool.name == "download":
        from ecc import download

        return guarded(
            await download.download(
                request.run_id, request.export_id, request.to, bounds.connect_timeout_s, bounds.timeout_s
            )
        )
    return guarded(await verbs.answer(tool.verb, request, bounds))


async def wait(request: WaitRequest, bounds: verbs.Bounds) -> Envelope[Any]:
    """Status every POLL_EVERY_S until the run stops or pauses, a refusal, or `max_wait_s`.

    A poll whose answer was lost is tried again on the next tick; any other refusal is returned at
    once (credential_revoked: no login is attempted, the agent gets control back)."""
    status = StatusRequest(run_id=request.run_id, idempotency_key=request.idempotency_key)
    deadline = time.monotonic() + request.max_wait_s
    last: Envelope[Any] | None = None
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
