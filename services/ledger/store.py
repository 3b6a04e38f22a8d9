"""The ledger's store: the port its handlers use (`Ledger`), its Redis adapter (one Lua script
consumes the confirmation and reserves the key) and an in-memory adapter for table tests.

Consumption and reservation are one atomic step, so a lost response can never create a second run
nor burn a second confirmation. Every key the script touches carries the `{account}` hash tag,
so it runs unchanged on Redis Cluster.

The confirmation record is the confirmation service's (it alone writes it); the ledger only reads
it and consumes it: this script is the only place that sets `consumed`. The record's fields and
the checks of a binding are defined once, in domain/binding.py, for both services.
"""

import dataclasses
import time
from typing import Protocol

import msgspec

from contracts.internal import LedgerAccept, LedgerEntry
from domain import binding
from runtime.configuration.keys import Keys
from runtime.messaging.codec import Refusal
from runtime.messaging.connections import RedisClient
from runtime.tenancy import accounts

BOUND_KEY = '"cost_bound_usd":'
"""The entry's last field as msgspec writes it; null until the script writes the confirmation's bound."""

ACCEPT_LUA = (
    f"""
local BOUND_KEY = '{BOUND_KEY}'
local BOUND_NULL = BOUND_KEY .. 'null'
"""
    + """
local existing = redis.call('GET', KEYS[1])
if existing then return {'exists', existing, tostring(redis.call('SISMEMBER', KEYS[3], ARGV[9]))} end
local conf = redis.call('HMGET', KEYS[2], """
    + ", ".join(f"'{f}'" for f in binding.FIELDS)
    + """)
local want = {account = ARGV[1], action = ARGV[2], target = ARGV[3], digest = ARGV[4], cost = ARGV[5]}
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""
    + binding.lua_checks()
    + """
local entry = ARGV[7]
local bound = tonumber(conf["""
    + str(binding.FIELDS.index("max_cost") + 1)
    + """])
if bound and bound == bound and bound < math.huge and bound > -math.huge then
  local at = string.find(entry, BOUND_NULL, 1, true)
  if at then
    entry = string.sub(entry, 1, at - 1) .. BOUND_KEY .. string.format('%.17g', bound)
      .. string.sub(entry, at + #BOUND_NULL)
  end
end
redis.call('HSET', KEYS[2], 'consumed', '1', 'consumed_by', ARGV[6])
redis.call('SET', KEYS[1], entry, 'PX', ARGV[8])
if ARGV[10] == '1' then redis.call('SADD', KEYS[3], ARGV[9]) end
return {'accepted', entry, ARGV[10]}
"""
)
"""Answer the existing entry (and whether it waits for hand-off); or refuse with the failed binding
rule's name and the record; or consume the confirmation and reserve the key (and queue a run for
hand-off), the entry stored with the confirmation's cost bound written into its `cost_bound_usd`
(the bound is read here, beside the binding, so the entry the ledger keeps for a hand-off after a
crash and the one answered now carry the same bound). One round trip either way."""

_entry_decoder = msgspec.json.Decoder(LedgerEntry)


class Ledger(Protocol):
    async def lookup(self, account: str, key: str) -> LedgerEntry | None: ...

    async def accept(self, req: LedgerAccept, entry: LedgerEntry) -> tuple[LedgerEntry, bool]:
        """(entry, created): consume the confirmation and reserve the key in one step, or the
        existing entry unchanged (created=False); a Refusal with the binding's code when the
        confirmation does not authorize the request."""
        ...

    async def mark_handed_off(self, account: str, key: str) -> LedgerEntry | None: ...

    async def pending(self) -> list[LedgerEntry]:
        """Every entry not yet handed off, across accounts (the reconciler's work list)."""
        ...


def _wanted(req: LedgerAccept) -> binding.Wanted:
    return binding.Wanted(
        account=req.account,
        action=req.action,
        target=req.target,
        digest=req.manifest_digest,
        cost=req.cost_usd,
    )


def _handed_off(entry: LedgerEntry, pending: bool) -> LedgerEntry:
    return msgspec.structs.replace(entry, handed_off=not pending)


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


class LedgerStore:
    def __init__(self, r: RedisClient, keys: Keys, retention_s: float) -> None:
        self.r = r
        self.keys = keys
        self.retention_ms = int(retention_s * 1000)
        self._accept = r.register_script(ACCEPT_LUA)

    async def lookup(self, account: str, key: str) -> LedgerEntry | None:
        """The entry and whether it was handed off, in one round trip."""
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.get(self.keys.idempotency(account, key))
            pipe.sismember(self.keys.pending_handoff(account), key)
            raw, pending = await pipe.execute()
        return None if raw is None else _handed_off(_entry_decoder.decode(raw), bool(pending))

    async def accept(self, req: LedgerAccept, entry: LedgerEntry) -> tuple[LedgerEntry, bool]:
        outcome, *value = await self._accept(
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
                binding.encode_cost(req.cost_usd),
                req.run_id,
                msgspec.json.encode(entry),
                self.retention_ms,
                req.idempotency_key,
                "1" if req.work else "0",  # only a run to hand off waits in the pending set
            ],
        )
        if _text(outcome) == "refused":
            fields = [_text(v) for v in value[1:]]
            stored = binding.Stored.from_fields(fields) if fields else None
            raise Refusal(*binding.refusal(binding.Reason(_text(value[0])), stored, _wanted(req)))
        decoded = _handed_off(_entry_decoder.decode(value[0]), _text(value[1]) == "1")
        return decoded, _text(outcome) == "accepted"

    async def mark_handed_off(self, account: str, key: str) -> LedgerEntry | None:
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.srem(self.keys.pending_handoff(account), key)
            pipe.get(self.keys.idempotency(account, key))
            _, raw = await pipe.execute()
        return None if raw is None else _handed_off(_entry_decoder.decode(raw), False)

    async def pending(self) -> list[LedgerEntry]:
        entries = []
        for account in await accounts.names(self.r, self.keys):
            for key in sorted(_text(k) for k in await self.r.smembers(self.keys.pending_handoff(account))):
                entry = await self.lookup(account, key)
                if entry is None:  # retention ran out: nothing left to hand off
                    await self.r.srem(self.keys.pending_handoff(account), key)
                elif not entry.handed_off:
                    entries.append(entry)
        return entries


class InMemoryLedger:
    """The same port in dicts, for table tests: it consumes the records of an in-memory
    confirmation store (`records`, keyed (account, ref)) by the same binding rules."""

    def __init__(self, records: dict[tuple[str, str], binding.Stored], clock: float | None = None) -> None:
        self.records = records
        self.clock = time.time() if clock is None else clock
        self.entries: dict[tuple[str, str], LedgerEntry] = {}
        self.waiting: set[tuple[str, str]] = set()

    def _with_handoff(self, entry: LedgerEntry) -> LedgerEntry:
        pending = (entry.account, entry.idempotency_key) in self.waiting
        return msgspec.structs.replace(entry, handed_off=not pending)

    async def lookup(self, account: str, key: str) -> LedgerEntry | None:
        entry = self.entries.get((account, key))
        return None if entry is None else self._with_handoff(entry)

    async def accept(self, req: LedgerAccept, entry: LedgerEntry) -> tuple[LedgerEntry, bool]:
        existing = await self.lookup(req.account, req.idempotency_key)
        if existing is not None:
            return existing, False
        wanted, stored = _wanted(req), self.records.get((req.account, req.confirmation_ref))
        if stored is None:
            raise Refusal(*binding.refusal(binding.Reason.not_found, None, wanted))
        reason = binding.refused(stored, wanted, self.clock)
        if reason is not None:
            raise Refusal(*binding.refusal(reason, stored, wanted))
        self.records[(req.account, req.confirmation_ref)] = dataclasses.replace(stored, consumed=True)
        entry = msgspec.structs.replace(entry, cost_bound_usd=stored.max_cost)  # as the script writes it
        self.entries[(req.account, req.idempotency_key)] = entry
        if req.work:
            self.waiting.add((req.account, req.idempotency_key))
        return self._with_handoff(entry), True

    async def mark_handed_off(self, account: str, key: str) -> LedgerEntry | None:
        self.waiting.discard((account, key))
        return await self.lookup(account, key)

    async def pending(self) -> list[LedgerEntry]:
        return [self._with_handoff(self.entries[k]) for k in sorted(self.waiting)]
