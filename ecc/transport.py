"""One bounded, authenticated request to the scheduler over core NATS, answered as an Envelope.

The connection authenticates with the tenant's NKey (challenge-response: the seed never leaves
this process) and receives replies only under the tenant's own inbox prefix. The request goes to
`<ns>.<verb>.<account>`: the server lets only this account's credential publish there, which is
how the scheduler knows who is asking. No secret is ever in a request. The answer is decoded into
the endpoint's answer type (contracts/endpoints.py) in one pass; an answer that is not one is an
`internal` error, never a guess.

Every call has a connect timeout and an overall timeout. Failures are values:
- the server refuses the credential: `unauthenticated` at login, `credential_revoked` after;
- the server drops the request for lack of permission (a credential of another account):
  `unauthenticated`;
- NATS unreachable, or nothing subscribed: `backend_unavailable` (nothing was processed);
- the server's TLS certificate is not signed by the CA ecc was given (`ecc ito login --ca`,
  ITO_NATS_CA), or none was given, or a CA was given and the server speaks no TLS:
  `tls_untrusted` (nothing was sent);
- the request was sent but no answer came in time: `timeout`, or for a mutation the caller
  resolves the ambiguity (see `ecc.verbs`).
"""

import asyncio
import functools
import os
import time
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from contracts.endpoints import Endpoint
from contracts.envelope import Envelope
from contracts.environment import ENV_NAMESPACE, ENV_NATS_CA
from contracts.errors import ApiError, ErrorCode
from ecc import connection
from ecc.timeouts import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_TIMEOUT_S, RETRY_REFUSED_S

if TYPE_CHECKING:  # nats loads on demand: `--help` must not import it
    from nats.aio.client import Client as NatsClient

_encoder = msgspec.json.Encoder()
Req = TypeVar("Req")
Ans = TypeVar("Ans")


@functools.cache
def answer_decoder(endpoint: Endpoint[Any, Any]) -> "msgspec.json.Decoder[Envelope[Any]]":
    """The Envelope decoder of one endpoint's answer (`data` as `endpoint.answer`), built once."""
    return msgspec.json.Decoder(Envelope[endpoint.answer])  # type: ignore[name-defined]  # a type held in a value


def local_error(code: ErrorCode, message: str, contacted: bool = False) -> Envelope[Any]:
    return Envelope(
        ok=False, live_api_contacted=contacted, notice=None, error=ApiError(code=code, message=message)
    )


class Unauthenticated(Exception):
    """The server does not require authentication: not ours, and not to be trusted with a request."""


class Untrusted(Exception):
    """The server's TLS could not be verified with the CA we hold (the message says why)."""


TLS_HINT = (
    f"set {ENV_NATS_CA}=/path/to/ca.pem or run `ecc ito login --ca /path/to/ca.pem` with the "
    "deployment's CA (`ito-training certs` writes it); nothing was sent"
)


def _quiet_ssl_eof() -> None:
    """asyncio warns on every TLS connection nats-py closes ("returning true from eof_received()
    has no effect when using ssl"): noise on ecc's stderr, not a fault."""
    import logging

    class Quiet(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "eof_received()" not in record.getMessage()

    logging.getLogger("asyncio").addFilter(Quiet())


class SentButUnanswered(Exception):
    """The request left this process and no answer came back in time: its effect is unknown."""


KEY_PREFIX = "ito_sk_"  # an API key is `ito_sk_` + the tenant's NKey seed


def seed_of(api_key: str) -> bytes | None:
    """The NKey seed inside an API key, or None when it is not one."""
    import nkeys

    if not api_key.startswith(KEY_PREFIX):
        return None
    seed = api_key[len(KEY_PREFIX) :].encode()
    try:
        nkeys.from_seed(bytearray(seed))
    except Exception:  # nkeys raises several types for a malformed seed
        return None
    return seed


def tenant_inbox(account: str) -> str:
    return f"_INBOX_t_{account}"  # the same rule as runtime/security/identities.py (ecc imports no service)


def _is_cert_failure(exc: BaseException) -> bool:
    """A failed certificate check, wherever nats-py wraps it (raised as is, or as a cause)."""
    import ssl

    seen: BaseException | None = exc
    for _ in range(5):
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class Client:
    def __init__(
        self,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        credential: tuple[str, str] | None = None,
        fresh: bool = False,
        ca: str | None = None,
    ) -> None:
        """`credential`: (account, api key); by default the stored login. `fresh`: a credential
        not yet known to work (login), so a refusal means "wrong", not "revoked". `ca`: the CA
        file to verify the server's TLS with; by default ITO_NATS_CA, else the one stored at login,
        else the connection file's."""
        from ecc import credentials

        try:  # the env, else the connection file `ito-training up` wrote, else the default
            self.resolved: connection.Resolved | None = connection.resolve()
            self.unresolved: str | None = None
        except connection.ConnectionFileInvalid as exc:
            self.resolved, self.unresolved = None, str(exc)
        self.url = self.resolved.url if self.resolved else ""
        self.namespace = self.resolved.namespace if self.resolved else ""
        self.connect_timeout_s = connect_timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.credential = credential or credentials.load()
        from_file = self.resolved.connection.ca if self.resolved else None  # `up --tls` wrote it
        self.ca = ca or os.environ.get(ENV_NATS_CA) or credentials.load_ca() or from_file
        self.fresh = fresh
        self.violations: list[str] = []
        self._nc: NatsClient | None = None

    def remaining(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._nc is not None:
            try:
                await asyncio.wait_for(self._nc.close(), timeout=1.0)
            except Exception:  # closing is best effort; the process is about to exit
                pass

    async def _connect(self, account: str, seed: bytes) -> "NatsClient":
        import nats

        async def on_error(exc: Exception) -> None:  # a denied publish is dropped and reported here only
            self.violations.append(str(exc).lower())

        if self._nc is None:
            tls = self._tls_options()
            nc = await nats.connect(
                [
                    u.strip() for u in self.url.split(",") if u.strip()
                ],  # a cluster's pool: a node that is down is skipped
                connect_timeout=min(self.connect_timeout_s, max(self.remaining(), 0.1)),
                allow_reconnect=False,
                # nats-py's first connect retries a refused address forever when this is 0 (it only
                # discards a server past a positive bound): each node is tried twice, 0.1 s apart,
                # then the pool is empty and a dead address is answered at once, not at the deadline.
                max_reconnect_attempts=1,
                reconnect_time_wait=RETRY_REFUSED_S,
                name="ecc",
                nkeys_seed_str=seed.decode(),
                inbox_prefix=tenant_inbox(account),
                error_cb=on_error,
                **tls,
            )
            if not nc._server_info.get("auth_required"):  # never talk to a server anyone may use
                await nc.close()
                raise Unauthenticated()
            if tls and not nc._server_info.get("tls_required"):  # a CA given, a plain server: a downgrade
                await nc.close()
                raise Untrusted(f"the server at {self.url} does not speak TLS, but a CA ({self.ca}) is set")
            self._nc = nc
        return self._nc

    def _tls_options(self) -> dict[str, Any]:
        """nats-py's TLS options: a context that trusts only our CA, or none (a server that
        requires TLS is then checked against the system's CAs, and fails as untrusted)."""
        import ssl

        _quiet_ssl_eof()
        if not self.ca:
            return {}
        try:
            context = ssl.create_default_context(cafile=self.ca)
        except (OSError, ssl.SSLError):
            raise Untrusted(f"the CA file {self.ca} cannot be read as a PEM certificate") from None
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return {"tls": context}

    def _refused(self) -> Envelope:
        if self.fresh:
            return local_error(
                ErrorCode.unauthenticated, "the server does not accept this credential", contacted=True
            )
        return local_error(
            ErrorCode.credential_revoked,
            "the server no longer accepts this credential (revoked); "
            "ask for a new one and run `ecc ito login`",
            contacted=True,
        )

    async def call(self, endpoint: Endpoint[Req, Ans], request: Req) -> Envelope[Ans]:
        """The scheduler's Envelope with its data decoded as `endpoint.answer`, a local refusal,
        or SentButUnanswered."""
        assert isinstance(request, endpoint.request), (
            f"{endpoint.subject} takes a {endpoint.request.__name__}"
        )
        if self.credential is None:
            return local_error(
                ErrorCode.unauthenticated, "not logged in; run `ecc ito login --account ACCOUNT`"
            )
        account, api_key = self.credential
        seed = seed_of(api_key)
        if seed is None:
            return local_error(
                ErrorCode.unauthenticated,
                "the stored credential is not an ito-training API key; run `ecc ito login` again",
            )
        if self.resolved is None:
            return local_error(ErrorCode.backend_unavailable, f"{self.unresolved}; nothing was sent")
        payload = _encoder.encode(request)
        nc = await self._connected(account, seed)
        if isinstance(nc, Envelope):
            return nc
        remaining = self.remaining()
        if remaining <= 0:
            return local_error(ErrorCode.timeout, "the overall timeout passed before the request was sent")
        reply = await self._request(nc, endpoint.subject, account, payload, remaining)
        if isinstance(reply, Envelope):
            return reply
        try:
            return answer_decoder(endpoint).decode(reply)
        # AssertionError: the Envelope's own check (an ok answer with an error, or neither)
        except (msgspec.ValidationError, msgspec.DecodeError, AssertionError):
            return local_error(ErrorCode.internal, "the server's answer could not be read", contacted=True)

    async def _connected(self, account: str, seed: bytes) -> "NatsClient | Envelope":
        """The connection, or why there is none (nothing was sent)."""
        try:
            return await asyncio.wait_for(self._connect(account, seed), timeout=max(self.remaining(), 0.1))
        except Unauthenticated:
            return local_error(
                ErrorCode.backend_unavailable,
                f"the server at {self.url} (from {self._where()}) does not require "
                f"authentication: it is not the ito-training API; nothing was sent. {self._fix()}",
            )
        except Untrusted as exc:
            return local_error(ErrorCode.tls_untrusted, f"{exc}; {TLS_HINT}")
        except Exception as exc:  # refused, DNS, timeout: nothing was sent
            if _is_cert_failure(exc):
                why = (
                    f"the TLS certificate of the server at {self.url} is not signed by the CA in {self.ca}"
                    if self.ca
                    else f"the server at {self.url} requires TLS and ecc has no CA to verify it with"
                )
                return local_error(ErrorCode.tls_untrusted, f"{why}; {TLS_HINT}")
            if "authorization" in str(exc).lower():
                return self._refused()
            return local_error(
                ErrorCode.backend_unavailable,
                f"cannot reach the ito-training API at {self.url} (from {self._where()}); nothing was "
                f"sent. {self._fix()}",
            )

    def _where(self) -> str:
        assert self.resolved is not None, "only a resolved address is ever tried"
        return self.resolved.source

    def _fix(self) -> str:
        assert self.resolved is not None, "only a resolved address is ever tried"
        words = self.resolved.what_to_set()
        return words[0].upper() + words[1:] + "."

    async def _request(
        self, nc: "NatsClient", suffix: str, account: str, payload: bytes, timeout: float
    ) -> bytes | Envelope:
        """The reply's bytes, a refusal the server made known, or SentButUnanswered."""
        from nats.errors import NoRespondersError
        from nats.errors import TimeoutError as NatsTimeout

        try:
            reply = await nc.request(f"{self.namespace}.{suffix}.{account}", payload, timeout=timeout)
        except NoRespondersError:
            return local_error(
                ErrorCode.backend_unavailable,
                f"the ito-training API is not running at {self.url} under namespace {self.namespace!r} "
                f"(from {self._where()}): nothing answers there. Start it with `make up`, or set "
                f"{ENV_NAMESPACE} to the namespace the stack serves",
            )
        except (TimeoutError, NatsTimeout):
            if any("permissions violation" in v for v in self.violations):  # dropped by the server: not sent
                return local_error(
                    ErrorCode.unauthenticated,
                    f"this credential may not act for account {account}",
                    contacted=True,
                )
            if any("authorization" in v for v in self.violations):
                return self._refused()
            raise SentButUnanswered() from None
        except Exception as exc:  # connection dropped mid-request, payload too large, ...
            if "maximum payload" in str(exc).lower():
                return local_error(ErrorCode.request_invalid, "the request is larger than the server accepts")
            if any("authorization" in v for v in self.violations) or "authorization" in str(exc).lower():
                return self._refused()
            raise SentButUnanswered() from None
        return reply.data
