"""Stop requests under several ranks: the flag is all-reduced every STOP_CHECK_EVERY steps, not
before every step, and a request between checks stops the run at the next check (the same step on
every rank); one process reads its own flag every step with no collective."""

import pytest
import torch

from contracts.models import MODEL_SHAPES
from training.data.corpora import BatchIterator, load_tokens
from training.engine import loop as loop_module
from training.engine.loop import STOP_CHECK_EVERY, LoopSettings, StepOutput, run_loop, stop_check_due
from training.engine.reporting import Recorder
from training.model import Transformer


@pytest.mark.parametrize(
    ("iteration", "world", "due"),
    [
        (0, 1, True),
        (1, 1, True),
        (7, 1, True),
        (0, 2, True),
        (1, 2, False),
        (STOP_CHECK_EVERY - 1, 8, False),
        (STOP_CHECK_EVERY, 2, True),
        (2 * STOP_CHECK_EVERY, 64, True),
    ],
)
def test_stop_checks_are_due_every_step_alone_and_every_n_steps_in_a_gang(iteration, world, due):
    assert stop_check_due(iteration, world) is due


def train(tmp_path, monkeypatch, *, world: int, stop_from: int | None, steps: int = 20):
    """`steps` steps of a tiny model in a faked world of `world` ranks (every rank alike); the stop
    flag turns true before step `stop_from`. Returns (all-reduces of the flag, the steps taken)."""
    reduced: list[bool] = []

    def any_true(flag: bool) -> bool:
        reduced.append(flag)
        return flag

    monkeypatch.setattr(loop_module, "world_size", lambda: world)
    monkeypatch.setattr(loop_module, "any_true", any_true)
    monkeypatch.setattr(loop_module.dist, "all_reduce", lambda *a, **k: None)  # the logged loss's mean
    torch.manual_seed(0)
    model = Transformer(MODEL_SHAPES["tiny"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    data = BatchIterator(load_tokens(["generated:arithmetic"], seed=0), seq_len=8, batch_size=2, seed=0)
    taken: list[int] = []

    def step_fn(step: int) -> StepOutput:
        taken.append(step)
        x, y = data.batch_at(step)
        return StepOutput(loss=model(x, y)[1], tokens=x.numel())

    settings = LoopSettings(
        stage="stop", steps=steps, checkpoint_dir=str(tmp_path), checkpoint_interval=1000, save_on_stop=False
    )
    result = run_loop(
        settings,
        model,
        optimizer,
        scheduler,
        step_fn,
        Recorder(),
        lambda: stop_from is not None and len(taken) >= stop_from,
    )
    assert result.stopped is (stop_from is not None)
    return reduced, taken


def test_a_two_rank_world_all_reduces_the_stop_flag_every_n_steps(tmp_path, monkeypatch):
    reduced, taken = train(tmp_path, monkeypatch, world=2, stop_from=None)
    assert len(taken) == 20
    assert len(reduced) == -(-20 // STOP_CHECK_EVERY)  # steps 0, 8, 16: 3 collectives, not 20


@pytest.mark.parametrize("stop_from", [1, 3, STOP_CHECK_EVERY, STOP_CHECK_EVERY + 1])
def test_a_stop_requested_between_checks_stops_at_the_next_check(tmp_path, monkeypatch, stop_from):
    reduced, taken = train(tmp_path, monkeypatch, world=2, stop_from=stop_from)
    next_check = -(-stop_from // STOP_CHECK_EVERY) * STOP_CHECK_EVERY
    assert len(taken) == next_check
    assert reduced[-1] is True and reduced.count(True) == 1


def test_one_process_stops_at_the_next_step_without_a_collective(tmp_path, monkeypatch):
    reduced, taken = train(tmp_path, monkeypatch, world=1, stop_from=3)
    assert len(taken) == 3 and reduced == []
