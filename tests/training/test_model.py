"""The model: exact parameter counts, shapes, causality, z-loss."""

import pytest
import torch

from contracts.models import MODEL_SHAPES, ModelShape
from training.model import Transformer, check_shape, count_parameters

TINY = MODEL_SHAPES["tiny"]
TINY_GQA = ModelShape(n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=96, vocab_size=256, max_seq_len=64)


def built_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() de-duplicates tied weights


@pytest.mark.parametrize("shape", [TINY, TINY_GQA], ids=["tiny", "gqa"])
@pytest.mark.parametrize("tie", [False, True])
def test_count_parameters_matches_the_built_model(shape, tie):
    assert count_parameters(shape, tie_embeddings=tie) == built_count(Transformer(shape, tie_embeddings=tie))


def test_count_parameters_of_big_shapes_without_building_them():
    # Llama-3-8B is 8.03e9 parameters with this shape; QK-norm adds only 2*head_dim per layer.
    assert count_parameters(MODEL_SHAPES["8B"]) == pytest.approx(8.03e9, rel=0.002)
    assert count_parameters(MODEL_SHAPES["70B"]) == pytest.approx(70.55e9, rel=0.002)


def test_forward_shapes():
    torch.manual_seed(0)
    model = Transformer(TINY_GQA)
    idx = torch.randint(0, 256, (3, 17))
    logits, loss = model(idx)
    assert logits.shape == (3, 17, 256) and loss is None
    logits, loss = model(idx, idx)
    assert logits.shape == (3, 17, 256) and loss.shape == () and torch.isfinite(loss)
    # A fresh model predicts close to uniform over the 256 bytes.
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 0.5


def test_attention_is_causal():
    torch.manual_seed(0)
    model = Transformer(TINY)
    idx = torch.randint(0, 256, (1, 16))
    changed = idx.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.equal(a[:, 10:], b[:, 10:])


def test_z_loss_adds_to_the_loss():
    torch.manual_seed(0)
    plain = Transformer(TINY)
    with_z = Transformer(TINY, z_loss=1e-2)
    with_z.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 256, (2, 8))
    assert with_z(idx, idx)[1] > plain(idx, idx)[1]


def test_rope_base_override_changes_outputs():
    torch.manual_seed(0)
    a = Transformer(TINY)
    b = Transformer(TINY, rope_base=500_000.0)
    b.load_state_dict(a.state_dict())  # rope tables are not in the state dict
    idx = torch.randint(0, 256, (1, 32))
    assert not torch.equal(a(idx)[0], b(idx)[0])


def test_generate_appends_tokens():
    model = Transformer(TINY)
    out = model.generate(torch.zeros((1, 3), dtype=torch.long), max_new_tokens=5, temperature=0)
    assert out.shape == (1, 8)


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"n_head": 3}, "divisible by n_head"),
        ({"n_kv_head": 3}, "multiple of n_kv_head"),
        ({"d_model": 120, "n_head": 8}, "must be even"),  # head_dim 15
    ],
)
def test_bad_shapes_are_refused_in_a_sentence(fields, words):
    base = {
        "n_layer": 1,
        "d_model": 128,
        "n_head": 4,
        "n_kv_head": 4,
        "d_ff": 64,
        "vocab_size": 256,
        "max_seq_len": 8,
    }
    with pytest.raises(ValueError, match=words):
        check_shape(ModelShape(**(base | fields)))
