"""Token files: JSONL / Parquet / text in, sharded memory-mapped tokens out; batches that are
`data.BatchIterator`'s, resumable at the exact position and split across ranks."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from contracts.manifest import DataFormat
from training.data.corpora import BatchIterator, eval_batches, split_documents, split_held_out
from training.data.token_files import (
    INDEX_FILE,
    CorpusBatchIterator,
    TokenCorpus,
    corpus_eval_batches,
    iter_column_documents,
    iter_source_documents,
    iter_text_documents,
    read_index,
    token_dtype,
    write_token_files,
)
from training.data.tokenizer import ByteTokenizer, HfTokenizer, byte_tokenizer_files
from training.engine.distributed import batch_rows

DOCS = [f"document {i}: " + "word " * (i % 17) + "é🙂" * (i % 3) for i in range(300)]


def _byte_stream(docs: list[str]) -> list[int]:
    return [t for d in docs for t in [*d.encode("utf-8"), 10]]


def _write_jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def _write_parquet(path: Path, docs: list[str], row_group: int = 64) -> Path:
    pq.write_table(pa.table({"text": docs, "n": list(range(len(docs)))}), path, row_group_size=row_group)
    return path


def test_jsonl_and_parquet_tokenize_to_the_same_shards(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    jsonl = _write_jsonl(tmp_path / "d.jsonl", DOCS)
    parquet = _write_parquet(tmp_path / "d.parquet", DOCS)
    a = write_token_files(
        tmp_path / "a",
        iter_column_documents(jsonl, DataFormat.jsonl, batch_rows=50),
        tok,
        sources={"d": "sha256:aa"},
        shard_tokens=1000,
        batch_documents=7,
    )
    b = write_token_files(
        tmp_path / "b",
        iter_source_documents(f"file:{parquet}", DataFormat.parquet),
        tok,
        sources={"d": "sha256:aa"},
        shard_tokens=1000,
    )
    expected = _byte_stream(DOCS)
    assert a.tokens == b.tokens == len(expected) and a.documents == len(DOCS)
    assert len(a.shards) == -(-len(expected) // 1000) > 3
    assert all(n == 1000 for _, n in a.shards[:-1])
    assert a.dtype == "uint16" and (tmp_path / "a" / "shard_00000.bin").stat().st_size == 2000
    corpus = TokenCorpus(tmp_path / "a")
    assert len(corpus) == len(expected)
    assert corpus.read(0, len(corpus)).tolist() == expected  # across every shard boundary
    assert corpus.read(995, 10).tolist() == expected[995:1005]
    assert TokenCorpus(tmp_path / "b").read(0, len(expected)).tolist() == expected
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_text_files_stream_blank_line_documents(tmp_path: Path) -> None:
    seps = ["\n\n", "\n \n", "\n\t \n\n  ", "\n\n\n"]
    text = "  \n" + "".join(d + seps[i % 4] for i, d in enumerate(DOCS)) + "tail\nline  \n \n"
    path = tmp_path / "t.txt"
    path.write_text(text, encoding="utf-8")
    whole = split_documents(f"file:{path}", text)
    assert len(whole) == len(DOCS) + 1
    for chunk in (1, 3, 7, 64, 1 << 20):  # chunks split documents, separators and characters
        assert list(iter_text_documents(path, chunk_bytes=chunk)) == whole
    path.write_bytes(b"ok\n\n\xff\xfe")
    with pytest.raises(ValueError, match="UTF-8"):
        list(iter_text_documents(path))


def test_batches_equal_batch_iterators_and_resume_at_the_exact_position(tmp_path: Path) -> None:
    write_token_files(tmp_path / "c", DOCS, ByteTokenizer(), sources={"d": "x"}, shard_tokens=777)
    corpus = TokenCorpus(tmp_path / "c")
    tokens = torch.tensor(_byte_stream(DOCS), dtype=torch.uint8)
    ours = CorpusBatchIterator(corpus, seq_len=32, batch_size=6, seed=3)
    theirs = BatchIterator(tokens, seq_len=32, batch_size=6, seed=3)
    uninterrupted = [next(ours) for _ in range(10)]
    for (x, y), (tx, ty) in zip(uninterrupted, (next(theirs) for _ in range(10)), strict=True):
        assert torch.equal(x, tx) and torch.equal(y, ty) and x.dtype == torch.int64
    first = CorpusBatchIterator(corpus, seq_len=32, batch_size=6, seed=3)
    for _ in range(4):
        next(first)
    resumed = CorpusBatchIterator(
        TokenCorpus(tmp_path / "c"), seq_len=32, batch_size=6, seed=3, position=first.position
    )
    for (x, y), (ux, uy) in zip((next(resumed) for _ in range(6)), uninterrupted[4:], strict=True):
        assert torch.equal(x, ux) and torch.equal(y, uy)
    other_seed = CorpusBatchIterator(corpus, seq_len=32, batch_size=6, seed=4)
    assert not torch.equal(next(other_seed)[0], uninterrupted[0][0])


def test_two_ranks_rows_partition_the_global_batch(tmp_path: Path) -> None:
    write_token_files(tmp_path / "c", DOCS, ByteTokenizer(), sources={"d": "x"}, shard_tokens=500)
    corpus = TokenCorpus(tmp_path / "c")
    whole = CorpusBatchIterator(corpus, seq_len=16, batch_size=8, seed=1, position=5)
    ranks = [
        CorpusBatchIterator(corpus, seq_len=16, batch_size=8, seed=1, position=5, rows=batch_rows(8, r, 2))
        for r in range(2)
    ]
    for _ in range(3):
        x, y = next(whole)
        parts = [next(it) for it in ranks]
        assert [p[0].shape[0] for p in parts] == [4, 4]
        assert torch.equal(torch.cat([p[0] for p in parts]), x)
        assert torch.equal(torch.cat([p[1] for p in parts]), y)


def test_held_out_split_and_eval_batches_match_the_tensor_ones(tmp_path: Path) -> None:
    write_token_files(tmp_path / "c", DOCS, ByteTokenizer(), sources={"d": "x"}, shard_tokens=900)
    corpus = TokenCorpus(tmp_path / "c")
    tokens = torch.tensor(_byte_stream(DOCS), dtype=torch.uint8)
    train, held = corpus.split_held_out(0.1)
    t_train, t_held = split_held_out(tokens, 0.1)
    assert (len(train), len(held)) == (len(t_train), len(t_held))
    ours = list(corpus_eval_batches(held, seq_len=20, batch_size=4, max_batches=3))
    theirs = list(eval_batches(t_held, seq_len=20, batch_size=4, max_batches=3))
    assert len(ours) == len(theirs) == 3
    for (x, y), (tx, ty) in zip(ours, theirs, strict=True):
        assert torch.equal(x, tx) and torch.equal(y, ty)
    a = CorpusBatchIterator(train, seq_len=20, batch_size=3, seed=0)
    b = BatchIterator(t_train, seq_len=20, batch_size=3, seed=0)
    assert torch.equal(next(a)[0], next(b)[0])


def test_finished_dirs_are_reused_and_half_written_ones_are_not(tmp_path: Path) -> None:
    tok = ByteTokenizer()
    out = tmp_path / "tokens"
    first = write_token_files(out, DOCS, tok, sources={"d": "sha256:1"}, shard_tokens=1000)
    marker = out / "shard_00000.bin"
    stamp = marker.stat().st_mtime_ns

    def exploding():  # a reused directory never reads its documents
        raise AssertionError("documents were read again")
        yield ""

    assert write_token_files(out, exploding(), tok, sources={"d": "sha256:1"}, shard_tokens=1000) == first
    assert marker.stat().st_mtime_ns == stamp
    # other sources: rebuilt
    second = write_token_files(out, DOCS[:10], tok, sources={"d": "sha256:2"}, shard_tokens=1000)
    assert second.documents == 10 and read_index(out) == second
    # half written: shards there, index missing (or a shard cut short): not a corpus, rebuilt
    (out / INDEX_FILE).unlink()
    assert read_index(out) is None
    with pytest.raises(ValueError, match="not a complete token directory"):
        TokenCorpus(out)
    third = write_token_files(out, DOCS, tok, sources={"d": "sha256:2"}, shard_tokens=1000)
    assert third.documents == len(DOCS) and TokenCorpus(out).read(0, 5).tolist() == list(b"docum")
    with (out / "shard_00001.bin").open("r+b") as f:
        f.truncate(10)
    assert read_index(out) is None

    # a failed write leaves no temporary directory and no index behind
    def failing():
        yield "one"
        raise RuntimeError("source broke")

    with pytest.raises(RuntimeError):
        write_token_files(tmp_path / "failed", failing(), tok, sources={"d": "x"})
    assert not (tmp_path / "failed").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokens"]


def test_hf_tokenizer_documents_get_bos_and_eos(tmp_path: Path) -> None:
    d = tmp_path / "tok"
    d.mkdir()
    for name, raw in byte_tokenizer_files().items():
        (d / name).write_bytes(raw)
    tok = HfTokenizer.from_dir(d)
    index = write_token_files(tmp_path / "c", ["ab", "c"], tok, sources={"d": "x"})
    assert index.tokenizer == tok.id and tok.id.startswith("sha256:")
    assert TokenCorpus(tmp_path / "c").read(0, index.tokens).tolist() == [97, 98, 10, 99, 10]


def test_bpe_documents_are_batch_encoded_with_bos_and_eos(tmp_path: Path) -> None:
    from tests.training.tokenizer_fixtures import CHATML, train_bpe

    tok = HfTokenizer.from_dir(train_bpe(tmp_path / "bpe", template=CHATML, bos=True))
    assert tok.bos_id is not None
    docs = DOCS[:40]
    index = write_token_files(
        tmp_path / "c", docs, tok, sources={"d": "x"}, shard_tokens=100, batch_documents=16
    )
    expected = [t for d in docs for t in [tok.bos_id, *tok.encode(d), tok.eos_id]]
    assert index.tokens == len(expected) and index.bos_id == tok.bos_id and index.dtype == "uint16"
    assert TokenCorpus(tmp_path / "c").read(0, len(expected)).tolist() == expected
