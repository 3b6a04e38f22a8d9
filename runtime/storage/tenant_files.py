"""The tenant store: where a tenant's uploads are received and its files kept, on the backend's disk
(the default) or in an S3-compatible bucket, behind one interface. The scheduler writes it (parts,
commits, deletes); the trainer reads a file by its id when a run names it.

Where, by one setting (`ITO_FILE_STORE_URL`): "" is `<data dir>/tenant-files`, an absolute path a
shared filesystem, `s3://bucket/prefix` a bucket (its endpoint `ITO_S3_ENDPOINT_URL`, credentials
botocore's chain, as the checkpoint store's).

Layout under the root, per account (the account and ids come from the service's own records,
never from a path a tenant wrote):

    <account>/uploads/<upload id>/<path>   what an upload has received so far (its parts appended)
    <account>/files/<file id>              a committed data file, immutable

On disk every file and directory is the service user's alone (0600 / 0700) and is opened below the
root component by component with O_NOFOLLOW (runtime/storage/confined.py). In a bucket the
upload's files arrive by presigned PUT (the client sends them straight to the store) and a commit
copies the object to its file key; reads go through a temporary copy on the reader's disk.
"""

import contextlib
import os
import pathlib
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol
from urllib.parse import urlparse

from runtime.configuration.settings import ENV_FILE_STORE_URL
from runtime.storage import confined, s3_objects
from runtime.storage.confined import Confined

PRESIGN_EXPIRES_S = 900  # a presigned PUT is good this long (S3 checks it when the PUT starts, so a long
# PUT still ends); asking the upload again makes another. Whatever a PUT leaves after its upload is
# over is swept once every URL of it has run out (services/scheduler/uploads.py, SWEEP_AFTER_S).
COPY_BLOCK = 4 * 1024 * 1024


class StoreError(Exception):
    """What the store cannot do, in a sentence safe to show (no path of the server's)."""


class TenantStore(Protocol):
    """A tenant's uploads and files, by account and id (see the module docstring)."""

    remote: bool

    def received(self, account: str, upload_id: str, path: str) -> int:
        """The bytes of `path` the upload holds so far (0: nothing yet)."""
        ...

    def write(self, account: str, upload_id: str, path: str, offset: int, data: bytes) -> int:
        """Append `data` at `offset`, which must be what is received (an earlier offset: nothing
        is written, the answer says what is there). The bytes received after."""
        ...

    def presign(self, account: str, upload_id: str, path: str, size: int) -> tuple[str, datetime] | None:
        """A presigned PUT for the file (a bucket), or None (parts over the API)."""
        ...

    def version(self, account: str, upload_id: str, path: str) -> str:
        """What identifies the bytes received for `path` now ("" where they cannot change once
        complete: a local file takes no write past its size; a bucket's object: its ETag)."""
        ...

    @contextlib.contextmanager
    def opened_upload(self, account: str, upload_id: str, path: str, version: str = "") -> Iterator[int]:
        """A read-only descriptor of what the upload received for `path` (that `version` of it)."""
        ...

    def keep(self, account: str, upload_id: str, path: str, file_id: str, version: str = "") -> None:
        """Make the upload's `path` (that `version` of it: the one checked) the file `file_id`,
        immutable from now on."""
        ...

    @contextlib.contextmanager
    def opened_file(self, account: str, file_id: str) -> Iterator[int]:
        """A read-only descriptor of the file `file_id`."""
        ...

    def delete_file(self, account: str, file_id: str) -> None: ...

    def drop_upload(self, account: str, upload_id: str) -> None:
        """Remove whatever the upload received (committed files stay)."""
        ...


def _name(value: str) -> str:
    """An account or an id as one path component (they come from our records; checked anyway)."""
    confined.parts(value)
    if "/" in value:
        raise StoreError("an account or id is one name")
    return value


class LocalStore:
    """The tenant store on a filesystem this process mounts."""

    remote = False

    def __init__(self, root: pathlib.Path) -> None:
        self.root = pathlib.Path(root)

    def _root_fd(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True, mode=confined.DIR_MODE)
        return confined.open_root(self.root)

    def _upload_rel(self, account: str, upload_id: str, path: str) -> str:
        confined.parts(path)
        return f"{_name(account)}/uploads/{_name(upload_id)}/{path}"

    def received(self, account: str, upload_id: str, path: str) -> int:
        try:
            fd = confined.open_file(self.root, self._upload_rel(account, upload_id, path))
        except Confined as exc:
            if exc.reason == "missing":
                return 0
            raise StoreError(f"{path} cannot be read back") from None
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)

    def write(self, account: str, upload_id: str, path: str, offset: int, data: bytes) -> int:
        rel = self._upload_rel(account, upload_id, path)
        root = self._root_fd()
        try:
            parent = confined.make_dirs(root, rel.rsplit("/", 1)[0])
            os.close(parent)
            fd = confined.open_file(root, rel, os.O_WRONLY | os.O_CREAT)
        except Confined:  # the store's own layout is never in an answer: the tenant's path only
            raise StoreError(
                f"{path} cannot be written (another of the upload's paths is in its way)"
            ) from None
        finally:
            os.close(root)
        try:
            size = os.fstat(fd).st_size
            if offset != size:
                return size
            view = memoryview(data)
            at = offset
            while view:
                n = os.pwrite(fd, view, at)
                view, at = view[n:], at + n
            return at
        finally:
            os.close(fd)

    def presign(self, account: str, upload_id: str, path: str, size: int) -> tuple[str, datetime] | None:
        return None

    def version(self, account: str, upload_id: str, path: str) -> str:
        return ""

    @contextlib.contextmanager
    def opened_upload(self, account: str, upload_id: str, path: str, version: str = "") -> Iterator[int]:
        try:
            fd = confined.open_file(self.root, self._upload_rel(account, upload_id, path))
        except Confined as exc:
            raise StoreError(f"the upload has no file {path}") from exc
        try:
            yield fd
        finally:
            os.close(fd)

    def keep(self, account: str, upload_id: str, path: str, file_id: str, version: str = "") -> None:
        root = self._root_fd()
        try:
            source = confined.open_dir(root, self._upload_rel(account, upload_id, path).rsplit("/", 1)[0])
            target = confined.make_dirs(root, f"{_name(account)}/files")
        except Confined:
            raise StoreError(f"{path} cannot be kept") from None
        finally:
            os.close(root)
        try:
            os.rename(path.rsplit("/", 1)[-1], _name(file_id), src_dir_fd=source, dst_dir_fd=target)
            os.fsync(target)
        except OSError as exc:
            raise StoreError(f"the upload could not be kept ({exc.strerror})") from None
        finally:
            os.close(source)
            os.close(target)

    @contextlib.contextmanager
    def opened_file(self, account: str, file_id: str) -> Iterator[int]:
        try:
            fd = confined.open_file(self.root, f"{_name(account)}/files/{_name(file_id)}")
        except Confined as exc:
            raise StoreError(f"no file {file_id} in the store") from exc
        try:
            yield fd
        finally:
            os.close(fd)

    def delete_file(self, account: str, file_id: str) -> None:
        try:
            directory = confined.open_dir(self.root, f"{_name(account)}/files")
        except Confined:
            return
        try:
            os.unlink(_name(file_id), dir_fd=directory)
        except FileNotFoundError:
            pass
        finally:
            os.close(directory)

    def drop_upload(self, account: str, upload_id: str) -> None:
        try:
            directory = confined.open_dir(self.root, f"{_name(account)}/uploads")
        except Confined:
            return
        try:
            _remove_tree(directory, _name(upload_id))
        finally:
            os.close(directory)


def _remove_tree(parent: int, name: str) -> None:
    """`name` below the directory `parent` and everything in it, never following a link."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent)
    except NotADirectoryError:
        os.unlink(name, dir_fd=parent)
        return
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=parent)
        return
    try:
        for entry in os.listdir(fd):
            _remove_tree(fd, entry)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=parent)


@dataclass(frozen=True, slots=True)
class BucketStore:
    """The tenant store in an S3-compatible bucket: `prefix` under `bucket`."""

    bucket: str
    prefix: str
    endpoint: s3_objects.Endpoint
    spool: pathlib.Path  # where a read's temporary copy goes (the reader's own disk)
    max_bytes: int = 1 << 40
    remote = True

    def _key(self, account: str, *rest: str) -> str:
        for part in rest:
            confined.parts(part)
        return "/".join(p for p in (self.prefix, _name(account), *rest) if p)

    def received(self, account: str, upload_id: str, path: str) -> int:
        found = s3_objects.head(self.endpoint, self.bucket, self._key(account, "uploads", upload_id, path))
        return found[0] if found is not None else 0

    def write(self, account: str, upload_id: str, path: str, offset: int, data: bytes) -> int:
        raise StoreError("this store takes uploads by presigned PUT, not in parts")

    def presign(self, account: str, upload_id: str, path: str, size: int) -> tuple[str, datetime] | None:
        key = self._key(account, "uploads", upload_id, path)
        return s3_objects.presign_put(self.endpoint, self.bucket, key, size, PRESIGN_EXPIRES_S)

    def version(self, account: str, upload_id: str, path: str) -> str:
        found = s3_objects.head(self.endpoint, self.bucket, self._key(account, "uploads", upload_id, path))
        return found[1] if found is not None else ""

    @contextlib.contextmanager
    def _spooled(self, key: str, version: str = "") -> Iterator[int]:
        self.spool.mkdir(parents=True, exist_ok=True, mode=confined.DIR_MODE)
        fd, name = tempfile.mkstemp(dir=self.spool, prefix=".spool-")
        os.unlink(name)  # the copy has no name: it goes with the descriptor
        try:
            try:
                s3_objects.get_into(self.endpoint, self.bucket, key, fd, self.max_bytes, if_match=version)
            except s3_objects.S3Error as exc:
                raise StoreError(str(exc).replace(f"s3://{self.bucket}/{key}", "the object")) from None
            os.lseek(fd, 0, os.SEEK_SET)
            yield fd
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def opened_upload(self, account: str, upload_id: str, path: str, version: str = "") -> Iterator[int]:
        with self._spooled(self._key(account, "uploads", upload_id, path), version) as fd:
            yield fd

    def keep(self, account: str, upload_id: str, path: str, file_id: str, version: str = "") -> None:
        """The checked version only (a PUT after the check makes the copy fail: nothing unchecked
        becomes a file)."""
        source = self._key(account, "uploads", upload_id, path)
        try:
            s3_objects.copy(
                self.endpoint, self.bucket, source, self._key(account, "files", file_id), if_match=version
            )
            s3_objects.delete(self.endpoint, self.bucket, source)
        except s3_objects.S3Error as exc:
            raise StoreError("the upload could not be kept in the bucket") from exc

    @contextlib.contextmanager
    def opened_file(self, account: str, file_id: str) -> Iterator[int]:
        with self._spooled(self._key(account, "files", file_id)) as fd:
            yield fd

    def delete_file(self, account: str, file_id: str) -> None:
        s3_objects.delete(self.endpoint, self.bucket, self._key(account, "files", file_id))

    def drop_upload(self, account: str, upload_id: str) -> None:
        client = s3_objects.client(self.endpoint)
        prefix = self._key(account, "uploads", upload_id) + "/"
        try:
            listed = client.list_objects_v2(Bucket=self.bucket, Prefix=prefix, MaxKeys=1000)
            for obj in listed.get("Contents", []):
                client.delete_object(Bucket=self.bucket, Key=obj["Key"])
        except Exception:  # best effort: an expired upload's leftovers are swept again later
            return


def open_store(url: str, data_dir: pathlib.Path, endpoint_url: str = "") -> TenantStore:
    """The store `url` names (see the module docstring); ValueError in a sentence for anything else."""
    if not url:
        return LocalStore(data_dir / "tenant-files")
    parsed = urlparse(url)
    if parsed.scheme == "" and os.path.isabs(url):
        return LocalStore(pathlib.Path(url))
    if parsed.scheme == "s3" and parsed.netloc and not parsed.query:
        return BucketStore(
            bucket=parsed.netloc,
            prefix=parsed.path.strip("/"),
            endpoint=s3_objects.Endpoint(endpoint_url=endpoint_url),
            spool=data_dir / "spool",
        )
    raise ValueError(f"{ENV_FILE_STORE_URL} must be an absolute path or s3://bucket/prefix, got {url!r}.")
