"""The hand-off (services/scheduler/handoff.py) on the request path answers once the work item is
in the queue, without waiting for the ledger's hand-off mark; a mark that does not land leaves
the key pending, and the reconciler repeats the hand-off: same view, same item id, no second run."""

import asyncio
from datetime import UTC, datetime

import msgspec

from contracts.errors import ErrorCode
from contracts.internal import LedgerEntry
from contracts.states import RunState
from runtime.configuration.settings import load
from runtime.messaging.codec import Refusal
from services.scheduler.handoff import Handoff
from services.scheduler.memory import InMemoryRuns
from tests.training.test_node_shares import work

NOW = datetime(2026, 12, 2, tzinfo=UTC)


class Bus:
    def __init__(self) -> None:
        self.events: list[str] = []

    async def publish_once(self, subject, stream, body, msg_id, timeout, headers=None) -> None:
        self.events.append(msg_id)


class Ledger:
    """The work queue and the ledger as the hand-off sees them (the Peers port)."""

    def __init__(self, entry: LedgerEntry, mark_fails: bool) -> None:
        self.entry = entry
        self.mark_fails = mark_fails
        self.queued: list[str] = []  # work item ids as the stream would store them (deduplicated)
        self.pending = True
        self.mark_released = asyncio.Event()

    async def publish_work(self, run_id: str, body: bytes, msg_id: str) -> None:
        if msg_id not in self.queued:
            self.queued.append(msg_id)

    async def ledger_handed_off(self, account: str, key: str) -> LedgerEntry:
        await self.mark_released.wait()
        if self.mark_fails:
            raise Refusal(ErrorCode.backend_unavailable, "no answer")
        self.pending = False
        return self.entry

    async def ledger_pending(self, older_than_s: float) -> list[LedgerEntry]:
        return [self.entry] if self.pending else []


def entry() -> LedgerEntry:
    return LedgerEntry(
        account="acme",
        idempotency_key="k1",
        fingerprint="f",
        run_id="run_1",
        action="train",
        handed_off=False,
        created_at=NOW,
        work=msgspec.json.encode(work(1)),
    )


def handoff(ledger: Ledger, tmp_path) -> tuple[Handoff, InMemoryRuns]:
    runs = InMemoryRuns()
    settings = load({"ITO_DATA_DIR": str(tmp_path)})
    return Handoff(Bus(), settings, runs, ledger), runs  # type: ignore[arg-type]


async def test_the_request_path_answers_before_the_mark_lands(tmp_path):
    ledger = Ledger(entry(), mark_fails=False)
    h, _runs = handoff(ledger, tmp_path)
    view = await asyncio.wait_for(h.hand_off(ledger.entry, wait_for_mark=False), timeout=5)
    assert view.state is RunState.queued and ledger.queued == ["run_1"] and ledger.pending
    ledger.mark_released.set()
    await asyncio.gather(*h._marks)
    assert not ledger.pending


async def test_a_lost_mark_is_finished_by_the_reconciler_without_a_second_run(tmp_path):
    ledger = Ledger(entry(), mark_fails=True)
    h, runs = handoff(ledger, tmp_path)
    await h.hand_off(ledger.entry, wait_for_mark=False)
    ledger.mark_released.set()
    await asyncio.gather(*h._marks)  # logged, not raised
    assert ledger.pending
    ledger.mark_fails = False
    assert await h.reconcile_once() == 1
    assert not ledger.pending and ledger.queued == ["run_1"]
    assert list(runs.views) == [("acme", "run_1")]
    assert (await runs.get("acme", "run_1")).state is RunState.queued
