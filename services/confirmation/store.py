"""Confirmation records: the port the handlers use, its Redis adapter and an in-memory one.

This service owns the records (it alone creates them); the ledger's accept script only reads and
consumes them (domain/binding.py defines their fields and checks for both). Records
outlive their TTL by a day so that an expired confirmation is told apart from an unknown one.
"""

import asyncio
import secrets
import time
from typing import Protocol

from redis.asyncio.cluster import RedisCluster

from domain.binding import FIELDS, Stored
from domain.quotas import OUTSTANDING_LUA
from runtime.configuration.keys import Keys
from runtime.messaging.connections import RedisClient

RETAIN_AFTER_EXPIRY_S = 24 * 3600


def new_ref() -> str:
    return "cf_" + secrets.token_urlsafe(24)


class Confirmations(Protocol):
    async def now(self) -> float:
        """The clock expiry is measured on (the one the ledger's script reads too)."""
        ...

    async def create(self, ref: str, stored: Stored) -> None: ...

    async def get(self, account: str, ref: str) -> Stored | None: ...

    async def get_at(self, account: str, ref: str) -> tuple[Stored | None, float]:
        """The record and the clock's time, read together (one round trip in Redis)."""
        ...

    async def owner(self, ref: str) -> str | None:
        """The account a reference was issued to, whoever asks (to tell mismatch from unknown)."""
        ...

    async def admit(self, account: str, ref: str, expires_at: float, limit: int) -> tuple[bool, int]:
        """Count `ref` among the account's outstanding confirmations if fewer than `limit` are
        (neither consumed nor expired): (admitted, outstanding). An empty `ref` only counts."""
        ...


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


class ConfirmationStore:
    """Confirmations in Redis: one hash per record (FIELDS), plus a ref -> account index. The two
    live in different slots (the index is found by ref alone), so they are written side by side,
    not in one transaction: a record whose index entry is missing, or the reverse, can only be a
    reference that was never handed out (`create` returns after both)."""

    def __init__(self, r: RedisClient, keys: Keys) -> None:
        self.r = r
        self.keys = keys
        self._admit = r.register_script(OUTSTANDING_LUA)

    async def admit(self, account: str, ref: str, expires_at: float, limit: int) -> tuple[bool, int]:
        """OUTSTANDING_LUA on the account's slot, at the clock expiry is measured on."""
        prefix = self.keys.confirmation(account, "")
        admitted, outstanding = await self._admit(
            keys=[self.keys.outstanding_confirmations(account)],
            args=[repr(await self.now()), limit, ref, repr(expires_at), prefix],
        )
        return bool(int(admitted)), int(outstanding)

    async def now(self) -> float:
        seconds, micros = await self.r.time()  # the server's clock: the same one the script uses
        return float(seconds) + float(micros) / 1e6

    async def create(self, ref: str, stored: Stored) -> None:
        key = self.keys.confirmation(stored.account, ref)
        ttl = int(stored.expires_at - await self.now()) + RETAIN_AFTER_EXPIRY_S
        await asyncio.gather(
            self._write_record(key, stored, ttl),
            self.r.set(self.keys.confirmation_owner(ref), stored.account, ex=ttl),
        )

    async def _write_record(self, key: str, stored: Stored, ttl: int) -> None:
        async with self.r.pipeline(transaction=True) as pipe:  # one key: a record never lacks its TTL
            pipe.hset(key, items=[x for pair in stored.fields().items() for x in pair])
            pipe.expire(key, ttl)
            await pipe.execute()

    async def get(self, account: str, ref: str) -> Stored | None:
        return (await self.get_at(account, ref))[0]

    async def get_at(self, account: str, ref: str) -> tuple[Stored | None, float]:
        key = self.keys.confirmation(account, ref)
        if isinstance(self.r, RedisCluster):
            # TIME names no key, and a cluster pipeline refuses it: ask the node that holds the
            # record, whose clock the ledger's script reads too, side by side with the read
            raw, (seconds, micros) = await asyncio.gather(
                self.r.hgetall(key), self.r.time(target_nodes=self.r.get_node_from_key(key))
            )
        else:
            async with self.r.pipeline(transaction=False) as pipe:
                pipe.hgetall(key)  # (its ACL user's commands)
                pipe.time()
                raw, (seconds, micros) = await pipe.execute()
        record = {_text(k): _text(v) for k, v in raw.items()}
        stored = Stored.from_fields([record[f] for f in FIELDS]) if record else None
        return stored, float(seconds) + float(micros) / 1e6

    async def owner(self, ref: str) -> str | None:
        raw = await self.r.get(self.keys.confirmation_owner(ref))
        return None if raw is None else _text(raw)


class InMemoryConfirmations:
    """The same port in a dict, for table tests; `records` is what the in-memory ledger consumes."""

    def __init__(self, clock: float | None = None) -> None:
        self.clock = time.time() if clock is None else clock
        self.records: dict[tuple[str, str], Stored] = {}
        self.outstanding: dict[str, dict[str, float]] = {}  # account -> ref -> expiry

    async def now(self) -> float:
        return self.clock

    async def admit(self, account: str, ref: str, expires_at: float, limit: int) -> tuple[bool, int]:
        mine = self.outstanding.setdefault(account, {})
        for r, expiry in list(mine.items()):
            record = self.records.get((account, r))
            if expiry <= self.clock or (record is not None and record.consumed):
                del mine[r]
        if not ref or ref in mine:
            return True, len(mine)
        if len(mine) >= limit:
            return False, len(mine)
        mine[ref] = expires_at
        return True, len(mine)

    async def create(self, ref: str, stored: Stored) -> None:
        self.records[(stored.account, ref)] = stored

    async def get(self, account: str, ref: str) -> Stored | None:
        return self.records.get((account, ref))

    async def get_at(self, account: str, ref: str) -> tuple[Stored | None, float]:
        return self.records.get((account, ref)), self.clock

    async def owner(self, ref: str) -> str | None:
        return next((account for account, r in self.records if r == ref), None)
