"""The quota stores on Redis, on one server and on a Redis Cluster (tests/conftest.py),
each as its service's own ACL user: the bucket script gives the pure bucket's answers, one bucket
is shared by two scheduler instances and admits exactly its burst under concurrency, outstanding
confirmations are counted and admitted in one step, the open-run set forgets finished runs, and
the operator's `accounts` user writes the limits that the services read."""

import asyncio
import uuid
from datetime import UTC, datetime

import pytest

from contracts.api import Action, RunView
from contracts.states import RunState
from domain import quotas
from domain.binding import Stored
from runtime.configuration.keys import Keys
from runtime.tenancy.quota_stores import RedisQuotas
from services.confirmation.store import ConfirmationStore
from services.scheduler.store import RunStore
from tests.conftest import new_namespace, start_infra
from tests.domain.test_quotas import BUCKET_ROWS


@pytest.fixture(scope="module")
def redis_infra(tmp_path_factory):
    i = start_infra(tmp_path_factory.mktemp("quotas") / "infra", new_namespace(), nats=False)
    yield i
    i.stop()


@pytest.fixture(params=["redis", "cluster"])
async def infra(request):
    infra = request.getfixturevalue("redis_infra" if request.param == "redis" else "cluster_infra")
    clients = {i: infra.redis(i) for i in ("scheduler", "confirmation", "accounts", "admin")}
    yield infra, Keys(infra.settings), clients
    for client in clients.values():
        await client.aclose()


def account() -> str:
    return "q-" + uuid.uuid4().hex[:10]


@pytest.mark.parametrize(("given", "expected"), BUCKET_ROWS)
async def test_the_bucket_script_is_the_pure_bucket(infra, given, expected):
    _, keys, c = infra
    tokens, at, now, rate, burst, cost = given
    name = account()
    await RedisQuotas(c["accounts"], keys).set_limits(name, {"rate_per_s": rate, "burst": burst})
    if tokens is not None:
        await c["admin"].hset(keys.bucket(name), mapping={"tokens": repr(tokens), "at": repr(at)})
    taken = await RedisQuotas(c["scheduler"], keys).take(name, cost, now=now)
    assert (taken.allowed, taken.tokens, taken.retry_after_s) == pytest.approx(expected)


async def test_a_trains_take_brings_its_run_limits_and_open_run_count_in_the_same_script(infra):
    # issue 30: the train path read the limits and counted the open runs in two more round trips
    _, keys, c = infra
    name = account()
    q = RedisQuotas(c["scheduler"], keys)
    first = await q.take(name, open_runs=True)
    assert (first.runs, first.queued, first.open_at_most) == (quotas.DEFAULT_RUNS, quotas.DEFAULT_QUEUED, 0)
    await RedisQuotas(c["accounts"], keys).set_limits(name, {"runs": 7, "queued": 3})
    await c["admin"].sadd(keys.open_runs(name), "run_a", "run_b")
    taken = await q.take(name, open_runs=True)
    assert (taken.runs, taken.queued, taken.open_at_most, taken.allowed) == (7, 3, 2, True)
    assert (await q.take(name)).open_at_most is None  # plan and confirm count nothing


async def test_two_scheduler_instances_share_one_bucket_and_admit_exactly_its_burst(infra):
    i, keys, c = infra
    name, other = account(), account()
    await RedisQuotas(c["accounts"], keys).set_limits(name, {"rate_per_s": 0.001, "burst": 5})
    second = i.redis("scheduler")  # another instance: its own connection
    try:
        a, b = RedisQuotas(c["scheduler"], keys), RedisQuotas(second, keys)
        for q in (a, b):  # connected first (redis-py's cluster client races its first connects)
            await q.limits(name)
        taken = await asyncio.gather(*((a if n % 2 else b).take(name) for n in range(20)))
        assert sum(t.allowed for t in taken) == 5
        refused = [t for t in taken if not t.allowed]
        assert all(900 < t.retry_after_s <= 1000 for t in refused)
        assert (await b.take(other)).allowed  # another account's bucket is its own
        assert (await a.limits(other)) == quotas.DEFAULTS
    finally:
        await second.aclose()


async def test_a_flood_s_refusals_are_answered_without_a_round_trip(infra):
    _, keys, c = infra
    name = account()
    await RedisQuotas(c["accounts"], keys).set_limits(name, {"rate_per_s": 0.001, "burst": 1})
    q = RedisQuotas(c["scheduler"], keys)
    assert (await q.take(name)).allowed
    assert not (await q.take(name)).allowed  # the bucket is empty: remembered by this instance
    await c["admin"].delete(keys.bucket(name))  # Redis would now admit (a new bucket is full) ...
    again = await q.take(name)
    assert not again.allowed and 900 < again.retry_after_s <= 1000  # ... but nobody asked it
    assert (await q.take(name, cost=0)).tokens == 1.0  # a look goes to Redis: the full new bucket


async def test_outstanding_confirmations_are_counted_and_admitted_in_one_step(infra):
    _, keys, c = infra
    store = ConfirmationStore(c["confirmation"], keys)
    name = account()
    now = await store.now()

    async def issue(ref: str, expires_at: float) -> tuple[bool, int]:
        admitted = await store.admit(name, ref, expires_at, 2)
        if admitted[0]:
            stored = Stored(name, Action.train, "b", "d", None, expires_at, False)
            await store.create(ref, stored)
        return admitted

    outcomes = await asyncio.gather(*(issue(f"cf_{n}", now + 600) for n in range(6)))
    assert sorted(a for a, _ in outcomes) == [False] * 4 + [True] * 2
    assert await store.admit(name, "", 0.0, 2) == (True, 2)  # only counts
    admitted = [f"cf_{n}" for n, (a, _) in enumerate(outcomes) if a]
    await c["admin"].hset(keys.confirmation(name, admitted[0]), "consumed", "1")  # as the ledger does
    assert await issue("cf_new", now + 600) == (True, 2)  # the consumed one left the count
    assert await issue("cf_late", now + 600) == (False, 2)
    await c["admin"].zadd(keys.outstanding_confirmations(name), {admitted[1]: now - 1})  # expired
    assert await store.admit(name, "", 0.0, 2) == (True, 1)


async def test_the_open_run_set_forgets_finished_runs(infra):
    _, keys, c = infra
    runs = RunStore(c["scheduler"], keys)
    # long ago: the desk's newest-runs index is shared by the session's cluster tests
    name, now = account(), datetime(2001, 1, 1, tzinfo=UTC)
    for n, state in enumerate((RunState.queued, RunState.running, RunState.succeeded)):
        view = RunView(
            run_id=f"run_{n}",
            account=name,
            booking_id="b",
            manifest_digest="d" * 64,
            idempotency_key=f"k{n}",
            state=state,
            created_at=now,
            updated_at=now,
        )
        assert await runs.create(view)
    assert sorted(await runs.open_states(name)) == sorted([RunState.queued, RunState.running])
    assert await c["admin"].scard(keys.open_runs(name)) == 2  # the finished one left the set
    assert await runs.open_at_most(name) == 2


async def test_the_operator_writes_the_limits_the_services_read_them(infra):
    i, keys, c = infra
    name = account()
    limits = await RedisQuotas(c["accounts"], keys).set_limits(name, {"runs": 2, "queued": 1})
    assert (limits.runs, limits.queued, limits.burst) == (2, 1, quotas.DEFAULT_BURST)
    assert (await RedisQuotas(c["scheduler"], keys).limits(name)).runs == 2
    assert (await RedisQuotas(c["confirmation"], keys).limits(name)).queued == 1
    ledger = i.redis("ledger")  # a service that has no business with quotas cannot touch them
    try:
        with pytest.raises(Exception, match=r"(?i)permission"):
            await ledger.hset(keys.quota(name), "runs", "100")
    finally:
        await ledger.aclose()


def test_the_operator_sets_and_shows_quotas_with_ito_training(redis_infra, monkeypatch, capsys):
    """`ito-training accounts quota ACCOUNT --rate ... --runs ...`: the limits given change, the rest
    keep their value (the defaults until set); a bad value is refused and changes nothing."""
    from ops import main as ops

    s = redis_infra.settings
    for env, value in (
        ("ITO_NAMESPACE", s.namespace),
        ("ITO_REDIS_URL", s.redis_url),
        ("ITO_SECRETS_DIR", str(s.secrets_dir)),
        ("ITO_DATA_DIR", str(s.data_dir)),
    ):
        monkeypatch.setenv(env, value)
    name = account()

    def quota(*flags: str) -> tuple[int, dict]:
        rc = ops.main(["accounts", "quota", name, *flags, "--json"])
        return rc, __import__("json").loads(capsys.readouterr().out)

    rc, shown = quota()
    assert rc == 0 and shown["quotas"] == {
        "rate_per_s": quotas.DEFAULT_RATE_PER_S,
        "burst": quotas.DEFAULT_BURST,
        "confirmations": quotas.DEFAULT_CONFIRMATIONS,
        "runs": quotas.DEFAULT_RUNS,
        "queued": quotas.DEFAULT_QUEUED,
        "file_bytes": quotas.DEFAULT_FILE_BYTES,
        "files": quotas.DEFAULT_FILES,
        "models": quotas.DEFAULT_MODELS,
    }
    rc, shown = quota(
        "--rate", "2.5", "--burst", "10", "--confirmations", "3", "--runs", "2", "--queued", "1",
        "--file-bytes", "1000000", "--files", "4", "--models", "1",
    )  # fmt: skip
    assert rc == 0 and shown["quotas"] == {
        "rate_per_s": 2.5,
        "burst": 10,
        "confirmations": 3,
        "runs": 2,
        "queued": 1,
        "file_bytes": 1_000_000,
        "files": 4,
        "models": 1,
    }
    rc, shown = quota("--runs", "0")
    assert rc == 2 and "positive" in shown["error"]
    assert quota()[1]["quotas"]["runs"] == 2
