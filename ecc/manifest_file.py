"""Read a reviewed manifest safely: one descriptor, never reopened by path, hashed exactly.

In the spirit of OpenSSH's StrictModes: the file must be a regular file owned by the caller or
root and not writable by group or others, and no directory above it may be writable by another
user unless it has the sticky bit (as /tmp has).
"""

import errno
import hashlib
import os
import stat

from contracts.errors import ErrorCode

DEFAULT_MAX_BYTES = 1024 * 1024  # 1 MiB
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC | os.O_NONBLOCK


class ManifestError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _trusted_owner(uid: int) -> bool:
    return uid in (os.getuid(), 0)


def _check_parents(path: str) -> None:
    """Every directory above the file, both as written and as resolved: a symlinked parent must
    not hide an unsafe directory above the real file."""
    for start in dict.fromkeys((os.path.dirname(path), os.path.dirname(os.path.realpath(path)))):
        _check_chain(start)


def _check_chain(directory: str) -> None:
    while True:
        st = os.stat(directory)
        sticky = bool(st.st_mode & stat.S_ISVTX)
        if not _trusted_owner(st.st_uid) and not sticky:
            raise ManifestError(
                ErrorCode.manifest_unsafe_permissions, f"{directory} is owned by another user"
            )
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not sticky:
            raise ManifestError(
                ErrorCode.manifest_unsafe_permissions,
                f"{directory} is writable by other users and has no sticky bit",
            )
        parent = os.path.dirname(directory)
        if parent == directory:
            return
        directory = parent


def read_manifest(path: str, max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[bytes, str]:
    """(the exact bytes, their SHA-256 hex) or ManifestError with a stable code."""
    if not os.path.isabs(path):
        raise ManifestError(ErrorCode.manifest_not_absolute, "the manifest path must be absolute")
    fd = _open(path)
    try:
        st = os.fstat(fd)
        _check_file(st)
        _check_parents(path)
        if st.st_size > max_bytes:
            raise ManifestError(
                ErrorCode.manifest_too_large, f"the manifest is {st.st_size} bytes; the limit is {max_bytes}"
            )
        data = _read_capped(fd, max_bytes)
        after = os.fstat(fd)
    finally:
        os.close(fd)
    _check_unchanged(path, st, after, data)
    return data, hashlib.sha256(data).hexdigest()


def _open(path: str) -> int:
    """One descriptor on the file itself: never through a symlink, never a terminal, never blocking."""
    try:
        return os.open(path, OPEN_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ManifestError(ErrorCode.manifest_symlink, "the manifest path is a symbolic link") from None
        if exc.errno == errno.ENOENT:
            raise ManifestError(ErrorCode.manifest_invalid, "no file at the manifest path") from None
        raise ManifestError(
            ErrorCode.manifest_not_regular, f"cannot open the manifest: {exc.strerror}"
        ) from None


def _check_file(st: os.stat_result) -> None:
    """A regular file, owned by the caller or root, not writable by group or others."""
    if not stat.S_ISREG(st.st_mode):
        raise ManifestError(ErrorCode.manifest_not_regular, "the manifest is not a regular file")
    if not _trusted_owner(st.st_uid):
        raise ManifestError(ErrorCode.manifest_unsafe_permissions, "the manifest is owned by another user")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ManifestError(
            ErrorCode.manifest_unsafe_permissions, "the manifest is writable by group or others"
        )


def _read_capped(fd: int, max_bytes: int) -> bytes:
    """At most max_bytes + 1 bytes: one more than allowed is enough to know the file grew too large."""
    chunks, total = [], 0
    while total <= max_bytes:
        try:
            chunk = os.read(fd, max_bytes + 1 - total)
        except BlockingIOError:
            raise ManifestError(ErrorCode.manifest_not_regular, "the manifest would block on read") from None
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    data = b"".join(chunks)
    if len(data) > max_bytes:
        raise ManifestError(ErrorCode.manifest_too_large, f"the manifest is over {max_bytes} bytes")
    return data


def _check_unchanged(path: str, st: os.stat_result, after: os.stat_result, data: bytes) -> None:
    """The path still names the file that was read, and the file did not change while it was read."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except OSError:
        raise ManifestError(
            ErrorCode.manifest_changed, "the manifest path changed while it was read"
        ) from None
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or (after.st_size, after.st_mtime_ns) != (
        st.st_size,
        st.st_mtime_ns,
    ):
        raise ManifestError(ErrorCode.manifest_changed, "the manifest changed while it was read")
    if len(data) != after.st_size:
        raise ManifestError(ErrorCode.manifest_changed, "the manifest changed while it was read")
