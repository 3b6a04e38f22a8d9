"""Data preparation on crafted data: known duplicates, a near copy, planted eval overlap."""

import random

import pytest

from training.data.prep import (
    ContaminationIndex,
    digest,
    estimated_jaccard,
    exact_duplicates,
    near_duplicates,
    normalize,
    prepare,
    words,
)

VOCAB = (
    "river stone light green slow cloud over under small bird wind north old road blue sand quiet field "
    "harbor lantern copper meadow thunder violet orchard canyon glacier ember falcon willow"
).split()


def essay(seed: int, n_words: int = 120) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCAB) for _ in range(n_words))


def test_normalize_and_words():
    assert normalize("  Hello\tWORLD \n") == "hello world"
    assert words("12+35=47") == ["12", "+", "35", "=", "47"]


def test_exact_dedup_drops_later_copies_up_to_case_and_whitespace():
    docs = ["The cat sat.", "the  cat sat.", "A dog.", "The cat sat.", "a DOG.", "Another."]
    assert exact_duplicates(docs) == [True, False, True, False, False, True]


def test_minhash_finds_a_near_copy_and_not_an_unrelated_document():
    original = essay(1, 300)
    tokens = original.split()
    tokens[150] = "zebra"  # one word changed in 300: 5 of ~296 shingles differ, Jaccard ~0.97
    near_copy = " ".join(tokens)
    unrelated = essay(2, 300)
    assert estimated_jaccard(original, near_copy) > 0.9
    assert estimated_jaccard(original, unrelated) < 0.2
    assert near_duplicates([original, unrelated, near_copy]) == [True, True, False]


def test_minhash_keeps_documents_below_the_threshold():
    base = essay(3, 200).split()
    half = " ".join(base[:100] + essay(4, 100).split())  # shares half its shingles: Jaccard ~1/3
    assert near_duplicates([" ".join(base), half]) == [True, True]


def test_minhash_is_deterministic_across_calls():
    docs = [essay(i, 80) for i in range(30)] + [essay(5, 80)]
    assert near_duplicates(docs) == near_duplicates(docs)
    assert near_duplicates(docs)[-1] is False  # the exact repeat of doc 5 is also a near duplicate


def test_bands_must_divide_permutations():
    with pytest.raises(ValueError, match="equal bands"):
        near_duplicates(["a b c d e f"], permutations=112, bands=15)


def test_decontamination_drops_13_gram_overlap_and_keeps_12():
    eval_doc = " ".join(f"w{i}" for i in range(40))
    index = ContaminationIndex.build([eval_doc], n=13)
    planted = "intro words here " + " ".join(f"w{i}" for i in range(10, 23)) + " outro"  # 13 in a row
    near_miss = "intro " + " ".join(f"w{i}" for i in range(10, 22)) + " outro"  # only 12
    assert index.contaminated(planted)
    assert not index.contaminated(near_miss)
    assert index.contaminated(planted.upper())  # normalised before matching


def test_short_eval_documents_match_whole():
    index = ContaminationIndex.build(["12+35=47", "ab"], n=13)  # 5 words; 1 word (too short to index)
    assert index.contaminated("12+35=47")
    assert index.contaminated("some text then 12 + 35 = 47 and more")
    assert not index.contaminated("12+35=48")
    assert not index.contaminated("ab ab ab")


def test_prepare_counts_every_step_on_crafted_data():
    docs_a = [essay(10), essay(11), essay(10), essay(12)]  # one exact duplicate (essay 10 twice)
    near = essay(11).split()
    near[60] = "zebra"
    eval_doc = essay(99, 60)
    planted = essay(13, 50) + " " + " ".join(eval_doc.split()[5:25]) + " " + essay(14, 50)  # 20 eval words
    docs_b = [" ".join(near), planted, essay(15), "12+35=47", "3+4=7"]
    prepared = prepare({"a": docs_a, "b": docs_b}, {"heldout": [eval_doc], "arith": ["12+35=47", "1+1=2"]})
    counts = [(s.name, s.before, s.after) for s in prepared.steps]
    assert counts == [("exact_dedup", 9, 8), ("near_dedup", 8, 7), ("decontamination", 7, 5)]
    assert prepared.documents == {"a": [essay(10), essay(11), essay(12)], "b": [essay(15), "3+4=7"]}
    assert "a 4->3; b 5->5" in prepared.steps[0].detail
    assert "[heldout, arith]" in prepared.steps[2].detail and "b 4->2" in prepared.steps[2].detail


def test_digests_name_the_exact_input_and_output():
    first = prepare({"a": ["x y z", "x y z"]}, {})
    again = prepare({"a": ["x y z", "x y z"]}, {})
    assert first.input_digest == again.input_digest and first.output_digest == again.output_digest
    assert first.input_digest != first.output_digest  # a duplicate was removed
    assert first.input_digest.startswith("sha256:") and len(first.input_digest) == 7 + 64
    assert digest(["ab", "c"]) != digest(["a", "bc"])  # document boundaries count


def test_steps_can_be_switched_off():
    prepared = prepare({"a": ["same", "same"]}, {}, exact=False, near=False)
    assert [s.name for s in prepared.steps] == ["decontamination"]
    assert prepared.documents == {"a": ["same", "same"]}
