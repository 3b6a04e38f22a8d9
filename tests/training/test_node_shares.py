"""A multi-node run's hand-off and node shares, as tables: one work item per node with distinct
message ids (node 0's is the run's own item and id, as for any run), the node rank in the signed
item; what a node refuses to train, in a sentence; where each node keeps its checkpoints."""

import json
import pathlib
import threading

import msgspec
import pytest

from contracts.manifest import Manifest
from contracts.plans import CostEstimate, Plan
from contracts.runs import TrainWork
from domain.curriculum import curriculum_of
from services.scheduler.handoff import node_shares
from tests.conftest import REPO, write_manifest
from training.engine.distributed import ParallelDims, replica_batch_rows
from training.launch import multinode
from training.launch.elastic import free_port
from training.recipes.data_ladder import LadderDecision

COST = {f.name: 0 for f in msgspec.structs.fields(CostEstimate) if f.required}
PLAN = msgspec.convert(
    {
        "booking_id": "b",
        "manifest_digest": "d",
        "strategy": "ddp",
        "degrees": {"dp_replicate": 2},
        "precision": "bf16",
        "cost": COST,
        "checks": [],
        "ok": True,
    },
    Plan,
)


HSDP_2X2 = msgspec.structs.replace(PLAN, strategy="hsdp", degrees={"dp_replicate": 2, "dp_shard": 2})
HSDP_4X2 = msgspec.structs.replace(PLAN, strategy="hsdp", degrees={"dp_replicate": 4, "dp_shard": 2})


def work(n: int, node_rank: int = 0, rendezvous: str = "127.0.0.1:29400", plan: Plan = PLAN) -> TrainWork:
    return TrainWork(
        run_id="run_1",
        account="acme",
        booking_id="b",
        manifest_text="{}",
        manifest_digest="d",
        plan=plan,
        checkpoint_dir="/x",
        nodes=n,
        node_rank=node_rank,
        rendezvous=rendezvous,
        rendezvous_key="k" * 43 if n > 1 else "",
    )


def test_a_one_node_run_is_one_item_with_the_run_id_as_message_id():
    one = work(1, rendezvous="")
    assert node_shares(one) == [(one, "run_1")]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_a_run_on_n_nodes_is_n_items_one_per_node_with_distinct_ids(n):
    shares = node_shares(work(n))
    assert [s.node_rank for s, _ in shares] == list(range(n))
    assert [msg_id for _, msg_id in shares] == ["run_1"] + [f"run_1:node-{i}" for i in range(1, n)]
    # every share is the same run: same binding, same rendezvous, only the node rank differs
    for share, _ in shares:
        assert msgspec.structs.replace(share, node_rank=0) == work(n)


@pytest.mark.parametrize("switch", [None, "1"])
def test_several_gpus_per_node_on_several_nodes_trains_with_or_without_the_old_switch(
    tmp_path, monkeypatch, switch
):
    """ITO_MULTINODE_GANGS once let such plans train while they were refused by default; it is still
    accepted and changes nothing."""
    if switch is None:
        monkeypatch.delenv(multinode.ENV_MULTINODE_GANGS, raising=False)
    else:
        monkeypatch.setenv(multinode.ENV_MULTINODE_GANGS, switch)
    m = _manifest(tmp_path, resources={"nodes": 2, "gpus_per_node": 2})
    assert multinode.refusal(work(2, 1, plan=HSDP_2X2), m, curriculum_of(m)) is None


def _manifest(tmp_path: pathlib.Path, **overrides) -> Manifest:
    return msgspec.json.decode(write_manifest(tmp_path, **overrides).read_bytes(), type=Manifest)


def test_a_share_of_one_gpu_per_node_trains(tmp_path):
    m = _manifest(tmp_path, resources={"nodes": 2, "gpus_per_node": 1})
    assert multinode.refusal(work(2, 1), m, curriculum_of(m)) is None


@pytest.mark.parametrize(
    ("resources", "share", "why"),
    [
        (
            {"nodes": 2, "gpus_per_node": 2},
            work(2, 1),
            "does not lay 2 nodes of 2 GPUs out as replica groups",
        ),
        ({"nodes": 2, "gpus_per_node": 2}, work(2, 1, plan=HSDP_4X2), "does not lay 2 nodes of 2 GPUs"),
        ({"nodes": 2, "gpus_per_node": 1}, work(3, 1), "does not match the manifest's 2 nodes"),
        ({"nodes": 2, "gpus_per_node": 1}, work(2, 2), "node 2 of 2 does not match"),
        ({"nodes": 2, "gpus_per_node": 1}, work(2, 1, rendezvous=""), "names no rendezvous endpoint"),
        (
            {"nodes": 2, "gpus_per_node": 1},
            msgspec.structs.replace(work(2, 1), rendezvous_key=""),
            "carries no rendezvous key",
        ),
    ],
)
def test_a_share_this_trainer_cannot_train_is_refused_in_a_sentence(tmp_path, resources, share, why):
    m = _manifest(tmp_path, resources=resources)
    reason = multinode.refusal(share, m, curriculum_of(m))
    assert reason is not None and why in reason, reason


def test_a_share_of_several_gpus_per_node_trains_on_a_gang_sharding_inside_the_node(tmp_path):
    m = _manifest(tmp_path, resources={"nodes": 2, "gpus_per_node": 2})
    assert multinode.refusal(work(2, 1, plan=HSDP_2X2), m, curriculum_of(m)) is None
    assert multinode.node_gang(work(2, 1, plan=HSDP_2X2)) == ParallelDims(strategy="fsdp2", dp_shard=2)
    assert multinode.node_gang(work(2, 1)) is None  # one rank per node: the agent's process is the group


def test_a_batch_that_does_not_split_over_every_rank_of_every_node_is_refused(tmp_path):
    m = _manifest(
        tmp_path,
        resources={"nodes": 2, "gpus_per_node": 2},
        target={"tokens": 6 * 32 * 4, "seq_len": 32, "batch_size": 6},
    )
    reason = multinode.refusal(work(2, 0, plan=HSDP_2X2), m, curriculum_of(m))
    assert reason is not None and "6 does not split evenly over 4 data-parallel ranks" in reason, reason


@pytest.mark.parametrize(
    ("replica_id", "groups", "dims", "rank", "rows"),
    [
        (0, 1, ParallelDims(), 0, slice(0, 8)),  # one group of one rank: the whole batch
        (1, 2, ParallelDims(), 0, slice(4, 8)),  # one rank per node: the node's half
        (0, 2, ParallelDims(strategy="fsdp2", dp_shard=2), 1, slice(2, 4)),
        (1, 2, ParallelDims(strategy="fsdp2", dp_shard=2), 0, slice(4, 6)),
        (1, 2, ParallelDims(strategy="fsdp2", dp_shard=2), 1, slice(6, 8)),
        (1, 2, ParallelDims(strategy="fsdp2+tp", dp_shard=2, tp=2), 3, slice(6, 8)),  # tp ranks share rows
    ],
)
def test_each_rank_of_each_replica_group_trains_its_own_rows_of_the_global_batch(
    replica_id, groups, dims, rank, rows
):
    assert replica_batch_rows(8, replica_id, groups, dims, rank) == rows


@pytest.mark.parametrize("recipe", [["sft"], ["sft", "dpo"], ["dpo"], ["sft", "dpo", "rlvr"]])
def test_post_training_on_several_nodes_trains_as_replica_groups(tmp_path, recipe):
    m = _manifest(tmp_path, resources={"nodes": 2, "gpus_per_node": 1}, post_training={"recipe": recipe})
    assert multinode.refusal(work(2, 0), m, curriculum_of(m)) is None
    m = _manifest(tmp_path, resources={"nodes": 2, "gpus_per_node": 2}, post_training={"recipe": recipe})
    assert multinode.refusal(work(2, 1, plan=HSDP_2X2), m, curriculum_of(m)) is None


def test_rlvr_on_several_nodes_trains_when_its_prompts_split_over_the_nodes(tmp_path):
    recipe = {"recipe": ["sft", "rlvr"], "rlvr": {"prompts_per_step": 4}}
    m = _manifest(tmp_path, resources={"nodes": 2, "gpus_per_node": 1}, post_training=recipe)
    assert multinode.refusal(work(2, 0), m, curriculum_of(m)) is None
    recipe = {"recipe": ["sft", "rlvr"], "rlvr": {"prompts_per_step": 3}}
    m = _manifest(tmp_path, resources={"nodes": 2, "gpus_per_node": 1}, post_training=recipe)
    reason = multinode.refusal(work(2, 0), m, curriculum_of(m))
    assert reason is not None and "3 prompts per step do not split evenly over 2 nodes" in reason, reason


def test_a_post_batch_that_does_not_split_over_every_rank_of_every_node_is_refused(tmp_path):
    m = _manifest(
        tmp_path,
        resources={"nodes": 2, "gpus_per_node": 2},
        post_training={"recipe": ["sft"], "sft": {"batch_size": 6}},
    )
    reason = multinode.refusal(work(2, 0, plan=HSDP_2X2), m, curriculum_of(m))
    assert reason is not None and "6 does not split evenly over 4 data-parallel ranks" in reason, reason


def test_the_ladder_with_custom_data_on_several_nodes_is_not_refused(tmp_path):
    custom = tmp_path / "custom.txt"
    custom.write_text("12+30=42\n" * 200)
    data = json.loads((REPO / "examples" / "manifests" / "tiny.json").read_text())["data"]
    data.append({"name": "mine", "source": f"file:{custom}", "role": "train"})
    m = _manifest(
        tmp_path,
        data=data,
        stages={"ladder": {"proxy_steps": 4, "max_budget_fraction": 0.5}},
        resources={"nodes": 2, "gpus_per_node": 1},
    )
    ladder = curriculum_of(m).ladder
    assert ladder is not None and ladder.custom == ("mine",)
    assert multinode.refusal(work(2, 1), m, curriculum_of(m)) is None


def test_node_0_keeps_the_run_directory_and_the_others_their_own():
    root = pathlib.Path("/ckpt/acme/run_1")
    assert multinode.node_checkpoint_dir(root, 0) == root
    assert multinode.node_checkpoint_dir(root, 1) == root / "node-1"


def test_node_0_decides_the_ladder_and_the_other_nodes_take_its_decision(tmp_path, monkeypatch):
    """Node 0 runs the proxies (here a stand-in) and publishes the decision in the rendezvous store;
    node 1 runs none, waits for it, records it as its own, and a replaced node 1 reads its record."""
    decided = LadderDecision(use=False, reference_loss=2.0, custom_loss=2.5, threshold=2.1, steps=4)
    calls: list[int] = []

    def proxies(plan, *, directory, should_stop, **kwargs) -> LadderDecision:
        calls.append(0)
        return decided

    monkeypatch.setattr(multinode, "run_ladder", proxies)
    endpoint = f"127.0.0.1:{free_port()}"
    leader, follower = (multinode.NodeShare(work(2, r, rendezvous=endpoint)) for r in (0, 1))
    taken: list[LadderDecision | None] = []
    thread = threading.Thread(
        target=lambda: taken.append(
            follower.ladder(None, directory=tmp_path / "n1", should_stop=lambda: False)
        )
    )
    try:
        assert leader.ladder(None, directory=tmp_path / "n0", should_stop=lambda: False) == decided
        thread.start()
        thread.join(30)
        assert taken == [decided] and calls == [0]  # node 1 ran no proxies of its own
        assert json.loads((tmp_path / "n1" / "decision.json").read_text())["use"] is False
        again = multinode.NodeShare(work(2, 1, rendezvous=endpoint))
        assert again.ladder(None, directory=tmp_path / "n1", should_stop=lambda: False) == decided
        again.close()
    finally:
        follower.close()
        leader.close()


def test_the_scheduler_mints_a_fresh_rendezvous_key_per_multi_node_run():
    from services.scheduler.handoff import Handoff

    keys = {Handoff.rendezvous_key(2) for _ in range(50)}
    assert len(keys) == 50 and all(len(k) >= 43 for k in keys)  # 32 random bytes, base64url
    assert Handoff.rendezvous_key(1) == ""  # one node: no store, no key
