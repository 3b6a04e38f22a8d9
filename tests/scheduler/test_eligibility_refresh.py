"""The eligibility statement at the moment of creation (services/scheduler/api.py): reused while
fresh, re-fetched once it expired (never stretched), and a plan holds only for the booking
version it was made on: a booking changed in between refuses the request."""

from datetime import UTC, datetime, timedelta

import pytest

from contracts.booking import Fabric, Topology
from contracts.errors import ErrorCode
from contracts.internal import EligibilityBody
from runtime.messaging.codec import Refusal
from services.scheduler.api import Api
from services.scheduler.peers import Peers

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def body(version: int, expires_in_s: float = 60.0) -> EligibilityBody:
    return EligibilityBody(
        account="acme",
        booking_id="bk",
        booking_version=version,
        topology=Topology(nodes=1, gpus_per_node=8, gpu_model="H200", gpu_memory_gb=141),
        region="eu",
        fabric=Fabric.infiniband,
        window_start=NOW - timedelta(hours=1),
        window_end=NOW + timedelta(hours=1),
        issued_at=NOW,
        expires_at=NOW + timedelta(seconds=expires_in_s),
    )


class Statements:
    """The entitlement service's side: the statement it issues now."""

    def __init__(self, current: EligibilityBody) -> None:
        self.current = current
        self.calls = 0

    async def verified_eligibility(self, account, booking_id, manifest) -> EligibilityBody:
        self.calls += 1
        return self.current


def api(statements: Statements) -> Api:
    a = Api.__new__(Api)  # only the peers take part in the refresh
    a.peers = statements  # type: ignore[assignment]
    return a


@pytest.mark.parametrize(
    "at, fresh", [(NOW, True), (NOW + timedelta(seconds=59.9), True), (NOW + timedelta(seconds=60), False)]
)
def test_a_statement_is_fresh_until_its_expiry_and_not_a_moment_longer(at, fresh):
    assert Peers.still_fresh(None, body(1), at) is fresh  # type: ignore[arg-type]


async def test_a_refreshed_statement_of_the_same_version_is_used():
    statements = Statements(body(3))
    assert (
        await api(statements)._refreshed("acme", "bk", None, body(3, expires_in_s=0))
    ).booking_version == 3
    assert statements.calls == 1


@pytest.mark.parametrize("now_version", [4, 2])
async def test_a_booking_changed_since_the_plan_refuses_the_request(now_version):
    statements = Statements(body(now_version))
    with pytest.raises(Refusal) as refused:
        await api(statements)._refreshed("acme", "bk", None, body(3, expires_in_s=0))
    assert refused.value.code is ErrorCode.eligibility_stale
    assert f"version 3 -> {now_version}" in refused.value.message
