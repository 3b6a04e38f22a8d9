"""Booked-but-unused GPU-hours on the desk: telemetry's rollups count them as their own badput
category (`idle`), per booking, and the implied price per useful GPU-hour uses the booked hours.

The issue's numbers: the demo books 8 x H200 for 4 h (32 GPU-h); its run held one GPU for 28.4 s
(0.0079 GPU-h) with 80 % goodput. Counting only the held hours, a useful GPU-hour cost 3.50 / 0.8 =
4.375 USD; counting the booking, 32 x 3.50 / (0.0079 x 0.8) = 17,722 USD.
"""

from datetime import UTC, datetime, timedelta

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from contracts.runs import RunCreated
from contracts.telemetry import BADPUT, BOOKED_BADPUT, IDLE, Rollup, RunTelemetry
from domain.accounting import account, booked_gpu_hours, rollup
from services.desk import board, gauges, pages

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
HELD = 0.0079  # GPU-hours the demo's run held (one GPU)
BOOKED = 32.0  # 8 GPUs x 4 h


def run(run_id="r1", booking="bk", held=HELD, goodput=0.8, booked=BOOKED, gpus=1, gpu_model="H200"):
    wall_s = held / gpus * 3600.0
    return RunTelemetry(
        run_id=run_id,
        account="acme",
        booking_id=booking,
        region="eu",
        gpu_model=gpu_model,
        gpus=gpus,
        state="succeeded",
        accepted_at=T0,
        ended_at=T0 + timedelta(seconds=wall_s),
        wall_s=wall_s,
        goodput_s=goodput * wall_s,
        badput_s={**dict.fromkeys(BADPUT, 0.0), "startup": (1 - goodput) * wall_s},
        goodput=goodput,
        gpu_hours=held,
        interruptions=0,
        interruption_causes={},
        checkpoint_saves=0,
        booked_gpus=8 if booked else 0,
        booked_gpu_hours=booked,
    )


def test_the_implied_price_uses_the_booked_hours_idle_gpus_included():
    got = board.implied_price([run()], {"H200": 3.5})
    assert got == pytest.approx(BOOKED * 3.5 / (HELD * 0.8))  # 17,722 USD, not 4.375


@pytest.mark.parametrize(
    "runs, booked",
    [
        ([run()], BOOKED),
        ([run(), run("r2")], BOOKED),  # two runs on one booking: the booking is counted once
        ([run(), run("r2", booking="bk2", booked=16.0)], BOOKED + 16.0),
        ([run(booked=0.0)], HELD),  # a booking whose size is not known: the hours its runs held
        ([run(held=40.0, gpus=8)], 40.0),  # never less than the runs held
    ],
    ids=["one-run", "two-runs-one-booking", "two-bookings", "size-unknown", "held-more-than-booked"],
)
def test_booked_gpu_hours(runs, booked):
    assert booked_gpu_hours(runs) == pytest.approx(booked)


def test_a_bookings_rollup_counts_its_idle_gpu_hours():
    r = rollup("booking", "bk", [run(), run("r2")], T0)
    assert r.booked_gpu_hours == pytest.approx(BOOKED)
    assert r.badput_gpu_hours[IDLE] == pytest.approx(BOOKED - 2 * HELD)
    good = r.goodput_gpu_hours
    assert good + sum(r.badput_gpu_hours[c] for c in BOOKED_BADPUT) == pytest.approx(BOOKED)


def test_the_run_carries_its_booking_from_the_creation_record():
    created = RunCreated(
        run_id="r",
        seq=0,
        at=T0,
        account="a",
        booking_id="bk",
        region="eu",
        gpu_model="H200",
        gpus=1,
        accepted_at=T0,
        booked_gpus=8,
        booked_gpu_hours=BOOKED,
    )
    t = account(created, [], T0 + timedelta(seconds=30), "succeeded")
    assert (t.booked_gpus, t.booked_gpu_hours) == (8, BOOKED)


def test_the_desk_page_shows_the_idle_hours_and_the_booked_price():
    runs = [run()]
    rollups = {("booking", "bk"): rollup("booking", "bk", runs, T0)}
    (row,) = board.breakdowns(rollups, {"r1": runs[0]}, {"H200": 3.5})
    assert row.booked_gpu_hours == pytest.approx(BOOKED) and row.idle_gpu_hours == pytest.approx(
        BOOKED - HELD
    )
    assert row.shares[IDLE] == pytest.approx((BOOKED - HELD) / BOOKED)
    assert row.goodput == pytest.approx(HELD * 0.8 / BOOKED)  # of the booked hours
    assert row.goodput + sum(row.shares.values()) == pytest.approx(1.0)
    assert row.implied_usd_per_useful_gpu_hour == pytest.approx(BOOKED * 3.5 / (HELD * 0.8))
    html = "".join(pages.desk_sections([row], {"H200": 3.5}).values())
    assert "<th>idle GPU-h</th>" in html and f"{BOOKED - HELD:.4f}" in html and "seg-idle" in html


def test_the_desk_gauges_carry_idle_and_booked_hours():
    runs = [run()]
    rollups: dict[tuple[str, str], Rollup] = {
        (by, key): rollup(by, key, runs, T0) for by, key in (("gpu_model", "H200"), ("booking", "bk"))
    }
    source = type("Src", (), {"runs": None, "rollups": rollups})()
    body, _ = gauges.exposition(source)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }
    idle = samples[("ito_desk_gpu_hours", (("gpu_model", "H200"), ("kind", "idle")))]
    assert idle == pytest.approx(BOOKED - HELD)
    assert samples[("ito_desk_booked_gpu_hours", (("by", "booking"), ("key", "bk")))] == pytest.approx(BOOKED)


def test_an_older_rollup_without_booked_hours_reads_as_before():
    old = msgspec.structs.replace(rollup("booking", "bk", [run(booked=0.0)], T0), booked_gpu_hours=0.0)
    (row,) = board.breakdowns({("booking", "bk"): old}, {}, {"H200": 3.5})
    assert row.booked_gpu_hours == pytest.approx(HELD) and row.shares[IDLE] == 0.0
