"""The RLVR rollout worker: a separate process that samples completions from versioned policy
weights, and the trainer-side client that feeds it weights and requests over queues.

One FIFO control queue carries both weight updates and rollout requests, so the version a request
is served with is fixed by the order the trainer sends them in: a run is reproducible from its seed
even though generation overlaps training. Every rollout batch carries the policy version it was
sampled from; the trainer drops those older than its staleness bound.

The process is started with "spawn": forking a process that runs torch threads (and, in the
service, an event loop) can deadlock the child. Weights travel as `torch.save` bytes rather than
shared-memory tensors, which need file-descriptor passing that some containers forbid.
"""

import io
import queue
import time
from dataclasses import dataclass

import msgspec
import torch
import torch.multiprocessing as mp

from contracts.models import ModelShape
from services.trainer.generation import Completion, complete

START_TIMEOUT_S = 120.0  # spawn + import torch takes ~2 s here; a loaded host can take far longer
COLLECT_TIMEOUT_S = 600.0  # one request's rollouts; generous, a dead worker is noticed within POLL_S
POLL_S = 1.0


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


def worker_main(control: "mp.Queue", results: "mp.Queue", shape: dict, rope_base: float | None, threads: int,
                device: str) -> None:
    """The worker process: apply weights, serve requests, in queue order, until a None arrives."""
    from services.trainer.model import Transformer

    try:
        torch.set_num_threads(max(1, threads))
        model = Transformer(msgspec.convert(shape, ModelShape), rope_base=rope_base).to(device)
        model.eval()
        version = -1
        results.put(("ready", None))
        while (message := control.get()) is not None:
            match message:
                case ("weights", int(new_version), bytes(raw)):
                    model.load_state_dict(torch.load(io.BytesIO(raw), weights_only=True, map_location=device))
                    version = new_version
                case ("request", RolloutRequest() as request):
                    generator = torch.Generator().manual_seed(request.seed)
                    prompts = [p for p in request.prompts for _ in range(request.group_size)]
                    flat = complete(model, prompts, max_new_tokens=request.max_new_tokens,
                                    temperature=request.temperature, generator=generator)
                    groups = [flat[i : i + request.group_size] for i in range(0, len(flat), request.group_size)]
                    results.put(("batch", RolloutBatch(request_id=request.request_id, version=version,
                                                       prompts=request.prompts, groups=groups)))
    except Exception as e:  # reported to the trainer, which fails the stage with the message
        results.put(("error", f"{type(e).__name__}: {e}"))


class RolloutWorker:
    """The trainer's handle on the worker process. Use as a context manager: the process is always
    stopped, on the error path too."""

    def __init__(self, shape: ModelShape, rope_base: float | None, *, threads: int = 1, device: str = "cpu"):
        ctx = mp.get_context("spawn")
        self._control = ctx.Queue()
        self._results = ctx.Queue()
        self._process = ctx.Process(
            target=worker_main, name="ito-rollout",
            args=(self._control, self._results, msgspec.to_builtins(shape), rope_base, threads, device),
            daemon=True,
        )
        self._ready: dict[str, RolloutBatch] = {}
        self.published_version = -1

    def __enter__(self) -> "RolloutWorker":
        self._process.start()
        self._receive(lambda kind, _: kind == "ready", START_TIMEOUT_S)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        """Policy weights for every request sent after this call."""
        self._control.put(("weights", version, _state_bytes(state_dict)))
        self.published_version = version

    def request(self, request: RolloutRequest) -> None:
        self._control.put(("request", request))

    def collect(self, request_id: str, timeout_s: float = COLLECT_TIMEOUT_S) -> RolloutBatch:
        """The batch answering `request_id` (batches for other requests are kept for later)."""
        if request_id not in self._ready:
            self._receive(lambda kind, payload: kind == "batch" and payload.request_id == request_id, timeout_s)
        return self._ready.pop(request_id)

    def _receive(self, done, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                kind, payload = self._results.get(timeout=POLL_S)
            except queue.Empty:
                if not self._process.is_alive():
                    raise RolloutError(f"The rollout worker exited with code {self._process.exitcode}.") from None
                continue
            if kind == "error":
                raise RolloutError(f"The rollout worker failed: {payload}")
            if kind == "batch":
                self._ready[payload.request_id] = payload
            if done(kind, payload):
                return
        raise RolloutError(f"No answer from the rollout worker within {timeout_s:.0f} s.")

    def close(self) -> None:
        if self._process.is_alive():
            self._control.put(None)
            self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.terminate()  # our own child, by its handle
            self._process.join(timeout=5)
        for q in (self._control, self._results):
            q.cancel_join_thread()
            q.close()
