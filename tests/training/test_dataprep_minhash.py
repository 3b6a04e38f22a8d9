"""Near dedup as the stage runs it (datasketch MinHash + MinHashLSH): planted near copies of the shipped
pydoc topics are found, the topics themselves are not flagged, and the result is a function of the seed."""

import os
import random
import subprocess
import sys

import pytest

from training.data import prep
from training.data.corpora import load_documents
from training.data.prep import estimated_jaccard, minhash, near_duplicates, shingles


@pytest.fixture(scope="module")
def topics() -> list[str]:
    """The shipped source, long topics only (>= 200 words, so a 5% edit is at least 10 words), exact
    duplicates dropped as `prepare` drops them first."""
    docs = load_documents("builtin:pydoc_topics")
    docs = [d for d, k in zip(docs, prep.exact_duplicates(docs), strict=True) if k]
    return [d for d in docs if len(prep.words(d)) >= 200]


def exact_jaccard(a: str, b: str) -> float:
    x, y = set(shingles(a, 5)), set(shingles(b, 5))
    return len(x & y) / len(x | y)


def span_edit(doc: str, rate: float, rng: random.Random) -> str:
    """`rate` of the words replaced in one contiguous span (an edited paragraph)."""
    tokens = prep.words(doc)
    width = round(rate * len(tokens))
    start = rng.randrange(len(tokens) - width + 1)
    return " ".join(tokens[:start] + [f"edit{k}" for k in range(width)] + tokens[start + width :])


def scattered_edit(doc: str, rate: float, rng: random.Random) -> str:
    """`rate` of the words replaced at random places."""
    tokens = prep.words(doc)
    for k in rng.sample(range(len(tokens)), round(rate * len(tokens))):
        tokens[k] = f"edit{k}"
    return " ".join(tokens)


def test_the_shipped_topics_have_no_near_duplicates(topics):
    assert len(topics) > 40
    assert all(near_duplicates(topics))


def test_planted_5_percent_edits_are_found_and_the_originals_kept(topics):
    rng = random.Random(7)
    originals = topics[::4]
    copies = [span_edit(d, 0.05, rng) for d in originals]
    assert min(exact_jaccard(o, c) for o, c in zip(originals, copies, strict=True)) > 0.8  # 0.83 .. 0.95
    keep = near_duplicates(topics + copies)
    assert keep[: len(topics)] == [True] * len(topics)  # not one unrelated topic flagged
    assert keep[len(topics) :] == [False] * len(copies)  # every planted copy found


def test_scattered_edits_follow_the_shingle_jaccard(topics):
    """One word in a hundred changed touches ~5% of the 5-word shingles (Jaccard ~0.9): a duplicate.
    Five in a hundred touch ~23% (Jaccard ~0.63): below 0.8, so kept, as the threshold says."""
    rng = random.Random(8)
    originals = topics[1::4]
    light = [scattered_edit(d, 0.01, rng) for d in originals]
    heavy = [scattered_edit(d, 0.05, rng) for d in originals]
    assert all(exact_jaccard(o, c) > 0.85 for o, c in zip(originals, light, strict=True))
    assert all(exact_jaccard(o, c) < 0.72 for o, c in zip(originals, heavy, strict=True))
    assert near_duplicates(originals + light) == [True] * len(originals) + [False] * len(light)
    assert all(near_duplicates(originals + heavy))


def test_the_estimate_tracks_exact_jaccard(topics):
    rng = random.Random(9)
    for doc in topics[:6]:
        for copy in (span_edit(doc, 0.1, rng), scattered_edit(doc, 0.02, rng)):
            assert abs(estimated_jaccard(doc, copy) - exact_jaccard(doc, copy)) < 0.12
    assert estimated_jaccard(topics[0], topics[1]) < 0.2


def test_results_are_a_function_of_the_seed(topics):
    rng = random.Random(10)
    docs = topics + [scattered_edit(d, 0.02, rng) for d in topics]  # Jaccard ~0.82: near the threshold
    first = near_duplicates(docs, seed=3)
    assert near_duplicates(docs, seed=3) == first
    hashes = shingles(topics[0], 5)
    assert (minhash(hashes, seed=3).hashvalues == minhash(hashes, seed=3).hashvalues).all()
    assert (minhash(hashes, seed=3).hashvalues != minhash(hashes, seed=4).hashvalues).any()


def test_signatures_do_not_depend_on_the_process():
    """Python's str hash is salted per process; nothing the signature depends on may use it."""
    code = (
        "from training.data.prep import minhash, shingles; "
        "print(minhash(shingles('the quick brown fox jumps over the lazy dog ' * 5, 5), seed=3)"
        ".hashvalues.tolist())"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": salt},
        ).stdout
        for salt in ("1", "2")
    ]
    here = minhash(
        shingles("the quick brown fox jumps over the lazy dog " * 5, 5), seed=3
    ).hashvalues.tolist()
    assert runs[0] == runs[1] == f"{here}\n"


def test_one_band_proposes_only_equal_signatures():
    """datasketch's LSH needs two bands; the manifest allows one, which the stage serves itself."""
    base = " ".join(f"w{i}" for i in range(300))
    edited = base.replace("w150", "zebra")
    assert near_duplicates([base, edited, base], bands=1) == [True, True, False]
    assert near_duplicates([base, edited, base]) == [True, False, False]


def test_long_documents_are_hashed_in_chunks(monkeypatch):
    hashes = list(range(1, 5001))
    whole = minhash(hashes, seed=2).hashvalues.tolist()
    monkeypatch.setattr(prep, "SIGNATURE_CHUNK", 7)
    assert minhash(hashes, seed=2).hashvalues.tolist() == whole


def test_one_shingle_documents_are_settled_exactly():
    """Five words or fewer is one shingle: the same shingle is a duplicate (Jaccard 1), anything else
    is at most Jaccard 1/2, so above 0.5 these never reach MinHash."""
    lines = ["12+35=47", "12 + 35 = 47", "12+35=48", "12+35=47 and then more words", "12+35=48"]
    assert near_duplicates(lines) == [True, False, True, True, False]
    assert near_duplicates(lines, threshold=0.5) == near_duplicates(lines)  # via MinHash, same answer here
