"""What the scheduler knows of a `file:` or `s3://` data ref at plan time: the file's digest, its
rows, the kinds of row and every problem (runtime/storage/data_checks.py, in a child
process), remembered while the file is the same, so a person who plans, confirms and trains reads
it once. Uploads need none of this: they were checked when committed, and their record says it.

A `file:` ref is opened below `<file root>/<account>` component by component with O_NOFOLLOW
(runtime/storage/confined.py), never by the path the manifest wrote; it is the same file
while its (device, inode, size, mtime) are. An `s3://` ref is read through the account's named
connection into a spool file of the scheduler's own; it is the same object while its ETag and size
are. Both are bounded: at most PLAN_CHECK_MAX_BYTES (bigger data is uploaded: an upload is checked
once, at its commit, however large), one check per file at a time however many plans ask.
"""

import asyncio
import os
import pathlib
import tempfile
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from contracts.files import DataReport
from contracts.manifest import DataFormat
from runtime.storage import confined, data_checks, data_connections, s3_objects

PLAN_CHECK_MAX_BYTES = 1 << 30  # a file: or s3:// ref read at plan time; larger data is uploaded
FACTS_KEPT = 1024  # files whose check is remembered


@dataclass(frozen=True, slots=True)
class Facts:
    """A data file as the scheduler found it: its report, or why there is none (`unreadable`:
    a sentence about the tenant's own file or object; never a server path)."""

    report: DataReport | None = None
    unreadable: str | None = None


Key = tuple[object, ...]


class DataFacts:
    def __init__(
        self,
        file_root: pathlib.Path | None,
        secrets_dir: pathlib.Path,
        spool: pathlib.Path,
        slots: data_checks.CheckSlots | None = None,
    ) -> None:
        self.slots = slots if slots is not None else data_checks.CheckSlots()  # shared with uploads
        self.file_root = file_root
        self.secrets_dir = secrets_dir
        self.spool = spool
        self._kept: OrderedDict[Key, Facts] = OrderedDict()
        self._running: dict[Key, asyncio.Future[Facts]] = {}

    async def _once(self, key: Key, make: Callable[[], Awaitable[Facts]]) -> Facts:
        """The facts of `key`: remembered, or made once however many ask at the same time (a
        caller that gives up does not stop the check the others wait for)."""
        known = self._kept.get(key)
        if known is not None:
            self._kept.move_to_end(key)
            return known
        running = self._running.get(key)
        if running is None:
            running = asyncio.ensure_future(make())
            self._running[key] = running
            running.add_done_callback(lambda done: self._settle(key, done))
        return await asyncio.shield(running)

    def _settle(self, key: Key, done: "asyncio.Future[Facts]") -> None:
        self._running.pop(key, None)
        if done.cancelled() or done.exception() is not None:
            return
        facts = done.result()
        if facts.report is not None:  # a read that failed is tried again next time
            self._kept[key] = facts
            if len(self._kept) > FACTS_KEPT:
                self._kept.popitem(last=False)

    # --- file: -----------------------------------------------------------------------------------

    async def file(self, account: str, relative: str, fmt: DataFormat) -> Facts:
        """The facts of `<file root>/<account>/<relative>`, opened from the root down."""
        if self.file_root is None:
            return Facts(unreadable="file: refs are not enabled on this backend")
        try:
            fd = await asyncio.to_thread(confined.open_file, self.file_root, f"{account}/{relative}")
        except confined.Confined as exc:
            why = "a link on the way" if exc.reason == "link" else "not a regular file there"
            return Facts(unreadable=f"no readable file ({why if exc.reason != 'missing' else 'none there'})")
        try:
            st = os.fstat(fd)
            if st.st_size > PLAN_CHECK_MAX_BYTES:
                return Facts(unreadable=self._too_large(st.st_size))
            key = ("file", st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, fmt)

            async def make() -> Facts:
                dup = os.dup(fd)  # the check's own descriptor: this call may return before it ends
                try:
                    return await self._checked(account, dup, fmt)
                finally:
                    os.close(dup)

            return await self._once(key, make)
        finally:
            os.close(fd)

    # --- s3:// -----------------------------------------------------------------------------------

    async def s3(self, account: str, connection: str, bucket: str, key: str, fmt: DataFormat) -> Facts:
        """The facts of the object, read through `account`'s connection."""
        endpoint = await asyncio.to_thread(
            data_connections.endpoint_of, self.secrets_dir, account, connection
        )
        if endpoint is None:
            return Facts(unreadable=f"no connection {connection!r} for this account")
        try:
            found = await asyncio.to_thread(s3_objects.head, endpoint, bucket, key)
        except s3_objects.S3Error as exc:
            return Facts(unreadable=str(exc))
        if found is None:
            return Facts(unreadable=f"no object s3://{bucket}/{key} through connection {connection!r}")
        size, etag = found
        if size > PLAN_CHECK_MAX_BYTES:
            return Facts(unreadable=self._too_large(size))
        cache_key = ("s3", account, connection, bucket, key, etag, size, fmt)

        async def make() -> Facts:
            fd = await asyncio.to_thread(self._spool_fd)
            try:
                try:
                    await asyncio.to_thread(
                        s3_objects.get_into, endpoint, bucket, key, fd, PLAN_CHECK_MAX_BYTES
                    )
                except s3_objects.S3Error as exc:
                    return Facts(unreadable=str(exc))
                return await self._checked(account, fd, fmt)
            finally:
                os.close(fd)

        return await self._once(cache_key, make)

    def _spool_fd(self) -> int:
        self.spool.mkdir(parents=True, exist_ok=True, mode=confined.DIR_MODE)
        fd, name = tempfile.mkstemp(dir=self.spool, prefix=".plan-")
        os.unlink(name)
        return fd

    # --- both ------------------------------------------------------------------------------------

    async def _checked(self, account: str, fd: int, fmt: DataFormat) -> Facts:
        try:
            async with self.slots.held(account):
                return Facts(report=await data_checks.run_check(fd, fmt))
        except data_checks.CheckFailed as exc:
            return Facts(unreadable=str(exc))

    @staticmethod
    def _too_large(size: int) -> str:
        return (
            f"{size:,} bytes: a file: or s3:// ref is read at plan time up to {PLAN_CHECK_MAX_BYTES:,} bytes; "
            "upload larger data (`ecc ito files upload`: checked once, when it is committed)"
        )
