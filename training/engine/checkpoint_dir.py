"""A stage's checkpoint directory on disk: its layout, the commit marker, listing, pruning, pins and
an approved loss-spike restart's rewind and skip. Plain files and JSON: no torch, so tools that only
read a checkpoint's step and data position (the trainer's worker, the follower) need none.

Layout of one checkpoint, `<dir>/step-<8 digit step>/`:
  __0_0.distcp, .metadata   model + optimizer tensors, written by torch.distributed.checkpoint
  trainer_state.json        step, data position, LR scheduler state, RNG states (the sidecar)
  COMMITTED                 JSON {step, bytes, stall_s, save_s}; written last, atomically
  PINNED                    (optional) pruning leaves this checkpoint alone; see below

A directory without COMMITTED is a save that is still running or that died: it is never listed and
never loaded, and the next commit deletes it (`prune`). The writers are in `checkpoint` (the saves)
and the readers in `checkpoint_load`.

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
and data position can be read by tools that do not import torch.
"""

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

MARKER = "COMMITTED"
SIDECAR = "trainer_state.json"
PIN = "PINNED"
DIR_PREFIX = "step-"
SKIP_FILE = "SKIP.json"  # an approved restart's batches to skip, in data positions: {"from": a, "to": b}
DISCARDED = "discarded"  # set aside, kept for a person to look at, never loaded


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointInfo:
    """A committed checkpoint, as its marker records it."""

    step: int
    path: str
    bytes: int
    stall_s: float  # how long the loop was blocked by this save: the call (incl. waiting on the
    # previous save) and the wait for its staging copy (`wait_staged`, or inside the call)
    save_s: float  # from the start of the save to the data being durable on disk


def step_dir(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"{DIR_PREFIX}{step:08d}"


def read_marker(path: Path) -> CheckpointInfo | None:
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


def commit(info: CheckpointInfo) -> None:
    """Write the marker that makes the checkpoint at `info.path` committed: last, atomically."""
    write_json_atomic(
        Path(info.path) / MARKER,
        {"step": info.step, "bytes": info.bytes, "stall_s": info.stall_s, "save_s": info.save_s},
    )


def step_dirs(directory: Path) -> list[tuple[int, Path]]:
    """Every `step-N` directory under `directory`, committed or not, by step."""
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
    for step, path in step_dirs(Path(directory)):
        info = read_marker(path)
        if info is not None and info.step == step:
            infos.append(info)
    return infos


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def write_json_atomic(path: Path, payload: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        json.dump(payload, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def prune(directory: Path, keep_last: int, committed_step: int) -> None:
    """Keep the newest `keep_last` committed checkpoints and the pinned ones; drop older ones and
    dead saves."""
    committed = {info.step for info in list_checkpoints(directory)}
    keep = set(sorted(committed)[-keep_last:]) | set(pinned_steps(directory))
    for step, path in step_dirs(directory):
        # Uncommitted dirs below the step just committed are dead: only one save is ever in flight.
        if step < committed_step and step not in keep:
            shutil.rmtree(path, ignore_errors=True)


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
    return [step for step, path in step_dirs(Path(directory)) if (path / PIN).exists()]


def pin(directory: str | os.PathLike, step: int | None) -> bool:
    """Make the committed checkpoint `step` the directory's one pinned checkpoint (None, or a step
    that is not committed: none). One pin, because one proposal is pending at a time. True if pinned."""
    directory = Path(directory)
    path = step_dir(directory, step) if step is not None else None
    target = path if path is not None and read_marker(path) is not None else None
    if target is not None:
        (target / PIN).touch()
    for _, other in step_dirs(directory):
        if other != target:
            (other / PIN).unlink(missing_ok=True)
    return target is not None


def unpin(directory: str | os.PathLike) -> None:
    pin(directory, None)


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
    write_json_atomic(Path(directory) / SKIP_FILE, {"from": skip_from, "to": skip_to})
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
