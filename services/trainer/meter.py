"""The trainer's meter: the GPUs a run holds and for how long, as the scheduler prices and bounds it.

A run holds every GPU of its placement (the plan's `gpus`: all GPUs of the nodes given to it) from
the trainer's start of the run (its lease) until release (its final state reported). The meter
counts GPU-seconds on the monotonic clock, starting from what earlier attempts held (the lease
answer's `held_gpu_s`), and keeps the figures a clean stop takes (the last step's wall time and the
last checkpoint save), which the scheduler adds to its margin (domain/budget.py). Node 0
reports it with each lease renewal; the other nodes' GPUs are in its `held_gpus`.
"""

import threading
import time

from contracts.runs import CheckpointSaved, Metrics, RunEvent


class Meter:
    def __init__(self, held_gpus: int, earlier_gpu_s: float = 0.0, delay_s: float = 0.0) -> None:
        """`delay_s`: the trainer.slow_steps fault point's added time per step (services/trainer/
        trainer_settings.py); 0 but in chaos tests."""
        self.held_gpus = max(held_gpus, 1)
        self.earlier_gpu_s = max(earlier_gpu_s, 0.0)
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._last_step_at: float | None = None
        self.step_s = 0.0
        self.save_s = 0.0
        self.delay_s = delay_s

    def held_gpu_s(self) -> float:
        """GPU-seconds held so far, this attempt and the earlier ones."""
        return self.earlier_gpu_s + self.held_gpus * (time.monotonic() - self.started)

    def stop_s(self) -> float:
        """How long a clean stop takes now: finish the step under way, then commit a checkpoint."""
        with self._lock:
            return self.step_s + self.save_s

    def observe(self, event: RunEvent) -> None:
        """Called from the training thread with every event: step and save times."""
        now = time.monotonic()
        with self._lock:
            if isinstance(event, Metrics):
                if self._last_step_at is not None:
                    self.step_s = now - self._last_step_at
                self._last_step_at = now
            elif isinstance(event, CheckpointSaved):
                self.save_s = max(self.save_s, event.save_s)
        if self.delay_s and isinstance(event, Metrics):  # fault injection: a run slower than planned
            time.sleep(self.delay_s)
