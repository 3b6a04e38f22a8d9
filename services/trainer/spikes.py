"""Loss-spike detection and PaLM's remedy, as pure functions.

A spike is a loss above mean + k·σ of a running window (or a grad-norm above k·σ of its own
window) for m consecutive steps. The proposal goes back to a committed checkpoint about
`BACK_FRACTION` of the stage before the spike (PaLM: ~100 steps) and skips the batches from there to
a little past the spike (PaLM: 200-500 batches), both scaled to the run. It is only a proposal:
the run waits in `awaiting_approval` until a person confirms `restart_from_checkpoint`.
"""

import math
from collections import deque
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
            not math.isfinite(loss) or self._above(self._losses, loss, self.k)
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


def propose(stage: str, spike_step: int, total_steps: int, committed_steps: list[int],
            reason: str) -> RestartProposal | None:
    """The restart to propose, or None when no committed checkpoint lies before the spike."""
    back = max(1, round(BACK_FRACTION * total_steps))
    candidates = [s for s in committed_steps if s <= spike_step - back] or [s for s in committed_steps if s < spike_step]
    if not candidates:
        return None
    checkpoint = max(candidates)
    skip = min(MAX_SKIP, max(1, round(SKIP_FRACTION * total_steps)))
    return RestartProposal(stage=stage, checkpoint_step=checkpoint, skip_from=checkpoint,
                           skip_to=spike_step + skip, spike_step=spike_step, reason=reason)
