"""A Hugging Face checkpoint loads into a sharded model on 2 ranks (torchrun, CPU, gloo) through
DCP's HuggingFaceStorageReader: every rank's local shard is exactly its slice of the checkpoint's
tensor (no rank holds the whole model), and the sharded model's logits are transformers'. The
checkpoint is a tied Qwen2 (q/k/v biases) with an odd vocabulary (uneven FSDP shards), saved in
several safetensors shards with an index."""

import json
from pathlib import Path

import pytest
import torch

from tests.distributed import torchrun

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.distributed

PROBE = Path(__file__).with_name("hf_sharded_probe.py")
VOCAB = 97  # odd: FSDP2's shards of the embedding are 49 and 48 rows


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(directory, the tokens, transformers' logits on them)."""
    config = transformers.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norms and biases away from 1 and 0, so a slip shows
                p.copy_((0.0 if name.endswith("bias") else 1.0) + 0.3 * torch.randn(p.shape, generator=g))
    directory = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(directory, safe_serialization=True, max_shard_size="40KB")
    assert len(list(directory.glob("*.safetensors"))) >= 2
    tokens = torch.randint(0, VOCAB, (2, 24), generator=g)
    with torch.no_grad():
        logits = model(tokens).logits
    return directory, tokens, logits


@pytest.mark.parametrize(
    ("strategy", "degrees"),
    [("manual", {}), ("fsdp2+tp", {"dp_shard": 1, "tp": 2})],
    ids=["fsdp2-by-hand", "tp-via-build_model"],
)
def test_two_ranks_load_only_their_shards_and_give_transformers_logits(
    checkpoint, tmp_path, strategy, degrees
):
    directory, tokens, expected = checkpoint
    torch.save(tokens, tmp_path / "tokens.pt")
    result = torchrun.launch([str(PROBE), str(directory), str(tmp_path), strategy, json.dumps(degrees)], 2)
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in range(2):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["mismatch"] == [], report
        assert report["tied"] is True
        assert report["local"] < report["whole"]  # a share, not a copy of the whole model
        if strategy == "manual":
            assert report["plain"] == []  # every parameter sharded
        else:
            assert "blocks.0.attn.wq.bias" in report["sharded"]  # colwise splits the biases too
        logits = torch.load(tmp_path / f"logits{rank}.pt")
        assert (logits - expected).abs().max().item() <= 1e-4
