"""The scheduler's signature on what it orders: work items, cancel notices, internal requests.

Defence in depth behind the NATS permissions: even a message that reached a subject it should not
have is refused unless the scheduler's Ed25519 key signed its subject, time and body digest. The
signed text is `subject \\n unix-millis \\n sha256(body)`; headers carry the time and the signature.
A request older than MAX_AGE_S (or that far in the future) is refused, so a captured one cannot be
replayed later; work items are verified without an age limit (they wait in the queue), and the
trainer also checks them against the run record through its lease.
"""

import hashlib
import time

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

HEADER_SIGNATURE = "Ito-Signature"
HEADER_SIGNED_AT = "Ito-Signed-At"
MAX_AGE_S = 30.0  # an internal request is answered within seconds; clocks may differ a little


def _signed_text(subject: str, signed_at: str, body: bytes) -> bytes:
    return b"\n".join((subject.encode(), signed_at.encode(), hashlib.sha256(body).digest()))


class Signer:
    def __init__(self, seed: bytes) -> None:
        self._key = SigningKey(seed)

    def headers(self, subject: str, body: bytes, now: float | None = None) -> dict[str, str]:
        signed_at = str(int((time.time() if now is None else now) * 1000))
        signature = self._key.sign(_signed_text(subject, signed_at, body)).signature.hex()
        return {HEADER_SIGNED_AT: signed_at, HEADER_SIGNATURE: signature}


class Verifier:
    def __init__(self, public_key: bytes) -> None:
        self._key = VerifyKey(public_key)

    def valid(
        self,
        subject: str,
        body: bytes,
        headers: dict[str, str] | None,
        now: float | None = None,
        max_age_s: float | None = MAX_AGE_S,
    ) -> bool:
        headers = headers or {}
        signed_at, signature = headers.get(HEADER_SIGNED_AT, ""), headers.get(HEADER_SIGNATURE, "")
        if not signed_at.isdigit() or not signature:
            return False
        if max_age_s is not None:
            age = (time.time() if now is None else now) - int(signed_at) / 1000
            if abs(age) > max_age_s:
                return False
        try:
            self._key.verify(_signed_text(subject, signed_at, body), bytes.fromhex(signature))
        except (BadSignatureError, ValueError):
            return False
        return True
