"""`ito-training`'s command table (services/ops/main.py): every command the parser knows is either
handled before the settings are resolved (serve, manifest-schema) or has exactly one entry."""

from services.ops import main
from services.runtime.settings import ENV_DATA_DIR, ENV_SECRETS_DIR

BEFORE_SETTINGS = {"serve", "manifest-schema"}


def parser_commands() -> set[str]:
    return set(main.parser()._subparsers._group_actions[0].choices)


def test_every_command_has_one_handler():
    assert set(main.COMMANDS) | BEFORE_SETTINGS == parser_commands()
    assert not set(main.COMMANDS) & BEFORE_SETTINGS


def test_a_failing_command_prints_one_line_and_exits_1(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(ENV_DATA_DIR, str(tmp_path))
    monkeypatch.setenv(ENV_SECRETS_DIR, str(tmp_path / "secrets"))
    assert main.main(["up", "--services", "nope"]) == 1
    assert capsys.readouterr().err == (
        "ito-training up: --services takes names from " + ", ".join(main.SERVICES) + "\n"
    )
