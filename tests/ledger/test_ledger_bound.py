"""The run's cost bound: recorded by the ledger's accept from the confirmation it consumed, written
into the work item by the hand-off (services/scheduler/handoff.py `bounded`)."""

from datetime import UTC, datetime

import msgspec
import pytest

from contracts.api import Action
from contracts.internal import LedgerEntry
from contracts.runs import TrainWork
from services.ledger.store import BOUND_KEY
from services.scheduler.handoff import bounded
from tests.training.test_node_shares import work as node_work


def entry(estimate: float, recorded: float | None, work: bool = True) -> LedgerEntry:
    item = msgspec.structs.replace(node_work(1, rendezvous=""), cost_bound_usd=estimate)
    return LedgerEntry(
        account="acme",
        idempotency_key="k",
        fingerprint="f",
        run_id="run_1",
        action=Action.train,
        handed_off=False,
        created_at=datetime(2026, 1, 1, tzinfo=UTC),
        work=msgspec.json.encode(item) if work else b"",
        cost_bound_usd=recorded,
    )


@pytest.mark.parametrize(
    ("estimate", "recorded", "bound"),
    [
        (2.0, 5.0, 5.0),  # the person authorised more than the estimate: the run may spend that
        (2.0, 2.0, 2.0),
        (2.0, None, 2.0),  # no bound recorded (an entry from before): the estimate stays
    ],
)
def test_the_item_handed_off_carries_what_the_confirmation_authorised(estimate, recorded, bound):
    out = bounded(entry(estimate, recorded))
    item = msgspec.json.decode(out.work, type=TrainWork)
    assert item.cost_bound_usd == bound
    before = msgspec.json.decode(entry(estimate, recorded).work, type=TrainWork)
    assert msgspec.structs.replace(item, cost_bound_usd=estimate) == before  # nothing else changed


def test_an_entry_without_an_item_is_left_as_it_is():
    assert bounded(entry(2.0, 5.0, work=False)).work == b""


def test_the_scripts_placeholder_is_the_encoded_entrys_last_field():
    # the accept script writes the bound over `"cost_bound_usd":null`: it must be there, once, last
    encoded = msgspec.json.encode(entry(2.0, None)).decode()
    assert encoded.count(BOUND_KEY) == 1 and encoded.endswith(BOUND_KEY + "null}")
