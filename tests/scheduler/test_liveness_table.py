"""The trainer's lease, its heartbeat and the watcher, as tables on both adapters of the run
store's port: in memory (no Redis) and Redis (`RunStore`, the scheduler's own ACL user), on one
server and on a Redis Cluster. Every state change goes through `move`; `update` cannot write one."""

import uuid
from datetime import UTC, datetime

import msgspec
import pytest

from contracts.api import LeaseQuery, RunView
from contracts.states import CANCEL_TO, LEASABLE, RunState
from runtime.configuration.keys import Keys
from runtime.messaging import codec
from services.scheduler import leases
from services.scheduler.lifecycle import NotAMove
from services.scheduler.memory import InMemoryRuns
from services.scheduler.store import RunStore
from tests.conftest import new_namespace, start_infra

NOW = datetime.now(UTC)


@pytest.fixture(scope="module")
def redis_infra(tmp_path_factory):
    i = start_infra(tmp_path_factory.mktemp("runs") / "infra", new_namespace(), nats=False)
    yield i
    i.stop()


@pytest.fixture(params=["memory", "redis", "cluster"])
async def runs(request):
    if request.param == "memory":
        yield InMemoryRuns()
        return
    infra = request.getfixturevalue("redis_infra" if request.param == "redis" else "cluster_infra")
    r = infra.redis("scheduler")
    yield RunStore(r, Keys(infra.settings))
    await r.aclose()


async def new_run(runs, state=RunState.queued, nodes: int = 1) -> RunView:
    view = RunView(
        nodes=nodes,
        run_id="run_" + uuid.uuid4().hex[:8],
        account="acme",
        booking_id="b",
        manifest_digest="d",
        idempotency_key="k",
        state=state,
        created_at=NOW,
        updated_at=NOW,
    )
    await runs.create(view)
    return view


def query(view: RunView, trainer: str = "t", epoch: int = 0, **changes) -> LeaseQuery:
    fields = {
        "run_id": view.run_id,
        "trainer_id": trainer,
        "epoch": epoch,
        "account": view.account,
        "booking_id": view.booking_id,
        "manifest_digest": view.manifest_digest,
        "plan_sha256": codec.digest(view.plan),
        **changes,
    }
    return LeaseQuery(**fields)


@pytest.mark.parametrize("state", list(RunState))
async def test_a_new_lease_is_granted_exactly_in_the_leasable_states(runs, state):
    view = await new_run(runs, state)
    answer = await leases.Heartbeats(runs).heartbeat(query(view))
    assert (answer.proceed, answer.state, answer.epoch) == (
        state in LEASABLE,
        state,
        1 if state in LEASABLE else 0,
    )


@pytest.mark.parametrize(
    "changes",
    [{"booking_id": "other"}, {"manifest_digest": "x"}, {"plan_sha256": "0" * 64}, {"account": "evil"}],
)
async def test_a_work_item_bound_to_another_run_gets_no_lease(runs, changes):
    view = await new_run(runs)
    answer = await leases.Heartbeats(runs).heartbeat(query(view, **changes))
    assert answer.proceed is False and answer.epoch == 0


async def test_heartbeats_renew_only_the_current_epoch(runs):
    view = await new_run(runs)
    beats = leases.Heartbeats(runs)
    assert (await beats.heartbeat(query(view, "a"))).epoch == 1
    assert (await beats.heartbeat(query(view, "a", epoch=1))).proceed is True
    assert (await beats.heartbeat(query(view, "a", epoch=2))).proceed is False  # a future epoch
    assert (await beats.heartbeat(query(view, "b"))).proceed is False  # `a` is alive


@pytest.mark.parametrize(
    "state, silent_s, interrupted",
    [
        (RunState.running, leases.SILENCE_S + 1, True),
        (RunState.running, leases.SILENCE_S - 1, False),
        (RunState.queued, leases.SILENCE_S + 1, False),  # not running: nobody to lose
        (RunState.awaiting_approval, leases.SILENCE_S + 1, False),
    ],
)
async def test_the_watcher_interrupts_only_a_silent_running_run(runs, state, silent_s, interrupted):
    view = await new_run(runs, RunState.queued)
    await runs.lease("acme", view.run_id, "t", 0, 1000.0, leases.SILENCE_S, lambda v: True)
    if state is not RunState.queued:
        await runs.move("acme", view.run_id, RunState.running)
    if state is RunState.awaiting_approval:
        await runs.move("acme", view.run_id, state)
    found = await leases.watch_once(runs, 1000.0 + silent_s)
    assert (view.run_id in found) is interrupted
    after = await runs.get("acme", view.run_id)
    assert after.state is (RunState.interrupted if interrupted else state)
    assert len(await runs.interruptions("acme", view.run_id)) == int(interrupted)


@pytest.mark.parametrize("state", list(CANCEL_TO))
async def test_cancel_moves_each_cancellable_state_where_the_table_says(runs, state):
    view = await new_run(runs, state)
    moved, applied = await runs.move("acme", view.run_id, CANCEL_TO)
    assert applied and moved.state is CANCEL_TO[state]


async def test_update_cannot_write_a_state(runs):
    view = await new_run(runs)
    with pytest.raises(NotAMove):
        await runs.update(
            "acme", view.run_id, None, lambda v: msgspec.structs.replace(v, state=RunState.running)
        )
    assert (await runs.get("acme", view.run_id)).state is RunState.queued


async def test_each_node_of_a_multi_node_run_holds_its_own_lease_fenced_alike(runs):
    view = await new_run(runs, nodes=2)
    beats = leases.Heartbeats(runs)
    node0 = await beats.heartbeat(query(view, "a"))
    node1 = await beats.heartbeat(query(view, "b", node_rank=1))
    assert (node0.proceed, node0.epoch, node1.proceed, node1.epoch) == (True, 1, True, 1)
    # node 1's lease is not node 0's: renewing one does not renew or fence the other
    assert (await beats.heartbeat(query(view, "b", epoch=1, node_rank=1))).proceed
    assert (await beats.heartbeat(query(view, "a", epoch=1))).proceed
    # a live holder of node 1 keeps a second agent out; only node 0 is in the watcher's index
    assert not (await beats.heartbeat(query(view, "c", node_rank=1))).proceed
    assert view.run_id in await runs.leased()


@pytest.mark.parametrize("node_rank", [2, -1, 7])
async def test_a_node_the_run_does_not_have_gets_no_lease(runs, node_rank):
    view = await new_run(runs, nodes=2)
    answer = await leases.Heartbeats(runs).heartbeat(query(view, node_rank=node_rank))
    assert not answer.proceed
    renewal = await leases.Heartbeats(runs).heartbeat(query(view, epoch=1, node_rank=node_rank))
    assert not renewal.proceed


async def test_a_one_node_run_has_no_node_1(runs):
    view = await new_run(runs)
    assert not (await leases.Heartbeats(runs).heartbeat(query(view, node_rank=1))).proceed


async def test_a_node_share_needs_the_run_binding_too(runs):
    view = await new_run(runs, nodes=2)
    answer = await leases.Heartbeats(runs).heartbeat(query(view, node_rank=1, booking_id="other"))
    assert not answer.proceed
