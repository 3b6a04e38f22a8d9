"""A tenant's uploads and files through the API: begin (or resume) an upload, take its parts, commit
it (checked in a child process: digest, every row, every problem at its line), list, show and
delete files (a separate, confirmed, idempotent mutation), and list the account's connections.

Tenant-scoped like every verb: the account is the one the NATS server authenticated; an upload,
file or connection of another account is `data_not_found` with the same words as one that does
not exist. Bounded: a part is at most UPLOAD_CHUNK_MAX bytes and must come at the offset the store
holds; an upload reserves its bytes against the account's quotas when it begins; its check runs
with a time bound and a memory cap, off the event loop, a few at once (`CheckSlots`); an account
has at most MAX_OPEN_UPLOADS uploads open, and beginning one or starting its check spends a token of
its request rate; an upload not committed within `upload_ttl_s` is removed and its reservation given
back (`expire_forever`).

One check of an upload at a time across every scheduler instance: the check (or the expiry) claims
the upload first (`FileRecords.claim`, until its time bound has passed half again), and the file is
recorded only while the reservation is held (`finish` answers False otherwise: the bytes checked
are removed). A bucket's object is checked and kept at its ETag: a PUT after the check makes the
keep fail. Whatever a late presigned PUT leaves once the upload is over is swept SWEEP_AFTER_S
later (every URL of it has run out by then).
"""

import asyncio
import contextlib
import hashlib
import logging
import os
import pathlib
import secrets
import shutil
import sys
import tempfile
from datetime import UTC, datetime, timedelta

import msgspec

from contracts.api import Action
from contracts.errors import ErrorCode
from contracts.files import (
    FILE_ID_PREFIX,
    UPLOAD_ID_PREFIX,
    ConnectionList,
    ConnectionsRequest,
    DataReport,
    FileDeleted,
    FileDeleteRequest,
    FileList,
    FileRequest,
    FilesRequest,
    FileView,
    PresignedPut,
    UploadCommitRequest,
    UploadedFile,
    UploadKind,
    UploadPartAck,
    UploadPartRequest,
    UploadRequest,
    UploadSession,
    UploadView,
)
from contracts.internal import LedgerAccept
from contracts.manifest import DataFormat
from domain import data_refs
from domain import quotas as quota_rules
from runtime.configuration.settings import Settings
from runtime.messaging.codec import Refusal
from runtime.storage import confined, data_checks, data_connections
from runtime.storage.model_store import NAME_RE, AddOutcome, ModelStore
from runtime.storage.tenant_files import PRESIGN_EXPIRES_S, StoreError, TenantStore
from runtime.tenancy.accounts import Credentials
from runtime.tenancy.quota_stores import Quotas
from runtime.tenancy.quota_stores import refusal as rate_refusal
from services.scheduler.account_reads import model_view
from services.scheduler.admission import authenticate, fingerprint, key_conflict, key_refusal
from services.scheduler.file_records import FileRecords, StorageLimits, UploadRecord
from services.scheduler.peers import Peers

log = logging.getLogger("ito.scheduler.uploads")

COMMIT_WAIT_S = 5.0  # a commit answers the check's verdict when it is this quick, else "checking"
CLAIM_FACTOR = (
    1.5  # a check's claim lasts its time bound and half again (an instance that died lets it run out)
)
EXPIRY_CLAIM_S = 120.0  # the expiry's claim: the time to release an upload and remove its bytes
SWEEP_AFTER_S = PRESIGN_EXPIRES_S + 3600  # an over upload's leftovers go once its last PUT has ended
MAX_NAME_BYTES = 255  # one component of an upload's path (the most a file system's name holds)
MODEL_ADD_TIMEOUT_S = 600.0  # checking and storing an uploaded checkpoint (hashing gigabytes)
EXPIRE_EVERY_S = 60.0
_outcome_decoder = msgspec.json.Decoder(AddOutcome)


def not_found(what: str, name: str) -> Refusal:
    return Refusal(ErrorCode.data_not_found, f"no {what} {name!r} for this account")


def spec_of(req: UploadRequest) -> str:
    """An upload's identity while it is open: the same request again is the same upload."""
    fields = (req.kind.value, req.name, req.purpose.value, req.format.value if req.format else "")
    listed = [(f.path, f.bytes, f.sha256) for f in req.files]
    return hashlib.sha256(msgspec.json.encode([fields, listed])).hexdigest()


def paths_refusal(paths: list[str]) -> str | None:
    """Why an upload's paths cannot be its files' (None: they can): each a plain relative path of
    names a file system holds, named once, and none the directory of another."""
    for path in paths:
        try:
            names = confined.parts(path)
        except confined.Confined:
            return f"{path!r} is not a plain relative path"
        if any(len(name.encode()) > MAX_NAME_BYTES for name in names):
            return f"{path!r}: a name in it is longer than {MAX_NAME_BYTES} bytes"
    if len(set(paths)) != len(paths):
        return "an upload names each file once"
    named = set(paths)
    for path in paths:
        names = path.split("/")
        for i in range(1, len(names)):
            if (above := "/".join(names[:i])) in named:
                return f"{above!r} is a file and the directory of {path!r}: name each file once"
    return None


def data_format(req: UploadRequest) -> DataFormat | None:
    """A data upload's format: the one given, else the name's suffix (None: neither says)."""
    if req.format is not None:
        return req.format
    suffix = data_refs.suffix_format(req.files[0].path) or data_refs.suffix_format(req.name)
    return DataFormat(suffix) if suffix else None


def rejection(view: UploadView) -> Refusal:
    """A rejected upload as its refusal: every problem (the first MAX_PROBLEMS), one a line."""
    lines = "\n".join(f"- {p}" for p in view.problems)
    more = f"\n- ... and {view.more_problems} more" if view.more_problems else ""
    head = view.message or "the upload was not kept"
    code = ErrorCode.data_digest_mismatch if "digest" in head else ErrorCode.data_schema_invalid
    return Refusal(code, f"{head}" + (f":\n{lines}{more}" if lines else ""))


class Uploads:
    def __init__(
        self,
        credentials: Credentials,
        records: FileRecords,
        store: TenantStore,
        quotas: Quotas,
        peers: Peers,
        settings: Settings,
        model_store: ModelStore,
        slots: data_checks.CheckSlots | None = None,
    ) -> None:
        self.slots = slots if slots is not None else data_checks.CheckSlots()
        self.owner = secrets.token_hex(8)  # this instance, as the claimant of the checks it runs
        self.credentials = credentials
        self.records = records
        self.store = store
        self.quotas = quotas
        self.peers = peers
        self.settings = settings
        self.model_store = model_store
        self._checks: dict[tuple[str, str], asyncio.Task[None]] = {}  # this instance's checks under way

    async def _account(self, caller: str, req: object) -> str:
        return (await authenticate(self.credentials, caller, req)).account

    async def _rated(self, account: str) -> None:
        """A token of the account's request rate (beginning an upload, starting its check): the
        same bucket plan, confirm and train spend from."""
        refusal = rate_refusal(await self.quotas.take(account, cost=1))
        if refusal is not None:
            raise refusal

    # --- begin, parts -----------------------------------------------------------------------------

    async def upload(self, caller: str, req: UploadRequest) -> UploadSession:
        account = await self._account(caller, req)
        if (why := paths_refusal([f.path for f in req.files])) is not None:
            raise Refusal(ErrorCode.request_invalid, why)
        fmt = None
        if req.kind is UploadKind.data:
            if len(req.files) != 1:
                raise Refusal(ErrorCode.request_invalid, "a data upload is one file")
            fmt = data_format(req)
            if fmt not in (DataFormat.jsonl, DataFormat.parquet):
                raise Refusal(
                    ErrorCode.request_invalid,
                    "a data upload is JSONL or Parquet: name the file .jsonl or .parquet, or give --format",
                )
        elif not NAME_RE.fullmatch(req.name):
            raise Refusal(ErrorCode.request_invalid, "a model's name is 1-256 letters, digits and . _ - /")
        await self._rated(account)
        now = datetime.now(UTC)
        limits = await self.quotas.limits(account)
        record = UploadRecord(
            upload_id=UPLOAD_ID_PREFIX + secrets.token_hex(12),
            account=account,
            kind=req.kind,
            name=req.name,
            purpose=req.purpose,
            format=fmt,
            files=list(req.files),
            created_at=now,
            expires_at=now + timedelta(seconds=self.settings.upload_ttl_s),
            spec=spec_of(req),
        )
        begun, breach = await self.records.begin(
            record, StorageLimits(limits.file_bytes, limits.files, limits.models)
        )
        if begun is None:
            assert breach is not None, "an upload not begun is over a quota"
            raise Refusal(
                ErrorCode.quota_exceeded, quota_rules.storage_message(breach, record.bytes), quota=breach
            )
        return await self._session(begun, resumed=begun.upload_id != record.upload_id)

    async def _session(self, record: UploadRecord, resumed: bool = False) -> UploadSession:
        files = []
        for f in record.files:
            try:
                received = await asyncio.to_thread(
                    self.store.received, record.account, record.upload_id, f.path
                )
            except StoreError:  # what is there cannot be read back: send it again
                received = 0
            put = None
            if self.store.remote and received < f.bytes:
                signed = await asyncio.to_thread(
                    self.store.presign, record.account, record.upload_id, f.path, f.bytes
                )
                if signed is not None:
                    put = PresignedPut(url=signed[0], expires_at=signed[1])
            files.append(
                UploadedFile(path=f.path, bytes=f.bytes, sha256=f.sha256, received=received, put=put)
            )
        return UploadSession(
            upload_id=record.upload_id,
            kind=record.kind,
            name=record.name,
            state=record.state,
            files=files,
            expires_at=record.expires_at,
            resumed=resumed,
        )

    async def _open(self, account: str, upload_id: str) -> UploadRecord:
        record = await self.records.upload(account, upload_id)
        if record is None:
            raise not_found("upload", upload_id)
        return record

    async def upload_part(self, caller: str, req: UploadPartRequest) -> UploadPartAck:
        account = await self._account(caller, req)
        record = await self._open(account, req.upload_id)
        if record.state != "uploading":
            raise Refusal(ErrorCode.request_invalid, f"the upload is {record.state}; it takes no more parts")
        declared = {f.path: f for f in record.files}.get(req.path)
        if declared is None:
            raise Refusal(ErrorCode.request_invalid, f"the upload has no file {req.path!r}")
        if req.offset + len(req.data) > declared.bytes:
            raise Refusal(
                ErrorCode.request_invalid,
                f"{req.path} is {declared.bytes} bytes; this part goes past its end",
            )
        try:
            received = await asyncio.to_thread(
                self.store.write, account, req.upload_id, req.path, req.offset, req.data
            )
        except StoreError as exc:
            raise Refusal(ErrorCode.request_invalid, str(exc)) from None
        if req.offset > received:
            raise Refusal(
                ErrorCode.request_invalid, f"{req.path}: the store holds {received} bytes; send from there"
            )
        return UploadPartAck(upload_id=req.upload_id, path=req.path, received=received)

    # --- commit -----------------------------------------------------------------------------------

    async def upload_commit(self, caller: str, req: UploadCommitRequest) -> UploadView:
        account = await self._account(caller, req)
        record = await self._open(account, req.upload_id)
        if record.state == "expired":
            raise Refusal(
                ErrorCode.upload_incomplete,
                "the upload expired before it was committed and was removed; upload the file again",
            )
        if record.state == "uploading":
            await self._rated(account)
            for f in record.files:
                got = await asyncio.to_thread(self.store.received, account, record.upload_id, f.path)
                if got != f.bytes:
                    raise Refusal(
                        ErrorCode.upload_incomplete,
                        f"{f.path}: {got:,} of {f.bytes:,} bytes received; send the rest, then commit",
                    )
            record = msgspec.structs.replace(record, state="checking", message=None)
            await self.records.save(record)
        if record.state == "checking":
            task = self._checking(record)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), COMMIT_WAIT_S)
            record = await self._open(account, req.upload_id)
        view = await self._view(record)
        if view.state == "rejected":
            raise rejection(view)
        return view

    def _checking(self, record: UploadRecord) -> asyncio.Task[None]:
        """This instance's check of the upload, started when none runs here."""
        key = (record.account, record.upload_id)
        task = self._checks.get(key)
        if task is None or task.done():
            check = self._check_data if record.kind is UploadKind.data else self._store_model
            task = asyncio.create_task(self._guarded(record, check))
            self._checks[key] = task
            task.add_done_callback(lambda _t: self._checks.pop(key, None))
        return task

    async def _guarded(self, record: UploadRecord, check) -> None:
        now = datetime.now(UTC).timestamp()
        bound = data_checks.time_bound(record.bytes)
        if record.kind is UploadKind.model:
            bound += MODEL_ADD_TIMEOUT_S
        if not await self.records.claim(record, self.owner, now, now + bound * CLAIM_FACTOR):
            return  # another instance checks it (or it is over): the commit answers what it finds
        try:
            await check(record)
        except Exception as exc:  # the check itself failed: the upload is rejected, its quota given back
            log.warning("upload %s: check failed", record.upload_id, exc_info=True)
            message = (
                str(exc) if isinstance(exc, data_checks.CheckFailed | StoreError) else "the check failed"
            )
            await self._reject(record, message, [])

    async def _reject(self, record: UploadRecord, message: str, problems: list[str], more: int = 0) -> None:
        rejected = msgspec.structs.replace(
            record, state="rejected", message=message, problems=problems, more_problems=more
        )
        if await self.records.release(rejected):
            await self._over(record)

    async def _over(self, record: UploadRecord) -> None:
        """An upload that is over: its bytes removed now, and again once its last PUT has ended."""
        await asyncio.to_thread(self.store.drop_upload, record.account, record.upload_id)
        await self.records.later(
            record.account, record.upload_id, datetime.now(UTC).timestamp() + SWEEP_AFTER_S
        )

    async def _check_data(self, record: UploadRecord) -> None:
        declared = record.files[0]
        fmt = record.format or DataFormat.jsonl
        version = await asyncio.to_thread(self.store.version, record.account, record.upload_id, declared.path)
        async with self.slots.held(record.account):
            with self.store.opened_upload(record.account, record.upload_id, declared.path, version) as fd:
                report: DataReport = await data_checks.run_check(fd, fmt)
        if report.sha256 != declared.sha256 or report.bytes != declared.bytes:
            await self._reject(
                record,
                f"the bytes received are not the ones declared (their digest is {report.sha256}, "
                f"{report.bytes:,} bytes; declared {declared.sha256}, {declared.bytes:,} bytes): upload again",
                [],
            )
            return
        if report.problems or report.more_problems:
            count = len(report.problems) + report.more_problems
            await self._reject(
                record,
                f"{declared.path} was not kept: {count} problem{'s' if count > 1 else ''}",
                report.problems,
                report.more_problems,
            )
            return
        file_id = FILE_ID_PREFIX + secrets.token_hex(12)
        await asyncio.to_thread(
            self.store.keep, record.account, record.upload_id, declared.path, file_id, version
        )
        file = FileView(
            file_id=file_id,
            name=record.name,
            purpose=record.purpose,
            format=fmt,
            bytes=report.bytes,
            sha256=report.sha256,
            rows=report.rows,
            kinds=report.kinds,
            columns=report.columns,
            created_at=datetime.now(UTC),
            source=f"upload:{file_id}",
        )
        if not await self.records.finish(
            msgspec.structs.replace(record, state="ready", file_id=file_id), file
        ):
            log.warning("upload %s: released while it was checked; its file is removed", record.upload_id)
            await asyncio.to_thread(self.store.delete_file, record.account, file_id)
            return
        await self._over(record)
        log.info("upload %s: file %s kept (%d rows)", record.upload_id, file_id, report.rows)

    async def _store_model(self, record: UploadRecord) -> None:
        """The upload's files gathered in a directory of their own (each checked against its
        digest), then checked and stored as the account's model by a child process."""
        scratch = pathlib.Path(tempfile.mkdtemp(dir=self._scratch(), prefix="model-"))
        try:
            for f in record.files:
                await asyncio.to_thread(self._gather, record, f.path, f.sha256, scratch)
            async with self.slots.held(record.account):
                outcome = await self._add_model(scratch, record)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if outcome.model is None:
            await self._reject(record, f"the model was not kept: {outcome.error}", [])
            return
        if not await self.records.finish(
            msgspec.structs.replace(record, state="ready", model=record.name), None
        ):
            log.warning("upload %s: released while its model was stored", record.upload_id)
            return
        await self._over(record)

    def _scratch(self) -> pathlib.Path:
        where = self.settings.data_dir / "spool"
        where.mkdir(parents=True, exist_ok=True, mode=0o700)
        return where

    def _gather(self, record: UploadRecord, path: str, sha256: str, scratch: pathlib.Path) -> None:
        target = scratch / path
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        digest = hashlib.sha256()
        with self.store.opened_upload(record.account, record.upload_id, path) as fd:
            os.lseek(fd, 0, os.SEEK_SET)
            with os.fdopen(os.dup(fd), "rb") as src, open(target, "wb") as dst:
                while block := src.read(4 << 20):
                    digest.update(block)
                    dst.write(block)
        if "sha256:" + digest.hexdigest() != sha256:
            raise StoreError(f"{path}: the bytes received are not the ones declared; upload again")

    async def _add_model(self, directory: pathlib.Path, record: UploadRecord) -> AddOutcome:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "runtime.storage.model_store",
            "add",
            "--root",
            str(self.model_store.root),
            "--owner",
            record.account,
            "--name",
            record.name,
            str(directory),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=data_checks._limits,
        )
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), MODEL_ADD_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()
            return AddOutcome(error=f"checking it took longer than {MODEL_ADD_TIMEOUT_S:.0f} s")
        try:
            return _outcome_decoder.decode(out)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return AddOutcome(error="the check failed")

    async def _view(self, record: UploadRecord) -> UploadView:
        file = await self.records.file(record.account, record.file_id) if record.file_id else None
        model = None
        if record.model is not None:
            found = await asyncio.to_thread(self.model_store.resolve, record.model, record.account)
            model = model_view(found) if found is not None else None
        return UploadView(
            upload_id=record.upload_id,
            kind=record.kind,
            state=record.state,
            file=file,
            model=model,
            problems=record.problems,
            more_problems=record.more_problems,
            message=record.message,
        )

    # --- files ------------------------------------------------------------------------------------

    async def files(self, caller: str, req: FilesRequest) -> FileList:
        account = await self._account(caller, req)
        uploads = [await self._session(r) for r in await self.records.open_uploads(account)]
        return FileList(files=await self.records.files(account), uploads=uploads)

    async def file(self, caller: str, req: FileRequest) -> FileView:
        account = await self._account(caller, req)
        found = await self.records.file(account, req.file_id)
        if found is None:
            raise not_found("file", req.file_id)
        return found

    async def file_delete(self, caller: str, req: FileDeleteRequest) -> tuple[FileDeleted, str | None]:
        """A confirmed, idempotent delete: the key's earlier delete answers a replay."""
        account = await self._account(caller, req)
        if (refusal := key_refusal(req.idempotency_key)) is not None:
            raise refusal
        action, target = Action.delete_file, req.file_id
        expected = fingerprint(action, account, target, "")
        existing = await self.peers.ledger_lookup(account, req.idempotency_key)
        if existing is not None:
            if existing.fingerprint != expected:
                raise key_conflict()
            return (
                FileDeleted(file_id=target, bytes=0, replay=True, idempotency_key=req.idempotency_key),
                "replay: this idempotency key already deleted this file",
            )
        found = await self.records.file(account, target)
        if found is None:
            raise not_found("file", target)
        if not req.confirmation_ref:
            raise Refusal(
                ErrorCode.confirmation_required,
                f"run `ecc ito confirm --action delete_file --file {target}` first and pass its reference",
            )
        await self.peers.resolve_confirmation(account, req.confirmation_ref, action, target, None, None)
        entry = await self.peers.ledger_accept(
            LedgerAccept(
                account=account,
                idempotency_key=req.idempotency_key,
                fingerprint=expected,
                run_id=target,
                action=action,
                confirmation_ref=req.confirmation_ref,
                target=target,
            )
        )
        if entry.fingerprint != expected:
            raise key_conflict()
        removed = await self.records.delete(account, target)
        await asyncio.to_thread(self.store.delete_file, account, target)
        log.info("file %s deleted", target)
        size = removed.bytes if removed is not None else found.bytes
        return FileDeleted(file_id=target, bytes=size, idempotency_key=req.idempotency_key), None

    async def connections(self, caller: str, req: ConnectionsRequest) -> ConnectionList:
        account = await self._account(caller, req)
        listed = await asyncio.to_thread(data_connections.listed, self.settings.secrets_dir, account)
        return ConnectionList(connections=listed)

    # --- expiry -----------------------------------------------------------------------------------

    async def expire_once(self, now: float | None = None) -> int:
        """The uploads due a look: an open one past its expiry is removed and its quota given back
        (unless a live check holds it: next time), an over one's leftovers swept; how many."""
        at = now if now is not None else datetime.now(UTC).timestamp()
        due = await self.records.expired(at)
        for account, upload_id in due:
            record = await self.records.upload(account, upload_id)
            if record is None:
                await self.records.later(account, upload_id, None)
            elif record.state not in ("uploading", "checking"):  # over: what a late PUT left goes
                await asyncio.to_thread(self.store.drop_upload, account, upload_id)
                await self.records.later(account, upload_id, None)
            elif await self.records.claim(record, self.owner, at, at + EXPIRY_CLAIM_S):
                expired = msgspec.structs.replace(record, state="expired", message="not committed in time")
                if await self.records.release(expired):
                    await self._over(record)
        return len(due)

    async def expire_forever(self) -> None:
        while True:
            try:
                await self.expire_once()
            except Exception:  # the store or Redis is away: try again next time
                log.warning("upload expiry failed", exc_info=True)
            await asyncio.sleep(EXPIRE_EVERY_S)
