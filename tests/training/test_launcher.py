"""One way to run a stage: the launcher decides, from the signed plan, how many processes train a
run's stages on this node (in the agent's process, a gang of the node's ranks, or the node's replica
group of a multi-node run), and the pipeline takes the same `Trainers` port from each."""

import pathlib

import msgspec
import pytest

from contracts.manifest import Manifest
from domain.curriculum import curriculum_of
from tests.conftest import write_manifest
from tests.training.test_node_shares import HSDP_2X2, PLAN, work
from training.engine.distributed import ParallelismError
from training.launch import elastic, launcher, multinode
from training.launch.launcher import Mode
from training.recipes.pipeline import IN_PROCESS

SINGLE = msgspec.structs.replace(PLAN, strategy="single", degrees={"dp_replicate": 1})
FSDP_4 = msgspec.structs.replace(PLAN, strategy="fsdp2", degrees={"dp_shard": 4})


def _manifest(tmp_path: pathlib.Path, nodes: int, gpus: int) -> Manifest:
    path = write_manifest(tmp_path, resources={"nodes": nodes, "gpus_per_node": gpus})
    return msgspec.json.decode(path.read_bytes(), type=Manifest)


@pytest.mark.parametrize(
    ("nodes", "gpus", "item", "mode", "processes"),
    [
        (1, 1, work(1, plan=SINGLE, rendezvous=""), Mode.in_process, 1),
        (1, 2, work(1, rendezvous=""), Mode.gang, 2),  # DDP over 2 ranks
        (1, 4, work(1, plan=FSDP_4, rendezvous=""), Mode.gang, 4),
        (2, 1, work(2, 1), Mode.node_share, 1),  # one rank per node: the agent's process is the group
        (2, 2, work(2, 1, plan=HSDP_2X2), Mode.node_share, 2),  # the node's group is a gang of 2
    ],
)
def test_the_launcher_decides_how_many_processes_train(tmp_path, nodes, gpus, item, mode, processes):
    manifest = _manifest(tmp_path, nodes, gpus)
    assert launcher.mode_for(item, manifest) is mode
    how = launcher.launch(item, manifest, curriculum_of(manifest), tmp_path / "run", threads=1)
    try:
        assert (how.mode, how.processes) == (mode, processes)
        match mode:
            case Mode.in_process:
                assert how.trainers is IN_PROCESS
            case Mode.gang:
                assert isinstance(how.trainers.lm.__self__, elastic.Gang)
                assert isinstance(how.trainers.post.__self__, elastic.Gang)
                assert how.trainers.ladder is IN_PROCESS.ladder  # the proxies stay in the agent
            case Mode.node_share:
                share = how.trainers.lm.__self__
                assert isinstance(share, multinode.NodeShare)
                assert how.trainers.ladder == share.ladder and how.close == share.close
    finally:
        how.close()


def test_a_plan_this_node_cannot_realise_is_refused_before_anything_trains(tmp_path):
    manifest = _manifest(tmp_path, 2, 2)
    with pytest.raises(ParallelismError, match="does not lay 2 nodes of 2 GPUs out"):
        launcher.launch(work(2, 1), manifest, curriculum_of(manifest), tmp_path / "run", threads=1)
