"""The trainer's checkpoints: asynchronous DCP saves, commit markers, pruning and resume.

Layout of one checkpoint, `<dir>/step-<8 digit step>/`:
  __0_0.distcp, .metadata   model + optimizer tensors, written by torch.distributed.checkpoint
  trainer_state.json        step, data position, LR scheduler state, RNG states (the sidecar)
  COMMITTED                 JSON {step, bytes, stall_s, save_s}; written last, atomically
  PINNED                    (optional) pruning leaves this checkpoint alone; see below

A directory without COMMITTED is a save that is still running or that died: it is never listed and
never loaded, and the next commit deletes it. At most one save is in flight: `save` first waits for
the previous one, so a slow disk slows the loop instead of piling up staged copies in memory.

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

Loss-spike restarts also live here. Beside the step directories, `SKIP.json` holds an approved
restart's window of batches to skip, in data positions (the batch count the sidecar records), never
in steps: once one skip has happened a step's data position is no longer its step number, so only
a position compared with a position finds the restart point again. A restart's checkpoint is pinned
from the moment a spike is suspected until the restart is carried out (`rewind`) or training goes on
in the directory without it (the next `Checkpointer`); pruning by `keep_last` never removes it,
since the saves around a spike (the one on stop among them) would otherwise evict exactly the
checkpoint the proposal needs to go back to.

Why a JSON sidecar for the non-tensor state rather than the DCP state dict: DCP stores non-tensor
values as pickles, and loading a pickle from a shared checkpoint directory runs whatever it holds;
DCP can also only load keys that a template names in advance. JSON is safe to read, and the step
and data position can be read by tools that do not import torch. The sidecar is written at the
moment of the `save` call, next to the DCP snapshot taken at that same moment, and before the marker.

Works with no process group (single process, `no_dist=True`) and with an initialised one. With
several ranks, every rank saves and loads its own shards (DCP reshards on load, so a stage saved on 4
ranks resumes on 2), and DCP's asynchronous saves run on a gloo group of their own
(`distributed.checkpoint_group`): sharing the default group, their background collectives would
interleave with FSDP's all-gathers and deadlock. Rank 0 alone touches the directory (mkdir, rmtree,
the sidecar, the marker, pins and pruning): every rank renaming one `.tmp` file crashes. Each decision
that ends in a collective (is a save finished? did it succeed? which checkpoint to load?) is taken by
all ranks together, so no rank waits in a collective that another skipped.
"""

import base64
import json
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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from contracts.manifest import CheckpointPolicy, Lora
from training.engine import distributed
from training.weights import lora
from training.weights.lora import plain_linears

MARKER = "COMMITTED"
SIDECAR = "trainer_state.json"
PIN = "PINNED"
DIR_PREFIX = "step-"

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
class CheckpointInfo:
    """A committed checkpoint, as its marker records it."""

    step: int
    path: str
    bytes: int
    stall_s: float  # how long the loop was blocked by this save: the call (incl. waiting on the
    # previous save) and the wait for its staging copy (`wait_staged`, or inside the call)
    save_s: float  # from the start of the save to the data being durable on disk


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointFailed:
    """A save that did not complete; its directory stays uncommitted and is cleaned up later."""

    step: int
    message: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeState:
    """What `load_latest` restored besides the model and optimizer."""

    step: int
    data_position: int
    path: str


def step_dir(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"{DIR_PREFIX}{step:08d}"


def _read_marker(path: Path) -> CheckpointInfo | None:
    try:
        marker = json.loads((path / MARKER).read_text())
        return CheckpointInfo(
            step=int(marker["step"]),
            path=str(path),
            bytes=int(marker["bytes"]),
            stall_s=float(marker["stall_s"]),
            save_s=float(marker["save_s"]),
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no marker, or a torn/foreign one: not a committed checkpoint


def _step_dirs(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        suffix = child.name.removeprefix(DIR_PREFIX)
        if child.is_dir() and child.name.startswith(DIR_PREFIX) and suffix.isdigit():
            found.append((int(suffix), child))
    return sorted(found)


def list_checkpoints(directory: str | os.PathLike) -> list[CheckpointInfo]:
    """Committed checkpoints under `directory`, oldest first."""
    infos = []
    for step, path in _step_dirs(Path(directory)):
        info = _read_marker(path)
        if info is not None and info.step == step:
            infos.append(info)
    return infos


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        json.dump(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_state() -> dict:
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


def _set_rng_state(state: dict) -> None:
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
        if distributed.broadcast_object(_read_marker(path) is not None):
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
                "rng": _rng_state(),
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
        return {"model": _only(model_sd, self.model_keys), "optimizer": optim_sd}

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
            _write_json_atomic(path / SIDECAR, sidecar)
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
            bytes=_dir_bytes(path) if distributed.is_rank0() else 0,  # only rank 0 reports it
            stall_s=round(pending["stall_s"], 6),
            save_s=round(done_at - pending["started"], 6),
        )
        if distributed.is_rank0():
            _write_json_atomic(
                path / MARKER,
                {"step": info.step, "bytes": info.bytes, "stall_s": info.stall_s, "save_s": info.save_s},
            )
            self._prune(info.step)
        self._outcomes.append(info)

    def _prune(self, committed_step: int) -> None:
        """Keep the newest `keep_last` committed checkpoints and the pinned ones; drop older ones and
        dead saves."""
        committed = {info.step for info in list_checkpoints(self.directory)}
        keep = set(sorted(committed)[-self.keep_last :]) | set(pinned_steps(self.directory))
        for step, path in _step_dirs(self.directory):
            # Uncommitted dirs below the step just committed are dead: only one save is ever in flight.
            if step < committed_step and step not in keep:
                shutil.rmtree(path, ignore_errors=True)


def load_latest(
    directory: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    restore_rng: bool = True,
    model_keys: ModelKeys | None = None,
) -> ResumeState | None:
    """Restore model, optimizer, scheduler and RNG from the newest committed checkpoint, in place.
    Returns None (and touches nothing) when there is none. `model_keys`: only those model keys are
    loaded (a checkpoint saved with the same filter); the rest of the model is left as it is."""
    latest = _latest(directory)
    if latest is None:
        return None
    path = Path(latest.path)
    sidecar = json.loads((path / SIDECAR).read_text())
    # get_state_dict on a fresh optimizer materialises its state (a zero-LR step), giving DCP the
    # template of shapes it loads into.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": _only(model_sd, model_keys), "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(path), no_dist=not distributed.initialized())
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_load_options(model_keys),
    )
    if scheduler is not None and sidecar["scheduler"] is not None:
        scheduler.load_state_dict(sidecar["scheduler"])
    if restore_rng:
        _set_rng_state(sidecar["rng"])
    return ResumeState(step=int(sidecar["step"]), data_position=int(sidecar["data_position"]), path=str(path))


def _latest(directory: str | os.PathLike) -> CheckpointInfo | None:
    """The newest committed checkpoint as rank 0 sees it, on every rank: all ranks load the same one."""
    checkpoints = list_checkpoints(directory) if distributed.is_rank0() else []
    return distributed.broadcast_object(checkpoints[-1] if checkpoints else None)


def is_hf_model_dir(directory: str | os.PathLike) -> bool:
    """A Hugging Face checkpoint (a base model of the model store): config.json and safetensors."""
    path = Path(directory)
    return (path / "config.json").is_file() and (
        (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    )


def load_weights(
    directory: str | os.PathLike, model: torch.nn.Module, *, model_keys: ModelKeys | None = None
) -> CheckpointInfo | None:
    """Load only the model weights of the newest committed checkpoint, in place: how a stage starts
    from the previous stage's result with its own fresh optimizer. None (nothing touched) if none.
    `model_keys`: only those keys (a LoRA stage's frozen base, from a checkpoint of a whole model).

    A base model's Hugging Face directory is a checkpoint too (step 0): the run's first stage starts
    from it the way later stages start from the stage before (each rank reads only its shards). It
    holds no adapter, so a LoRA model's adapters keep their initialisation."""
    if is_hf_model_dir(directory):
        from training.weights.hf_load import load_hf_weights  # safetensors / DCP's HF reader

        with plain_linears(model):  # a LoRA model's adapters are not in a base model's files
            load_hf_weights(model, Path(directory))
        return CheckpointInfo(step=0, path=str(directory), bytes=0, stall_s=0.0, save_s=0.0)
    latest = _latest(directory)
    if latest is None:
        return None
    model_sd = _only(get_model_state_dict(model), model_keys)
    state = {"model": model_sd}
    dcp.load(state, checkpoint_id=latest.path, no_dist=not distributed.initialized())
    set_model_state_dict(model, state["model"], options=_load_options(model_keys))
    return latest


def _only(model_sd: dict[str, Any], keys: ModelKeys | None) -> dict[str, Any]:
    if keys is None:
        return model_sd
    kept = {k: v for k, v in model_sd.items() if keys(k)}
    if not kept:
        raise ValueError("The checkpoint's key filter leaves no model weight to save or load.")
    return kept


def _load_options(keys: ModelKeys | None) -> StateDictOptions | None:
    # A filtered state names only part of the model: the rest stays as it is, not "missing".
    return None if keys is None else StateDictOptions(strict=False)


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
        bytes=_dir_bytes(path),
        stall_s=0.0,
        save_s=round(time.perf_counter() - started, 6),
    )
    _write_json_atomic(
        path / MARKER, {"step": step, "bytes": info.bytes, "stall_s": info.stall_s, "save_s": info.save_s}
    )
    return info


def committed_positions(directory: str | os.PathLike) -> dict[int, int]:
    """Committed step -> the data position (batches served) its sidecar recorded, oldest first."""
    positions = {}
    for info in list_checkpoints(directory):
        try:
            positions[info.step] = int(json.loads((Path(info.path) / SIDECAR).read_text())["data_position"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # pruned meanwhile, or a foreign sidecar: not a checkpoint to restart from
    return positions


def pinned_steps(directory: str | os.PathLike) -> list[int]:
    return [step for step, path in _step_dirs(Path(directory)) if (path / PIN).exists()]


def pin(directory: str | os.PathLike, step: int | None) -> bool:
    """Make the committed checkpoint `step` the directory's one pinned checkpoint (None, or a step
    that is not committed: none). One pin, because one proposal is pending at a time. True if pinned."""
    directory = Path(directory)
    path = step_dir(directory, step) if step is not None else None
    target = path if path is not None and _read_marker(path) is not None else None
    if target is not None:
        (target / PIN).touch()
    for _, other in _step_dirs(directory):
        if other != target:
            (other / PIN).unlink(missing_ok=True)
    return target is not None


def unpin(directory: str | os.PathLike) -> None:
    pin(directory, None)


SKIP_FILE = "SKIP.json"  # an approved restart's batches to skip, in data positions: {"from": a, "to": b}


def rewind(directory: str | os.PathLike, step: int, skip_from: int, skip_to: int) -> list[int]:
    """Make `step` this stage's latest committed checkpoint for an approved restart: newer ones move
    to `discarded/` (kept, never loaded), the data positions [skip_from, skip_to) are marked to skip,
    and the pin that kept `step` through the proposal is removed (the restart is carried out).

    `skip_from` has to be the data position `step` recorded (0 for a restart from the start): the
    resume skips only when it lands exactly there, so any other value would silently skip nothing."""
    directory = Path(directory)
    if step > 0:
        recorded = committed_positions(directory).get(step)
        if recorded is None:
            raise ValueError(
                f"The restart's checkpoint at step {step} is not a committed checkpoint in {directory}."
            )
    else:
        recorded = 0
    if skip_from != recorded or skip_to <= skip_from:
        raise ValueError(
            f"The skip [{skip_from}, {skip_to}) does not start at the data position {recorded} that "
            f"the checkpoint at step {step} recorded, so the restart would skip nothing."
        )
    moved = discard_from(directory, step + 1)
    mark_skip(directory, skip_from, skip_to)
    return moved


DISCARDED = "discarded"  # set aside, kept for a person to look at, never loaded


def set_aside(path: Path, target: Path) -> bool:
    """Move `path` (a file or directory) to `target`, replacing what was there; False if there was
    nothing to move."""
    if not path.exists():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.is_dir():
        shutil.rmtree(target, ignore_errors=True)
    else:
        target.unlink(missing_ok=True)
    path.rename(target)
    return True


def discard_from(directory: str | os.PathLike, first_step: int) -> list[int]:
    """Set aside (into `discarded/`) every committed checkpoint of step `first_step` or later; the
    steps moved."""
    directory = Path(directory)
    moved = []
    for info in list_checkpoints(directory):
        if info.step >= first_step:
            set_aside(Path(info.path), directory / DISCARDED / Path(info.path).name)
            moved.append(info.step)
    return moved


def mark_skip(directory: str | os.PathLike, skip_from: int, skip_to: int) -> None:
    """Mark the data positions [skip_from, skip_to) to skip at the next resume, and remove the pin
    that kept the restart's checkpoint through the proposal (the restart is carried out)."""
    _write_json_atomic(Path(directory) / SKIP_FILE, {"from": skip_from, "to": skip_to})
    unpin(directory)


def skip_window(directory: str | os.PathLike) -> tuple[int, int] | None:
    """The last approved restart's window [from, to) of data positions to skip, if any."""
    try:
        skip = json.loads((Path(directory) / SKIP_FILE).read_text())
        return int(skip["from"]), int(skip["to"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def batches_to_skip(directory: str | os.PathLike, position: int) -> int | None:
    """The data position to continue from when a resume lands at `position` (the data position its
    checkpoint recorded) and that is where the approved skip starts; None: no skip here."""
    skip = skip_window(directory)
    return skip[1] if skip is not None and position == skip[0] else None


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
