"""The booking projection's store: the port the handlers use (`Bookings`), its Redis adapter and
an in-memory adapter for handler tests.

Applying an event is one Lua script in Redis: write only when the event's version is newer than
the projection's, so duplicates and redeliveries change nothing and older events are ignored
(`projection.apply_outcome` is that decision; the in-memory adapter applies it).
"""

from typing import Protocol

import msgspec

from contracts.booking import Booking, BookingEvent
from runtime.configuration.keys import Keys
from runtime.messaging.codec import redis_text
from runtime.messaging.connections import RedisClient
from services.entitlement.projection import Outcome, apply_outcome

APPLY_LUA = """
local current = redis.call('HGET', KEYS[1], 'version')
if current and tonumber(current) >= tonumber(ARGV[1]) then
  if tonumber(current) == tonumber(ARGV[1]) then return 'duplicate' end
  return 'stale'
end
redis.call('HSET', KEYS[1], 'version', ARGV[1], 'data', ARGV[2])
redis.call('SADD', KEYS[2], ARGV[3])
return 'applied'
"""

_booking_decoder = msgspec.json.Decoder(Booking)
_event_decoder = msgspec.json.Decoder(BookingEvent)


class Bookings(Protocol):
    async def owner(self, booking_id: str) -> str | None: ...

    async def claim_owner(self, booking_id: str, account: str) -> str:
        """The first account seen for a booking owns it (set once, atomically); returns the owner."""
        ...

    async def apply(self, booking: Booking) -> Outcome:
        """Write `booking` only when its version is newer than the stored one, in one step."""
        ...

    async def get(self, account: str, booking_id: str) -> Booking | None: ...
    async def of_account(self, account: str) -> list[Booking]: ...
    async def park(self, event: BookingEvent) -> None: ...
    async def parked(self, booking_id: str) -> list[BookingEvent]: ...
    async def clear_parked(self, booking_id: str) -> None: ...

    async def count(self, what: str) -> None:
        """Add one to a counter (`stale_ignored`, `parked`, `rejected_malformed`, ...)."""
        ...

    async def counted(self, what: str) -> int: ...


class BookingStore:
    def __init__(self, r: RedisClient, keys: Keys) -> None:
        self.r = r
        self.keys = keys
        self._apply = r.register_script(APPLY_LUA)

    async def owner(self, booking_id: str) -> str | None:
        raw = await self.r.get(self.keys.booking_owner(booking_id))
        return None if raw is None else redis_text(raw)

    async def claim_owner(self, booking_id: str, account: str) -> str:
        """The first account seen for a booking owns it; returns the owner."""
        await self.r.set(self.keys.booking_owner(booking_id), account, nx=True)
        return (await self.owner(booking_id)) or account

    async def apply(self, booking: Booking) -> Outcome:
        outcome = await self._apply(
            keys=[
                self.keys.booking(booking.account, booking.booking_id),
                self.keys.bookings(booking.account),
            ],
            args=[booking.version, msgspec.json.encode(booking), booking.booking_id],
        )
        return Outcome(redis_text(outcome))

    async def get(self, account: str, booking_id: str) -> Booking | None:
        raw = await self.r.hget(self.keys.booking(account, booking_id), "data")
        return None if raw is None else _booking_decoder.decode(raw)

    async def of_account(self, account: str) -> list[Booking]:
        ids = sorted(redis_text(i) for i in await self.r.smembers(self.keys.bookings(account)))
        found = [await self.get(account, i) for i in ids]
        return [b for b in found if b is not None]

    async def park(self, event: BookingEvent) -> None:
        await self.r.rpush(self.keys.booking_parked(event.booking_id), msgspec.json.encode(event))

    async def parked(self, booking_id: str) -> list[BookingEvent]:
        raw = await self.r.lrange(self.keys.booking_parked(booking_id), 0, -1)
        return sorted((_event_decoder.decode(x) for x in raw), key=lambda e: e.version)

    async def clear_parked(self, booking_id: str) -> None:
        await self.r.delete(self.keys.booking_parked(booking_id))

    async def count(self, what: str) -> None:
        await self.r.hincrby(self.keys.booking_stats(), what, 1)  # a random shard of the counters

    async def counted(self, what: str) -> int:
        async with self.r.pipeline(transaction=False) as pipe:
            for key in self.keys.booking_stats_shards():
                pipe.hget(key, what)
            shards = await pipe.execute()
        return sum(int(n or 0) for n in shards)


class InMemoryBookings:
    """The same port in dicts: versioned by `apply_outcome`, owner claimed once, events parked."""

    def __init__(self) -> None:
        self.bookings: dict[tuple[str, str], Booking] = {}
        self.owners: dict[str, str] = {}
        self.early: dict[str, list[BookingEvent]] = {}
        self.stats: dict[str, int] = {}

    async def owner(self, booking_id: str) -> str | None:
        return self.owners.get(booking_id)

    async def claim_owner(self, booking_id: str, account: str) -> str:
        return self.owners.setdefault(booking_id, account)

    async def apply(self, booking: Booking) -> Outcome:
        current = self.bookings.get((booking.account, booking.booking_id))
        outcome = apply_outcome(None if current is None else current.version, booking.version)
        if outcome is Outcome.applied:
            self.bookings[(booking.account, booking.booking_id)] = booking
        return outcome

    async def get(self, account: str, booking_id: str) -> Booking | None:
        return self.bookings.get((account, booking_id))

    async def of_account(self, account: str) -> list[Booking]:
        return [b for (a, _), b in sorted(self.bookings.items()) if a == account]

    async def park(self, event: BookingEvent) -> None:
        self.early.setdefault(event.booking_id, []).append(event)

    async def parked(self, booking_id: str) -> list[BookingEvent]:
        return sorted(self.early.get(booking_id, []), key=lambda e: e.version)

    async def clear_parked(self, booking_id: str) -> None:
        self.early.pop(booking_id, None)

    async def count(self, what: str) -> None:
        self.stats[what] = self.stats.get(what, 0) + 1

    async def counted(self, what: str) -> int:
        return self.stats.get(what, 0)
