"""Data preparation: exact dedup, near-duplicate removal (MinHash-LSH), decontamination against the
run's eval suites, and the provenance record of what each step removed.

Everything here is a pure function of the documents it is given; `prepare` writes nothing. The
pipeline stores the output and reports the `Provenance` as the run's "provenance" event.

MinHash-LSH is written here rather than taken from `datasketch`: it is not installed, the trainer
must not download anything at run time, and the part needed is ~60 lines of numpy. Hashes are
derived from BLAKE2b, never from Python's `hash()`, which is salted per process and would make the
result differ between a run and its resume.
"""

import hashlib
import re
import unicodedata
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

MERSENNE_31 = (1 << 31) - 1  # prime modulus of the permutations: a*x + b stays below 2**62, no overflow
MIN_SHORT_NGRAM = 3  # an eval document shorter than n words is matched whole, if it has at least 3
SIGNATURE_CHUNK = 1 << 16  # shingles hashed per numpy block: (permutations x chunk) int64 = ~60 MB at 112
_TOKEN = re.compile(r"\w+|[^\w\s]")


def normalize(text: str) -> str:
    """NFKC, lower case, whitespace collapsed: what "the same text" means for exact dedup."""
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def words(text: str) -> list[str]:
    """Normalized word and punctuation tokens: "12+35=47" -> ["12", "+", "35", "=", "47"]."""
    return _TOKEN.findall(normalize(text))


def digest(documents: Iterable[str]) -> str:
    """sha256 over the documents in order, each length-prefixed so boundaries count."""
    h = hashlib.sha256()
    for doc in documents:
        raw = doc.encode("utf-8")
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return "sha256:" + h.hexdigest()


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


# --- exact dedup ---------------------------------------------------------------------------------


def exact_duplicates(documents: Sequence[str]) -> list[bool]:
    """keep[i] is False for a document whose normalized text appeared earlier."""
    seen: set[bytes] = set()
    keep = []
    for doc in documents:
        key = hashlib.sha256(normalize(doc).encode("utf-8")).digest()
        keep.append(key not in seen)
        seen.add(key)
    return keep


# --- near dedup: MinHash-LSH ---------------------------------------------------------------------


def shingles(text: str, size: int) -> list[int]:
    """64-bit hashes of the distinct `size`-word shingles; a shorter document is one shingle."""
    tokens = words(text)
    if not tokens:
        return []
    if len(tokens) <= size:
        return [_hash64(" ".join(tokens))]
    return sorted({_hash64(" ".join(tokens[i : i + size])) for i in range(len(tokens) - size + 1)})


@dataclass(frozen=True, slots=True)
class MinHasher:
    """`permutations` universal hashes h(x) = (a*x + b) mod p, seeded, so signatures compare across
    runs. The signature of a set is the minimum of each hash over the set."""

    a: np.ndarray
    b: np.ndarray

    @classmethod
    def create(cls, permutations: int, seed: int = 1) -> "MinHasher":
        rng = np.random.default_rng(seed)
        a = rng.integers(1, MERSENNE_31, size=permutations, dtype=np.int64)
        b = rng.integers(0, MERSENNE_31, size=permutations, dtype=np.int64)
        return cls(a=a, b=b)

    def signatures(self, shingle_sets: Sequence[Sequence[int] | np.ndarray]) -> np.ndarray:
        """(documents, permutations) int64; a document without shingles gets all MERSENNE_31."""
        n = len(shingle_sets)
        out = np.full((n, len(self.a)), MERSENNE_31, dtype=np.int64)
        lengths = np.array([len(s) for s in shingle_sets], dtype=np.int64)
        if n == 0 or lengths.sum() == 0:
            return out
        flat = np.concatenate([np.asarray(s, dtype=np.uint64) for s in shingle_sets])
        values = (flat % np.uint64(MERSENNE_31)).astype(np.int64)
        owner = np.repeat(np.arange(n), lengths)
        for start in range(0, len(values), SIGNATURE_CHUNK):
            x = values[start : start + SIGNATURE_CHUNK]
            hashed = (self.a[None, :] * x[:, None] + self.b[None, :]) % MERSENNE_31  # (chunk, perms)
            docs = owner[start : start + SIGNATURE_CHUNK]  # sorted: each document's shingles are adjacent
            firsts = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
            rows = docs[firsts]
            out[rows] = np.minimum(out[rows], np.minimum.reduceat(hashed, firsts, axis=0))
        return out


def lsh_candidates(signatures: np.ndarray, bands: int) -> dict[int, set[int]]:
    """For each document, the earlier documents that share at least one band of its signature."""
    n, perms = signatures.shape
    if perms % bands:
        raise ValueError(f"{perms} MinHash permutations do not split into {bands} equal bands.")
    rows = perms // bands
    candidates: dict[int, set[int]] = defaultdict(set)
    for band in range(bands):
        block = signatures[:, band * rows : (band + 1) * rows]
        _, bucket, counts = np.unique(block, axis=0, return_inverse=True, return_counts=True)
        shared = np.flatnonzero(counts[bucket] > 1)  # only documents whose bucket has company
        members: dict[int, list[int]] = defaultdict(list)
        for i in shared.tolist():  # ascending, so each list is in document order
            members[int(bucket[i])].append(i)
        for group in members.values():
            for k, i in enumerate(group[1:], start=1):
                candidates[i].update(group[:k])
    return candidates


def near_duplicates(
    documents: Sequence[str], *, shingle_words: int = 5, permutations: int = 112, bands: int = 14,
    threshold: float = 0.8, seed: int = 1,
) -> list[bool]:
    """keep[i] is False for a document whose estimated Jaccard similarity (shingle sets, MinHash)
    with an earlier kept document is at least `threshold`. LSH proposes the pairs; the signature
    agreement decides, so a band collision alone never removes a document."""
    # numpy per document: 8 bytes a shingle instead of a Python int's ~36 (a 64 MB file has ~10M)
    sets = [np.array(shingles(doc, shingle_words), dtype=np.uint64) for doc in documents]
    signatures = MinHasher.create(permutations, seed).signatures(sets)
    candidates = lsh_candidates(signatures, bands)
    keep = [len(s) > 0 for s in sets]  # a document without a single word is noise, not data
    for i in range(len(documents)):
        if not keep[i]:
            continue
        for j in sorted(candidates.get(i, ())):
            if keep[j] and float(np.mean(signatures[i] == signatures[j])) >= threshold:
                keep[i] = False
                break
    return keep


def estimated_jaccard(a: str, b: str, *, shingle_words: int = 5, permutations: int = 112) -> float:
    sig = MinHasher.create(permutations).signatures([shingles(a, shingle_words), shingles(b, shingle_words)])
    return float(np.mean(sig[0] == sig[1]))


# --- decontamination -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ContaminationIndex:
    """The n-grams of every eval document. An eval document with fewer than n (but at least
    MIN_SHORT_NGRAM) words is indexed whole, as GPT-3's decontamination does: an arithmetic problem
    "12+35=47" is five words, and a training line holding it is contaminated."""

    n: int
    grams: frozenset[tuple[str, ...]]
    short_lengths: frozenset[int]

    @classmethod
    def build(cls, eval_documents: Iterable[str], n: int = 13) -> "ContaminationIndex":
        grams: set[tuple[str, ...]] = set()
        short: set[int] = set()
        for doc in eval_documents:
            tokens = words(doc)
            if len(tokens) >= n:
                grams.update(tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1))
            elif len(tokens) >= MIN_SHORT_NGRAM:
                grams.add(tuple(tokens))
                short.add(len(tokens))
        return cls(n=n, grams=frozenset(grams), short_lengths=frozenset(short))

    def contaminated(self, document: str) -> bool:
        tokens = words(document)
        for size in (self.n, *self.short_lengths):
            if any(tuple(tokens[i : i + size]) in self.grams for i in range(len(tokens) - size + 1)):
                return True
        return False


# --- the whole preparation -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class PrepStep:
    name: str
    before: int
    after: int
    detail: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepared:
    documents: dict[str, list[str]]  # per training ref name, the documents kept, in input order
    steps: list[PrepStep]
    input_digest: str
    output_digest: str


def _apply(sources: dict[str, list[str]], keep: list[bool]) -> dict[str, list[str]]:
    out, i = {}, 0
    for name, docs in sources.items():
        out[name] = [doc for doc, k in zip(docs, keep[i : i + len(docs)], strict=True) if k]
        i += len(docs)
    return out


def _per_source(before: dict[str, list[str]], after: dict[str, list[str]]) -> str:
    return "; ".join(f"{name} {len(before[name])}->{len(after[name])}" for name in before)


def prepare(
    sources: dict[str, list[str]], eval_suites: dict[str, list[str]], *, exact: bool = True, near: bool = True,
    shingle_words: int = 5, permutations: int = 112, bands: int = 14, jaccard: float = 0.8, ngram: int = 13,
) -> Prepared:
    """Dedup across all training sources together (the first occurrence wins, in source order), then
    drop every training document that shares an n-gram with any eval suite."""
    names = list(sources)
    steps = []
    current = {name: list(sources[name]) for name in names}
    flat = lambda docs: [d for name in names for d in docs[name]]  # noqa: E731
    input_digest = digest(f"{name}\0{doc}" for name in names for doc in sources[name])

    if exact:
        before = current
        current = _apply(current, exact_duplicates(flat(current)))
        steps.append(PrepStep(name="exact_dedup", before=len(flat(before)), after=len(flat(current)),
                              detail=f"sha256 of normalized text; {_per_source(before, current)}"))
    if near:
        before = current
        keep = near_duplicates(flat(current), shingle_words=shingle_words, permutations=permutations,
                               bands=bands, threshold=jaccard)
        current = _apply(current, keep)
        steps.append(PrepStep(
            name="near_dedup", before=len(flat(before)), after=len(flat(current)),
            detail=(f"MinHash-LSH {permutations} hashes, {bands} bands x {permutations // bands} rows, "
                    f"{shingle_words}-word shingles, Jaccard >= {jaccard}; {_per_source(before, current)}"),
        ))
    index = ContaminationIndex.build((doc for suite in eval_suites.values() for doc in suite), ngram)
    before = current
    current = {name: [doc for doc in docs if not index.contaminated(doc)] for name, docs in current.items()}
    suites = ", ".join(eval_suites) or "none"
    steps.append(PrepStep(name="decontamination", before=len(flat(before)), after=len(flat(current)),
                          detail=f"{ngram}-gram overlap with eval suites [{suites}]; {_per_source(before, current)}"))
    output_digest = digest(f"{name}\0{doc}" for name in names for doc in current[name])
    return Prepared(documents=current, steps=steps, input_digest=input_digest, output_digest=output_digest)
