"""Loss-spike restarts end to end in one process: the pin that keeps the proposal's checkpoint
through the save on stop, and approved restarts, one after another, each skipping exactly the data
positions its proposal names.

The checkpoint tests use a two-weight model. The restart test drives the real pretraining loop of
the tiny model (a few dozen steps in all) through `SpikeWatch`, as the worker does; only the curve
the detector judges is synthetic (steady, then x10 from a chosen step), so where a spike starts is
the test's choice and not the tiny model's.
"""

import functools
import json
import math

import msgspec
import pytest
import torch

from contracts.manifest import Manifest
from contracts.runs import LogLine, Metrics, RunEvent, StopReason
from services.trainer.endings import SpikeWatch, Stop
from training.data.corpora import BatchIterator
from training.engine import loss_spikes
from training.engine.checkpoint import Checkpointer
from training.engine.checkpoint_dir import (
    PIN,
    SKIP_FILE,
    batches_to_skip,
    committed_positions,
    list_checkpoints,
    pin,
    pinned_steps,
    rewind,
    step_dir,
    unpin,
)
from training.engine.reporting import Reporter
from training.recipes import pretrain
from training.recipes.pretrain import stage_config_from_manifest, train_stage

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def tiny_state():
    model = torch.nn.Linear(2, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def save_all(directory, steps_positions, *, keep_last=2, pin_at=None):
    """Commit one checkpoint per (step, data position), pinning `pin_at` once it is committed."""
    model, optimizer = tiny_state()
    checkpointer = Checkpointer(directory, keep_last=keep_last)
    for step, position in steps_positions:
        checkpointer.save(step, model, optimizer, data_position=position)
        checkpointer.wait()
        if step == pin_at:
            assert pin(directory, step)
    return checkpointer


def steps(directory):
    return [c.step for c in list_checkpoints(directory)]


# -- pinning -----------------------------------------------------------------------------------------


def test_pruning_keeps_the_pinned_checkpoint_beyond_keep_last(tmp_path):
    save_all(tmp_path, [(5, 5), (10, 10), (15, 15), (20, 20)], keep_last=2, pin_at=5)
    assert steps(tmp_path) == [5, 15, 20] and pinned_steps(tmp_path) == [5]


def test_once_unpinned_it_is_pruned_like_any_other(tmp_path):
    checkpointer = save_all(tmp_path, [(5, 5), (10, 10), (15, 15)], keep_last=2, pin_at=5)
    unpin(tmp_path)
    model, optimizer = tiny_state()
    checkpointer.save(20, model, optimizer, data_position=20)
    checkpointer.wait()
    assert steps(tmp_path) == [15, 20]


def test_one_pin_per_directory_and_only_on_a_committed_checkpoint(tmp_path):
    save_all(tmp_path, [(5, 5), (10, 10)], keep_last=2)
    assert pin(tmp_path, 5) and pin(tmp_path, 10)
    assert pinned_steps(tmp_path) == [10]  # moved: one proposal is pending at a time
    assert not pin(tmp_path, 7) and pinned_steps(tmp_path) == []  # no such checkpoint: nothing pinned
    step_dir(tmp_path, 12).mkdir()
    assert not pin(tmp_path, 12)  # a save that never committed is not a restart point


def test_a_new_checkpointer_drops_a_pin_nobody_carried_out(tmp_path):
    save_all(tmp_path, [(5, 5), (10, 10)], keep_last=2, pin_at=5)
    Checkpointer(tmp_path, keep_last=2)  # training goes on here without the restart
    assert pinned_steps(tmp_path) == []


# -- the skip window, in data positions ---------------------------------------------------------------


def test_rewind_sets_later_checkpoints_aside_unpins_and_marks_the_positions_to_skip(tmp_path):
    save_all(tmp_path, [(5, 5), (10, 25), (15, 30)], keep_last=3, pin_at=10)
    assert committed_positions(tmp_path) == {5: 5, 10: 25, 15: 30}
    assert rewind(tmp_path, 10, 25, 39) == [15]
    assert steps(tmp_path) == [5, 10] and (tmp_path / "discarded" / "step-00000015").is_dir()
    assert pinned_steps(tmp_path) == [] and json.loads((tmp_path / SKIP_FILE).read_text()) == {
        "from": 25,
        "to": 39,
    }


@pytest.mark.parametrize(
    ("position", "expected"),
    [
        (25, 39),  # the restart's checkpoint recorded position 25: the data continues at 39
        (10, None),  # its step number is not its position
        (5, None),
        (39, None),
    ],
)
def test_batches_to_skip_compares_positions_with_positions(tmp_path, position, expected):
    save_all(tmp_path, [(5, 5), (10, 25)], keep_last=2)
    rewind(tmp_path, 10, 25, 39)
    assert batches_to_skip(tmp_path, position) == expected


@pytest.mark.parametrize(
    ("step", "skip_from", "skip_to"),
    [
        (10, 10, 39),  # the window in steps: the resume lands at position 25 and would skip nothing
        (10, 25, 25),  # an empty window
        (7, 7, 20),  # no committed checkpoint at step 7
        (0, 3, 20),  # a restart from the start begins at position 0
    ],
)
def test_rewind_refuses_a_restart_that_would_skip_nothing(tmp_path, step, skip_from, skip_to):
    save_all(tmp_path, [(5, 5), (10, 25)], keep_last=2)
    with pytest.raises(ValueError):
        rewind(tmp_path, step, skip_from, skip_to)
    assert steps(tmp_path) == [5, 10] and not (tmp_path / SKIP_FILE).exists()  # nothing touched


# -- repeated approved restarts on the real loop ------------------------------------------------------

STEPS, INTERVAL, KEEP_LAST = 80, 5, 2  # 80 steps: a restart goes back >= 4 steps and skips 8 batches past


def manifest() -> Manifest:
    return msgspec.convert(
        {
            "name": "spikes",
            "model": {"size": "tiny", "revision": "test"},
            "data": [{"name": "docs", "source": "builtin:pydoc_topics"}],
            "target": {"tokens": STEPS * 32 * 8, "seq_len": 32, "batch_size": 8},
            "checkpoint": {"interval_steps": INTERVAL, "keep_last": KEEP_LAST},
            "budget_cap_usd": 1.0,
            "seed": 0,
        },
        Manifest,
    )


class Attempt:
    """One work item's worth of training, as `Worker._train` runs it: an approved restart is
    rewound first, then the stage trains under a fresh `SpikeWatch` until a spike (or `max_steps`)."""

    def __init__(self, run_dir, monkeypatch, *, spike_from=None, max_steps=None, restart=None):
        self.run_dir, self.stage_dir = run_dir, run_dir / "pretrain"
        self.consumed: list[int] = []  # data positions the stage's batch iterator served
        self.logs: list[str] = []
        consumed = self.consumed

        class Recording(BatchIterator):
            def __next__(self):
                consumed.append(self.position)
                return super().__next__()

        monkeypatch.setattr(pretrain, "BatchIterator", Recording)
        if restart is not None:
            rewind(self.stage_dir, restart.checkpoint_step, restart.skip_from, restart.skip_to)
        self.stop = Stop()
        self.watch = SpikeWatch(self._record, self.stop, checkpoint_dir=run_dir)

        def curve(event: RunEvent) -> None:
            if isinstance(event, Metrics):  # steady, with a little noise; x10 from `spike_from` on
                loss = 2.0 + 0.01 * math.sin(event.step)
                if spike_from is not None and event.step >= spike_from:
                    loss *= 10.0
                event = msgspec.structs.replace(event, loss=loss, grad_norm=1.0)
            self.watch.send(event)

        def should_stop():
            return self.stop.is_set() or (max_steps is not None and len(consumed) >= max_steps)

        cfg = stage_config_from_manifest(manifest(), self.stage_dir)
        self.result = train_stage(cfg, Reporter(curve), should_stop)

    def _record(self, event: RunEvent) -> None:
        if isinstance(event, LogLine):
            self.logs.append(event.message)

    def skipping(self) -> list[str]:
        return [line for line in self.logs if line.startswith("Skipping")]


@pytest.fixture
def quick_detector(monkeypatch):
    # A verdict after 5 steps of history instead of 20, so each attempt needs only a dozen steps.
    monkeypatch.setattr(
        loss_spikes, "SpikeDetector", functools.partial(loss_spikes.SpikeDetector, min_history=5)
    )


def test_the_save_on_stop_keeps_the_checkpoint_the_proposal_goes_back_to(
    tmp_path, monkeypatch, quick_detector
):
    first = Attempt(tmp_path, monkeypatch, spike_from=12)
    assert first.stop.reason is StopReason.loss_spike and first.result.final_step == 14  # 12, 13, 14 spiked
    # keep_last=2 kept 10 and the stop's 14; 5 is 4+ steps before the spike, so it stays, pinned.
    assert steps(first.stage_dir) == [5, 10, 14] and pinned_steps(first.stage_dir) == [5]
    proposal = first.watch.proposal(tmp_path)
    assert (proposal.checkpoint_step, proposal.skip_from, proposal.skip_to) == (5, 5, 20)
    assert (step_dir(first.stage_dir, 5) / PIN).exists()  # pinned until the restart is carried out
    Attempt(tmp_path, monkeypatch, max_steps=1, restart=proposal)
    assert pinned_steps(first.stage_dir) == []


def test_each_of_three_approved_restarts_skips_exactly_what_it_says(tmp_path, monkeypatch, quick_detector):
    first = Attempt(tmp_path, monkeypatch, spike_from=12)
    assert first.consumed == list(range(0, 14))
    p1 = first.watch.proposal(tmp_path)

    # Resumed at step 5 (position 5), continued from 20: after step s the position is s + 15.
    second = Attempt(tmp_path, monkeypatch, spike_from=16, restart=p1)
    assert second.skipping() == ["Skipping batches [5, 20) of pretrain."]
    assert second.consumed == list(range(20, 33))  # steps 6..18
    p2 = second.watch.proposal(tmp_path)
    # From step 10, whose recorded position is 25 (not 10), to 8 batches past the spike's position 31.
    assert (p2.checkpoint_step, p2.skip_from, p2.skip_to, p2.spike_step) == (10, 25, 39, 16)

    third = Attempt(tmp_path, monkeypatch, spike_from=22, restart=p2)
    assert third.skipping() == ["Skipping batches [25, 39) of pretrain."]
    assert third.consumed == list(range(39, 53))  # steps 11..24
    p3 = third.watch.proposal(tmp_path)
    assert (p3.checkpoint_step, p3.skip_from, p3.skip_to, p3.spike_step) == (15, 44, 59, 22)

    fourth = Attempt(tmp_path, monkeypatch, max_steps=5, restart=p3)
    assert fourth.skipping() == ["Skipping batches [44, 59) of pretrain."]
    assert fourth.consumed == list(range(59, 64))  # steps 16..20

    # Across the attempts, no approved window was ever read after its approval.
    for later, proposal in [(second, p1), (third, p2), (fourth, p3)]:
        assert later.consumed[0] == proposal.skip_to
        assert not set(later.consumed) & set(range(proposal.skip_from, proposal.skip_to))
