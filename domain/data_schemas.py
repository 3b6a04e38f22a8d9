"""Which columns each stage reads from a JSONL or Parquet data file: the schemas people already use
(TRL's and the fine-tuning APIs'). A pure table and a pure check, used by the scheduler at plan time
(so a wrong file is refused with its field path before anything is reserved) and by the trainer.

    next-token stages (pretrain, midtrain, long_context)   text: string
    sft                                                    messages: list of {role, content}
    dpo                                                    prompt, chosen, rejected: string
    rlvr                                                   prompt, answer: string (+ the ref's verifier)
"""

from dataclasses import dataclass

from contracts.manifest import DataFormat, DataRef
from domain.data_refs import SourceKind, kind_of, suffix_format

ROW_FORMATS = (DataFormat.jsonl, DataFormat.parquet)
"""The formats read by column (a schema per stage); text files are read as documents."""
VERIFIERS = ("exact", "number", "math", "choice", "regex")
"""RLVR verifiers a data ref may name (training/data/verifiers.py): exact (stripped string equality),
number (the last number in the response equals the answer's), math (math-verify's LaTeX and
expression equivalence), choice (the last letter A-J), regex (the answer is a bounded pattern)."""
EXECUTES_CODE = ("code", "python", "unit_tests", "tests", "sandbox", "execute")
"""Verifier names that would mean running the tenant's code inside the trainer: refused by name."""


@dataclass(frozen=True, slots=True)
class Schema:
    kind: str  # "text", "messages", "preference", "verifiable"
    columns: tuple[str, ...]  # required; each a string column unless listed in `lists`
    lists: tuple[str, ...] = ()  # list<struct<role: string, content: string>> columns


TEXT = Schema("text", ("text",))
MESSAGES = Schema("messages", ("messages",), lists=("messages",))
PREFERENCE = Schema("preference", ("prompt", "chosen", "rejected"))
VERIFIABLE = Schema("verifiable", ("prompt", "answer"))

STAGE_SCHEMA = {
    "pretrain": TEXT,
    "midtrain": TEXT,
    "long_context": TEXT,
    "sft": MESSAGES,
    "dpo": PREFERENCE,
    "rlvr": VERIFIABLE,
}


def file_format(ref: DataRef) -> DataFormat:
    """The ref's declared format, else the suffix of the file or object it names (.jsonl/.json/
    .ndjson -> jsonl, .parquet/.pq -> parquet), else text. Pure: the planner decides from the
    manifest alone. An `upload:` ref without a declared format is nominally jsonl: an upload is
    JSONL or Parquet, which is all the plan needs to know here; its record says which, and the
    scheduler and the trainer read that."""
    if ref.format is not None:
        return ref.format
    suffix = suffix_format(ref.source) if kind_of(ref.source) in (SourceKind.file, SourceKind.s3) else None
    if suffix is not None:
        return DataFormat(suffix)
    if kind_of(ref.source) is SourceKind.upload:
        return DataFormat.jsonl
    return DataFormat.text


def reads_rows(ref: DataRef) -> bool:
    """A tenant's JSONL or Parquet data (an upload; a `file:` or `s3://` ref in one of those
    formats): read by column, with the schema of the stages reading it."""
    kind = kind_of(ref.source)
    if kind is SourceKind.upload:
        return True
    return kind in (SourceKind.file, SourceKind.s3) and file_format(ref) in ROW_FORMATS


def _is_string(type_text: str) -> bool:
    return type_text in ("string", "large_string")


def _is_messages(type_text: str) -> bool:
    """A list of structs with string `role` and `content` (other fields allowed)."""
    if not type_text.startswith(("list<", "large_list<")):
        return False
    return "role: string" in type_text and "content: string" in type_text


def schema_problem(stage: str, columns: dict[str, str]) -> str | None:
    """Why a file with `columns` ({name: pyarrow type text}) cannot feed `stage`, or None."""
    schema = STAGE_SCHEMA[stage]
    missing = [c for c in schema.columns if c not in columns]
    if missing:
        have = ", ".join(sorted(columns)) or "none"
        return (
            f"{stage} reads the column(s) {', '.join(schema.columns)} ({schema.kind} rows); "
            f"the file has no {', '.join(missing)} (its columns: {have})"
        )
    for name in schema.columns:
        ok = _is_messages(columns[name]) if name in schema.lists else _is_string(columns[name])
        if not ok:
            want = "a list of {role, content} strings" if name in schema.lists else "a string"
            return f"{stage} needs column {name!r} to be {want}; it is {columns[name]}"
    return None


def verifier_problem(verifier: str | None) -> str | None:
    if verifier is None:
        return f"rlvr rows need a verifier on their data ref: one of {', '.join(VERIFIERS)}"
    if verifier in EXECUTES_CODE:
        return (
            f"verifier {verifier!r} would run the tenant's code inside the trainer, which the backend "
            f"never does; use one of {', '.join(VERIFIERS)}"
        )
    if verifier not in VERIFIERS:
        return f"verifier {verifier!r} is unknown: use one of {', '.join(VERIFIERS)}"
    return None
