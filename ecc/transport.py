"""One bounded request to the scheduler over core NATS, answered as an Envelope.

Every call has a connect timeout and an overall timeout. Failures are values:
- NATS unreachable, or nothing subscribed: `backend_unavailable` (nothing was processed);
- the request was sent but no answer came in time: `timeout`, or for a mutation the caller
  resolves the ambiguity (see `ecc.verbs`).
"""

import asyncio
import os
import time

import msgspec

from contracts.envelope import Envelope
from contracts.errors import ApiError, ErrorCode
from services.runtime.settings import DEFAULT_NAMESPACE, DEFAULT_NATS_URL, ENV_NAMESPACE, ENV_NATS_URL

DEFAULT_CONNECT_TIMEOUT_S = 2.0
DEFAULT_TIMEOUT_S = 15.0  # covers eligibility, plan, confirmation and ledger hops on a busy server

_envelope_decoder = msgspec.json.Decoder(Envelope)
_encoder = msgspec.json.Encoder()


def local_error(code: ErrorCode, message: str, contacted: bool = False) -> Envelope:
    return Envelope(ok=False, live_api_contacted=contacted, notice=None, error=ApiError(code=code, message=message))


class SentButUnanswered(Exception):
    """The request left this process and no answer came back in time: its effect is unknown."""


class Client:
    def __init__(self, connect_timeout_s: float, timeout_s: float) -> None:
        self.url = os.environ.get(ENV_NATS_URL) or DEFAULT_NATS_URL
        self.namespace = os.environ.get(ENV_NAMESPACE) or DEFAULT_NAMESPACE
        self.connect_timeout_s = connect_timeout_s
        self.deadline = time.monotonic() + timeout_s
        self._nc = None

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc) -> None:
        if self._nc is not None:
            try:
                await asyncio.wait_for(self._nc.close(), timeout=1.0)
            except Exception:  # closing is best effort; the process is about to exit
                pass

    async def _connect(self):
        import nats

        if self._nc is None:
            self._nc = await nats.connect(
                self.url,
                connect_timeout=min(self.connect_timeout_s, max(self.remaining(), 0.1)),
                allow_reconnect=False,
                max_reconnect_attempts=0,
                name="ecc",
            )
        return self._nc

    async def call(self, suffix: str, request: msgspec.Struct) -> Envelope:
        """The scheduler's Envelope, a local `backend_unavailable`, or SentButUnanswered."""
        from nats.errors import NoRespondersError, TimeoutError as NatsTimeout

        payload = _encoder.encode(request)
        try:
            nc = await asyncio.wait_for(self._connect(), timeout=max(self.remaining(), 0.1))
        except Exception:  # refused, DNS, timeout: nothing was sent
            return local_error(ErrorCode.backend_unavailable, f"cannot reach the ito-training API at {self.url}")
        remaining = self.remaining()
        if remaining <= 0:
            return local_error(ErrorCode.timeout, "the overall timeout passed before the request was sent")
        try:
            reply = await nc.request(f"{self.namespace}.{suffix}", payload, timeout=remaining)
        except NoRespondersError:
            return local_error(ErrorCode.backend_unavailable, "the ito-training API is not running")
        except (NatsTimeout, asyncio.TimeoutError):
            raise SentButUnanswered() from None
        except Exception as exc:  # connection dropped mid-request, payload too large, ...
            if "maximum payload" in str(exc).lower():
                return local_error(ErrorCode.request_invalid, "the request is larger than the server accepts")
            raise SentButUnanswered() from None
        try:
            return _envelope_decoder.decode(reply.data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return local_error(ErrorCode.internal, "the server's answer could not be read", contacted=True)
