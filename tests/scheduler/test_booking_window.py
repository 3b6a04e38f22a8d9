"""The booking's window and its idle GPUs through the API's handlers (in memory and on Redis, the
fixtures of test_handlers_inmemory): a run that cannot finish in the booking's remaining window is
refused with `booking_window_exceeded` at plan, confirm and train, and nothing is reserved (the
confirmation stays usable, the key has no run); the demo's plan names the idle GPUs and their cost.

The manifest is the demo's tiny one with 2.5e11 tokens: 6 x 468,352 x 2.5e11 FLOPs at 989 TFLOPs x 0.4
= 0.49 h on one H200, 0.74 h with the plan's margin, against a window with 29 minutes left.
"""

import json

import msgspec

from contracts import subjects
from contracts.api import (
    Action,
    ConfirmationIssued,
    ConfirmRequest,
    PlanRequest,
    RunAccepted,
    StatusRequest,
    TrainRequest,
)
from contracts.errors import ErrorCode
from contracts.plans import Plan
from devstack.booking_sim import event
from services.scheduler.manifests import digest_of
from tests.scheduler.test_handlers_inmemory import REPO_MANIFEST, call, code, data, login, publish_booking
from tests.scheduler.test_handlers_inmemory import bus as bus
from tests.scheduler.test_handlers_inmemory import redis_infra as redis_infra

LONG_TOKENS = 250_000_000_000
WINDOW = "booking_window_exceeded"  # ErrorCode.booking_window_exceeded (a StrEnum: equal to its value)


def manifest_text(tokens: int | None = None, resumable: bool = False) -> str:
    doc = json.loads(REPO_MANIFEST.read_text())
    if tokens is not None:
        doc["target"]["tokens"] = tokens
        # a long run costs more than the demo's 5 USD cap: the window, not the budget, is under test
        doc["budget_cap_usd"] = doc["max_incremental_cost_usd"] = 1e9
    if resumable:
        doc["checkpoint"]["resumable_across_bookings"] = True
    return json.dumps(doc)


async def book(bus, booking: str, hours: float, version: int = 1, kind: str = "completed") -> None:
    ev = event(
        account="acme",
        booking=booking,
        kind=kind,
        nodes=1,
        gpus_per_node=8,
        gpu_model="H200",
        region="eu-central-1",
        fabric="infiniband",
        hours=hours,
        version=version,
    )
    await publish_booking(bus, ev)


def requests(booking: str, text: str) -> tuple[PlanRequest, ConfirmRequest]:
    digest = digest_of(text.encode())
    return (
        PlanRequest(booking_id=booking, manifest_text=text, manifest_digest=digest),
        ConfirmRequest(action=Action.train, booking_id=booking, manifest_text=text, manifest_digest=digest),
    )


async def test_the_demo_plan_names_the_idle_gpus(bus):
    await login(bus)
    await book(bus, "bw-demo", hours=24)
    plan_req, _ = requests("bw-demo", manifest_text())
    p = data(await call(bus, subjects.API_PLAN, plan_req), Plan)
    assert p.ok and p.capacity is not None and p.window is not None and p.window.fits
    assert (p.capacity.held, p.capacity.idle) == (["node0:gpu0"], ["node0:gpu1-7"])
    assert p.capacity.idle_usd_per_hour == 24.5 and p.capacity.wasteful


async def test_a_run_longer_than_the_window_is_refused_at_plan_and_confirm(bus):
    await login(bus)
    await book(bus, "bw-short", hours=0.5)
    plan_req, confirm_req = requests("bw-short", manifest_text(LONG_TOKENS))
    out = await call(bus, subjects.API_PLAN, plan_req)
    assert code(out) == WINDOW
    assert out.error is not None and "does not fit" in out.error.message
    assert code(await call(bus, subjects.API_CONFIRM, confirm_req)) == WINDOW
    # resumable on a later booking: the plan passes, and says so
    plan_req, _ = requests("bw-short", manifest_text(LONG_TOKENS, resumable=True))
    p = data(await call(bus, subjects.API_PLAN, plan_req), Plan)
    assert p.window is not None and p.window.resumable and not p.window.fits
    assert "later booking" in p.window.sentence


async def test_train_is_refused_when_the_window_shrank_and_nothing_is_reserved(bus):
    await login(bus)
    await book(bus, "bw-moved", hours=24)
    text = manifest_text(LONG_TOKENS // 400)  # ~10 h at the calibrated figures: fits 24 h, not 30 min
    _, confirm_req = requests("bw-moved", text)
    issued = data(await call(bus, subjects.API_CONFIRM, confirm_req), ConfirmationIssued)
    train = TrainRequest(
        booking_id="bw-moved",
        manifest_text=text,
        manifest_digest=digest_of(text.encode()),
        confirmation_ref=issued.confirmation_ref,
        idempotency_key="k-window",
    )
    await book(bus, "bw-moved", hours=0.5, version=2, kind="modified")  # upstream shortened it
    assert code(await call(bus, subjects.API_TRAIN, train)) == WINDOW
    status = await call(bus, subjects.API_STATUS, StatusRequest(idempotency_key="k-window"))
    assert code(status) is ErrorCode.run_not_found  # no run, no key reserved
    # the confirmation was not consumed: with the window back, the same reference starts the run
    await book(bus, "bw-moved", hours=24, version=3, kind="modified")
    run = data(await call(bus, subjects.API_TRAIN, train), RunAccepted)
    assert not run.replay and run.booking_id == "bw-moved"
    assert msgspec.structs.asdict(run)["idempotency_key"] == "k-window"
