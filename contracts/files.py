"""A tenant's own inputs, as the API takes them: uploads (data files and Hugging Face checkpoints, in
bounded, resumable, digest-checked parts), the files they become, and what the trainer is told of
each data ref a run reads (`DataInput`, in the signed work item).

An upload names what it will send (each file's relative path, size and SHA-256) when it begins;
the server answers an upload id and how much of each file it has already (so the same command run
again resumes where it stopped), then takes parts in order, and on commit checks every byte
against the declared digest and the content against what a stage can read (every problem at once,
each with its 1-based line or row). A data upload becomes a file (`file-<hex>`, named in a manifest
as `upload:file-<hex>` or `upload:sha256:<hex>`); a model upload becomes a model of the account in
the model store. Where the store is S3, `UploadSession.files[i].url` is a presigned PUT the client
sends the file to instead of parts.

Requests are strict (`Contract`), answers lenient (`Internal`), as everywhere (contracts/base.py).
"""

import enum
from datetime import datetime
from typing import Annotated

import msgspec

from contracts.api import Credential, ModelView
from contracts.base import Contract, Internal
from contracts.manifest import DataFormat

UPLOAD_CHUNK_MAX = 1024 * 1024  # bytes per part: ~1.4 MiB as base64 JSON, under the 2 MiB request cap
MAX_UPLOAD_FILES = 64  # files in one upload: a sharded checkpoint's shards, config and tokenizer files
MAX_PROBLEMS = 100  # problems an upload's check reports; the count says how many more there were
FILE_ID_PREFIX = "file-"
UPLOAD_ID_PREFIX = "up-"

Sha256 = Annotated[str, msgspec.Meta(pattern=r"^sha256:[0-9a-f]{64}$")]
RelativePath = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
DisplayName = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Size = Annotated[int, msgspec.Meta(ge=0, le=1 << 50)]


class UploadKind(enum.StrEnum):
    data = "data"  # one JSONL or Parquet file: becomes a file the manifest names as upload:<id>
    model = "model"  # a Hugging Face directory: becomes one of the account's models


class FilePurpose(enum.StrEnum):
    train = "train"
    eval = "eval"


class UploadFile(Contract, frozen=True, kw_only=True):
    """One file an upload will send: where it goes (relative, "/"-separated), its size and digest."""

    path: RelativePath
    bytes: Size
    sha256: Sha256


class UploadRequest(Contract, frozen=True, kw_only=True):
    """Begin (or resume) an upload: the same account, kind, name and files as an upload still open
    answer that upload, with what it has received so far."""

    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    kind: UploadKind = UploadKind.data
    name: DisplayName  # a data file's name as the user knows it; a model's name in the manifest
    files: Annotated[list[UploadFile], msgspec.Meta(min_length=1, max_length=MAX_UPLOAD_FILES)]
    purpose: FilePurpose = FilePurpose.train
    format: DataFormat | None = None  # a data upload's format; None: from the name's suffix


class PresignedPut(Internal, frozen=True, kw_only=True):
    """Where an S3 store takes a file directly: an HTTP PUT of exactly its bytes, with these headers."""

    url: str
    headers: dict[str, str] = {}
    expires_at: datetime


class UploadedFile(Internal, frozen=True, kw_only=True):
    path: str
    bytes: int
    sha256: str
    received: int  # bytes the server holds of it: the next part's offset
    put: PresignedPut | None = None  # an S3 store: send the file here instead of in parts


class UploadSession(Internal, frozen=True, kw_only=True):
    upload_id: str
    kind: UploadKind
    name: str
    state: str  # "uploading", "checking", "ready", "rejected"
    files: list[UploadedFile]
    chunk_max: int = UPLOAD_CHUNK_MAX
    expires_at: datetime | None = None  # an upload not committed by then is removed
    resumed: bool = False  # an upload of the same files was open: this is it


class UploadPartRequest(Contract, frozen=True, kw_only=True):
    """`length(data)` bytes of file `path` of the upload, from `offset` (the server's `received`)."""

    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    upload_id: Annotated[str, msgspec.Meta(max_length=64)]
    path: RelativePath
    offset: Annotated[int, msgspec.Meta(ge=0)]
    data: Annotated[bytes, msgspec.Meta(min_length=1, max_length=UPLOAD_CHUNK_MAX)]


class UploadPartAck(Internal, frozen=True, kw_only=True):
    upload_id: str
    path: str
    received: int


class UploadCommitRequest(Contract, frozen=True, kw_only=True):
    """Check what was sent and make it a file (or a model). Idempotent: asked again, it answers the
    upload's state (`checking` until the check is over, then `ready` or `rejected`)."""

    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    upload_id: Annotated[str, msgspec.Meta(max_length=64)]


class DataReport(Internal, frozen=True, kw_only=True):
    """What a data file's check found (runtime/storage/data_checks.py): its bytes and
    digest, its rows, the kinds of row every row is (`text`, `messages`, `preference`,
    `verifiable`) and every problem, each starting with its 1-based "line N" or "row N"."""

    format: DataFormat
    bytes: int
    sha256: str
    rows: int
    kinds: list[str] = []
    columns: list[str] = []
    problems: list[str] = []
    more_problems: int = 0  # problems found past MAX_PROBLEMS


class FileView(Internal, frozen=True, kw_only=True):
    """One of the account's files: what a manifest names (`upload:<file_id>`) and what it holds."""

    file_id: str
    name: str
    purpose: FilePurpose
    format: DataFormat
    bytes: int
    sha256: str
    rows: int
    kinds: list[str] = []  # the stages' row kinds every row is of
    created_at: datetime
    columns: list[str] = []  # the columns of its rows
    source: str = ""  # "upload:<file_id>": what a manifest's data ref names


class UploadView(Internal, frozen=True, kw_only=True):
    """An upload's state after commit: `checking`, then `ready` with what it became (a file or a
    model), or `rejected` with why (every problem of a data file, each at its line or row)."""

    upload_id: str
    kind: UploadKind
    state: str
    file: FileView | None = None
    model: ModelView | None = None
    problems: list[str] = []
    more_problems: int = 0
    message: str | None = None


class FilesRequest(Contract, frozen=True, kw_only=True):
    """`ecc ito files list`: the account's files, newest first."""

    credential: Credential | None = None  # optional: the account comes from the authenticated subject


class FileList(Internal, frozen=True, kw_only=True):
    files: list[FileView]
    uploads: list[UploadSession] = []  # uploads begun and not yet ready: resume or let them expire


class FileRequest(Contract, frozen=True, kw_only=True):
    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    file_id: Annotated[str, msgspec.Meta(max_length=64)]


class FileDeleteRequest(Contract, frozen=True, kw_only=True):
    """A separate, confirmed, idempotent mutation (`ecc ito confirm --action delete_file --file ID`)."""

    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    file_id: Annotated[str, msgspec.Meta(max_length=64)]
    confirmation_ref: str | None = None
    idempotency_key: str


class FileDeleted(Internal, frozen=True, kw_only=True):
    file_id: str
    bytes: int  # what the account's store holds less now
    replay: bool = False
    idempotency_key: str = ""


class ConnectionsRequest(Contract, frozen=True, kw_only=True):
    """`ecc ito connections`: the named connections the operator made for this account."""

    credential: Credential | None = None  # optional: the account comes from the authenticated subject


class ConnectionView(Internal, frozen=True, kw_only=True):
    name: str  # what a data ref's `connection` names
    kind: str  # "s3"
    endpoint: str = ""  # an S3-compatible store's endpoint ("" for AWS); never a credential
    region: str = ""


class ConnectionList(Internal, frozen=True, kw_only=True):
    connections: list[ConnectionView]


class InputKind(enum.StrEnum):
    upload = "upload"  # one of the account's files, in the tenant store
    file = "file"  # a file under the account's operator-configured file root
    s3 = "s3"  # an object read through one of the account's named connections


class DataInput(Internal, frozen=True, kw_only=True):
    """One tenant data ref as the scheduler resolved and checked it, in the signed work item: the
    trainer reads exactly this (by locator, never by a path the manifest wrote) and trains only if
    its bytes are `digest`."""

    name: str  # the manifest's data ref
    kind: InputKind
    locator: str  # upload: the file id; file: the path below the account's root; s3: "bucket/key"
    digest: str
    format: DataFormat
    bytes: int
    connection: str = ""  # s3: the account's connection
