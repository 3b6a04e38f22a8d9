"""Hugging Face models in and out: tiny Llama (GQA, llama3 RoPE scaling, theta 500k), Qwen2 (q/k/v
biases, tied embeddings) and Qwen3 (QK-norm, head_dim != hidden / heads) checkpoints built with
transformers' own config classes load into the trainer's Transformer with transformers' logits
(max abs diff <= 1e-4 in fp32), and the trainer's exports load back into transformers with ours.
Norm weights and biases are randomized so a mapping or numerics slip cannot hide behind ones and
zeros. Nothing is downloaded."""

import hashlib
import json
import os
import stat

import msgspec
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from contracts.models import MODEL_SHAPES
from domain.model_shapes import count_parameters, family_of, shape_from_hf_config
from training.model import RMSNorm, Transformer, rope_inv_freq
from training.recipes.pretrain import build_model
from training.weights.hf_adapter import from_hf, to_hf
from training.weights.hf_export import ModelCard, write_hf_export
from training.weights.hf_load import load_hf_weights

transformers = pytest.importorskip("transformers")

TOL = 1e-4
VOCAB = 96
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,  # below the test's 40 tokens: the scaling matters
}


def hf_config(family: str):
    if family == "llama":
        return transformers.LlamaConfig(
            **COMMON, rms_norm_eps=1e-5, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False
        )
    if family == "qwen2":
        return transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
    return transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False)  # 32 != 64 / 4


def randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Norm weights around 1 and biases around 0, not exactly 1 and 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                centre = 0.0 if name.endswith("bias") else 1.0
                p.copy_(centre + 0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def hf_model(family: str):
    torch.manual_seed(0)
    return randomized(transformers.AutoModelForCausalLM.from_config(hf_config(family)))


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory):
    """(family, the transformers model, its save_pretrained directory)."""
    model = hf_model(request.param)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory, safe_serialization=True)
    return request.param, model, directory


def shape_of(directory):
    return shape_from_hf_config(json.loads((directory / "config.json").read_text())).shape


def ours_from(directory) -> Transformer:
    model = Transformer(shape_of(directory))
    load_hf_weights(model, directory)
    return model.eval()


@torch.no_grad()
def max_diff(hf, ours: Transformer, tokens: torch.Tensor) -> float:
    return (hf(tokens).logits - ours(tokens)[0]).abs().max().item()


TOKENS = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))


def test_rms_norm_matches_transformers_in_fp32():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    theirs, ours = LlamaRMSNorm(64, eps=1e-5), RMSNorm(64, eps=1e-5)
    randomized(theirs)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 7, 64) * 5
    assert (theirs(x) - ours(x)).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", ["llama", "linear"])
def test_rope_frequencies_are_transformers_own(family):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = (
        LLAMA3_ROPE if family == "llama" else {"rope_type": "linear", "rope_theta": 10_000.0, "factor": 4.0}
    )
    config = transformers.LlamaConfig(**COMMON, rope_parameters=rope)
    theirs, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu")
    shape = shape_from_hf_config(config.to_dict()).shape
    assert shape.rope_scaling is not None and shape.rope_scaling.kind == rope["rope_type"]
    ours = rope_inv_freq(16, shape.rope_base, shape.rope_scaling)
    assert torch.equal(ours, theirs.float())
    assert not torch.equal(ours, rope_inv_freq(16, shape.rope_base))  # the scaling did something


def test_a_hf_checkpoint_loads_with_transformers_logits(checkpoint):
    family, hf, directory = checkpoint
    ours = ours_from(directory)
    assert max_diff(hf, ours, TOKENS) <= TOL
    assert sum(p.numel() for p in ours.parameters()) == hf.num_parameters() == count_parameters(ours.shape)
    if family == "llama":  # without the llama3 scaling the same weights give other logits
        plain = Transformer(msgspec.structs.replace(ours.shape, rope_scaling=None))
        plain.load_state_dict(ours.state_dict())
        assert max_diff(hf, plain.eval(), TOKENS) > 1e-3
    if family == "qwen2":
        assert ours.lm_head.weight is ours.tok_emb.weight and ours.blocks[0].attn.wq.bias is not None
    if family == "qwen3":
        assert ours.blocks[0].attn.q_norm is not None and ours.blocks[0].attn.head_dim == 32
    else:
        assert not any("q_norm" in n or "k_norm" in n for n in ours.state_dict())


def test_the_adapter_round_trips(checkpoint):
    family, _, directory = checkpoint
    shape = shape_of(directory)
    hf_state = load_file(directory / "model.safetensors")
    back = to_hf(from_hf(hf_state, shape), shape)
    assert list(back) == list(hf_state) and all(back[k] is hf_state[k] for k in hf_state)
    ours = Transformer(shape).state_dict()
    assert from_hf(to_hf(ours, shape), shape).keys() == ours.keys()
    assert ("lm_head.weight" in hf_state) == (family != "qwen2")  # HF omits the tied head


def test_a_half_precision_checkpoint_loads_into_fp32_parameters(tmp_path):
    hf = hf_model("qwen3")
    hf.to(torch.bfloat16).save_pretrained(tmp_path, safe_serialization=True)
    ours = ours_from(tmp_path)
    assert ours.tok_emb.weight.dtype == torch.float32
    expected = hf.model.layers[1].self_attn.k_norm.weight.float()
    assert torch.equal(ours.blocks[1].attn.k_norm.weight, expected)


def test_a_sharded_checkpoint_loads(tmp_path):
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert max_diff(hf, ours_from(tmp_path), TOKENS) <= TOL


def test_build_model_starts_from_the_hf_weights(checkpoint):
    _, hf, directory = checkpoint
    model = build_model(shape_of(directory), seq_len=40, device=torch.device("cpu"), init_from_hf=directory)
    assert max_diff(hf, model.eval(), TOKENS) <= TOL


def rewrite(directory, change) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (
            lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.weight", torch.zeros(60, 64)),
            r"model\.layers\.0\.self_attn\.q_proj\.weight has shape \[60, 64\], but .* needs \[64, 64\]",
        ),
        (
            lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
            r"no tensor model\.layers\.1\.mlp\.up_proj\.weight",
        ),
        (
            lambda t: t.__setitem__("model.layers.0.self_attn.o_proj.bias", torch.zeros(64)),
            r"o_proj\.bias has no place",
        ),
    ],
    ids=["wrong-shape", "missing", "foreign"],
)
def test_a_checkpoint_that_does_not_fit_is_refused_in_a_sentence(tmp_path, change, says):
    hf_model("llama").save_pretrained(tmp_path, safe_serialization=True)
    rewrite(tmp_path, change)
    model = Transformer(shape_of(tmp_path))
    before = model.state_dict()["blocks.0.attn.wq.weight"].clone()
    with pytest.raises(ValueError, match=says):
        load_hf_weights(model, tmp_path)
    assert torch.equal(model.state_dict()["blocks.0.attn.wq.weight"], before)  # nothing loaded


CARD = ModelCard(
    run_id="run-42",
    manifest_digest="sha256:" + "ab" * 32,
    stage="sft",
    step=7,
    base_model="tiny-base",
    base_digest="sha256:" + "cd" * 32,
    data={"chat": "sha256:" + "ef" * 32},
    gates=[("sft", True, "held-out loss 1.23 <= 2.0")],
)


def exported_logits_match(ours: Transformer, out, **kwargs) -> list:
    files = write_hf_export(ours.state_dict(), ours.shape, out, card=CARD, **kwargs)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert max_diff(theirs, ours, TOKENS % ours.shape.vocab_size) <= TOL
    return files


def test_an_export_loads_in_transformers_with_our_logits(checkpoint, tmp_path):
    family, _, directory = checkpoint
    ours = randomized(ours_from(directory), seed=3)  # trained weights differ from the base's
    files = exported_logits_match(ours, tmp_path / "export", family=family, eos_token_id=2)
    names = [f.path for f in files]
    assert names == sorted(names) and "model.safetensors" in names
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["model_type"] == family and config["eos_token_id"] == 2


def test_a_from_scratch_size_table_model_exports_as_qwen3_in_shards(tmp_path):
    shape = MODEL_SHAPES["tiny"]
    assert family_of(shape) == "qwen3"
    torch.manual_seed(0)
    ours = randomized(Transformer(shape))
    tokenizer = {"tokenizer.json": b'{"version": "1.0"}', "tokenizer_config.json": b"{}"}
    out = tmp_path / "export"
    files = exported_logits_match(ours, out, max_shard_bytes=200_000, tokenizer_files=tokenizer)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert index["metadata"]["total_size"] == 4 * count_parameters(shape)
    assert set(index["weight_map"]) == set(to_hf(ours.state_dict(), shape))
    for shard in shards:
        with safe_open(out / shard, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
    assert (out / "tokenizer.json").read_bytes() == tokenizer["tokenizer.json"]
    names = {f.path for f in files}
    assert names == {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "README.md", *tokenizer, *shards} <= names
    for f in files:
        path = out / f.path
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert f.bytes == path.stat().st_size and f.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert not [p for p in tmp_path.iterdir() if p.name != "export"]  # no temporary left behind


def test_the_model_card_says_where_the_model_came_from(tmp_path):
    torch.manual_seed(0)
    ours = Transformer(MODEL_SHAPES["tiny"])
    write_hf_export(ours.state_dict(), ours.shape, tmp_path / "e", card=CARD)
    card = (tmp_path / "e" / "README.md").read_text()
    front = card.split("---\n")[1]
    assert "library_name: transformers" in front and 'base_model: "tiny-base"' in front
    assert "tags:\n- ito-training" in front
    for words in ("run-42", CARD.manifest_digest, "sft, step 7", CARD.base_digest, "chat", "ef" * 32):
        assert words in card
    assert "sft: passed: held-out loss 1.23 <= 2.0" in card


def test_an_export_of_the_wrong_family_or_a_partial_state_is_refused(tmp_path):
    ours = Transformer(MODEL_SHAPES["tiny"])
    with pytest.raises(ValueError, match="llama model cannot reproduce this shape"):
        write_hf_export(ours.state_dict(), ours.shape, tmp_path / "a", family="llama")
    state = ours.state_dict()
    state.pop("blocks.1.mlp.w_up.weight")
    with pytest.raises(ValueError, match=r"no tensor for model\.layers\.1\.mlp\.up_proj\.weight"):
        write_hf_export(state, ours.shape, tmp_path / "b")
    assert not list(tmp_path.iterdir())
