"""A run's tenant data, read the way the scheduler resolved it and nothing else: each of the
manifest's own data refs (an upload, a `file:` ref under the account's root, an `s3://` object
through the account's connection) is copied into the run's directory (`inputs/`) from its locator
in the signed work item (`TrainWork.inputs`), hashing it on the way, and used only if its bytes
are the digest the scheduler checked and the person confirmed. The stages then read those copies;
no path a manifest wrote is ever opened here, and a ref the work item does not resolve fails the
run before any GPU time (a work item from before inputs were carried names its files by path).

Reads are confined: an upload through the tenant store (runtime/storage/tenant_files.py),
a `file:` ref below `<file root>/<account>` component by component with O_NOFOLLOW, an object with
the connection's credential, which never leaves this process. A copy already in `inputs/` whose
digest is right is kept (a resumed run does not read its data again).
"""

import contextlib
import hashlib
import os
import pathlib
import tempfile
from collections.abc import Iterator

from contracts.files import DataInput, InputKind
from contracts.manifest import DataFormat, Manifest
from contracts.runs import TrainWork
from domain import data_refs
from runtime.configuration.settings import Settings
from runtime.storage import confined, data_connections, s3_objects, tenant_files

INPUTS_DIR = "inputs"
COPY_BLOCK = 4 * 1024 * 1024
SUFFIX = {DataFormat.jsonl: ".jsonl", DataFormat.parquet: ".parquet", DataFormat.text: ".txt"}
Local = dict[str, tuple[pathlib.Path, DataFormat]]
"""A ref's name -> its copy in the run's directory and its format."""


class InputsUnavailable(Exception):
    """A tenant data ref that cannot be read as resolved; the message is safe to show (the ref's
    name and what is wrong, never a server path or a credential)."""


def _digest_of(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(COPY_BLOCK):
            h.update(block)
    return "sha256:" + h.hexdigest()


def _copy(source: int, target: pathlib.Path) -> str:
    """`source` (from its start) into `target` by a temporary name; its sha256."""
    os.lseek(source, 0, os.SEEK_SET)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".in-")
    h = hashlib.sha256()
    try:
        with os.fdopen(os.dup(source), "rb") as src, os.fdopen(fd, "wb") as dst:
            while block := src.read(COPY_BLOCK):
                h.update(block)
                dst.write(block)
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return "sha256:" + h.hexdigest()


class Reader:
    """Opens a resolved input where it lives (see the module docstring)."""

    def __init__(self, settings: Settings, account: str) -> None:
        self.settings = settings
        self.account = account
        self._store: tenant_files.TenantStore | None = None

    @property
    def store(self) -> tenant_files.TenantStore:
        if self._store is None:
            self._store = tenant_files.open_store(
                self.settings.file_store_url, self.settings.data_dir, self.settings.s3_endpoint_url
            )
        return self._store

    @contextlib.contextmanager
    def opened(self, item: DataInput) -> Iterator[int]:
        match item.kind:
            case InputKind.upload:
                try:
                    with self.store.opened_file(self.account, item.locator) as fd:
                        yield fd
                except tenant_files.StoreError:
                    raise InputsUnavailable(f"data {item.name!r}: the upload is gone (deleted?)") from None
            case InputKind.file:
                root = self.settings.file_root
                if root is None:
                    raise InputsUnavailable(f"data {item.name!r}: file: refs are not enabled on this trainer")
                try:
                    fd = confined.open_file(root, f"{self.account}/{item.locator}")
                except confined.Confined:
                    raise InputsUnavailable(f"data {item.name!r}: the file is no longer readable") from None
                try:
                    yield fd
                finally:
                    os.close(fd)
            case InputKind.s3:
                yield from self._s3(item)

    def _s3(self, item: DataInput) -> Iterator[int]:
        endpoint = data_connections.endpoint_of(self.settings.secrets_dir, self.account, item.connection)
        if endpoint is None:
            raise InputsUnavailable(f"data {item.name!r}: the connection {item.connection!r} is gone")
        bucket, _, key = item.locator.partition("/")
        spool = self.settings.data_dir / "spool"
        spool.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, name = tempfile.mkstemp(dir=spool, prefix=".s3-")
        os.unlink(name)
        try:
            try:
                s3_objects.get_into(endpoint, bucket, key, fd, max(item.bytes, 0) or 1 << 40)
            except s3_objects.S3Error as exc:
                raise InputsUnavailable(f"data {item.name!r}: {exc}") from None
            os.lseek(fd, 0, os.SEEK_SET)
            yield fd
        finally:
            os.close(fd)


def materialize(work: TrainWork, manifest: Manifest, run_dir: pathlib.Path, settings: Settings) -> Local:
    """Every tenant data ref of the manifest copied into `<run_dir>/inputs/` and checked against
    its resolved digest; InputsUnavailable when one cannot be."""
    resolved = {item.name: item for item in work.inputs}
    wanted = [(i, ref) for i, ref in enumerate(manifest.data) if data_refs.is_tenant(ref.source)]
    if not wanted:
        return {}
    directory = run_dir / INPUTS_DIR
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    reader = Reader(settings, work.account)
    local: Local = {}
    for i, ref in wanted:
        item = resolved.get(ref.name)
        if item is None:
            raise InputsUnavailable(
                f"data {ref.name!r} was not resolved by the scheduler (a work item of an older version): "
                "plan, confirm and train again"
            )
        target = directory / f"{i:03d}{SUFFIX[item.format]}"
        if target.is_file() and not target.is_symlink() and _digest_of(target) == item.digest:
            local[ref.name] = (target, item.format)
            continue
        with reader.opened(item) as fd:
            digest = _copy(fd, target)
        if digest != item.digest:
            target.unlink(missing_ok=True)
            raise InputsUnavailable(
                f"data {ref.name!r} changed since it was planned (its bytes are {digest}, the run was "
                f"confirmed on {item.digest}); nothing trained on it"
            )
        local[ref.name] = (target, item.format)
    return local
