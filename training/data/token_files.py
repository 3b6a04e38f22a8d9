"""Token files: a corpus tokenized once into sharded, memory-mapped arrays (nanoGPT's `.bin`), read
by windows, so a corpus larger than memory trains and resumes at the exact position.

A token directory holds `shard_00000.bin`, `shard_00001.bin`, ... (raw little-endian uint16 when
the vocabulary fits in 65,536 ids, else uint32; at most `shard_tokens` tokens each) and
`index.json` (format, dtype, tokenizer id, special ids, the sources' digests, document and token
counts, the shards). Each document is written as [bos] + tokens + [eos] (bos only when the
tokenizer adds one), so eos separates documents. The directory is written under a temporary name
and renamed when complete: a finished one is reused by a redelivered run (same tokenizer, same
sources), a half-written one is never read (it has no index, or is not at the final name).

Documents come from iterators that never hold a whole file: text files read in chunks and split
at blank lines, JSONL/Parquet `text` columns through `runtime.storage.data_files.iter_batches`,
and the builtin/generated sources of `data.load_documents` (small by construction).

`TokenCorpus` maps the shards read-only (`numpy.memmap`): a read-only shared file mapping costs
page cache, not the process's private memory, and only the pages a window touches are read.
`CorpusBatchIterator` serves exactly what `data.BatchIterator` serves over the same tokens.
"""

import codecs
import json
import os
import re
import secrets
import shutil
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from contracts.manifest import DataFormat
from runtime.storage.data_files import ROW_BATCH, iter_batches
from training.data.corpora import BatchIterator
from training.data.tokenizer import ByteTokenizer, Tokenizer

FORMAT_VERSION = 1
INDEX_FILE = "index.json"
SHARD_TOKENS = 1 << 27  # 134M tokens: 256 MiB of uint16 a shard; fewer, larger files for big corpora
TEXT_CHUNK_BYTES = 4 << 20  # bytes read per step from a text file
MAX_DOCUMENT_CHARS = 64 << 20  # a "document" with no blank line for this long is cut here
ENCODE_BATCH = 1024  # documents handed to the tokenizer at once (encode_batch runs them in parallel)
_BLANK_LINE = re.compile(r"\n\s*\n")


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenIndex:
    """What index.json records."""

    dtype: str
    vocab_size: int
    eos_id: int
    bos_id: int | None
    tokenizer: str  # the tokenizer's id: "bytes", or "sha256:<hex>" of its files
    sources: dict[str, str]  # ref name -> digest of what was tokenized
    documents: int
    tokens: int
    shard_tokens: int
    shards: list[tuple[str, int]] = field(default_factory=list)  # (file name, tokens)
    version: int = FORMAT_VERSION

    def key(self) -> tuple[object, ...]:
        """What must agree for a finished directory to be reused."""
        return (self.version, self.tokenizer, self.vocab_size, self.eos_id, self.bos_id, self.sources)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TokenIndex":
        raw = json.loads(text)
        raw["shards"] = [(str(name), int(n)) for name, n in raw["shards"]]
        return cls(**raw)


def tokenizer_id(tokenizer: Tokenizer) -> str:
    return str(getattr(tokenizer, "id", "") or type(tokenizer).__name__)


def read_index(directory: Path) -> TokenIndex | None:
    """The directory's index when it is a complete token directory, else None."""
    try:
        index = TokenIndex.from_json((Path(directory) / INDEX_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError, KeyError):
        return None
    for name, tokens in index.shards:
        path = Path(directory) / name
        if not path.is_file() or path.stat().st_size != tokens * np.dtype(index.dtype).itemsize:
            return None
    return index


# --- documents -----------------------------------------------------------------------------------


def iter_text_documents(path: Path, chunk_bytes: int = TEXT_CHUNK_BYTES) -> Iterator[str]:
    """A UTF-8 text file's blank-line-separated documents, read `chunk_bytes` at a time: the
    documents `data.split_documents` finds in the whole text. Trailing whitespace of a chunk waits
    for the next one, since a separator there may go on."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    carry = ""
    try:
        with Path(path).open("rb") as f:
            while raw := f.read(chunk_bytes):
                carry += decoder.decode(raw)
                ready = len(carry.rstrip())
                *done, last = _BLANK_LINE.split(carry[:ready])
                carry = last + carry[ready:]
                yield from (doc for doc in done if doc.strip())
                while len(carry) > MAX_DOCUMENT_CHARS:
                    yield carry[:MAX_DOCUMENT_CHARS]
                    carry = carry[MAX_DOCUMENT_CHARS:]
            carry += decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise ValueError(f"The file {Path(path).name} is not valid UTF-8 text.") from None
    yield from (doc for doc in _BLANK_LINE.split(carry) if doc.strip())


def iter_column_documents(
    path: Path, fmt: DataFormat, column: str = "text", batch_rows: int = ROW_BATCH
) -> Iterator[str]:
    """A JSONL or Parquet file's `column` values, streamed a record batch at a time."""
    for rows in iter_batches(Path(path), fmt, [column], batch_rows):
        for row in rows:
            value = row.get(column)
            if value is None:
                continue
            if not isinstance(value, str):
                raise ValueError(
                    f"{Path(path).name}: column {column!r} holds a {type(value).__name__}, not text."
                )
            if value.strip():
                yield value


def iter_source_documents(source: str, fmt: DataFormat | None = None, *, seed: int = 0) -> Iterator[str]:
    """The documents a data ref names: file: sources streamed per format (text by default), the
    builtin and generated ones from `data.load_documents`."""
    if source.startswith("file:"):
        path = Path(source.removeprefix("file:"))
        if not path.is_absolute():
            raise ValueError(f"A file source needs an absolute path, got {source!r}.")
        if fmt in (DataFormat.jsonl, DataFormat.parquet):
            return iter_column_documents(path, fmt)
        return iter_text_documents(path)
    from training.data.corpora import load_documents

    return iter(load_documents(source, seed=seed))


# --- writing -------------------------------------------------------------------------------------


def _encode(tokenizer: Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    if isinstance(tokenizer, ByteTokenizer):  # bytes are their own ids: no per-token Python
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    return [np.asarray(ids) for ids in tokenizer.encode_batch(texts)]


class _ShardWriter:
    def __init__(self, directory: Path, dtype: np.dtype[Any], shard_tokens: int):
        self.directory, self.dtype, self.shard_tokens = directory, dtype, shard_tokens
        self.shards: list[tuple[str, int]] = []
        self.file: Any = None
        self.count = 0

    def write(self, tokens: np.ndarray) -> None:
        tokens = tokens.astype(self.dtype, copy=False)
        while len(tokens):
            if self.file is None or self.count == self.shard_tokens:
                self._next()
            take = min(len(tokens), self.shard_tokens - self.count)
            tokens[:take].tofile(self.file)
            self.count += take
            tokens = tokens[take:]

    def _next(self) -> None:
        self.close()
        name = f"shard_{len(self.shards):05d}.bin"
        self.file = (self.directory / name).open("wb")
        self.shards.append((name, 0))
        self.count = 0

    def close(self) -> None:
        if self.file is not None:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            self.file = None
            self.shards[-1] = (self.shards[-1][0], self.count)


def write_token_files(
    directory: Path,
    documents: Iterable[str],
    tokenizer: Tokenizer,
    *,
    sources: Mapping[str, str],
    shard_tokens: int = SHARD_TOKENS,
    batch_documents: int = ENCODE_BATCH,
) -> TokenIndex:
    """Tokenize `documents` into `directory` (see the module docstring), or reuse it when it is
    already complete for the same tokenizer and `sources` (ref name -> digest of its input)."""
    if shard_tokens < 1 or batch_documents < 1:
        raise ValueError("Shards and encode batches need at least one token and one document.")
    directory = Path(directory)
    want = TokenIndex(
        dtype=token_dtype(tokenizer.vocab_size).name,
        vocab_size=tokenizer.vocab_size,
        eos_id=tokenizer.eos_id,
        bos_id=tokenizer.bos_id,
        tokenizer=tokenizer_id(tokenizer),
        sources=dict(sources),
        documents=0,
        tokens=0,
        shard_tokens=shard_tokens,
    )
    existing = read_index(directory)
    if existing is not None and existing.key() == want.key():
        return existing
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.with_name(f".{directory.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        index = _write(tmp, documents, tokenizer, want, batch_documents)
        if directory.exists():  # incomplete, or another tokenizer's or sources': replaced
            if (done := read_index(directory)) is not None and done.key() == want.key():
                shutil.rmtree(tmp)
                return done  # a concurrent writer finished first
            shutil.rmtree(directory)
        try:
            tmp.rename(directory)
        except OSError:
            if (done := read_index(directory)) is not None and done.key() == want.key():
                shutil.rmtree(tmp)
                return done
            raise
        return index
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write(
    tmp: Path, documents: Iterable[str], tokenizer: Tokenizer, want: TokenIndex, batch_documents: int
) -> TokenIndex:
    dtype = np.dtype(want.dtype)
    writer = _ShardWriter(tmp, dtype, want.shard_tokens)
    head = np.array([] if tokenizer.bos_id is None else [tokenizer.bos_id], dtype=dtype)
    tail = np.array([tokenizer.eos_id], dtype=dtype)
    count = tokens = 0
    batch: list[str] = []

    def flush() -> None:
        nonlocal tokens
        pieces = []
        for ids in _encode(tokenizer, batch):
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= want.vocab_size):
                raise ValueError("The tokenizer produced an id outside its vocabulary.")
            pieces += [head, ids.astype(dtype, copy=False), tail]
        joined = np.concatenate(pieces)
        writer.write(joined)
        tokens += len(joined)
        batch.clear()

    for doc in documents:
        batch.append(doc)
        count += 1
        if len(batch) == batch_documents:
            flush()
    if batch:
        flush()
    writer.close()
    index = TokenIndex(**{**asdict(want), "documents": count, "tokens": tokens, "shards": writer.shards})
    with (tmp / INDEX_FILE).open("w", encoding="utf-8") as f:
        f.write(index.to_json())
        f.flush()
        os.fsync(f.fileno())
    return index


# --- reading -------------------------------------------------------------------------------------


class TokenCorpus:
    """The tokens [start, stop) of a token directory, read through read-only memory maps."""

    def __init__(self, directory: Path, *, start: int = 0, stop: int | None = None, _maps: Any = None):
        self.directory = Path(directory)
        index = read_index(self.directory)
        if index is None:
            raise ValueError(f"{self.directory} is not a complete token directory (no valid {INDEX_FILE}).")
        self.index = index
        self.bounds = np.cumsum([0] + [n for _, n in index.shards], dtype=np.int64)
        self._maps: list[np.memmap[Any, Any] | None] = (
            _maps if _maps is not None else [None] * len(index.shards)
        )
        stop = index.tokens if stop is None else stop
        if not 0 <= start <= stop <= index.tokens:
            raise ValueError(f"Token range [{start}, {stop}) is outside the corpus of {index.tokens}.")
        self.start, self.stop = start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def _shard(self, k: int) -> "np.memmap[Any, Any]":
        shard = self._maps[k]
        if shard is None:
            name = self.index.shards[k][0]
            shard = np.memmap(self.directory / name, dtype=np.dtype(self.index.dtype), mode="r")
            self._maps[k] = shard
        return shard

    def view(self, start: int, stop: int) -> "TokenCorpus":
        """Tokens [start, stop) of this corpus, sharing its maps."""
        if not 0 <= start <= stop <= len(self):
            raise ValueError(f"Token range [{start}, {stop}) is outside a corpus of {len(self)}.")
        return TokenCorpus(self.directory, start=self.start + start, stop=self.start + stop, _maps=self._maps)

    def split_held_out(self, fraction: float) -> tuple["TokenCorpus", "TokenCorpus"]:
        """(train, held_out) as `data.split_held_out` cuts a tensor: the last `fraction` held out."""
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"The held-out fraction must be between 0 and 1, got {fraction}.")
        cut = int(len(self) * (1.0 - fraction))
        return self.view(0, cut), self.view(cut, len(self))

    def read(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) of this corpus as int64, across shard boundaries."""
        if start < 0 or length < 0 or start + length > len(self):
            raise IndexError(f"Window [{start}, {start + length}) is outside a corpus of {len(self)}.")
        out = np.empty(length, dtype=np.int64)
        at = self.start + start
        k = int(np.searchsorted(self.bounds, at, side="right")) - 1
        done = 0
        while done < length:
            local = at + done - int(self.bounds[k])
            take = min(length - done, int(self.bounds[k + 1]) - (at + done))
            out[done : done + take] = self._shard(k)[local : local + take]
            done += take
            k += 1
        return out

    def windows(self, starts: Sequence[int] | np.ndarray, length: int) -> np.ndarray:
        """(len(starts), length) int64 windows."""
        out = np.empty((len(starts), length), dtype=np.int64)
        for i, s in enumerate(starts):
            out[i] = self.read(int(s), length)
        return out


class CorpusBatchIterator(BatchIterator):
    """`data.BatchIterator` over a TokenCorpus: the same batches (batch p drawn from a generator
    seeded by (seed, p) alone, so `position` resumes exactly, this rank's `rows` of them); only this
    rank's windows are read from the maps."""

    def __init__(
        self,
        corpus: TokenCorpus,
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        position: int = 0,
        rows: slice = slice(None),
    ):
        super().__init__(
            corpus,  # type: ignore[arg-type]  # a corpus has len() and windows(), all that is read
            seq_len=seq_len,
            batch_size=batch_size,
            seed=seed,
            position=position,
            rows=rows,
        )
        self.corpus = corpus

    @staticmethod
    def _check_tokens(tokens: object) -> None:
        if not isinstance(tokens, TokenCorpus):
            raise ValueError("A CorpusBatchIterator reads a TokenCorpus.")

    def _windows(self, starts: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.corpus.windows(starts[self.rows].numpy(), self.seq_len + 1))


def corpus_eval_batches(
    corpus: TokenCorpus, *, seq_len: int, batch_size: int, max_batches: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`data.eval_batches` over a TokenCorpus: consecutive non-overlapping windows from its start."""
    n_windows = min((len(corpus) - 1) // seq_len, max_batches * batch_size)
    for first in range(0, n_windows, batch_size):
        starts = np.arange(first, min(first + batch_size, n_windows)) * seq_len
        windows = torch.from_numpy(corpus.windows(starts, seq_len + 1))
        yield windows[:, :-1], windows[:, 1:]
