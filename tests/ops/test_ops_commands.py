"""`ito-training`'s command table (ops/main.py): every command the parser knows is either
handled before the settings are resolved (serve, manifest-schema) or has exactly one entry."""

from ops import main
from runtime.configuration.settings import ENV_DATA_DIR, ENV_SECRETS_DIR

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


def test_models_add_prints_the_digest_and_models_list_shows_it(tmp_path, monkeypatch, capsys):
    import json

    from tests.hf_checkpoints import save_tiny, train_tokenizer

    monkeypatch.setenv(ENV_DATA_DIR, str(tmp_path / "data"))
    monkeypatch.setenv(ENV_SECRETS_DIR, str(tmp_path / "secrets"))
    checkpoint = save_tiny(tmp_path / "tiny-llama")
    assert main.main(["models", "add", str(checkpoint), "--account", "acme", "--json"]) == 0
    added = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert added["digest"].startswith("sha256:") and added["model"]["name"] == "tiny-llama"
    assert added["model"]["accounts"] == ["acme"]
    assert (tmp_path / "data" / "models" / added["digest"].removeprefix("sha256:") / "MODEL.json").is_file()
    assert main.main(["models", "list"]) == 0
    assert capsys.readouterr().out.startswith(f"tiny-llama: {added['digest']} (LlamaForCausalLM,")
    assert main.main(["models", "add", str(train_tokenizer(tmp_path / "tok", 280)), "--json"]) == 0
    tok = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert tok["tokenizer"]["vocab"] == 280 and tok["digest"].startswith("sha256:")
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert main.main(["models", "add", str(checkpoint)]) == 1
    assert "model_type" in capsys.readouterr().err
