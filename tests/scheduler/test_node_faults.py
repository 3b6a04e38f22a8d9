"""A multi-node run's faults, as tables: a lost gang's requeues are the run's own count (never
JetStream's deliveries); a follower's failure fails the run naming the node (through its lease and
`lifecycle.move`), unless the run moved on; what becomes of a follower's work item; an approved
restart rewinds a follower's directory to node 0's checkpoint step and skip window."""

import json
import pathlib
import uuid
from datetime import UTC, datetime

import pytest

from contracts.api import LeaseAnswer, LeaseQuery, RestartProposal, RunView
from contracts.runs import StateChanged
from contracts.states import RunState
from runtime.messaging import codec
from services.scheduler import leases
from services.scheduler.events import requeue_count
from services.scheduler.memory import InMemoryRuns
from services.trainer import follower
from services.trainer.endings import lost_gang_state
from training.engine.checkpoint_dir import (
    MARKER,
    SIDECAR,
    SKIP_FILE,
    batches_to_skip,
    list_checkpoints,
    pin,
    skip_window,
    step_dir,
)
from training.engine.distributed import ParallelismError
from training.launch.elastic import GangFailed, GangLost

NOW = datetime.now(UTC)
LOST = GangLost("The gang of 2 ranks exited with code 1 after up to 0 restarts.")


# --- a lost gang's requeues: counted by the run, bounded by ITO_GANG_MAX_REQUEUES


@pytest.mark.parametrize(
    ("requeued", "max_requeues", "want", "count", "says"),
    [
        (0, 2, RunState.interrupted, 1, "(requeue 1 of at most 2; attempt 2 of at most 3)"),
        (1, 2, RunState.interrupted, 2, "(requeue 2 of at most 2; attempt 3 of at most 3)"),
        (
            2,
            2,
            RunState.failed,
            None,
            "requeued 2 times for a lost gang already (at most 2, ITO_GANG_MAX_REQUEUES=2)",
        ),
        (0, 0, RunState.failed, None, "requeued 0 times for a lost gang already (at most 0"),
        (5, 2, RunState.failed, None, "requeued 5 times"),
    ],
)
def test_a_lost_gang_is_requeued_as_often_as_the_run_has_requeues_left(
    requeued, max_requeues, want, count, says
):
    state, message, new_count = lost_gang_state(LOST, requeued, max_requeues)
    assert (state, new_count) == (want, count)
    assert str(LOST) in message and says in message, message
    if want is RunState.interrupted:
        assert "requeued to resume from the last checkpoint" in message
    else:
        assert message.startswith("training failed:") and "Not requeued again" in message


def test_redeliveries_for_other_reasons_cost_no_requeue():
    """The bound reads the run's count, whatever JetStream's delivery count is: an agent lost twice
    and a fence (deliveries 2, 3, 4) still leave a first lost gang its requeue."""
    state, _, count = lost_gang_state(LOST, requeued=0, max_requeues=1)
    assert (state, count) == (RunState.interrupted, 1)


def _changed(state: RunState, gang_requeues: int | None) -> StateChanged:
    return StateChanged(run_id="r", seq=1, at=NOW, state=state, gang_requeues=gang_requeues)


@pytest.mark.parametrize(
    ("state", "gang_requeues", "fields"),
    [
        (RunState.interrupted, 1, {"gang_requeues": 1}),
        (RunState.interrupted, 2, {"gang_requeues": 2}),
        (RunState.interrupted, None, {}),  # interrupted for another reason: no count
        (RunState.failed, 3, {}),  # only the interruption that requeues sets it
        (RunState.running, None, {}),
    ],
)
def test_the_scheduler_keeps_the_count_the_requeuing_interruption_carries(state, gang_requeues, fields):
    assert requeue_count(_changed(state, gang_requeues)) == fields


async def test_the_lease_says_how_many_requeues_the_run_used():
    runs = InMemoryRuns()
    view = await _new_run(runs, RunState.interrupted, nodes=1)
    await runs.move("acme", view.run_id, RunState.queued, gang_requeues=0)  # a move keeps other fields
    await runs.move("acme", view.run_id, RunState.running, gang_requeues=1)
    answer = await leases.Heartbeats(runs).heartbeat(_query(view))
    assert answer.proceed and answer.gang_requeues == 1


# --- a follower's failure fails the run, naming the node


async def _new_run(runs: InMemoryRuns, state: RunState, nodes: int = 2) -> RunView:
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


def _query(view: RunView, **changes) -> LeaseQuery:
    fields = {
        "run_id": view.run_id,
        "trainer_id": "t1",
        "epoch": 0,
        "account": view.account,
        "booking_id": view.booking_id,
        "manifest_digest": view.manifest_digest,
        "plan_sha256": codec.digest(view.plan),
        **changes,
    }
    return LeaseQuery(**fields)


@pytest.mark.parametrize(
    ("state", "after"),
    [
        (RunState.running, RunState.failed),
        (RunState.queued, RunState.failed),
        (RunState.accepted, RunState.failed),
        (RunState.interrupted, RunState.interrupted),  # node 0 lost: the follower rejoins instead
    ],
)
async def test_a_followers_failure_fails_the_run_naming_the_node(state, after):
    runs = InMemoryRuns()
    view = await _new_run(runs, state)
    beats = leases.Heartbeats(runs)
    granted = await beats.heartbeat(_query(view, node_rank=1))
    assert granted.proceed
    answer = await beats.heartbeat(
        LeaseQuery(
            run_id=view.run_id, trainer_id="t1", epoch=granted.epoch, node_rank=1, failure="GangFailed: boom"
        )
    )
    assert (answer.proceed, answer.state) == (False, after)
    stored = await runs.get("acme", view.run_id)
    assert stored is not None and stored.state is after
    if after is RunState.failed:
        assert stored.message == "training failed: node 1 failed: GangFailed: boom"


async def test_a_fenced_or_node_0_failure_report_changes_nothing():
    runs = InMemoryRuns()
    view = await _new_run(runs, RunState.running)
    beats = leases.Heartbeats(runs)
    held = await beats.heartbeat(_query(view, node_rank=1))
    fenced = await beats.heartbeat(  # an epoch this node's lease no longer has: a fenced holder
        LeaseQuery(run_id=view.run_id, trainer_id="t0", epoch=held.epoch + 1, node_rank=1, failure="boom")
    )
    assert not fenced.proceed and fenced.state is RunState.running
    node0 = await beats.heartbeat(_query(view))
    await beats.heartbeat(LeaseQuery(run_id=view.run_id, trainer_id="t1", epoch=node0.epoch, failure="boom"))
    stored = await runs.get("acme", view.run_id)
    assert stored is not None and stored.state is RunState.running  # node 0 reports through its events


@pytest.mark.parametrize(
    ("failure", "says"),
    [
        ("x" * 1000, "x" * leases.MAX_FAILURE_CHARS),
        ("two\nlines", "two lines"),
        ("", "no reason given"),
    ],
)
def test_a_nodes_failure_message_is_one_capped_line(failure, says):
    assert leases.node_failure_message(2, failure) == f"training failed: node 2 failed: {says}"


@pytest.mark.parametrize(
    ("exc", "says"),
    [
        (GangFailed("The gang of 2 ranks left no result."), "The gang of 2 ranks left no result."),
        (LOST, str(LOST)),
        (ParallelismError("The plan does not fit."), "The plan does not fit."),
        (RuntimeError("/secret/path/x.pt: bad"), "RuntimeError"),  # any other text stays in the node's log
        (OSError(28, "No space left on device"), "OSError"),
    ],
)
def test_a_followers_failure_says_our_own_sentences_and_otherwise_only_the_type(exc, says):
    assert follower.share_failure(exc) == says


A = follower.ItemEnd


@pytest.mark.parametrize(
    ("state", "failed", "want"),
    [
        (None, False, A.leave),  # no answer: the lease decides on redelivery
        (None, True, A.requeue),  # no answer to a failure: report it again later
        (RunState.awaiting_approval, False, A.ack),  # paused: the approval brings a fresh item
        (RunState.succeeded, False, A.ack),
        (RunState.cancelling, False, A.ack),
        (RunState.failed, True, A.ack),  # our failure failed the run
        (RunState.interrupted, True, A.requeue),  # node 0 lost: rejoin when it resumes
        (RunState.running, False, A.leave),  # fenced by a newer holder of this node
        (RunState.running, True, A.leave),
    ],
)
def test_what_becomes_of_a_followers_item_once_its_share_stopped(state, failed, want):
    answer = None if state is None else LeaseAnswer(run_id="r", proceed=False, state=state)
    assert follower.after_share(answer, failed) is want


# --- an approved restart rewinds a follower as node 0


def _commit(stage: pathlib.Path, step: int, position: int | None = None) -> None:
    path = step_dir(stage, step)
    path.mkdir(parents=True)
    (path / SIDECAR).write_text(
        json.dumps({"step": step, "data_position": step if position is None else position})
    )
    (path / MARKER).write_text(json.dumps({"step": step, "bytes": 1, "stall_s": 0.0, "save_s": 0.0}))


RESTART = RestartProposal(
    stage="pretrain", checkpoint_step=20, skip_from=20, skip_to=45, spike_step=30, reason="r"
)


@pytest.mark.parametrize(
    ("kept", "resumes_from", "says"),
    [
        ([10, 20, 30, 40], 20, "from checkpoint step 20 (set aside later ones: [30, 40])"),  # it kept step 20
        ([40, 50], None, "no longer keeps (set aside: [40, 50]): resuming from the start"),  # pruned
        ([10, 40, 50], 10, "resuming from its checkpoint step 10 and healing from node 0"),
    ],
)
def test_an_approved_restart_rewinds_a_follower_to_node_0s_step_and_skip(tmp_path, kept, resumes_from, says):
    stage = tmp_path / "pretrain"
    for step in kept:
        _commit(stage, step)
    (stage / "GATE.json").write_text("{}")  # the follower had finished the stage alone
    (tmp_path / "midtrain").mkdir()
    (tmp_path / "midtrain" / "GATE.json").write_text("{}")
    line = follower.rewind_share(tmp_path, RESTART, ["midtrain"])
    assert says in line and "skipping batches [20, 45)" in line, line
    assert "set aside the later stages midtrain" in line
    left = [c.step for c in list_checkpoints(stage)]
    assert left == [s for s in kept if s <= 20] and (max(left) if left else None) == resumes_from
    assert skip_window(stage) == (20, 45)  # the same window as node 0's
    if resumes_from == 20:
        assert batches_to_skip(stage, 20) == 45  # the resume at step 20 skips, as on node 0
    assert not (stage / "GATE.json").exists() and not (tmp_path / "midtrain").exists()  # trained again
    assert (stage / "discarded" / "GATE.json").exists() and (tmp_path / "discarded" / "midtrain").is_dir()


def test_a_restart_from_the_start_sets_aside_every_checkpoint(tmp_path):
    stage = tmp_path / "pretrain"
    for step in (10, 20):
        _commit(stage, step)
    pin(stage, 10)
    restart = RestartProposal(
        stage="pretrain", checkpoint_step=0, skip_from=0, skip_to=15, spike_step=12, reason="r"
    )
    follower.rewind_share(tmp_path, restart, [])
    assert list_checkpoints(stage) == [] and json.loads((stage / SKIP_FILE).read_text()) == {
        "from": 0,
        "to": 15,
    }
    assert not list(stage.glob("step-*/PINNED"))  # nothing left pinned to keep from pruning


def test_a_follower_that_recorded_another_position_there_heals_instead(tmp_path):
    stage = tmp_path / "pretrain"
    _commit(stage, 10)
    _commit(stage, 20, position=33)  # not node 0's position at step 20: resuming it would skip nothing
    line = follower.rewind_share(tmp_path, RESTART, [])
    assert "no longer keeps" in line and [c.step for c in list_checkpoints(stage)] == [10]
    assert skip_window(stage) == (20, 45)
