"""The phases of a py-spy sample (bench/cpu_profile.py), as a table."""

import pytest

from bench.cpu_profile import breakdown, phase_of

LOOP = ["run (asyncio/runners.py:190)", "BaseEventLoop._run_once (asyncio/base_events.py:1922)"]
ANSWER = [
    "serve.<locals>.one (runtime/messaging/bus.py:177)",
    "answer_coded (runtime/messaging/codec.py:122)",
]


@pytest.mark.parametrize(
    ("frames", "phase"),
    [
        (LOOP, "event loop"),
        ([*LOOP, "_SelectorSocketTransport._read_ready (asyncio/selector_events.py:952)"], "event loop"),
        (LOOP + ANSWER, "decode/encode"),  # msgspec runs in C: its time is the codec's line
        (
            LOOP
            + ANSWER
            + ["Api._run_quota (services/scheduler/api.py:184)"]
            + ["Retry.call_with_retry (redis/asyncio/retry.py:69)", "wait_for (asyncio/tasks.py:479)"],
            "redis client",  # the innermost frame with a phase wins, not the loop under the client
        ),
        ([*LOOP, "Verifier.valid (runtime/security/order_signatures.py:55)"], "signatures"),
        (
            [
                *LOOP,
                "Auditor.publish (services/scheduler/audit.py:90)",
                "Client.publish (nats/aio/client.py:1)",
            ],
            "nats client",
        ),
        ([*LOOP, "Auditor.publish (services/scheduler/audit.py:90)"], "audit"),
        ([*LOOP, "Api._create (services/scheduler/api.py:370)"], "scheduler/api.py"),  # ours, unnamed
        (
            [*LOOP, "plan (services/scheduler/planning.py:80)", "Logger.info (logging/__init__.py:1)"],
            "logging",
        ),
        (
            ["main (services/ledger/app.py:90)", *LOOP, "EpollSelector.select (selectors.py:468)"],
            "event loop",
        ),
        (
            [
                "main (services/ledger/app.py:90)",
                *LOOP,
                "Handle._run (asyncio/events.py:80)",
                "Future.set_result (asyncio/futures.py:1)",
            ],
            "event loop",  # the service's entry point is every sample's root, not a phase
        ),
        (["frozen (<frozen importlib._bootstrap>:1)"], "other"),
        ([], "other"),
    ],
)
def test_a_sample_goes_to_its_innermost_phase(frames, phase):
    assert phase_of(frames) == phase


def test_the_shares_add_up_and_come_largest_first():
    raw = [
        ";".join(LOOP) + " 30",
        ";".join(LOOP + ANSWER) + " 60",
        ";".join([*LOOP, "Verifier.valid (runtime/security/order_signatures.py:55)"]) + " 10",
        "not a sample line",
    ]
    samples, shares = breakdown(raw)
    assert samples == 100
    assert list(shares.items()) == [("decode/encode", 0.6), ("event loop", 0.3), ("signatures", 0.1)]
