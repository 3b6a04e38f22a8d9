"""The model store on a real filesystem: what `add` accepts and refuses, the digest, re-adds,
names and accounts, and `verify` finding a tampered file."""

import json
import shutil

import pytest

from runtime.storage.model_store import ModelStore, ModelStoreError, content_digest
from tests.hf_checkpoints import save_tiny, train_tokenizer


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {"llama": save_tiny(root / "llama"), "qwen2": save_tiny(root / "qwen2", "qwen2", tie=True)}


@pytest.fixture
def checkpoint(built, tmp_path):
    """A fresh copy of the tiny Llama that the test may change."""
    return pathlib_copy(built["llama"], tmp_path / "llama")


def pathlib_copy(src, dest):
    shutil.copytree(src, dest)
    return dest


@pytest.mark.parametrize(
    "family, architecture", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")]
)
def test_add_records_the_shape_the_tokenizer_and_the_exact_parameter_count(
    built, tmp_path, family, architecture
):
    import torch
    from safetensors.torch import load_file

    store = ModelStore(tmp_path / "store")
    entry = store.add(built[family], "tiny", [])
    assert entry.family == family and entry.architecture == architecture
    assert entry.digest.startswith("sha256:") and len(entry.digest) == 71
    assert entry.tokenizer_vocab == 300 and entry.chat_template and entry.eos_token == "<|endoftext|>"
    weights = load_file(built[family] / "model.safetensors")
    assert entry.parameters == sum(t.numel() for t in weights.values())  # a tied head is saved once
    assert all(t.dtype == torch.float32 for t in weights.values())
    assert store.path(entry.digest).is_dir() and (store.path(entry.digest) / "config.json").is_file()
    assert (store.path(entry.digest).stat().st_mode & 0o777) == 0o700
    assert ((store.path(entry.digest) / "model.safetensors").stat().st_mode & 0o777) == 0o600
    store.verify(entry.digest)


def test_the_digest_is_stable_and_the_same_content_is_one_entry(checkpoint, tmp_path):
    store = ModelStore(tmp_path / "store")
    first = store.add(checkpoint, "a", [])
    copy = pathlib_copy(checkpoint, tmp_path / "elsewhere")
    again = store.add(copy, "b", ["acme"])
    assert again.digest == first.digest
    assert [p.name for p in store.root.iterdir() if len(p.name) == 64] == [
        first.digest.removeprefix("sha256:")
    ]
    assert [m.name for m in store.list("acme")] == ["a", "b"]
    assert [m.name for m in store.list("other")] == ["a"]  # "b" is acme's only
    assert store.resolve("b", "other") is None and store.resolve("b", "acme").accounts == ["acme"]
    assert content_digest(store.record(first.digest).files) == first.digest
    (checkpoint / "README.md").write_text("one more file")
    assert store.add(checkpoint, "a", []).digest != first.digest  # other content: another digest


def test_verify_finds_a_tampered_file(checkpoint, tmp_path):
    store = ModelStore(tmp_path / "store")
    entry = store.add(checkpoint, "m", [])
    config = store.path(entry.digest) / "config.json"
    config.write_text(config.read_text().replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e-05'))
    with pytest.raises(ModelStoreError, match=r"config.json .* changed"):
        store.verify(entry.digest)


def test_a_symlink_is_refused(checkpoint, tmp_path):
    (tmp_path / "outside.txt").write_text("not the model's")
    (checkpoint / "notes.txt").symlink_to(tmp_path / "outside.txt")
    with pytest.raises(ModelStoreError, match=r"notes\.txt is a symlink"):
        ModelStore(tmp_path / "store").add(checkpoint, "m", [])
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").glob("[0-9a-f]*"))


@pytest.mark.parametrize(
    "change, key",
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}},
            "rope_parameters.rope_type",
        ),
    ],
)
def test_an_unsupported_config_is_refused_naming_the_key(checkpoint, tmp_path, change, key):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(ModelStoreError) as refused:
        ModelStore(tmp_path / "store").add(checkpoint, "m", [])
    assert refused.value.key == key and key in str(refused.value)


def test_a_wrong_tensor_shape_is_refused(checkpoint, tmp_path):
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(config | {"intermediate_size": 96}))
    with pytest.raises(
        ModelStoreError,
        match=r"tensor model.layers.0.mlp.\w+_proj.weight has shape \[\d+, \d+\]; config.json implies \[\d+, \d+\]",
    ):
        ModelStore(tmp_path / "store").add(checkpoint, "m", [])


def test_missing_weights_or_config_are_refused(checkpoint, tmp_path):
    store = ModelStore(tmp_path / "store")
    (checkpoint / "model.safetensors").rename(tmp_path / "away.safetensors")
    with pytest.raises(ModelStoreError, match="no weights"):
        store.add(checkpoint, "m", [])
    (checkpoint / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}})
    )
    with pytest.raises(ModelStoreError, match=r"shard 'model-00001-of-00002\.safetensors'"):
        store.add(checkpoint, "m", [])
    (checkpoint / "config.json").unlink()
    with pytest.raises(ModelStoreError, match=r"no config\.json"):
        store.add(checkpoint, "m", [])


def test_a_sharded_checkpoint_is_read_through_its_index(checkpoint, tmp_path):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(checkpoint)
    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    entry = ModelStore(tmp_path / "store").add(sharded, "m", [])
    assert entry.parameters == sum(p.numel() for p in model.parameters())


def test_a_tokenizer_directory_is_stored_by_the_digest_of_its_files(tmp_path):
    store = ModelStore(tmp_path / "store")
    tok = store.add_tokenizer(train_tokenizer(tmp_path / "tok", 280))
    assert tok.vocab == 280 and tok.chat_template
    assert (store.tokenizer_path(tok.digest) / "tokenizer.json").is_file()
    assert store.tokenizer(tok.digest) == tok
    assert store.add_tokenizer(tmp_path / "tok").digest == tok.digest
    assert store.tokenizer("sha256:" + "0" * 64) is None and store.tokenizer("nonsense") is None


def test_a_name_a_manifest_cannot_spell_is_refused(checkpoint, tmp_path):
    with pytest.raises(ModelStoreError, match="name 'has space'"):
        ModelStore(tmp_path / "store").add(checkpoint, "has space", [])
    assert ModelStore(tmp_path / "store").add(checkpoint, "org/Model-1.5B_v2", []).name == "org/Model-1.5B_v2"


# --- a tenant's own models (issue 39: only the operator could put a model in) ---


def test_a_tenants_own_model_is_its_own(checkpoint, tmp_path):
    store = ModelStore(tmp_path / "store")
    shared = store.add(checkpoint, "tiny", [])
    mine = store.add(checkpoint, "mine", owner="acme")
    assert mine.digest == shared.digest  # the same content is one entry on disk
    assert store.resolve("mine", "acme") is not None
    assert store.resolve("mine", "rival") is None  # the same answer as a name nobody has
    assert store.resolve("@acme/mine", "rival") is None and store.resolve("@acme/mine", "acme") is None
    assert [m.name for m in store.list("acme")] == ["mine", "tiny"]
    assert [m.name for m in store.list("rival")] == ["tiny"]
    assert "@acme/mine" in {m.name for m in store.list()}  # the operator's view


def test_the_same_name_in_two_accounts_is_two_models_and_an_own_name_hides_a_shared_one(built, tmp_path):
    store = ModelStore(tmp_path / "store")
    store.add(built["qwen2"], "tiny", [])
    a = store.add(built["llama"], "tiny", owner="acme")
    b = store.add(built["qwen2"], "tiny", owner="rival")
    assert store.resolve("tiny", "acme").digest == a.digest
    assert store.resolve("tiny", "rival").digest == b.digest
    assert store.resolve("tiny", "third").family == "qwen2"


def test_a_runs_stage_is_a_name_only_an_account_may_hold(checkpoint, tmp_path):
    store = ModelStore(tmp_path / "store")
    name = "run:run_" + "ab" * 12 + "/sft"
    with pytest.raises(ModelStoreError, match="use 1-256 letters"):
        store.add(checkpoint, name, [])
    entry = store.add(checkpoint, name, owner="acme")
    assert store.resolve(name, "acme") == entry and store.resolve(name, "rival") is None


def test_an_exports_control_files_are_not_the_models(checkpoint, tmp_path):
    (checkpoint / "EXPORT.json").write_text("{}")
    store = ModelStore(tmp_path / "store")
    entry = store.add(checkpoint, "x", owner="acme", ignore=("EXPORT.json",), link=True)
    assert not (store.path(entry.digest) / "EXPORT.json").exists()
    store.verify(entry.digest)
