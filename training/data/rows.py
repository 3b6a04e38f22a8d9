"""Rows of the field's data files (JSONL and Parquet) as the pipeline handles them: read by column
(runtime/storage/data_files.py, never a whole file at once), each row's text for data preparation
(dedup and decontamination judge what a row says, whatever its schema), and the rows that survive
preparation written back as JSONL, so the stages read the prepared file like any other.

Only the columns the schemas name are read (`text`, `messages`, `prompt`, `chosen`, `rejected`,
`answer`); a row's other columns are dropped on the way. The number of rows one ref may hold in
memory here is bounded (ROW_CAP): the post-training sets and eval splits this path is for are far
smaller; a pretraining corpus larger than memory goes through token files instead
(training/data/token_files.py).
"""

import json
import os
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

from contracts.manifest import DataFormat, DataRef
from runtime.storage import data_files

ROW_CAP = 1_000_000  # rows of one ref held at once for data prep and post-training
KNOWN_COLUMNS = ("text", "messages", "prompt", "chosen", "rejected", "answer")
EVAL_ROWS = 1000  # an eval ref's split is its first rows, like a generated eval suite's documents

Row = dict[str, Any]


def is_structured(ref: DataRef) -> bool:
    return data_files.file_format(ref) in (DataFormat.jsonl, DataFormat.parquet)


def path_of(source: str) -> pathlib.Path:
    if not source.startswith("file:/"):
        raise ValueError(f"A JSONL or Parquet ref needs a file:/absolute/path source, got {source!r}.")
    return pathlib.Path(source.removeprefix("file:"))


def read_rows(ref: DataRef, *, source: str | None = None, limit: int = ROW_CAP) -> list[Row]:
    """The ref's rows (its known columns), in file order; `source` overrides the ref's (a prepared
    file). ValueError past `limit` rows."""
    path = path_of(source or ref.source)
    fmt = data_files.file_format(ref if source is None else DataRef(name=ref.name, source=source))
    columns = [c for c in KNOWN_COLUMNS if c in data_files.schema_of(path, fmt).columns]
    rows: list[Row] = []
    for batch in data_files.iter_batches(path, fmt, columns):
        rows.extend(batch)
        if len(rows) > limit:
            raise ValueError(f"data {ref.name!r} has more than {limit} rows, the cap for this stage.")
    return rows


def row_text(row: Row) -> str:
    """What a row says, as one document: its text fields in schema order, chat turns' contents."""
    parts: list[str] = []
    for column in KNOWN_COLUMNS:
        value = row.get(column)
        if isinstance(value, str):
            parts.append(value)
        elif isinstance(value, list):
            parts.extend(str(m.get("content", "")) for m in value if isinstance(m, dict))
    return "\n".join(p for p in parts if p)


def kept_rows(rows: Sequence[Row], texts: Sequence[str], kept: Sequence[str]) -> list[Row]:
    """The rows whose texts survived preparation. `kept` is a subsequence of `texts` (preparation
    drops documents, never reorders them), so one scan pairs each kept text with its own row, even
    where two rows say the same."""
    out, i = [], 0
    for text in kept:
        while texts[i] != text:
            i += 1
        out.append(rows[i])
        i += 1
    return out


def write_rows(path: pathlib.Path, rows: Iterable[Row]) -> None:
    """JSONL, written to a temporary name and renamed: a half-written file is never read."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def messages_of(row: Row) -> list[dict[str, str]]:
    """A `messages` row's turns as plain {role, content} dicts."""
    return [{"role": str(m["role"]), "content": str(m["content"])} for m in row["messages"]]


def sft_examples(tok: Any, table: Sequence[Row]) -> list[tuple[list[int], list[int]]]:
    """`messages` rows through the tokenizer's chat template: (ids, 1 on the assistant's tokens).
    Rows with no assistant turn teach nothing and are left out."""
    out = []
    for row in table:
        ids, mask = tok.chat(messages_of(row))
        if any(mask):
            out.append((list(ids), [int(m) for m in mask]))
    return out


def dpo_pairs(tok: Any, table: Sequence[Row]) -> list[tuple[list[int], list[int], list[int]]]:
    """`prompt` / `chosen` / `rejected` rows as token pairs: the prompt as a user turn with the chat
    template's generation prompt (the raw prompt without a template), each completion its text and
    the end-of-turn token, as TRL builds them."""
    out = []
    for row in table:
        if tok.has_chat_template:
            prompt, _ = tok.chat(
                [{"role": "user", "content": str(row["prompt"])}], add_generation_prompt=True
            )
        else:
            prompt = tok.encode(str(row["prompt"]))
        end = [tok.eos_id] if tok.eos_id is not None else []
        chosen = tok.encode(str(row["chosen"])) + end
        rejected = tok.encode(str(row["rejected"])) + end
        out.append((list(prompt), chosen, rejected))
    return out
