"""The plan-time checks of what a manifest brings: its base model, its tokenizer and its data files.
Pure decisions over facts the scheduler gathered (services/scheduler/inputs.py reads the model store
and the files), so they are tested as tables. Each refusal is a stable code and a sentence that
starts with the manifest's field path (`model.revision: ...`, `data[2].digest: ...`), and each runs
before anything is reserved.

Tokenizer and embeddings: a base model trains with its own tokenizer (tokenizer.json), whose
vocabulary must fit its embedding rows. A from-scratch size trains with the byte tokenizer (the
default; 256 tokens, so only the tiny size's 256 rows) or a stored tokenizer, which must fit the
size's vocab_size and fill it: a vocabulary that leaves more than max(128, 1%) of the rows unused
trains embeddings no data ever reaches (bytes on 128,256 rows: 99.8% of them).
"""

from dataclasses import dataclass

from contracts.errors import ErrorCode
from contracts.manifest import DataFormat, DataRef, ModelSpec
from contracts.models import BaseModel, ModelShape
from domain.data_refs import SourceKind, kind_of
from domain.data_rows import stage_kind
from domain.data_schemas import STAGE_SCHEMA, file_format, reads_rows, verifier_problem

Refusal = tuple[ErrorCode, str]
BYTES = "bytes"
BYTE_VOCAB = 256  # the byte tokenizer's vocabulary (training/data/corpora.py's VOCAB_SIZE)
MIN_UNUSED_ALLOWED = 128  # rows a from-scratch tokenizer may leave unused, at least (padding to 128)
UNUSED_FRACTION_ALLOWED = 0.01


def max_unused_rows(vocab_size: int) -> int:
    return max(MIN_UNUSED_ALLOWED, int(vocab_size * UNUSED_FRACTION_ALLOWED))


def is_digest(text: str) -> bool:
    hexpart = text.removeprefix("sha256:")
    return text.startswith("sha256:") and len(hexpart) == 64 and all(c in "0123456789abcdef" for c in hexpart)


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What the store says about `model.base`: the entry the account may use (None: none), and
    config.json as it reads now (`unsupported`: (key, sentence) when it no longer parses;
    `changed`: it parses to another shape than the one recorded)."""

    entry: BaseModel | None
    unsupported: tuple[str, str] | None = None
    changed: bool = False


def model_refusal(spec: ModelSpec, facts: ModelFacts) -> Refusal | None:
    """model_not_found, model_digest_mismatch or model_unsupported for a manifest naming a base."""
    entry = facts.entry
    if entry is None:
        run = (
            "; a stage of one of your runs is one once exported (`ecc ito export RUN --stage STAGE`)"
            if (spec.base or "").startswith("run:")
            else ""
        )
        return (
            ErrorCode.model_not_found,
            f"model.base: no model {spec.base!r} in the model store for this account "
            f"(`ecc ito models` lists the ones you may use){run}",
        )
    if spec.revision != entry.digest:
        return (
            ErrorCode.model_digest_mismatch,
            f"model.revision: {spec.revision!r} is not the digest of the stored {entry.name!r} "
            f"({entry.digest}); pin the digest `ecc ito models` lists",
        )
    if facts.unsupported is not None:
        key, why = facts.unsupported
        return ErrorCode.model_unsupported, f"model.base: {entry.name!r}'s config.json key {key}: {why}"
    if facts.changed:
        return (
            ErrorCode.model_digest_mismatch,
            f"model.base: the stored {entry.name!r} changed on disk since it was added "
            "(its config.json no longer matches its record); the operator must add it again",
        )
    return None


def tokenizer_refusal(
    spec: ModelSpec, shape: ModelShape, base: BaseModel | None, stored_vocab: int | None
) -> Refusal | None:
    """tokenizer_mismatch, or None. `shape`: the run's starting shape (the base's or the size's);
    `stored_vocab`: the vocabulary of the stored tokenizer `spec.tokenizer` names (None: not in the
    store, or the spec names none)."""
    rows = shape.vocab_size
    named = spec.tokenizer
    if base is not None and named is None:
        if base.tokenizer_vocab is None:
            return (
                ErrorCode.tokenizer_mismatch,
                f"model.tokenizer: the base model {base.name!r} has no tokenizer.json; add the "
                "checkpoint with its tokenizer files, or name a stored tokenizer",
            )
        if base.tokenizer_vocab > rows:
            return (
                ErrorCode.tokenizer_mismatch,
                f"model.tokenizer: {base.name!r}'s tokenizer has {base.tokenizer_vocab:,} tokens, more "
                f"than its {rows:,} embedding rows",
            )
        return None
    if named is None or named == BYTES:
        if base is not None:
            return (
                ErrorCode.tokenizer_mismatch,
                f"model.tokenizer: the byte tokenizer is the tiny demo's; {base.name!r} trains with "
                "its own tokenizer (leave model.tokenizer out)",
            )
        if rows != BYTE_VOCAB:
            return (
                ErrorCode.tokenizer_mismatch,
                f"model.tokenizer: the byte tokenizer ({'the default; ' if named is None else ''}"
                f"{BYTE_VOCAB} tokens) would fill {BYTE_VOCAB} of the {spec.size}'s {rows:,} embedding "
                "rows and leave the rest untrained; it is only for the tiny size: name a stored "
                "tokenizer (model.tokenizer: its sha256 digest) whose vocabulary fits",
            )
        return None
    if not is_digest(named):
        return (
            ErrorCode.tokenizer_mismatch,
            f"model.tokenizer: {named!r} is neither 'bytes' nor a digest (sha256:<64 hex digits>)",
        )
    if stored_vocab is None:
        return ErrorCode.tokenizer_mismatch, f"model.tokenizer: no tokenizer {named} in the model store"
    if stored_vocab > rows:
        return (
            ErrorCode.tokenizer_mismatch,
            f"model.tokenizer: the tokenizer has {stored_vocab:,} tokens, more than the model's "
            f"{rows:,} embedding rows",
        )
    unused = rows - stored_vocab
    if base is None and unused > max_unused_rows(rows):
        return (
            ErrorCode.tokenizer_mismatch,
            f"model.tokenizer: the tokenizer's {stored_vocab:,} tokens fill {stored_vocab:,} of the "
            f"{spec.size}'s {rows:,} embedding rows; {unused:,} would never train (at most "
            f"{max_unused_rows(rows):,} may stay unused): pick a size whose vocab_size fits the tokenizer",
        )
    return None


@dataclass(frozen=True, slots=True)
class FileFacts:
    """A tenant data file as the scheduler found it: its digest, what its check found (the kinds of
    row every row is, its columns, its problems, each at its 1-based line or row), and its format
    where a record says it (an upload). `unreadable`: why there is no report (a sentence about the
    tenant's own data, never a server path)."""

    digest: str | None
    kinds: tuple[str, ...] = ()
    columns: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    more_problems: int = 0
    unreadable: str | None = None
    format: DataFormat | None = None


def _problems(i: int, facts: FileFacts) -> str:
    count = len(facts.problems) + facts.more_problems
    lines = "\n".join(f"- {p}" for p in facts.problems)
    more = f"\n- ... and {facts.more_problems} more" if facts.more_problems else ""
    return f"data[{i}]: {count} problem{'s' if count > 1 else ''} in the file:\n{lines}{more}"


def _kind_problem(stage: str, facts: FileFacts) -> str | None:
    """Why rows of `facts.kinds` cannot feed `stage` (an eval ref: text, or messages for a chat
    split), with the columns the stage reads and the ones the file has."""
    if stage not in STAGE_SCHEMA:
        if "text" in facts.kinds or "messages" in facts.kinds:
            return None
        have = ", ".join(facts.columns) or "none"
        return (
            "the held-out eval (text, or messages for a chat split) reads the column(s) text or "
            f"messages; the file has neither (its columns: {have})"
        )
    kind = stage_kind(stage)
    if kind in facts.kinds:
        return None
    schema = STAGE_SCHEMA[stage]
    have = ", ".join(facts.columns) or "none"
    rows = " / ".join(facts.kinds) or "of no kind a stage reads"
    return (
        f"{stage} reads the column(s) {', '.join(schema.columns)} ({schema.kind} rows); the file's rows "
        f"are {rows} (its columns: {have})"
    )


def data_refusal(i: int, ref: DataRef, readers: list[str], facts: FileFacts) -> Refusal | None:
    """data_digest_mismatch or data_schema_invalid for the tenant's data ref `data[i]`, read by
    the stages `readers` (their names: "pretrain", "sft", ...; an eval ref is read as "eval")."""
    rows = reads_rows(ref)
    upload = kind_of(ref.source) is SourceKind.upload
    if rows and not upload and ref.digest is None:
        fmt = file_format(ref)
        return (
            ErrorCode.data_digest_mismatch,
            f"data[{i}].digest: a {fmt.value} file needs the sha256 of its bytes "
            '("sha256:<hex>", as `sha256sum` prints it) so the run trains on what was reviewed',
        )
    if facts.unreadable is not None:
        return ErrorCode.data_schema_invalid, f"data[{i}]: {facts.unreadable}"
    if ref.digest is not None and facts.digest != ref.digest:
        return (
            ErrorCode.data_digest_mismatch,
            f"data[{i}].digest: {ref.digest!r} is not the sha256 of the file's bytes (the file "
            "changed, or the digest is another file's)",
        )
    if upload and ref.format is not None and facts.format is not None and ref.format is not facts.format:
        return (
            ErrorCode.data_schema_invalid,
            f"data[{i}].format: the upload is {facts.format.value}, not {ref.format.value} (leave format out)",
        )
    if facts.problems or facts.more_problems:
        return ErrorCode.data_schema_invalid, _problems(i, facts)
    if not rows:
        return None
    for stage in readers:
        problem = _kind_problem(stage, facts)
        if problem is not None:
            return ErrorCode.data_schema_invalid, f"data[{i}]: {problem}"
        if stage == "rlvr" and (why := verifier_problem(ref.verifier)) is not None:
            return ErrorCode.data_schema_invalid, f"data[{i}].verifier: {why}"
    return None
