"""A run booked on 2 nodes of 2 GPUs: each node's agent starts a gang of 2 ranks under torchrun
(FSDP2 over the node's ranks), and the gang's ranks together are the node's torchft replica group
(node 0 hosts the Lighthouse); through `ecc ito train` to `succeeded`, with status showing world
size 4 and the mesh {dp_replicate 2, dp_shard 2}. The "nodes" are two `ito-training serve trainer`
processes on one machine, their ranks on CPU/gloo over loopback. The two gangs meet at their first
quorum and train together from step 1: one of them takes the other's state at step 0 (torchft's
initial sync, the same heal, rank by rank, that a late or replaced gang goes through)."""

import pytest

from tests.support import confirm_and_train, multi_agent_stack, run_state

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

RUN_TIMEOUT_S = 240  # 4 ranks of the tiny model on a few cores; most of it start-up and quorums


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """All services plus node 1's trainer agent, one CPU thread per rank."""
    # No ITO_MULTINODE_GANGS: several GPUs per node on several nodes trains by default.
    with multi_agent_stack(
        tmp_path_factory.mktemp("multinode-gang-stack"), {"ITO_GANG_MAX_RESTARTS": "0"}
    ) as s:
        yield s


def test_two_nodes_of_two_ranks_train_as_two_replica_groups_of_fsdp2_gangs(stack, manifest):
    account, _, env = stack.account()
    booking = stack.booking(account, nodes=2, gpus_per_node=2)
    steps = 6
    m = manifest(
        resources={"nodes": 2, "gpus_per_node": 2},
        target={"tokens": steps * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003},
        checkpoint={"interval_steps": 3, "keep_last": 2, "storage": "local"},
    )
    rc, plan = stack.ecc("plan", "--booking", booking, "--manifest", str(m), env=env)
    assert rc == 0 and plan["data"]["ok"], plan
    assert plan["data"]["strategy"] == "hsdp", plan["data"]
    assert plan["data"]["degrees"] == {"dp_replicate": 2, "dp_shard": 2}, plan["data"]

    train = confirm_and_train(stack, env, booking, str(m), "two-by-two")
    run_id = train["data"]["run_id"]

    final = run_state(stack, env, run_id, {"succeeded", "failed", "gate_failed"}, timeout=RUN_TIMEOUT_S)
    assert final["state"] == "succeeded", final
    assert final["step"] == final["total_steps"] == steps
    assert final["nodes"] == 2
    used = final["parallelism"]
    assert used["world_size"] == 4 and used["mesh"] == {"dp_replicate": 2, "dp_shard": 2}, used

    # Each node trained on a gang of 2 ranks: per-rank logs under its own directory.
    run_dir = stack.run_dir(run_id)
    for node_dir in (run_dir, run_dir / "node-1"):
        ranks = {p.parent.name for p in (node_dir / "gang" / "pretrain" / "logs").rglob("stdout.log")}
        assert ranks == {"0", "1"}, (node_dir, ranks)
    assert list((run_dir / "node-1" / "pretrain").glob("step-*")), "node 1 committed no checkpoint"
    events = [
        run_dir / "gang" / "pretrain" / "events.jsonl",
        run_dir / "node-1" / "gang" / "pretrain" / "events.jsonl",
    ]
    synced = [line for path in events for line in path.read_text().splitlines() if "healed at step 0" in line]
    assert len(synced) == 1, f"the gangs did not meet at their first quorum: {synced}"

    human = stack.run("ecc", "ito", "status", run_id, env=env)
    assert human.returncode == 0, human.stderr
    assert "hsdp, world size 4, mesh dp_replicate 2 x dp_shard 2, 2 nodes" in human.stdout, human.stdout
