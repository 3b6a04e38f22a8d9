"""`ecc`'s verb table (ecc/verbs.py): every verb the parser knows has exactly one handler, and
without a stored login every verb but login/logout answers `unauthenticated` without a call; a
terminal's metrics curve reads the whole run, page by bounded page."""

import argparse
import asyncio
from datetime import UTC, datetime

import msgspec
import pytest

from contracts.api import MetricsRequest
from contracts.envelope import Envelope
from contracts.errors import ErrorCode
from contracts.runs import Metrics, MetricsPage
from ecc import credentials, verbs
from ecc.main import parser
from ecc.transport import local_error
from tests.ecc.test_ecc_timeouts import VERBS

AT = datetime(2026, 12, 2, tzinfo=UTC)


def parser_verbs() -> set[str]:
    ito = parser()._subparsers._group_actions[0].choices["ito"]
    return set(ito._subparsers._group_actions[0].choices)


def test_every_parsed_verb_has_one_handler():
    assert parser_verbs() == set(VERBS)
    assert not set(verbs.WITHOUT_LOGIN) & set(verbs.LOGGED_IN)
    assert set(verbs.WITHOUT_LOGIN) | set(verbs.LOGGED_IN) == parser_verbs()


@pytest.mark.parametrize("verb", sorted(verbs.LOGGED_IN))
def test_without_a_login_nothing_is_called(verb, tmp_path, monkeypatch):
    monkeypatch.setenv(credentials.ENV_CONFIG_DIR, str(tmp_path))
    env = verbs.run_verb(parser().parse_args(["ito", verb, *VERBS[verb]]))
    assert not env.ok and not env.live_api_contacted
    assert env.error is not None and env.error.code == ErrorCode.unauthenticated


def test_logout_without_a_login_says_nothing_was_removed(tmp_path, monkeypatch):
    monkeypatch.setenv(credentials.ENV_CONFIG_DIR, str(tmp_path))
    env = verbs.run_verb(parser().parse_args(["ito", "logout"]))
    assert env.ok and msgspec.to_builtins(env.data) == {"logged_out": False}


def _page(since: int, n: int) -> MetricsPage:
    points = [
        Metrics(
            run_id="run-1",
            seq=i,
            at=AT,
            stage="pretrain",
            step=i,
            total_steps=5000,
            loss=2.0,
            learning_rate=1e-3,
            tokens_per_s=1.0,
            grad_norm=1.0,
        )
        for i in range(since, since + n)
    ]
    return MetricsPage(run_id="run-1", points=points, next=since + n)


def _pages(monkeypatch, sizes: list[int | None]) -> list[int]:
    """`_read` answering metrics pages of these sizes (None: a timeout); the `since` of each call."""
    asked: list[int] = []

    async def read(args, endpoint, request):
        asked.append(request.since)
        n = sizes[len(asked) - 1]
        if n is None:
            return local_error(ErrorCode.timeout, "no answer in time", contacted=True)
        return Envelope(ok=True, live_api_contacted=True, notice=None, data=_page(request.since, n))

    monkeypatch.setattr(verbs, "_read", read)
    return asked


ARGS = argparse.Namespace(json=False, connect_timeout=1.0, timeout=1.0)


def test_a_terminals_curve_reads_every_page_not_only_the_first(monkeypatch):
    asked = _pages(monkeypatch, [1000, 1000, 7])
    env = asyncio.run(verbs._chart_points(ARGS, MetricsRequest(run_id="run-1", since=5)))
    assert asked == [5, 1005, 2005]
    assert env.ok and env.notice is None
    assert [p.step for p in env.data.points] == list(range(5, 2012)) and env.data.next == 2012


def test_a_terminals_curve_is_bounded_and_says_where_the_rest_starts(monkeypatch):
    asked = _pages(monkeypatch, [1000] * (verbs.CHART_PAGES + 1))
    env = asyncio.run(verbs._chart_points(ARGS, MetricsRequest(run_id="run-1")))
    assert len(asked) == verbs.CHART_PAGES and len(env.data.points) == 1000 * verbs.CHART_PAGES
    assert env.notice == "the first 20000 points from 0; `--since 20000` shows any after them"


def test_a_lost_page_is_the_answer(monkeypatch):
    _pages(monkeypatch, [1000, None])
    env = asyncio.run(verbs._chart_points(ARGS, MetricsRequest(run_id="run-1")))
    assert not env.ok and env.error.code == ErrorCode.timeout


def test_runs_states_are_the_contracts_states():
    from contracts.states import RunState
    from ecc.main import RUN_STATES

    assert RUN_STATES == [s.value for s in RunState]


@pytest.mark.parametrize("limit", ["0", "101"])
def test_runs_bounds_are_checked_before_anything_is_sent(limit, tmp_path, monkeypatch):
    monkeypatch.setenv(credentials.ENV_CONFIG_DIR, str(tmp_path))
    credentials.save("acme", "ito_sk_SUAFAKESEEDFORTESTSONLYNOTAREALKEY0000000000000000000000")

    def sent(*args):
        raise AssertionError("runs was sent")

    monkeypatch.setattr(verbs, "_run", sent)
    env = verbs.run_verb(parser().parse_args(["ito", "runs", "--limit", limit]))
    assert not env.ok and not env.live_api_contacted
    assert (
        env.error is not None and env.error.code == ErrorCode.request_invalid and "limit" in env.error.message
    )


def test_runs_sends_the_filters_it_was_given(tmp_path, monkeypatch):
    from contracts.api import RunsRequest
    from contracts.states import RunState

    monkeypatch.setenv(credentials.ENV_CONFIG_DIR, str(tmp_path))
    credentials.save("acme", "ito_sk_SUAFAKESEEDFORTESTSONLYNOTAREALKEY0000000000000000000000")
    asked = []
    monkeypatch.setattr(verbs, "_run", lambda verb, request, args: asked.append((verb, request)) or None)
    verbs.run_verb(parser().parse_args(["ito", "runs"]))
    verbs.run_verb(
        parser().parse_args(["ito", "runs", "--state", "running", "--booking", "b", "--cursor", "1.5:r"])
    )
    assert asked == [
        ("runs", RunsRequest()),
        ("runs", RunsRequest(state=RunState.running, booking_id="b", cursor="1.5:r")),
    ]
