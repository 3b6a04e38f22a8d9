"""HMAC-SHA256 over msgspec's canonical JSON of a statement body. Shared key, never logged."""

import hashlib
import hmac

import msgspec

from contracts.internal import EligibilityBody, EligibilityStatement


def sign(body: EligibilityBody, key: bytes) -> EligibilityStatement:
    mac = hmac.new(key, msgspec.json.encode(body), hashlib.sha256).hexdigest()
    return EligibilityStatement(body=body, signature=mac)
