"""Files and directories opened on a tenant's behalf, confined to a root: every component below the
root is opened with O_NOFOLLOW relative to the descriptor of the one before (`openat`), so a link
anywhere on the way is refused, never followed, and no path text is ever resolved by the kernel
from `/`. The root itself is the operator's (the data dir, a configured file root, an allowed
checkpoint storage) and is trusted as configured.

What it owns:
- `parts`: a relative path split into plain names (no absolute path, `..`, `.`, empty part, NUL).
- `open_file`: a regular file below a root, read-only (or as the flags say), as a descriptor.
- `open_dir` / `make_dirs`: a directory below a root; `make_dirs` creates what is missing (0700)
  and refuses a component that exists and is a link, is not a directory, or is not ours (another
  user's, or writable by group or others: someone else could plant a link inside it).

Every refusal is a `Confined` error with a safe message (it names the relative path, never the root)
and a reason a caller can map to its own code.
"""

import errno
import os
import stat

DIR_MODE = 0o700
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Confined(Exception):
    """A path below a root that cannot be opened as asked; `reason` is one of "unsafe" (not a plain
    relative path), "link" (a link or a non-directory on the way), "missing", "not_regular",
    "foreign" (a directory that is not ours alone); the message never names the root."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def parts(relative: str) -> list[str]:
    """The plain names of a relative path; Confined("unsafe") for anything else."""
    if not relative or relative.startswith("/") or "\0" in relative or "\\" in relative:
        raise Confined("unsafe", "the path is not a plain relative path")
    names = relative.split("/")
    if any(name in ("", ".", "..") for name in names):
        raise Confined("unsafe", "the path is not a plain relative path")
    return names


def open_root(root: str | os.PathLike[str]) -> int:
    """The root's own directory descriptor (the operator's path: links in it are the operator's)."""
    try:
        return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise Confined("missing", "the storage root is not there") from exc


def _step(fd: int, name: str, rel: str) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Confined("link", f"{rel} leads through a link or a file") from None
        if exc.errno == errno.ENOENT:
            raise Confined("missing", f"{rel} is not there") from None
        raise Confined("missing", f"{rel} cannot be opened ({exc.strerror})") from None


def open_dir(root: str | os.PathLike[str] | int, relative: str = "") -> int:
    """A descriptor of the directory `relative` below `root` (a path or an open directory)."""
    fd = open_root(root) if not isinstance(root, int) else os.dup(root)
    try:
        for name in parts(relative) if relative else []:
            nxt = _step(fd, name, relative)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_file(
    root: str | os.PathLike[str] | int, relative: str, flags: int = os.O_RDONLY, mode: int = 0o600
) -> int:
    """A descriptor of the regular file `relative` below `root`; with O_CREAT in `flags` it may be
    made (mode `mode`). Its directories must exist (`make_dirs` makes them)."""
    names = parts(relative)
    directory = open_dir(root, "/".join(names[:-1])) if len(names) > 1 else open_dir(root)
    try:
        fd = os.open(names[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=directory)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Confined("link", f"{relative} is a link") from None
        if exc.errno == errno.ENOENT:
            raise Confined("missing", f"{relative} is not there") from None
        raise Confined("missing", f"{relative} cannot be opened ({exc.strerror})") from None
    finally:
        os.close(directory)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise Confined("not_regular", f"{relative} is not a regular file")
    return fd


def _ours(fd: int, rel: str) -> None:
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise Confined("foreign", f"{rel} is not this service's alone (its owner or mode)")


def _root_safe(fd: int) -> None:
    """A root others may write is safe only with the sticky bit (they cannot rename our entries)."""
    st = os.fstat(fd)
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise Confined("foreign", "the storage root may be changed by other users")


def open_trusted_dir(root: str | os.PathLike[str], relative: str = "") -> int:
    """A descriptor of the directory `relative` below `root` through a chain nobody else can
    change: the root is not writable by others (or is sticky) and every directory below it is this
    process's user's alone. Only then may a path through it be used later (a tenant who owned a
    directory on the way could rename it away and put its own tree in its place)."""
    fd = open_root(root)
    try:
        _root_safe(fd)
    except BaseException:
        os.close(fd)
        raise
    return _walk(fd, relative, None)


def make_dirs(root: str | os.PathLike[str] | int, relative: str, mode: int = DIR_MODE) -> int:
    """A descriptor of the directory `relative` below `root`, made (0700) where missing. A component
    that is a link, a file, or a directory not ours alone is refused: nothing is made through it."""
    fd = open_root(root) if not isinstance(root, int) else os.dup(root)
    return _walk(fd, relative, mode)


def _walk(fd: int, relative: str, make: int | None) -> int:
    """From the directory `fd` (this call's to close) down `relative`, each directory made with mode
    `make` where missing (None: none made) and refused unless it is ours alone."""
    try:
        for name in parts(relative) if relative else []:
            if make is not None:
                try:
                    os.mkdir(name, make, dir_fd=fd)
                except FileExistsError:
                    pass
                except OSError as exc:
                    raise Confined("missing", f"{relative} cannot be made ({exc.strerror})") from None
            nxt = _step(fd, name, relative)
            os.close(fd)
            fd = nxt
            _ours(fd, relative)
        return fd
    except BaseException:
        os.close(fd)
        raise
