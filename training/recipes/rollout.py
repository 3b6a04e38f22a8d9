"""The RLVR rollout worker: a separate process that samples completions from versioned policy
weights, and the trainer-side client that feeds it weights and requests over queues.

One FIFO control queue carries both weight updates and rollout requests, so the version a request
is served with is fixed by the order the trainer sends them in: a run is reproducible from its seed
even though generation overlaps training. Every rollout batch carries the policy version it was
sampled from; the trainer drops those older than its staleness bound.

The process is started with "spawn": forking a process that runs torch threads (and, in the
service, an event loop) can deadlock the child.

Weights travel through a memory-mapped file both processes map (`SharedWeights`, in /dev/shm when
it has room): the trainer copies each new version into one of two slots and queues only (version,
slot); the worker copies the slot into its model when the queue reaches that message, and says so,
and a slot is overwritten only after the version it held was loaded. No serialisation, no bytes
through a pipe, and no file-descriptor passing (which torch's shared-memory tensors need and some
containers forbid). Where no such file can be made, weights fall back to `torch.save` bytes on the
queue. A version is sent once: publishing the version the worker already has sends nothing.
"""

import io
import os
import queue
import tempfile
import time
from dataclasses import dataclass

import msgspec
import torch
import torch.multiprocessing as mp

from contracts.models import ModelShape
from training.recipes.generation import Completion
from training.recipes.rollout_engine import KvCacheEngine, RolloutEngine, Sampling

START_TIMEOUT_S = 120.0  # spawn + import torch takes ~2 s here; a loaded host can take far longer
COLLECT_TIMEOUT_S = 600.0  # one request's rollouts; generous, a dead worker is noticed within POLL_S
POLL_S = 1.0
WEIGHT_SLOTS = 2  # the worker loads version v while the trainer writes v + 1 into the other slot
SHM_DIR = "/dev/shm"  # tmpfs: the file never reaches a disk; a regular temp dir where it lacks room
ALIGN = 64  # bytes: every tensor starts at a multiple, so any dtype can view the buffer there


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutRequest:
    request_id: str
    prompts: list[list[int]]  # one group per prompt
    group_size: int
    max_new_tokens: int
    temperature: float
    seed: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RolloutBatch:
    request_id: str
    version: int  # the policy version the completions were sampled from
    prompts: list[list[int]]
    groups: list[list[Completion]]  # groups[i] has group_size completions of prompts[i]


class RolloutError(RuntimeError):
    """The rollout worker died or reported an error."""


def _state_bytes(state_dict: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in state_dict.items()}, buffer)
    return buffer.getvalue()


Layout = list[tuple[str, str, tuple[int, ...], int]]  # (key, dtype name, shape, byte offset in a slot)


def _layout(state_dict: dict[str, torch.Tensor]) -> tuple[Layout, int]:
    """Where each tensor lies in a slot, and the slot's size in bytes."""
    layout: Layout = []
    offset = 0
    for key, tensor in state_dict.items():
        layout.append((key, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
        offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
    return layout, max(offset, ALIGN)


def _slot_views(buffer: torch.Tensor, layout: Layout, slot_bytes: int, slot: int) -> dict[str, torch.Tensor]:
    """The tensors of one slot, as views of the mapped bytes (no copy)."""
    views = {}
    for key, dtype_name, shape, offset in layout:
        dtype = getattr(torch, dtype_name)
        start = slot * slot_bytes + offset
        count = torch.Size(shape).numel()
        views[key] = buffer[start : start + count * dtype.itemsize].view(dtype).view(shape)
    return views


class SharedWeights:
    """The trainer's side of the weight slots: a file both processes map, WEIGHT_SLOTS copies of
    the state dict. `write` copies a state dict into a slot; the worker maps the file by its path."""

    def __init__(self, state_dict: dict[str, torch.Tensor]):
        self.layout, self.slot_bytes = _layout(state_dict)
        size = self.slot_bytes * WEIGHT_SLOTS
        directory = SHM_DIR if _room(SHM_DIR) > 2 * size else None  # a full tmpfs would SIGBUS on write
        fd, self.path = tempfile.mkstemp(prefix="ito-rollout-weights-", dir=directory)
        try:
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        self.buffer = torch.from_file(self.path, shared=True, size=size, dtype=torch.uint8)
        self.signature = _signature(state_dict)

    def fits(self, state_dict: dict[str, torch.Tensor]) -> bool:
        return _signature(state_dict) == self.signature

    def write(self, slot: int, state_dict: dict[str, torch.Tensor]) -> None:
        views = _slot_views(self.buffer, self.layout, self.slot_bytes, slot)
        for key, tensor in state_dict.items():
            views[key].copy_(tensor.detach())

    def unlink(self) -> None:
        """Remove the file's name; the mappings (trainer's and worker's) live on until closed."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _room(directory: str) -> int:
    try:
        stat = os.statvfs(directory)
    except OSError:
        return 0
    return stat.f_bavail * stat.f_frsize


def _signature(state_dict: dict[str, torch.Tensor]) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    return [(k, v.dtype, tuple(v.shape)) for k, v in state_dict.items()]


def worker_main(
    control: "mp.Queue", results: "mp.Queue", shape: dict, rope_base: float | None, threads: int, device: str
) -> None:
    """The worker process: apply weights, serve requests, in queue order, until a None arrives. It
    samples through the engine port (rollout_engine.py), here the trainer's KV-cache decoder."""
    from training.model import Transformer

    try:
        torch.set_num_threads(max(1, threads))
        engine: RolloutEngine = KvCacheEngine(
            Transformer(msgspec.convert(shape, ModelShape), rope_base=rope_base).to(device)
        )
        shared: tuple[torch.Tensor, Layout, int] | None = None
        results.put(("ready", None))
        while (message := control.get()) is not None:
            match message:
                case ("attach", str(path), list(layout), int(slot_bytes)):
                    size = slot_bytes * WEIGHT_SLOTS
                    shared = (
                        torch.from_file(path, shared=True, size=size, dtype=torch.uint8),
                        layout,
                        slot_bytes,
                    )
                case ("weights_at", int(new_version), int(slot)):
                    assert shared is not None, "weights_at before attach"
                    engine.load_weights(new_version, _slot_views(shared[0], shared[1], shared[2], slot))
                    results.put(("loaded", engine.version))  # the slot may be written again
                case ("weights", int(new_version), bytes(raw)):
                    engine.load_weights(
                        new_version, torch.load(io.BytesIO(raw), weights_only=True, map_location=device)
                    )
                    results.put(("loaded", engine.version))
                case ("request", RolloutRequest() as request):
                    results.put(("batch", serve(engine, request)))
    except Exception as e:  # reported to the trainer, which fails the stage with the message
        results.put(("error", f"{type(e).__name__}: {e}"))


def serve(engine: RolloutEngine, request: RolloutRequest) -> RolloutBatch:
    """Sample `group_size` completions of every prompt of the request through the engine port,
    seeded by the request, stamped with the version the engine held."""
    prompts = [p for p in request.prompts for _ in range(request.group_size)]
    sampling = Sampling(
        max_new_tokens=request.max_new_tokens, temperature=request.temperature, seed=request.seed
    )
    flat = engine.generate(prompts, sampling)
    groups = [flat[i : i + request.group_size] for i in range(0, len(flat), request.group_size)]
    return RolloutBatch(
        request_id=request.request_id, version=engine.version, prompts=request.prompts, groups=groups
    )


class RolloutWorker:
    """The trainer's handle on the worker process. Use as a context manager: the process is always
    stopped, on the error path too."""

    def __init__(self, shape: ModelShape, rope_base: float | None, *, threads: int = 1, device: str = "cpu"):
        ctx = mp.get_context("spawn")
        self._control = ctx.Queue()
        self._results = ctx.Queue()
        self._process = ctx.Process(
            target=worker_main,
            name="ito-rollout",
            args=(self._control, self._results, msgspec.to_builtins(shape), rope_base, threads, device),
            daemon=True,
        )
        self._ready: dict[str, RolloutBatch] = {}
        self.published_version = -1
        self.loaded_version = -1  # the newest version the worker has said it loaded
        self._shared: SharedWeights | None = None
        self._shared_failed = False
        self._slot_versions = [-1] * WEIGHT_SLOTS  # the version each slot holds
        self.bytes_sent = 0  # weights that went through the queue as bytes (the fallback)

    def __enter__(self) -> "RolloutWorker":
        self._process.start()
        self._receive(lambda kind, _: kind == "ready", START_TIMEOUT_S)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Policy weights for every request sent after this call; a version the worker already has
        (or was already sent) is not sent again."""
        if version == self.published_version:
            return
        shared = self._shared_weights(state_dict)
        if shared is None:
            raw = _state_bytes(state_dict)
            self.bytes_sent += len(raw)
            self._control.put(("weights", version, raw))
        else:
            slot = version % WEIGHT_SLOTS
            if self._slot_versions[slot] > self.loaded_version:  # the worker has yet to load what it holds
                needed = self._slot_versions[slot]
                self._receive(lambda kind, payload: kind == "loaded" and payload >= needed, COLLECT_TIMEOUT_S)
            shared.write(slot, state_dict)
            self._slot_versions[slot] = version
            self._control.put(("weights_at", version, slot))
        self.published_version = version

    def _shared_weights(self, state_dict: dict[str, torch.Tensor]) -> SharedWeights | None:
        if self._shared is not None:
            return self._shared if self._shared.fits(state_dict) else None
        if self._shared_failed:
            return None
        try:
            self._shared = SharedWeights(state_dict)
        except (OSError, RuntimeError):  # no writable temp dir, or no shared mapping: bytes it is
            self._shared_failed = True
            return None
        self._control.put(("attach", self._shared.path, self._shared.layout, self._shared.slot_bytes))
        return self._shared

    def request(self, request: RolloutRequest) -> None:
        self._control.put(("request", request))

    def collect(self, request_id: str, timeout_s: float = COLLECT_TIMEOUT_S) -> RolloutBatch:
        """The batch answering `request_id` (batches for other requests are kept for later)."""
        if request_id not in self._ready:
            self._receive(
                lambda kind, payload: kind == "batch" and payload.request_id == request_id, timeout_s
            )
        return self._ready.pop(request_id)

    def _receive(self, done, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                kind, payload = self._results.get(timeout=POLL_S)
            except queue.Empty:
                if not self._process.is_alive():
                    raise RolloutError(
                        f"The rollout worker exited with code {self._process.exitcode}."
                    ) from None
                continue
            if kind == "error":
                raise RolloutError(f"The rollout worker failed: {payload}")
            if kind == "batch":
                self._ready[payload.request_id] = payload
            if kind == "loaded":
                self.loaded_version = max(self.loaded_version, payload)
                if self._shared is not None:
                    self._shared.unlink()  # both sides have it mapped: nothing left to leak
            if done(kind, payload):
                return
        raise RolloutError(f"No answer from the rollout worker within {timeout_s:.0f} s.")

    def close(self) -> None:
        if self._shared is not None:
            self._shared.unlink()
        if self._process.is_alive():
            self._control.put(None)
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.terminate()  # our own child, by its handle
            self._process.join(timeout=5)
        for q in (self._control, self._results):
            q.cancel_join_thread()
            q.close()
