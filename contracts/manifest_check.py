"""The manifest checked against its JSON Schema: every problem at once, each with its JSON path,
line and column, and the values that would be allowed.

One source: the schema is msgspec's, generated from the `Manifest` contract (`schema()`; the
committed examples/manifests/manifest.schema.json is this text, and a test keeps it so). The check
walks the parsed JSON against that schema, so it reports every mistake where msgspec's decoder
stops at the first; the contract's strict decode then runs as the last word, so nothing this
accepts can fail to decode. Both sides use it: `ecc ito validate` (and the MCP `validate` tool)
before anything is sent, and the server's refusal (`manifest_invalid`), which lists the same
problems. It lives in `ecc` because the client imports no service.

What the schema cannot say (a base model in the store, data files, the stages' budget) the server
checks when it plans the run.
"""

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from contracts.manifest import Manifest

SCHEMA_TITLE = "ito-training manifest"
MAX_SHOWN = 50  # problems listed in one message; a file with more is mostly wrong: fix these first
MAX_FOUND = 1000  # problems collected before the walk stops: the work is bounded by this, not the input
MAX_ALLOWED_SHOWN = 40  # allowed values listed for one problem
KNOWN_KEYWORDS = frozenset(
    {
        "$ref",
        "$defs",
        "title",
        "description",
        "default",
        "type",
        "enum",
        "anyOf",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
    }
)
"""The keywords msgspec writes for the Manifest, and all this checker reads: a test fails when the
schema starts using another one."""


@functools.cache
def schema() -> dict[str, Any]:
    """The manifest's JSON Schema, from the contract (a fresh copy is `json.loads(schema_text())`)."""
    generated = msgspec.json.schema(Manifest)
    generated["title"] = SCHEMA_TITLE
    return generated


def schema_text() -> str:
    """The schema as examples/manifests/manifest.schema.json holds it."""
    return json.dumps(schema(), indent=2, sort_keys=True) + "\n"


@dataclass(frozen=True, slots=True)
class Problem:
    path: str  # "$.target.tokens", as msgspec names it
    line: int  # 1-based; where the value (or, for an unknown field, its key) starts
    column: int  # 1-based, in characters
    message: str
    allowed: tuple[str, ...] = ()  # the values (or field names) that would be accepted

    def describe(self) -> str:
        shown = self.allowed[:MAX_ALLOWED_SHOWN]
        more = f", ... ({len(self.allowed) - len(shown)} more)" if len(self.allowed) > len(shown) else ""
        allowed = f"; allowed: {', '.join(shown)}{more}" if self.allowed else ""
        return f"{self.path} (line {self.line}, column {self.column}): {self.message}{allowed}"


class Checked(msgspec.Struct, frozen=True, kw_only=True):
    """`ecc ito validate`'s answer for a manifest that passed: what the server would read."""

    valid: bool
    name: str
    manifest_digest: str  # SHA-256 of the exact bytes, as plan and train send it
    note: str = "the server checks the model, the data files and the plan at `ecc ito plan`"


def check(text: str) -> tuple[Manifest | None, list[Problem]]:
    """(the manifest, []) or (None, the problems in the order they appear in the text: every one,
    up to MAX_FOUND; a manifest with more is refused with those, `message` says there are more).

    Bounded in work whatever the input: the walk stops at MAX_FOUND problems and does not visit the
    items of an array longer than its schema allows; positions come from one scan of the text, and
    line and column from one pass over the sorted offsets (a manifest of 100,000 empty data entries
    is refused in milliseconds, not seconds)."""
    data = text.encode("utf-8")
    try:
        value = msgspec.json.decode(data)
    except msgspec.DecodeError as exc:
        return None, [_not_json(text, data, str(exc))]
    except RecursionError:
        return None, [Problem("$", 1, 1, "the manifest is nested too deeply")]
    found: list[_Found] = []
    try:
        _walk(value, schema(), (), found, schema()["$defs"])
    except _Enough:
        pass
    if not found:
        try:
            return msgspec.convert(value, Manifest), []
        except msgspec.ValidationError as exc:  # the contract's last word (the schema said yes)
            found.append(_Found(_msgspec_path(str(exc)), str(exc).split(" - at ")[0], ()))
    return None, _Positions(text, found).problems(found)


def message(problems: list[Problem]) -> str:
    """Every problem in one message, one a line: what the CLI prints and the server refuses with."""
    if len(problems) == 1 and problems[0].message.startswith("not valid JSON"):
        p = problems[0]
        return f"the manifest is not valid JSON: line {p.line}, column {p.column}: {p.message[16:]}"
    shown = problems[:MAX_SHOWN]
    more = f"\n- ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    if len(problems) >= MAX_FOUND:
        more = f"\n- ... and more (the check stops at {MAX_FOUND} problems)"
    count = "1 problem" if len(problems) == 1 else f"{len(problems)} problems"
    if len(problems) >= MAX_FOUND:
        count = f"at least {MAX_FOUND} problems"
    return f"invalid manifest, {count}:\n" + "\n".join(f"- {p.describe()}" for p in shown) + more


# --- not JSON ---

_BYTE = re.compile(r"\(byte (\d+)\)")


def _not_json(text: str, data: bytes, why: str) -> Problem:
    """Where msgspec stopped reading (its byte offset; the end for truncated input), as line/column."""
    m = _BYTE.search(why)
    offset = len(text) if m is None else len(data[: int(m[1])].decode("utf-8", "replace"))
    reason = _BYTE.sub("", why).replace("JSON is malformed: ", "").strip()
    if reason == "Input data was truncated":
        reason = "it ends before the JSON does (a missing closing bracket or quote?)"
    line, column = _line_column(text, offset)
    return Problem("$", line, column, f"not valid JSON: {reason}")


def _line_column(text: str, offset: int) -> tuple[int, int]:
    line = text.count("\n", 0, offset) + 1
    return line, offset - (text.rfind("\n", 0, offset) + 1) + 1


# --- the walk ---

Path = tuple[str | int, ...]


class _Enough(Exception):
    """MAX_FOUND problems found: the walk stops."""


def _add(found: "list[_Found]", f: "_Found") -> None:
    found.append(f)
    if len(found) >= MAX_FOUND:
        raise _Enough


@dataclass(frozen=True, slots=True)
class _Found:
    path: Path
    message: str
    allowed: tuple[str, ...]
    at_key: bool = False  # an unknown field: point at its key, not its value


def _kind(value: Any) -> str:
    match value:
        case None:
            return "null"
        case bool():
            return "a boolean"
        case int():
            return "an integer"
        case float():
            return "a number"
        case str():
            return "a string"
        case list():
            return "an array"
        case _:
            return "an object"


_TYPE_WORDS = {
    "object": "an object",
    "array": "an array",
    "string": "a string",
    "integer": "an integer",
    "number": "a number",
    "boolean": "a boolean",
    "null": "null",
}


def _is_type(value: Any, type_: str) -> bool:
    match type_:
        case "null":
            return value is None
        case "boolean":
            return isinstance(value, bool)
        case "integer":  # as msgspec: 1.0 is not an integer, true is not a number
            return isinstance(value, int) and not isinstance(value, bool)
        case "number":
            return isinstance(value, int | float) and not isinstance(value, bool)
        case "string":
            return isinstance(value, str)
        case "array":
            return isinstance(value, list)
        case "object":
            return isinstance(value, dict)
    raise AssertionError(f"a JSON Schema type this checker does not know: {type_}")


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _resolve(s: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in s:
        s = defs[s["$ref"].rsplit("/", 1)[1]]
    return s


def _fits_kind(value: Any, s: dict[str, Any], defs: dict[str, Any]) -> bool:
    """Whether `value` is of the kind a branch of an anyOf takes (its errors are then the ones to show)."""
    s = _resolve(s, defs)
    if "type" in s:
        return _is_type(value, s["type"])
    if "enum" in s:
        return any(type(value) is type(v) for v in s["enum"])
    return True


def _expected(s: dict[str, Any], defs: dict[str, Any]) -> str:
    s = _resolve(s, defs)
    if "enum" in s:
        return "one of " + ", ".join(_shown(v) for v in s["enum"])
    words = _TYPE_WORDS.get(s.get("type", ""), "a value")
    return f"{words} ({s['title']})" if "title" in s and s.get("type") == "object" else words


def _walk(value: Any, s: dict[str, Any], path: Path, found: list[_Found], defs: dict[str, Any]) -> None:
    s = _resolve(s, defs)
    if "anyOf" in s:
        _any_of(value, s["anyOf"], path, found, defs)
        return
    if "enum" in s and value not in s["enum"]:
        allowed = tuple(str(v) for v in s["enum"])
        _add(found, _Found(path, f"{_shown(value)} is not allowed", allowed))
        return
    if "type" in s and not _is_type(value, s["type"]):
        _add(found, _Found(path, f"expected {_expected(s, defs)}, got {_kind(value)}", ()))
        return
    if isinstance(value, dict):
        _object(value, s, path, found, defs)
    elif isinstance(value, list):
        _array(value, s, path, found, defs)
    elif isinstance(value, str):
        _bounds(len(value), s, "minLength", "maxLength", "characters", path, found)
    elif isinstance(value, int | float) and not isinstance(value, bool):
        _number(value, s, path, found)


def _any_of(
    value: Any, branches: list[dict[str, Any]], path: Path, found: list[_Found], defs: dict[str, Any]
) -> None:
    """Accepted by one branch: fine. Else the errors of the branch of the value's kind (a bad size
    says what the sizes are, and that null is allowed too); else what kinds would do."""
    attempts = []
    for branch in branches:
        errors: list[_Found] = []
        try:
            _walk(value, branch, path, errors, defs)
        except _Enough:  # this branch alone is MAX_FOUND problems: it does not fit, the rest is noise
            pass
        if not errors:
            return
        attempts.append((branch, errors))
    nullable = any(_resolve(b, defs).get("type") == "null" for b in branches)
    fitting = [(b, e) for b, e in attempts if _fits_kind(value, b, defs)]
    if len(fitting) == 1:
        for f in fitting[0][1]:
            extra = ("null",) if nullable and f.path == path and f.allowed else ()
            _add(found, _Found(f.path, f.message, f.allowed + extra, f.at_key))
        return
    kinds = " or ".join(_expected(b, defs) for b in branches)
    allowed = tuple(str(v) for b in branches for v in _resolve(b, defs).get("enum", []))
    _add(
        found,
        _Found(
            path,
            f"expected {kinds}, got {_kind(value)}",
            allowed + (("null",) if allowed and nullable else ()),
        ),
    )


def _object(
    value: dict[str, Any], s: dict[str, Any], path: Path, found: list[_Found], defs: dict[str, Any]
) -> None:
    properties: dict[str, Any] = s.get("properties", {})
    for name in s.get("required", []):
        if name not in value:
            _add(found, _Found(path, f"missing required field `{name}`", ()))
    for key, item in value.items():
        if key in properties:
            _walk(item, properties[key], (*path, key), found, defs)
        elif s.get("additionalProperties") is False:
            _add(found, _Found((*path, key), f"unknown field `{key}`", tuple(properties), at_key=True))


def _array(
    value: list[Any], s: dict[str, Any], path: Path, found: list[_Found], defs: dict[str, Any]
) -> None:
    _bounds(len(value), s, "minItems", "maxItems", "items", path, found)
    if "maxItems" in s and len(value) > s["maxItems"]:
        return  # too long is the problem; its items are not looked at (bounded work)
    if "items" in s:
        for i, item in enumerate(value):
            _walk(item, s["items"], (*path, i), found, defs)


def _bounds(
    size: int, s: dict[str, Any], low: str, high: str, unit: str, path: Path, found: list[_Found]
) -> None:
    if low in s and size < s[low]:
        _add(found, _Found(path, f"needs at least {s[low]} {unit}, has {size}", ()))
    if high in s and size > s[high]:
        _add(found, _Found(path, f"takes at most {s[high]} {unit}, has {size}", ()))


def _number(value: float, s: dict[str, Any], path: Path, found: list[_Found]) -> None:
    rules: tuple[tuple[str, Callable[[float], bool], str], ...] = (
        ("minimum", lambda b: value >= b, ">="),
        ("exclusiveMinimum", lambda b: value > b, ">"),
        ("maximum", lambda b: value <= b, "<="),
        ("exclusiveMaximum", lambda b: value < b, "<"),
    )
    broken = [f"{sign} {s[k]}" for k, holds, sign in rules if k in s and not holds(s[k])]
    if broken:
        limits = " and ".join(f"{sign} {s[k]}" for k, _, sign in rules if k in s)
        _add(found, _Found(path, f"must be {limits}, got {_shown(value)}", ()))


# --- where each value is in the text ---

_scanstring = json.decoder.scanstring  # type: ignore[attr-defined]  # public in json.decoder, untyped in typeshed
_SCALAR = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?|true|false|null")
_SPACE = re.compile(r"[ \t\n\r]*")


class _Located(Exception):
    """Every wanted position is known: the scan stops."""


class _Positions:
    """The offset of the values (and object keys) the problems in `found` are at, in a valid JSON
    text, by path; made only for a manifest with problems, and scanned only as far as the last of
    them (a problem in the first of 100,000 entries does not read the other 99,999)."""

    def __init__(self, text: str, found: list[_Found]) -> None:
        self.text = text
        self.values: dict[Path, int] = {}
        self.keys: dict[Path, int] = {}
        self._want_values = {f.path for f in found if not f.at_key} | {f.path for f in found}
        self._want_keys = {f.path for f in found if f.at_key}
        try:
            self._value(self._ws(0), ())
        except _Located:
            pass
        except (RecursionError, IndexError, ValueError):  # positions are a help: `$` still names it
            pass

    def _seen(self, wanted: set[Path], path: Path) -> None:
        wanted.discard(path)
        if not self._want_values and not self._want_keys:
            raise _Located

    def offset(self, f: _Found) -> int:
        offset = (self.keys if f.at_key else self.values).get(f.path)
        if offset is None:
            offset = self.values.get(f.path, self.values.get((), 0))
        return offset

    def problems(self, found: list[_Found]) -> list[Problem]:
        """The problems in text order, each with its line and column: one pass over the text for
        all of them (a line count per problem would be quadratic in a manifest with many)."""
        placed = sorted(((self.offset(f), _path_text(f.path), i) for i, f in enumerate(found)))
        out, line, line_start, at = [], 1, 0, 0
        for offset, path, i in placed:
            newlines = self.text.count("\n", at, offset)
            if newlines:
                line += newlines
                line_start = self.text.rfind("\n", at, offset) + 1
            at = offset
            f = found[i]
            out.append(Problem(path, line, offset - line_start + 1, f.message, f.allowed))
        return out

    def _ws(self, i: int) -> int:
        m = _SPACE.match(self.text, i)
        return m.end() if m else i

    def _value(self, i: int, path: Path) -> int:
        self.values[path] = i
        if path in self._want_values:
            self._seen(self._want_values, path)
        c = self.text[i]
        if c == "{":
            return self._object(self._ws(i + 1), path)
        if c == "[":
            return self._array(self._ws(i + 1), path)
        if c == '"':
            end: int = _scanstring(self.text, i + 1)[1]
            return end
        m = _SCALAR.match(self.text, i)
        if m is None:
            raise ValueError(f"no JSON value at {i}")
        return m.end()

    def _object(self, i: int, path: Path) -> int:
        if self.text[i] == "}":
            return i + 1
        while True:
            key, after = _scanstring(self.text, i + 1)
            self.keys[(*path, key)] = i
            if (*path, key) in self._want_keys:
                self._seen(self._want_keys, (*path, key))
            i = self._ws(self._ws(after) + 1)  # past the colon
            i = self._ws(self._value(i, (*path, key)))
            if self.text[i] == "}":
                return i + 1
            i = self._ws(i + 1)  # past the comma

    def _array(self, i: int, path: Path) -> int:
        if self.text[i] == "]":
            return i + 1
        index = 0
        while True:
            i = self._ws(self._value(i, (*path, index)))
            if self.text[i] == "]":
                return i + 1
            i, index = self._ws(i + 1), index + 1


def _path_text(path: Path) -> str:
    return "$" + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path)


_AT = re.compile(r" - at `\$([^`]*)`")
_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def _msgspec_path(why: str) -> Path:
    """msgspec's `- at `$.a.b[1]`` as a path."""
    m = _AT.search(why)
    if m is None:
        return ()
    return tuple(int(i) if i else k for k, i in _STEP.findall(m[1]))
