"""Manifests given by content (the MCP tools' `manifest_json`): kept 0600 in the door's own dir.

A remote agent cannot hand the door a path on the door's machine, so it sends the manifest's text.
The door writes those exact bytes to `$ECC_CONFIG_DIR/manifests/<sha256>.json` (the directory
0700, the file 0600, written to a private temporary name and renamed into place) and from then on
treats it as a path argument: the same safe reader (ecc/manifest_file.py) reads it back and hashes
it, so the digest is the one the same bytes in any file have, and the `ecc ito confirm` command a
person is asked to run names this file, which they can read before confirming.

Content over the reader's size limit is refused with the reader's code before anything is written.
The directory keeps the newest KEEP manifests: a person's confirmation names one of the recent ones.
"""

import hashlib
import os
import pathlib
import secrets
from typing import Any

from contracts.envelope import Envelope
from contracts.errors import ErrorCode
from ecc import credentials
from ecc.manifest_file import DEFAULT_MAX_BYTES
from ecc.transport import local_error

DIR_NAME = "manifests"
KEEP = 200  # 200 manifests of at most 1 MiB each: a bounded directory, far more than a session plans


def directory() -> pathlib.Path:
    return credentials.config_dir() / DIR_NAME


def store(text: str) -> str | Envelope[Any]:
    """The absolute path of a 0600 file holding `text` as UTF-8, or why not (nothing written)."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate in the JSON string: not text a file can hold
        return local_error(ErrorCode.manifest_invalid, "the manifest is not UTF-8 text")
    if len(data) > DEFAULT_MAX_BYTES:
        return local_error(
            ErrorCode.manifest_too_large,
            f"the manifest is {len(data)} bytes; the limit is {DEFAULT_MAX_BYTES}",
        )
    where = directory()
    where.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(where, 0o700)  # an older, looser directory is tightened before anything goes into it
    target = where / f"{hashlib.sha256(data).hexdigest()}.json"
    tmp = where / f".{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _prune(where, keep=target)
    return str(target.absolute())


def _prune(where: pathlib.Path, keep: pathlib.Path) -> None:
    """The newest KEEP manifests stay (the one just written always)."""
    stored = sorted(where.glob("*.json"), key=_mtime, reverse=True)
    for old in stored[KEEP:]:
        if old != keep:
            old.unlink(missing_ok=True)


def _mtime(path: pathlib.Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:  # another door pruned it meanwhile
        return 0
