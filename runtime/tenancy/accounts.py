"""The account registry: each account's credentials, as public keys only, revocable.

A tenant's credential is an NKey seed (shown once, as the API key `ito_sk_<seed>`). The seed never
crosses the wire: NATS authenticates the connection by challenge-response, and the server config
lists only the public key with permissions for that account's own subjects. Identity is not
authority: an authenticated caller still needs a booking, a manifest and a confirmation before
anything is created.

Redis layout: `<ns>:apikeys:<account>` maps each public nkey of the account to its KeyRecord (one
read authenticates a request); the account names are a set split in shards (`<ns>:accounts:<n>`,
runtime/configuration/keys.py), so that no one key, hence no one Redis Cluster slot, takes every
account. Only the `accounts` identity (operator tooling) writes them; the scheduler reads the keys,
the ledger the names.

The scheduler reads them through the `Credentials` port (`RedisAccounts` here, `InMemoryAccounts`
in handler tests); operator tooling calls the module functions, which the Redis adapter wraps.
"""

import time
from typing import Protocol

import msgspec

from contracts.api import AuthInfo
from contracts.errors import ErrorCode
from runtime.configuration.keys import Keys
from runtime.messaging.codec import Refusal, redis_text
from runtime.messaging.connections import RedisClient
from runtime.security.secrets import new_nkey_seed, nkey_public

KEY_PREFIX = "ito_sk_"
MAX_ACCOUNT_LEN = 64


class KeyRecord(msgspec.Struct, frozen=True, kw_only=True):
    account: str
    key_id: str
    revoked: bool
    created_at: float
    nkey: str = ""  # the public half; the seed is never stored


_record_decoder = msgspec.json.Decoder(KeyRecord)


def valid_account(account: str) -> bool:
    # no '.', '*' or '>': an account name must be safe as one NATS subject token
    return 0 < len(account) <= MAX_ACCOUNT_LEN and all(
        c.isascii() and (c.isalnum() or c in "-_") for c in account
    )


def seed_of(api_key: str) -> bytes | None:
    """The NKey seed inside an API key, or None when it is not one of ours."""
    if not api_key.startswith(KEY_PREFIX):
        return None
    seed = api_key[len(KEY_PREFIX) :].encode()
    try:
        nkey_public(seed)
    except Exception:  # nkeys raises several types for a malformed seed
        return None
    return seed


def new_credential(account: str) -> tuple[str, KeyRecord]:
    """(api_key, its record) for a new credential of `account`; only the record is ever stored."""
    if not valid_account(account):
        raise Refusal(ErrorCode.request_invalid, "account names are 1-64 ASCII letters, digits, '-' or '_'")
    seed = new_nkey_seed()
    public = nkey_public(seed)
    record = KeyRecord(
        account=account, key_id=public[:12], revoked=False, created_at=time.time(), nkey=public
    )
    return KEY_PREFIX + seed.decode(), record


async def create(r: RedisClient, keys: Keys, account: str) -> tuple[str, str, str]:
    """A new credential for `account` (created if new): (api_key, key_id, public nkey). The key is
    shown once; only its public half is kept.

    Two keys in two slots, so no transaction: the name goes into the index first (a name without
    a key authenticates nobody), then the key (a key whose account is in the index from the start
    is never missing from the server config)."""
    api_key, record = new_credential(account)
    public = record.nkey
    await r.sadd(keys.accounts_shard(account), account)
    await r.hset(keys.api_keys(account), public, msgspec.json.encode(record))
    return api_key, record.key_id, public


async def records(r: RedisClient, keys: Keys, account: str) -> list[KeyRecord]:
    return [_record_decoder.decode(raw) for raw in (await r.hgetall(keys.api_keys(account))).values()]


async def names(r: RedisClient, keys: Keys) -> list[str]:
    """Every account name: each shard of the index, read in one pipeline (on a cluster, one round
    trip to each node that holds a shard)."""
    async with r.pipeline(transaction=False) as pipe:
        for key in keys.accounts_shards():
            pipe.smembers(key)
        shards = await pipe.execute()
    return sorted({redis_text(a) for members in shards for a in members})


async def active_tenants(r: RedisClient, keys: Keys) -> list[tuple[str, str]]:
    """(account, public nkey) of every credential the NATS server should accept."""
    active = []
    for account in await names(r, keys):
        active += [(k.account, k.nkey) for k in await records(r, keys, account) if not k.revoked and k.nkey]
    return sorted(active)


async def revoke(r: RedisClient, keys: Keys, account: str) -> int:
    """Revoke every key of `account`; returns how many were active."""
    revoked = 0
    for record in await records(r, keys, account):
        if not record.revoked:
            await r.hset(
                keys.api_keys(account),
                record.nkey,
                msgspec.json.encode(msgspec.structs.replace(record, revoked=True)),
            )
            revoked += 1
    return revoked


def authenticated(account: str, mine: list[KeyRecord]) -> AuthInfo:
    """The decision on an account's key records: its newest active key, or the refusal."""
    active = [k for k in mine if not k.revoked]
    if not mine:
        raise Refusal(ErrorCode.unauthenticated, "unknown account; run `ecc ito login`")
    if not active:
        raise Refusal(ErrorCode.credential_revoked, "this credential was revoked")
    newest = max(active, key=lambda k: k.created_at)
    return AuthInfo(account=account, key_id=newest.key_id)


class Credentials(Protocol):
    """What authentication reads: an account's key records (public halves only)."""

    async def records(self, account: str) -> list[KeyRecord]: ...


async def authenticate(credentials: Credentials, account: str) -> AuthInfo:
    """The account the NATS server authenticated (from the request subject) must still hold an
    active key here too: a revocation is refused even before the server's config reload lands."""
    return authenticated(account, await credentials.records(account))


class RedisAccounts:
    """The registry in Redis (the layout above): `Credentials` for the scheduler, and the
    operator's create and revoke."""

    def __init__(self, r: RedisClient, keys: Keys) -> None:
        self.r = r
        self.keys = keys

    async def records(self, account: str) -> list[KeyRecord]:
        return await records(self.r, self.keys, account)

    async def create(self, account: str) -> tuple[str, str, str]:
        return await create(self.r, self.keys, account)

    async def revoke(self, account: str) -> int:
        return await revoke(self.r, self.keys, account)


class InMemoryAccounts:
    """The same registry in a dict, for handler tests: the same records, the same revocation."""

    def __init__(self) -> None:
        self.keys: dict[str, dict[str, KeyRecord]] = {}  # account -> public nkey -> record

    async def records(self, account: str) -> list[KeyRecord]:
        return list(self.keys.get(account, {}).values())

    async def create(self, account: str) -> tuple[str, str, str]:
        api_key, record = new_credential(account)
        self.keys.setdefault(account, {})[record.nkey] = record
        return api_key, record.key_id, record.nkey

    async def revoke(self, account: str) -> int:
        mine = self.keys.get(account, {})
        active = [k for k in mine.values() if not k.revoked]
        for record in active:
            mine[record.nkey] = msgspec.structs.replace(record, revoked=True)
        return len(active)
