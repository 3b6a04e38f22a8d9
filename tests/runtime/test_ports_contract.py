"""The ports the bootstraps take (accounts' `Credentials`, entitlement's `Bookings`, the scheduler's
`RunRecords`) as tables on both adapters: in memory (what the handler tests run on) and Redis
(what the services run on), on one server and on a Redis Cluster (tests/conftest.py). A
row that differs between them is a fake that lies."""

from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from contracts.api import LogLineView, RunView
from contracts.booking import Booking, BookingState, Fabric, Topology
from contracts.errors import ErrorCode
from contracts.states import RunState
from runtime.configuration.keys import Keys
from runtime.messaging.codec import Refusal
from runtime.tenancy import accounts
from services.entitlement.projection import Outcome
from services.entitlement.store import BookingStore, InMemoryBookings
from services.scheduler.memory import InMemoryRuns
from services.scheduler.store import RunStore
from tests.conftest import new_namespace, start_infra

NOW = datetime.now(UTC)


@pytest.fixture(scope="module")
def redis_infra(tmp_path_factory):
    i = start_infra(tmp_path_factory.mktemp("ports") / "infra", new_namespace(), nats=False)
    yield i
    i.stop()


@pytest.fixture(params=["memory", "redis", "cluster"])
async def adapters(request):
    """(accounts registry, bookings, runs) of one kind; Redis as each service's own ACL user."""
    if request.param == "memory":
        yield accounts.InMemoryAccounts(), InMemoryBookings(), InMemoryRuns()
        return
    infra = request.getfixturevalue("redis_infra" if request.param == "redis" else "cluster_infra")
    keys = Keys(infra.settings)
    clients = [infra.redis(identity) for identity in ("accounts", "entitlement", "scheduler")]
    ra, re, rs = clients
    yield accounts.RedisAccounts(ra, keys), BookingStore(re, keys), RunStore(rs, keys)
    for client in clients:
        await client.aclose()


def booking(account: str, booking_id: str, version: int, state=BookingState.completed) -> Booking:
    return Booking(
        booking_id=booking_id,
        account=account,
        state=state,
        version=version,
        topology=Topology(nodes=1, gpus_per_node=8, gpu_model="H200", gpu_memory_gb=141),
        region="eu-central-1",
        fabric=Fabric.infiniband,
        window_start=NOW,
        window_end=NOW + timedelta(hours=1),
        updated_at=NOW,
    )


async def test_credentials_create_revoke_authenticate(adapters, namespace):
    registry, _, _ = adapters
    account = "acct-" + namespace
    with pytest.raises(Refusal) as unknown:
        await accounts.authenticate(registry, account)
    assert unknown.value.code is ErrorCode.unauthenticated
    api_key, key_id, public = await registry.create(account)
    assert accounts.seed_of(api_key) is not None and key_id == public[:12]
    (record,) = await registry.records(account)
    assert (record.nkey, record.revoked) == (public, False) and api_key not in repr(record)
    assert (await accounts.authenticate(registry, account)).key_id == key_id
    _, newer, _ = await registry.create(account)
    assert (await accounts.authenticate(registry, account)).key_id == newer  # the newest active key
    assert await registry.revoke(account) == 2
    with pytest.raises(Refusal) as revoked:
        await accounts.authenticate(registry, account)
    assert revoked.value.code is ErrorCode.credential_revoked
    with pytest.raises(Refusal) as invalid:
        await registry.create("no.dots")
    assert invalid.value.code is ErrorCode.request_invalid


@pytest.mark.parametrize(
    "versions, outcomes, kept",
    [
        ([1], [Outcome.applied], 1),
        ([1, 1], [Outcome.applied, Outcome.duplicate], 1),
        ([2, 1], [Outcome.applied, Outcome.stale], 2),
        ([1, 3, 2, 3], [Outcome.applied, Outcome.applied, Outcome.stale, Outcome.duplicate], 3),
    ],
)
async def test_bookings_are_versioned(adapters, namespace, versions, outcomes, kept):
    _, bookings, _ = adapters
    account = "acct-" + namespace
    assert [await bookings.apply(booking(account, "b", v)) for v in versions] == outcomes
    stored = await bookings.get(account, "b")
    assert stored is not None and stored.version == kept
    assert [b.version for b in await bookings.of_account(account)] == [kept]
    assert await bookings.claim_owner(namespace + "-b", account) == account
    assert await bookings.claim_owner(namespace + "-b", "someone-else") == account  # claimed once
    before = await bookings.counted("stale_ignored")
    await bookings.count("stale_ignored")
    assert await bookings.counted("stale_ignored") == before + 1


def new_view(account: str, run_id: str, state: RunState) -> RunView:
    return RunView(
        run_id=run_id,
        account=account,
        booking_id="b",
        manifest_digest="d",
        idempotency_key="k",
        state=state,
        created_at=NOW,
        updated_at=NOW,
    )


async def test_run_records_keep_answers_logs_and_checkpoints(adapters, namespace):
    _, _, runs = adapters
    account, run_id = "acct-" + namespace, "run_" + namespace
    view = new_view(account, run_id, RunState.accepted)
    assert await runs.create(view) and not await runs.create(view)  # idempotent
    assert await runs.owner(run_id) == account
    assert await runs.recall(account, run_id, "work") is None
    await runs.remember(account, run_id, "work", b"{}")
    assert await runs.recall(account, run_id, "work") == b"{}"
    for i in range(5):
        line = LogLineView(index=await runs.log_count(account, run_id), at=NOW, level="info", message=str(i))
        await runs.append_log(account, run_id, line)
    assert [ln.message for ln in await runs.logs(account, run_id, 1, 2)] == ["1", "2"]
    assert [ln.index for ln in await runs.logs(account, run_id, 3, 100)] == [3, 4]
    assert await runs.logs(account, run_id, 9, 10) == []
    assert await runs.checkpoints(account, run_id) == []
    await runs.forget_checkpoints(account, run_id)
    moved, applied = await runs.move(
        account, run_id, RunState.queued, allowed_from=frozenset({RunState.accepted})
    )
    assert applied and moved is not None and moved.state is RunState.queued


async def test_creation_keeps_the_work_item_and_never_overwrites_a_view(adapters, namespace):
    """The hand-off creates the view with its work item in one step, repeatable by the
    reconciler: a second creation changes nothing, neither a view that moved on nor its item."""
    _, _, runs = adapters
    account, run_id = "acct-" + namespace, "run_w" + namespace
    view = new_view(account, run_id, RunState.queued)
    assert await runs.create(view, work=b'{"item": 1}')
    await runs.move(account, run_id, RunState.running)
    assert not await runs.create(view, work=b'{"item": 2}')
    stored = await runs.get(account, run_id)
    assert stored is not None and stored.state is RunState.running
    assert await runs.recall(account, run_id, "work") == b'{"item": 1}'
    assert await runs.owner(run_id) == account


async def test_the_desk_lists_every_accounts_newest_runs_and_each_runs_moves(adapters, namespace):
    """The desk's reads: the newest runs of every account (the run index, across its shards), and
    a run's history, which is exactly the moves applied (an update that keeps the state adds
    nothing; a refused move adds nothing)."""
    _, _, runs = adapters
    made = []
    for i, account in enumerate(["acct-a" + namespace, "acct-b" + namespace, "acct-a" + namespace]):
        view = msgspec.structs.replace(
            new_view(account, f"run_{i}{namespace}", RunState.queued), created_at=NOW + timedelta(seconds=i)
        )
        assert await runs.create(view)
        made.append(view)
    newest = [v.run_id for v in await runs.newest(1000) if v.run_id.endswith(namespace)]
    assert newest == [made[2].run_id, made[1].run_id, made[0].run_id]
    assert [v.run_id for v in await runs.newest(2)][:2] == [made[2].run_id, made[1].run_id]
    account, run_id = made[0].account, made[0].run_id
    assert await runs.states(account, run_id) == []
    at = NOW + timedelta(seconds=10)
    await runs.move(account, run_id, RunState.running, at=at, message="training started")
    await runs.update(account, run_id, None, lambda v: msgspec.structs.replace(v, step=3))
    await runs.move(
        account, run_id, RunState.cancelled, allowed_from=frozenset({RunState.queued})
    )  # too late
    await runs.move(account, run_id, RunState.succeeded, at=at + timedelta(seconds=1))
    history = await runs.states(account, run_id)
    assert [(r.state, r.message) for r in history] == [
        (RunState.running, "training started"),
        (RunState.succeeded, None),
    ]
    assert [r.at for r in history] == [at, at + timedelta(seconds=1)]


async def test_an_accounts_runs_are_read_newest_first_by_position_ties_included(adapters, namespace):
    """The tenant's read (`account_runs`): its own index only, newest first, runs created at the
    same instant by run id (descending); reading on from each position visits every run exactly once."""
    _, _, runs = adapters
    mine, other = "acct-m" + namespace, "acct-o" + namespace
    times = [0, 1, 1, 1, 2]  # three runs created at the same instant
    for i, seconds in enumerate(times):
        view = new_view(mine, f"run_{i}{namespace}", RunState.queued)
        assert await runs.create(msgspec.structs.replace(view, created_at=NOW + timedelta(seconds=seconds)))
    assert await runs.create(new_view(other, "run_x" + namespace, RunState.queued))
    expected = [f"run_{i}{namespace}" for i in (4, 3, 2, 1, 0)]
    everything = await runs.account_runs(mine, None, 100)
    assert [run for (_, run), _view in everything] == expected
    assert all(view is not None and view.account == mine for _, view in everything)
    seen, position = [], None
    while page := await runs.account_runs(mine, position, 1):
        ((position, _view),) = page
        seen.append(position[1])
    assert seen == expected
    assert [run for (_, run), _ in await runs.account_runs(mine, everything[1][0], 2)] == expected[2:4]
    assert await runs.account_runs("acct-none" + namespace, None, 10) == []
