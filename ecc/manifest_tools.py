"""Two MCP tools that call no server and need no login: `validate` (a manifest checked against its
JSON Schema, every problem at once: contracts/manifest_check.py) and `manifest_schema` (that schema), so
that an agent learns the manifest's fields from the schema, not one refusal at a time.

Kept apart from `ecc.tools` (the API verbs' tools): `ecc.mcp_server` lists these after those and
routes their calls here. Each description is one line: every tool definition counts against the
catalogue's size budget.
"""

from dataclasses import dataclass
from typing import Any

from contracts import manifest_check
from contracts.envelope import Envelope
from contracts.errors import ErrorCode
from ecc.manifest_file import DEFAULT_MAX_BYTES
from ecc.transport import local_error
from ecc.verb_help import VERB_HELP


@dataclass(frozen=True, slots=True)
class LocalTool:
    name: str
    description: str
    input_schema: dict[str, Any]
    answer: Any  # its Envelope's data type

    @property
    def hints(self) -> dict[str, bool]:
        return {"read_only_hint": True}


VALIDATE_INPUT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "manifest": {"type": "string", "description": "absolute path of the manifest"},
        "manifest_json": {"type": "string", "description": "or the manifest's JSON itself"},
    },
    "additionalProperties": False,
}

TOOLS: dict[str, LocalTool] = {
    t.name: t
    for t in (
        LocalTool(
            "validate",
            VERB_HELP["validate"] + "; give manifest (a path) or manifest_json.",
            VALIDATE_INPUT,
            manifest_check.Checked,
        ),
        LocalTool(
            "manifest_schema",
            "the manifest's JSON Schema: every field, its type, bounds, default and allowed values "
            "(sends nothing).",
            {"type": "object", "properties": {}, "additionalProperties": False},
            dict[str, Any],
        ),
    )
}


def call(name: str, arguments: dict[str, Any]) -> Envelope[Any]:
    """One call of a local tool, answered as the envelope (nothing leaves this process)."""
    from ecc import verbs

    if name == "manifest_schema":
        if arguments:
            return local_error(ErrorCode.request_invalid, "manifest_schema takes no arguments")
        return Envelope(ok=True, live_api_contacted=False, notice=None, data=manifest_check.schema())
    unknown = sorted(set(arguments) - set(VALIDATE_INPUT["properties"]))
    path, text = arguments.get("manifest"), arguments.get("manifest_json")
    if unknown or (path is None) == (text is None):
        return local_error(
            ErrorCode.request_invalid,
            "give exactly one of manifest (an absolute path) and manifest_json (the JSON)"
            + (f"; unknown argument {', '.join(unknown)}" if unknown else ""),
        )
    if not isinstance(path or text, str):
        return local_error(ErrorCode.request_invalid, "manifest and manifest_json are strings")
    if path is not None:
        return verbs.validate(path=path)
    assert isinstance(text, str)
    size = len(text.encode("utf-8"))
    if size > DEFAULT_MAX_BYTES:  # the cap a manifest file has
        return local_error(
            ErrorCode.manifest_too_large, f"the manifest is {size} bytes; the limit is {DEFAULT_MAX_BYTES}"
        )
    return verbs.validate(text=text)
