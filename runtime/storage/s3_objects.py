"""S3-compatible objects, read and written by the services themselves: the tenant store's uploads
when it lives in a bucket (runtime/storage/tenant_files.py) and the objects a tenant's
named connection reaches (runtime/storage/data_connections.py).

botocore's client, which the `s3` extra installs already (s3fs stands on it): a presigned PUT for
an upload, HEAD, a streamed GET into a descriptor (hashed on the way), a server-side copy, a delete.
Every call is bounded: connect and read timeouts, a few retries. Credentials are given (a
connection's, read from its 0600 file) or botocore's own chain (the standard AWS variables or a
shared credentials file, as the checkpoint store's); they are never logged and never leave here.
"""

import hashlib
import os
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 60.0
RETRIES = 3
GET_BLOCK = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Which store and as whom: `endpoint_url` "" for AWS; no keys: botocore's own chain."""

    endpoint_url: str = ""
    region: str = ""
    access_key_id: str = ""
    secret_access_key: str = ""
    session_token: str = ""

    def __repr__(self) -> str:  # a log line or a traceback never shows the keys
        return f"Endpoint(endpoint_url={self.endpoint_url!r}, region={self.region!r})"


class S3Error(Exception):
    """An object that cannot be read or written; the message is safe to show (no credential)."""


QUIET_LOGGERS = ("botocore", "urllib3", "s3transfer")
"""botocore logs requests at DEBUG, credentials and signatures included: never below WARNING here,
whatever level a process's root logger is at."""


def client(endpoint: Endpoint) -> Any:
    import logging

    import botocore.config
    import botocore.session

    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)

    config = botocore.config.Config(
        connect_timeout=CONNECT_TIMEOUT_S,
        read_timeout=READ_TIMEOUT_S,
        retries={"max_attempts": RETRIES, "mode": "standard"},
        signature_version="s3v4",
        s3={"addressing_style": "path"},
    )
    kwargs: dict[str, Any] = {"config": config, "region_name": endpoint.region or "us-east-1"}
    if endpoint.endpoint_url:
        kwargs["endpoint_url"] = endpoint.endpoint_url
    if endpoint.access_key_id:
        kwargs["aws_access_key_id"] = endpoint.access_key_id
        kwargs["aws_secret_access_key"] = endpoint.secret_access_key
        if endpoint.session_token:
            kwargs["aws_session_token"] = endpoint.session_token
    return botocore.session.get_session().create_client("s3", **kwargs)


def _failed(what: str, exc: Exception) -> S3Error:
    code = getattr(exc, "response", {}).get("Error", {}).get("Code", "") if hasattr(exc, "response") else ""
    return S3Error(f"{what}: {code or type(exc).__name__}")


def presign_put(endpoint: Endpoint, bucket: str, key: str, size: int, expires_s: int) -> tuple[str, datetime]:
    """A URL that takes one HTTP PUT of exactly `size` bytes to `bucket/key`, until it expires."""
    url = client(endpoint).generate_presigned_url(
        "put_object",
        Params={"Bucket": bucket, "Key": key, "ContentLength": size},
        ExpiresIn=expires_s,
        HttpMethod="PUT",
    )
    return url, datetime.now(UTC) + timedelta(seconds=expires_s)


def head(endpoint: Endpoint, bucket: str, key: str) -> tuple[int, str] | None:
    """(size, ETag) of the object, or None when there is none."""
    try:
        meta = client(endpoint).head_object(Bucket=bucket, Key=key)
    except Exception as exc:  # botocore's ClientError and its connection errors
        code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
        if code in ("404", "NoSuchKey", "NotFound"):
            return None
        raise _failed(f"s3://{bucket}/{key} cannot be read", exc) from None
    return int(meta["ContentLength"]), str(meta.get("ETag", ""))


def get_into(
    endpoint: Endpoint, bucket: str, key: str, fd: int, max_bytes: int, if_match: str = ""
) -> tuple[int, str]:
    """The object's bytes written to `fd` from its current offset: (size, "sha256:<hex>"). S3Error
    when it cannot be read, is larger than `max_bytes`, or (with `if_match`) is no longer that
    version (its ETag)."""
    try:
        extra = {"IfMatch": if_match} if if_match else {}
        body = client(endpoint).get_object(Bucket=bucket, Key=key, **extra)["Body"]
    except Exception as exc:
        raise _failed(f"s3://{bucket}/{key} cannot be read", exc) from None
    digest, size = hashlib.sha256(), 0
    try:
        while block := body.read(GET_BLOCK):
            size += len(block)
            if size > max_bytes:
                raise S3Error(f"s3://{bucket}/{key} is larger than {max_bytes} bytes")
            digest.update(block)
            view = memoryview(block)
            while view:
                view = view[os.write(fd, view) :]
    except S3Error:
        raise
    except Exception as exc:
        raise _failed(f"s3://{bucket}/{key} could not be read to its end", exc) from None
    finally:
        body.close()
    return size, "sha256:" + digest.hexdigest()


def copy(endpoint: Endpoint, bucket: str, source: str, target: str, if_match: str = "") -> None:
    """A server-side copy; with `if_match`, only of that version of the source (its ETag): S3
    refuses the copy of another (CopySourceIfMatch), and where a store does not, the copy's own
    ETag (a single PUT's is its bytes' MD5, the same in the copy) says so and the copy is removed."""
    extra = {"CopySourceIfMatch": if_match} if if_match else {}
    try:
        made = client(endpoint).copy_object(
            Bucket=bucket, Key=target, CopySource={"Bucket": bucket, "Key": source}, **extra
        )
    except Exception as exc:
        raise _failed(f"s3://{bucket}/{source} cannot be copied", exc) from None
    copied = str(made.get("CopyObjectResult", {}).get("ETag", ""))
    if if_match and "-" not in if_match and copied and copied != if_match:
        delete(endpoint, bucket, target)
        raise S3Error(f"s3://{bucket}/{source} changed after it was checked")


def delete(endpoint: Endpoint, bucket: str, key: str) -> None:
    try:
        client(endpoint).delete_object(Bucket=bucket, Key=key)
    except Exception as exc:
        raise _failed(f"s3://{bucket}/{key} cannot be removed", exc) from None
