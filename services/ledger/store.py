"""Redis access for the ledger: one Lua script consumes the confirmation and reserves the key.

Consumption and reservation are one atomic step, so a lost response can never create a second run
nor burn a second confirmation. Every key the script touches carries the `{account}` hash tag,
so it runs unchanged on Redis Cluster.

The confirmation record is a hash written by the confirmation service with the fields
account, action, target, digest, max_cost, expires_at (epoch seconds), consumed ("0"/"1").
This script is the only place that sets `consumed`.
"""

import msgspec
import redis.asyncio as aioredis

from contracts.errors import ErrorCode
from contracts.internal import LedgerAccept, LedgerEntry
from services.runtime.codec import Refusal
from services.runtime.keys import Keys

ACCEPT_LUA = """
local existing = redis.call('GET', KEYS[1])
if existing then return {'exists', existing} end
local conf = redis.call('HMGET', KEYS[2], 'account', 'action', 'target', 'digest', 'max_cost', 'expires_at', 'consumed')
if not conf[1] then return {'refused', 'confirmation_not_found'} end
if conf[7] == '1' then return {'refused', 'confirmation_consumed'} end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
if now >= tonumber(conf[6]) then return {'refused', 'confirmation_expired'} end
if conf[1] ~= ARGV[1] or conf[2] ~= ARGV[2] or conf[3] ~= ARGV[3] then
  return {'refused', 'confirmation_mismatch'}
end
if conf[4] ~= '' and conf[4] ~= ARGV[4] then return {'refused', 'manifest_digest_mismatch'} end
if conf[5] ~= '' and ARGV[5] ~= '' and tonumber(ARGV[5]) > tonumber(conf[5]) then
  return {'refused', 'confirmation_mismatch'}
end
redis.call('HSET', KEYS[2], 'consumed', '1', 'consumed_by', ARGV[6])
redis.call('SET', KEYS[1], ARGV[7], 'PX', ARGV[8])
if ARGV[10] == '1' then redis.call('SADD', KEYS[3], ARGV[9]) end
return {'accepted', ARGV[7]}
"""

_entry_decoder = msgspec.json.Decoder(LedgerEntry)


def _cost(value: float | None) -> str:
    return "" if value is None else repr(float(value))


class LedgerStore:
    def __init__(self, r: aioredis.Redis, keys: Keys, retention_s: float) -> None:
        self.r = r
        self.keys = keys
        self.retention_ms = int(retention_s * 1000)
        self._accept = r.register_script(ACCEPT_LUA)

    async def _with_handoff(self, entry: LedgerEntry) -> LedgerEntry:
        pending = await self.r.sismember(self.keys.pending_handoff(entry.account), entry.idempotency_key)
        return msgspec.structs.replace(entry, handed_off=not pending)

    async def lookup(self, account: str, key: str) -> LedgerEntry | None:
        raw = await self.r.get(self.keys.idempotency(account, key))
        return None if raw is None else await self._with_handoff(_entry_decoder.decode(raw))

    async def accept(self, req: LedgerAccept, entry: LedgerEntry) -> tuple[LedgerEntry, bool]:
        """Returns (entry, created). An existing entry comes back unchanged (created=False)."""
        outcome, value = await self._accept(
            keys=[
                self.keys.idempotency(req.account, req.idempotency_key),
                self.keys.confirmation(req.account, req.confirmation_ref),
                self.keys.pending_handoff(req.account),
            ],
            args=[
                req.account,
                req.action.value,
                req.target,
                req.manifest_digest or "",
                _cost(req.cost_usd),
                req.run_id,
                msgspec.json.encode(entry),
                self.retention_ms,
                req.idempotency_key,
                "1" if req.work else "0",  # only a run to hand off waits in the pending set
            ],
        )
        outcome = outcome.decode()
        if outcome == "refused":
            code = ErrorCode(value.decode())
            raise Refusal(code, _REFUSALS[code])
        decoded = await self._with_handoff(_entry_decoder.decode(value))
        return decoded, outcome == "accepted"

    async def mark_handed_off(self, account: str, key: str) -> LedgerEntry | None:
        await self.r.srem(self.keys.pending_handoff(account), key)
        return await self.lookup(account, key)

    async def pending(self) -> list[LedgerEntry]:
        """Every entry not yet handed off, across accounts (the reconciler's work list)."""
        entries = []
        for account in sorted(a.decode() for a in await self.r.smembers(self.keys.accounts())):
            for key in sorted(k.decode() for k in await self.r.smembers(self.keys.pending_handoff(account))):
                entry = await self.lookup(account, key)
                if entry is None:  # retention ran out: nothing left to hand off
                    await self.r.srem(self.keys.pending_handoff(account), key)
                elif not entry.handed_off:
                    entries.append(entry)
        return entries


_REFUSALS = {
    ErrorCode.confirmation_not_found: "no such confirmation for this account",
    ErrorCode.confirmation_consumed: "this confirmation was already used; confirm again",
    ErrorCode.confirmation_expired: "this confirmation expired; confirm again",
    ErrorCode.confirmation_mismatch: "this confirmation was made for another account, action, target or a lower cost",
    ErrorCode.manifest_digest_mismatch: "the manifest changed since it was confirmed; review and confirm again",
}
