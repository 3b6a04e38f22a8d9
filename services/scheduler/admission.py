"""What every API request shares before its own gates: who the caller is, whether its idempotency
key is well formed, and the fingerprint that tells a replay from a conflicting reuse of a key.

Both the train path (api.py) and the run mutations (mutations.py) admit requests here, so neither
imports the other.
"""

import hashlib
from typing import Any

from contracts.api import Action, AuthInfo
from contracts.errors import ErrorCode
from runtime.messaging.codec import Refusal
from runtime.tenancy import accounts

MAX_IDEMPOTENCY_KEY = 255


def valid_idempotency_key(key: str) -> bool:
    """1-255 printable ASCII characters (space through tilde)."""
    return 1 <= len(key) <= MAX_IDEMPOTENCY_KEY and all(" " <= c <= "~" for c in key)


def key_refusal(key: str) -> Refusal | None:
    """The refusal for a malformed idempotency key, or None."""
    if valid_idempotency_key(key):
        return None
    return Refusal(ErrorCode.idempotency_key_invalid, "idempotency keys are 1-255 printable ASCII characters")


def key_conflict() -> Refusal:
    return Refusal(ErrorCode.idempotency_key_conflict, "this idempotency key was used for another request")


def fingerprint(action: Action, account: str, target: str, digest: str) -> str:
    return hashlib.sha256("\0".join((action.value, account, target, digest)).encode()).hexdigest()


async def authenticate(credentials: accounts.Credentials, caller: str, req: Any) -> AuthInfo:
    """The caller is the account whose credential the NATS server authenticated (the request's
    subject says which; only that credential may publish there). An API key is never accepted on
    the wire, and a credential block, when a client still sends one, must name the same account."""
    credential = getattr(req, "credential", None)
    if credential is not None:
        if credential.api_key:
            raise Refusal(
                ErrorCode.request_invalid, "API keys never travel in requests; upgrade ecc and log in again"
            )
        if credential.account != caller:
            raise Refusal(ErrorCode.unauthenticated, "the request names another account than its credential")
    return await accounts.authenticate(credentials, caller)
