"""Server-side manifest verification: recompute the digest over the exact bytes, parse them
strictly, refuse secrets, and refuse what the trainer could not run (the same `plan_run` it
calls). The client's digest is compared, never trusted alone."""

import hashlib

import msgspec

from contracts.errors import ErrorCode
from contracts.manifest import Manifest
from services.domain.curriculum import plan_run
from services.runtime.codec import Refusal
from services.scheduler.secret_scan import find_secret

MAX_MANIFEST_BYTES = 1024 * 1024  # 1 MiB, the same cap the client enforces before sending

_decoder = msgspec.json.Decoder(Manifest)


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def verify(text: str, client_digest: str, max_bytes: int = MAX_MANIFEST_BYTES) -> tuple[Manifest, str]:
    data = text.encode("utf-8")
    if len(data) > max_bytes:
        raise Refusal(
            ErrorCode.manifest_too_large, f"the manifest is {len(data)} bytes; the limit is {max_bytes}"
        )
    digest = digest_of(data)
    if digest != client_digest:
        raise Refusal(
            ErrorCode.manifest_digest_mismatch, "the manifest bytes do not match the digest the client sent"
        )
    try:
        untyped = msgspec.json.decode(data)
    except msgspec.DecodeError:
        raise Refusal(ErrorCode.manifest_invalid, "the manifest is not valid JSON") from None
    except RecursionError:
        raise Refusal(ErrorCode.manifest_invalid, "the manifest is nested too deeply") from None
    finding = find_secret(untyped)
    if finding is not None:
        raise Refusal(ErrorCode.manifest_contains_secret, f"{finding}; remove it (the value is not shown)")
    try:
        manifest = _decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise Refusal(ErrorCode.manifest_invalid, f"invalid manifest: {exc}") from None
    try:
        plan_run(manifest)  # accepted here means runnable there: the trainer's own guard is this call
    except ValueError as exc:
        raise Refusal(ErrorCode.manifest_invalid, f"the manifest cannot run: {exc}") from None
    return manifest, digest
