"""A run booked on 2 nodes trains on two trainer agents, one torchft replica group each: through
`ecc ito train`, to `succeeded`; node 0 reports the run, node 1 trains its share under its own
lease and writes its per-node log; status shows the parallelism over 2 nodes. Here the "nodes" are
two `ito-training serve trainer` processes on one machine, their groups on loopback."""

import json
import pathlib
import signal
import subprocess

import pytest

from tests.conftest import BIN, start_stack
from tests.support import run_state

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

NODES = {"nodes": 2, "gpus_per_node": 1}
RUN_TIMEOUT_S = 300  # two agents of the tiny model on 2 cores; most of it start-up and quorums


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """All services plus a second trainer agent (node 1's), with the scheduler allowed to plan the
    tiny model on several nodes (ITO_PLAN_SMALL_MODEL_GANGS)."""
    s = start_stack(tmp_path_factory.mktemp("multinode-stack"), env={"ITO_PLAN_SMALL_MODEL_GANGS": "1"})
    log = open(s.data_dir / "second-trainer.log", "ab")
    second = subprocess.Popen(
        [str(BIN / "ito-training"), "serve", "trainer"], env=s.env, stdout=log, stderr=log
    )
    try:
        yield s
    finally:
        second.send_signal(signal.SIGTERM)
        try:
            second.wait(timeout=30)
        except subprocess.TimeoutExpired:
            second.kill()
            second.wait()
        log.close()
        s.run("ito-training", "down", timeout=60)


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

    _, conf = stack.ecc("confirm", "--action", "train", "--booking", booking, "--manifest", str(m), env=env)
    rc, train = stack.ecc(
        "train",
        "--booking",
        booking,
        "--manifest",
        str(m),
        "--confirmation-ref",
        conf["data"]["confirmation_ref"],
        "--idempotency-key",
        "two-nodes",
        env=env,
    )
    assert rc == 0 and train["ok"], train
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
    run_dir = pathlib.Path(final["checkpoint_dir"])
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
