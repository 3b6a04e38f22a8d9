"""The liveness timers, one object read by the trainer (renew, self-fence, ack deadline) and the
scheduler (silence), with the rule that makes fencing safe checked when it is built.

A trainer renews its lease every `renew_every_s`; the renewal is its heartbeat. The scheduler
declares a run's trainer lost after `silence_s` without one and lets another trainer lease it. The
old holder, if it was only cut off, must have stopped by then, hence `self_fence_s < silence_s`;
and the work item must not come back from JetStream while its trainer is still considered alive,
hence `silence_s < ack_wait_s`. Construction refuses any other ordering with a plain sentence, so
a bad set of timers stops a service at start-up instead of letting two trainers train one run.
"""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class LivenessTimers:
    renew_every_s: float = 1.0
    """The trainer's lease renewal (its heartbeat); several fit inside `self_fence_s`."""
    self_fence_s: float = 3.0
    """No renewal for this long: the trainer stops by itself (it may have been fenced)."""
    silence_s: float = 5.0
    """No renewal for this long: the scheduler marks the run interrupted (target: detect within 10 s)."""
    ack_wait_s: float = 10.0
    """JetStream redelivers a dead trainer's work item this long after its last in_progress."""
    in_progress_every_s: float = 2.0
    """How often a live trainer extends the work item's ack deadline; well inside `ack_wait_s`."""
    watch_every_s: float = 1.0
    """How often the scheduler's watcher looks for silent runs."""

    def __post_init__(self) -> None:
        for name in (
            "renew_every_s",
            "self_fence_s",
            "silence_s",
            "ack_wait_s",
            "in_progress_every_s",
            "watch_every_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"The liveness timer {name} needs to be a positive number of seconds.")
        if not self.renew_every_s < self.self_fence_s:
            raise ValueError(
                f"A trainer must renew its lease (every {self.renew_every_s}s) more often than it "
                f"fences itself ({self.self_fence_s}s)."
            )
        if not self.self_fence_s < self.silence_s < self.ack_wait_s:
            raise ValueError(
                "The liveness timers need self_fence_s < silence_s < ack_wait_s "
                f"(got {self.self_fence_s}s, {self.silence_s}s, {self.ack_wait_s}s): a cut-off trainer "
                "must stop before the scheduler gives its run to another, and the work item must not "
                "come back while its trainer still counts as alive."
            )
        if not self.in_progress_every_s < self.ack_wait_s:
            raise ValueError(
                f"The work item's ack deadline ({self.ack_wait_s}s) needs extending more often than "
                f"it passes (in_progress_every_s is {self.in_progress_every_s}s)."
            )


TIMERS = LivenessTimers()  # built (and so checked) when a service imports it, i.e. at start-up
