"""Per-tenant quotas, defined once: the defaults, the token bucket's math, the admission of a
confirmation and of a run, and the same bucket in Lua for the scheduler's atomic take.

The operator writes an account's limits (`ito-training accounts quota`, runtime/tenancy/quota_stores.py);
an account without them has DEFAULTS. The scheduler takes one token from the account's bucket for
each plan, confirm and train request (BUCKET_LUA: one script on the account's own slot, so that
every scheduler instance shares one bucket); the confirmation service admits a confirmation against
the account's outstanding ones (OUTSTANDING_LUA); the scheduler admits a train against the account's
unfinished and waiting runs (`run_refusal`), before anything is reserved.
"""

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from contracts.api import QuotaLimits
from contracts.errors import QuotaBreach
from contracts.states import TERMINAL_STATES, RunState

# Generous on purpose: an account the operator never limited keeps working as before (a burst of
# hundreds of requests, hundreds of queued runs); tighten them per account (docs/quotas.md).
DEFAULT_RATE_PER_S = 20.0  # plan/confirm/train requests per second, sustained
DEFAULT_BURST = 600  # requests at once after a quiet half minute
DEFAULT_CONFIRMATIONS = 256  # outstanding confirmations (each lives confirmation_ttl_s at most)
DEFAULT_RUNS = 256  # unfinished runs
DEFAULT_QUEUED = 256  # runs waiting for a trainer
DEFAULT_FILE_BYTES = 256 * 1024**3  # files and uploaded models together: a few corpora and checkpoints
DEFAULT_FILES = 1000  # data files (uploads under way count)
DEFAULT_MODELS = 64  # models uploaded by the account

DEFAULTS = QuotaLimits(
    rate_per_s=DEFAULT_RATE_PER_S,
    burst=DEFAULT_BURST,
    confirmations=DEFAULT_CONFIRMATIONS,
    runs=DEFAULT_RUNS,
    queued=DEFAULT_QUEUED,
    file_bytes=DEFAULT_FILE_BYTES,
    files=DEFAULT_FILES,
    models=DEFAULT_MODELS,
)
FIELDS = ("rate_per_s", "burst", "confirmations", "runs", "queued", "file_bytes", "files", "models")
"""The limits' hash fields (`<ns>:{<account>}:quota`); a field not set is its default."""
MAX_LIMIT = 1_000_000  # a count above this is a typo, not a quota
MAX_BYTES_LIMIT = 1 << 50  # a byte limit above a petabyte is a typo

MANIFEST_BYTES_PER_TOKEN = 64 * 1024
"""A rated request costs one token, and one more per this many bytes of the manifest it carries: a
manifest's checks grow with its bytes (~0.1 s for 1 MiB of pathological JSON), so a burst of heavy
manifests drains the bucket as fast as the work it causes (issue 39), and a 1 MiB one costs 17."""

RATED_VERBS = frozenset({"plan", "confirm", "train"})
"""The verbs that cost the bucket a token: each parses a manifest and asks for a signed eligibility
statement (train and confirm also reserve). Reads (status, logs, runs, ...) are not rated."""

WAITING: frozenset[RunState] = frozenset({RunState.accepted, RunState.queued, RunState.interrupted})
"""A run in these states waits for a trainer: the `queued` quota counts them."""


def limits_from(fields: Mapping[str, str]) -> QuotaLimits:
    """The limits as stored (strings by field name); a field missing or unreadable is its default."""

    def number(name: str, default: float) -> float:
        try:
            value = float(fields[name])
        except (KeyError, ValueError):
            return default
        return value if math.isfinite(value) and value > 0 else default

    return QuotaLimits(
        rate_per_s=number("rate_per_s", DEFAULTS.rate_per_s),
        burst=int(number("burst", DEFAULTS.burst)),
        confirmations=int(number("confirmations", DEFAULTS.confirmations)),
        runs=int(number("runs", DEFAULTS.runs)),
        queued=int(number("queued", DEFAULTS.queued)),
        file_bytes=int(number("file_bytes", DEFAULTS.file_bytes)),
        files=int(number("files", DEFAULTS.files)),
        models=int(number("models", DEFAULTS.models)),
    )


def invalid_limit(name: str, value: float) -> str | None:
    """Why an operator's value for a limit is refused, or None."""
    if name not in FIELDS:
        return f"unknown quota {name!r}; one of {', '.join(FIELDS)}"
    if not math.isfinite(value) or value <= 0:
        return f"--{name.split('_')[0]} needs to be a positive number, got {value}"
    largest = MAX_BYTES_LIMIT if name == "file_bytes" else MAX_LIMIT
    if name != "rate_per_s" and (value != int(value) or value > largest):
        return f"--{name.replace('_', '-')} needs to be a whole number up to {largest}, got {value}"
    return None


@dataclass(frozen=True, slots=True)
class Taken:
    """The bucket after a take: whether it was admitted, the tokens left, and (when refused) how
    long until one is there again."""

    allowed: bool
    tokens: float
    retry_after_s: float
    rate_per_s: float = 0.0  # the limits it was taken under (0: not known), for the refusal's words
    burst: int = 0
    runs: int = 0  # the account's `runs` and `queued` limits, read in the same step (0: not read)
    queued: int = 0
    open_at_most: int | None = None
    """The size of the account's open-run set, read in the same step (None: not read): at least its
    unfinished runs, so that `may_breach` can spare a train the read of every open run."""


def request_cost(manifest_bytes: int) -> float:
    """The tokens a plan, confirm or train costs: 1, plus 1 per MANIFEST_BYTES_PER_TOKEN it carries."""
    return 1.0 + max(0, manifest_bytes) // MANIFEST_BYTES_PER_TOKEN


def take(
    tokens: float | None, at: float | None, now: float, rate: float, burst: float, cost: float = 1.0
) -> Taken:
    """The token bucket: `tokens` as of `at` (None: a new bucket, full), refilled at `rate` per second
    up to `burst`; admitted when `cost` tokens are there (cost 0: a look that takes nothing; a cost
    above `burst` costs `burst`, so that a full bucket always admits a request). A clock that went
    back refills nothing. BUCKET_LUA is the same arithmetic."""
    cost = min(cost, burst)
    if tokens is None or at is None:
        level = burst
    else:
        level = min(burst, tokens + max(0.0, now - at) * rate)
    if level >= cost:
        return Taken(True, level - cost, 0.0, rate, int(burst))
    return Taken(False, level, (cost - level) / rate, rate, int(burst))


REFUSAL_MEMORY_S = 1.0
"""How long a scheduler instance answers an account's empty bucket itself, without Redis: no
instance can add tokens, only time can, so "none before T" stays true; a flood's refusals then
cost no round trip. Short, so that an operator's raised rate applies within a second."""


def remembered(entry: tuple[float, float] | None, now: float) -> float | None:
    """A remembered refusal (remember until, no token before), as the retry-after it still means
    at `now` (local monotonic seconds); None when there is none or it is over."""
    if entry is None or now >= entry[0]:
        return None
    return max(0.0, entry[1] - now)


def memory_of(taken: "Taken", now: float) -> tuple[float, float] | None:
    """What to remember of a take: a refusal, for REFUSAL_MEMORY_S at most; an admission, nothing."""
    if taken.allowed:
        return None
    return now + min(REFUSAL_MEMORY_S, taken.retry_after_s), now + taken.retry_after_s


def rate_message(taken: Taken) -> str:
    return (
        f"over this account's request rate ({taken.rate_per_s:g}/s, bursts of {taken.burst}); "
        f"retry in {taken.retry_after_s:.2f} s"
    )


def over(quota: str, current: int, limit: int, what: str) -> tuple[QuotaBreach, str] | None:
    """The breach when one more would go over `limit`, with its message; else None."""
    if current < limit:
        return None
    return QuotaBreach(quota=quota, current=current, limit=limit), (
        f"quota {quota}: this account has {current} {what} and may have {limit}; "
        "wait for some to finish, or ask the operator for more"
    )


STORAGE_WORDS = {"file_bytes": "bytes of files and models", "files": "files", "models": "uploaded models"}


def storage_message(breach: QuotaBreach, needed_bytes: int) -> str:
    """Why an upload was refused for the account's storage quota, and what to do."""
    if breach.quota == "open_uploads":
        return (
            f"quota open_uploads: this account has {breach.current:,} uploads begun and not committed, "
            f"the most it may have open; finish them (`ecc ito files list` shows them) or let them expire"
        )
    what = STORAGE_WORDS.get(breach.quota, breach.quota)
    return (
        f"quota {breach.quota}: this account holds {breach.current:,} {what} and may hold "
        f"{breach.limit:,}; this upload needs {needed_bytes:,} bytes and one more: delete files "
        "(`ecc ito files delete`) or ask the operator for more"
    )


def confirmation_breach(outstanding: int, limit: int) -> tuple[QuotaBreach, str] | None:
    return over("confirmations", outstanding, limit, "outstanding confirmations")


def run_usage(states: Iterable[RunState]) -> tuple[int, int]:
    """(unfinished runs, waiting runs) among an account's runs' states."""
    unfinished = [s for s in states if s not in TERMINAL_STATES]
    return len(unfinished), sum(s in WAITING for s in unfinished)


def may_breach(limits: QuotaLimits | Taken, open_at_most: int) -> bool:
    """Could one more run go over `runs` or `queued`, when at most `open_at_most` runs are unfinished
    (waiting runs are among them)? If not, no run's state needs reading: the train path's quota
    gate then costs one count, however many runs the account has open (a read of every open run's
    view, each request, made the gate grow with the account's runs)."""
    return open_at_most >= min(limits.runs, limits.queued)


def run_breach(limits: QuotaLimits, states: Iterable[RunState]) -> tuple[QuotaBreach, str] | None:
    """May the account start one more run (it starts waiting)? The `runs` quota first, then `queued`."""
    unfinished, waiting = run_usage(states)
    return over("runs", unfinished, limits.runs, "unfinished runs") or over(
        "queued", waiting, limits.queued, "runs waiting for a trainer"
    )


BUCKET_LUA = """
local now = tonumber(ARGV[1])
if ARGV[1] == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local q = redis.call('HMGET', KEYS[2], 'rate_per_s', 'burst', 'runs', 'queued')
local rate = tonumber(q[1]) or tonumber(ARGV[2])
local burst = tonumber(q[2]) or tonumber(ARGV[3])
if rate <= 0 then rate = tonumber(ARGV[2]) end
if burst <= 0 then burst = tonumber(ARGV[3]) end
burst = math.floor(burst)
local cost = math.min(tonumber(ARGV[4]), burst)
local b = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local level = burst
if b[1] and b[2] then
  local elapsed = now - tonumber(b[2])
  if elapsed < 0 then elapsed = 0 end
  level = math.min(burst, tonumber(b[1]) + elapsed * rate)
end
local allowed, retry = 0, (cost - level) / rate
if level >= cost then
  level, allowed, retry = level - cost, 1, 0
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', level), 'at', string.format('%.17g', now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + 60000)
local open = -1
if KEYS[3] then open = redis.call('SCARD', KEYS[3]) end
return {allowed, string.format('%.17g', level), string.format('%.17g', retry), string.format('%.17g', rate), burst,
  q[3] or '', q[4] or '', open}
"""
"""`take` on the account's bucket (KEYS[1], a hash: tokens, at) with its limits (KEYS[2], the quota
hash; ARGV[2..3] the defaults), at the server's clock (ARGV[1] '': TIME; a number in tests), for
ARGV[4] tokens. With KEYS[3] (the account's open-run set) it also counts that set, and it returns
the `runs` and `queued` limits as stored ('' when unset): a train's run quota then needs no read of
its own. Every key carries the account's hash tag: one slot, one script, every scheduler
instance on the same bucket. A full bucket expires: an idle account costs no memory. A retry of
the script after a lost reply takes a second token (it is bounded: one request, one retry)."""

OUTSTANDING_LUA = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[1])
local open = 0
for _, ref in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if redis.call('HGET', ARGV[5] .. ref, 'consumed') == '1' then
    redis.call('ZREM', KEYS[1], ref)
  else
    open = open + 1
  end
end
if ARGV[3] == '' then return {1, open} end
if redis.call('ZSCORE', KEYS[1], ARGV[3]) then return {1, open} end
if open >= tonumber(ARGV[2]) then return {0, open} end
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[3])
return {1, open + 1}
"""
"""The account's outstanding confirmations (KEYS[1], a sorted set: ref by expiry): the expired and
the consumed ones (the record `ARGV[5]<ref>`, same slot, says `consumed`) leave it; then admit
ARGV[3] (expiring at ARGV[4]) when fewer than ARGV[2] remain ('': only count). A repeat of the same
ref is admitted once. Returns {admitted, outstanding}."""
