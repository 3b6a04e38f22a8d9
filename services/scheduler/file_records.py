"""The records of a tenant's uploads and files, and what they take of its storage quotas: the one
writer of those facts is the scheduler, through this port (`FileRecords`: Redis in the service, in
memory in the handler tests; the same tests run on both).

An upload is begun once per (account, kind, name, files): asking again while it is open answers
the same upload, so a client that stopped resumes it. Beginning one reserves its bytes and one file
(or one model) against the account's `file_bytes` and `files` (or `models`) quotas, in the same
atomic step that records it (BEGIN_LUA); a rejected or expired upload gives them back (RELEASE_LUA,
once: a repeat releases nothing); a ready data upload becomes a file that keeps them (FINISH_LUA)
until it is deleted (DELETE_LUA). Every script touches one account's keys (one hash tag: one slot).
"""

from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

import msgspec

from contracts.errors import QuotaBreach
from contracts.files import FilePurpose, FileView, UploadFile, UploadKind
from contracts.manifest import DataFormat
from runtime.configuration.keys import Keys, shard
from runtime.messaging.connections import RedisClient


class UploadRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What the scheduler keeps of an upload (internal; an older reader skips new fields)."""

    upload_id: str
    account: str
    kind: UploadKind
    name: str
    purpose: FilePurpose = FilePurpose.train
    format: DataFormat | None = None
    files: list[UploadFile]
    state: str = "uploading"  # "uploading", "checking", "ready", "rejected", "expired"
    created_at: datetime
    expires_at: datetime
    spec: str = ""  # the digest of (kind, name, purpose, format, files): an open upload's identity
    problems: list[str] = []
    more_problems: int = 0
    message: str | None = None
    file_id: str | None = None  # a ready data upload's file
    model: str | None = None  # a ready model upload's name

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)

    @property
    def counts(self) -> str:
        """The quota an upload takes one of: `files` or `models`."""
        return "models" if self.kind is UploadKind.model else "files"


_upload_decoder = msgspec.json.Decoder(UploadRecord)
_file_decoder = msgspec.json.Decoder(FileView)
OPEN = ("uploading", "checking")
MAX_OPEN_UPLOADS = 16  # an account's uploads begun and not yet committed (each holds a check's queue place)


@dataclass(frozen=True, slots=True)
class StorageLimits:
    file_bytes: int
    files: int
    models: int
    open_uploads: int = MAX_OPEN_UPLOADS


class FileRecords(Protocol):
    async def begin(
        self, record: UploadRecord, limits: StorageLimits
    ) -> tuple[UploadRecord | None, QuotaBreach | None]:
        """The open upload of the same spec, else `record` made (its bytes reserved), else the breach."""
        ...

    async def upload(self, account: str, upload_id: str) -> UploadRecord | None: ...

    async def save(self, record: UploadRecord) -> None:
        """An open upload's record as it changes (state `checking`)."""
        ...

    async def claim(self, record: UploadRecord, owner: str, now: float, until: float) -> bool:
        """The upload's check (or expiry) is `owner`'s until `until`; False: another's is live, or
        the upload is over."""
        ...

    async def release(self, record: UploadRecord) -> bool:
        """A rejected or expired upload: recorded so, and its reservation given back (once); False
        when it was kept meanwhile (then nothing changes)."""
        ...

    async def finish(self, record: UploadRecord, file: FileView | None) -> bool:
        """A ready upload: recorded so; a data upload's file recorded, keeping its reservation.
        False when the reservation was released meanwhile (nothing is recorded)."""
        ...

    async def file(self, account: str, file_id: str) -> FileView | None: ...

    async def file_by_digest(self, account: str, sha256: str) -> FileView | None: ...

    async def files(self, account: str) -> list[FileView]: ...

    async def open_uploads(self, account: str) -> list[UploadRecord]: ...

    async def delete(self, account: str, file_id: str) -> FileView | None:
        """The file's record removed and its bytes given back; None when there was none."""
        ...

    async def usage(self, account: str) -> dict[str, int]:
        """{"file_bytes", "files", "models"} the account holds and has reserved."""
        ...

    async def later(self, account: str, upload_id: str, at: float | None) -> None:
        """Look at the upload again at `at` (epoch s; None: never again): its expiry while it is
        open, the sweep of what a late presigned PUT left once it is over."""
        ...

    async def expired(self, now: float, limit: int = 100) -> list[tuple[str, str]]:
        """(account, upload id) of uploads due a look (`later`, first at their expiry), oldest first."""
        ...


# --- Redis ---------------------------------------------------------------------------------------

BEGIN_LUA = """
local existing = redis.call('GET', KEYS[1])
if existing then return {'existing', existing} end
local limit_bytes = tonumber(ARGV[5])
local limit_count = tonumber(ARGV[6])
local s = redis.call('HMGET', KEYS[4], 'file_bytes', ARGV[4])
local used_bytes = tonumber(s[1]) or 0
local used_count = tonumber(s[2]) or 0
local open = redis.call('ZCARD', KEYS[3])
if open + 1 > tonumber(ARGV[9]) then
  return {'breach', 'open_uploads', tostring(open), ARGV[9]}
end
if used_bytes + tonumber(ARGV[3]) > limit_bytes then
  return {'breach', 'file_bytes', tostring(used_bytes), tostring(limit_bytes)}
end
if used_count + 1 > limit_count then
  return {'breach', ARGV[4], tostring(used_count), tostring(limit_count)}
end
redis.call('HINCRBY', KEYS[4], 'file_bytes', ARGV[3])
redis.call('HINCRBY', KEYS[4], ARGV[4], 1)
redis.call('HSET', KEYS[2], 'json', ARGV[2], 'held', '1')
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[7])
redis.call('ZADD', KEYS[3], ARGV[8], ARGV[1])
return {'created', ARGV[1]}
"""
"""KEYS: the spec's key, the upload's record, the account's open uploads, its usage. ARGV: upload
id, record, bytes, the count's name (files|models), the account's byte and count limits (the
scheduler read them: domain/quotas.py), the spec key's lifetime (ms), the expiry (epoch s)."""

RELEASE_LUA = """
local held = redis.call('HGET', KEYS[1], 'held')
if held == 'kept' then return 0 end
redis.call('HSET', KEYS[1], 'json', ARGV[2], 'held', '0')
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('GET', KEYS[4]) == ARGV[1] then redis.call('DEL', KEYS[4]) end
if held == '1' then
  redis.call('HINCRBY', KEYS[3], 'file_bytes', -tonumber(ARGV[3]))
  redis.call('HINCRBY', KEYS[3], ARGV[4], -1)
  return 1
end
return 0
"""
"""KEYS: the record, the open uploads, the usage, the spec's key. ARGV: upload id, record, bytes,
the count's name. Gives the reservation back only while it is held: a repeat gives nothing, and a
kept upload (its file counts) is never released."""

FINISH_LUA = """
if redis.call('HGET', KEYS[1], 'held') ~= '1' then return 0 end
redis.call('HSET', KEYS[1], 'json', ARGV[2], 'held', 'kept')
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('GET', KEYS[3]) == ARGV[1] then redis.call('DEL', KEYS[3]) end
if ARGV[3] ~= '' then
  redis.call('SET', KEYS[4], ARGV[3])
  redis.call('ZADD', KEYS[5], ARGV[5], ARGV[4])
  redis.call('SET', KEYS[6], ARGV[4])
end
return 1
"""
"""KEYS: the record, the open uploads, the spec's key, the file's record, the account's files, the
file's digest key. ARGV: upload id, record, the file ('' for a model), its id, its creation time.
Only while the reservation is held (0 otherwise: it was released meanwhile, the file is not
recorded and its caller removes it): a file is never kept without the bytes it counts."""

CLAIM_LUA = """
if redis.call('HGET', KEYS[1], 'held') ~= '1' then return 0 end
local owner = redis.call('HGET', KEYS[1], 'claim_owner')
local untl = tonumber(redis.call('HGET', KEYS[1], 'claim_until') or '0')
if owner and owner ~= ARGV[1] and untl > tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], 'claim_owner', ARGV[1], 'claim_until', ARGV[3])
return 1
"""
"""KEYS: the record. ARGV: the claimant, now, until (epoch s). One check (or expiry) of an upload at a
time across every scheduler instance: the claim is taken while the reservation is held and no
other claimant's is live; a claimant that died leaves a claim that runs out."""

DELETE_LUA = """
local raw = redis.call('GET', KEYS[1])
if not raw then return false end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
if redis.call('GET', KEYS[4]) == ARGV[1] then redis.call('DEL', KEYS[4]) end
redis.call('HINCRBY', KEYS[3], 'file_bytes', -tonumber(ARGV[2]))
redis.call('HINCRBY', KEYS[3], 'files', -1)
return raw
"""
"""KEYS: the file's record, the account's files, its usage, the file's digest key. ARGV: file id,
its bytes. Returns the record removed (nil: there was none, nothing given back)."""

SPEC_KEPT_MS = 7 * 24 * 3600 * 1000  # an open upload's spec key outlives any upload's expiry


def _epoch(moment: datetime) -> float:
    return moment.timestamp()


class RedisFileRecords:
    def __init__(self, redis: RedisClient, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._begin = redis.register_script(BEGIN_LUA)
        self._release = redis.register_script(RELEASE_LUA)
        self._finish = redis.register_script(FINISH_LUA)
        self._claim = redis.register_script(CLAIM_LUA)
        self._delete = redis.register_script(DELETE_LUA)

    def _k(self, account: str, rest: str) -> str:
        return f"{self.keys.account(account)}:{rest}"

    def _expiry(self, account: str) -> str:
        return f"{self.keys.ns}:upload-expiry:{shard(account)}"

    async def begin(
        self, record: UploadRecord, limits: StorageLimits
    ) -> tuple[UploadRecord | None, QuotaBreach | None]:
        a = record.account
        count_limit = limits.models if record.counts == "models" else limits.files
        result = await self._begin(
            keys=[
                self._k(a, f"upload-spec:{record.spec}"),
                self._k(a, f"upload:{record.upload_id}"),
                self._k(a, "uploads"),
                self._k(a, "stored"),
            ],
            args=[
                record.upload_id,
                msgspec.json.encode(record),
                record.bytes,
                record.counts,
                limits.file_bytes,
                count_limit,
                SPEC_KEPT_MS,
                _epoch(record.expires_at),
                limits.open_uploads,
            ],
        )
        kind = _text(result[0])
        if kind == "breach":
            quota, current, limit = (_text(v) for v in result[1:4])
            return None, QuotaBreach(quota=quota, current=int(float(current)), limit=int(float(limit)))
        upload_id = _text(result[1])
        if kind == "created":
            await self.redis.zadd(self._expiry(a), {f"{a}/{upload_id}": _epoch(record.expires_at)})
            return record, None
        existing = await self.upload(a, upload_id)
        return existing, None

    async def upload(self, account: str, upload_id: str) -> UploadRecord | None:
        raw = await self.redis.hget(self._k(account, f"upload:{upload_id}"), "json")
        return None if raw is None else _upload_decoder.decode(raw)

    async def save(self, record: UploadRecord) -> None:
        await self.redis.hset(
            self._k(record.account, f"upload:{record.upload_id}"), "json", msgspec.json.encode(record)
        )

    async def claim(self, record: UploadRecord, owner: str, now: float, until: float) -> bool:
        key = self._k(record.account, f"upload:{record.upload_id}")
        return bool(await self._claim(keys=[key], args=[owner, now, until]))

    async def release(self, record: UploadRecord) -> bool:
        a = record.account
        released = await self._release(
            keys=[
                self._k(a, f"upload:{record.upload_id}"),
                self._k(a, "uploads"),
                self._k(a, "stored"),
                self._k(a, f"upload-spec:{record.spec}"),
            ],
            args=[record.upload_id, msgspec.json.encode(record), record.bytes, record.counts],
        )
        return bool(released) or await self._held(record) == "0"

    async def _held(self, record: UploadRecord) -> str:
        return _text(
            await self.redis.hget(self._k(record.account, f"upload:{record.upload_id}"), "held") or b""
        )

    async def finish(self, record: UploadRecord, file: FileView | None) -> bool:
        a = record.account
        file_id = file.file_id if file is not None else "-"
        finished = await self._finish(
            keys=[
                self._k(a, f"upload:{record.upload_id}"),
                self._k(a, "uploads"),
                self._k(a, f"upload-spec:{record.spec}"),
                self._k(a, f"file:{file_id}"),
                self._k(a, "files"),
                self._k(a, f"file-digest:{file.sha256 if file is not None else '-'}"),
            ],
            args=[
                record.upload_id,
                msgspec.json.encode(record),
                msgspec.json.encode(file) if file is not None else "",
                file_id,
                _epoch(file.created_at) if file is not None else 0,
            ],
        )
        return bool(finished)

    async def later(self, account: str, upload_id: str, at: float | None) -> None:
        member = f"{account}/{upload_id}"
        if at is None:
            await self.redis.zrem(self._expiry(account), member)
        else:
            await self.redis.zadd(self._expiry(account), {member: at})

    async def file(self, account: str, file_id: str) -> FileView | None:
        raw = await self.redis.get(self._k(account, f"file:{file_id}"))
        return None if raw is None else _file_decoder.decode(raw)

    async def file_by_digest(self, account: str, sha256: str) -> FileView | None:
        file_id = await self.redis.get(self._k(account, f"file-digest:{sha256}"))
        return None if file_id is None else await self.file(account, _text(file_id))

    async def files(self, account: str) -> list[FileView]:
        ids = await self.redis.zrevrange(self._k(account, "files"), 0, -1)
        if not ids:
            return []
        raws = await self.redis.mget([self._k(account, f"file:{_text(i)}") for i in ids])
        return [_file_decoder.decode(r) for r in raws if r is not None]

    async def open_uploads(self, account: str) -> list[UploadRecord]:
        ids = await self.redis.zrange(self._k(account, "uploads"), 0, -1)
        found = [await self.upload(account, _text(i)) for i in ids]
        return [r for r in found if r is not None and r.state in OPEN]

    async def delete(self, account: str, file_id: str) -> FileView | None:
        current = await self.file(account, file_id)
        if current is None:
            return None
        raw = await self._delete(
            keys=[
                self._k(account, f"file:{file_id}"),
                self._k(account, "files"),
                self._k(account, "stored"),
                self._k(account, f"file-digest:{current.sha256}"),
            ],
            args=[file_id, current.bytes],
        )
        return None if not raw else _file_decoder.decode(raw)

    async def usage(self, account: str) -> dict[str, int]:
        raw = await self.redis.hgetall(self._k(account, "stored"))
        stored = {_text(k): int(_text(v)) for k, v in raw.items()}
        return {name: max(0, stored.get(name, 0)) for name in ("file_bytes", "files", "models")}

    async def expired(self, now: float, limit: int = 100) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for i in range(16):
            key = f"{self.keys.ns}:upload-expiry:{i}"
            for member in await self.redis.zrangebyscore(key, "-inf", now, start=0, num=limit):
                account, _, upload_id = _text(member).partition("/")
                out.append((account, upload_id))
        return out[:limit]


def _text(raw: object) -> str:
    """A Redis reply as text (our clients read bytes; redis-py's types cannot know that)."""
    return raw.decode() if isinstance(raw, bytes) else str(raw)


# --- in memory (handler tests) -------------------------------------------------------------------


@dataclass
class InMemoryFileRecords:
    """The same rules in one process (tests): what the scripts above do, step for step."""

    uploads: dict[tuple[str, str], UploadRecord] = field(default_factory=dict)
    held: dict[tuple[str, str], str] = field(default_factory=dict)
    specs: dict[tuple[str, str], str] = field(default_factory=dict)
    stored: dict[str, dict[str, int]] = field(default_factory=dict)
    records: dict[tuple[str, str], FileView] = field(default_factory=dict)
    digests: dict[tuple[str, str], str] = field(default_factory=dict)
    claims: dict[tuple[str, str], tuple[str, float]] = field(default_factory=dict)
    due: dict[tuple[str, str], float] = field(default_factory=dict)

    async def begin(
        self, record: UploadRecord, limits: StorageLimits
    ) -> tuple[UploadRecord | None, QuotaBreach | None]:
        a = record.account
        existing = self.specs.get((a, record.spec))
        if existing is not None:
            return self.uploads[(a, existing)], None
        usage = self.stored.setdefault(a, {"file_bytes": 0, "files": 0, "models": 0})
        open_now = len([k for k, held in self.held.items() if k[0] == a and held == "1"])
        if open_now + 1 > limits.open_uploads:
            return None, QuotaBreach(quota="open_uploads", current=open_now, limit=limits.open_uploads)
        count_limit = limits.models if record.counts == "models" else limits.files
        if usage["file_bytes"] + record.bytes > limits.file_bytes:
            return None, QuotaBreach(quota="file_bytes", current=usage["file_bytes"], limit=limits.file_bytes)
        if usage[record.counts] + 1 > count_limit:
            return None, QuotaBreach(quota=record.counts, current=usage[record.counts], limit=count_limit)
        usage["file_bytes"] += record.bytes
        usage[record.counts] += 1
        self.uploads[(a, record.upload_id)] = record
        self.held[(a, record.upload_id)] = "1"
        self.specs[(a, record.spec)] = record.upload_id
        self.due[(a, record.upload_id)] = record.expires_at.timestamp()
        return record, None

    async def upload(self, account: str, upload_id: str) -> UploadRecord | None:
        return self.uploads.get((account, upload_id))

    async def save(self, record: UploadRecord) -> None:
        self.uploads[(record.account, record.upload_id)] = record

    async def claim(self, record: UploadRecord, owner: str, now: float, until: float) -> bool:
        key = (record.account, record.upload_id)
        if self.held.get(key) != "1":
            return False
        holder = self.claims.get(key)
        if holder is not None and holder[0] != owner and holder[1] > now:
            return False
        self.claims[key] = (owner, until)
        return True

    async def release(self, record: UploadRecord) -> bool:
        a, key = record.account, (record.account, record.upload_id)
        if self.held.get(key) == "kept":
            return False
        self.uploads[key] = record
        if self.specs.get((a, record.spec)) == record.upload_id:
            del self.specs[(a, record.spec)]
        if self.held.get(key) == "1":
            usage = self.stored[a]
            usage["file_bytes"] -= record.bytes
            usage[record.counts] -= 1
        self.held[key] = "0"
        return True

    async def finish(self, record: UploadRecord, file: FileView | None) -> bool:
        a, key = record.account, (record.account, record.upload_id)
        if self.held.get(key) != "1":
            return False
        self.uploads[key] = record
        self.held[key] = "kept"
        if self.specs.get((a, record.spec)) == record.upload_id:
            del self.specs[(a, record.spec)]
        if file is not None:
            self.records[(a, file.file_id)] = file
            self.digests[(a, file.sha256)] = file.file_id
        return True

    async def file(self, account: str, file_id: str) -> FileView | None:
        return self.records.get((account, file_id))

    async def file_by_digest(self, account: str, sha256: str) -> FileView | None:
        file_id = self.digests.get((account, sha256))
        return None if file_id is None else self.records.get((account, file_id))

    async def files(self, account: str) -> list[FileView]:
        mine = [f for (a, _), f in self.records.items() if a == account]
        return sorted(mine, key=lambda f: (f.created_at, f.file_id), reverse=True)

    async def open_uploads(self, account: str) -> list[UploadRecord]:
        return [r for (a, _), r in self.uploads.items() if a == account and r.state in OPEN]

    async def delete(self, account: str, file_id: str) -> FileView | None:
        found = self.records.pop((account, file_id), None)
        if found is None:
            return None
        if self.digests.get((account, found.sha256)) == file_id:
            del self.digests[(account, found.sha256)]
        usage = self.stored[account]
        usage["file_bytes"] -= found.bytes
        usage["files"] -= 1
        return found

    async def usage(self, account: str) -> dict[str, int]:
        return dict(self.stored.get(account, {"file_bytes": 0, "files": 0, "models": 0}))

    async def later(self, account: str, upload_id: str, at: float | None) -> None:
        if at is None:
            self.due.pop((account, upload_id), None)
        else:
            self.due[(account, upload_id)] = at

    async def expired(self, now: float, limit: int = 100) -> list[tuple[str, str]]:
        due = sorted((at, a, u) for (a, u), at in self.due.items() if at <= now)
        return [(a, u) for _, a, u in due][:limit]
