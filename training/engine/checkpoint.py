"""The trainer's checkpoint saves: asynchronous DCP saves, one in flight, committed when they finish;
and the synchronous whole-model weights a LoRA stage hands on. The directory's layout, markers, pins
and pruning are `checkpoint_dir`'s; reading a checkpoint back is `checkpoint_load`'s.

At most one save is in flight: `save` first waits for the previous one, so a slow disk slows the
loop instead of piling up staged copies in memory. A save's directory is committed (its marker
written, older checkpoints pruned) only once every rank's part is durable.

Staging, the copy of the state that the background write then serialises, is what a save costs the
loop. One `DefaultStager` per Checkpointer, made at its first save, serves every save: its host
buffers are allocated once (about the size of the model and optimizer state, held until `close`)
instead of once per save, and with `overlap_staging` it copies in a thread of its own while the
loop runs the next forward and backward. One writer thread, likewise made once, reads the state
dict (at the call instead, under FSDP2, whose forward swaps parameters), has it copied, writes the
sidecar and the shards: the loop's call only starts the save. The loop then calls `wait_staged` right before the next
optimizer step, the first thing that changes what is being copied; without `overlap_staging`, `save`
waits for the copy itself before it returns. Either way a save holds the state at its call, and its
`stall_s` counts every moment the loop was blocked by it: the call, the wait for the previous save
inside it, and the wait for its copy.

The sidecar (`checkpoint_dir.SIDECAR`, JSON) is written at the moment of the `save` call, next to
the DCP snapshot taken at that same moment, and before the marker; its RNG states are encoded here
and restored by `checkpoint_load`.

Works with no process group (single process, `no_dist=True`) and with an initialised one. With
several ranks, every rank saves its own shards, and DCP's asynchronous saves run on a gloo group of
their own (`distributed.checkpoint_group`): sharing the default group, their background collectives
would interleave with FSDP's all-gathers and deadlock. Rank 0 alone touches the directory (mkdir,
rmtree, the sidecar, the marker, pins and pruning): every rank renaming one `.tmp` file crashes. Each
decision that ends in a collective (is a save finished? did it succeed?) is taken by all ranks
together, so no rank waits in a collective that another skipped.
"""

import base64
import os
import random
import shutil
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

from contracts.manifest import CheckpointPolicy, Lora
from training.engine import distributed
from training.engine.checkpoint_dir import (
    SIDECAR,
    CheckpointInfo,
    commit,
    dir_bytes,
    prune,
    read_marker,
    step_dir,
    unpin,
    write_json_atomic,
)
from training.weights import lora

# DCP warns on every single-process save/load even when no_dist=True is passed on purpose. A filter
# (not catch_warnings) because the save runs on DCP's thread and catch_warnings is not thread-safe.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

# The manifest's checkpoint policy owns the defaults (every 50 steps, keep the last 2); every stage's
# config, the loop and the checkpointer take theirs from here rather than repeating the numbers.
CHECKPOINT_DEFAULTS = CheckpointPolicy()


ModelKeys = Callable[[str], bool]
"""Which model state-dict keys a checkpoint holds (True: saved and loaded). A LoRA stage passes
`lora.is_adapter_key`: its frozen base is not saved again at every checkpoint, only the adapters
(the optimizer holds only the adapters already); None, every key, is what every other stage uses."""


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointFailed:
    """A save that did not complete; its directory stays uncommitted and is cleaned up later."""

    step: int
    message: str


def rng_state() -> dict:
    """This process's RNG states as the sidecar holds them (JSON: base64 of torch's byte tensors)."""
    version, internal, gauss = random.getstate()
    state = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": [version, list(internal), gauss],
    }
    if torch.cuda.is_available():
        state["cuda"] = [
            base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()
        ]
    return state


def set_rng_state(state: dict) -> None:
    """Restore the RNG states `rng_state` recorded (cuda's only on as many devices as were saved)."""
    as_tensor = lambda text: torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)  # noqa: E731
    torch.set_rng_state(as_tensor(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    cuda = state.get("cuda")
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([as_tensor(s) for s in cuda])


def _shards_in_forward(model: torch.nn.Module) -> bool:
    """Does FSDP2 swap this model's parameters during its forward (then its state dict must be read
    before the forward starts)?"""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def copy_table_intact(stager: DefaultStager) -> bool:
    """Can this stager copy a state again? In torch 2.11 its state-dict stager's `close()`, which
    `DefaultStager` calls after every copy, empties its copy table, and the one lookup that indexes
    the table directly (a class object, reached through any object copied by reduction) then fails:
    every save after a Checkpointer's first failed on a GPU with `KeyError: <class 'type'>` (seen on
    an H200 with torch 2.11.0+cu130; the run's final checkpoint failed, and so did the run). torch
    2.13's table survives the copy."""
    table = getattr(getattr(stager, "_state_dict_stager", None), "_deepcopy_dispatch", None)
    return not isinstance(table, dict) or type in table


def staging_options() -> StagingOptions:
    """How a Checkpointer's stager copies the state: in a thread of its own (the loop goes on
    meanwhile); into pinned host memory with non-blocking copies when there is an accelerator to copy
    from (DefaultStager refuses non-blocking copies without one, and pinning needs cuda); never into
    shared memory, which only a writer in another process would need (DCP's writer is a thread here)."""
    return StagingOptions(
        use_pinned_memory=torch.cuda.is_available(),
        use_shared_memory=False,
        use_async_staging=True,
        use_non_blocking_copy=torch.accelerator.is_available(),
    )


class Checkpointer:
    """Saves asynchronously into `directory`, one save in flight, and commits finished saves.

    The loop calls `save` at its checkpoint steps and `poll` every step; both `poll` and `wait`
    return the outcomes (CheckpointInfo or CheckpointFailed) finished since the last call, so the
    caller can report each commit once, from its own thread. With `overlap_staging`, the caller
    also calls `wait_staged` before anything changes the parameters or the optimizer state (the loop:
    right before `optimizer.step`). `close` when done: it frees the staging buffers.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep_last: int = CHECKPOINT_DEFAULTS.keep_last,
        overlap_staging: bool = False,
        model_keys: ModelKeys | None = None,
    ):
        if keep_last < 1:
            raise ValueError("keep_last needs to be at least 1 checkpoint.")
        self.directory = Path(directory)
        self.keep_last = keep_last
        # False by default: a caller that does not know to call `wait_staged` gets a save that returns
        # with the state copied, instead of a checkpoint that silently holds a later step's state.
        self.overlap_staging = overlap_staging
        self.model_keys = model_keys  # None: the whole model; a LoRA stage: only its adapters
        # Training goes on here: a pin left by an earlier attempt belongs to a restart that was never
        # carried out (a carried-out one was unpinned by `rewind`), and would hold its checkpoint forever.
        if distributed.is_rank0():
            unpin(self.directory)
        self._future: Future | None = None  # the in-flight save's write
        self._staging: Future | None = None  # its staging copy, until someone has waited for it
        self._pending: dict | None = None  # step, path, started, stall_s, done_at of the in-flight save
        self._outcomes: list[CheckpointInfo | CheckpointFailed] = []
        self._stager: DefaultStager | None = None  # made at the first save, reused by every save
        self._writer: ThreadPoolExecutor | None = None  # likewise: the thread that writes each save
        self._closed = False

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        data_position: int = 0,
    ) -> None:
        """Snapshot the state now and write it in the background. Blocks to wait for the previous
        save and, without `overlap_staging`, for the copy of the state into staging memory."""
        if self._closed:
            raise RuntimeError("This Checkpointer is closed: a new one saves again.")
        entered = time.perf_counter()
        self._finish(block=True)
        path = step_dir(self.directory, step)
        # Rank 0 owns the directory: its answer holds for every rank.
        if distributed.broadcast_object(read_marker(path) is not None):
            return  # this exact step is already durable (a resumed run that ends where it began)
        started = time.perf_counter()
        sidecar = None
        if distributed.is_rank0():
            if path.exists():
                shutil.rmtree(path)  # a save of this step that died before its marker
            path.mkdir(parents=True)
            sidecar = {  # taken now, the state at the call; written (and fsync'd) by the writer
                "step": step,
                "data_position": data_position,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "rng": rng_state(),
            }
        distributed.barrier()  # the directory exists before any rank writes into it
        # What `dcp.async_save` does with a thread, on a writer thread made once instead of once per
        # save (issue 30: starting a thread, the sidecar's fsync and reading the state dict were
        # most of a small save's stall): the writer reads the state dict, has the stager copy it
        # (in the stager's own thread), then writes the sidecar and the shards (`dcp.save`, on
        # DCP's own gloo group with several ranks). The loop goes on meanwhile; `wait_staged`
        # waits for the copy. FSDP2 swaps a module's parameters for unsharded ones during its
        # forward, so with FSDP2 the state dict is read here, before the call returns.
        state = None if not _shards_in_forward(model) else self._state_dict(model, optimizer)
        staged: Future = Future()
        staged.set_running_or_notify_cancel()
        # Reusing the stager's buffers is safe: the previous save, the only reader of the last copy,
        # finished in `_finish` above.
        future = self._ready_writer().submit(
            self._write,
            path,
            sidecar,
            (model, optimizer) if state is None else state,
            staged,
            self._ready_stager(),
        )
        pending = {"step": step, "path": path, "started": started, "done_at": None}
        future.add_done_callback(lambda _: pending.__setitem__("done_at", time.perf_counter()))
        pending["stall_s"] = time.perf_counter() - entered
        self._future, self._pending, self._staging = future, pending, staged
        if not self.overlap_staging:
            self.wait_staged()

    def _state_dict(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        return {"model": only_keys(model_sd, self.model_keys), "optimizer": optim_sd}

    def _write(
        self,
        path: Path,
        sidecar: dict | None,
        state_or_modules: dict | tuple[torch.nn.Module, torch.optim.Optimizer],
        staged: Future,
        stager: DefaultStager,
    ) -> None:
        """A save, on the writer thread: the state dict (unless read at the call), its copy into
        the staging buffers (`staged` says when it is done, or why it failed), the sidecar (rank 0)
        and this rank's shards. A failed step fails the write, which `_finish` reports."""
        try:
            state = (
                self._state_dict(*state_or_modules)
                if isinstance(state_or_modules, tuple)
                else state_or_modules
            )
            copy = stager.stage(state)
            copied = copy.result() if isinstance(copy, Future) else copy
        except BaseException as e:
            staged.set_exception(e)
            raise
        staged.set_result(None)
        if sidecar is not None:
            write_json_atomic(path / SIDECAR, sidecar)
        dcp.save(
            copied,
            checkpoint_id=str(path),
            process_group=distributed.checkpoint_group(),
            no_dist=not distributed.initialized(),
        )

    def _ready_stager(self) -> DefaultStager:
        if self._stager is not None and not copy_table_intact(self._stager):
            self._stager.close()  # the last save, its only reader, finished in `_finish`
            self._stager = None  # a new one copies, with buffers of its own
        if self._stager is None:
            # Made here, not in __init__: a Checkpointer that never saves holds no thread, and on an
            # accelerator the stager's stream is made after the training stream is in use (as
            # DefaultStager asks).
            self._stager = DefaultStager(staging_options())
        # On an accelerator the copy runs on the stager's own stream, which does not wait for the
        # training stream by itself: the optimizer step just queued there may not have run yet.
        stream = getattr(self._stager, "_staging_stream", None)
        if stream is not None:
            stream.wait_stream(torch.accelerator.current_stream())
        return self._stager

    def _ready_writer(self) -> ThreadPoolExecutor:
        if self._writer is None:  # one thread for every save's write; one save in flight at a time
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ito-checkpoint-writer")
        return self._writer

    def wait_staged(self) -> float:
        """Block until the in-flight save's copy of the state is complete; the seconds waited,
        which count in that save's stall. Call it before anything changes the parameters or the
        optimizer state. Local to this rank: no collective."""
        staging, self._staging = self._staging, None
        if staging is None:
            return 0.0
        started = time.perf_counter()
        wait_for([staging])  # a failed copy fails the save's write too, and `_finish` reports that
        waited = time.perf_counter() - started
        if self._pending is not None:
            self._pending["stall_s"] += waited
        return waited

    def close(self) -> None:
        """Free the staging buffers and thread. Commits nothing and takes no collective, so it is
        safe on an error path: call `wait` first to commit the save in flight (a save still writing
        keeps its own reference to the copy until it is done)."""
        self._closed = True
        stager, self._stager = self._stager, None
        if stager is not None:
            stager.close()  # waits for a copy still running before it drops the buffers
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=False)  # a write still running finishes on its own

    def poll(self) -> list[CheckpointInfo | CheckpointFailed]:
        """Commit the in-flight save if it has finished; never blocks on it."""
        self._finish(block=False)
        return self._drain()

    def wait(self) -> list[CheckpointInfo | CheckpointFailed]:
        """Block until the in-flight save (if any) has finished, and commit it."""
        self._finish(block=True)
        return self._drain()

    def _drain(self) -> list[CheckpointInfo | CheckpointFailed]:
        outcomes, self._outcomes = self._outcomes, []
        return outcomes

    def _finish(self, *, block: bool) -> None:
        future, pending = self._future, self._pending
        if future is None or pending is None:
            return
        # Every rank's part must be written before any rank commits; all ranks agree on "done".
        if not block and not distributed.all_true(future.done()):
            return
        # A finished write had its staging copy finished first: nothing left to wait for.
        self._future, self._pending, self._staging = None, None, None
        error: str | None = None
        try:
            future.result()
        except Exception as e:  # any writer error: recorded as a value, the loop decides what to do
            error = f"{type(e).__name__}: {e}"
        if not distributed.all_true(error is None):  # also the barrier before rank 0 commits
            message = error or "another rank's part of the save failed"
            self._outcomes.append(CheckpointFailed(step=pending["step"], message=message))
            return
        path: Path = pending["path"]
        done_at = pending["done_at"] or time.perf_counter()
        info = CheckpointInfo(
            step=pending["step"],
            path=str(path),
            bytes=dir_bytes(path) if distributed.is_rank0() else 0,  # only rank 0 reports it
            stall_s=round(pending["stall_s"], 6),
            save_s=round(done_at - pending["started"], 6),
        )
        if distributed.is_rank0():
            commit(info)
            prune(self.directory, self.keep_last, info.step)
        self._outcomes.append(info)


def only_keys(model_sd: dict[str, Any], keys: ModelKeys | None) -> dict[str, Any]:
    """The entries of a model state dict that `keys` names (all of them for None): what a save
    writes and a load reads."""
    if keys is None:
        return model_sd
    kept = {k: v for k, v in model_sd.items() if keys(k)}
    if not kept:
        raise ValueError("The checkpoint's key filter leaves no model weight to save or load.")
    return kept


def write_weights(directory: str | os.PathLike, step: int, state: dict[str, torch.Tensor]) -> CheckpointInfo:
    """Write whole (unsharded) model weights as a committed checkpoint `<directory>/step-N` that
    `load_weights` reads on any number of ranks (DCP reshards on load): how a LoRA stage hands its
    merged model to the next stage. Rank 0 alone, synchronously; no optimizer, no sidecar."""
    started = time.perf_counter()
    path = step_dir(directory, step)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    dcp.save({"model": state}, checkpoint_id=str(path), no_dist=True)
    info = CheckpointInfo(
        step=step,
        path=str(path),
        bytes=dir_bytes(path),
        stall_s=0.0,
        save_s=round(time.perf_counter() - started, 6),
    )
    commit(info)
    return info


def write_merged_checkpoint(model: torch.nn.Module, cfg: Lora, directory: Path, step: int) -> None:
    """The adapted model, merged, as a whole-model committed checkpoint in `directory` (not the
    stage's own, which holds adapters alone): what a following stage's `init_from`, or any code
    that calls `load_weights`, can start from. Collective under FSDP2: every rank calls
    it; rank 0 gathers, merges and writes."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # Filled on rank 0 under several ranks; a model's state (unlike an optimizer's) is all tensors.
    whole = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))
    if distributed.is_rank0():
        write_weights(directory, step, lora.merge_state_dict(whole, cfg))
    distributed.barrier()
