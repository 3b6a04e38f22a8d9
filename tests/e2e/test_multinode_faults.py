"""Faults of a run on 2 nodes (two trainer agents on one machine, one torchft replica group each),
through real `ecc` processes.

A loss spike on node 0 (planted): the run pauses for approval while node 1 stops and gives its item
back; a confirmed `restart_from_checkpoint` restarts both nodes from the proposal's checkpoint step,
skipping the same batches, so neither heals the other forward past the rewind; the run succeeds.
A follower that trained on alone past the proposal's checkpoint (and pruned it) while node 0
waited for it is stopped by the pause without failing the run, and at the restart heals from
node 0 at that step.

Node 1's share raising (a planted fault): the run fails, its message naming node 1."""

import json
import pathlib

import pytest

from runtime.configuration import faults
from tests.support import (
    approve_restart,
    confirm_and_train,
    eventually,
    multi_agent_stack,
    run_state,
    run_status,
)
from training.engine.checkpoint_dir import committed_positions

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

NODES = {"nodes": 2, "gpus_per_node": 1}
RUN_TIMEOUT_S = 240  # two agents of the tiny model on 2 cores, on a machine shared with other tests
TERMINAL = {"succeeded", "failed", "gate_failed", "cancelled"}


def _node_events(run_dir: pathlib.Path, node: int) -> list[dict]:
    path = run_dir / f"node-{node}" / "node.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.chaos  # long: `make chaos` runs it (its short version stays in the suite)
def test_an_approved_spike_restart_rewinds_every_node_alike(tmp_path_factory, manifest):
    spike_env = {faults.ENV_FAULT_POINT: faults.TRAINER_LOSS_SPIKE, faults.ENV_SPIKE_STEP: "24"}
    with multi_agent_stack(tmp_path_factory.mktemp("multinode-spike"), spike_env) as stack:
        account, _, env = stack.account()
        booking = stack.booking(account, nodes=2, gpus_per_node=1)
        steps = 40  # the spike detector needs 20 steps of history before the planted spike
        m = manifest(
            resources=NODES,
            target={"tokens": steps * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003},
            checkpoint={"interval_steps": 5, "keep_last": 20, "storage": "local"},
        )
        run_id = confirm_and_train(stack, env, booking, str(m), "spike-2-nodes")["data"]["run_id"]

        def paused(view):
            assert view["state"] in ("accepted", "queued", "running", "awaiting_approval"), view
            return view["state"] == "awaiting_approval"

        view = run_status(stack, env, run_id, paused, timeout=RUN_TIMEOUT_S)
        proposal = view["proposal"]
        assert proposal["spike_step"] == 24 and proposal["checkpoint_step"] == 20, proposal
        window = (proposal["skip_from"], proposal["skip_to"])
        assert window == (20, 28), proposal  # 5% of the stage back, 10% past the spike
        run_dir = stack.run_dir(run_id)

        approve_restart(stack, env, run_id, "ok-2-nodes")
        final = run_state(stack, env, run_id, TERMINAL | {"awaiting_approval"}, timeout=RUN_TIMEOUT_S)
        assert final["state"] == "succeeded", final
        assert final["step"] == final["total_steps"] == steps, final

        # Node 0 (the run's logs): skipped the window, never healed from node 1 past the rewind.
        _, logs = stack.ecc("logs", run_id, env=env)
        messages = [ln["message"] for ln in logs["data"]["lines"]]
        assert any("approved restart: pretrain from checkpoint step 20" in msg for msg in messages), messages
        assert "Skipping batches [20, 28) of pretrain." in messages, messages
        assert not any("replica group 0 healed" in msg for msg in messages), messages
        _, metrics = stack.ecc("metrics", run_id, env=env)
        node0_steps = [p["step"] for p in metrics["data"]["points"]]
        assert node0_steps.count(21) == 2, node0_steps  # trained again from the proposal's checkpoint

        # Node 1 (its own log): rewound to the same step with the same skip in its restart epoch.
        events = _node_events(run_dir, 1)
        last_epoch = max(e["epoch"] for e in events)
        later = [e for e in events if e["epoch"] == last_epoch]
        said = [e.get("message", "") for e in later]
        assert any("approved restart: pretrain from checkpoint step 20" in msg for msg in said), said
        assert "Skipping batches [20, 28) of pretrain." in said, said
        node1_steps = [e["step"] for e in later if e.get("kind") == "metrics"]
        assert node1_steps and node1_steps[0] == 21 and max(node1_steps) == steps, node1_steps

        # Both groups trained the same batches: their final checkpoints record the same data position.
        node0 = committed_positions(run_dir / "pretrain")
        node1 = committed_positions(run_dir / "node-1" / "pretrain")
        assert node0[steps] == node1[steps] == steps + (28 - 20), (node0, node1)


@pytest.mark.chaos  # long: `make chaos` runs it (its short version stays in the suite)
def test_a_follower_stopped_by_the_pause_heals_from_node_0_at_the_restart(tmp_path_factory, manifest):
    """A long stage: node 1 trains on alone while node 0 waits for it after the spike, until the
    pause withdraws its lease; it has pruned the proposal's checkpoint by then, so at the restart it
    sets aside everything from that step on and heals from node 0 there, on the same batches."""
    spike_env = {faults.ENV_FAULT_POINT: faults.TRAINER_LOSS_SPIKE, faults.ENV_SPIKE_STEP: "24"}
    with multi_agent_stack(tmp_path_factory.mktemp("multinode-pause"), spike_env) as stack:
        account, _, env = stack.account()
        booking = stack.booking(account, nodes=2, gpus_per_node=1)
        m = manifest(
            resources=NODES,
            target={"tokens": 4000 * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003},
            checkpoint={"interval_steps": 5, "keep_last": 2, "storage": "local"},
        )
        run_id = confirm_and_train(stack, env, booking, str(m), "pause-2-nodes")["data"]["run_id"]
        view = run_state(stack, env, run_id, {"awaiting_approval"} | TERMINAL, timeout=RUN_TIMEOUT_S)
        assert view["state"] == "awaiting_approval", view
        proposal = view["proposal"]
        assert proposal["checkpoint_step"] == 20, proposal
        run_dir = stack.run_dir(run_id)

        def over():  # node 1's share ended with the pause (stopped, or failing on its way out as
            # node 0's Lighthouse and store went away): its log says so, and it trains no more
            said = [e.get("message", "") for e in _node_events(run_dir, 1)]
            return any(msg.startswith(("node 1: ", "node 1 failed")) for msg in said)

        eventually(over, timeout=90, what="node 1's share ended by the pause")
        assert run_status(stack, env, run_id, lambda v: True)["state"] == "awaiting_approval"  # not failed
        ahead = max(e["step"] for e in _node_events(run_dir, 1) if e.get("kind") == "metrics")
        assert ahead > 20, ahead  # it had trained on past the proposal's checkpoint
        assert 20 not in committed_positions(run_dir / "node-1" / "pretrain")  # and pruned it

        approve_restart(stack, env, run_id, "ok-pause")

        def healed():
            events = _node_events(run_dir, 1)
            last = max(e["epoch"] for e in events)
            return [e for e in events if e["epoch"] == last and e.get("kind") == "metrics"] and events

        events = eventually(healed, timeout=RUN_TIMEOUT_S, what="node 1 trains again after the restart")
        last = max(e["epoch"] for e in events)
        said = [e.get("message", "") for e in events if e["epoch"] == last]
        assert any("from checkpoint step 20, which this node no longer keeps" in msg for msg in said), said
        heal = [int(msg.rsplit(" ", 1)[1]) for msg in said if "replica group 1 healed at step" in msg]
        assert heal and heal[0] >= 20, said  # from node 0, rewound: not from its own later state
        first = min(e["step"] for e in events if e["epoch"] == last and e.get("kind") == "metrics")
        assert first <= heal[0] + 5, (first, heal)  # it did not resume anywhere near where it had stopped

        _, ref = stack.ecc("confirm", "--action", "cancel", "--run", run_id, env=env)
        rc, out = stack.ecc(
            "cancel",
            run_id,
            "--confirmation-ref",
            ref["data"]["confirmation_ref"],
            "--idempotency-key",
            "c",
            env=env,
        )
        assert rc == 0, out
        final = run_state(stack, env, run_id, TERMINAL, timeout=120)
        assert final["state"] == "cancelled", final


def test_a_followers_failure_fails_the_run_naming_the_node(tmp_path_factory, manifest):
    with multi_agent_stack(
        tmp_path_factory.mktemp("multinode-share-fails"), {faults.ENV_FAULT_POINT: faults.TRAINER_SHARE_FAILS}
    ) as stack:
        account, _, env = stack.account()
        booking = stack.booking(account, nodes=2, gpus_per_node=1)
        m = manifest(
            resources=NODES,
            target={"tokens": 400 * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003},
        )
        run_id = confirm_and_train(stack, env, booking, str(m), "share-fails")["data"]["run_id"]
        final = run_state(stack, env, run_id, TERMINAL, timeout=RUN_TIMEOUT_S)
        assert final["state"] == "failed", final
        assert final["message"] == "training failed: node 1 failed: RuntimeError", final
        assert final["step"] < final["total_steps"], final  # node 0 did not finish alone
