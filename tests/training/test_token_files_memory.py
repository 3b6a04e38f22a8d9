"""A pretraining-style run over a tokenized Parquet corpus larger than the process's memory limit:
it tokenizes, trains a few steps, stops, and resumes at the exact position, all under the limit.

The limit is RLIMIT_DATA, set in a subprocess after torch, numpy and pyarrow are imported: the
process's data size then (VmData) plus HEADROOM. RLIMIT_DATA (Linux >= 4.7) counts the heap and
every private writable mapping, which is where numpy, torch and pyarrow allocate; it does not
count read-only shared file mappings, which is what `TokenCorpus`'s `numpy.memmap(mode="r")` is:
those pages belong to the page cache, which the kernel reclaims. RLIMIT_AS would count the
mappings too (and torch alone reserves ~800 MB of address space), so it cannot tell a memory map
from a load.

Reading the corpus whole needs an anonymous buffer as large as the corpus, more than the limit
allows: the same subprocess proves it by calling `numpy.fromfile` on the shards, which fails with
MemoryError, while the memory-mapped run succeeds, and even reads every token once through the maps
(its resident size then exceeds the limit: file pages, not counted).

Measured here (2 busy cores): limit ~520 MB (VmData ~265 MB after the imports + 256 MB), corpus
~630 MB of uint16 tokens in 4 shards, tokenized under the limit in ~4 s; VmData peaks ~420 MB,
resident ~1 GB after the full read; the test takes ~20-30 s.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

HEADROOM = (
    256 << 20
)  # private memory beyond the imports: the run peaks ~150 MB over them (thread stacks, malloc)
ROW_CHARS = 4096
ROWS_PER_GROUP = 512  # 2 MiB of text per Parquet row group: the reader holds one group at a time

CHILD = textwrap.dedent(
    """
    import json, re, resource, sys, time
    from pathlib import Path
    import numpy as np
    import pyarrow.parquet
    import torch
    from contracts.manifest import DataFormat
    from training.data.token_files import (
        CorpusBatchIterator, TokenCorpus, iter_column_documents, write_token_files,
    )
    from training.data.tokenizer import ByteTokenizer
    # the trainer's stage and everything it imports, before the limit: the limit is what the run
    # itself allocates beyond its code (the imports of a later feature must not eat the headroom)
    from contracts.models import MODEL_SHAPES
    from training.recipes.pretrain import StageConfig, train_stage
    from training.engine.reporting import Reporter

    parquet, out, headroom = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])

    def vm_data():
        return int(re.search(r"VmData:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024

    limit = vm_data() + headroom
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    result = {"limit": limit}
    started = time.perf_counter()
    index = write_token_files(
        out, iter_column_documents(parquet, DataFormat.parquet, batch_rows=256), ByteTokenizer(),
        sources={"corpus": "test"}, shard_tokens=96 << 20,
    )
    result["tokenize_s"] = time.perf_counter() - started
    result["corpus_bytes"] = index.tokens * np.dtype(index.dtype).itemsize
    result["shards"] = len(index.shards)

    def run(position, steps):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Embedding(256, 32), torch.nn.Linear(32, 256))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        it = CorpusBatchIterator(TokenCorpus(out), seq_len=256, batch_size=16, seed=7, position=position)
        seen = []
        for _ in range(steps):
            x, y = next(it)
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            seen.append(x)
        return it.position, seen

    whole_pos, whole = run(0, 12)
    stopped_at, first = run(0, 5)
    resumed_pos, rest = run(stopped_at, 7)
    result["stopped_at"] = stopped_at
    result["resumed_to"] = resumed_pos
    result["resume_exact"] = all(torch.equal(a, b) for a, b in zip(first + rest, whole, strict=True))
    result["batches_differ"] = not torch.equal(whole[0], whole[1])

    # The trainer's own stage on the same token files (a `tokens:` source, memory-mapped): stopped
    # after 5 steps (a checkpoint of step 5 committed), then resumed to the end, it ends on the
    # loss an uninterrupted stage ends on.
    def stage(directory, stop_after=None):
        calls = []
        def should_stop():
            calls.append(1)
            return stop_after is not None and len(calls) > stop_after
        cfg = StageConfig(
            stage="pretrain", shape=MODEL_SHAPES["tiny"], train_sources=[f"tokens:{out}"], seq_len=64,
            batch_size=8, learning_rate=3e-3, steps=12, checkpoint_dir=str(directory),
            checkpoint_interval=100, device="cpu",
        )
        return train_stage(cfg, Reporter(lambda event: None), should_stop)

    straight = stage(out.parent / "straight")
    stopped = stage(out.parent / "resumed", stop_after=5)
    resumed = stage(out.parent / "resumed")
    result["stage_stopped_at"] = stopped.final_step
    result["stage_resumed_to"] = resumed.final_step
    result["stage_same_loss"] = resumed.final_loss == straight.final_loss
    # every token once through the maps: all the corpus's pages mapped and read, none of it counted
    corpus = TokenCorpus(out)
    chunk = 4 << 20
    result["token_sum"] = sum(int(corpus.read(s, min(chunk, len(corpus) - s)).sum()) for s in range(0, len(corpus), chunk))
    result["rss_after"] = int(re.search(r"VmRSS:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024
    result["vm_data_after"] = vm_data()
    try:
        loaded = [np.fromfile(out / name, dtype=index.dtype) for name, _ in index.shards]
        result["fromfile"] = "loaded %d tokens" % sum(len(a) for a in loaded)
    except MemoryError as exc:
        result["fromfile"] = "MemoryError: %s" % exc
    print(json.dumps(result))
    """
)


def _vm_data_after_imports() -> int:
    env = {**os.environ, "ARROW_DEFAULT_MEMORY_POOL": "system"}
    probe = (
        "import re, pathlib, numpy, pyarrow.parquet, torch; import training.data.token_files; "
        "import training.recipes.pretrain, training.engine.reporting; "
        "print(int(re.search(r'VmData:\\s+(\\d+) kB', pathlib.Path('/proc/self/status').read_text()).group(1)) * 1024)"
    )
    return int(
        subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env
        ).stdout
    )


def _write_corpus(path: Path, min_bytes: int) -> tuple[int, int]:
    """Rows of ROW_CHARS distinct-enough text, written a row group at a time, until min_bytes:
    (tokens, sum of the token ids) of the byte tokenization, eos after each row included."""
    words = [f"w{i:03d}" for i in range(997)]
    rows = [
        (" ".join(words[(r * 7 + k) % 997] for k in range(ROW_CHARS // 5 + 2)))[:ROW_CHARS] for r in range(64)
    ]
    group = pa.table({"text": [rows[i % 64] for i in range(ROWS_PER_GROUP)]})
    group_sum = sum(sum(rows[i % 64].encode()) + 10 for i in range(ROWS_PER_GROUP))
    written = groups = 0
    with pq.ParquetWriter(path, group.schema) as writer:
        while written < min_bytes:
            writer.write_table(group, row_group_size=ROWS_PER_GROUP)
            written += ROWS_PER_GROUP * (ROW_CHARS + 1)  # + the eos after each document
            groups += 1
    return written, groups * group_sum


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_DATA semantics are Linux's")
def test_corpus_larger_than_the_memory_limit_trains_and_resumes(tmp_path: Path) -> None:
    limit = _vm_data_after_imports() + HEADROOM
    parquet = tmp_path / "corpus.parquet"
    tokens, token_sum = _write_corpus(
        parquet, min_bytes=int(limit * 0.6)
    )  # uint16: 2 bytes a token -> 1.2x the limit
    # pyarrow's default pool (mimalloc) maps ~1 GB of arena at its first allocation, which
    # RLIMIT_DATA counts though it is never touched; the system allocator maps what it uses.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "ARROW_DEFAULT_MEMORY_POOL": "system"}
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(parquet), str(tmp_path / "tokens"), str(HEADROOM)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(result)  # the figures, with -s
    assert result["corpus_bytes"] == 2 * tokens
    assert result["corpus_bytes"] > result["limit"], result
    assert result["shards"] >= 2
    assert result["stopped_at"] == 5 and result["resumed_to"] == 12
    assert result["resume_exact"] and result["batches_differ"]
    assert result["token_sum"] == token_sum
    assert result["rss_after"] > result["limit"]  # the mapped pages are resident, and not counted
    assert result["vm_data_after"] <= result["limit"]
    assert result["fromfile"].startswith("MemoryError"), result
    assert result["stage_stopped_at"] == 5 and result["stage_resumed_to"] == 12, result
    assert result["stage_same_loss"], result
