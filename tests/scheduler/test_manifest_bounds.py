"""A manifest is bounded in work, not only in bytes (issue 39): one tenant's burst of heavy
manifests (100,000 empty data entries in ~400 KB, under every size cap) took 11-27 s each to refuse
on the scheduler's event loop, and meanwhile another tenant's `status` timed out. Here, on the
handlers (in memory and on Redis): the burst is refused for the data list's length, another
tenant's reads are answered while it is checked, and the same refused bytes are checked once."""

import asyncio
import json
import uuid

from contracts import subjects
from contracts.api import PlanRequest, StatusRequest
from contracts.errors import ErrorCode
from services.scheduler import manifests
from services.scheduler.manifests import digest_of
from tests.scheduler.test_handlers_inmemory import (
    REPO_MANIFEST,
    booking_event,
    call,
    code,
    login,
    publish_booking,
)
from tests.scheduler.test_handlers_inmemory import bus as bus
from tests.scheduler.test_handlers_inmemory import redis_infra as redis_infra

HEAVY_ENTRIES = 100_000
BURST = 24
BURST_BOUND_S = 60.0  # a liveness bound, not a timing: on main the burst took ~10 s a request


def heavy_manifest(variant: int | str) -> str:
    doc = json.loads(REPO_MANIFEST.read_text())
    doc["data"] = [{} for _ in range(HEAVY_ENTRIES)]
    doc["name"] = f"heavy-{variant}"  # other bytes each: no answer is remembered for another
    return json.dumps(doc)


async def test_a_burst_of_heavy_manifests_is_refused_while_another_tenant_is_answered(bus):
    await login(bus, "heavy")
    await login(bus, "calm")
    await publish_booking(bus, booking_event("heavy", "bk-heavy"))
    texts = [heavy_manifest(f"{i}-{uuid.uuid4().hex}") for i in range(BURST)]
    answered: list[ErrorCode | None] = []
    done = asyncio.Event()

    async def calm_reads() -> None:
        while not done.is_set():
            out = await call(bus, subjects.API_STATUS, StatusRequest(run_id="run_none"), "calm")
            answered.append(code(out))
            await asyncio.sleep(0)

    async def heavy(text: str):
        req = PlanRequest(booking_id="bk-heavy", manifest_text=text, manifest_digest=digest_of(text.encode()))
        return await call(bus, subjects.API_PLAN, req, "heavy")

    reader = asyncio.create_task(calm_reads())
    try:
        outs = await asyncio.wait_for(asyncio.gather(*(heavy(t) for t in texts)), BURST_BOUND_S)
    finally:
        done.set()
        await reader
    assert [code(out) for out in outs] == [ErrorCode.manifest_invalid] * BURST
    assert all("$.data" in out.error.message and "at most 256 items" in out.error.message for out in outs)
    assert answered and set(answered) == {ErrorCode.run_not_found}  # every calm read was answered


async def test_the_same_refused_bytes_are_checked_once(bus, monkeypatch):
    await login(bus, "heavy")
    await publish_booking(bus, booking_event("heavy", "bk-once"))
    checked = []
    real = manifests._checked

    def counting(data: bytes):
        checked.append(len(data))
        return real(data)

    monkeypatch.setattr(manifests, "_checked", counting)
    text = heavy_manifest(uuid.uuid4().hex)  # bytes this process has not seen
    req = PlanRequest(booking_id="bk-once", manifest_text=text, manifest_digest=digest_of(text.encode()))
    first = await call(bus, subjects.API_PLAN, req, "heavy")
    again = [await call(bus, subjects.API_PLAN, req, "heavy") for _ in range(5)]
    assert code(first) is ErrorCode.manifest_invalid
    assert all(out.error == first.error for out in again)
    assert checked == [len(text)]
