"""The checkpoint storage check, where checkpoints are written: the trainer's own disk.

The scheduler judges only the policy's form ('local', or a path under one of the storage roots the
operator allows: `ITO_CHECKPOINT_ROOTS`) and puts the room a run needs into the signed plan
(`Plan.checkpoint_bytes`: `keep_last` checkpoints of the largest stage). Before its first step the
trainer makes the run's directory and checks it here: an absolute storage path must be under one
of this trainer's allowed roots and must exist already (the trainer never creates a mount point);
the run's directories are made from the storage root down, component by component with
O_NOFOLLOW (runtime/storage/confined.py), so a link anywhere on the way (a local user's
`<root>/<account>` pointing at a directory of root's, issue 39) is refused and nothing is made
through it; and the whole chain from the root down must be one nobody else can change (the root
not writable by others unless sticky, every directory below it the trainer's alone), because the
run's files are used by path afterwards: a directory a tenant owned on the way could be renamed
away and replaced by a tree of its own (checkpoints the trainer would load, records it would read); the directory must
take a file, and the disk must have the room the plan asks for, less what this run's checkpoints
hold already (a resumed run rotates its own). A refusal fails the run with
`checkpoint_storage_unavailable` before any GPU time is spent.
"""

import os
import pathlib
import shutil
import tempfile

from contracts.errors import ErrorCode
from runtime.storage import confined

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


def allowed_root(storage: pathlib.Path, roots: tuple[pathlib.Path, ...]) -> tuple[pathlib.Path, str] | None:
    """(the allowed root, the storage's path below it) for an absolute storage path, or None when
    it is under none of `roots` (judged on the text: normal, absolute, no `..`)."""
    text = os.path.normpath(storage)
    if text != str(storage) or not storage.is_absolute():
        return None
    for root in roots:
        base = os.path.normpath(root)
        if text == base:
            return pathlib.Path(base), ""
        if text.startswith(base.rstrip("/") + "/"):
            return pathlib.Path(base), text[len(base.rstrip("/")) + 1 :]
    return None


def _made(root: pathlib.Path, below: str, run_dir: pathlib.Path, absolute: bool) -> None:
    """The run's directory made under the storage root (`root`/`below`), from the root down."""
    storage = root / below if below else root
    relative = run_dir.relative_to(storage).as_posix()
    if not absolute:
        storage.mkdir(parents=True, exist_ok=True, mode=0o700)  # the trainer's own `<data dir>/checkpoints`
    try:
        top = confined.open_trusted_dir(root, below)
    except confined.Confined as exc:
        if exc.reason == "missing":
            raise StorageUnavailable("the checkpoint storage path does not exist on the trainer") from None
        raise StorageUnavailable(
            "the checkpoint storage leads through a link or a directory that is not the trainer's "
            "alone; nothing was made there"
        ) from None
    try:
        os.close(confined.make_dirs(top, relative))
    except confined.Confined as exc:
        if exc.reason in ("link", "foreign"):
            raise StorageUnavailable(
                "the checkpoint storage leads through a link or a directory that is not the trainer's "
                "alone; nothing was made there"
            ) from None
        raise StorageUnavailable("the checkpoint storage is not writable by the trainer") from None
    finally:
        os.close(top)


def prepare(
    root: pathlib.Path,
    run_dir: pathlib.Path,
    needed: int,
    absolute: bool,
    allowed: tuple[pathlib.Path, ...] = (),
) -> None:
    """Make `run_dir` (0700) under `root` and check it can take `needed` bytes of checkpoints;
    `StorageUnavailable` otherwise. `absolute`: the manifest named `root`, which must be under one
    of `allowed` (this trainer's ITO_CHECKPOINT_ROOTS) and exist."""
    if absolute:
        found = allowed_root(root, allowed)
        if found is None:
            raise StorageUnavailable("the checkpoint storage is not one this trainer allows")
        _made(found[0], found[1], run_dir, absolute=True)
    else:
        _made(root, "", run_dir, absolute=False)
    try:
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
