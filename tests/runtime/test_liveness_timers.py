"""The liveness timers' ordering is checked when they are built, not left to a comment."""

import pytest

from runtime.configuration.timers import TIMERS, LivenessTimers


def test_the_defaults_keep_the_fencing_order():
    assert TIMERS.renew_every_s < TIMERS.self_fence_s < TIMERS.silence_s < TIMERS.ack_wait_s


@pytest.mark.parametrize(
    "overrides",
    [
        {"self_fence_s": 5.0, "silence_s": 5.0},  # the old holder may still train when a new one starts
        {"self_fence_s": 6.0},  # fences itself after the scheduler already gave the run away
        {"silence_s": 10.0},  # the work item comes back while its trainer still counts as alive
        {"ack_wait_s": 4.0},
        {"renew_every_s": 3.0},  # renews no more often than it fences itself
        {"in_progress_every_s": 10.0},
        {"watch_every_s": 0.0},
    ],
)
def test_a_bad_ordering_is_refused(overrides):
    with pytest.raises(ValueError, match=r"liveness timer|self_fence_s < silence_s|renew|ack deadline"):
        LivenessTimers(**overrides)


def test_the_trainer_reads_the_same_timers():
    from services.trainer import worker

    assert (worker.SELF_FENCE_S, worker.RENEW_EVERY_S, worker.WORK_ACK_WAIT_S) == (
        TIMERS.self_fence_s,
        TIMERS.renew_every_s,
        TIMERS.ack_wait_s,
    )
