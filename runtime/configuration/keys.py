"""The Redis key layout, in one place.

Per-account keys carry the account as a hash tag (`<ns>:{<account>}:...`), so every key that one
atomic script touches lives in one Redis Cluster slot.

No key takes every account's writes: on Redis Cluster such a key is one slot, so one primary, for
the whole desk. The account index, the lease index and the booking counters are split in SHARDS
keys (a name's shard is a hash of it; a counter's is random) that land on different slots; readers
read every shard in one pipeline. The keys that remain global are one per id (`run-owner:<run>`,
`conf-owner:<ref>`, `booking-owner:<booking>`, `booking-parked:<booking>`, `apikeys:<account>`,
`telemetry:events:<run>`, `desk:<by>:<key>`): each is written by that id's events only, and the ids
themselves spread over the slots.
"""

import random
import zlib

from runtime.configuration.settings import Settings

SHARDS = 16
"""How many keys an index or a counter is split in: enough to spread over the primaries of any
cluster up to ~16 shards; raise it with the cluster (every read visits each shard). Changing it
moves names between shards: a deployment with data keeps it, or migrates."""


def shard(name: str) -> int:
    """The shard a name (an account, a run id) belongs to: stable across processes and versions."""
    return zlib.crc32(name.encode()) % SHARDS


class Keys:
    def __init__(self, settings: Settings) -> None:
        self.ns = settings.namespace

    def account(self, account: str) -> str:
        return f"{self.ns}:{{{account}}}"

    # accounts and credentials
    def api_keys(self, account: str) -> str:  # hash: public nkey -> encoded key record, one per account
        return f"{self.ns}:apikeys:{account}"

    def accounts_shard(self, account: str) -> str:  # set of account names, one shard of them
        return f"{self.ns}:accounts:{shard(account)}"

    def accounts_shards(self) -> list[str]:
        """Every shard of the account index, and the single set that held it before it was split
        (read, never written: accounts created then must keep their credentials)."""
        return [f"{self.ns}:accounts:{i}" for i in range(SHARDS)] + [f"{self.ns}:accounts"]

    # entitlement projection
    def booking(self, account: str, booking_id: str) -> str:
        return f"{self.account(account)}:booking:{booking_id}"

    def bookings(self, account: str) -> str:  # set of the account's booking ids
        return f"{self.account(account)}:bookings"

    def booking_owner(self, booking_id: str) -> str:  # booking id -> account
        return f"{self.ns}:booking-owner:{booking_id}"

    def booking_parked(self, booking_id: str) -> str:  # events that came before `completed`
        return f"{self.ns}:booking-parked:{booking_id}"

    def booking_stats(self) -> str:  # hash of counters (stale events ignored, parked, ...): a random shard
        return f"{self.ns}:booking-stats:{random.randrange(SHARDS)}"

    def booking_stats_shards(self) -> list[str]:  # a counter is the sum over these (and the old single hash)
        return [f"{self.ns}:booking-stats:{i}" for i in range(SHARDS)] + [f"{self.ns}:booking-stats"]

    # confirmations
    def confirmation(self, account: str, ref: str) -> str:
        return f"{self.account(account)}:conf:{ref}"

    def confirmation_owner(self, ref: str) -> str:  # ref -> account, to tell mismatch from unknown
        return f"{self.ns}:conf-owner:{ref}"

    # idempotency ledger
    def idempotency(self, account: str, key: str) -> str:
        return f"{self.account(account)}:idem:{key}"

    def pending_handoff(self, account: str) -> str:  # set of idempotency keys not yet handed off
        return f"{self.account(account)}:pending"

    # runs (owned by the scheduler)
    def run(self, account: str, run_id: str) -> str:
        return f"{self.account(account)}:run:{run_id}"

    def run_owner(self, run_id: str) -> str:  # run id -> account (the trainer's events carry only the id)
        return f"{self.ns}:run-owner:{run_id}"

    def run_logs(self, account: str, run_id: str) -> str:
        return f"{self.account(account)}:run:{run_id}:logs"

    def run_metrics(self, account: str, run_id: str) -> str:
        return f"{self.account(account)}:run:{run_id}:metrics"

    def run_checkpoints(self, account: str, run_id: str) -> str:
        return f"{self.account(account)}:run:{run_id}:checkpoints"

    def run_interruptions(self, account: str, run_id: str) -> str:
        return f"{self.account(account)}:run:{run_id}:interruptions"

    def run_states(self, account: str, run_id: str) -> str:  # list: the run's state moves, in order
        return f"{self.account(account)}:run:{run_id}:states"

    def run_index(self, run_id: str) -> str:  # zset `<account>:<run id>` by creation time, one shard
        return f"{self.ns}:run-index:{shard(run_id)}"

    def run_index_shards(self) -> list[str]:  # every run of every account: the desk's list
        return [f"{self.ns}:run-index:{i}" for i in range(SHARDS)]

    def leased(self, run_id: str) -> str:  # hash: run id -> account, for every run a trainer has held
        return f"{self.ns}:leased:{shard(run_id)}"

    def leased_shards(self) -> list[str]:  # the whole lease index (and the old single hash, read only)
        return [f"{self.ns}:leased:{i}" for i in range(SHARDS)] + [f"{self.ns}:leased"]

    # desk telemetry
    def telemetry_events(self, run_id: str) -> str:  # hash: seq -> encoded event
        return f"{self.ns}:telemetry:events:{run_id}"

    def telemetry_runs(self, by: str, key: str) -> str:  # hash: run id -> encoded RunTelemetry
        return f"{self.ns}:desk:{by}:{key}"

    def runs(self, account: str) -> str:
        return f"{self.account(account)}:runs"

    # quotas (docs/quotas.md): the operator writes the limits; each counter beside its account's keys
    def quota(self, account: str) -> str:  # hash: limit name -> value (domain/quotas.py)
        return f"{self.account(account)}:quota"

    def bucket(self, account: str) -> str:  # hash: tokens, at (the scheduler's request-rate bucket)
        return f"{self.account(account)}:bucket"

    def outstanding_confirmations(self, account: str) -> str:  # zset: ref -> expiry (confirmation service)
        return f"{self.account(account)}:conf-open"

    def open_runs(self, account: str) -> str:  # set: run ids not known to be finished (the scheduler)
        return f"{self.account(account)}:open-runs"
