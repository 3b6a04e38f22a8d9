"""Where an account's quotas live: one hash per account in Redis (`<ns>:{<account>}:quota`), one
writer (the `accounts` identity: `ito-training accounts quota`), read by the scheduler (its
request-rate bucket, its run admission) and the confirmation service (outstanding confirmations).

The scheduler reads them through the `Quotas` port (`RedisQuotas` here, `InMemoryQuotas` in
handler tests); the decisions are domain/quotas.py's.
"""

import dataclasses
import time
from typing import Protocol

from contracts.api import QuotaLimits
from contracts.errors import ErrorCode
from domain import quotas as decide
from runtime.configuration.keys import Keys
from runtime.messaging.codec import Refusal, redis_text
from runtime.messaging.connections import RedisClient

MAX_REMEMBERED = 10_000  # accounts whose refusal one scheduler instance remembers at once


def refusal(taken: decide.Taken) -> Refusal | None:
    """The `rate_limited` refusal of a take that was not admitted, with its retry-after; else None."""
    if taken.allowed:
        return None
    retry = round(taken.retry_after_s, 3)
    message = decide.rate_message(dataclasses.replace(taken, retry_after_s=retry))
    return Refusal(ErrorCode.rate_limited, message, retry_after_s=retry)


def breach_refusal(breach) -> Refusal | None:
    """A `quota_exceeded` refusal from `decide.over`'s (breach, message), or None."""
    if breach is None:
        return None
    quota, message = breach
    return Refusal(ErrorCode.quota_exceeded, message, quota=quota)


class Quotas(Protocol):
    """What the services read (and the operator writes) of an account's quotas."""

    async def limits(self, account: str) -> QuotaLimits: ...

    async def take(self, account: str, cost: float = 1.0, open_runs: bool = False) -> decide.Taken:
        """One request's token from the account's bucket (cost 0: look, take nothing); with
        `open_runs`, the run limits and the open-run count come with it where one read can give
        them (`Taken.open_at_most` None where not)."""
        ...

    def remembered(self, account: str) -> decide.Taken | None:
        """A refusal this instance still remembers for the account (no I/O), or None."""
        ...

    async def set_limits(self, account: str, changes: dict[str, float]) -> QuotaLimits: ...


def _checked(changes: dict[str, float]) -> dict[str, float]:
    for name, value in changes.items():
        reason = decide.invalid_limit(name, value)
        if reason is not None:
            raise Refusal(ErrorCode.request_invalid, reason)
    return changes


class RedisQuotas:
    def __init__(self, r: RedisClient, keys: Keys) -> None:
        self.r = r
        self.keys = keys
        self._bucket = r.register_script(decide.BUCKET_LUA)
        self._refused: dict[str, tuple[tuple[float, float], decide.Taken]] = {}  # this instance's

    async def limits(self, account: str) -> QuotaLimits:
        raw = await self.r.hgetall(self.keys.quota(account))
        return decide.limits_from({redis_text(k): redis_text(v) for k, v in raw.items()})

    async def take(
        self, account: str, cost: float = 1.0, open_runs: bool = False, now: float | None = None
    ) -> decide.Taken:
        """BUCKET_LUA on the server's clock (`now` only in tests); an empty bucket this instance saw
        less than REFUSAL_MEMORY_S ago is refused without a round trip (`decide.remembered`)."""
        local = time.monotonic()
        if cost > 0 and now is None:
            seen = self.remembered(account, local)
            if seen is not None:
                return seen
        keys = [self.keys.bucket(account), self.keys.quota(account)]
        if open_runs:
            keys.append(self.keys.open_runs(account))
        allowed, tokens, retry_s, rate, burst, runs, queued, open_count = await self._bucket(
            keys=keys,
            args=["" if now is None else repr(now), decide.DEFAULTS.rate_per_s, decide.DEFAULTS.burst, cost],
        )
        limits = decide.limits_from({"runs": redis_text(runs), "queued": redis_text(queued)})
        taken = decide.Taken(
            bool(int(allowed)),
            float(tokens),
            float(retry_s),
            float(rate),
            int(burst),
            runs=limits.runs,
            queued=limits.queued,
            open_at_most=int(open_count) if open_runs else None,
        )
        if cost > 0 and now is None:
            self._remember(account, taken, local)
        return taken

    def remembered(self, account: str, local: float | None = None) -> decide.Taken | None:
        """The refusal remembered for `account` (REFUSAL_MEMORY_S at most), as it stands at `local`
        (monotonic seconds; now when None), or None."""
        if account not in self._refused:
            return None
        entry, seen = self._refused[account]
        retry = decide.remembered(entry, time.monotonic() if local is None else local)
        return None if retry is None else dataclasses.replace(seen, tokens=0.0, retry_after_s=retry)

    def _remember(self, account: str, taken: decide.Taken, now: float) -> None:
        entry = decide.memory_of(taken, now)
        if entry is None:
            self._refused.pop(account, None)
            return
        if len(self._refused) >= MAX_REMEMBERED:  # bounded: forget the ones that are over
            self._refused = {a: e for a, e in self._refused.items() if e[0][0] > now}
        self._refused[account] = (entry, taken)

    async def set_limits(self, account: str, changes: dict[str, float]) -> QuotaLimits:
        """The operator's write (the `accounts` identity): the named limits, the rest unchanged."""
        if changes:
            await self.r.hset(
                self.keys.quota(account), mapping={k: repr(float(v)) for k, v in _checked(changes).items()}
            )
        return await self.limits(account)


class InMemoryQuotas:
    """The same port in a dict, for handler tests; `clock` is read for every take."""

    def __init__(self, clock=time.time) -> None:
        self.clock = clock
        self.stored: dict[str, dict[str, str]] = {}
        self.buckets: dict[str, tuple[float, float]] = {}

    async def limits(self, account: str) -> QuotaLimits:
        return decide.limits_from(self.stored.get(account, {}))

    def remembered(self, account: str) -> decide.Taken | None:
        return None  # every take reads the bucket here

    async def take(self, account: str, cost: float = 1.0, open_runs: bool = False) -> decide.Taken:
        limits, now = await self.limits(account), self.clock()
        tokens, at = self.buckets.get(account, (None, None))
        taken = decide.take(tokens, at, now, limits.rate_per_s, limits.burst, cost)
        self.buckets[account] = (taken.tokens, now)
        return dataclasses.replace(taken, runs=limits.runs, queued=limits.queued)  # no run count here

    async def set_limits(self, account: str, changes: dict[str, float]) -> QuotaLimits:
        stored = self.stored.setdefault(account, {})
        stored.update({k: repr(float(v)) for k, v in _checked(changes).items()})
        return await self.limits(account)
