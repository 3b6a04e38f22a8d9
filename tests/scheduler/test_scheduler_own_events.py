"""The scheduler's own run events (creation, interruptions) are for the run's history and the
desk: the scheduler's event consumer applies none of them to a view, so it does not touch the
store for them (a write per accepted run otherwise, fsynced like every write)."""

from datetime import UTC, datetime

import pytest

from contracts.runs import Interruption, RunCreated
from services.scheduler.events import RunEvents

AT = datetime(2026, 12, 2, tzinfo=UTC)


class Untouchable:
    def __getattr__(self, name):
        raise AssertionError(f"the store was asked for {name}")


@pytest.mark.parametrize(
    "event",
    [
        RunCreated(
            run_id="run_a",
            seq=1,
            at=AT,
            account="acme",
            booking_id="b",
            region="r",
            gpu_model="g",
            gpus=1,
            accepted_at=AT,
        ),
        Interruption(run_id="run_a", seq=2, at=AT, cause="trainer_lost", silent_s=30.0),
    ],
)
async def test_the_schedulers_own_events_leave_the_store_alone(event):
    kind = type(event).__struct_config__.tag
    await RunEvents(Untouchable()).on_event(event, f"ns.v1.run.run_a.{kind}")  # type: ignore[arg-type]
