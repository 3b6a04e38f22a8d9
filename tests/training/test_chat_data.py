"""Post-training rows: SFT labels only on assistant tokens, DPO batches in TRL's layout (and the
byte demo's), RLVR verifiers as tables."""

import json
from fractions import Fraction
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from contracts.manifest import DataFormat
from tests.training.tokenizer_fixtures import CHATML, CONVERSATIONS, train_bpe
from training.data.chat import (
    IGNORE,
    PreferencePair,
    collate_preference,
    collate_sft,
    last_number,
    messages_rows,
    preference_pair,
    preference_rows,
    rlvr_prompts,
    sft_example,
    sft_examples,
    shifted,
    verifiable_rows,
    verify,
)
from training.data.tokenizer import ByteTokenizer, HfTokenizer
from training.recipes.posttrain import response_batch


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> HfTokenizer:
    return HfTokenizer.from_dir(train_bpe(tmp_path_factory.mktemp("bpe"), template=CHATML))


def test_sft_labels_are_only_the_assistant_tokens(chatml: HfTokenizer) -> None:
    for conversation in CONVERSATIONS:
        example = sft_example(chatml, conversation, seq_len=4096)
        ids, mask = chatml.chat(conversation)
        assert example.input_ids == ids
        assert [label != IGNORE for label in example.labels] == [bool(m) for m in mask]
        trained = chatml.decode([t for t in example.labels if t != IGNORE])
        assert trained == "".join(
            m["content"] + "<|im_end|>" for m in conversation if m["role"] == "assistant"
        )
        assert "user" not in trained and "system" not in trained
    cut = sft_example(chatml, CONVERSATIONS[1], seq_len=9)
    assert len(cut.input_ids) == len(cut.labels) == 10
    # a conversation whose assistant turn falls past the cut trains nothing and is left out
    assert cut.trained_tokens == 0
    assert list(sft_examples(chatml, [CONVERSATIONS[1]], seq_len=9)) == []
    assert len(list(sft_examples(chatml, CONVERSATIONS, seq_len=4096))) == len(CONVERSATIONS)


def test_sft_batch_is_right_padded_with_masks(chatml: HfTokenizer) -> None:
    examples = [sft_example(chatml, c, seq_len=4096) for c in CONVERSATIONS[:2]]
    batch = collate_sft(examples, chatml.pad_id)
    short, long_ = sorted(range(2), key=lambda i: len(examples[i].input_ids))
    n = len(examples[short].input_ids)
    width = len(examples[long_].input_ids)
    assert batch.input_ids.shape == batch.labels.shape == batch.attention_mask.shape == (2, width)
    assert batch.input_ids[short, n:].eq(chatml.pad_id).all()
    assert batch.labels[short, n:].eq(IGNORE).all()
    assert batch.attention_mask[short].tolist() == [1] * n + [0] * (width - n)
    assert batch.attention_mask[long_].eq(1).all()
    inputs, targets, mask = shifted(batch)
    assert inputs.shape == targets.shape == mask.shape == (2, width - 1)
    assert torch.equal(targets[mask.bool()], batch.labels[:, 1:][batch.labels[:, 1:] != IGNORE])
    assert mask.sum() == sum(e.trained_tokens for e in examples) - sum(
        e.labels[0] != IGNORE for e in examples
    )


def test_dpo_batch_has_trls_layout() -> None:
    # the example in TRL's DataCollatorForPreference docstring
    pairs = [PreferencePair([1, 2, 3], [4, 5], [6]), PreferencePair([7, 8], [9], [10, 11])]
    batch = collate_preference(pairs, pad_id=0)
    assert batch.input_ids.tolist() == [[1, 2, 3, 4, 5], [7, 8, 9, 0, 0], [1, 2, 3, 6, 0], [7, 8, 10, 11, 0]]
    assert batch.attention_mask.tolist() == [
        [1, 1, 1, 1, 1],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0],
    ]
    assert batch.completion_mask.tolist() == [
        [0, 0, 0, 1, 1],
        [0, 0, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 1, 1, 0],
    ]
    kept = collate_preference(pairs, pad_id=0, max_length=3, truncation_mode="keep_end")
    assert kept.input_ids.tolist() == [[3, 4, 5], [7, 8, 9], [2, 3, 6], [8, 10, 11]]
    with pytest.raises(ValueError, match="keep_start"):
        collate_preference(pairs, pad_id=0, max_length=3, truncation_mode="middle")


def test_byte_dpo_batch_is_the_demos_response_batch() -> None:
    tok = ByteTokenizer()
    problems = [("12+35=", "47", "48"), ("3-9=", "-6", "-5"), ("abc>", "cba", "cab")]
    pairs = [preference_pair(tok, p, c, r) for p, c, r in problems]
    ours = shifted(collate_preference(pairs, tok.pad_id))
    theirs = response_batch(
        [p for p, _, _ in problems] * 2, [c for _, c, _ in problems] + [r for *_, r in problems]
    )
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b.to(a.dtype))


def test_dpo_prompt_is_a_user_turn_under_a_chat_template(chatml: HfTokenizer) -> None:
    pair = preference_pair(chatml, "What is 2+2?", "4", "5")
    assert (
        chatml.decode(pair.prompt_ids) == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert pair.chosen_ids[-1] == pair.rejected_ids[-1] == chatml.eos_id
    assert chatml.decode(pair.chosen_ids) == "4<|im_end|>"


def test_rows_stream_from_jsonl_and_parquet(tmp_path: Path) -> None:
    chats = tmp_path / "chat.jsonl"
    chats.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    assert list(messages_rows(chats, DataFormat.jsonl)) == CONVERSATIONS
    prefs = tmp_path / "prefs.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b"], "chosen": ["x", "y"], "rejected": ["z", "w"]}), prefs)
    assert list(preference_rows(prefs, DataFormat.parquet)) == [("a", "x", "z"), ("b", "y", "w")]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "2+2=", "answer": "4"}\n{"prompt": "1+1=", "answer": null}\n')
    rows = verifiable_rows(tasks, DataFormat.jsonl)
    assert next(rows) == ("2+2=", "4")
    # issue 39: the second line was reported as "row 1"; rows are counted from 1, as lines are
    with pytest.raises(ValueError, match=r"tasks\.jsonl row 2: answer must be a string"):
        next(rows)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user"}]}\n')
    with pytest.raises(ValueError, match=r"messages\[0\] needs string role and content"):
        list(messages_rows(bad, DataFormat.jsonl))
    prompts = rlvr_prompts(ByteTokenizer(), [("2+2=", "4")], "number")
    assert prompts[0].prompt_ids == list(b"2+2=") and prompts[0].verifier == "number"
    with pytest.raises(ValueError, match="unknown"):
        rlvr_prompts(ByteTokenizer(), [], "fuzzy")


@pytest.mark.parametrize(
    ("verifier", "response", "answer", "expected"),
    [
        ("exact", "47", "47", True),
        ("exact", "  47\n", "47", True),
        ("exact", "47", " 47 ", True),
        ("exact", "47.0", "47", False),
        ("exact", "the answer is 47", "47", False),
        ("exact", "Paris", "paris", False),
        ("exact", "", "", True),
        ("number", "the answer is 47", "47", True),
        ("number", "3 apples and then 5", "5", True),
        ("number", "5 then 3", "5", False),
        ("number", "12-5=7", "7", True),
        ("number", "it is -6", "-6", True),
        ("number", "it is 6", "-6", False),
        ("number", "1,000 people", "1000", True),
        ("number", "3.0", "3", True),
        ("number", "0.5", ".5", True),
        ("number", "3.5", "3", False),
        ("number", "no number here", "3", False),
        ("number", "42", "#### 42", True),
        ("number", "42", "no number", False),
        ("number", "42.", "42", True),
    ],
)
def test_verifiers(verifier: str, response: str, answer: str, expected: bool) -> None:
    assert verify(verifier, response, answer) is expected


def test_last_number_table() -> None:
    cases = {
        "a 1 b 2": Fraction(2),
        "x": None,
        "-1,234.5": Fraction(-12345, 10),
        "+3": Fraction(3),
        "1.25e": Fraction(5, 4),
    }
    assert {text: last_number(text) for text in cases} == cases
    with pytest.raises(ValueError, match="unknown"):
        verify("fuzzy", "a", "a")
