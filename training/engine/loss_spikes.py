"""Loss-spike detection and PaLM's remedy, as pure functions.

A spike is a loss above mean + k·σ of a running window (or a grad-norm above k·σ of its own
window) for m consecutive steps. The proposal goes back to a committed checkpoint about
`BACK_FRACTION` of the stage before the spike (PaLM: ~100 steps) and skips the batches from there to
a little past the spike (PaLM: 200-500 batches), both scaled to the run. It is only a proposal:
the run waits in `awaiting_approval` until a person confirms `restart_from_checkpoint`.

The skip window is in data positions (batches the data stream has served), not steps: after one
approved skip, step s no longer reads batch s, and a second restart's window computed from step
numbers would start where the resume never lands, so it would skip nothing. Positions come from the
checkpoints' sidecars (each records the position it was saved at); `position_after` turns them into
the position at the spike.
"""

import math
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from contracts.api import RestartProposal

WINDOW = 50  # steps of history the mean and σ come from
K_SIGMA = 4.0  # how far above the mean counts as a spike
CONSECUTIVE = 3  # for how many steps in a row (one noisy step is not a spike)
MIN_HISTORY = 20  # no verdict before the window has this many steps
BACK_FRACTION = 0.05  # restart this share of the stage's steps before the spike (>= 1 step)
SKIP_FRACTION = 0.1  # skip this share of the stage's batches past the spike, at most MAX_SKIP
MAX_SKIP = 500


@dataclass
class SpikeDetector:
    window: int = WINDOW
    k: float = K_SIGMA
    consecutive: int = CONSECUTIVE
    min_history: int = MIN_HISTORY
    _losses: deque = field(default_factory=deque)
    _norms: deque = field(default_factory=deque)
    _run: int = 0
    first_spike_step: int | None = None

    @staticmethod
    def _above(history: deque, value: float, k: float) -> bool:
        mean = sum(history) / len(history)
        sd = math.sqrt(sum((x - mean) ** 2 for x in history) / len(history))
        return value > mean + k * max(sd, 1e-3 * abs(mean), 1e-8)

    def observe(self, step: int, loss: float, grad_norm: float) -> bool:
        """True once `consecutive` spiking steps in a row were seen; spiking steps stay out of the window."""
        if len(self._losses) >= self.min_history and (
            not math.isfinite(loss)
            or self._above(self._losses, loss, self.k)
            or self._above(self._norms, grad_norm, self.k)
        ):
            self._run += 1
            if self._run == 1:
                self.first_spike_step = step
            return self._run >= self.consecutive
        self._run, self.first_spike_step = 0, None
        self._losses.append(loss)
        self._norms.append(grad_norm)
        if len(self._losses) > self.window:
            self._losses.popleft()
            self._norms.popleft()
        return False


def restart_point(spike_step: int, total_steps: int, committed_steps: Collection[int]) -> int | None:
    """The checkpoint a restart goes back to: the newest at least `BACK_FRACTION` of the stage before
    the spike, else the newest before it; None when none lies before the spike."""
    back = max(1, round(BACK_FRACTION * total_steps))
    candidates = [s for s in committed_steps if s <= spike_step - back] or [
        s for s in committed_steps if s < spike_step
    ]
    return max(candidates, default=None)


def position_after(step: int, positions: Mapping[int, int], skip: tuple[int, int] | None = None) -> int:
    """The data position once `step` steps of the current attempt ran (one batch a step), from the
    positions the committed checkpoints recorded (`positions`: step -> position) and the last
    approved skip [from, to) (`skip`).

    A checkpoint at or after `step` was saved by this same attempt (the spike came after its resume
    point), with no skip in between: count back from it. Failing that, count on from the newest one
    before `step`; if that is where the skip starts, the resume from it continued at the skip's end.
    With no checkpoint at all, the stage ran from position 0."""
    after = [s for s in positions if s >= step]
    if after:
        nearest = min(after)
        return positions[nearest] - (nearest - step)
    before = [s for s in positions if s < step]
    if not before:
        return step
    newest = max(before)
    position = positions[newest]
    if skip is not None and position == skip[0]:
        position = skip[1]
    return position + (step - newest)


def propose(
    stage: str,
    spike_step: int,
    total_steps: int,
    positions: Mapping[int, int],
    reason: str,
    skip: tuple[int, int] | None = None,
) -> RestartProposal:
    """The restart to propose for a spike first seen at `spike_step`. `positions`: committed step ->
    the data position it recorded; `skip`: the last approved skip window, if any. The window starts
    at the restart checkpoint's recorded position (where its resume lands, so the skip fires) and
    ends a little past the data position of the spike. With no committed checkpoint before the spike,
    the restart goes back to the start (step 0, position 0)."""
    checkpoint = restart_point(spike_step, total_steps, positions)
    past = min(MAX_SKIP, max(1, round(SKIP_FRACTION * total_steps)))
    skip_to = position_after(spike_step, positions, skip) + past
    if checkpoint is None:
        return RestartProposal(
            stage=stage,
            checkpoint_step=0,
            skip_from=0,
            skip_to=skip_to,
            spike_step=spike_step,
            reason=reason + "; no checkpoint before it",
        )
    return RestartProposal(
        stage=stage,
        checkpoint_step=checkpoint,
        skip_from=positions[checkpoint],
        skip_to=skip_to,
        spike_step=spike_step,
        reason=reason,
    )
