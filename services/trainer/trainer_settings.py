"""What the trainer agent reads from its environment beside the shared settings, read once when the
service starts (`app.register`) and handed down: nothing on the worker's way reads the environment.

The variables' names and defaults are runtime/configuration/settings.py's, like every `ITO_*` one.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

from runtime.configuration import faults
from runtime.configuration.settings import (
    DEFAULT_FAULT_SPIKE_STEP,
    DEFAULT_FAULT_STEP_DELAY_S,
    DEFAULT_GANG_MAX_REQUEUES,
    ENV_FAULT_POINT,
    ENV_FAULT_SPIKE_STEP,
    ENV_FAULT_STEP_DELAY_S,
    ENV_GANG_MAX_REQUEUES,
    trainer_compile,
    trainer_threads,
)

N = TypeVar("N", int, float)


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainerSettings:
    threads: int
    """Torch threads a run trains with (`trainer_threads`: ITO_TRAINER_THREADS, else OMP_NUM_THREADS,
    else the cores this process may run on)."""
    gang_max_requeues: int = DEFAULT_GANG_MAX_REQUEUES
    """How often a run whose gang was lost past the launcher's restarts is requeued before it fails
    (`ITO_GANG_MAX_REQUEUES`)."""
    compile: bool | None = None
    """Per-block torch.compile of every stage's model (`ITO_TRAINER_COMPILE`: auto, on, off); None:
    auto, on for cuda and off on CPU."""
    fault_point: str = ""
    """The chaos tests' fault point (`ITO_FAULT_POINT`, runtime/configuration/faults.py); "" for none,
    as in every production deployment."""
    fault_spike_step: int = DEFAULT_FAULT_SPIKE_STEP
    """With `trainer.loss_spike`: the step from which losses are reported x10 (`ITO_FAULT_SPIKE_STEP`)."""
    fault_step_delay_s: float = DEFAULT_FAULT_STEP_DELAY_S
    """With `trainer.slow_steps`: how much longer every step takes (`ITO_FAULT_STEP_DELAY_S`)."""

    def fault(self, point: str) -> bool:
        """Is the named fault point planted in this process?"""
        return faults.active(point, self.fault_point)


def load(env: Mapping[str, str], cpus: int) -> TrainerSettings:
    """The trainer's settings from `env` (the process's environment, once), on `cpus` usable cores.
    A fault's own variable is read only when its fault point is planted: unused, it cannot stop a
    start. ValueError names a variable that is not a number."""
    point = env.get(ENV_FAULT_POINT, "")
    return TrainerSettings(
        threads=trainer_threads(env, cpus),
        gang_max_requeues=_number(int, env, ENV_GANG_MAX_REQUEUES, DEFAULT_GANG_MAX_REQUEUES),
        compile=trainer_compile(env),
        fault_point=point,
        fault_spike_step=(
            _number(int, env, ENV_FAULT_SPIKE_STEP, DEFAULT_FAULT_SPIKE_STEP)
            if point == faults.TRAINER_LOSS_SPIKE
            else DEFAULT_FAULT_SPIKE_STEP
        ),
        fault_step_delay_s=(
            _number(float, env, ENV_FAULT_STEP_DELAY_S, DEFAULT_FAULT_STEP_DELAY_S)
            if point == faults.TRAINER_SLOW_STEPS
            else DEFAULT_FAULT_STEP_DELAY_S
        ),
    )


def _number(kind: type[N], env: Mapping[str, str], name: str, default: N) -> N:
    raw = env.get(name)
    if raw is None:
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name} needs to be a number, got {raw!r}.") from None
