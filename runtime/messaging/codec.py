"""Decode at the edge, answer with an Envelope: the only place raw bytes meet contracts."""

import functools
import logging
from typing import Any, TypeVar

import msgspec
import redis.exceptions

from contracts.envelope import Envelope
from contracts.errors import ApiError, ErrorCode, QuotaBreach
from runtime.configuration.settings import MAX_REQUEST_BYTES

T = TypeVar("T")
log = logging.getLogger("ito.codec")

_encoder = msgspec.json.Encoder()
_envelope_decoder = msgspec.json.Decoder(Envelope)


STORE_UNAVAILABLE = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.MasterDownError,
)
"""Redis could not be reached or its cluster is electing a primary: `backend_unavailable`, as
silence from a service is; never `internal`, which would tell a client not to retry."""


class Refusal(Exception):
    """A decision that fails closed: carries a stable code and a message safe to show."""

    def __init__(
        self,
        code: ErrorCode,
        message: str,
        *,
        retry_after_s: float | None = None,
        quota: QuotaBreach | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s  # rate_limited: when a retry can be admitted
        self.quota = quota  # quota_exceeded: which quota, its use and its limit


def redis_text(raw: bytes | str) -> str:
    """A Redis reply as text. Our clients read bytes (decode_responses=False); redis-py's types
    cannot know that and say `bytes | str`."""
    return raw.decode() if isinstance(raw, bytes) else raw


def encode(value: Any) -> bytes:
    return _encoder.encode(value)


def digest(value: Any) -> str:
    """SHA-256 of a contract's encoding (deterministic for equal values of one type)."""
    import hashlib

    return hashlib.sha256(_encoder.encode(value)).hexdigest()


def ok(data: Any, notice: str | None = None) -> bytes:
    return _encoder.encode(Envelope(ok=True, live_api_contacted=True, notice=notice, data=data))


def fail(
    code: ErrorCode, message: str, *, retry_after_s: float | None = None, quota: QuotaBreach | None = None
) -> bytes:
    error = ApiError(code=code, message=message, retry_after_s=retry_after_s, quota=quota)
    return _encoder.encode(Envelope(ok=False, live_api_contacted=True, notice=None, error=error))


def decode_request(raw: bytes, decoder: "msgspec.json.Decoder[T]") -> T:
    """Bytes from the wire into a contract, or a `request_invalid` refusal naming the field."""
    if len(raw) > MAX_REQUEST_BYTES:
        raise Refusal(
            ErrorCode.request_invalid, f"request is {len(raw)} bytes; the limit is {MAX_REQUEST_BYTES}"
        )
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise Refusal(ErrorCode.request_invalid, f"invalid request: {exc}") from None
    except msgspec.DecodeError:
        raise Refusal(ErrorCode.request_invalid, "request is not valid JSON") from None


def decode_envelope(raw: bytes) -> Envelope:
    return _envelope_decoder.decode(raw)


@functools.cache
def _answer_decoder(data_type: Any) -> "msgspec.json.Decoder[Envelope[Any]]":
    return msgspec.json.Decoder(Envelope[data_type])  # type: ignore[valid-type]


def unwrap(raw: bytes, data_type: Any) -> Any:
    """An internal reply: its data decoded as `data_type` in one pass (an endpoint's `answer`, see
    contracts/endpoints.py), or the refusal it carries."""
    env = _answer_decoder(data_type).decode(raw)
    if not env.ok:
        assert env.error is not None, "a failed envelope carries an error"
        error = env.error
        raise Refusal(error.code, error.message, retry_after_s=error.retry_after_s, quota=error.quota)
    return env.data


async def answer(handler, raw: bytes, decoder) -> bytes:
    """Run `handler(request)` on a decoded request; every outcome becomes an Envelope."""
    return (await answer_coded(handler, raw, decoder))[0]


async def answer_coded(handler, raw: bytes, decoder) -> tuple[bytes, ErrorCode | None]:
    """`answer`, and the refusal's code beside the envelope (None when it is ok): the code is known
    here, where the envelope is built, so a counter of refusals never decodes an answer again."""
    try:
        request = decode_request(raw, decoder)
        result = await handler(request)
    except Refusal as refusal:
        return fail(
            refusal.code, refusal.message, retry_after_s=refusal.retry_after_s, quota=refusal.quota
        ), refusal.code
    except STORE_UNAVAILABLE:  # a Redis node lost, a failover under way: a retry is the answer
        log.warning("request failed: the store did not answer", exc_info=True)
        return fail(
            ErrorCode.backend_unavailable,
            "the store did not answer in time; retry with the same idempotency key",
        ), ErrorCode.backend_unavailable
    except Exception:  # an unexpected fault must still answer, without leaking internals
        log.exception("request failed")
        return fail(
            ErrorCode.internal, "internal error; the request changed nothing that was not committed"
        ), ErrorCode.internal
    if isinstance(result, tuple):
        data, notice = result
        return ok(data, notice), None
    return ok(result), None
