"""Loss-spike detection and the restart proposal, on hand-made loss curves."""

import math

from services.trainer.spikes import SpikeDetector, propose


def feed(losses, norms=None):
    d = SpikeDetector()
    for step, loss in enumerate(losses, start=1):
        if d.observe(step, loss, (norms or [1.0] * len(losses))[step - 1]):
            return step, d.first_spike_step
    return None


def noisy(n, level=2.0):
    return [level + 0.01 * math.sin(i) for i in range(n)]


def test_a_smooth_falling_curve_never_spikes():
    assert feed([5.0 * 0.99 ** i + 0.01 * math.sin(i) for i in range(300)]) is None


def test_one_noisy_step_is_not_a_spike():
    assert feed(noisy(40) + [9.0] + noisy(40)) is None


def test_three_spiking_steps_in_a_row_are():
    assert feed(noisy(40) + [9.0, 9.5, 9.2] + noisy(5)) == (43, 41)


def test_a_grad_norm_spike_counts_too():
    assert feed(noisy(40) + noisy(3), norms=[1.0] * 40 + [50.0] * 3) == (43, 41)


def test_nan_loss_is_a_spike():
    assert feed(noisy(30) + [float("nan")] * 3) == (33, 31)


def test_no_verdict_before_enough_history():
    assert feed([1.0] * 5 + [100.0] * 3) is None


def test_proposal_goes_back_and_skips_past_the_spike():
    p = propose("pretrain", spike_step=400, total_steps=1000, committed_steps=[100, 200, 300, 350, 390],
                reason="loss 4σ above its window for 3 steps")
    assert p.checkpoint_step == 350  # at least 5 % (50 steps) before the spike
    assert (p.skip_from, p.skip_to) == (350, 500)  # skip 10 % of the stage past the spike
    assert p.spike_step == 400


def test_proposal_uses_an_earlier_checkpoint_when_none_is_far_enough_back():
    p = propose("pretrain", spike_step=60, total_steps=1000, committed_steps=[50], reason="r")
    assert p.checkpoint_step == 50


def test_no_checkpoint_before_the_spike_no_proposal():
    assert propose("pretrain", spike_step=10, total_steps=100, committed_steps=[20], reason="r") is None
