"""Redis access for confirmations. Records outlive their TTL by a day so that an expired
confirmation is told apart from an unknown one; the ledger's accept script consumes them."""

import secrets

import redis.asyncio as aioredis

from contracts.api import Action
from services.confirmation.binding import Stored
from services.runtime.keys import Keys

RETAIN_AFTER_EXPIRY_S = 24 * 3600


def new_ref() -> str:
    return "cf_" + secrets.token_urlsafe(24)


class ConfirmationStore:
    def __init__(self, r: aioredis.Redis, keys: Keys) -> None:
        self.r = r
        self.keys = keys

    async def now(self) -> float:
        seconds, micros = await self.r.time()  # the server's clock: the same one the script uses
        return seconds + micros / 1e6

    async def create(self, ref: str, stored: Stored) -> None:
        key = self.keys.confirmation(stored.account, ref)
        ttl = int(stored.expires_at - await self.now()) + RETAIN_AFTER_EXPIRY_S
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.hset(
                key,
                mapping={
                    "account": stored.account,
                    "action": stored.action.value,
                    "target": stored.target,
                    "digest": stored.digest,
                    "max_cost": "" if stored.max_cost is None else repr(float(stored.max_cost)),
                    "expires_at": repr(stored.expires_at),
                    "consumed": "0",
                },
            )
            pipe.expire(key, ttl)
            pipe.set(self.keys.confirmation_owner(ref), stored.account, ex=ttl)
            await pipe.execute()

    async def get(self, account: str, ref: str) -> Stored | None:
        raw = await self.r.hgetall(self.keys.confirmation(account, ref))
        if not raw:
            return None
        f = {k.decode(): v.decode() for k, v in raw.items()}
        return Stored(
            account=f["account"],
            action=Action(f["action"]),
            target=f["target"],
            digest=f["digest"],
            max_cost=float(f["max_cost"]) if f["max_cost"] else None,
            expires_at=float(f["expires_at"]),
            consumed=f["consumed"] == "1",
        )

    async def owner(self, ref: str) -> str | None:
        raw = await self.r.get(self.keys.confirmation_owner(ref))
        return None if raw is None else raw.decode()
