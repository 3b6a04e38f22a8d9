"""The run's cost bound, written into its work item by the ledger's accept (services/ledger/handlers.py)."""

import msgspec
import pytest

from contracts.runs import TrainWork
from services.ledger.handlers import bounded_work
from tests.unit.test_node_shares import work as node_work


def item(bound: float | None) -> bytes:
    return msgspec.json.encode(msgspec.structs.replace(node_work(1, rendezvous=""), cost_bound_usd=bound))


@pytest.mark.parametrize(
    ("estimate", "authorised", "bound"),
    [
        (2.0, 5.0, 5.0),  # the person authorised more than the estimate: the run may spend that
        (2.0, 1.5, 1.5),  # never above what was authorised
        (2.0, 2.0, 2.0),
        (2.0, None, 2.0),  # a confirmation with no bound: the estimate stays
    ],
)
def test_the_item_carries_what_the_confirmation_authorised(estimate, authorised, bound):
    out = msgspec.json.decode(bounded_work(item(estimate), authorised), type=TrainWork)
    assert out.cost_bound_usd == bound
    assert msgspec.structs.replace(out, cost_bound_usd=estimate) == msgspec.json.decode(
        item(estimate), type=TrainWork
    )


def test_no_work_item_is_left_as_it_is():
    assert bounded_work(b"", 5.0) == b""
