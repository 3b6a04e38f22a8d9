"""Redis access for runs: the run view, its logs, metrics and checkpoints, and the run indexes.

A run view changes only through `move()` (its state, by `lifecycle.move`: the one writer of that
fact) and `update()` (anything but its state: `lifecycle.NotAMove` otherwise), both an optimistic
compare-and-set (CAS_LUA) around a pure function, so concurrent writers (the event consumer, cancel,
the watcher) never lose each other's changes. A lease is a compare-and-set too (LEASE_LUA). Every
script touches the run's own key only, so it runs unchanged on Redis Cluster; the lease index is
split by run id (runtime/configuration/keys.py) and written beside the grant, idempotently.
"""

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

import msgspec

from contracts.api import LogLineView, RunView
from contracts.desk import StateRecord
from contracts.runs import CheckpointSaved, Metrics
from contracts.states import TERMINAL_STATES, RunState
from runtime.configuration.keys import Keys
from runtime.messaging.connections import RedisClient
from services.scheduler import lifecycle

MAX_LOG_LINES = 10_000  # per run; older lines are trimmed
MAX_METRIC_POINTS = 10_000
MAX_STATE_RECORDS = 1_000  # a run's state moves kept for the desk; a run makes a handful
UPDATE_RETRIES = 20
log = logging.getLogger("ito.scheduler.store")

_view_decoder = msgspec.json.Decoder(RunView)
_log_decoder = msgspec.json.Decoder(LogLineView)
_metrics_decoder = msgspec.json.Decoder(Metrics)
_checkpoint_decoder = msgspec.json.Decoder(CheckpointSaved)
_state_decoder = msgspec.json.Decoder(StateRecord)


MAX_SEQ_GAP = 100_000  # events lost in transit leave small gaps; a jump this large is forged


def in_order(epoch: int, seq: int, last_epoch: int, last_seq: int) -> bool:
    """Does (epoch, seq) come after the last applied (last_epoch, last_seq), by a plausible step?"""
    if epoch != last_epoch:
        return epoch > last_epoch and seq <= MAX_SEQ_GAP
    return last_seq < seq <= last_seq + MAX_SEQ_GAP


Position = tuple[float, str]
"""Where a run stands in its account's index: (creation time in epoch seconds, run id). The index
is ordered newest first by time, then by run id (descending) among runs created at the same time."""


@dataclass(frozen=True, slots=True)
class LeaseHeld:
    epoch: int  # 0: never leased
    holder: str  # "" when none
    seen: float  # the holder's last heartbeat (epoch seconds)


def lease_decision(
    view: RunView,
    held: LeaseHeld,
    trainer_id: str,
    epoch: int,
    now: float,
    silence_s: float,
    leasable: Callable[[RunView], bool],
) -> int | None:
    """The epoch granted (a renewal keeps the held one, a new lease gets the next), or None."""
    if not leasable(view):
        return None
    if epoch:  # a renewal: only the current holder's epoch
        return epoch if epoch == held.epoch else None
    if held.holder and held.holder != trainer_id and now - held.seen < silence_s:
        return None  # another live trainer holds it
    return held.epoch + 1


def lease_fields(node: int) -> tuple[str, str, str]:
    """The run record's fields of a node's lease (epoch, holder, seen): node 0's are the run's."""
    suffix = f":{node}" if node else ""
    return f"lease_epoch{suffix}", f"lease_holder{suffix}", f"lease_seen{suffix}"


def _text(raw: bytes | str | None) -> str:
    return "" if raw is None else raw.decode() if isinstance(raw, bytes) else raw


class Runs(Protocol):
    """The run store's port for the lease, the watcher and run writes (RunStore in Redis,
    memory.InMemoryRuns in table tests). `move` is the one writer of a run's state."""

    async def owner(self, run_id: str) -> str | None: ...
    async def get(self, account: str, run_id: str) -> RunView | None: ...
    async def update(
        self,
        account: str,
        run_id: str,
        seq: int | None,
        change: Callable[[RunView], RunView],
        holder_epoch: int | None = None,
    ) -> tuple[RunView | None, bool]: ...
    async def move(
        self,
        account: str,
        run_id: str,
        to: RunState | Mapping[RunState, RunState],
        *,
        allowed_from: frozenset[RunState] | None = None,
        at: datetime | None = None,
        seq: int | None = None,
        holder_epoch: int | None = None,
        **details: Any,
    ) -> tuple[RunView | None, bool]: ...
    async def lease(
        self,
        account: str,
        run_id: str,
        trainer_id: str,
        epoch: int,
        now: float,
        silence_s: float,
        leasable: Callable[[RunView], bool],
        node: int = 0,
    ) -> tuple[bool, RunView | None, int]: ...
    async def leased(self) -> dict[str, str]: ...
    async def lease_seen(self, account: str, run_id: str) -> float | None: ...
    async def release_lease(self, run_id: str) -> None: ...
    async def record_interruption(self, account: str, run_id: str, record: dict[str, Any]) -> None: ...


class RunRecords(Runs, Protocol):
    """Everything the scheduler's handlers keep about a run (Api, Mutations, Handoff, RunEvents):
    the `Runs` port plus creation, the answers kept beside a run, and its logs, metrics and
    checkpoints. RunStore in Redis, memory.InMemoryRuns in handler tests."""

    async def create(self, view: RunView, work: bytes | None = None) -> bool: ...
    async def remember(self, account: str, run_id: str, field: str, value: bytes) -> None: ...
    async def recall(self, account: str, run_id: str, field: str) -> bytes | None: ...
    async def log_count(self, account: str, run_id: str) -> int: ...
    async def append_log(self, account: str, run_id: str, line: LogLineView) -> None: ...
    async def logs(self, account: str, run_id: str, since: int, limit: int) -> list[LogLineView]: ...
    async def append_metrics(self, account: str, run_id: str, m: Metrics) -> None: ...
    async def metrics(self, account: str, run_id: str, since: int, limit: int) -> list[Metrics]: ...
    async def append_checkpoint(self, account: str, run_id: str, c: CheckpointSaved) -> None: ...
    async def checkpoints(self, account: str, run_id: str) -> list[CheckpointSaved]: ...
    async def forget_checkpoints(self, account: str, run_id: str) -> None: ...
    async def interruptions(self, account: str, run_id: str) -> list[dict[str, Any]]: ...
    async def states(self, account: str, run_id: str) -> list[StateRecord]: ...
    async def newest(self, limit: int) -> list[RunView]: ...
    async def account_runs(
        self, account: str, after: Position | None, count: int
    ) -> list[tuple[Position, RunView | None]]: ...
    async def open_states(self, account: str) -> list[RunState]:
        """The states of the account's unfinished runs (its `runs` and `queued` quotas)."""
        ...

    async def open_at_most(self, account: str) -> int:
        """At least the number of the account's unfinished runs, in one cheap read."""
        ...


CAS_FIELDS = ("view", "last_seq", "last_epoch", "lease_epoch")
CAS_LUA = """
local cur = redis.call('HMGET', KEYS[1], 'view', 'last_seq', 'last_epoch', 'lease_epoch')
for i = 1, 4 do
  if (cur[i] or '') ~= ARGV[i] then return 0 end
end
redis.call('HSET', KEYS[1], 'view', ARGV[5])
if ARGV[6] ~= '' then redis.call('HSET', KEYS[1], 'last_seq', ARGV[6], 'last_epoch', ARGV[7]) end
if ARGV[8] ~= '' and KEYS[2] then
  redis.call('RPUSH', KEYS[2], ARGV[8])
  redis.call('LTRIM', KEYS[2], -tonumber(ARGV[9]), -1)
end
return 1
"""
"""Write a run's new view only if the fields it was computed from are unchanged (compare and set,
one round trip after the read; the caller retries on a lost race, as a WATCH would make it). A
write that moves the state appends its StateRecord (ARGV[8]) to the run's state history (KEYS[2],
same slot) in the same step, so the history is exactly the moves that were applied."""


LEASE_LUA = """
local cur = redis.call('HMGET', KEYS[1], 'view', ARGV[1], ARGV[2], ARGV[3])
for i = 1, 4 do
  if (cur[i] or '') ~= ARGV[i + 3] then return 0 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[8], ARGV[2], ARGV[9], ARGV[3], ARGV[10])
return 1
"""
"""Write a node's lease (ARGV[1..3]: its epoch, holder and seen fields) only if the view and the
lease it was decided on (ARGV[4..7], as read) are unchanged; the new epoch, holder and heartbeat
are ARGV[8..10]. A repeat after a lost reply finds the heartbeat moved and writes nothing."""


def state_record(old: RunView, new: RunView) -> StateRecord | None:
    """The history entry of a write: one when it moves the state, else None."""
    if new.state == old.state:
        return None
    return StateRecord(state=new.state, at=new.updated_at, message=new.message)


def index_member(view: RunView) -> str:
    """A run's entry in the desk's run index: `<account>:<run id>` (run ids hold no ':')."""
    return f"{view.account}:{view.run_id}"


def _bytes(raw: bytes | str | None) -> bytes:
    return b"" if raw is None else raw.encode() if isinstance(raw, str) else raw


class RunStore:
    def __init__(self, r: RedisClient, keys: Keys) -> None:
        self.r = r
        self.keys = keys
        self._cas = r.register_script(CAS_LUA)
        self._lease = r.register_script(LEASE_LUA)

    async def create(self, view: RunView, work: bytes | None = None) -> bool:
        """Create the run view if absent, with its work item kept beside it (for an approved
        restart): one round trip, every command idempotent (the reconciler repeats it with the
        same view). Returns whether it was created."""
        key = self.keys.run(view.account, view.run_id)
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.hsetnx(key, "view", msgspec.json.encode(view))
            pipe.hsetnx(key, "last_seq", 0)
            if work is not None:
                pipe.hsetnx(key, "work", work)
            pipe.set(self.keys.run_owner(view.run_id), view.account)
            pipe.zadd(self.keys.runs(view.account), {view.run_id: view.created_at.timestamp()})
            pipe.sadd(self.keys.open_runs(view.account), view.run_id)  # left when found finished
            pipe.zadd(self.keys.run_index(view.run_id), {index_member(view): view.created_at.timestamp()})
            created, *_ = await pipe.execute()
        return bool(created)

    async def owner(self, run_id: str) -> str | None:
        raw = await self.r.get(self.keys.run_owner(run_id))
        return None if raw is None else _text(raw)

    async def get(self, account: str, run_id: str) -> RunView | None:
        raw = await self.r.hget(self.keys.run(account, run_id), "view")
        return None if raw is None else _view_decoder.decode(raw)

    async def update(
        self,
        account: str,
        run_id: str,
        seq: int | None,
        change: Callable[[RunView], RunView],
        holder_epoch: int | None = None,
    ) -> tuple[RunView | None, bool]:
        """Apply `change`, which must leave the state alone (`move` changes it), as `_write` does."""

        return await self._write(account, run_id, seq, lifecycle.keeping_state(change), holder_epoch)

    async def move(
        self,
        account: str,
        run_id: str,
        to: RunState | Mapping[RunState, RunState],
        *,
        allowed_from: frozenset[RunState] | None = None,
        at: datetime | None = None,
        seq: int | None = None,
        holder_epoch: int | None = None,
        **details: Any,
    ) -> tuple[RunView | None, bool]:
        """Move the run with `lifecycle.move` (see there) atomically; (view, applied) as `_write`."""
        when = at or datetime.now(UTC)
        return await self._write(
            account,
            run_id,
            seq,
            lifecycle.mover(to, when, allowed_from=allowed_from, **details),
            holder_epoch,
        )

    async def _write(
        self,
        account: str,
        run_id: str,
        seq: int | None,
        change: Callable[[RunView], RunView],
        holder_epoch: int | None = None,
    ) -> tuple[RunView | None, bool]:
        """Apply `change` atomically: (view, applied). A trainer event comes with `holder_epoch` and
        `seq`, its counter within the epoch: it applies only from the current lease holder (a
        fenced trainer's, or any when no lease was ever granted, are skipped), only after the last
        applied (epoch, seq) (a redelivery or duplicate is skipped) and never more than
        MAX_SEQ_GAP ahead of it (a forged far-future seq would block every later event). No wall
        clock is involved, so a trainer whose clock is off still has every event applied in order.
        The scheduler's own transitions come without either and go through the same compare-and-set,
        so they are serialized with the events. `applied` is False when skipped."""
        key = self.keys.run(account, run_id)
        for _ in range(UPDATE_RETRIES):
            raw, last, last_epoch, lease_epoch = await self.r.hmget(key, list(CAS_FIELDS))
            if raw is None:
                return None, False
            view = _view_decoder.decode(raw)
            if holder_epoch is not None and not (0 < int(lease_epoch or 0) == holder_epoch):
                return view, False
            if seq is not None and not in_order(holder_epoch or 0, seq, int(last_epoch or 0), int(last or 0)):
                return view, False
            new = change(view)
            seen = [_bytes(v) for v in (raw, last, last_epoch, lease_epoch)]
            moved = state_record(view, new)
            written = await self._cas(
                keys=[key, self.keys.run_states(account, run_id)],
                args=[
                    *seen,
                    msgspec.json.encode(new),
                    "" if seq is None else seq,
                    "" if seq is None else holder_epoch or 0,
                    b"" if moved is None else msgspec.json.encode(moved),
                    MAX_STATE_RECORDS,
                ],
            )
            if written:
                return new, True
        raise RuntimeError(f"run {run_id}: too much contention updating the view")

    async def append_log(self, account: str, run_id: str, line: LogLineView) -> None:
        key = self.keys.run_logs(account, run_id)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.rpush(key, msgspec.json.encode(line))
            pipe.ltrim(key, -MAX_LOG_LINES, -1)
            await pipe.execute()

    async def log_count(self, account: str, run_id: str) -> int:
        return await self.r.llen(self.keys.run_logs(account, run_id))

    async def logs(self, account: str, run_id: str, since: int, limit: int) -> list[LogLineView]:
        raw = await self.r.lrange(self.keys.run_logs(account, run_id), since, since + limit - 1)
        return [_log_decoder.decode(x) for x in raw]

    async def append_metrics(self, account: str, run_id: str, m: Metrics) -> None:
        key = self.keys.run_metrics(account, run_id)
        async with self.r.pipeline(transaction=True) as pipe:
            pipe.rpush(key, msgspec.json.encode(m))
            pipe.ltrim(key, -MAX_METRIC_POINTS, -1)
            await pipe.execute()

    async def metrics(self, account: str, run_id: str, since: int, limit: int) -> list[Metrics]:
        raw = await self.r.lrange(self.keys.run_metrics(account, run_id), since, since + limit - 1)
        return [_metrics_decoder.decode(x) for x in raw]

    async def append_checkpoint(self, account: str, run_id: str, c: CheckpointSaved) -> None:
        await self.r.rpush(self.keys.run_checkpoints(account, run_id), msgspec.json.encode(c))

    async def checkpoints(self, account: str, run_id: str) -> list[CheckpointSaved]:
        raw = await self.r.lrange(self.keys.run_checkpoints(account, run_id), 0, -1)
        return [_checkpoint_decoder.decode(x) for x in raw]

    async def forget_checkpoints(self, account: str, run_id: str) -> None:
        await self.r.delete(self.keys.run_checkpoints(account, run_id))

    async def remember(self, account: str, run_id: str, field: str, value: bytes) -> None:
        """Keep an answer beside the run (a cleanup's result, for replays)."""
        await self.r.hset(self.keys.run(account, run_id), field, value)

    async def recall(self, account: str, run_id: str, field: str) -> bytes | None:
        raw = await self.r.hget(self.keys.run(account, run_id), field)
        return raw.encode() if isinstance(raw, str) else raw

    # --- leases: which trainer may train a run, fenced by a growing epoch ---

    async def lease(
        self,
        account: str,
        run_id: str,
        trainer_id: str,
        epoch: int,
        now: float,
        silence_s: float,
        leasable: Callable[[RunView], bool],
        node: int = 0,
    ) -> tuple[bool, RunView | None, int]:
        """Grant (epoch 0) or renew (the held epoch) a run's lease: (granted, view, epoch); the
        decision is `lease_decision`'s, written by a compare-and-set on the run key (LEASE_LUA;
        a lost race reads and decides again). Node n > 0 of a multi-node run has its own fields
        (`lease_epoch:n`, ...) and stays out of the watcher's index.

        A new lease of node 0 enters the run in the lease index (another slot) before the grant is
        written: the entry is idempotent, and an entry whose grant then loses the race is harmless
        (the watcher finds the run not running, or releases it once finished), while a grant
        without its entry would leave a lost trainer unnoticed."""
        key = self.keys.run(account, run_id)
        epoch_f, holder_f, seen_f = lease_fields(node)
        indexed = False
        for _ in range(UPDATE_RETRIES):
            raw, cur, holder, seen = await self.r.hmget(key, ["view", epoch_f, holder_f, seen_f])
            if raw is None:
                return False, None, 0
            view = _view_decoder.decode(raw)
            held = LeaseHeld(int(cur or 0), _text(holder), float(seen or 0))
            grant = lease_decision(view, held, trainer_id, epoch, now, silence_s, leasable)
            if grant is None:
                return False, view, held.epoch
            renewal = grant == held.epoch  # a renewal: only the heartbeat moves
            if node == 0 and not renewal and not indexed:
                await self.r.hset(self.keys.leased(run_id), run_id, account)
                indexed = True
            written = await self._lease(
                keys=[key],
                args=[
                    epoch_f,
                    holder_f,
                    seen_f,
                    *(_bytes(v) for v in (raw, cur, holder, seen)),
                    grant,
                    held.holder if renewal else trainer_id,
                    repr(now),
                ],
            )
            if written:
                return True, view, grant
        raise RuntimeError(f"run {run_id}: too much contention on its lease")

    async def leased(self) -> dict[str, str]:
        """Every run in the lease index (run id -> account): each shard, in one pipeline."""
        async with self.r.pipeline(transaction=False) as pipe:
            for name in self.keys.leased_shards():
                pipe.hgetall(name)
            shards = await pipe.execute()
        return {_text(k): _text(v) for entries in shards for k, v in entries.items()}

    async def lease_seen(self, account: str, run_id: str) -> float | None:
        raw = await self.r.hget(self.keys.run(account, run_id), "lease_seen")
        return None if raw is None else float(raw)

    async def release_lease(self, run_id: str) -> None:
        legacy = self.keys.leased_shards()[-1]  # the index before it was split may still hold the run
        async with self.r.pipeline(transaction=False) as pipe:
            pipe.hdel(self.keys.leased(run_id), run_id)
            pipe.hdel(legacy, run_id)
            await pipe.execute()

    async def record_interruption(self, account: str, run_id: str, record: dict) -> None:
        await self.r.rpush(self.keys.run_interruptions(account, run_id), msgspec.json.encode(record))

    async def interruptions(self, account: str, run_id: str) -> list[dict]:
        return [
            msgspec.json.decode(x)
            for x in await self.r.lrange(self.keys.run_interruptions(account, run_id), 0, -1)
        ]

    # --- the desk's reads: every run, and a run's history ---

    async def states(self, account: str, run_id: str) -> list[StateRecord]:
        raw = await self.r.lrange(self.keys.run_states(account, run_id), 0, -1)
        return [_state_decoder.decode(x) for x in raw]

    async def newest(self, limit: int) -> list[RunView]:
        """The newest `limit` runs of every account (each index shard's newest, merged), oldest
        last. Runs created before the index existed are not in it."""
        async with self.r.pipeline(transaction=False) as pipe:
            for name in self.keys.run_index_shards():
                pipe.zrevrange(name, 0, limit - 1, withscores=True)
            shards = await pipe.execute()
        entries = sorted(
            ((score, _text(member)) for shard in shards for member, score in shard), reverse=True
        )[:limit]
        if not entries:
            return []
        async with self.r.pipeline(transaction=False) as pipe:
            for _, member in entries:
                account, _, run_id = member.rpartition(":")
                pipe.hget(self.keys.run(account, run_id), "view")
            raws = await pipe.execute()
        return [_view_decoder.decode(raw) for raw in raws if raw is not None]

    async def open_at_most(self, account: str) -> int:
        """The open-run set's size: every unfinished run is in it (and finished ones not yet seen)."""
        return int(await self.r.scard(self.keys.open_runs(account)))

    async def open_states(self, account: str) -> list[RunState]:
        """The account's open-run set (a run enters it when created), read with each view; a run
        found finished (or gone) leaves the set here, so it holds about the unfinished runs only."""
        key = self.keys.open_runs(account)
        run_ids = [_text(m) for m in await self.r.smembers(key)]
        if not run_ids:
            return []
        async with self.r.pipeline(transaction=False) as pipe:
            for run_id in run_ids:
                pipe.hget(self.keys.run(account, run_id), "view")
            raws = await pipe.execute()
        views = {
            run_id: None if raw is None else _view_decoder.decode(raw)
            for run_id, raw in zip(run_ids, raws, strict=True)
        }
        done = [run_id for run_id, v in views.items() if v is None or v.state in TERMINAL_STATES]
        if done:
            await self.r.srem(key, *done)
        return [v.state for v in views.values() if v is not None and v.state not in TERMINAL_STATES]

    # --- the tenant's read: one account's runs ---

    async def account_runs(
        self, account: str, after: Position | None, count: int
    ) -> list[tuple[Position, RunView | None]]:
        """Up to `count` of the account's runs after `after` (None: from the newest), newest first,
        each with its view (None if the view is gone). Read from the account's own index (`<ns>:
        {<account>}:runs`, written beside the view when the run is created, since the first
        version of the store), so no other account's run is ever read. After a position: the runs
        created at the same instant with a smaller run id, then the older ones."""
        key = self.keys.runs(account)
        async with self.r.pipeline(transaction=False) as pipe:
            if after is None:
                pipe.zrevrange(key, 0, count - 1, withscores=True)
            else:
                at, run_id = after
                pipe.zrevrangebyscore(key, repr(at), repr(at), withscores=True)  # the same instant
                pipe.zrevrangebyscore(key, f"({at!r}", "-inf", start=0, num=count, withscores=True)
            ranges = await pipe.execute()
        found = [(float(score), _text(member)) for entries in ranges for member, score in entries]
        if after is not None:
            found = [(at, run) for at, run in found if at < after[0] or run < after[1]]
        found = found[:count]
        if not found:
            return []
        async with self.r.pipeline(transaction=False) as pipe:
            for _, run_id in found:
                pipe.hget(self.keys.run(account, run_id), "view")
            raws = await pipe.execute()
        return [
            (position, None if raw is None else _view_decoder.decode(raw))
            for position, raw in zip(found, raws, strict=True)
        ]
