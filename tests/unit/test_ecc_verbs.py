"""`ecc`'s verb table (ecc/verbs.py): every verb the parser knows has exactly one handler, and
without a stored login every verb but login/logout answers `unauthenticated` without a call."""

import msgspec
import pytest

from contracts.errors import ErrorCode
from ecc import credentials, verbs
from ecc.main import parser
from tests.unit.test_ecc_timeouts import VERBS


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
