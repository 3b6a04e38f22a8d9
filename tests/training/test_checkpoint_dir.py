"""The checkpoint directory's own module (training/engine/checkpoint_dir.py): the layout and commit
protocol, readable without torch (issue 44 split it from the saves and the loads)."""

import json
import os
import subprocess
import sys

from tests.conftest import REPO
from training.engine.checkpoint_dir import (
    MARKER,
    CheckpointInfo,
    commit,
    list_checkpoints,
    pin,
    prune,
    step_dir,
)


def test_the_directory_is_read_without_importing_torch():
    # What the worker and the follower read (steps, data positions, pins) needs no torch; an import
    # of the saves or the loads from here would pull it in.
    probe = "import sys, training.engine.checkpoint_dir; print('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _committed(directory, step: int) -> CheckpointInfo:
    path = step_dir(directory, step)
    path.mkdir(parents=True)
    info = CheckpointInfo(step=step, path=str(path), bytes=7, stall_s=0.5, save_s=1.25)
    commit(info)
    return info


def test_a_commit_writes_the_marker_that_lists_the_checkpoint(tmp_path):
    info = _committed(tmp_path, 3)
    step_dir(tmp_path, 4).mkdir()  # a save that died before its marker
    assert json.loads((step_dir(tmp_path, 3) / MARKER).read_text()) == {
        "step": 3,
        "bytes": 7,
        "stall_s": 0.5,
        "save_s": 1.25,
    }
    assert list_checkpoints(tmp_path) == [info]


def test_pruning_keeps_the_newest_and_the_pinned_and_drops_dead_saves_below(tmp_path):
    for step in (1, 2, 3, 4):
        _committed(tmp_path, step)
    step_dir(tmp_path, 5).mkdir()  # dead: below the step being committed
    assert pin(tmp_path, 1)
    _committed(tmp_path, 6)
    prune(tmp_path, keep_last=2, committed_step=6)
    assert [info.step for info in list_checkpoints(tmp_path)] == [1, 4, 6]
    assert not step_dir(tmp_path, 5).exists()
