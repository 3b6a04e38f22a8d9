"""The quota decisions as tables (domain/quotas.py): the token bucket's arithmetic (the
same rows run against its Lua twin on Redis: tests/runtime/test_quotas_redis.py), the limits as
stored, the operator's values, and the admission of a run."""

import msgspec
import pytest

from contracts.api import QuotaLimits
from contracts.states import RunState
from domain import quotas

BUCKET_ROWS = [
    # (tokens, at, now, rate, burst, cost) -> (allowed, tokens after, retry after)
    ((None, None, 100.0, 1.0, 3, 1.0), (True, 2.0, 0.0)),  # a new bucket is full
    ((0.0, 100.0, 100.0, 1.0, 3, 1.0), (False, 0.0, 1.0)),  # empty: one token in 1/rate s
    ((0.0, 100.0, 100.5, 2.0, 3, 1.0), (True, 0.0, 0.0)),  # refilled at rate per second
    ((0.5, 100.0, 100.0, 0.25, 3, 1.0), (False, 0.5, 2.0)),  # half a token short at 0.25/s
    ((1.0, 100.0, 1000.0, 1.0, 3, 1.0), (True, 2.0, 0.0)),  # never above the burst
    ((2.0, 100.0, 50.0, 1.0, 3, 1.0), (True, 1.0, 0.0)),  # a clock that went back refills nothing
    ((0.0, 100.0, 100.0, 1.0, 3, 0.0), (True, 0.0, 0.0)),  # cost 0: a look, admitted, takes nothing
    ((None, None, 100.0, 1.0, 3, 17.0), (True, 0.0, 0.0)),  # a cost above the burst costs the burst
    ((2.0, 100.0, 100.0, 1.0, 3, 17.0), (False, 2.0, 1.0)),  # ...and waits for a full bucket
]


@pytest.mark.parametrize(("given", "expected"), BUCKET_ROWS)
def test_the_bucket(given, expected):
    taken = quotas.take(*given)
    assert (taken.allowed, taken.tokens, taken.retry_after_s) == pytest.approx(expected)


def test_a_flood_is_admitted_at_the_rate_and_no_faster():
    """One request every 10 ms for 10 s against 5/s with a burst of 10: 10 + 5 * 10 admitted."""
    tokens, at, admitted = None, None, 0
    for i in range(1000):
        now = i * 0.01
        taken = quotas.take(tokens, at, now, 5.0, 10)
        tokens, at, admitted = taken.tokens, now, admitted + taken.allowed
    assert admitted in (59, 60, 61)


@pytest.mark.parametrize(
    ("stored", "expected"),
    [
        ({}, quotas.DEFAULTS),
        (
            {"rate_per_s": "2.5", "runs": "3.0"},
            msgspec.structs.replace(quotas.DEFAULTS, rate_per_s=2.5, runs=3),
        ),
        (
            {"file_bytes": "1e9", "files": "2.0", "models": "1"},
            msgspec.structs.replace(quotas.DEFAULTS, file_bytes=10**9, files=2, models=1),
        ),
        ({"burst": "junk", "queued": "-1", "confirmations": "inf"}, quotas.DEFAULTS),  # unreadable: default
    ],
)
def test_limits_as_stored(stored, expected):
    assert quotas.limits_from(stored) == expected


@pytest.mark.parametrize(
    ("name", "value", "refused"),
    [
        ("rate_per_s", 0.5, False),
        ("rate_per_s", 0.0, True),
        ("burst", 10.0, False),
        ("burst", 2.5, True),  # a count is whole
        ("runs", -1.0, True),
        ("queued", 1e9, True),  # a typo, not a quota
        ("tokens", 1.0, True),  # no such quota
        ("file_bytes", 1e12, False),  # bytes: far above the counts' bound
        ("file_bytes", 2.0**51, True),
        ("files", 2e6, True),
    ],
)
def test_the_operators_values(name, value, refused):
    assert (quotas.invalid_limit(name, value) is not None) is refused


LIMITS = QuotaLimits(rate_per_s=1.0, burst=1, confirmations=1, runs=3, queued=2)
S = RunState


@pytest.mark.parametrize(
    ("states", "breach"),
    [
        ([], None),
        ([S.running, S.queued], None),
        ([S.running, S.succeeded, S.failed, S.cancelled, S.gate_failed, S.queued], None),  # finished: free
        ([S.running, S.awaiting_approval, S.cancelling], ("runs", 3, 3)),
        ([S.queued, S.accepted], ("queued", 2, 2)),
        ([S.interrupted, S.queued, S.running], ("runs", 3, 3)),  # `runs` is checked first
    ],
)
def test_run_admission(states, breach):
    found = quotas.run_breach(LIMITS, states)
    assert (None if found is None else (found[0].quota, found[0].current, found[0].limit)) == breach


@pytest.mark.parametrize(
    ("open_at_most", "may"),
    [
        (0, False),
        (1, False),  # below both limits (runs 3, queued 2): no state needs reading
        (2, True),  # could be two waiting runs: `queued` reached
        (3, True),
        (10_000, True),  # a set with finished runs not yet pruned: the states decide
    ],
)
def test_the_run_states_are_read_only_when_a_limit_could_be_reached(open_at_most, may):
    assert quotas.may_breach(LIMITS, open_at_most) is may


@pytest.mark.parametrize("states", [[S.queued, S.accepted], [S.running, S.awaiting_approval, S.cancelling]])
def test_wherever_a_breach_is_found_may_breach_said_so(states):
    # the upper bound the store gives is at least the unfinished count: never a missed breach
    unfinished, _ = quotas.run_usage(states)
    assert quotas.run_breach(LIMITS, states) is not None and quotas.may_breach(LIMITS, unfinished)


def test_a_confirmation_breach_names_the_quota_and_its_numbers():
    assert quotas.confirmation_breach(1, 2) is None
    breach, message = quotas.confirmation_breach(2, 2) or (None, "")
    assert breach is not None and (breach.quota, breach.current, breach.limit) == ("confirmations", 2, 2)
    assert "2 outstanding confirmations" in message and "may have 2" in message


@pytest.mark.parametrize(
    ("taken", "now", "later", "retry"),
    [
        (quotas.Taken(True, 3.0, 0.0), 10.0, 10.0, None),  # an admission is not remembered
        (quotas.Taken(False, 0.0, 0.25), 10.0, 10.1, 0.15),  # a refusal, until its token is there
        (quotas.Taken(False, 0.0, 0.25), 10.0, 10.3, None),
        (quotas.Taken(False, 0.0, 100.0), 10.0, 10.5, 99.5),  # a long wait: remembered a second only
        (quotas.Taken(False, 0.0, 100.0), 10.0, 11.0, None),
    ],
)
def test_a_refusal_is_remembered_for_at_most_a_second(taken, now, later, retry):
    found = quotas.remembered(quotas.memory_of(taken, now), later)
    assert found == (None if retry is None else pytest.approx(retry))


@pytest.mark.parametrize(
    ("manifest_bytes", "cost"),
    [(0, 1.0), (1000, 1.0), (64 * 1024 - 1, 1.0), (64 * 1024, 2.0), (400_411, 7.0), (1024 * 1024, 17.0)],
)
def test_a_request_costs_one_token_and_one_more_per_64_kib_of_manifest(manifest_bytes, cost):
    # issue 39: a burst of heavy manifests was admitted at the rate of light ones, hundreds at once
    assert quotas.request_cost(manifest_bytes) == cost
