"""What a good row of a JSONL or Parquet data file is, row by row: the rules an upload is checked
against (and a `file:` or `s3://` file at plan time), so that a file a stage cannot read is refused
with every problem at once, each at its 1-based line (JSONL) or row (Parquet), before anything is
reserved or paid for; the fine-tuning APIs' file validation does the same.

Pure: a row is a decoded JSON object (or a Parquet row as a dict); the I/O that reads the file,
counts its lines and hashes its bytes is runtime/storage/data_checks.py.

The kinds of row (the schemas of domain/data_schemas.py, by the columns they have):

    text          text: string                                next-token stages, held-out text
    messages      messages: [{role, content}, ...]            sft, a chat eval split
    preference    prompt, chosen, rejected: strings           dpo
    verifiable    prompt, answer: strings                     rlvr

A row may be of several kinds (a `text` beside `prompt` and `answer`). A column the row has is
checked whatever stage reads it: a `messages` with a role no chat template knows is a problem even
in a file only pretraining reads. A file's kinds are its first good row's; every other row must
have them too (a file mixing chat rows and text rows is refused, naming the first row that differs).
"""

from collections.abc import Mapping
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
"""The roles chat templates render (OpenAI's fine-tuning files allow the same four)."""
KINDS: dict[str, tuple[str, ...]] = {
    "messages": ("messages",),
    "preference": ("prompt", "chosen", "rejected"),
    "verifiable": ("prompt", "answer"),
    "text": ("text",),
}
"""Each kind and the columns it needs (strings, but `messages`)."""
STRING_COLUMNS = ("text", "prompt", "chosen", "rejected", "answer")
KNOWN_COLUMNS = ("text", "messages", "prompt", "chosen", "rejected", "answer")
MAX_SHOWN_VALUE = 40  # characters of a wrong value quoted in a problem


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_VALUE else text[: MAX_SHOWN_VALUE - 3] + "..."


def _type(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def message_problems(messages: Any) -> list[str]:
    """Why a `messages` value is not a conversation a chat template renders and SFT learns from."""
    if not isinstance(messages, list) or not messages:
        return [f"messages must be a non-empty list of {{role, content}}, not {_type(messages)}"]
    problems = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            problems.append(f"messages[{i}] must be an object {{role, content}}, not {_type(m)}")
            continue
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str):
            problems.append(f"messages[{i}].role must be a string, not {_type(role)}")
        elif role not in ROLES:
            problems.append(f"messages[{i}].role is {_shown(role)}; use one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            problems.append(f"messages[{i}].content must be a string, not {_type(content)}")
    if not problems and not any(m.get("role") == "assistant" for m in messages):
        problems.append("messages has no assistant turn: there is nothing to learn from it")
    return problems


def row_problems(row: Any) -> list[str]:
    """Why `row` (a decoded line or Parquet row) is not a good row: every problem of every known
    column it has, and none if it has no known column at all (`row_kinds` is then empty)."""
    if not isinstance(row, Mapping):
        return [f"a row must be a JSON object, not {_type(row)}"]
    problems = []
    for column in STRING_COLUMNS:
        if column in row and not isinstance(row[column], str):
            problems.append(f"{column} must be a string, not {_type(row[column])}")
    if "messages" in row:
        problems += message_problems(row["messages"])
    if not any(column in row for column in KNOWN_COLUMNS):
        have = ", ".join(sorted(str(k) for k in row)[:8]) or "none"
        problems.append(
            "no column a stage reads (text; messages; prompt, chosen, rejected; prompt, answer); "
            f"its columns: {have}"
        )
    return problems


def row_kinds(row: Mapping[str, Any]) -> frozenset[str]:
    """The kinds a good row is of: every kind whose columns it has."""
    return frozenset(kind for kind, columns in KINDS.items() if all(c in row for c in columns))


def kinds_problem(first: frozenset[str], first_at: int, row: frozenset[str], unit: str) -> str | None:
    """Why a row of kinds `row` does not belong in a file whose first good row (at `first_at`) is
    of kinds `first`: it lacks one of them."""
    missing = sorted(first - row)
    if not missing:
        return None
    return (
        f"it is not a {' / '.join(missing)} row as {unit} {first_at} is "
        f"(it has the columns of: {', '.join(sorted(row)) or 'no kind'})"
    )


def stage_kind(stage: str) -> str:
    """The kind of row a stage reads (an eval ref: text, or messages for a chat split)."""
    return {
        "pretrain": "text",
        "midtrain": "text",
        "long_context": "text",
        "sft": "messages",
        "dpo": "preference",
        "rlvr": "verifiable",
    }.get(stage, "text")
