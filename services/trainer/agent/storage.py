"""The checkpoint storage check, where checkpoints are written: the trainer's own disk.

The scheduler judges only the policy's form ('local' or an absolute path) and puts the room a run
needs into the signed plan (`Plan.checkpoint_bytes`: `keep_last` checkpoints of the largest stage).
Before its first step the trainer makes the run's directory and checks it here: an absolute storage
path must exist already (the trainer never creates a mount point), the directory must take a file,
and the disk must have the room the plan asks for, less what this run's checkpoints hold already
(a resumed run rotates its own). A refusal fails the run with `checkpoint_storage_unavailable`
before any GPU time is spent.
"""

import os
import pathlib
import shutil
import tempfile

from contracts.errors import ErrorCode

CODE = ErrorCode.checkpoint_storage_unavailable


class StorageUnavailable(Exception):
    """The run's checkpoint storage cannot take its checkpoints; the message is safe to show."""

    def __str__(self) -> str:
        return f"{CODE.value}: {self.args[0]}"


def used_bytes(directory: pathlib.Path) -> int:
    """What the files under `directory` hold (links not followed)."""
    total = 0
    for parent, _dirs, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except OSError:  # removed while we walked (a rotation)
                pass
    return total


def prepare(root: pathlib.Path, run_dir: pathlib.Path, needed: int, absolute: bool) -> None:
    """Make `run_dir` (0700) under `root` and check it can take `needed` bytes of checkpoints;
    `StorageUnavailable` otherwise. `absolute`: the manifest named `root`, which must exist."""
    if absolute and not root.is_dir():
        raise StorageUnavailable("the checkpoint storage path does not exist on the trainer")
    try:
        run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".probe-"):
            pass  # a write that works is the only proof of writability (root passes every access())
    except OSError:
        raise StorageUnavailable("the checkpoint storage is not writable by the trainer") from None
    free = shutil.disk_usage(run_dir).free
    missing = needed - used_bytes(run_dir)
    if missing > free:
        raise StorageUnavailable(
            f"checkpoints need ~{needed / 1e9:.1f} GB; the trainer's storage has {free / 1e9:.1f} GB free"
        )
