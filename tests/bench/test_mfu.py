"""bench/mfu.py's arithmetic as a table, worked by hand: 6N + 12·L·d_attn·T, with d_attn =
n_head x head_dim (not d_model: issue 40 found the bench used d_model where a shape sets head_dim),
and the causal figure that counts attention at half."""

import pytest

from bench import mfu
from contracts.models import ModelShape
from domain.model_shapes import count_parameters

# One layer, d_model 8, two heads of 16 over one KV head, no QK-norm: by hand, per layer wq 8x32,
# wk 8x16, wv 8x16, wo 32x8, SwiGLU 3x8x16, two norms of 8 = 1,168; final norm 8; head 10x8 = 80;
# the embedding's 80 is a lookup. N = 1,256; d_attn = 32 while d_model = 8.
WIDE_HEADS = ModelShape(
    n_layer=1,
    d_model=8,
    n_head=2,
    n_kv_head=1,
    head_dim=16,
    d_ff=16,
    vocab_size=10,
    max_seq_len=8,
    qk_norm=False,
)
TIED = ModelShape(
    n_layer=1,
    d_model=8,
    n_head=2,
    n_kv_head=1,
    head_dim=16,
    d_ff=16,
    vocab_size=10,
    max_seq_len=8,
    qk_norm=False,
    tie_embeddings=True,
)
PLAIN = ModelShape(
    n_layer=2, d_model=8, n_head=2, n_kv_head=2, d_ff=16, vocab_size=10, max_seq_len=8, qk_norm=False
)


@pytest.mark.parametrize(
    ("shape", "seq_len", "n", "d_attn", "per_token", "causal"),
    [
        # 6 x 1,256 = 7,536; attention 12 x 1 x 32 x 4 = 1,536 (d_model would give 384)
        (WIDE_HEADS, 4, 1256, 32, 7536 + 1536, 7536 + 768),
        # tied: the head is the embedding table, multiplied once: N is every parameter (1,256)
        (TIED, 4, 1256, 32, 7536 + 1536, 7536 + 768),
        # head_dim None: d_attn = d_model = 8; per layer 4x64 + 384 + 16 = 656, x2 + 8 + 80 = 1,400
        (PLAIN, 8, 1400, 8, 8400 + 12 * 2 * 8 * 8, 8400 + 6 * 2 * 8 * 8),
    ],
)
def test_flops_per_token(shape, seq_len, n, d_attn, per_token, causal):
    f = mfu.flops(shape, seq_len)
    assert (f.matmul_params, f.attention_width, f.per_token, f.per_token_causal) == (
        n,
        d_attn,
        per_token,
        causal,
    )


def test_the_hand_counts_are_the_models():
    """The table's N agrees with the trainer's own parameter count (the embedding aside)."""
    assert count_parameters(WIDE_HEADS) - 80 == 1256 and count_parameters(TIED) == 1256
    assert count_parameters(PLAIN) - 80 == 1400


@pytest.mark.parametrize(
    ("flops_per_token", "tokens_per_s", "peak", "expected"),
    [
        (6_000_000_000, 50_000.0, 989.0, 300.0 / 989.0),  # 6 GFLOP x 50k tok/s = 300 TFLOPS
        (6_000_000_000, 50_000.0, None, None),  # the CPU, an unknown GPU: no peak, no MFU
        (1_000_000, 0.0, 312.0, 0.0),
    ],
)
def test_mfu(flops_per_token, tokens_per_s, peak, expected):
    value = mfu.mfu(flops_per_token, tokens_per_s, peak)
    assert value == pytest.approx(expected) if expected is not None else value is None
