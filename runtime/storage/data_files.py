"""Data files in the field's formats (JSONL and Parquet, read with pyarrow): their digest, their
columns, and their rows in bounded batches. Never a whole file in memory: the digest streams, the
schema of a Parquet file is its footer, a JSONL file's is inferred from its first block, and rows
come out a record batch at a time.

Used by the scheduler at plan time (digest and schema, before anything is reserved) and by the
trainer's data preparation (rows). The rules of which columns a stage needs are pure and live in
`domain.data_schemas`.
"""

import hashlib
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from contracts.manifest import DataFormat
from domain.data_schemas import file_format as file_format  # re-exported: the rule is pure

HASH_CHUNK = 4 * 1024 * 1024  # bytes read per step while hashing
JSONL_BLOCK = 1 << 20  # pyarrow's JSON block size: a row (one line) must fit in one block
JSONL_MAX_BLOCK = 64 << 20  # the largest block a file with very long lines is retried with
ROW_BATCH = 1024  # rows per batch handed to the tokenizer


@dataclass(frozen=True, slots=True)
class FileSchema:
    """A data file's columns as `{name: type}` with types in pyarrow's words ("string",
    "list<item: struct<role: string, content: string>>", ...)."""

    columns: dict[str, str]
    rows: int | None  # known for Parquet (the footer); None for JSONL until read


def sha256_file(path: pathlib.Path) -> str:
    """ "sha256:<hex>" of the file's bytes, read in chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _jsonl_options(block: int) -> pa_json.ReadOptions:
    return pa_json.ReadOptions(block_size=block, use_threads=False)


def _jsonl_reader(path: pathlib.Path) -> pa.RecordBatchReader:
    """A streaming JSONL reader whose block holds the file's longest line (retried larger)."""
    block = JSONL_BLOCK
    while True:
        try:
            return pa_json.open_json(path, read_options=_jsonl_options(block))
        except pa.ArrowInvalid as exc:
            if "straddling" not in str(exc) or block >= JSONL_MAX_BLOCK:
                raise ValueError(f"{path.name} is not valid JSON Lines: {exc}") from None
            block *= 4


def schema_of(path: pathlib.Path, fmt: DataFormat) -> FileSchema:
    """The file's columns (and row count where the format records it), or ValueError."""
    try:
        if fmt is DataFormat.parquet:
            meta = pq.ParquetFile(path)
            schema = meta.schema_arrow
            return FileSchema({f.name: str(f.type) for f in schema}, meta.metadata.num_rows)
        if fmt is DataFormat.jsonl:
            reader = _jsonl_reader(path)
            return FileSchema({f.name: str(f.type) for f in reader.schema}, None)
    except (pa.ArrowInvalid, OSError) as exc:
        raise ValueError(f"{path.name} cannot be read as {fmt.value}: {exc}") from None
    raise ValueError(f"{fmt.value} files have no columns.")


def iter_batches(
    path: pathlib.Path, fmt: DataFormat, columns: list[str], batch_rows: int = ROW_BATCH
) -> Iterator[list[dict[str, object]]]:
    """The file's rows (only `columns`), `batch_rows` at a time, as Python dicts, in file order."""
    if fmt is DataFormat.parquet:
        parquet = pq.ParquetFile(path)
        for batch in parquet.iter_batches(batch_size=batch_rows, columns=columns):
            yield batch.to_pylist()
        return
    if fmt is DataFormat.jsonl:
        reader = _jsonl_reader(path)
        pending: list[dict[str, object]] = []
        try:
            for batch in reader:
                pending.extend(batch.select(columns).to_pylist())
                while len(pending) >= batch_rows:
                    yield pending[:batch_rows]
                    pending = pending[batch_rows:]
        except pa.ArrowInvalid as exc:
            raise ValueError(f"{path.name} is not valid JSON Lines: {exc}") from None
        if pending:
            yield pending
        return
    raise ValueError(f"{fmt.value} files are not read by column.")
