"""Base models and data files through the real CLIs: the operator stores a checkpoint with
`ito-training models add`, the account sees it with `ecc ito models` (another account does not),
and `ecc ito plan` / `ecc ito confirm` refuse a digest mismatch, an unsupported architecture, a
tokenizer that does not fit the embeddings and a data file with the wrong schema, each with its
stable code and the field path, and nothing reserved."""

import hashlib
import json
import uuid

import pytest

from tests.hf_checkpoints import save_tiny

pytestmark = pytest.mark.e2e


def code(out):
    assert out["ok"] is False, out
    return out["error"]["code"]


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path.chmod(0o644)
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def test_models_are_listed_per_account_and_bad_inputs_are_refused_at_plan_time(stack, manifest, tmp_path):
    account, _, env = stack.account()
    _other, _, other_env = stack.account()
    tag = uuid.uuid4().hex[:6]
    llama = stack.ito(
        "models", "add", str(save_tiny(tmp_path / "llama")), "--name", f"llama-{tag}", "--account", account
    )
    small = stack.ito(  # its tokenizer has 300 tokens, its embeddings 200 rows
        "models",
        "add",
        str(save_tiny(tmp_path / "small", vocab_size=200)),
        "--name",
        f"small-{tag}",
        "--account",
        account,
    )
    qwen = stack.ito("models", "add", str(save_tiny(tmp_path / "qwen", "qwen2")), "--name", f"qwen-{tag}")
    again = stack.ito(
        "models", "add", str(tmp_path / "llama"), "--name", f"llama-{tag}", "--account", account
    )
    assert again["digest"] == llama["digest"]  # the same content again is the same entry
    gelu = tmp_path / "gelu"
    save_tiny(gelu)
    config = json.loads((gelu / "config.json").read_text())
    (gelu / "config.json").write_text(json.dumps(config | {"hidden_act": "gelu"}))
    refused_add = stack.run("ito-training", "models", "add", str(gelu), "--name", f"gelu-{tag}")
    assert refused_add.returncode == 1 and "hidden_act" in refused_add.stderr

    rc, listed = stack.ecc("models", env=env)
    assert rc == 0, listed
    mine = {m["name"]: m for m in listed["data"]["models"]}
    assert mine[f"llama-{tag}"]["digest"] == llama["digest"] and mine[f"llama-{tag}"]["tokenizer"] is True
    assert mine[f"llama-{tag}"]["parameters"] == llama["model"]["parameters"]
    assert f"qwen-{tag}" in mine and f"gelu-{tag}" not in mine  # every account's; refused at add
    rc, theirs = stack.ecc("models", env=other_env)
    assert rc == 0 and {m["name"] for m in theirs["data"]["models"]} & set(mine) == {f"qwen-{tag}"}

    chat = stack.file_root(account) / "chat.jsonl"  # file: refs name the account's own root
    chat_digest = jsonl(
        chat,
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}] * 4,
    )
    prefs = stack.file_root(account) / "prefs.jsonl"
    prefs_digest = jsonl(prefs, [{"prompt": "2+2?", "chosen": "4", "rejected": "5"}] * 4)
    deco = {"method": "13-gram", "against": [], "provenance": "test"}

    def finetune(model_name, revision, data_path=chat, data_digest=chat_digest):
        return manifest(
            model={"base": model_name, "revision": revision},
            data=[
                {
                    "name": "chat",
                    "source": f"file:{data_path}",
                    "digest": data_digest,
                    "decontamination": deco,
                }
            ],
            stages={"pretrain": None},
            post_training={"recipe": ["sft"], "sft": {"data": ["chat"], "steps": 2, "batch_size": 2}},
        )

    booking = stack.booking(account)
    good = finetune(f"llama-{tag}", llama["digest"])
    rc, planned = stack.ecc("plan", "--booking", booking, "--manifest", str(good), env=env)
    assert rc == 0, planned
    assert planned["data"]["cost"]["parameters"] == llama["model"]["parameters"]  # the exact count
    rc, confirmed = stack.ecc(
        "confirm", "--action", "train", "--booking", booking, "--manifest", str(good), env=env
    )
    assert rc == 0, confirmed
    ref = confirmed["data"]["confirmation_ref"]

    stored_qwen = stack.settings.model_store / qwen["digest"].removeprefix("sha256:") / "config.json"
    stored_qwen.write_text(json.dumps(json.loads(stored_qwen.read_text()) | {"hidden_act": "gelu"}))
    cases = [
        (finetune(f"llama-{tag}", "sha256:" + "0" * 64), "model_digest_mismatch", "model.revision: "),
        (finetune(f"nope-{tag}", llama["digest"]), "model_not_found", "model.base: "),
        (finetune(f"qwen-{tag}", qwen["digest"]), "model_unsupported", "model.base: "),
        (finetune(f"small-{tag}", small["digest"]), "tokenizer_mismatch", "model.tokenizer: "),
        (
            finetune(f"llama-{tag}", llama["digest"], prefs, prefs_digest),
            "data_schema_invalid",
            "data[0]: sft reads",
        ),
        (
            finetune(f"llama-{tag}", llama["digest"], chat, prefs_digest),
            "data_digest_mismatch",
            "data[0].digest: ",
        ),
    ]
    for bad, expected, field in cases:
        for verb in (["plan"], ["confirm", "--action", "train"]):
            rc, out = stack.ecc(*verb, "--booking", booking, "--manifest", str(bad), env=env)
            assert rc == 1 and code(out) == expected and out["error"]["message"].startswith(field), (
                verb,
                out,
            )
        key = f"bad-{expected}-{tag}"
        rc, out = stack.ecc(
            "train",
            "--booking",
            booking,
            "--manifest",
            str(bad),
            "--confirmation-ref",
            ref,
            "--idempotency-key",
            key,
            env=env,
        )
        assert code(out) == expected, out
        rc, out = stack.ecc("status", "--idempotency-key", key, env=env)
        assert code(out) == "run_not_found"  # nothing reserved
    rc, listed = stack.ecc("models", env=other_env)
    assert f"llama-{tag}" not in {m["name"] for m in listed["data"]["models"]}
    other_booking = stack.booking(_other)
    rc, out = stack.ecc("plan", "--booking", other_booking, "--manifest", str(good), env=other_env)
    assert code(out) == "model_not_found" and out["error"]["message"].startswith("model.base: ")
    rc, out = stack.ecc(
        "train",
        "--booking",
        booking,
        "--manifest",
        str(good),
        "--confirmation-ref",
        ref,
        "--idempotency-key",
        f"good-{tag}",
        env=env,
    )
    assert rc == 0, out  # the confirmation the refused requests carried was not consumed
    assert stack.ecc("status", "--idempotency-key", f"good-{tag}", env=env)[0] == 0
