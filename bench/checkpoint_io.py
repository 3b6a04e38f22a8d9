"""Checkpoint benchmarks: how long the training loop stalls for an asynchronous DCP save
(`services.trainer.checkpoint.Checkpointer`) against a synchronous `torch.save` of the same state,
and the checkpoint's write bandwidth against a raw file write of the same number of bytes.

The state is a model of a named shape with its AdamW state materialised by one optimizer step.
The stall is what `Checkpointer.save` blocks the loop for (the staging copy); the bandwidth is the
checkpoint's bytes over the time from the save call until the data is durable (DCP fsyncs its
files). The raw write is one file of the same size written in large chunks, then fsync'd. The sync
baseline is reported both as `torch.save` alone (the ratio's denominator: what a plain loop pays)
and with an fsync after it (durable, like the checkpoint).

The first async save of a process also starts DCP's writer thread; it is run once as a warm-up and
its stall reported separately (`first_stall_s`).
"""

import os
import pathlib
import shutil
import tempfile
import time
from dataclasses import dataclass

import torch

from bench import stats
from contracts.models import MODEL_SHAPES
from services.trainer.model import Transformer, count_parameters

RAW_CHUNK_BYTES = 16 * 1024 * 1024  # large sequential writes: the disk's best case


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizes:
    shapes: tuple[str, ...]
    """Model shapes to checkpoint (names in contracts.models.MODEL_SHAPES)."""
    repeats: int


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


def _async_save(checkpointer, step: int, model, optimizer):
    """(stall seconds as the loop saw it, the committed CheckpointInfo)."""
    from services.trainer.checkpoint import CheckpointInfo

    started = time.perf_counter()
    checkpointer.save(step, model, optimizer, data_position=step)
    stall = time.perf_counter() - started
    outcomes = checkpointer.wait()
    info = outcomes[-1]
    if not isinstance(info, CheckpointInfo):
        raise RuntimeError(f"the async checkpoint failed: {info}")
    return stall, info


def measure(shape_name: str, repeats: int) -> dict:
    from services.trainer.checkpoint import Checkpointer

    model, optimizer = _state(shape_name)
    root = pathlib.Path(tempfile.mkdtemp(prefix="ito-bench-ckpt-"))
    try:
        checkpointer = Checkpointer(root / "async", keep_last=1)
        first_stall, _ = _async_save(checkpointer, 1, model, optimizer)  # warm-up: starts DCP's writer
        stalls, saves, bandwidths, sync_s, sync_durable_s, raw_bandwidths = [], [], [], [], [], []
        n_bytes = 0
        for i in range(repeats):
            stall, info = _async_save(checkpointer, i + 2, model, optimizer)
            n_bytes = info.bytes
            stalls.append(stall)
            saves.append(info.save_s)
            bandwidths.append(info.bytes / info.save_s)

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
        stall, sync, sync_durable = stats.median(stalls), stats.median(sync_s), stats.median(sync_durable_s)
        bandwidth, raw_bandwidth = stats.median(bandwidths), stats.median(raw_bandwidths)
        return {
            "shape": shape_name,
            "parameters": count_parameters(MODEL_SHAPES[shape_name]),
            "checkpoint_bytes": n_bytes,
            "torch_save_bytes": sync_bytes,
            "async_stall_s": round(stall, 4),
            "first_stall_s": round(first_stall, 4),
            "async_save_to_durable_s": round(stats.median(saves), 4),
            "sync_torch_save_s": round(sync, 4),
            "sync_torch_save_fsync_s": round(sync_durable, 4),
            "stall_ratio": round(stall / sync, 3),
            "stall_ratio_vs_durable_sync": round(stall / sync_durable, 3),
            "checkpoint_write_mb_s": round(bandwidth / 1e6, 1),
            "raw_write_mb_s": round(raw_bandwidth / 1e6, 1),
            "bandwidth_ratio": round(bandwidth / raw_bandwidth, 3),
            "repeats": repeats,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_all(sizes: Sizes) -> dict[str, dict]:
    return {f"checkpoint_{shape}": measure(shape, sizes.repeats) for shape in sizes.shapes}
