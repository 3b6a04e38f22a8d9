"""Where a stage's loop starts (training/recipes/stage_run.py): alone from its own checkpoint or the
previous stage's weights, or as a torchft replica group whose group is closed if joining fails (a
group left open holds its quorum and heal threads after the stage has failed)."""

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from training.engine.loop import LoopSettings, TrainingError
from training.engine.reporting import Recorder
from training.recipes.stage_run import Replicas, StageRun


class FakeGroup:
    """A replica group that resumed (or not) at `step`; counts its closes."""

    def __init__(self, step: int, resumed: bool) -> None:
        self.step = step
        self.resumed = resumed
        self.closed = 0

    def resume(self, directory: str) -> object:
        return object() if self.resumed else None

    def close(self) -> None:
        self.closed += 1


def stage_run(directory) -> StageRun:
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    settings = LoopSettings(stage="sft", steps=3, checkpoint_dir=str(directory))
    return StageRun(model, optimizer, LambdaLR(optimizer, lambda _: 1.0), settings, torch.device("cpu"))


def replicas_of(group: FakeGroup) -> Replicas:
    return Replicas(replica_id=1, groups=2, join=lambda *_: group)


def test_a_group_that_resumed_starts_the_loop_at_its_step_and_is_closed_once(tmp_path):
    run, group = stage_run(tmp_path / "sft"), FakeGroup(step=7, resumed=True)
    assert run.join(replicas_of(group), Recorder(), init_from=None)
    assert (run.start, run.group) == (7, group)
    run.close()
    assert group.closed == 1


def test_a_group_that_cannot_start_from_the_previous_stage_is_closed(tmp_path):
    (tmp_path / "pretrain").mkdir()  # the previous stage committed nothing
    run, group = stage_run(tmp_path / "sft"), FakeGroup(step=0, resumed=False)
    with pytest.raises(TrainingError, match="holds no committed checkpoint"):
        run.join(replicas_of(group), Recorder(), init_from=str(tmp_path / "pretrain"))
    assert group.closed == 1 and run.group is None


def test_alone_without_a_checkpoint_the_loop_starts_at_zero(tmp_path):
    run = stage_run(tmp_path / "sft")
    run.start = 5
    assert run.resume(Recorder(), init_from=None) is None
    assert run.start == 0
