"""Loss-spike detection and the restart proposal, on hand-made loss curves and checkpoint tables.

Checkpoint tables map a committed step to the data position its sidecar recorded; after an approved
skip the two differ, which is what the proposal's window (in data positions) has to follow.
"""

import math
from datetime import UTC, datetime

import pytest

from contracts.runs import LogLine, Metrics, RunEvent, StopReason
from services.trainer.endings import SpikeWatch, Stop
from training.engine.loss_spikes import SpikeDetector, position_after, propose, restart_point


def feed(losses, norms=None):
    d = SpikeDetector()
    for step, loss in enumerate(losses, start=1):
        if d.observe(step, loss, (norms or [1.0] * len(losses))[step - 1]):
            return step, d.first_spike_step
    return None


def noisy(n, level=2.0):
    return [level + 0.01 * math.sin(i) for i in range(n)]


def test_a_smooth_falling_curve_never_spikes():
    assert feed([5.0 * 0.99**i + 0.01 * math.sin(i) for i in range(300)]) is None


def test_one_noisy_step_is_not_a_spike():
    assert feed([*noisy(40), 9.0, *noisy(40)]) is None


def test_three_spiking_steps_in_a_row_are():
    assert feed([*noisy(40), 9.0, 9.5, 9.2, *noisy(5)]) == (43, 41)


def test_a_grad_norm_spike_counts_too():
    assert feed(noisy(40) + noisy(3), norms=[1.0] * 40 + [50.0] * 3) == (43, 41)


def test_nan_loss_is_a_spike():
    assert feed(noisy(30) + [float("nan")] * 3) == (33, 31)


def test_no_verdict_before_enough_history():
    assert feed([1.0] * 5 + [100.0] * 3) is None


@pytest.mark.parametrize(
    ("spike_step", "total_steps", "committed", "expected"),
    [
        (400, 1000, [100, 200, 300, 350, 390], 350),  # at least 5 % (50 steps) before the spike
        (60, 1000, [50], 50),  # none far enough back: the newest before the spike
        (
            60,
            200,
            [20, 40, 60, 62],
            40,
        ),  # the e2e run: the checkpoint at the spike and the stop's are after it
        (10, 100, [20], None),  # none before the spike
        (10, 100, [], None),
    ],
)
def test_restart_point(spike_step, total_steps, committed, expected):
    assert restart_point(spike_step, total_steps, committed) == expected


# One run of 80 steps (back 4 steps, skip 8 batches), restarted three times: from step 5 skipping
# [5, 20), from step 10 (which, 5 steps past that skip, recorded position 25) skipping [25, 39), and
# from step 15 (position 44) skipping [44, 59). Positions are the batches served once a step ran.
FIRST = {5: 5, 10: 10, 14: 14}  # no skip yet: position == step; 14 is the save on stop
SECOND = {5: 5, 10: 25, 15: 30, 18: 33}  # resumed at 5, continued from 20
THIRD = {5: 5, 10: 25, 15: 44, 20: 49, 24: 53}  # resumed at 10, continued from 39


@pytest.mark.parametrize(
    ("step", "positions", "skip", "expected"),
    [
        (12, FIRST, None, 12),
        (16, SECOND, (5, 20), 31),  # counted back from the stop's checkpoint at 18
        (13, SECOND, (5, 20), 28),  # ... or from the one at 15
        (8, {5: 5}, (5, 20), 23),  # only the resume point before it: the data went on at the skip's end
        (13, {5: 5, 10: 25}, (5, 20), 28),  # the newest before it, after the skip: no jump
        (22, THIRD, (25, 39), 51),
        (22, {5: 5, 10: 25}, (25, 39), 51),  # no checkpoint after the spike (the stop's save failed)
        (7, {}, None, 7),  # nothing committed: the stage ran from position 0
    ],
)
def test_position_after(step, positions, skip, expected):
    assert position_after(step, positions, skip) == expected


@pytest.mark.parametrize(
    ("spike_step", "total", "positions", "skip", "checkpoint", "window"),
    [
        (400, 1000, {100: 100, 200: 200, 300: 300, 350: 350, 390: 390, 402: 402}, None, 350, (350, 500)),
        (60, 200, {40: 40, 60: 60, 62: 62}, None, 40, (40, 80)),  # the e2e run's proposal
        (12, 80, FIRST, None, 5, (5, 20)),
        # the 2nd restart: from step 10, whose recorded position (25) is where its resume lands, not 10
        (16, 80, SECOND, (5, 20), 10, (25, 39)),
        (22, 80, THIRD, (25, 39), 15, (44, 59)),  # the 3rd
        # back to the last restart's own checkpoint: one window from its position, over the old one too
        (8, 80, {5: 5, 10: 25}, (5, 20), 5, (5, 31)),
        (10, 80, {20: 20}, None, 0, (0, 18)),  # nothing before the spike: from the start
    ],
)
def test_proposal_window_is_in_data_positions(spike_step, total, positions, skip, checkpoint, window):
    p = propose(
        "pretrain", spike_step=spike_step, total_steps=total, positions=positions, reason="r", skip=skip
    )
    assert (p.checkpoint_step, (p.skip_from, p.skip_to), p.spike_step) == (checkpoint, window, spike_step)


def test_a_restart_from_the_start_says_so():
    p = propose("pretrain", spike_step=10, total_steps=100, positions={20: 20}, reason="r")
    assert (p.checkpoint_step, p.skip_from, p.skip_to) == (0, 0, 20) and p.reason.endswith(
        "no checkpoint before it"
    )


def metrics(step: int, loss: float, stage: str = "pretrain") -> Metrics:
    return Metrics(
        run_id="r",
        seq=0,
        at=datetime.now(UTC),
        stage=stage,
        step=step,
        total_steps=100,
        loss=loss,
        learning_rate=1e-3,
        tokens_per_s=1.0,
        grad_norm=1.0,
    )


def watched(
    losses, stage: str = "pretrain", planted_from: int | None = None
) -> tuple[Stop, SpikeWatch, list[RunEvent]]:
    """Typed metrics through a SpikeWatch, as the training thread sends them; what it passes on."""
    passed: list[RunEvent] = []
    stop = Stop()
    watch = SpikeWatch(passed.append, stop, planted_from)
    for step, loss in enumerate(losses, start=1):
        watch.send(metrics(step, loss, stage))
    return stop, watch, passed


def test_the_spike_watch_reads_typed_metrics_and_stops_on_a_spike():
    stop, watch, passed = watched([*noisy(40), 9.0, 9.5, 9.2])
    assert stop.reason is StopReason.loss_spike
    assert (watch.stage, watch.spike_step, watch.total_steps) == ("pretrain", 41, 100)
    assert all(type(e) is Metrics for e in passed) and [e.step for e in passed] == list(range(1, 44))


@pytest.mark.parametrize("stage", ["sft", "dpo", "rlvr", "ladder"])
def test_post_training_and_ladder_losses_are_not_watched(stage):
    stop, _, _ = watched([*noisy(40), 9.0, 9.5, 9.2], stage=stage)
    assert not stop.is_set() and stop.reason is None


def test_the_spike_watch_refuses_an_untyped_payload():
    watch = SpikeWatch(lambda event: None, Stop())
    with pytest.raises(TypeError):
        watch.send({"kind": "metrics", "stage": "pretrain", "step": 1, "loss": 2.0, "grad_norm": 1.0})


def test_other_events_pass_the_watch_unchanged():
    passed: list[RunEvent] = []
    line = LogLine(run_id="r", seq=0, at=datetime.now(UTC), message="hello")
    SpikeWatch(passed.append, Stop()).send(line)
    assert passed == [line]


def test_a_planted_spike_multiplies_the_loss_passed_on():
    _, _, passed = watched([2.0] * 4, planted_from=3)  # ITO_FAULT_SPIKE_STEP=3 (trainer_settings.load)
    assert [e.loss for e in passed if isinstance(e, Metrics)] == [2.0, 2.0, 20.0, 20.0]
