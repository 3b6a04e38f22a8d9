"""Where a run's checkpoints live, derived from a root the service owns: never taken from a message.

The scheduler (to show and bill it) and the trainer (to write and remove it) both derive
`<root>/<account>/<run_id>`, where the root is the service's own `<data dir>/checkpoints`, or the
absolute storage path the reviewed manifest names (bound by its digest and the run record).
"""

import os
import pathlib

from contracts.manifest import Manifest


def storage_root(local: pathlib.Path, storage: str) -> pathlib.Path:
    """The manifest's absolute storage path, or the service's own storage for "local"."""
    return pathlib.Path(storage) if os.path.isabs(storage) else local


def checkpoint_root(local: pathlib.Path, manifest: Manifest) -> pathlib.Path:
    return storage_root(local, manifest.checkpoint.storage)


def run_dir(local: pathlib.Path, storage: str, account: str, run_id: str) -> pathlib.Path:
    return storage_root(local, storage) / account / run_id


def inside(root: pathlib.Path, path: pathlib.Path) -> bool:
    """Does `path`, with every link resolved, lie strictly below `root` (also resolved)?"""
    real_root, real = os.path.realpath(root), os.path.realpath(path)
    return real != real_root and os.path.commonpath([real_root, real]) == real_root
