"""The named model-size table: shapes only, shared by the planner (parameter counts, memory)
and the trainer (which builds the model from it). Data, not code."""

from contracts.base import Internal


class ModelShape(Internal, frozen=True, kw_only=True):
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    d_ff: int  # SwiGLU hidden width
    vocab_size: int
    max_seq_len: int
    rope_base: float = 10_000.0


# "tiny" trains on 2 CPU cores in seconds (byte-level vocabulary); the others exist for planning
# and GPUs. Values follow the usual Llama-style ratios (d_ff ~ 8/3 d_model, rounded).
MODEL_SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(
        n_layer=2, d_model=128, n_head=4, n_kv_head=4, d_ff=352, vocab_size=256, max_seq_len=256
    ),
    "150M": ModelShape(
        n_layer=12, d_model=768, n_head=12, n_kv_head=12, d_ff=2048, vocab_size=32_000, max_seq_len=2048
    ),
    "1B": ModelShape(
        n_layer=16, d_model=2048, n_head=32, n_kv_head=8, d_ff=8192, vocab_size=128_256, max_seq_len=4096
    ),
    "8B": ModelShape(
        n_layer=32,
        d_model=4096,
        n_head=32,
        n_kv_head=8,
        d_ff=14_336,
        vocab_size=128_256,
        max_seq_len=8192,
        rope_base=500_000.0,
    ),
    "70B": ModelShape(
        n_layer=80,
        d_model=8192,
        n_head=64,
        n_kv_head=8,
        d_ff=28_672,
        vocab_size=128_256,
        max_seq_len=8192,
        rope_base=500_000.0,
    ),
}
