"""An approved loss-spike restart is queued on every node of the run: one signed work item per node
(the hand-off's `node_shares`), each carrying the proposal, with distinct message ids; a one-node
run's restart stays one item under the restart's own id."""

from datetime import UTC, datetime

import msgspec
import pytest

from contracts.api import ApproveRequest, RestartProposal, RunView
from contracts.runs import TrainWork
from contracts.states import RunState
from services.scheduler.mutations import Mutations
from tests.training.test_node_shares import work

PROPOSAL = RestartProposal(
    stage="pretrain", checkpoint_step=40, skip_from=40, skip_to=80, spike_step=60, reason="spike"
)
NOW = datetime(2026, 1, 1, tzinfo=UTC)


class Runs:
    """The run records `_restart` reads and moves: one paused run and its stored work item."""

    def __init__(self, stored: TrainWork) -> None:
        self.stored = msgspec.json.encode(stored)
        self.view = RunView(
            run_id=stored.run_id,
            account=stored.account,
            booking_id=stored.booking_id,
            manifest_digest=stored.manifest_digest,
            idempotency_key="k",
            state=RunState.awaiting_approval,
            created_at=NOW,
            updated_at=NOW,
            proposal=PROPOSAL,
            nodes=stored.nodes,
        )

    async def get(self, account: str, run_id: str) -> RunView:
        return self.view

    async def recall(self, account: str, run_id: str, what: str) -> bytes:
        assert what == "work"
        return self.stored

    async def move(self, account: str, run_id: str, state: RunState, **_: object) -> tuple[RunView, bool]:
        self.view = msgspec.structs.replace(self.view, state=state, proposal=None)
        return self.view, True


class Peers:
    def __init__(self) -> None:
        self.published: list[tuple[str, TrainWork, str]] = []

    async def publish_work(self, run_id: str, body: bytes, msg_id: str) -> None:
        self.published.append((run_id, msgspec.json.decode(body, type=TrainWork), msg_id))


@pytest.mark.parametrize("nodes", [1, 2, 3])
async def test_an_approved_restart_republishes_every_nodes_work_item(nodes):
    runs, peers = Runs(work(nodes, rendezvous="" if nodes == 1 else "127.0.0.1:29400")), Peers()
    mutations = Mutations(credentials=None, peers=peers, runs=runs)  # type: ignore[arg-type]
    await mutations._restart("acme", ApproveRequest(run_id="run_1", idempotency_key="approve-1"))

    assert runs.view.state is RunState.queued
    assert [item.node_rank for _, item, _ in peers.published] == list(range(nodes))
    assert all(run_id == "run_1" and item.restart == PROPOSAL for run_id, item, _ in peers.published)
    ids = [msg_id for _, _, msg_id in peers.published]
    assert ids[0].startswith("run_1:restart:")  # not the hand-off's id, which JetStream would drop
    assert ids[1:] == [f"{ids[0]}:node-{n}" for n in range(1, nodes)]
