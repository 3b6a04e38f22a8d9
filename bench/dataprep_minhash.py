"""`python -m bench.dataprep_minhash [--repeats N] [--seeds N] [--out PATH]`: near-duplicate detection
by the hand-written numpy MinHash-LSH against `datasketch` (MinHash + MinHashLSH), side by side.

Corpora: the data prep's shipped source, `builtin:pydoc_topics` (the documents
`training.data.corpora.load_documents` gives the pipeline: 79 long help texts); the same topics
plus planted near copies; and the training mix of `examples/manifests/full.json` (the topics and
the generated line sources: ~35k documents, most of them one 5-word shingle long). Exact duplicates
are dropped first, as `prepare` does.

Rows: `numpy (before)` is the hand-written implementation `training/data/prep.py` carried
(kept here verbatim so the comparison can be rerun); `datasketch (stage)` is what the stage runs now
(`prep.near_duplicate_sets`), which settles one-shingle documents by a set lookup (exact: see
there) and hands the rest to datasketch; `numpy + one-shingle path` gives the hand-written code the
same shortcut, so the library is compared with like. All use the same shingles
(`prep.shingles`: 64-bit BLAKE2b hashes of 5-word shingles), the manifest's defaults (112
permutations, 14 bands x 8 rows, Jaccard >= 0.8) and the same decision rule: LSH proposes earlier
documents, the signature agreement (estimated Jaccard) decides. datasketch gets the shingle hashes
through an identity `hashfunc` with its 64-bit affine scheme, so the rows differ only in MinHash and
LSH, not in what they hash.

Quality is measured on pairs: a pair is flagged when it is decided a near duplicate (LSH proposal
and estimated Jaccard at or above the threshold; for two one-shingle documents on the shortcut,
the same shingle); the truth is the exact Jaccard of the two shingle sets, over all pairs (a sparse
set-intersection product; pairs sharing no shingle have Jaccard 0). The shipped topics have no near
duplicates, so the second corpus adds planted near copies of every topic, edited over a grid from
barely (Jaccard ~0.95) to clearly below the threshold (~0.6): scattered word substitutions and one
replaced contiguous span. Each quality figure is the mean (and the worst) over `--seeds` MinHash
seeds; "removed" is what the stage's rule removes with seed 1.

Speed is documents per second of the whole near-dedup decision (shingling, signatures, LSH,
verification), and of the MinHash + LSH part alone on shingles computed once; the rows alternate
`--repeats` times and each rate is over the median time.

The decision rule (issue "An honest pipeline", item 9): datasketch replaces the hand-written code if
it is within ~2x of its speed with equal or better recall.
"""

import argparse
import json
import pathlib
import random
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np
from datasketch import MinHashLSH
from scipy import sparse

from training.data import prep
from training.data.corpora import load_documents

SOURCE = "builtin:pydoc_topics"
EXAMPLE_MANIFEST = pathlib.Path(__file__).resolve().parent.parent / "examples" / "manifests" / "full.json"
PERMUTATIONS, BANDS, THRESHOLD, SHINGLE_WORDS = 112, 14, 0.8, 5
SCATTERED_RATES = (0.005, 0.01, 0.02, 0.03, 0.05)  # words substituted at random: Jaccard ~0.95 .. ~0.63
SPAN_RATES = (0.05, 0.10, 0.20)  # one contiguous span replaced: Jaccard ~0.9 .. ~0.67
CLEAR_MARGIN = 0.05
MERSENNE_31 = (1 << 31) - 1
SIGNATURE_CHUNK = 1 << 16


# --- the hand-written numpy MinHash-LSH (what training/data/prep.py shipped before datasketch) ---


def numpy_signatures(sets: Sequence[np.ndarray], permutations: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    a = rng.integers(1, MERSENNE_31, size=permutations, dtype=np.int64)
    b = rng.integers(0, MERSENNE_31, size=permutations, dtype=np.int64)
    n = len(sets)
    out = np.full((n, permutations), MERSENNE_31, dtype=np.int64)
    lengths = np.array([len(s) for s in sets], dtype=np.int64)
    if n == 0 or lengths.sum() == 0:
        return out
    values = (np.concatenate([np.asarray(s, dtype=np.uint64) for s in sets]) % np.uint64(MERSENNE_31)).astype(
        np.int64
    )
    owner = np.repeat(np.arange(n), lengths)
    for start in range(0, len(values), SIGNATURE_CHUNK):
        x = values[start : start + SIGNATURE_CHUNK]
        hashed = (a[None, :] * x[:, None] + b[None, :]) % MERSENNE_31
        docs = owner[start : start + SIGNATURE_CHUNK]
        firsts = np.flatnonzero(np.r_[True, docs[1:] != docs[:-1]])
        rows = docs[firsts]
        out[rows] = np.minimum(out[rows], np.minimum.reduceat(hashed, firsts, axis=0))
    return out


def numpy_candidates(signatures: np.ndarray, bands: int) -> dict[int, set[int]]:
    """For each document, the earlier documents that share at least one band of its signature."""
    rows = signatures.shape[1] // bands
    candidates: dict[int, set[int]] = defaultdict(set)
    for band in range(bands):
        block = signatures[:, band * rows : (band + 1) * rows]
        _, bucket, counts = np.unique(block, axis=0, return_inverse=True, return_counts=True)
        members: dict[int, list[int]] = defaultdict(list)
        for i in np.flatnonzero(counts[bucket] > 1).tolist():
            members[int(bucket[i])].append(i)
        for group in members.values():
            for k, i in enumerate(group[1:], start=1):
                candidates[i].update(group[:k])
    return candidates


def numpy_keep(sets: Sequence[np.ndarray], seed: int) -> list[bool]:
    signatures = numpy_signatures(sets, PERMUTATIONS, seed)
    candidates = numpy_candidates(signatures, BANDS)
    keep = [len(s) > 0 for s in sets]
    for i in range(len(sets)):
        if keep[i]:
            for j in sorted(candidates.get(i, ())):
                if keep[j] and float(np.mean(signatures[i] == signatures[j])) >= THRESHOLD:
                    keep[i] = False
                    break
    return keep


def numpy_pairs(sets: Sequence[np.ndarray], seed: int) -> set[tuple[int, int]]:
    signatures = numpy_signatures(sets, PERMUTATIONS, seed)
    return {
        (j, i)
        for i, earlier in numpy_candidates(signatures, BANDS).items()
        for j in earlier
        if len(sets[i]) and len(sets[j]) and float(np.mean(signatures[i] == signatures[j])) >= THRESHOLD
    }


# --- the one-shingle shortcut the stage takes, for the numpy rows ---------------------------------------


def one_shingle_path(keep_fn: Callable, pairs_fn: Callable) -> tuple[Callable, Callable]:
    """`keep_fn`/`pairs_fn` behind the stage's shortcut: one-shingle documents by set lookup."""

    def split(sets):
        singles = defaultdict(list)
        multi = []
        for i, s in enumerate(sets):
            if len(s) == 1:
                singles[int(s[0])].append(i)
            elif len(s) > 1:
                multi.append(i)
        return singles, multi

    def keep(sets, seed):
        singles, multi = split(sets)
        out = [False] * len(sets)
        for group in singles.values():
            out[group[0]] = True
        for i, k in zip(multi, keep_fn([sets[i] for i in multi], seed), strict=True):
            out[i] = k
        return out

    def pairs(sets, seed):
        singles, multi = split(sets)
        out = {(j, i) for group in singles.values() for k, i in enumerate(group) for j in group[:k]}
        return out | {(multi[j], multi[i]) for j, i in pairs_fn([sets[i] for i in multi], seed)}

    return keep, pairs


# --- datasketch: what training/data/prep.py runs -------------------------------------------------


def datasketch_keep(sets: Sequence[np.ndarray], seed: int) -> list[bool]:
    return prep.near_duplicate_sets(
        sets, permutations=PERMUTATIONS, bands=BANDS, threshold=THRESHOLD, seed=seed
    )


def _datasketch_lsh_pairs(sets: Sequence[np.ndarray], seed: int) -> set[tuple[int, int]]:
    """Every pair the stage's LSH proposes and its signatures accept, all documents indexed."""
    lsh = MinHashLSH(threshold=THRESHOLD, num_perm=PERMUTATIONS, params=(BANDS, PERMUTATIONS // BANDS))
    pairs, hashes = set(), {}
    for i, s in enumerate(sets):
        if not len(s):
            continue
        m = prep.minhash(s, permutations=PERMUTATIONS, seed=seed)
        pairs.update((j, i) for j in lsh.query(m) if m.jaccard(hashes[j]) >= THRESHOLD)
        lsh.insert(i, m, check_duplication=False)
        hashes[i] = m
    return pairs


_, datasketch_pairs = one_shingle_path(datasketch_keep, _datasketch_lsh_pairs)  # the stage's pairs

IMPLEMENTATIONS: dict[str, tuple[Callable, Callable]] = {
    "numpy (before)": (numpy_keep, numpy_pairs),
    "numpy + one-shingle path": one_shingle_path(numpy_keep, numpy_pairs),
    "datasketch (stage)": (datasketch_keep, datasketch_pairs),
}


# --- data, truth, measurement ---------------------------------------------------------------------------


def planted_corpus(documents: Sequence[str], seed: int = 0) -> tuple[list[str], list[str]]:
    """The documents, then for each one a near copy per edit in the grid; and each copy's edit label."""
    rng = random.Random(seed)
    out, labels = list(documents), ["original"] * len(documents)
    for doc in documents:
        tokens = prep.words(doc)
        for rate in SCATTERED_RATES:
            copy = list(tokens)
            for k in rng.sample(range(len(copy)), max(1, round(rate * len(copy)))):
                copy[k] = f"planted{rng.randrange(10**9)}"
            out.append(" ".join(copy))
            labels.append(f"scattered {rate:.1%}")
        for rate in SPAN_RATES:
            width = max(1, round(rate * len(tokens)))
            start = rng.randrange(len(tokens) - width + 1)
            copy = (
                tokens[:start]
                + [f"planted{rng.randrange(10**9)}" for _ in range(width)]
                + tokens[start + width :]
            )
            out.append(" ".join(copy))
            labels.append(f"span {rate:.0%}")
    return out, labels


def exact_jaccard_pairs(sets: Sequence[np.ndarray], threshold: float) -> tuple[set[tuple[int, int]], int]:
    """Every pair (j < i) whose shingle sets have Jaccard >= threshold, and how many pairs were compared."""
    vocab, column = np.unique(
        np.concatenate([np.asarray(s, dtype=np.uint64) for s in sets]), return_inverse=True
    )
    lengths = np.array([len(s) for s in sets])
    rows = np.repeat(np.arange(len(sets)), lengths)
    x = sparse.csr_matrix((np.ones(len(rows), dtype=np.int32), (rows, column)), shape=(len(sets), len(vocab)))
    inter = (x @ x.T).tocoo()
    union = lengths[inter.row] + lengths[inter.col] - inter.data
    hit = (inter.row > inter.col) & (inter.data >= threshold * union)
    pairs = {(int(j), int(i)) for i, j in zip(inter.row[hit], inter.col[hit], strict=True)}
    return pairs, len(sets) * (len(sets) - 1) // 2


def quality(sets: Sequence[np.ndarray], seeds: int) -> dict:
    """Pair recall and precision against exact Jaccard, the mean (and worst) over MinHash seeds; also
    the recall of clear duplicates (exact Jaccard >= threshold + CLEAR_MARGIN), which should be ~1.
    None where there is nothing to recall (no true pair) or nothing was flagged."""
    truth, compared = exact_jaccard_pairs(sets, THRESHOLD)
    clear, _ = exact_jaccard_pairs(sets, THRESHOLD + CLEAR_MARGIN)
    out = {"pairs_compared": compared, "true_pairs": len(truth), "clear_pairs": len(clear)}
    mean = lambda xs: None if None in xs else round(statistics.fmean(xs), 4)  # noqa: E731
    worst = lambda xs: None if None in xs else round(min(xs), 4)  # noqa: E731
    for name, (_, pairs_fn) in IMPLEMENTATIONS.items():
        recalls, clear_recalls, precisions, flagged = [], [], [], []
        for seed in range(1, seeds + 1):
            pairs = pairs_fn(sets, seed)
            recalls.append(len(pairs & truth) / len(truth) if truth else None)
            clear_recalls.append(len(pairs & clear) / len(clear) if clear else None)
            precisions.append(len(pairs & truth) / len(pairs) if pairs else None)
            flagged.append(len(pairs))
        out[name] = {
            "recall": mean(recalls),
            "recall_min": worst(recalls),
            "recall_clear": mean(clear_recalls),
            "recall_clear_min": worst(clear_recalls),
            "precision": mean(precisions),
            "precision_min": worst(precisions),
            "flagged_pairs": statistics.fmean(flagged),
        }
    return out


def speed(documents: Sequence[str], repeats: int) -> dict:
    """Median seconds over alternating repeats: end to end (shingling included) and MinHash + LSH only."""
    sets = [np.array(prep.shingles(d, SHINGLE_WORDS), dtype=np.uint64) for d in documents]
    times: dict[str, dict[str, list[float]]] = {
        name: {"total": [], "minhash_lsh": []} for name in IMPLEMENTATIONS
    }
    for _ in range(repeats):
        for name, (keep_fn, _) in IMPLEMENTATIONS.items():
            t0 = time.perf_counter()
            keep_fn([np.array(prep.shingles(d, SHINGLE_WORDS), dtype=np.uint64) for d in documents], 1)
            t2 = time.perf_counter()
            keep_fn(sets, 1)
            t3 = time.perf_counter()
            times[name]["total"].append(t2 - t0)
            times[name]["minhash_lsh"].append(t3 - t2)
    out = {}
    for name, t in times.items():
        total, core = statistics.median(t["total"]), statistics.median(t["minhash_lsh"])
        out[name] = {
            "docs_per_s": round(len(documents) / total, 1),
            "seconds": round(total, 4),
            "minhash_lsh_docs_per_s": round(len(documents) / core, 1),
            "minhash_lsh_seconds": round(core, 4),
        }
    return out


def removed(documents: Sequence[str]) -> dict[str, int]:
    sets = [np.array(prep.shingles(d, SHINGLE_WORDS), dtype=np.uint64) for d in documents]
    return {name: sum(not k for k in keep_fn(sets, 1)) for name, (keep_fn, _) in IMPLEMENTATIONS.items()}


def example_mix(path: pathlib.Path = EXAMPLE_MANIFEST) -> list[str]:
    """The training refs of an example manifest, loaded as the pipeline loads them (its seed)."""
    raw = json.loads(path.read_text())
    return [
        doc
        for ref in raw["data"]
        if ref.get("role", "train") == "train" and not ref["source"].startswith("file:")
        for doc in load_documents(ref["source"], seed=raw.get("seed", 0))
    ]


def _deduped(documents: list[str]) -> list[str]:
    return [d for d, k in zip(documents, prep.exact_duplicates(documents), strict=True) if k]  # as prepare()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--out", type=pathlib.Path, default=None, help="also write the results as JSON")
    args = parser.parse_args(argv)

    shipped = _deduped(load_documents(SOURCE))
    planted, _ = planted_corpus(shipped)
    corpora = {
        "pydoc topics (shipped)": shipped,
        "topics + planted copies": planted,
        f"{EXAMPLE_MANIFEST.name} training mix": _deduped(example_mix()),
    }
    results = {
        "source": SOURCE,
        "permutations": PERMUTATIONS,
        "bands": BANDS,
        "rows": PERMUTATIONS // BANDS,
        "threshold": THRESHOLD,
        "shingle_words": SHINGLE_WORDS,
        "corpora": {},
    }
    for label, corpus in corpora.items():
        sets = [np.array(prep.shingles(d, SHINGLE_WORDS), dtype=np.uint64) for d in corpus]
        results["corpora"][label] = {
            "documents": len(corpus),
            "shingles": int(sum(len(s) for s in sets)),
            "one_shingle_documents": sum(len(s) == 1 for s in sets),
            "near_duplicates_removed": removed(corpus),
            "speed": speed(corpus, args.repeats),
            "quality": quality(sets, args.seeds),
        }

    print(
        f"near dedup: {PERMUTATIONS} permutations, {BANDS} bands x {PERMUTATIONS // BANDS} rows, "
        f"{SHINGLE_WORDS}-word shingles, Jaccard >= {THRESHOLD}; quality: mean (worst) over {args.seeds} seeds"
    )

    def fmt(mean: float | None, worst: float | None) -> str:
        return f"{'-':>15}" if mean is None else f"{mean:>7.3f} ({worst:.3f})"

    clear = f"recall J>={THRESHOLD + CLEAR_MARGIN:.2f}"
    header = (
        f"{'corpus':<28} {'implementation':<24} {'docs/s':>8} {'MinHash+LSH docs/s':>18} {'recall':>15} "
        f"{clear:>15} {'precision':>15} {'removed':>7}"
    )
    print(header)
    print("-" * len(header))
    for label, r in results["corpora"].items():
        q = r["quality"]
        for name in IMPLEMENTATIONS:
            s, qi = r["speed"][name], q[name]
            print(
                f"{label:<28} {name:<24} {s['docs_per_s']:>8.0f} {s['minhash_lsh_docs_per_s']:>18.0f} "
                f"{fmt(qi['recall'], qi['recall_min'])} {fmt(qi['recall_clear'], qi['recall_clear_min'])} "
                f"{fmt(qi['precision'], qi['precision_min'])} {r['near_duplicates_removed'][name]:>7}"
            )
        print(
            f"{'':<28} {r['documents']} documents ({r['one_shingle_documents']} of one shingle), {r['shingles']} "
            f"shingles; of {q['pairs_compared']} pairs, {q['true_pairs']} at exact Jaccard >= {THRESHOLD}, "
            f"{q['clear_pairs']} at >= {THRESHOLD + CLEAR_MARGIN:.2f}"
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
