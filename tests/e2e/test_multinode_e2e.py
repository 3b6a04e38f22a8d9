"""A run booked on 2 nodes trains on two trainer agents, one torchft replica group each: through
`ecc ito train`, to `succeeded`; node 0 reports the run, node 1 trains its share under its own
lease and writes its per-node log; status shows the parallelism over 2 nodes. Here the "nodes" are
two `ito-training serve trainer` processes on one machine, their groups on loopback.

Node 1's agent SIGKILLed mid-stage: a replacement agent leases node 1's redelivered item at a higher
epoch, resumes node 1's checkpoint and heals from node 0, which trains on throughout; the run
succeeds without ever leaving `running`.

A custom-data ladder, SFT, DPO and RLVR on 2 nodes: node 0 decides the ladder and node 1 takes its
decision from the rendezvous store; the post stages train as two replica groups (RLVR with a rollout
worker per node), ending with the same weights on both nodes.

Several GPUs per node on several nodes is no longer refused: such a run trains (2 nodes of 2 ranks,
tests/e2e/test_multinode_gang_e2e.py, with the default settings)."""

import json
import os
import pathlib
import signal

import pytest

from contracts.models import MODEL_SHAPES
from devstack.infra import alive, holder_of
from tests.support import (
    FULL_RECIPE_STEPS,
    confirm_and_train,
    eventually,
    full_recipe,
    multi_agent_stack,
    run_state,
    run_status,
)
from training.engine.checkpoint_load import load_weights
from training.engine.fault_tolerance import weights_checksum
from training.model import Transformer

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

NODES = {"nodes": 2, "gpus_per_node": 1}
RUN_TIMEOUT_S = 300  # two agents of the tiny model on 2 cores; most of it start-up and quorums


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """All services plus a second trainer agent (node 1's), with the scheduler allowed to plan the
    tiny model on several nodes (ITO_PLAN_SMALL_MODEL_GANGS)."""
    with multi_agent_stack(tmp_path_factory.mktemp("multinode-stack")) as s:
        yield s


def _node_events(run_dir: pathlib.Path, node: int) -> list[dict]:
    path = run_dir / f"node-{node}" / "node.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_two_node_run_trains_on_two_agents(stack, manifest):
    account, _, env = stack.account()
    booking = stack.booking(account, nodes=2, gpus_per_node=1)
    steps = 12
    m = manifest(
        resources=NODES,
        target={"tokens": steps * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003},
        checkpoint={"interval_steps": 4, "keep_last": 2, "storage": "local"},
    )
    rc, plan = stack.ecc("plan", "--booking", booking, "--manifest", str(m), env=env)
    assert rc == 0 and plan["data"]["ok"], plan
    assert plan["data"]["degrees"].get("dp_replicate") == 2, plan["data"]

    train = confirm_and_train(stack, env, booking, str(m), "two-nodes")
    run_id = train["data"]["run_id"]

    final = run_state(stack, env, run_id, {"succeeded", "failed", "gate_failed"}, timeout=RUN_TIMEOUT_S)
    assert final["state"] == "succeeded", final
    assert final["step"] == final["total_steps"] == steps
    assert final["nodes"] == 2
    used = final["parallelism"]
    assert used["world_size"] == 2 and used["mesh"] == {"dp_replicate": 2}, used

    # Node 0 reported the run; node 1 trained its share, every step, in its own log.
    rc, logs = stack.ecc("logs", run_id, env=env)
    assert rc == 0, logs
    messages = [ln["message"] for ln in logs["data"]["lines"]]
    assert any("node 0 of 2 joins as replica group 0" in msg for msg in messages), messages
    run_dir = stack.run_dir(run_id)
    events = _node_events(run_dir, 1)
    joined = [e["message"] for e in events if "joins as replica group 1" in e.get("message", "")]
    assert joined and "2 of 2 nodes met" in joined[0], events[:5]
    node1_steps = [e["step"] for e in events if e.get("kind") == "metrics"]
    assert node1_steps and max(node1_steps) == steps, node1_steps
    assert any("node 1: succeeded" in e.get("message", "") for e in events), events[-3:]
    assert list((run_dir / "node-1" / "pretrain").glob("step-*")), "node 1 committed no checkpoint"

    human = stack.run("ecc", "ito", "status", run_id, env=env)
    assert human.returncode == 0, human.stderr
    assert "world size 2, mesh dp_replicate 2, 2 nodes" in human.stdout, human.stdout


@pytest.mark.chaos  # long: `make chaos` runs it (its short version stays in the suite)
@pytest.mark.skipif(not pathlib.Path("/proc/self/fd").is_dir(), reason="finds node 1's agent through /proc")
def test_node_1s_agent_killed_mid_stage_is_replaced_and_heals_from_node_0(stack, manifest):
    account, _, env = stack.account()
    booking = stack.booking(account, nodes=2, gpus_per_node=1)
    steps, every = 500, 20  # long enough that node 0 is still training when node 1's replacement joins
    m = manifest(
        resources=NODES,
        target={"tokens": steps * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003},
        checkpoint={"interval_steps": every, "keep_last": 2, "storage": "local"},
    )
    train = confirm_and_train(stack, env, booking, str(m), "two-nodes-kill")
    run_id = train["data"]["run_id"]

    def never_interrupted(view):
        assert view["state"] in ("accepted", "queued", "running", "succeeded"), view
        return view

    run_status(stack, env, run_id, lambda v: never_interrupted(v) and v["state"] != "accepted", timeout=60)
    run_dir = stack.run_dir(run_id)
    node1_log = run_dir / "node-1" / "node.jsonl"

    def node1_committed():
        never_interrupted(run_status(stack, env, run_id, lambda v: True, timeout=10))
        ckpts = list((run_dir / "node-1" / "pretrain").glob("step-*/COMMITTED"))  # a committed save
        return (
            node1_log.exists() and ckpts and any(e.get("kind") == "metrics" for e in _node_events(run_dir, 1))
        )

    eventually(node1_committed, timeout=90, interval=0.2, what="node 1 committed a checkpoint")
    up_trainer = json.loads((stack.data_dir / "up.json").read_text())["services"]["trainer"]
    agents = [up_trainer] + [a.pid for a in stack.agents if a.poll() is None]
    node1_pid = eventually(lambda: holder_of(node1_log, agents), timeout=10, what="node 1's agent")
    node0_pid = next(pid for pid in agents if pid != node1_pid and alive(pid))
    os.kill(node1_pid, signal.SIGKILL)
    killed_at = max(e["step"] for e in _node_events(run_dir, 1) if e.get("kind") == "metrics")
    stack.start_agent()  # the replacement; JetStream redelivers node 1's item to it after AckWait

    final = run_status(
        stack, env, run_id, lambda v: never_interrupted(v)["state"] == "succeeded", timeout=RUN_TIMEOUT_S
    )
    assert final["step"] == final["total_steps"] == steps, final
    assert alive(node0_pid), "node 0's agent was stopped"

    events = _node_events(run_dir, 1)
    epochs = sorted({e["epoch"] for e in events})
    assert len(epochs) == 2 and epochs[0] < epochs[1], epochs  # the replacement leased at a higher epoch
    later = [e for e in events if e["epoch"] == epochs[1]]
    messages = [e.get("message", "") for e in later]
    resumed = [int(msg.rsplit(" ", 1)[1]) for msg in messages if "replica group 1 resumed at step" in msg]
    healed = [int(msg.rsplit(" ", 1)[1]) for msg in messages if "replica group 1 healed at step" in msg]
    assert resumed and resumed[0] % every == 0 and resumed[0] <= killed_at, (
        resumed,
        killed_at,
        messages[:12],
    )
    assert healed and healed[0] > resumed[0], (healed, resumed)  # node 0 was ahead: node 1 caught up from it
    node1_steps = [e["step"] for e in later if e.get("kind") == "metrics"]
    assert node1_steps and max(node1_steps) == steps, node1_steps[-3:]
    assert any("node 1: succeeded" in msg for msg in messages), messages[-3:]


def test_a_custom_data_ladder_and_post_training_train_on_two_nodes(stack, manifest, tmp_path):
    """data_prep -> ladder (custom data) -> pretrain -> sft -> rlvr on 2 nodes: node 0 decides
    the ladder and node 1 takes its decision (no proxy runs of its own); every stage trains as two
    replica groups, node 1 each stage's every step, RLVR with one rollout worker per node; both
    nodes end with the same weights."""
    account, _, env = stack.account()
    booking = stack.booking(account, nodes=2, gpus_per_node=1)
    m = full_recipe(manifest, stack.file_root(account), NODES)
    train = confirm_and_train(stack, env, booking, str(m), "two-nodes-post")
    run_id = train["data"]["run_id"]
    final = run_state(stack, env, run_id, {"succeeded", "failed", "gate_failed"}, timeout=2 * RUN_TIMEOUT_S)
    assert final["state"] == "succeeded", final
    assert [g["stage"] for g in final["gates"]] == ["ladder", "pretrain", "sft", "rlvr"], final["gates"]
    assert final["parallelism"]["stage"] == "rlvr" and final["parallelism"]["mesh"] == {"dp_replicate": 2}

    run_dir = stack.run_dir(run_id)
    node1 = run_dir / "node-1"
    decision = json.loads((run_dir / "ladder" / "decision.json").read_text())
    assert json.loads((node1 / "ladder" / "decision.json").read_text()) == decision  # node 0's, taken
    assert not (node1 / "ladder" / "reference").exists(), "node 1 ran proxies of its own"
    events = _node_events(run_dir, 1)
    messages = [e.get("message", "") for e in events]
    for stage, steps in FULL_RECIPE_STEPS.items():
        joined = [msg for msg in messages if msg.startswith(f"{stage}: node 1 of 2 joins as replica group 1")]
        assert joined and "2 of 2 nodes met" in joined[0], (stage, messages[:20])
        node1_steps = [e["step"] for e in events if e.get("kind") == "metrics" and e.get("stage") == stage]
        assert node1_steps and max(node1_steps) == steps, (stage, node1_steps)
    assert any("node 1: succeeded" in msg for msg in messages), messages[-3:]
    worker = "rlvr: 1 rollout worker (rank 0's) for 1 rank of replica group {} of 2"
    assert messages.count(worker.format(1)) == 1, [m for m in messages if m.startswith("rlvr")]
    rc, logs = stack.ecc("logs", run_id, env=env)
    assert rc == 0, logs
    assert [ln["message"] for ln in logs["data"]["lines"]].count(worker.format(0)) == 1

    weights = []
    for directory in (run_dir / "rlvr", node1 / "rlvr"):
        model = Transformer(MODEL_SHAPES["tiny"])
        assert load_weights(directory, model) is not None, directory
        weights.append(weights_checksum(model))
    assert weights[0] == weights[1]  # the two replica groups ended with the same weights
