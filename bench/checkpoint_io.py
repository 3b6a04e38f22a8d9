"""Checkpoint benchmarks: how long the training loop stalls for an asynchronous DCP save
(`training.engine.checkpoint.Checkpointer`) against a synchronous `torch.save` of the same state,
and the checkpoint's write bandwidth against a raw file write of the same number of bytes.

The state is a model of a named shape with its AdamW state materialised by one optimizer step.
The saves follow the training loop's pattern, on one Checkpointer (one stager) as in a stage: save,
the next step's forward and backward (the window the background copy of the state overlaps with),
`wait_staged`, the optimizer step. The stall of a save is the `stall_s` its commit records (what
`ecc ito checkpoints` shows): the call plus the wait for its copy before the step; its parts are
reported too (`save_call_s`, `staging_wait_s`), beside the forward and backward they overlapped
(`step_compute_s`). Each save's write is waited for before the next save, off the loop's clock, as
a checkpoint interval of many steps would allow. The first save of a Checkpointer allocates the
staging buffers and starts DCP's writer: its stall is reported separately (`first_stall_s`), the
others as their median (`async_stall_s`, the ratio's numerator).

The bandwidth is the checkpoint's bytes over the time from the save call until the data is durable
(DCP fsyncs its files). The raw write is one file of the same size written in large chunks, then
fsync'd. The sync baseline is reported both as `torch.save` alone (the ratio's denominator: what a
plain loop pays) and with an fsync after it (durable, like the checkpoint).

`python -m bench.checkpoint_io --shape 150M` measures one shape on its own and prints the figures.
"""

import argparse
import json
import os
import pathlib
import shutil
import tempfile
import time
from dataclasses import dataclass

import torch

from bench import stats
from contracts.models import MODEL_SHAPES
from training.model import Transformer, count_parameters

RAW_CHUNK_BYTES = 16 * 1024 * 1024  # large sequential writes: the disk's best case
# Tokens in the forward and backward between a save and the next optimizer step (batch 1): small,
# so 150M stays quick on 2 CPU cores, where it still takes ~0.8 s; a GPU step at 150M is longer.
STEP_TOKENS = 128


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizes:
    shapes: tuple[str, ...]
    """Model shapes to checkpoint (names in contracts.models.MODEL_SHAPES)."""
    repeats: int
    """Saves after the first one (whose stall is reported on its own), and sync saves to compare."""
    step_tokens: int = STEP_TOKENS
    """Tokens of the forward and backward the background copy overlaps with."""


def _state(shape_name: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Transformer(MODEL_SHAPES[shape_name])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 256, (1, 16))
    model(x, x)[1].backward()  # one step, so the optimizer holds its exp_avg / exp_avg_sq state
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _fsync_path(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_write(path: pathlib.Path, n_bytes: int) -> float:
    """Seconds to write `n_bytes` to a new file and fsync it."""
    chunk = memoryview(bytearray(min(RAW_CHUNK_BYTES, max(1, n_bytes))))
    started = time.perf_counter()
    with open(path, "wb") as f:
        left = n_bytes
        while left > 0:
            left -= f.write(chunk[: min(left, len(chunk))])
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - started


def _loop_save(checkpointer, step: int, model, optimizer, tokens: torch.Tensor) -> dict[str, float]:
    """One save in the loop's pattern: save, forward and backward, wait_staged, optimizer step.
    Then the write is waited for and committed (what the loop's next steps would overlap)."""
    from training.engine.checkpoint_dir import CheckpointInfo

    started = time.perf_counter()
    checkpointer.save(step, model, optimizer, data_position=step)
    called = time.perf_counter()
    if tokens.numel():  # none: no window to overlap with, the copy is waited for at once
        model(tokens, tokens)[1].backward()
    computed = time.perf_counter()
    waited = checkpointer.wait_staged()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    outcomes = checkpointer.wait()
    info = outcomes[-1]
    if not isinstance(info, CheckpointInfo):
        raise RuntimeError(f"the async checkpoint failed: {info}")
    return {
        "stall_s": info.stall_s,
        "call_s": called - started,
        "staging_wait_s": waited,
        "compute_s": computed - called,
        "save_s": info.save_s,
        "bytes": info.bytes,
    }


def measure(shape_name: str, repeats: int, step_tokens: int = STEP_TOKENS) -> dict:
    from training.engine.checkpoint import Checkpointer

    model, optimizer = _state(shape_name)
    shape = MODEL_SHAPES[shape_name]
    tokens = torch.randint(0, shape.vocab_size, (1, min(step_tokens, shape.max_seq_len)))
    root = pathlib.Path(tempfile.mkdtemp(prefix="ito-bench-ckpt-"))
    try:
        checkpointer = Checkpointer(root / "async", keep_last=1, overlap_staging=True)
        try:
            first, *saves = [
                _loop_save(checkpointer, step, model, optimizer, tokens) for step in range(1, repeats + 2)
            ]
        finally:
            checkpointer.close()
        n_bytes = int(first["bytes"])
        sync_s, sync_durable_s, raw_bandwidths = [], [], []
        for i in range(repeats):
            target = root / f"sync-{i}.pt"
            started = time.perf_counter()
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, target)
            saved = time.perf_counter()
            _fsync_path(target)
            sync_s.append(saved - started)
            sync_durable_s.append(time.perf_counter() - started)
            sync_bytes = target.stat().st_size
            target.unlink()

            raw = root / f"raw-{i}.bin"
            raw_bandwidths.append(n_bytes / _raw_write(raw, n_bytes))
            raw.unlink()

        def p50(key: str) -> float:
            return stats.median([save[key] for save in saves])

        stall, sync, sync_durable = p50("stall_s"), stats.median(sync_s), stats.median(sync_durable_s)
        bandwidth = stats.median([save["bytes"] / save["save_s"] for save in saves])
        raw_bandwidth = stats.median(raw_bandwidths)
        return {
            "shape": shape_name,
            "parameters": count_parameters(shape),
            "checkpoint_bytes": n_bytes,
            "torch_save_bytes": sync_bytes,
            "async_stall_s": round(stall, 4),
            "async_stalls_s": [round(save["stall_s"], 4) for save in saves],
            "first_stall_s": round(first["stall_s"], 4),
            "save_call_s": round(p50("call_s"), 4),
            "staging_wait_s": round(p50("staging_wait_s"), 4),
            "step_compute_s": round(p50("compute_s"), 4),
            "step_tokens": int(tokens.numel()),
            "async_save_to_durable_s": round(p50("save_s"), 4),
            "sync_torch_save_s": round(sync, 4),
            "sync_torch_save_fsync_s": round(sync_durable, 4),
            "stall_ratio": round(stall / sync, 3),
            "first_stall_ratio": round(first["stall_s"] / sync, 3),
            "stall_ratio_vs_durable_sync": round(stall / sync_durable, 3),
            "checkpoint_write_mb_s": round(bandwidth / 1e6, 1),
            "raw_write_mb_s": round(raw_bandwidth / 1e6, 1),
            "bandwidth_ratio": round(bandwidth / raw_bandwidth, 3),
            "repeats": repeats,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_all(sizes: Sizes) -> dict[str, dict]:
    return {f"checkpoint_{shape}": measure(shape, sizes.repeats, sizes.step_tokens) for shape in sizes.shapes}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.checkpoint_io", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--shape", default="tiny", choices=sorted(MODEL_SHAPES), help="model shape (default tiny)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="saves after the first (default 3)")
    parser.add_argument(
        "--step-tokens",
        type=int,
        default=STEP_TOKENS,
        help=f"tokens of the step the copy overlaps with (default {STEP_TOKENS}; 0: no overlap)",
    )
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.shape, args.repeats, args.step_tokens), indent=2))


if __name__ == "__main__":
    main()
