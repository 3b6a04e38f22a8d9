"""`ecc ito download RUN [--export ID] --to DIR`: a ready export onto this machine, checked.

The export's file list and digest come from the server (`export`, idempotent: a ready export
answers at once). Each file is fetched in chunks of at most DOWNLOAD_CHUNK_MAX into `<name>.part`,
appended from the size the `.part` already has (so an interrupted download resumes), and renamed
to its name only when complete and its SHA-256 is the one the export lists; a chunk that does not
belong (another offset, file size or digest) or a file whose digest does not match is refused and
its `.part` removed. At the end the export digest is recomputed from the files on disk and
compared. Every chunk call is bounded by `--timeout`; a chunk whose answer was lost is asked again
up to CHUNK_RETRIES times with backoff (a read: asking again changes nothing). Files are 0600 in a
0700 directory; an existing file that differs from the export's is never overwritten.
"""

import asyncio
import hashlib
import os
import pathlib
import time
from typing import Any

from contracts.endpoints import API
from contracts.envelope import Envelope
from contracts.errors import ErrorCode
from contracts.export_files import export_digest, parse_export_id, safe_relative
from contracts.exports import (
    DOWNLOAD_CHUNK_MAX,
    DownloadChunk,
    DownloadRequest,
    ExportFile,
    ExportRequest,
    ExportView,
)
from ecc.exports_view import Downloaded
from ecc.transport import Client, SentButUnanswered, local_error

CHUNK_RETRIES = 3  # a lost chunk answer is asked again this often (backoff 0.5 s, 1 s, 2 s)
BACKOFF_S = 0.5
PART = ".part"


class DownloadFailed(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def sha256_of(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def prepare_directory(to: str) -> pathlib.Path:
    """The target directory (made 0700 when new); a link is refused."""
    target = pathlib.Path(to).expanduser().absolute()
    if target.is_symlink():
        raise DownloadFailed(ErrorCode.forbidden, f"{target} is a symbolic link; name a real directory")
    if target.exists() and not target.is_dir():
        raise DownloadFailed(ErrorCode.forbidden, f"{target} exists and is not a directory")
    target.mkdir(parents=True, exist_ok=True, mode=0o700)
    return target


def destination(target: pathlib.Path, rel: str) -> pathlib.Path:
    """Where a listed file goes: below `target`, its parents made 0700, no link on the way."""
    if not safe_relative(rel):
        raise DownloadFailed(ErrorCode.forbidden, f"the export lists an unsafe path {rel!r}; nothing written")
    path = target / rel
    parent = target
    for part in rel.split("/")[:-1]:
        parent = parent / part
        if parent.is_symlink():
            raise DownloadFailed(ErrorCode.forbidden, f"{parent} is a symbolic link; nothing written there")
        parent.mkdir(exist_ok=True, mode=0o700)
    if path.is_symlink() or pathlib.Path(str(path) + PART).is_symlink():
        raise DownloadFailed(ErrorCode.forbidden, f"{path} is a symbolic link; not overwritten")
    return path


def accept_chunk(chunk: DownloadChunk, entry: ExportFile, offset: int) -> bytes:
    """The chunk's bytes when it is the one asked for: this file, this offset, its listed size and
    digest, and no more than the rest of the file."""
    if chunk.path != entry.path or chunk.offset != offset:
        raise DownloadFailed(ErrorCode.internal, f"{entry.path}: the server sent another chunk than asked")
    if chunk.size != entry.bytes or chunk.sha256 != entry.sha256:
        raise DownloadFailed(
            ErrorCode.internal, f"{entry.path}: the file changed on the server; download again"
        )
    if not chunk.data or offset + len(chunk.data) > entry.bytes or len(chunk.data) > DOWNLOAD_CHUNK_MAX:
        raise DownloadFailed(
            ErrorCode.internal, f"{entry.path}: a chunk of the wrong length at offset {offset}"
        )
    return chunk.data


class Fetcher:
    """One connection; each chunk call bounded by `timeout_s`, retried on a lost answer."""

    def __init__(self, client: Client, timeout_s: float, run_id: str, export: str) -> None:
        self.client, self.timeout_s, self.run_id, self.export = client, timeout_s, run_id, export

    async def chunk(self, path: str, offset: int) -> DownloadChunk:
        req = DownloadRequest(run_id=self.run_id, export_id=self.export, path=path, offset=offset)
        for attempt in range(CHUNK_RETRIES + 1):
            self.client.deadline = time.monotonic() + self.timeout_s  # each chunk its own bound
            try:
                env = await self.client.call(API["download"], req)
            except SentButUnanswered:
                if attempt == CHUNK_RETRIES:
                    raise DownloadFailed(
                        ErrorCode.timeout,
                        f"{path}: no answer for the chunk at {offset} after {CHUNK_RETRIES + 1} tries; "
                        "run the same download again to resume",
                    ) from None
                await asyncio.sleep(BACKOFF_S * 2**attempt)
                continue
            if not env.ok:
                assert env.error is not None
                raise DownloadFailed(env.error.code, env.error.message)
            assert isinstance(env.data, DownloadChunk), "download answers a DownloadChunk"
            return env.data
        raise AssertionError("unreachable")


async def fetch_file(fetcher: Fetcher, target: pathlib.Path, entry: ExportFile) -> int:
    """One listed file into place; the bytes fetched (0 when it was there already)."""
    path = destination(target, entry.path)
    if path.exists():
        if path.stat().st_size == entry.bytes and sha256_of(path) == entry.sha256:
            return 0
        raise DownloadFailed(
            ErrorCode.forbidden, f"{path} exists and differs from the export's file; not overwritten"
        )
    part = pathlib.Path(str(path) + PART)
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    fetched = 0
    try:
        offset = os.fstat(fd).st_size
        if offset > entry.bytes:  # not this file's beginning: start again
            os.ftruncate(fd, 0)
            offset = 0
        os.lseek(fd, offset, os.SEEK_SET)
        while offset < entry.bytes:
            data = accept_chunk(await fetcher.chunk(entry.path, offset), entry, offset)
            os.write(fd, data)
            offset += len(data)
            fetched += len(data)
        os.fsync(fd)
    finally:
        os.close(fd)
    if sha256_of(part) != entry.sha256:
        part.unlink()
        raise DownloadFailed(
            ErrorCode.internal, f"{entry.path}: its SHA-256 is not the export's; the partial file was removed"
        )
    os.chmod(part, 0o600)
    os.replace(part, path)
    return fetched


async def export_view(client: Client, run_id: str, export: str | None) -> ExportView:
    """The export's view (`export` is idempotent: a ready one answers at once)."""
    req = ExportRequest(run_id=run_id)
    if export is not None:
        parsed = parse_export_id(export)
        if parsed is None:
            raise DownloadFailed(
                ErrorCode.request_invalid, f"{export!r} is no export id (<stage>-<format>, e.g. sft-hf)"
            )
        req = ExportRequest(run_id=run_id, stage=parsed[0], format=parsed[1])
    try:
        env = await client.call(API["export"], req)
    except SentButUnanswered:
        raise DownloadFailed(ErrorCode.timeout, "no answer in time; nothing was written") from None
    if not env.ok:
        assert env.error is not None
        raise DownloadFailed(env.error.code, env.error.message)
    view = env.data
    assert isinstance(view, ExportView), "export answers an ExportView"
    if view.state != "ready":
        why = f": {view.message}" if view.message else ""
        raise DownloadFailed(
            ErrorCode.export_not_found,
            f"export {view.export_id} is {view.state}{why}; `ecc ito export {run_id}` says when it is ready",
        )
    return view


async def download(
    run_id: str, export: str | None, to: str, connect_timeout_s: float, timeout_s: float
) -> Envelope[Any]:
    contacted = False
    try:
        target = prepare_directory(to)
        async with Client(connect_timeout_s, timeout_s) as client:
            contacted = True
            view = await export_view(client, run_id, export)
            fetcher = Fetcher(client, timeout_s, run_id, view.export_id)
            fetched = 0
            for entry in view.files:
                fetched += await fetch_file(fetcher, target, entry)
        on_disk = [
            ExportFile(path=f.path, bytes=(target / f.path).stat().st_size, sha256=sha256_of(target / f.path))
            for f in view.files
        ]
        digest = export_digest(on_disk)
        if digest != view.digest:
            raise DownloadFailed(
                ErrorCode.internal, f"the files' digest {digest} is not the export's {view.digest}"
            )
    except DownloadFailed as exc:
        return local_error(exc.code, exc.message, contacted=contacted)
    except OSError as exc:
        return local_error(
            ErrorCode.forbidden,
            f"cannot write the download: {exc.strerror} ({exc.filename})",
            contacted=contacted,
        )
    done = Downloaded(
        run_id=run_id,
        export_id=view.export_id,
        directory=str(target),
        digest=digest,
        files=on_disk,
        bytes=sum(f.bytes for f in on_disk),
        fetched_bytes=fetched,
    )
    return Envelope(ok=True, live_api_contacted=True, notice=None, data=done)
