"""Named fault points for chaos tests: `ITO_FAULT_POINT=<name>` makes the process die there.

Off unless the variable is set; a production deployment never sets it. The names in use are
listed here so that tests and `make chaos` refer to one place.
"""

import logging
import os

from runtime.configuration import settings

# The variables' names live with every other setting's; tests and `make chaos` find them here too.
ENV_FAULT_POINT = settings.ENV_FAULT_POINT
ENV_SPIKE_STEP = settings.ENV_FAULT_SPIKE_STEP
SCHEDULER_AFTER_ACCEPT = "scheduler.after_accept"  # the ledger reserved the key; no hand-off yet
ENTITLEMENT_BEFORE_APPLY = "entitlement.before_apply"  # a booking event received, not yet written
TRAINER_LOSS_SPIKE = "trainer.loss_spike"  # losses reported x10 from ITO_FAULT_SPIKE_STEP on (first attempt)
TRAINER_SHARE_FAILS = "trainer.share_fails"  # node n > 0 of a multi-node run raises as its share starts
# Every step takes ITO_FAULT_STEP_DELAY_S longer (default 1 s): a run that costs more than its estimate
TRAINER_SLOW_STEPS = "trainer.slow_steps"
POINTS = frozenset(
    {
        SCHEDULER_AFTER_ACCEPT,
        ENTITLEMENT_BEFORE_APPLY,
        TRAINER_LOSS_SPIKE,
        TRAINER_SHARE_FAILS,
        TRAINER_SLOW_STEPS,
    }
)


def active(point: str, planted: str) -> bool:
    """Is `point` the one `planted` names (ITO_FAULT_POINT, read once when the process started)?"""
    assert point in POINTS, f"unknown fault point {point!r}"
    return planted == point


log = logging.getLogger("ito.faults")


def crash_here(point: str) -> None:
    assert point in POINTS, f"unknown fault point {point!r}"
    if os.environ.get(ENV_FAULT_POINT) == point:
        log.error("fault point %s: exiting as if killed", point)
        logging.shutdown()
        os._exit(137)
