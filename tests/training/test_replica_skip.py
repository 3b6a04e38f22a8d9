"""An approved loss-spike restart as a torchft replica group trains it (a multi-node run's node):
resumed at the restart's checkpoint, the group skips the approved window of batches, and its
checkpoints record the data positions past it, as a one-process run's do. One group, an
in-process Lighthouse."""

import pytest

pytest.importorskip("torchft", reason="torchft is not installed: `pip install torchft==0.2.0`")

from contracts.models import MODEL_SHAPES
from contracts.runs import LogLine, Metrics
from tests.support import replica_seal
from training.engine.checkpoint_dir import committed_positions, rewind
from training.engine.fault_tolerance import ReplicaGroup, start_lighthouse
from training.engine.reporting import Recorder
from training.recipes.pretrain import StageConfig, train_stage
from training.recipes.stage_run import Replicas

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def test_a_replica_group_resumed_at_an_approved_restart_skips_its_window(tmp_path):
    lighthouse = start_lighthouse()
    stage_dir = tmp_path / "pretrain"
    cfg = StageConfig(
        stage="pretrain",
        shape=MODEL_SHAPES["tiny"],
        train_sources=["generated:small_arithmetic"],
        seq_len=32,
        batch_size=8,
        learning_rate=3e-3,
        steps=20,
        checkpoint_dir=str(stage_dir),
        checkpoint_interval=5,
        keep_last=10,
        eval_max_batches=1,
    )

    def replicas() -> Replicas:
        return Replicas(
            replica_id=0,
            groups=1,
            join=lambda model, optimizer, scheduler: ReplicaGroup(
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                replica_id=0,
                lighthouse=lighthouse.address(),
                seal=replica_seal(0),
            ),
        )

    try:
        first = Recorder()
        train_stage(cfg, first, lambda: False, replicas())
        assert committed_positions(stage_dir) == {5: 5, 10: 10, 15: 15, 20: 20}  # one batch a step

        assert rewind(stage_dir, 10, 10, 16) == [15, 20]  # approved: from step 10, skip [10, 16)
        again = Recorder()
        result = train_stage(cfg, again, lambda: False, replicas())
    finally:
        lighthouse.shutdown()
    assert result.final_step == 20
    assert "Skipping batches [10, 16) of pretrain." in [e.message for e in again.of(LogLine)]
    assert next(m.step for m in again.of(Metrics)) == 11  # resumed at the restart's checkpoint
    assert committed_positions(stage_dir) == {5: 5, 10: 10, 15: 21, 20: 26}  # past the skipped window
