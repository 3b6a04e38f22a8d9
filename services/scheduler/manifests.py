"""Server-side manifest verification: recompute the digest over the exact bytes, parse them
strictly, refuse secrets, and refuse what the trainer could not run (the same `curriculum_of` it
calls). The client's digest is compared, never trusted alone.

Parsing and the secret scan are a pure function of the bytes, so a manifest that passed them is
remembered by its SHA-256 (the digest recomputed here) and not parsed and scanned again: a person
confirms, then trains, with the same reviewed manifest. Whether it can run is not: a base model in
the store or a data file can change between two requests, so the API checks them (and plans the
run) every time, through `ManifestInputs` (services/scheduler/inputs.py), which is cheap (small
files; data-file digests remembered while the file is unchanged).

Bounded in work (issue 39): the checks are bounded by the contract's caps and by manifest_check's
(contracts/manifest_check.py), run off the event loop (`parsed_off_loop`: a worker thread, so
another tenant's `status` is served meanwhile), and a refused manifest is remembered by its digest
for REFUSED_KEPT_S: the same bytes again are refused at once, with the same answer."""

import asyncio
import hashlib
import threading
import time
from collections import OrderedDict

import msgspec

from contracts import manifest_check  # the schema check ecc runs too: one list of problems on both sides
from contracts.errors import ErrorCode
from contracts.manifest import Manifest
from domain.curriculum import curriculum_of
from runtime.messaging.codec import Refusal
from services.scheduler.secret_scan import find_secret

MAX_MANIFEST_BYTES = 1024 * 1024  # 1 MiB, the same cap the client enforces before sending

_decoder = msgspec.json.Decoder(Manifest)
VERIFIED_KEPT = 256  # manifests whose byte checks are remembered by digest (confirm, then train, replays)
_verified: "OrderedDict[str, Manifest]" = OrderedDict()
REFUSED_KEPT = 256  # refused manifests remembered by digest: a burst of one heavy manifest is checked once
REFUSED_KEPT_S = 60.0  # ...for this long (a refusal is a pure function of the bytes; the bound is memory)
_refused: "OrderedDict[str, tuple[float, Refusal]]" = OrderedDict()
_lock = threading.Lock()  # the caches are read on the event loop and written from worker threads


def digest_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def verify(text: str, client_digest: str, max_bytes: int = MAX_MANIFEST_BYTES) -> tuple[Manifest, str]:
    """The parsed manifest and its digest, refused unless it can run as a from-scratch run with no
    inputs to check (the table tests' form; the API checks the inputs too: `Api._planned_request`)."""
    manifest, digest = parsed(text, client_digest, max_bytes)
    try:
        curriculum_of(manifest)  # accepted here means runnable there: the trainer's own guard is this call
    except ValueError as exc:
        raise Refusal(ErrorCode.manifest_invalid, f"the manifest cannot run: {exc}") from None
    return manifest, digest


def parsed(text: str, client_digest: str, max_bytes: int = MAX_MANIFEST_BYTES) -> tuple[Manifest, str]:
    """Size, digest, strict parse and secret scan; remembered by digest."""
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
    known = remembered(digest)
    if known is not None:
        return known, digest
    try:
        manifest = _checked(data)
    except Refusal as refusal:
        with _lock:
            _refused[digest] = (time.monotonic() + REFUSED_KEPT_S, refusal)
            if len(_refused) > REFUSED_KEPT:
                _refused.popitem(last=False)
        raise
    with _lock:
        _verified[digest] = manifest
        if len(_verified) > VERIFIED_KEPT:
            _verified.popitem(last=False)
    return manifest, digest


def remembered(digest: str) -> Manifest | None:
    """The manifest of bytes that passed before (None: never seen); a Refusal raised again for
    bytes refused within REFUSED_KEPT_S."""
    with _lock:
        known = _verified.get(digest)
        if known is not None:  # these exact bytes passed every check below before: they pass again
            _verified.move_to_end(digest)
            return known
        refused = _refused.get(digest)
        if refused is not None:
            until, refusal = refused
            if time.monotonic() < until:
                raise Refusal(refusal.code, refusal.message)
            del _refused[digest]
    return None


async def parsed_off_loop(text: str, client_digest: str) -> tuple[Manifest, str]:
    """`parsed`, with the checks of bytes not seen before in a worker thread: a manifest's size,
    digest and remembered answer are checked here at once (microseconds); a new one's parse, walk
    and secret scan (up to ~0.1 s for 1 MiB of pathological JSON) do not hold the event loop."""
    data = text.encode("utf-8")
    if len(data) <= MAX_MANIFEST_BYTES and digest_of(data) == client_digest:
        known = remembered(client_digest)
        if known is not None:
            return known, client_digest
    return await asyncio.to_thread(parsed, text, client_digest)


def _checked(data: bytes) -> Manifest:
    """Parse strictly and refuse secrets: a pure function of the bytes."""
    try:
        untyped = msgspec.json.decode(data)
    except msgspec.DecodeError:  # where it stops being JSON, as line and column
        _, problems = manifest_check.check(data.decode("utf-8", "replace"))
        raise Refusal(ErrorCode.manifest_invalid, manifest_check.message(problems)) from None
    except RecursionError:
        raise Refusal(ErrorCode.manifest_invalid, "the manifest is nested too deeply") from None
    finding = find_secret(untyped)
    if finding is not None:
        raise Refusal(ErrorCode.manifest_contains_secret, f"{finding}; remove it (the value is not shown)")
    try:
        manifest = _decoder.decode(data)
    except msgspec.ValidationError:  # every problem, each with its path, line and column, not the first
        _, problems = manifest_check.check(data.decode("utf-8"))
        raise Refusal(ErrorCode.manifest_invalid, manifest_check.message(problems)) from None
    return manifest
