"""The trainer's data: corpora named by source strings, and a
deterministic, resumable batch iterator.

Sources (the `source` field of a manifest's data refs):
  builtin:pydoc_topics   the help texts that ship with CPython (`pydoc_data.topics`), ~1 MB
  generated:arithmetic   seeded lines like "12+35=47"
  generated:reverse      seeded lines like "abcde>edcba"
  generated:small_arithmetic  seeded single-digit lines like "7-9=-2": 200 problems in all, learnt in
                         minutes by the tiny model, for quick post-training runs (an eval suite of it
                         holds every problem, so decontamination against one removes all of it)
  generated:needle       seeded filler text with a planted key and a query for it at the end
  file:/abs/path         a UTF-8 text file, at most FILE_CAP_BYTES

A source is also a list of documents (`load_documents`), the unit data preparation deduplicates
and decontaminates: a pydoc topic, a generated line, a blank-line-separated paragraph of a file.

Tokens are kept as uint8 (one byte per token) so a 64 MiB corpus costs 64 MiB, not 512 MiB;
batches are widened to int64 on the way out. The byte tokenizer lives in
training/data/tokenizer.py (with the Hugging Face one); corpora larger than memory are token
files (training/data/token_files.py).
"""

import random
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

# moved to training.data.tokenizer; still imported from here
from training.data.tokenizer import ByteTokenizer as ByteTokenizer

VOCAB_SIZE = 256  # bytes; every model shape trained on this data needs vocab_size >= 256
FILE_CAP_BYTES = 64 * 1024 * 1024  # the input cap for file: sources; raise with the host's memory
GENERATED_LINES = 20_000  # ~200 KB per generated source: enough that the tiny model cannot memorise it
HELD_OUT_FRACTION = 0.1  # tail of the training text kept for held-out loss when no eval ref is given
EVAL_SUITE_MAX_DOCS = 1000  # an eval ref's suite is its first 1000 documents: ~9K tokens of arithmetic
EVAL_SEED_OFFSET = 1  # eval refs are generated with seed + 1, so they are not the training lines
NEEDLE_LINES = 2_000  # needle documents in generated:needle
NEEDLE_WORDS = (
    "the",
    "a",
    "river",
    "stone",
    "light",
    "green",
    "slow",
    "cloud",
    "over",
    "under",
    "and",
    "small",
    "bird",
    "wind",
    "north",
    "old",
    "road",
    "blue",
    "sand",
    "quiet",
    "field",
    "of",
)
TASK_SEPARATORS = ("=", ">")  # arithmetic "12+35=47", reverse "abc>cba": prompt ends with the separator


def _pydoc_topics() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def _arithmetic(seed: int) -> str:
    rng = random.Random(f"arithmetic:{seed}")
    lines = []
    for _ in range(GENERATED_LINES):
        a, b = rng.randrange(100), rng.randrange(100)
        if rng.random() < 0.5:
            lines.append(f"{a}+{b}={a + b}\n")
        else:
            lines.append(f"{a}-{b}={a - b}\n")
    return "".join(lines)


def _small_arithmetic(seed: int) -> str:
    rng = random.Random(f"small_arithmetic:{seed}")
    lines = []
    for _ in range(GENERATED_LINES):
        a, b = rng.randrange(10), rng.randrange(10)
        lines.append(f"{a}+{b}={a + b}\n" if rng.random() < 0.5 else f"{a}-{b}={a - b}\n")
    return "".join(lines)


def _reverse(seed: int) -> str:
    rng = random.Random(f"reverse:{seed}")
    letters = "abcdefghijklmnopqrstuvwxyz"
    lines = []
    for _ in range(GENERATED_LINES):
        word = "".join(rng.choice(letters) for _ in range(rng.randint(3, 10)))
        lines.append(f"{word}>{word[::-1]}\n")
    return "".join(lines)


def needle_document(rng: random.Random, length: int) -> tuple[str, str, str]:
    """(context, query, answer): about `length` bytes of filler words with "|key NNNNN|" planted at
    a random depth, then the query "?key " whose answer is the five digits. Retrieval needs the model
    to find the key far back and copy it, which is what the long-context battery measures."""
    key = f"{rng.randrange(100_000):05d}"
    query = "?key "
    budget = max(8, length - len(query) - len(key) - 12)
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < budget:
        words.append(rng.choice(NEEDLE_WORDS))
    at = rng.randint(0, len(words))
    words.insert(at, f"|key {key}|")
    return " ".join(words) + " ", query, key


def _needle(seed: int) -> str:
    rng = random.Random(f"needle:{seed}")
    lines = []
    for _ in range(NEEDLE_LINES):
        context, query, key = needle_document(rng, rng.randint(48, 400))
        lines.append(f"{context}{query}{key}\n")
    return "".join(lines)


def _file(path_text: str, cap_bytes: int) -> str:
    path = Path(path_text)
    if not path.is_absolute():
        raise ValueError(f"A file source needs an absolute path, got {path_text!r}.")
    try:
        with path.open("rb") as f:
            raw = f.read(cap_bytes + 1)  # read at most one byte past the cap: never the whole file
    except OSError as e:
        raise ValueError(f"The file source {path_text!r} cannot be read ({e.strerror}).") from None
    if len(raw) > cap_bytes:
        raise ValueError(f"The file source {path_text!r} is larger than the {cap_bytes} byte cap.")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"The file source {path_text!r} is not valid UTF-8 text.") from None


def load_text(source: str, *, seed: int = 0, file_cap_bytes: int = FILE_CAP_BYTES) -> str:
    """The text a source string names. Generated sources depend only on `seed`."""
    kind, _, rest = source.partition(":")
    match kind, rest:
        case "builtin", "pydoc_topics":
            return _pydoc_topics()
        case "generated", "arithmetic":
            return _arithmetic(seed)
        case "generated", "small_arithmetic":
            return _small_arithmetic(seed)
        case "generated", "reverse":
            return _reverse(seed)
        case "generated", "needle":
            return _needle(seed)
        case "file", path_text if path_text:
            return _file(path_text, file_cap_bytes)
    raise ValueError(
        f"Unknown data source {source!r}: use builtin:pydoc_topics, generated:arithmetic, "
        "generated:small_arithmetic, generated:reverse, generated:needle or file:/absolute/path."
    )


def load_tokens(
    sources: Sequence[str], *, seed: int = 0, file_cap_bytes: int = FILE_CAP_BYTES
) -> torch.Tensor:
    """The sources' texts joined by a blank line and encoded, as a 1-D uint8 tensor."""
    if not sources:
        raise ValueError("At least one data source is needed.")
    text = "\n\n".join(load_text(s, seed=seed, file_cap_bytes=file_cap_bytes) for s in sources)
    return ByteTokenizer().encode_tensor(text)


def is_line_source(source: str) -> bool:
    """Generated sources are one document per line; the others are joined by blank lines."""
    return source.startswith("generated:")


def split_documents(source: str, text: str) -> list[str]:
    """The documents of a source's text: lines for generated sources, topics for pydoc, blank-line
    separated paragraphs otherwise. Empty documents are dropped."""
    if is_line_source(source):
        return [line for line in text.split("\n") if line.strip()]
    if source == "builtin:pydoc_topics":
        from pydoc_data.topics import topics

        return [topics[key] for key in sorted(topics) if topics[key].strip()]
    return [doc for doc in re.split(r"\n\s*\n", text) if doc.strip()]


def join_documents(source: str, documents: Sequence[str]) -> str:
    """The inverse of `split_documents` up to whitespace between documents."""
    if is_line_source(source):
        return "".join(doc + "\n" for doc in documents)
    return "\n\n".join(documents)


def load_documents(source: str, *, seed: int = 0, file_cap_bytes: int = FILE_CAP_BYTES) -> list[str]:
    return split_documents(source, load_text(source, seed=seed, file_cap_bytes=file_cap_bytes))


def load_eval_suite(source: str, *, seed: int = 0) -> list[str]:
    """An eval ref's documents: the first EVAL_SUITE_MAX_DOCS, generated with the eval seed. Every
    eval that reads an eval ref reads these, so decontamination against them is complete."""
    return load_documents(source, seed=seed + EVAL_SEED_OFFSET)[:EVAL_SUITE_MAX_DOCS]


def split_task_line(line: str) -> tuple[str, str] | None:
    """(prompt, answer) of a verifiable task line, the prompt ending with its separator:
    "12+35=47" -> ("12+35=", "47"); None for a line that is not a task."""
    for sep in TASK_SEPARATORS:
        prompt, found, answer = line.strip().partition(sep)
        if found and prompt and answer and sep not in answer:
            return prompt + sep, answer
    return None


def task_problems(text: str) -> list[tuple[str, str]]:
    """Every verifiable (prompt, answer) in a text of task lines."""
    return [problem for line in text.split("\n") if (problem := split_task_line(line)) is not None]


def split_held_out(
    tokens: torch.Tensor, fraction: float = HELD_OUT_FRACTION
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held_out): the last `fraction` of the tokens is held out. Contiguous, not shuffled,
    so no training window overlaps a held-out one."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"The held-out fraction must be between 0 and 1, got {fraction}.")
    cut = int(len(tokens) * (1.0 - fraction))
    return tokens[:cut], tokens[cut:]


class BatchIterator:
    """Random windows of `seq_len + 1` tokens, `batch_size` at a time, as (x, y) int64 tensors
    (the rows `rows` of them: one data-parallel rank's slice).

        Batch number p is drawn from a generator seeded by (seed, p) alone, so the stream is a pure
        function of (tokens, seed, seq_len, batch_size): setting `position` to the number of batches a
        previous run served makes this iterator yield exactly the batch that run would have yielded next.
    """

    def __init__(
        self,
        tokens: torch.Tensor,
        *,
        seq_len: int,
        batch_size: int,
        seed: int,
        position: int = 0,
        rows: slice = slice(None),
    ):
        self._check_tokens(tokens)
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"The data has {len(tokens)} tokens, fewer than one window of seq_len + 1 = {seq_len + 1}."
            )
        if seq_len < 1 or batch_size < 1:
            raise ValueError("seq_len and batch_size must be at least 1.")
        self.tokens = tokens
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.seed = seed
        self.position = position  # batches served so far; restore it to resume
        # This data-parallel rank's rows of each global batch (`distributed.batch_rows`): every rank
        # draws the same global batch and keeps its slice, so N ranks train on what one would.
        self.rows = rows

    @staticmethod
    def _check_tokens(tokens: torch.Tensor) -> None:
        if tokens.dim() != 1:
            raise ValueError("Tokens must be a 1-D tensor.")

    def _windows(self, starts: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the windows of `seq_len + 1` tokens at `starts`, as int64."""
        offsets = torch.arange(self.seq_len + 1)
        return self.tokens[starts[:, None] + offsets[None, :]][self.rows].long()

    def batch_at(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch served at `position`, without moving the iterator."""
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + position) % (2**63))
        starts = torch.randint(0, len(self.tokens) - self.seq_len, (self.batch_size,), generator=g)
        windows = self._windows(starts)
        return windows[:, :-1], windows[:, 1:]

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.batch_at(self.position)
        self.position += 1
        return batch


def eval_batches(
    tokens: torch.Tensor, *, seq_len: int, batch_size: int, max_batches: int
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive non-overlapping windows from the start of `tokens`, the same every call, so
    held-out losses from different runs compare. Stops at `max_batches` or the end of the data."""
    n_windows = (len(tokens) - 1) // seq_len
    n_windows = min(n_windows, max_batches * batch_size)
    for first in range(0, n_windows, batch_size):
        idx = torch.arange(first, min(first + batch_size, n_windows))
        starts = idx * seq_len
        windows = tokens[starts[:, None] + torch.arange(seq_len + 1)[None, :]].long()
        yield windows[:, :-1], windows[:, 1:]


def load_eval_tokens(sources: Sequence[str], *, seed: int = 0) -> torch.Tensor:
    """The eval suites of `sources` (see `load_eval_suite`) joined and encoded: held-out text."""
    if not sources:
        raise ValueError("At least one eval source is needed.")
    text = "\n\n".join(join_documents(s, load_eval_suite(s, seed=seed)) for s in sources)
    return ByteTokenizer().encode_tensor(text)
