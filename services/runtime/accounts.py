"""API keys: created once, stored only as a SHA-256 hash, revocable.

Identity is not authority: an authenticated caller still needs a booking, a manifest and a
confirmation before anything is created. Keys are 256-bit random, so a plain SHA-256 (not a slow
password hash) is the right lookup digest.
"""

import hashlib
import secrets
import time

import msgspec
import redis.asyncio as aioredis

from contracts.api import AuthInfo, Credential
from contracts.errors import ErrorCode
from services.runtime.codec import Refusal
from services.runtime.keys import Keys

KEY_PREFIX = "ito_sk_"
MAX_ACCOUNT_LEN = 64


class KeyRecord(msgspec.Struct, frozen=True, kw_only=True):
    account: str
    key_id: str
    revoked: bool
    created_at: float


_record_decoder = msgspec.json.Decoder(KeyRecord)


def digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def valid_account(account: str) -> bool:
    # no '.', '*' or '>': an account name must be safe as one NATS subject token
    return 0 < len(account) <= MAX_ACCOUNT_LEN and all(c.isascii() and (c.isalnum() or c in "-_") for c in account)


async def create(r: aioredis.Redis, keys: Keys, account: str) -> tuple[str, str]:
    """A new key for `account` (created if new): returns (api_key, key_id). The key is shown once."""
    if not valid_account(account):
        raise Refusal(ErrorCode.request_invalid, "account names are 1-64 ASCII letters, digits, '-' or '_'")
    api_key = KEY_PREFIX + secrets.token_urlsafe(32)
    key_hash = digest(api_key)
    record = KeyRecord(account=account, key_id=key_hash[:12], revoked=False, created_at=time.time())
    async with r.pipeline(transaction=True) as pipe:
        pipe.hset(keys.api_keys(), key_hash, msgspec.json.encode(record))
        pipe.sadd(keys.accounts(), account)
        await pipe.execute()
    return api_key, record.key_id


async def revoke(r: aioredis.Redis, keys: Keys, account: str) -> int:
    """Revoke every key of `account`; returns how many were active."""
    revoked = 0
    for key_hash, raw in (await r.hgetall(keys.api_keys())).items():
        record = _record_decoder.decode(raw)
        if record.account == account and not record.revoked:
            await r.hset(keys.api_keys(), key_hash, msgspec.json.encode(msgspec.structs.replace(record, revoked=True)))
            revoked += 1
    return revoked


async def authenticate(r: aioredis.Redis, keys: Keys, credential: Credential) -> AuthInfo:
    raw = await r.hget(keys.api_keys(), digest(credential.api_key))
    if raw is None:
        raise Refusal(ErrorCode.unauthenticated, "unknown credential; run `ecc ito login`")
    record = _record_decoder.decode(raw)
    if record.account != credential.account:
        raise Refusal(ErrorCode.unauthenticated, "the credential does not belong to this account")
    if record.revoked:
        raise Refusal(ErrorCode.credential_revoked, "this credential was revoked")
    return AuthInfo(account=record.account, key_id=record.key_id)
