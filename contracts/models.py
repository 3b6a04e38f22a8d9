"""Model shapes: the named size table for from-scratch runs, and what a base model from the model
store looks like to the planner (`BaseModel`: its shape from `config.json`, never its weights).
Shared by the planner (parameter counts, memory) and the trainer (which builds the model from a
shape). Data, not code.

Schema evolution: the fields after `rope_base` came with Hugging Face base models; their defaults
are the size table's own architecture, so every shape written before them means the same model.
"""

from contracts.base import Internal


class RopeScaling(Internal, frozen=True, kw_only=True):
    """`rope_scaling` / `rope_parameters` of a Hugging Face config, as the trainer applies it."""

    kind: str = "default"  # "default", "linear" or "llama3" (others are refused at plan time)
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


class ModelShape(Internal, frozen=True, kw_only=True):
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int
    d_ff: int  # SwiGLU hidden width
    vocab_size: int
    max_seq_len: int
    rope_base: float = 10_000.0
    head_dim: int | None = None  # None: d_model // n_head (Qwen3 sets it explicitly)
    qk_norm: bool = True  # RMSNorm on q and k per head: the size table's models and Qwen3; not Llama/Qwen2
    attention_bias: bool = False  # biases on q, k and v (Qwen2)
    tie_embeddings: bool = False  # the LM head shares the token embedding's weight
    norm_eps: float = 1e-6  # RMSNorm epsilon (`rms_norm_eps`)
    rope_scaling: RopeScaling | None = None


class BaseModel(Internal, frozen=True, kw_only=True):
    """A checkpoint in the backend's model store as the planner sees it: read from its
    `config.json`, tokenizer files and file digests, never from its weights."""

    name: str  # the store's name for it (`ito-training models add PATH --name N`)
    digest: str  # "sha256:<64 hex>": the content digest over every file (a manifest's model.revision)
    family: str  # "llama", "qwen2" or "qwen3"
    architecture: str  # config.json's, e.g. "LlamaForCausalLM"
    shape: ModelShape
    parameters: int  # exact, from the shape (tied embeddings counted once)
    tokenizer_vocab: int | None = None  # None: the checkpoint has no tokenizer.json
    chat_template: bool = False  # tokenizer_config.json carries a chat template
    eos_token: str | None = None
    bytes: int = 0  # the files' total size
    accounts: list[str] = []  # accounts that may use it; [] = every account
    added_at: str = ""  # ISO-8601, when `models add` stored it


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
