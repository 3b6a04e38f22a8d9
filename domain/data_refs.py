"""What a manifest's data `source` (and a `run:` base model) names, read from the text alone: pure,
so the planner, the trainer and the tests agree on it, and so a source that is not the tenant's is
refused before anything on the server is touched (no answer then depends on what exists there).

    builtin:pydoc_topics, generated:<name>   the backend's own corpora
    upload:file-<hex>, upload:sha256:<hex>   one of the account's uploads, by id or by its digest
    s3://bucket/key  (+ `connection: NAME`)  an object read through one of the account's connections
    file:/abs/path                           a file under the account's operator-configured root:
                                             `<file root>/<account>/...` (off unless configured)

A `run:` base names the account's own run and stage: `run:<run id>/<stage>`.
"""

import enum
import posixpath
import re

from contracts.files import FILE_ID_PREFIX

FILE_ID = re.compile(rf"^{FILE_ID_PREFIX}[0-9a-f]{{24}}$")
DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
RUN_BASE = re.compile(r"^run:(run_[0-9a-f]{24})/([a-z_]{1,32})$")
S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
MAX_S3_KEY = 1024


class SourceKind(enum.StrEnum):
    builtin = "builtin"
    generated = "generated"
    upload = "upload"
    file = "file"
    s3 = "s3"


TENANT_KINDS = frozenset({SourceKind.upload, SourceKind.file, SourceKind.s3})
"""Sources a tenant brings: checked at plan time, resolved into the work item, read by locator."""


def kind_of(source: str) -> SourceKind | None:
    """The kind a source string names, or None for a source no backend reads."""
    if source.startswith("s3://"):
        return SourceKind.s3
    scheme, sep, _ = source.partition(":")
    if not sep:
        return None
    try:
        return SourceKind(scheme)
    except ValueError:
        return None


def is_tenant(source: str) -> bool:
    return kind_of(source) in TENANT_KINDS


def upload_target(source: str) -> tuple[str | None, str | None]:
    """(file id, digest): what an `upload:` source names (one of the two); (None, None) when it is
    not a well-formed one."""
    rest = source.removeprefix("upload:")
    if FILE_ID.fullmatch(rest):
        return rest, None
    if DIGEST.fullmatch(rest):
        return None, rest
    return None, None


def s3_target(source: str) -> tuple[str, str] | None:
    """(bucket, key) of an `s3://bucket/key` source, or None when it is not a plain one."""
    rest = source.removeprefix("s3://")
    bucket, sep, key = rest.partition("/")
    if not sep or not S3_BUCKET.fullmatch(bucket) or not key or len(key) > MAX_S3_KEY:
        return None
    if key.endswith("/") or any(c in key for c in "\0\n\r"):
        return None
    return bucket, key


def file_below_root(source: str, root: str | None, account: str) -> str | None:
    """The path of a `file:` source relative to the account's root (`<root>/<account>`), judged on
    the text alone: None when there is no root, the path is not absolute and normal, or it is not
    below the account's root. The file is then opened from the root down, never by this text."""
    if root is None:
        return None
    path = source.removeprefix("file:")
    if not path.startswith("/") or posixpath.normpath(path) != path or "\0" in path:
        return None
    base = posixpath.join(posixpath.normpath(root), account)
    if not path.startswith(base + "/"):
        return None
    return path[len(base) + 1 :]


def run_base(base: str) -> tuple[str, str] | None:
    """(run id, stage) of a `run:<run id>/<stage>` base, or None."""
    m = RUN_BASE.fullmatch(base)
    return (m[1], m[2]) if m else None


def suffix_format(source: str) -> str | None:
    """The format a source's name says (".jsonl" -> jsonl, ".parquet" -> parquet), or None."""
    name = source.rsplit("/", 1)[-1].lower()
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    return None
