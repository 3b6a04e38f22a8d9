"""Data preparation: exact dedup, near-duplicate removal (MinHash-LSH), decontamination against the
run's eval suites, and the provenance record of what each step removed.

Everything here is a pure function of the documents it is given; `prepare` writes nothing. The
pipeline stores the output and reports the `Provenance` as the run's "provenance" event.

MinHash and LSH are `datasketch`'s (a declared dependency, installed with the package, never
fetched at run time). `python -m bench.dataprep_minhash` runs it beside the hand-written numpy
MinHash-LSH this module used to carry: on the pydoc topics it is faster (~1.2x end to end, ~2.5x
in MinHash + LSH) with the same pair recall and precision against exact Jaccard (within seed
noise); on line-per-document sources its per-document Python cost is higher, which the exact
one-shingle shortcut in `near_duplicate_sets` more than pays back. Shingle hashes are derived from
BLAKE2b, never from Python's `hash()`, which is salted per process and would make the result
differ between a run and its resume; datasketch's permutations come from a fixed seed.
"""

import functools
import hashlib
import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from datasketch import MinHash, MinHashLSH

SIGNATURE_CHUNK = 1 << 16  # shingles per datasketch update: (chunk x permutations) uint64 = ~60 MB at 112
MIN_SHORT_NGRAM = 3  # an eval document shorter than n words is matched whole, if it has at least 3
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


def minhash(shingle_hashes: Sequence[int], *, permutations: int = 112, seed: int = 1) -> MinHash:
    """The MinHash signature of a shingle set. The shingles are already 64-bit BLAKE2b hashes, so
    datasketch gets them through an identity `hashfunc` and permutes them with its 64-bit affine
    scheme; its permutations come from `numpy.random.RandomState(seed)`, the same in every process.
    Fed in chunks: `update_batch` holds a (shingles x permutations) array, 9 GB for one 10M-shingle
    document at once."""
    m = _empty_minhash(permutations, seed).copy()
    for start in range(0, len(shingle_hashes), SIGNATURE_CHUNK):
        m.update_batch(shingle_hashes[start : start + SIGNATURE_CHUNK])
    return m


def _identity(x: int) -> int:
    return x


@functools.lru_cache(maxsize=8)
def _empty_minhash(permutations: int, seed: int) -> MinHash:
    """Drawing the permutations costs more than hashing a short document: done once, then copied
    (a copy shares the permutation array). Never updated itself."""
    return MinHash(num_perm=permutations, seed=seed, hashfunc=_identity, scheme="affine64")


def near_duplicate_sets(
    shingle_sets: Iterable[Sequence[int]],
    *,
    permutations: int = 112,
    bands: int = 14,
    threshold: float = 0.8,
    seed: int = 1,
) -> list[bool]:
    """`near_duplicates` on shingle sets already computed (see `shingles`)."""
    if permutations % bands:
        raise ValueError(f"{permutations} MinHash permutations do not split into {bands} equal bands.")
    # datasketch's LSH needs two bands or more; one band of every row proposes only documents
    # with the whole signature equal, which a dict of signatures finds just the same
    lsh = (
        MinHashLSH(threshold=threshold, num_perm=permutations, params=(bands, permutations // bands))
        if bands > 1
        else None
    )
    # A one-shingle document (no longer than a shingle) has Jaccard 1 with the same single shingle and at
    # most 1/2 with any larger set, so above 0.5 its near duplicates are exactly the earlier
    # one-shingle documents with the same shingle: a set lookup instead of a MinHash. Line-per-
    # document sources are mostly such documents, and datasketch's per-document cost (~150 us of
    # Python, against ~20 us to shingle a short line) would otherwise make the stage 3x slower on them.
    exact_singles = threshold > 0.5
    singles: set[int] = set()
    whole: dict[bytes, int] = {}
    kept: dict[int, MinHash] = {}
    keep = []
    for i, hashes in enumerate(shingle_sets):
        if not len(hashes):
            keep.append(False)  # a document without a single word is noise, not data
            continue
        if exact_singles and len(hashes) == 1:
            keep.append(int(hashes[0]) not in singles)
            singles.add(int(hashes[0]))
            continue
        m = minhash(hashes, permutations=permutations, seed=seed)
        key = m.hashvalues.tobytes()
        earlier = lsh.query(m) if lsh is not None else [whole[key]] if key in whole else []
        duplicate = any(m.jaccard(kept[j]) >= threshold for j in earlier)
        keep.append(not duplicate)
        if not duplicate:  # only kept documents are indexed: a removed one never removes another
            kept[i] = m
            if lsh is not None:
                lsh.insert(i, m, check_duplication=False)
            else:
                whole[key] = i
    return keep


def near_duplicates(
    documents: Sequence[str],
    *,
    shingle_words: int = 5,
    permutations: int = 112,
    bands: int = 14,
    threshold: float = 0.8,
    seed: int = 1,
) -> list[bool]:
    """keep[i] is False for a document whose estimated Jaccard similarity (shingle sets, MinHash)
    with an earlier kept document is at least `threshold`. LSH (`bands` bands of
    `permutations // bands` rows) proposes the pairs; the signature agreement decides, so a band
    collision alone never removes a document. Documents are hashed one at a time: only the kept
    documents' signatures stay in memory, never every shingle set."""
    return near_duplicate_sets(
        (shingles(doc, shingle_words) for doc in documents),
        permutations=permutations,
        bands=bands,
        threshold=threshold,
        seed=seed,
    )


def estimated_jaccard(
    a: str, b: str, *, shingle_words: int = 5, permutations: int = 112, seed: int = 1
) -> float:
    return minhash(shingles(a, shingle_words), permutations=permutations, seed=seed).jaccard(
        minhash(shingles(b, shingle_words), permutations=permutations, seed=seed)
    )


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


def _flat(docs: dict[str, list[str]]) -> list[str]:
    """Every document, in source order then document order."""
    return [doc for source in docs.values() for doc in source]


def _step(name: str, before: dict[str, list[str]], after: dict[str, list[str]], method: str) -> PrepStep:
    return PrepStep(
        name=name,
        before=len(_flat(before)),
        after=len(_flat(after)),
        detail=f"{method}; {_per_source(before, after)}",
    )


def prepare(
    sources: dict[str, list[str]],
    eval_suites: dict[str, list[str]],
    *,
    exact: bool = True,
    near: bool = True,
    shingle_words: int = 5,
    permutations: int = 112,
    bands: int = 14,
    jaccard: float = 0.8,
    ngram: int = 13,
) -> Prepared:
    """Dedup across all training sources together (the first occurrence wins, in source order), then
    drop every training document that shares an n-gram with any eval suite."""
    steps = []
    current = {name: list(docs) for name, docs in sources.items()}
    input_digest = digest(f"{name}\0{doc}" for name, docs in current.items() for doc in docs)
    if exact:
        kept = _apply(current, exact_duplicates(_flat(current)))
        steps.append(_step("exact_dedup", current, kept, "sha256 of normalized text"))
        current = kept
    if near:
        keep = near_duplicates(
            _flat(current),
            shingle_words=shingle_words,
            permutations=permutations,
            bands=bands,
            threshold=jaccard,
        )
        kept = _apply(current, keep)
        method = (
            f"MinHash-LSH {permutations} hashes, {bands} bands x {permutations // bands} rows, "
            f"{shingle_words}-word shingles, Jaccard >= {jaccard}"
        )
        steps.append(_step("near_dedup", current, kept, method))
        current = kept
    index = ContaminationIndex.build((doc for suite in eval_suites.values() for doc in suite), ngram)
    kept = {name: [doc for doc in docs if not index.contaminated(doc)] for name, docs in current.items()}
    suites = ", ".join(eval_suites) or "none"
    steps.append(_step("decontamination", current, kept, f"{ngram}-gram overlap with eval suites [{suites}]"))
    output_digest = digest(f"{name}\0{doc}" for name, docs in kept.items() for doc in docs)
    return Prepared(documents=kept, steps=steps, input_digest=input_digest, output_digest=output_digest)
