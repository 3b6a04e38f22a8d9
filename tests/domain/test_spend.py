"""Cost as spent, the pure parts as tables: a run's spend limit, when the scheduler stops it, which
lease renewals are meter readings, and the trainer's final state on a budget stop."""

import pathlib
from datetime import UTC, datetime

import pytest

from contracts.api import LeaseQuery, RunView
from contracts.manifest import Manifest
from contracts.plans import CostEstimate
from contracts.runs import Outcome, StopReason
from contracts.states import RunState
from domain import budget
from services.scheduler.leases import metering
from services.trainer.endings import Stop, final_state
from training.recipes.pipeline import PipelineResult

REPO = pathlib.Path(__file__).resolve().parents[2]
T0 = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
RATE = 3.6  # USD per GPU-hour: one GPU-second costs 0.001 USD


def cost(booked_gpu_hours: float = 8.0, storage: float = 0.0) -> CostEstimate:
    return CostEstimate(
        flops=1.0,
        tokens=1,
        parameters=1,
        assumed_mfu=0.4,
        peak_tflops_per_gpu=989.0,
        gpus=1,
        gpu_hours=0.01,
        price_per_gpu_hour_usd=RATE,
        compute_usd=0.036,
        checkpoint_storage_usd=storage,
        total_usd=0.036 + storage,
        booked_gpu_hours=booked_gpu_hours,
        incremental_usd=0.0,
    )


def manifest(cap: float, incremental: float = 0.0) -> Manifest:
    import msgspec

    raw = msgspec.json.decode((REPO / "examples/manifests/tiny.json").read_bytes())
    raw |= {"budget_cap_usd": cap, "max_incremental_cost_usd": incremental}
    return msgspec.convert(raw, Manifest)


@pytest.mark.parametrize(
    "cap, booked_gpu_hours, incremental, limit",
    [
        (5.0, 8.0, 0.0, 5.0),  # the cap binds: the booking covers 28.8 USD
        (50.0, 8.0, 0.0, 28.8),  # the booking binds: nothing allowed beyond it
        (50.0, 8.0, 10.0, 38.8),  # the booking plus what may go beyond it
        (50.0, 0.0, 0.0, 0.0),
    ],
)
def test_the_limit_is_the_cap_or_the_booking_plus_the_allowed_increment(
    cap, booked_gpu_hours, incremental, limit
):
    assert budget.spend_limit(manifest(cap, incremental), cost(booked_gpu_hours)) == pytest.approx(limit)


@pytest.mark.parametrize(
    "cap, bound, limit",
    [
        (5.0, None, 5.0),  # no bound carried (an older work item): the manifest's limit
        (5.0, 2.0, 2.0),  # the person authorised less than the cap: the bound is the limit
        (5.0, 9.0, 5.0),  # a bound above the cap never raises it
        (5.0, 0.0, 0.0),
    ],
)
def test_the_confirmations_bound_caps_the_limit_and_never_raises_it(cap, bound, limit):
    assert budget.spend_limit(manifest(cap), cost(), bound) == pytest.approx(limit)
    assert budget.manifest_limit(manifest(cap), cost()) == pytest.approx(cap)


RENEW_EVERY_S = 1.0  # the lease renewal period handed to the rule
MARGIN_S = (
    RENEW_EVERY_S + budget.STOP_ALLOWANCE_S
)  # the next renewal and the allowance, before the trainer's stop_s


@pytest.mark.parametrize(
    "held_gpus, held_gpu_s, stop_s, storage, limit, stop",
    [
        (1, 0.0, 0.0, 0.0, 1.0, False),
        (1, 990.0, 2.0, 0.0, 1.0, False),  # 0.990 + 0.006 margin < 1.0
        (1, 995.0, 2.0, 0.0, 1.0, True),  # 0.995 + 0.006 reaches it: stop now, not after crossing
        (1, 990.0, 8.0, 0.0, 1.0, True),  # a slow step and save take the margin
        (4, 980.0, 2.0, 0.0, 1.0, True),  # four held GPUs spend four times as fast meanwhile
        (1, 990.0, 2.0, 0.005, 1.0, True),  # the plan's storage counts against the limit
        (1, 2000.0, 0.0, 0.0, 1.0, True),  # already over (a late reading): stop at once
    ],
)
def test_the_run_stops_while_a_clean_stop_still_fits_under_the_limit(
    held_gpus, held_gpu_s, stop_s, storage, limit, stop
):
    v = budget.verdict(held_gpus, held_gpu_s, stop_s, cost(storage=storage), limit, RENEW_EVERY_S)
    assert v.stop is stop
    assert v.spent_usd == pytest.approx(held_gpu_s / 1000)
    assert v.projected_usd == pytest.approx((held_gpu_s + held_gpus * (MARGIN_S + stop_s)) / 1000)


def view(state: RunState) -> RunView:
    return RunView(
        run_id="run_1",
        account="acme",
        booking_id="bk",
        manifest_digest="d",
        idempotency_key="k",
        state=state,
        created_at=T0,
        updated_at=T0,
    )


@pytest.mark.parametrize(
    "query, state, epoch, kept",
    [
        (dict(epoch=3, held_gpus=1, held_gpu_s=5.0), RunState.running, 3, True),
        (dict(epoch=3, held_gpus=1, held_gpu_s=5.0), RunState.cancelling, 3, True),  # the stop's reading
        (dict(epoch=2, held_gpus=1, held_gpu_s=5.0), RunState.running, 3, False),  # a fenced holder
        (dict(epoch=0, held_gpus=1, held_gpu_s=5.0), RunState.running, 3, False),  # a new lease, no reading
        (dict(epoch=3, held_gpus=0), RunState.running, 3, False),  # an older trainer: no meter
        (
            dict(epoch=3, node_rank=1, held_gpus=1, held_gpu_s=5.0),
            RunState.running,
            3,
            False,
        ),  # node 0's only
        (dict(epoch=3, held_gpus=1, held_gpu_s=5.0), RunState.succeeded, 3, False),  # released
    ],
)
def test_a_meter_reading_is_node_zeros_renewal_at_the_current_epoch(query, state, epoch, kept):
    assert metering(LeaseQuery(run_id="run_1", **query), view(state), epoch) is kept


@pytest.mark.parametrize(
    "reason, state, words",
    [
        (
            StopReason.budget_exhausted,
            RunState.budget_exhausted,
            "budget exhausted: spent 0.9950 USD of its limit 1.0000",
        ),
        (StopReason.cancelled, RunState.cancelled, "cancelled"),
    ],
)
def test_a_budget_stop_ends_budget_exhausted_with_its_sentence(tmp_path, reason, state, words):
    stop = Stop()
    stop.set(reason)
    result = PipelineResult(
        outcome=Outcome.stopped, summary="stopped", last_stage="pretrain", final_loss=None, held_out_loss=None
    )
    final, message = final_state(result, stop, tmp_path, (0.995, 1.0))
    assert final is state and message.startswith(words) and "no checkpoint yet" in message


def test_status_says_what_the_run_spent_against_its_limit():
    import msgspec

    from contracts.api import Spend
    from ecc import run_view

    spent = Spend(held_gpus=1, held_gpu_s=14.4, spent_usd=0.014, limit_usd=0.0146, at=T0)
    view_ = msgspec.structs.replace(
        view(RunState.budget_exhausted), spend=spent, message="budget exhausted: spent 0.0140 USD"
    )
    text = run_view.run(view_)
    assert "budget_exhausted" in text and "budget exhausted: spent 0.0140 USD" in text
    assert "spent: 0.014000 USD of its limit 0.014600 USD (1 GPU(s) held 14.4s)" in text
