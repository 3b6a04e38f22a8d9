"""A run's exports: the export area, the export job, its digest, and the chunks a download reads.

Layout, beside the run's checkpoints (runtime/storage/checkpoint_paths.py decides the run's
directory): `<run dir>/exports/<stage>-<format>/` holds the exported files and, written last and
atomically, `EXPORT.json` (stage, format, step, every file's size and SHA-256, the digest). An
export without `EXPORT.json` is not ready and nothing of it can be downloaded.

The export digest, the export id and the path rule are contracts/export_files.py's (the
client checks the same).

The job: the first order of an export starts it in a background thread and answers "pending";
later orders answer "pending" while it runs, then "ready" (from EXPORT.json) or "failed" (once,
with a safe message: the next order starts it again). One job per export at a time: in this
process a dict of running jobs, across the trainers that share the storage a claim file (`JOB`,
created exclusively, its mtime renewed while the job runs; a claim not renewed for
`STALE_CLAIM_S` is a dead trainer's and is taken over).

Download chunks: only files listed in a ready export's EXPORT.json, opened component by component
with O_NOFOLLOW below the export's directory (no absolute path, no `..`, no link anywhere on the
way), at most DOWNLOAD_CHUNK_MAX bytes per chunk.
"""

import errno
import hashlib
import json
import logging
import os
import pathlib
import shutil
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from contracts.errors import ErrorCode
from contracts.evals import StageGate
from contracts.export_files import export_digest, export_id, parse_export_id, safe_relative
from contracts.exports import (
    DOWNLOAD_CHUNK_MAX,
    DownloadChunk,
    DownloadOrder,
    ExportFile,
    ExportFormat,
    ExportOrder,
    ExportView,
)
from contracts.manifest import Manifest
from runtime.messaging.codec import Refusal
from services.trainer import restore
from services.trainer.restore import StageSource, Unavailable

log = logging.getLogger("ito.trainer.exports")

EXPORTS_DIR = "exports"
RECORD = "EXPORT.json"
FAILED = "FAILED.json"
CLAIM = "JOB"
STALE_CLAIM_S = 120.0  # a claim not renewed this long is a dead trainer's (renewed every RENEW_CLAIM_S)
RENEW_CLAIM_S = 15.0
READ_BUFFER = 1 << 20


class ExportRecord(msgspec.Struct, frozen=True, kw_only=True):
    """EXPORT.json: what a ready export holds (internal: an older reader skips new fields)."""

    run_id: str
    stage: str
    format: ExportFormat
    step: int
    files: list[ExportFile]
    bytes: int
    digest: str
    manifest_digest: str = ""


_record_decoder = msgspec.json.Decoder(ExportRecord)


def sha256_file(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_BUFFER):
            h.update(chunk)
    return h.hexdigest()


def describe(directory: pathlib.Path, paths: list[str]) -> list[ExportFile]:
    """Each written file's size and SHA-256, as the export's record lists them."""
    return [
        ExportFile(path=p, bytes=(directory / p).stat().st_size, sha256=sha256_file(directory / p))
        for p in sorted(paths)
    ]


CONTROL_FILES = frozenset({RECORD, FAILED, CLAIM})


def written_files(directory: pathlib.Path) -> list[str]:
    """Every regular file below `directory` (relative, sorted) but the export's own control files
    and temporaries; a link is never listed (nor followed)."""
    found = []
    for here, dirs, names in os.walk(directory, followlinks=False):
        rel = pathlib.Path(here).relative_to(directory)
        dirs[:] = [d for d in dirs if not (pathlib.Path(here) / d).is_symlink()]
        for name in names:
            path = pathlib.Path(here) / name
            if path.is_symlink() or not path.is_file() or name.endswith(".tmp"):
                continue
            if rel == pathlib.Path(".") and name in CONTROL_FILES:
                continue
            found.append(str(rel / name) if rel != pathlib.Path(".") else name)
    return sorted(found)


def _write_atomic(path: pathlib.Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_record(directory: pathlib.Path) -> ExportRecord | None:
    try:
        return _record_decoder.decode((directory / RECORD).read_bytes())
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def view_of(record: ExportRecord) -> ExportView:
    return ExportView(
        run_id=record.run_id,
        stage=record.stage,
        format=record.format,
        state="ready",
        export_id=export_id(record.stage, record.format),
        digest=record.digest,
        files=record.files,
        bytes=record.bytes,
        step=record.step,
    )


# --- opening a listed file without following any link ---


def open_below(root: pathlib.Path, rel: str) -> int:
    """A read-only descriptor of the regular file `rel` below `root`, every component opened with
    O_NOFOLLOW relative to the one before: a link anywhere on the way is refused (`forbidden`)."""
    if not safe_relative(rel):
        raise Refusal(ErrorCode.forbidden, "the path is not a plain relative path inside the export")
    parts = rel.split("/")
    flags_dir = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
    fd = os.open(root, flags_dir)
    try:
        for part in parts[:-1]:
            nxt = os.open(part, flags_dir, dir_fd=fd)
            os.close(fd)
            fd = nxt
        leaf = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise Refusal(ErrorCode.forbidden, "the path leads through a link") from None
        raise Refusal(ErrorCode.export_not_found, "no such file in the export") from None
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(leaf).st_mode):
        os.close(leaf)
        raise Refusal(ErrorCode.forbidden, "not a regular file")
    return leaf


def read_chunk(
    directory: pathlib.Path, run_id: str, export: str, path: str, offset: int, length: int
) -> DownloadChunk:
    """One chunk of one file of a ready export: only a file its record lists, at most
    DOWNLOAD_CHUNK_MAX bytes from `offset` (an offset at or past the end reads nothing)."""
    record = read_record(directory)
    if record is None:
        raise Refusal(ErrorCode.export_not_found, f"export {export} is not ready")
    listed = {f.path: f for f in record.files}
    entry = listed.get(path)
    if entry is None:
        raise Refusal(ErrorCode.export_not_found, f"export {export} has no file {path!r}")
    if offset < 0 or length < 1:
        raise Refusal(ErrorCode.request_invalid, "offset must be >= 0 and length >= 1")
    fd = open_below(directory, path)
    try:
        size = os.fstat(fd).st_size
        if size != entry.bytes:
            raise Refusal(ErrorCode.export_not_found, f"{path} changed since the export was written")
        data = os.pread(fd, min(length, DOWNLOAD_CHUNK_MAX), offset) if offset < size else b""
    finally:
        os.close(fd)
    return DownloadChunk(
        run_id=run_id, export_id=export, path=path, offset=offset, data=data, size=size, sha256=entry.sha256
    )


# --- the job ---


@dataclass(frozen=True, slots=True, kw_only=True)
class Writers:
    """What writes an export: the hfmodel helper's `write_hf_export`, the lora helper's
    `write_peft_adapter`, and the run's tokenizer files (`restore.tokenizer_files`). None: the
    module's own, imported when a job runs (Unavailable, said plainly, when it is not there)."""

    hf: Callable[..., list[ExportFile]] | None = None
    peft: Callable[..., list[ExportFile]] | None = None
    tokenizer_files: Callable[[StageSource, pathlib.Path], Mapping[str, bytes]] = restore.tokenizer_files
    card: Callable[..., Any] | None = None  # hf_export.ModelCard


def _hf_writer(w: Writers) -> tuple[Callable[..., list[ExportFile]], Callable[..., Any]]:
    if w.hf is not None:
        return w.hf, w.card or _CardFields
    hf_export = restore.optional("training.weights.hf_export", "cannot write Hugging Face exports")
    return hf_export.write_hf_export, hf_export.ModelCard


def _peft_writer(w: Writers) -> Callable[..., list[ExportFile]]:
    if w.peft is not None:
        return w.peft
    lora = restore.optional("training.weights.lora", "cannot write PEFT adapters")
    return lora.write_peft_adapter


@dataclass(frozen=True, slots=True, kw_only=True)
class _CardFields:
    """The model card's fields when a test's writer takes no card class of its own."""

    run_id: str
    manifest_digest: str
    stage: str
    step: int
    base_model: str | None
    base_digest: str | None
    data: dict[str, str]
    gates: list[tuple[str, bool, str]]


def verdict(gate: StageGate) -> str:
    numbers = ", ".join(
        f"{m.name} {m.value:.4f}" + (f" ({m.op} {m.threshold:.4f})" if m.threshold is not None else "")
        for m in gate.metrics
    )
    return (
        f"{'passed' if gate.passed else 'FAILED'}: {numbers}"
        if numbers
        else ("passed" if gate.passed else "FAILED")
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportJob:
    """One export to write: the stage located, its format, and what its card says."""

    src: StageSource
    fmt: ExportFormat
    directory: pathlib.Path
    manifest_digest: str
    gates: list[StageGate] = field(default_factory=list)
    account: str = ""  # whose run: an hf export becomes that account's model `run:<run id>/<stage>`

    @property
    def export_id(self) -> str:
        return export_id(self.src.stage.name, self.fmt)


def write_export(
    job: ExportJob, store_root: pathlib.Path, writers: Writers, loader: restore.Loader = restore.restore_model
) -> ExportRecord:
    """Write the export's files into its directory, then EXPORT.json (last, atomically)."""
    src = job.src
    if job.fmt is ExportFormat.peft and src.lora is None:
        raise Refusal(ErrorCode.export_not_found, f"stage {src.stage.name} trained no LoRA adapter")
    model, info = loader(src, store_root)
    if job.fmt is ExportFormat.peft:
        base_name = src.base.name if src.base is not None else f"{src.run_id}/{src.stage.name}"
        written = _peft_writer(writers)(model, src.lora, job.directory, base_model=base_name)
    else:
        write, card_type = _hf_writer(writers)
        if src.lora is not None:
            restore.optional("training.weights.lora", "cannot merge LoRA adapters").merge_lora(model)
        tokenizer = writers.tokenizer_files(src, store_root)
        try:
            eos = restore.eos_id_of(restore.load_run_tokenizer(src, store_root))
        except Unavailable:
            eos = None
        card = card_type(
            run_id=src.run_id,
            manifest_digest=job.manifest_digest,
            stage=src.stage.name,
            step=info.step,
            base_model=src.base.name if src.base is not None else None,
            base_digest=src.base.digest if src.base is not None else None,
            data={d.name: d.digest or _shown_source(d.source) for d in src.manifest.data},
            gates=[(g.stage, g.passed, verdict(g)) for g in job.gates],
        )
        state = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
        written = write(
            state,
            src.stage.shape,
            job.directory,
            family=src.base.family if src.base is not None else None,
            tokenizer_files=tokenizer,
            card=card,
            eos_token_id=eos,
        )
    on_disk = written_files(job.directory)
    missing = sorted({f.path for f in written} - set(on_disk))
    if missing:
        raise RuntimeError(f"the writer listed files it did not write: {missing}")
    files = describe(job.directory, on_disk)  # every file written, with our own sums
    record = ExportRecord(
        run_id=src.run_id,
        stage=src.stage.name,
        format=job.fmt,
        step=info.step,
        files=files,
        bytes=sum(f.bytes for f in files),
        digest=export_digest(files),
        manifest_digest=job.manifest_digest,
    )
    register(job, record, store_root)  # before it is ready: then it is a model too
    _write_atomic(job.directory / RECORD, msgspec.json.encode(record))
    return record


def _shown_source(source: str) -> str:
    """A data source as a model card may show it: a `file:` ref's path is the server's, never shown."""
    return "file: (under the account's file root)" if source.startswith("file:") else source


def run_model_name(run_id: str, stage: str) -> str:
    """What a manifest's `model.base` names a run's exported stage by (`run:<run id>/<stage>`)."""
    return f"run:{run_id}/{stage}"


def register(job: ExportJob, record: ExportRecord, store_root: pathlib.Path) -> None:
    """A ready hf export made its account's model `run:<run id>/<stage>` in the model store, so a
    next run can start from it with no operator step (`model.base`, pinned by the export's digest,
    which is the store's content digest of the same files). A stage the store cannot take (a shape
    no family reproduces) stays an export only: the run's user reads why in the trainer's log."""
    if job.fmt is not ExportFormat.hf or not job.account:
        return
    from runtime.storage.model_store import ModelStore, ModelStoreError

    name = run_model_name(record.run_id, record.stage)
    try:
        model = ModelStore(store_root).add(
            job.directory, name=name, owner=job.account, ignore=CONTROL_FILES, link=True
        )
    except ModelStoreError as exc:
        log.warning("export %s of run %s: not a model of the store: %s", job.export_id, record.run_id, exc)
        return
    if model.digest != record.digest:  # the same files, the same digest: a difference is a bug
        log.error(
            "export %s of run %s: the store's digest %s is not the export's",
            job.export_id,
            record.run_id,
            model.digest,
        )


class Exports:
    """The export jobs of one trainer process (one per export directory at a time)."""

    def __init__(
        self,
        store_root: pathlib.Path,
        owner: str,
        writers: Writers | None = None,
        loader: restore.Loader = restore.restore_model,
    ) -> None:
        self.store_root = store_root  # the model store (Settings.model_store): base models, tokenizers
        self.owner = owner  # this trainer's id, written into its claims
        self.writers = writers or Writers()
        self.loader = loader
        self._lock = threading.Lock()
        self._running: dict[pathlib.Path, threading.Thread] = {}

    def order(self, job: ExportJob) -> ExportView:
        """The export's view now; starts its job when none has it."""
        directory = job.directory
        pending = ExportView(
            run_id=job.src.run_id,
            stage=job.src.stage.name,
            format=job.fmt,
            state="pending",
            export_id=job.export_id,
            step=job.src.checkpoint.step,
        )
        if job.fmt is ExportFormat.peft and job.src.lora is None:
            raise Refusal(ErrorCode.export_not_found, f"stage {job.src.stage.name} trained no LoRA adapter")
        with self._lock:
            record = read_record(directory)
            if record is not None:
                return view_of(record)
            if directory in self._running:
                return pending
            failed = self._take_failure(directory)
            if failed is not None:
                return msgspec.structs.replace(pending, state="failed", message=failed)
            if not self._claim(directory):
                return pending  # another trainer's job has it
            thread = threading.Thread(
                target=self._run, args=(job,), name=f"export-{job.export_id}", daemon=True
            )
            self._running[directory] = thread
            thread.start()
        return pending

    def _take_failure(self, directory: pathlib.Path) -> str | None:
        """A failed job's message, said once: the marker goes, and the next order starts anew."""
        try:
            message = str(json.loads((directory / FAILED).read_text())["message"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        (directory / FAILED).unlink(missing_ok=True)
        return message

    def _claim(self, directory: pathlib.Path) -> bool:
        """Take the export's claim (a stale one is taken over); the directory is emptied first."""
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        claim = directory / CLAIM
        try:
            if time.time() - claim.stat().st_mtime < STALE_CLAIM_S:
                return False
            log.warning("export %s: taking over a stale claim", directory.name)
            claim.unlink(missing_ok=True)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({"owner": self.owner, "at": time.time()}))
        for child in directory.iterdir():  # a dead job's partial files
            if child.name != CLAIM:
                shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
        return True

    def _run(self, job: ExportJob) -> None:
        directory = job.directory
        done = threading.Event()
        renew = threading.Thread(target=self._renew, args=(directory / CLAIM, done), daemon=True)
        renew.start()
        started = time.monotonic()
        try:
            record = write_export(job, self.store_root, self.writers, self.loader)
            log.info(
                "export %s of run %s: %d files, %d bytes in %.1f s",
                job.export_id,
                job.src.run_id,
                len(record.files),
                record.bytes,
                time.monotonic() - started,
            )
        except Exception as exc:  # a failed export is recorded state, said once to the next order
            message = _safe_message(exc)
            log.warning(
                "export %s of run %s failed: %s", job.export_id, job.src.run_id, message, exc_info=True
            )
            try:
                _write_atomic(directory / FAILED, json.dumps({"message": message}).encode())
            except OSError:
                log.exception("export %s: could not record the failure", job.export_id)
        finally:
            done.set()
            (directory / CLAIM).unlink(missing_ok=True)
            with self._lock:
                self._running.pop(directory, None)

    @staticmethod
    def _renew(claim: pathlib.Path, done: threading.Event) -> None:
        while not done.wait(RENEW_CLAIM_S):
            try:
                os.utime(claim)
            except OSError:
                return

    def wait_idle(self, timeout: float) -> bool:
        """Every running job finished within `timeout` (tests)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                threads = list(self._running.values())
            if not threads:
                return True
            for t in threads:
                t.join(max(0.0, deadline - time.monotonic()))
            if time.monotonic() >= deadline:
                with self._lock:
                    return not self._running


def _safe_message(exc: Exception) -> str:
    """A sentence safe to show: our own refusals and unavailabilities verbatim, anything else by type."""
    if isinstance(exc, Refusal):
        return exc.message
    if isinstance(exc, Unavailable):
        return str(exc)
    return f"the export failed ({type(exc).__name__}); the trainer's log has the details"


# --- the trainer's endpoints (worker.py's thin handlers call these) ---

_manifest_decoder = msgspec.json.Decoder(Manifest)


def decode_manifest(text: str) -> Manifest:
    if not text:
        raise Refusal(ErrorCode.export_not_found, "the order carries no manifest (an older scheduler)")
    try:
        return _manifest_decoder.decode(text.encode())
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise Refusal(ErrorCode.export_not_found, "the run's manifest could not be read") from None


def answer_export(exports: Exports, local_root: pathlib.Path, order: ExportOrder) -> ExportView:
    """TRAINER_EXPORT: the export's view now (its job started by the first order)."""
    run = restore.owned_run_dir(local_root, order.storage, order.account, order.run_id)
    src = restore.locate(run, order.run_id, decode_manifest(order.manifest_text), order.base, order.stage)
    job = ExportJob(
        src=src,
        fmt=order.format,
        directory=run / EXPORTS_DIR / export_id(src.stage.name, order.format),
        manifest_digest=order.manifest_digest,
        gates=list(order.gates),
        account=order.account,
    )
    return exports.order(job)


def answer_download(local_root: pathlib.Path, order: DownloadOrder) -> DownloadChunk:
    """TRAINER_DOWNLOAD: one chunk of a ready export's listed file."""
    if parse_export_id(order.export_id) is None:
        raise Refusal(
            ErrorCode.export_not_found, f"no export {order.export_id!r} (an id is <stage>-<format>)"
        )
    run = restore.owned_run_dir(local_root, order.storage, order.account, order.run_id)
    directory = run / EXPORTS_DIR / order.export_id
    if directory.is_symlink() or not directory.is_dir():
        raise Refusal(ErrorCode.export_not_found, f"export {order.export_id} is not there; run export first")
    return read_chunk(directory, order.run_id, order.export_id, order.path, order.offset, order.length)
