"""FLOPs per token and model FLOPs utilisation: the arithmetic `bench/gpu.py` reports, as pure
functions (tested as a table in tests/bench/test_mfu.py).

The convention (PaLM appendix B; nanoGPT's `estimate_mfu`; torchtitan's `get_num_flop_per_token`):

    flops_per_token = 6 * N + 12 * n_layer * d_attn * seq_len

- N: the parameters a token is multiplied by: every parameter except the input embedding table (a
  lookup, no multiply). The untied `lm_head` counts; a tied head is the embedding table itself, and
  its matmul is counted once, by adding the table back (it is multiplied, just not looked up).
- d_attn = n_head * head_dim: the width of the attention products QK^T and AV. It is d_model for
  the size table's shapes, but not where a shape sets `head_dim` (Qwen3: 32 heads of 128 on
  d_model 2560 -> d_attn 4096). The previous bench used d_model there.
- 12 = 2 (multiply-add) x 2 (QK^T and AV) x 3 (forward + backward's two).

"Causal at half": a causal kernel (flash attention, SDPA `is_causal`) skips the masked upper
triangle, so the attention work done is about half of the convention's; the second figure counts it
so (6 * n_layer * d_attn * seq_len). Both are reported; the first is the one papers quote.
"""

from dataclasses import dataclass

from contracts.models import ModelShape
from domain.model_shapes import count_parameters, head_dim


@dataclass(frozen=True, slots=True, kw_only=True)
class Flops:
    """FLOPs per token of one training step (forward + backward) of a shape at a sequence length."""

    matmul_params: int
    """N: the parameters in matmuls (see the module docstring)."""
    attention_width: int
    """d_attn = n_head * head_dim."""
    dense: int
    """6 * N."""
    attention: int
    """12 * n_layer * d_attn * seq_len: attention's products counted in full."""

    @property
    def per_token(self) -> int:
        """The convention's figure: 6N + 12 L d_attn T."""
        return self.dense + self.attention

    @property
    def per_token_causal(self) -> int:
        """The same with causal attention's masked half left out: 6N + 6 L d_attn T."""
        return self.dense + self.attention // 2


def matmul_params(shape: ModelShape) -> int:
    """N: every parameter but the input embedding lookup; a tied head's matmul still counts."""
    total = count_parameters(shape)
    embedding = shape.vocab_size * shape.d_model
    return total if shape.tie_embeddings else total - embedding


def attention_width(shape: ModelShape) -> int:
    """d_attn = n_head * head_dim (d_model unless the shape sets head_dim)."""
    return shape.n_head * head_dim(shape)


def flops(shape: ModelShape, seq_len: int) -> Flops:
    n = matmul_params(shape)
    d_attn = attention_width(shape)
    return Flops(
        matmul_params=n,
        attention_width=d_attn,
        dense=6 * n,
        attention=12 * shape.n_layer * d_attn * seq_len,
    )


def achieved_tflops(flops_per_token: int, tokens_per_s: float) -> float:
    return flops_per_token * tokens_per_s / 1e12


def mfu(flops_per_token: int, tokens_per_s_per_gpu: float, peak_tflops: float | None) -> float | None:
    """Achieved over peak, a fraction; None without a peak (the CPU, a GPU not in the table)."""
    if not peak_tflops:
        return None
    return achieved_tflops(flops_per_token, tokens_per_s_per_gpu) / peak_tflops
