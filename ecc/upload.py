"""`ecc ito files upload PATH` and `ecc ito models upload DIR`: a tenant's own data or checkpoint into
the backend, in bounded, resumable, digest-checked parts (contracts/files.py).

Each file is hashed here first (its SHA-256 and size are what the upload declares); the upload is
begun, or resumed when the same upload is open (the server says how much of each file it holds);
each file goes from that offset in parts of at most UPLOAD_CHUNK_MAX bytes, each part its own
bounded call retried with backoff when its answer is lost (a part the server has already is not
written twice), or, where the store is a bucket, in one HTTP PUT to the presigned URL the server
gave. Then the upload is committed and its check waited for: the answer is the file (its id, the
digest, its rows) or the model, or every problem the check found, each at its line or row. Run the
same command again after an interruption: it resumes where the server stopped receiving.
"""

import asyncio
import hashlib
import os
import pathlib
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from contracts.endpoints import API
from contracts.envelope import Envelope
from contracts.errors import ErrorCode
from contracts.files import (
    MAX_UPLOAD_FILES,
    UPLOAD_CHUNK_MAX,
    FilePurpose,
    UploadCommitRequest,
    UploadedFile,
    UploadFile,
    UploadKind,
    UploadPartAck,
    UploadPartRequest,
    UploadRequest,
    UploadSession,
    UploadView,
)
from contracts.manifest import DataFormat
from ecc.transport import Client, SentButUnanswered, local_error

PART_RETRIES = 4  # a part whose answer was lost is sent again this often (backoff 0.5 s, 1 s, 2 s, 4 s)
BACKOFF_S = 0.5
CHECK_POLL_S = 1.0  # while the server checks the upload, its state is asked this often
DEFAULT_CHECK_WAIT_S = 600.0  # how long `files upload` waits for the check (a GB of JSONL: tens of s)
PUT_TIMEOUT_S = 3600.0  # one presigned PUT of a whole file
HASH_BLOCK = 4 * 1024 * 1024
MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".jinja", ".md")
"""The files of a Hugging Face directory a model upload sends: config, weights, tokenizer, card."""


class UploadFailed(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True, slots=True)
class Local:
    """A file to send: where it is here, where it goes, its size and digest."""

    path: pathlib.Path
    relative: str
    bytes: int
    sha256: str


def hashed(path: pathlib.Path, relative: str) -> Local:
    """The file's size and SHA-256, read once (a regular file; the user's own)."""
    digest, size = hashlib.sha256(), 0
    try:
        with path.open("rb") as f:
            if not os.path.isfile(path):
                raise UploadFailed(ErrorCode.request_invalid, f"{path} is not a regular file")
            while block := f.read(HASH_BLOCK):
                digest.update(block)
                size += len(block)
    except OSError as exc:
        raise UploadFailed(ErrorCode.request_invalid, f"cannot read {path}: {exc.strerror}") from None
    return Local(path=path, relative=relative, bytes=size, sha256="sha256:" + digest.hexdigest())


def model_files(directory: pathlib.Path) -> list[tuple[pathlib.Path, str]]:
    """A Hugging Face directory's files a model upload sends: (path here, relative path)."""
    if not directory.is_dir():
        raise UploadFailed(ErrorCode.request_invalid, f"{directory} is not a directory")
    found = []
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory).as_posix()
        if any(part.startswith(".") for part in rel.split("/")) or not path.is_file():
            continue
        if path.is_symlink():
            raise UploadFailed(ErrorCode.request_invalid, f"{rel} is a symbolic link; copy the file in")
        if path.name.endswith(MODEL_FILE_SUFFIXES):
            found.append((path, rel))
    if not found:
        raise UploadFailed(
            ErrorCode.request_invalid, f"{directory} holds no model files (config.json, *.safetensors)"
        )
    if len(found) > MAX_UPLOAD_FILES:
        raise UploadFailed(ErrorCode.request_invalid, f"{directory} holds more than {MAX_UPLOAD_FILES} files")
    return found


Progress = Callable[[int, int], None]


def stderr_progress(total: int) -> Progress:
    """A line on stderr now and then while parts go: what a person waiting wants to see."""
    last = [0.0]

    def report(sent: int, _total: int) -> None:
        now = time.monotonic()
        if sys.stderr.isatty() and (now - last[0] > 0.5 or sent == total):
            last[0] = now
            print(f"\ruploaded {sent / 2**20:,.1f} of {total / 2**20:,.1f} MiB", end="", file=sys.stderr)
            if sent == total:
                print(file=sys.stderr)

    return report


class Sender:
    """One connection; each call bounded by `timeout_s`; a lost answer is asked again."""

    def __init__(self, client: Client, timeout_s: float) -> None:
        self.client, self.timeout_s = client, timeout_s

    async def call(self, verb: str, req: Any, retries: int = 0) -> Any:
        for attempt in range(retries + 1):
            self.client.deadline = time.monotonic() + self.timeout_s  # each call its own bound
            try:
                env = await self.client.call(API[verb], req)
            except SentButUnanswered:
                if attempt == retries:
                    raise UploadFailed(
                        ErrorCode.timeout,
                        "no answer in time; run the same command again: the upload resumes where it stopped",
                    ) from None
                await asyncio.sleep(BACKOFF_S * 2**attempt)
                continue
            if not env.ok:
                assert env.error is not None
                raise UploadFailed(env.error.code, env.error.message)
            return env.data
        raise AssertionError("unreachable")


async def send_parts(
    sender: Sender,
    session: UploadSession,
    local: Local,
    state: UploadedFile,
    progress: Progress,
    sent: list[int],
) -> None:
    """`local` from the offset the server holds, in parts; a part's answer says what it holds."""
    offset = state.received
    with local.path.open("rb") as f:
        while offset < local.bytes:
            f.seek(offset)
            data = f.read(min(UPLOAD_CHUNK_MAX, local.bytes - offset))
            req = UploadPartRequest(
                upload_id=session.upload_id, path=local.relative, offset=offset, data=data
            )
            ack = await sender.call("upload_part", req, retries=PART_RETRIES)
            assert isinstance(ack, UploadPartAck), "upload_part answers an UploadPartAck"
            sent[0] += ack.received - offset
            offset = ack.received
            progress(sent[0], sent[1])


def put_file(url: str, local: Local) -> None:
    """One presigned HTTP PUT of the whole file (a bucket store): exactly its bytes."""
    with local.path.open("rb") as f:
        request = urllib.request.Request(url, data=f, method="PUT")  # type: ignore[arg-type]  # a file streams
        request.add_header("Content-Length", str(local.bytes))
        # urllib's default for a body is a form's type, which a store may parse as a form and empty
        request.add_header("Content-Type", "application/octet-stream")
        try:
            with urllib.request.urlopen(request, timeout=PUT_TIMEOUT_S) as answer:
                if answer.status >= 300:
                    raise UploadFailed(ErrorCode.backend_unavailable, f"the store refused {local.relative}")
        except urllib.error.HTTPError as exc:
            raise UploadFailed(
                ErrorCode.backend_unavailable, f"the store refused {local.relative} (HTTP {exc.code})"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            raise UploadFailed(
                ErrorCode.backend_unavailable, f"the store could not be reached for {local.relative} ({exc})"
            ) from None


async def committed(sender: Sender, upload_id: str, wait_s: float) -> UploadView:
    """Commit, then ask again while the server checks, up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        view = await sender.call("upload_commit", UploadCommitRequest(upload_id=upload_id), retries=2)
        assert isinstance(view, UploadView), "upload_commit answers an UploadView"
        if view.state != "checking" or time.monotonic() > deadline:
            return view
        await asyncio.sleep(CHECK_POLL_S)


async def upload(
    kind: UploadKind,
    name: str,
    files: list[tuple[pathlib.Path, str]],
    connect_timeout_s: float,
    timeout_s: float,
    *,
    purpose: FilePurpose = FilePurpose.train,
    fmt: DataFormat | None = None,
    wait_s: float = DEFAULT_CHECK_WAIT_S,
    progress: Progress | None = None,
) -> Envelope[Any]:
    contacted = False
    try:
        locals_ = [await asyncio.to_thread(hashed, path, rel) for path, rel in files]
        total = sum(f.bytes for f in locals_)
        report = progress or stderr_progress(total)
        req = UploadRequest(
            kind=kind,
            name=name,
            files=[UploadFile(path=f.relative, bytes=f.bytes, sha256=f.sha256) for f in locals_],
            purpose=purpose,
            format=fmt,
        )
        async with Client(connect_timeout_s, timeout_s) as client:
            contacted = True
            sender = Sender(client, timeout_s)
            session = await sender.call("upload", req, retries=2)
            assert isinstance(session, UploadSession), "upload answers an UploadSession"
            states = {f.path: f for f in session.files}
            sent = [sum(states[f.relative].received for f in locals_), total]
            for local in locals_:
                state = states[local.relative]
                if state.received >= local.bytes:
                    continue
                if state.put is not None:
                    await asyncio.to_thread(put_file, state.put.url, local)
                    sent[0] += local.bytes - state.received
                    report(sent[0], total)
                else:
                    await send_parts(sender, session, local, state, report, sent)
            view = await committed(sender, session.upload_id, wait_s)
    except UploadFailed as exc:
        return local_error(exc.code, exc.message, contacted=contacted)
    notice = None
    if view.state == "checking":
        notice = (
            f"still being checked; `ecc ito files list` shows it once it is kept (upload {view.upload_id})"
        )
    elif session.resumed:
        notice = "resumed the upload begun before: only what the server did not hold was sent"
    return Envelope(ok=True, live_api_contacted=True, notice=notice, data=view)
