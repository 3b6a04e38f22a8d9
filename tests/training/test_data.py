"""Data: tokenizer, sources, resumable batches, held-out split."""

import pytest
import torch

from training.data.corpora import (
    BatchIterator,
    ByteTokenizer,
    eval_batches,
    load_text,
    load_tokens,
    split_held_out,
)


def test_byte_tokenizer_round_trips_unicode():
    tok = ByteTokenizer()
    text = "naïve café — 東京 🙂\n"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.decode(tok.encode_tensor(text)) == text
    assert tok.decode([0xFF, 0x41]) == "\ufffdA"  # invalid UTF-8 is shown, not raised


def test_pydoc_topics_ships_with_python():
    text = load_text("builtin:pydoc_topics")
    assert len(text) > 100_000 and "for" in text


def test_arithmetic_lines_are_correct_and_seeded():
    text = load_text("generated:arithmetic", seed=3)
    assert text == load_text("generated:arithmetic", seed=3)
    assert text != load_text("generated:arithmetic", seed=4)
    lines = text.splitlines()
    assert len(lines) > 1000
    for line in lines[:200]:
        left, right = line.split("=")
        assert eval(left) == int(right)


def test_reverse_lines_are_reversals():
    for line in load_text("generated:reverse", seed=1).splitlines()[:200]:
        word, reversed_word = line.split(">")
        assert reversed_word == word[::-1]


def test_file_source_reads_utf8(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("héllo\n", encoding="utf-8")
    assert load_text(f"file:{path}") == "héllo\n"


def test_file_source_refusals(tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("x" * 101)
    with pytest.raises(ValueError, match="larger than the 100 byte cap"):
        load_text(f"file:{big}", file_cap_bytes=100)
    with pytest.raises(ValueError, match="absolute path"):
        load_text("file:relative.txt")
    with pytest.raises(ValueError, match="cannot be read"):
        load_text(f"file:{tmp_path / 'missing.txt'}")
    binary = tmp_path / "bin.txt"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not valid UTF-8"):
        load_text(f"file:{binary}")


@pytest.mark.parametrize("source", ["builtin:nope", "s3://bucket/x", "file:", "generated:"])
def test_unknown_source_is_refused_in_a_sentence(source):
    with pytest.raises(ValueError, match="Unknown data source"):
        load_text(source)


def test_load_tokens_concatenates_sources_as_bytes():
    tokens = load_tokens(["generated:arithmetic", "generated:reverse"], seed=0)
    assert tokens.dtype == torch.uint8
    text = ByteTokenizer().decode(tokens)
    assert "+" in text and ">" in text


def test_batches_are_shifted_windows():
    tokens = torch.arange(200, dtype=torch.uint8)
    x, y = next(BatchIterator(tokens, seq_len=16, batch_size=4, seed=0))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert torch.equal(y - x, torch.ones_like(x))


def test_restored_position_gives_the_same_next_batch():
    tokens = load_tokens(["generated:arithmetic"], seed=0)
    first = BatchIterator(tokens, seq_len=32, batch_size=8, seed=7)
    for _ in range(5):
        next(first)
    assert first.position == 5
    resumed = BatchIterator(tokens, seq_len=32, batch_size=8, seed=7, position=first.position)
    for _ in range(3):
        a, b = next(first), next(resumed)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    other_seed = BatchIterator(tokens, seq_len=32, batch_size=8, seed=8, position=5)
    assert not torch.equal(other_seed.batch_at(5)[0], first.batch_at(5)[0])
    assert not torch.equal(first.batch_at(5)[0], first.batch_at(6)[0])


def test_too_little_data_is_refused():
    with pytest.raises(ValueError, match="fewer than one window"):
        BatchIterator(torch.zeros(10, dtype=torch.uint8), seq_len=16, batch_size=2, seed=0)


def test_held_out_split_is_the_contiguous_tail():
    tokens = torch.arange(100)
    train, held = split_held_out(tokens, 0.1)
    assert torch.equal(train, tokens[:90]) and torch.equal(held, tokens[90:])
    with pytest.raises(ValueError):
        split_held_out(tokens, 1.0)


def test_eval_batches_are_fixed_non_overlapping_windows():
    tokens = torch.arange(0, 1000) % 256
    batches = list(eval_batches(tokens, seq_len=10, batch_size=4, max_batches=3))
    assert len(batches) == 3 and all(x.shape == (4, 10) for x, _ in batches)
    assert batches[1][0][0, 0].item() == 40  # 5th window starts at token 40
    again = list(eval_batches(tokens, seq_len=10, batch_size=4, max_batches=3))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, again, strict=True))
    tail = list(eval_batches(tokens[:25], seq_len=10, batch_size=4, max_batches=3))
    assert [x.shape[0] for x, _ in tail] == [2]
