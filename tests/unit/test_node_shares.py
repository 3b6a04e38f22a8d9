"""A multi-node run's hand-off and node shares, as tables: one work item per node with distinct
message ids (node 0's is the run's own item and id, as for any run), the node rank in the signed
item; what a node refuses to train, in a sentence; where each node keeps its checkpoints."""

import pathlib

import msgspec
import pytest

from contracts.api import CostEstimate, Plan
from contracts.manifest import Manifest
from contracts.runs import TrainWork
from services.domain.curriculum import plan_run
from services.scheduler.handoff import node_shares
from services.trainer import nodes
from tests.conftest import write_manifest

COST = {name: 0 for name in CostEstimate.__struct_fields__}
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


def work(n: int, node_rank: int = 0, rendezvous: str = "127.0.0.1:29400") -> TrainWork:
    return TrainWork(
        run_id="run_1",
        account="acme",
        booking_id="b",
        manifest_text="{}",
        manifest_digest="d",
        plan=PLAN,
        checkpoint_dir="/x",
        nodes=n,
        node_rank=node_rank,
        rendezvous=rendezvous,
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


def _manifest(tmp_path: pathlib.Path, **overrides) -> Manifest:
    return msgspec.json.decode(write_manifest(tmp_path, **overrides).read_bytes(), type=Manifest)


def test_a_share_of_one_gpu_per_node_trains(tmp_path):
    m = _manifest(tmp_path, resources={"nodes": 2, "gpus_per_node": 1})
    assert nodes.refusal(work(2, 1), m, plan_run(m)) is None


@pytest.mark.parametrize(
    ("resources", "share", "why"),
    [
        ({"nodes": 2, "gpus_per_node": 2}, work(2, 1), "book gpus_per_node 1"),
        ({"nodes": 2, "gpus_per_node": 1}, work(3, 1), "does not match the manifest's 2 nodes"),
        ({"nodes": 2, "gpus_per_node": 1}, work(2, 2), "node 2 of 2 does not match"),
        ({"nodes": 2, "gpus_per_node": 1}, work(2, 1, rendezvous=""), "names no rendezvous endpoint"),
    ],
)
def test_a_share_this_trainer_cannot_train_is_refused_in_a_sentence(tmp_path, resources, share, why):
    m = _manifest(tmp_path, resources=resources)
    reason = nodes.refusal(share, m, plan_run(m))
    assert reason is not None and why in reason, reason


def test_post_training_on_several_nodes_is_refused_naming_the_stage(tmp_path):
    m = _manifest(tmp_path, resources={"nodes": 2, "gpus_per_node": 1}, post_training={"recipe": ["sft"]})
    reason = nodes.refusal(work(2, 0), m, plan_run(m))
    assert reason is not None and "cannot run sft yet" in reason, reason


def test_node_0_keeps_the_run_directory_and_the_others_their_own():
    root = pathlib.Path("/ckpt/acme/run_1")
    assert nodes.node_checkpoint_dir(root, 0) == root
    assert nodes.node_checkpoint_dir(root, 1) == root / "node-1"
