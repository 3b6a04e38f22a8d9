"""The services' stores on a Redis Cluster of our own (3 primaries, a replica each: conftest.py),
formed as `ito-training up --cluster` forms it: locked down like the single server, every Lua
script of the services run against keys on every shard (each script touches one slot), no index
or counter on one slot, and a primary killed: its replica takes over and the same clients carry on.
The store contracts themselves run on the cluster too (test_ports_contract.py,
test_liveness_table.py, test_binding_contract.py)."""

import asyncio
import pathlib
import time
import uuid
from datetime import UTC, datetime, timedelta

import msgspec
import pytest
import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from contracts.api import Action, LogLineView, RunView
from contracts.booking import Booking, BookingState, Fabric, Topology
from contracts.internal import ConfirmationCreate, LedgerAccept
from contracts.runs import LogLine, Metrics
from contracts.states import RunState
from devstack import redis_cluster
from runtime.configuration.keys import SHARDS, Keys
from runtime.configuration.settings import load
from runtime.security.identities import ADMIN, REPLICATION
from runtime.security.secrets import Secrets
from runtime.tenancy import accounts
from services.confirmation.handlers import ConfirmationHandlers
from services.confirmation.store import ConfirmationStore
from services.entitlement.projection import Outcome
from services.entitlement.store import BookingStore
from services.ledger.handlers import LedgerHandlers
from services.ledger.store import LedgerStore
from services.scheduler.store import RunStore
from services.telemetry.store import TelemetryStore
from tests.support import eventually_async
from tests.training.test_node_shares import work as node_work

NOW = datetime.now(UTC)
ONCE = Retry(NoBackoff(), 0)  # a refusal is the answer here: no retries
DIGEST = "d" * 64
PRIMARIES = redis_cluster.PRIMARIES


def shard_of(key: str) -> int:
    """Which primary (as formed: even slot ranges) serves a key."""
    return key_slot(key.encode()) * PRIMARIES // redis_cluster.SLOTS


def account_on(keys: Keys, primary: int, prefix: str) -> str:
    """An account name whose keys (`<ns>:{account}:...`) the given primary serves."""
    return next(
        name
        for name in (f"{prefix}{i}" for i in range(1000))
        if shard_of(keys.account(name) + ":x") == primary
    )


def view(account: str, run_id: str, state: RunState = RunState.queued) -> RunView:
    return RunView(
        run_id=run_id,
        account=account,
        booking_id="b",
        manifest_digest=DIGEST,
        idempotency_key="k",
        state=state,
        created_at=NOW,
        updated_at=NOW,
    )


def booking(account: str, booking_id: str, version: int) -> Booking:
    return Booking(
        booking_id=booking_id,
        account=account,
        state=BookingState.completed,
        version=version,
        topology=Topology(nodes=1, gpus_per_node=8, gpu_model="H200", gpu_memory_gb=141),
        region="eu-central-1",
        fabric=Fabric.infiniband,
        window_start=NOW,
        window_end=NOW + timedelta(hours=1),
        updated_at=NOW,
    )


class Stores:
    """Every store of the services on the cluster, each as its service's own ACL user."""

    def __init__(self, infra) -> None:
        self.keys = Keys(infra.settings)
        self.clients = {i: infra.redis(i) for i in ("scheduler", "ledger", "confirmation", "entitlement")}
        self.clients["telemetry"] = infra.redis("telemetry")
        self.clients["accounts"] = infra.redis("accounts")
        self.runs = RunStore(self.clients["scheduler"], self.keys)
        self.confirmations = ConfirmationStore(self.clients["confirmation"], self.keys)
        self.ledger = LedgerStore(self.clients["ledger"], self.keys, retention_s=3600)
        self.bookings = BookingStore(self.clients["entitlement"], self.keys)
        self.telemetry = TelemetryStore(self.clients["telemetry"], self.keys)
        self.registry = accounts.RedisAccounts(self.clients["accounts"], self.keys)

    async def close(self) -> None:
        for client in self.clients.values():
            await client.aclose()

    async def every_script(self, account: str) -> None:
        """Run each script of the services once on `account`'s keys, and check what it did:
        the ledger's accept (with the confirmation service's record), the entitlement's apply,
        the scheduler's view compare-and-set and its lease."""
        run_id = "run_" + uuid.uuid4().hex[:8]
        issued = await ConfirmationHandlers(self.confirmations, ttl_s=600).create(
            ConfirmationCreate(
                account=account, action=Action.train, target="b1", manifest_digest=DIGEST, max_cost_usd=10.0
            )
        )
        key = "k_" + uuid.uuid4().hex[:8]
        accept = LedgerAccept(
            account=account,
            idempotency_key=key,
            fingerprint="f",
            run_id=run_id,
            action=Action.train,
            confirmation_ref=issued.confirmation_ref,
            target="b1",
            manifest_digest=DIGEST,
            cost_usd=5.0,
            work=msgspec.json.encode(node_work(1, rendezvous="")),  # a train's item (its bound written in)
        )
        entry, note = await LedgerHandlers(self.ledger).accept(accept)  # ACCEPT_LUA
        assert note is None and entry.run_id == run_id and not entry.handed_off
        again, _ = await LedgerHandlers(self.ledger).accept(accept)  # a replay: the same entry
        assert again.run_id == run_id
        assert (await self.confirmations.get(account, issued.confirmation_ref)).consumed

        b = "bk-" + uuid.uuid4().hex[:6]
        assert await self.bookings.apply(booking(account, b, 2)) is Outcome.applied  # APPLY_LUA
        assert await self.bookings.apply(booking(account, b, 1)) is Outcome.stale
        assert [x.booking_id for x in await self.bookings.of_account(account)].count(b) == 1

        assert await self.runs.create(view(account, run_id))
        granted, _, epoch = await self.runs.lease(account, run_id, "t1", 0, 1000.0, 5.0, lambda v: True)
        assert granted and epoch >= 1  # LEASE_LUA
        assert (await self.runs.lease(account, run_id, "t1", epoch, 1001.0, 5.0, lambda v: True))[0]
        assert not (await self.runs.lease(account, run_id, "t2", 0, 1002.0, 5.0, lambda v: True))[0]
        moved, applied = await self.runs.move(account, run_id, RunState.running)  # CAS_LUA
        assert applied and moved is not None and moved.state is RunState.running
        assert (await self.runs.get(account, run_id)).state is RunState.running
        assert (await self.runs.leased())[run_id] == account


@pytest.fixture
async def stores(cluster_infra):
    s = Stores(cluster_infra)
    yield s
    await s.close()


def admin(cluster: redis_cluster.Cluster, node: redis_cluster.Node) -> redis.Redis:
    password = Secrets(cluster.secrets_dir).password(ADMIN)
    return redis.Redis(port=node.port, username=ADMIN, password=password, decode_responses=True)


def test_the_cluster_is_three_primaries_with_a_replica_each_locked_down_like_one_server(cluster_infra):
    cluster = cluster_infra.cluster
    assert len(cluster.nodes) == 6
    assert redis_cluster.Cluster.from_dict(cluster.as_dict()).nodes == cluster.nodes  # `up`'s state file
    assert (
        sorted(redis_cluster.role(cluster, n) or "down" for n in cluster.nodes)
        == ["master"] * 3 + ["slave"] * 3
    )
    node = cluster.nodes[0]
    with pytest.raises(redis.exceptions.AuthenticationError):  # `default` is off
        redis.Redis(port=node.port, retry=ONCE).ping()
    password = Secrets(cluster.secrets_dir).password(REPLICATION)
    with pytest.raises(redis.exceptions.NoPermissionError):  # replication reads no key
        redis.Redis(port=node.port, username=REPLICATION, password=password, retry=ONCE).get("x")
    for n in cluster.nodes:
        info = admin(cluster, n).config_get("appendfsync")
        assert info["appendfsync"] == "always"
        config = n.store / redis_cluster.CONFIG
        assert config.stat().st_mode & 0o777 == 0o600 and n.store.stat().st_mode & 0o777 == 0o700
        cmdline = pathlib.Path(f"/proc/{n.pid}/cmdline").read_bytes().decode(errors="replace")
        assert (password in cmdline) is False  # only in the 0600 file (and no echo of it on failure)


async def test_a_service_user_is_confined_on_the_cluster_as_on_one_server(cluster_infra):
    ns = cluster_infra.settings.namespace
    scheduler = cluster_infra.redis("scheduler")
    try:
        with pytest.raises(redis.exceptions.NoPermissionError):
            await scheduler.hset(f"{ns}:{{acme}}:conf:cf_evil", "consumed", "0")
        with pytest.raises(redis.exceptions.NoPermissionError):
            await scheduler.get(f"{ns}:{{acme}}:idem:k")
    finally:
        await scheduler.aclose()


async def test_every_script_runs_on_every_shard(stores):
    for primary in range(PRIMARIES):
        await stores.every_script(account_on(stores.keys, primary, "acct-s"))


@pytest.mark.parametrize("namespace", ["ito", "t0123456789"])
def test_no_index_or_counter_sits_on_one_primary(namespace):
    """Each split key spreads over every primary of the 3-shard cluster (for the default namespace
    and a test one); before, one key (one slot) took every account's writes."""
    keys = Keys(load({"ITO_NAMESPACE": namespace}))
    for shards in (keys.accounts_shards(), keys.leased_shards(), keys.booking_stats_shards()):
        assert len(shards) == SHARDS + 1  # and the single key of before, read only
        assert {shard_of(k) for k in shards[:-1]} == set(range(PRIMARIES)), shards
    assert keys.leased("run_a") in keys.leased_shards() and keys.accounts_shard("a") in keys.accounts_shards()


async def test_the_indexes_and_counters_read_every_shard(stores):
    names = [account_on(stores.keys, primary, "acct-i") for primary in range(PRIMARIES)]
    for name in names:
        await stores.registry.create(name)
    assert set(names) <= set(await accounts.names(stores.clients["accounts"], stores.keys))
    tenants = await accounts.active_tenants(stores.clients["accounts"], stores.keys)
    assert set(names) <= {account for account, _ in tenants}
    before = await stores.bookings.counted("parked")
    for _ in range(3 * SHARDS):  # random shards: most of them hit
        await stores.bookings.count("parked")
    assert await stores.bookings.counted("parked") == before + 3 * SHARDS
    # the ledger's reconciler list reads the account index across shards
    await stores.every_script(names[1])
    assert any(e.account == names[1] for e in await stores.ledger.pending())


async def test_confirmation_clock_telemetry_and_run_records_on_the_cluster(stores):
    account = account_on(stores.keys, 2, "acct-c")
    issued = await ConfirmationHandlers(stores.confirmations, ttl_s=600).create(
        ConfirmationCreate(account=account, action=Action.train, target="b1", manifest_digest=DIGEST)
    )
    stored, now = await stores.confirmations.get_at(account, issued.confirmation_ref)
    assert stored is not None and abs(now - time.time()) < 5  # the clock of the record's node
    assert await stores.confirmations.owner(issued.confirmation_ref) == account
    run_id = "run_" + uuid.uuid4().hex[:8]
    assert await stores.runs.create(view(account, run_id), work=b"item")
    for i in range(3):
        await stores.runs.append_log(
            account, run_id, LogLineView(index=i, at=NOW, level="info", message=str(i))
        )
        await stores.runs.append_metrics(account, run_id, metrics(run_id, i))
    assert [ln.message for ln in await stores.runs.logs(account, run_id, 0, 10)] == ["0", "1", "2"]
    assert len(await stores.runs.metrics(account, run_id, 0, 10)) == 3
    event = LogLine(run_id=run_id, seq=1, at=NOW, epoch=1, level="info", message="m")
    await stores.telemetry.add_event(event)
    await stores.telemetry.add_event(event)  # a redelivery replaces
    assert len(await stores.telemetry.events(run_id)) == 1


async def test_rotated_credentials_reach_every_node_and_the_replicas_log_in_anew(cluster_infra):
    """A rotation (as `ito-training` rotates: new password files, the ACL file written again),
    then `apply_credentials`: the new password works on every shard, the old one nowhere, and the
    replicas, made to log in again, do so with the new replication password."""
    from devstack import authority

    cluster, s = cluster_infra.cluster, cluster_infra.settings
    secrets = Secrets(s.secrets_dir)
    old = secrets.password("telemetry")
    secrets.rotate_redis("telemetry")
    secrets.rotate_redis(REPLICATION)
    assert redis_cluster.apply_credentials(cluster, authority.write_redis_acl(s)) == len(cluster.nodes)
    for node in cluster.nodes:
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=node.port, username="telemetry", password=old, retry=ONCE).ping()
        if redis_cluster.role(cluster, node) == "master":
            admin(cluster, node).execute_command("CLIENT KILL TYPE slave")  # its replica logs in again

    async def in_sync() -> bool:
        return redis_cluster.replicas_in_sync(cluster) == PRIMARIES

    await eventually_async(in_sync, timeout=redis_cluster.FORM_TIMEOUT_S, what="every replica in sync again")
    client = cluster_infra.redis("telemetry")
    try:
        store = TelemetryStore(client, Keys(s))
        for i in range(2 * PRIMARIES):  # runs on every shard, most likely
            event = LogLine(run_id=f"run_rot{i}", seq=1, at=NOW, epoch=1, level="info", message="m")
            await store.add_event(event)
            assert len(await store.events(event.run_id)) == 1
    finally:
        await client.aclose()


def metrics(run_id: str, step: int) -> Metrics:
    return Metrics(
        run_id=run_id,
        seq=step + 1,
        at=NOW,
        epoch=1,
        stage="pretrain",
        step=step,
        total_steps=10,
        loss=1.0,
        learning_rate=0.001,
        tokens_per_s=1.0,
        grad_norm=1.0,
    )


def transient(exc: BaseException) -> bool:
    return isinstance(exc, (redis.exceptions.RedisError, RedisClusterException, OSError))


async def test_a_primary_killed_its_replica_takes_over_and_the_same_clients_carry_on(stores, cluster_infra):
    """A trainer heartbeats on the killed shard while its primary dies: the beats fail until the
    replica is elected, then every store (the same client objects: nothing reconnects them by
    hand) answers again, with the data written before the kill, and runs every script there."""
    cluster = cluster_infra.cluster
    primary = next(n for n in cluster.nodes if redis_cluster.role(cluster, n) == "master")
    account = account_on(stores.keys, shard_of_node(cluster, primary), "acct-f")
    run_id = "run_" + uuid.uuid4().hex[:8]
    assert await stores.runs.create(view(account, run_id))
    granted, _, epoch = await stores.runs.lease(account, run_id, "t1", 0, time.time(), 5.0, lambda v: True)
    assert granted
    assert admin(cluster, primary).execute_command("WAIT", 1, 2000) == 1  # the replica has it all

    async def beat() -> bool:
        try:
            return (await stores.runs.lease(account, run_id, "t1", epoch, time.time(), 5.0, lambda v: True))[
                0
            ]
        except Exception as exc:
            if not transient(exc):
                raise
            return False

    async def every_store_answers() -> bool:
        try:
            await stores.confirmations.now()  # a keyless command: the client's default node
            await stores.ledger.lookup(account, "k")
            await stores.bookings.get(account, "b")
            await stores.telemetry.events(run_id)
            await stores.registry.records(account)
        except Exception as exc:
            if not transient(exc):
                raise
            return False
        return await beat()

    failing = asyncio.create_task(asyncio.to_thread(redis_cluster.fail_over, cluster, primary))
    beats = []
    while not failing.done():
        beats.append(await beat())
        await asyncio.sleep(0.05)
    failover = await failing
    killed_at = time.monotonic() - failover.seconds
    assert False in beats  # the kill was seen mid-way
    print(f"\nfailover: replica on {failover.promoted.port} elected {failover.seconds:.2f}s after the kill")
    await eventually_async(every_store_answers, timeout=redis_cluster.FAILOVER_TIMEOUT_S, what="every store")
    print(f"every store answering {time.monotonic() - killed_at:.2f}s after the kill")
    assert (await stores.runs.get(account, run_id)).state is RunState.queued  # written before the kill
    await stores.every_script(account)  # the promoted primary runs every script (loaded again)
    assert redis_cluster.role(cluster, failover.promoted) == "master"

    cluster_infra.cluster = redis_cluster.restart_node(cluster, primary)  # back, as a replica

    async def rejoined():
        return redis_cluster.role(cluster_infra.cluster, primary) == "slave"

    await eventually_async(rejoined, timeout=redis_cluster.FORM_TIMEOUT_S, what="the old primary a replica")


def shard_of_node(cluster: redis_cluster.Cluster, node: redis_cluster.Node) -> int:
    """Which of the even slot ranges a primary serves now (after earlier failovers too)."""
    slots = admin(cluster, node).execute_command("CLUSTER SLOTS")
    ports = {int(entry[2][1]): int(entry[0]) for entry in slots}
    return ports[node.port] * PRIMARIES // redis_cluster.SLOTS
