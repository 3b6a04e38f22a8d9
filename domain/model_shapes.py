"""What a model shape means without building it: its exact parameter count, and the translation
between a Hugging Face `config.json` (Llama, Qwen2, Qwen3) and the trainer's `ModelShape`.

Pure functions of plain data, so the scheduler checks a base model at plan time (and prices it from
its real parameter count) without importing torch or transformers. `shape_from_hf_config` refuses
what the trainer's model cannot reproduce exactly, naming the config key: a model that loaded with
a silently different architecture would train and export something else than the user's.
"""

from dataclasses import dataclass
from typing import Any

from contracts.models import ModelShape, RopeScaling

FAMILIES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
"""model_type -> the architecture transformers builds for it: the families the trainer supports."""
ROPE_KINDS = ("default", "linear", "llama3")


class UnsupportedConfig(ValueError):
    """A config.json the trainer cannot train; `key` is the config key at fault."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def head_dim(shape: ModelShape) -> int:
    return shape.head_dim or shape.d_model // shape.n_head


def count_parameters(shape: ModelShape, *, tie_embeddings: bool | None = None) -> int:
    """Exact parameter count of the trainer's `Transformer(shape)` (tied embeddings counted once);
    `tie_embeddings` overrides the shape's."""
    tied = shape.tie_embeddings if tie_embeddings is None else tie_embeddings
    d, hd = shape.d_model, head_dim(shape)
    q_dim, kv_dim = shape.n_head * hd, shape.n_kv_head * hd
    attn = d * q_dim + 2 * d * kv_dim + q_dim * d  # wq, wk, wv, wo
    if shape.attention_bias:
        attn += q_dim + 2 * kv_dim
    if shape.qk_norm:
        attn += 2 * hd
    mlp = 3 * d * shape.d_ff  # gate, up, down
    block = attn + mlp + 2 * d  # + attn_norm, mlp_norm
    embeddings = shape.vocab_size * d * (1 if tied else 2)
    return embeddings + shape.n_layer * block + d  # + final norm


@dataclass(frozen=True, slots=True)
class HfModel:
    family: str  # "llama", "qwen2", "qwen3"
    architecture: str
    shape: ModelShape


def _int(config: dict[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UnsupportedConfig(key, f"config.json's {key} must be a positive integer, got {value!r}.")
    return value


def _rope(config: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from transformers 5's `rope_parameters` or the older `rope_theta` +
    `rope_scaling`."""
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", config.get("rope_theta", 10_000.0))
        scaling: dict[str, Any] | None = params
        key = "rope_parameters"
    else:
        theta = config.get("rope_theta", 10_000.0)
        scaling = config.get("rope_scaling")
        key = "rope_scaling"
    if not isinstance(theta, int | float) or theta <= 0:
        raise UnsupportedConfig("rope_theta", f"config.json's rope_theta must be positive, got {theta!r}.")
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise UnsupportedConfig(
            f"{key}.rope_type",
            f"RoPE scaling {kind!r} is not supported; the trainer applies {', '.join(ROPE_KINDS)}.",
        )
    if kind == "default":
        return float(theta), None
    return float(theta), RopeScaling(
        kind=kind,
        factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def shape_from_hf_config(config: dict[str, Any]) -> HfModel:
    """The trainer's shape for a Llama / Qwen2 / Qwen3 `config.json`, or UnsupportedConfig."""
    family = config.get("model_type")
    if family not in FAMILIES:
        raise UnsupportedConfig(
            "model_type",
            f"model_type {family!r} is not supported; the trainer trains {', '.join(FAMILIES)}.",
        )
    architectures = config.get("architectures") or [FAMILIES[family]]
    if architectures != [FAMILIES[family]]:
        raise UnsupportedConfig(
            "architectures", f"architectures {architectures!r}: only {FAMILIES[family]} is supported."
        )
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedConfig("hidden_act", f"hidden_act {act!r}: the trainer's MLP is SwiGLU (silu).")
    if config.get("mlp_bias"):
        raise UnsupportedConfig("mlp_bias", "MLP biases are not supported.")
    if family == "llama" and config.get("attention_bias"):
        raise UnsupportedConfig("attention_bias", "Llama attention biases (o_proj too) are not supported.")
    if family == "qwen3" and config.get("attention_bias"):
        raise UnsupportedConfig("attention_bias", "Qwen3 attention biases are not supported.")
    if config.get("use_sliding_window"):
        raise UnsupportedConfig("use_sliding_window", "Sliding-window attention is not supported.")
    n_head = _int(config, "num_attention_heads")
    n_kv = _int(config, "num_key_value_heads", n_head)
    d_model = _int(config, "hidden_size")
    explicit_head_dim = config.get("head_dim")
    hd = _int(config, "head_dim") if explicit_head_dim is not None else d_model // n_head
    if hd % 2:
        raise UnsupportedConfig("head_dim", f"head_dim {hd} must be even for rotary embeddings.")
    if n_head % n_kv:
        raise UnsupportedConfig(
            "num_key_value_heads", f"num_attention_heads {n_head} must be a multiple of {n_kv}."
        )
    eps = config.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, int | float) or eps <= 0:
        raise UnsupportedConfig("rms_norm_eps", f"rms_norm_eps must be positive, got {eps!r}.")
    theta, scaling = _rope(config)
    shape = ModelShape(
        n_layer=_int(config, "num_hidden_layers"),
        d_model=d_model,
        n_head=n_head,
        n_kv_head=n_kv,
        d_ff=_int(config, "intermediate_size"),
        vocab_size=_int(config, "vocab_size"),
        max_seq_len=_int(config, "max_position_embeddings"),
        rope_base=theta,
        head_dim=hd if hd != d_model // n_head else None,  # None: the derived width (one spelling)
        qk_norm=family == "qwen3",
        attention_bias=family == "qwen2",
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        norm_eps=float(eps),
        rope_scaling=scaling,
    )
    return HfModel(family=family, architecture=FAMILIES[family], shape=shape)


def family_of(shape: ModelShape) -> str:
    """The Hugging Face family that reproduces `shape` exactly (for exports of from-scratch runs):
    QK-norm is Qwen3's, q/k/v biases Qwen2's, neither Llama's."""
    if shape.qk_norm and shape.attention_bias:
        raise ValueError("No supported family has both QK-norm and attention biases.")
    if shape.qk_norm:
        return "qwen3"
    return "qwen2" if shape.attention_bias else "llama"


def hf_config_from_shape(
    shape: ModelShape, *, family: str | None = None, eos_token_id: int | None = None
) -> dict[str, Any]:
    """The config.json (as a dict) of `shape` in `family` (default: `family_of(shape)`): the inverse
    of `shape_from_hf_config` up to keys it ignores. fp32 weights, as the trainer exports them."""
    family = family or family_of(shape)
    if family not in FAMILIES:
        raise ValueError(f"Unknown family {family!r}.")
    rope: dict[str, Any] = {"rope_theta": shape.rope_base, "rope_type": "default"}
    if shape.rope_scaling is not None:
        s = shape.rope_scaling
        rope |= {"rope_type": s.kind, "factor": s.factor}
        if s.kind == "llama3":
            rope |= {
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }
    config: dict[str, Any] = {
        "architectures": [FAMILIES[family]],
        "model_type": family,
        "hidden_size": shape.d_model,
        "intermediate_size": shape.d_ff,
        "num_hidden_layers": shape.n_layer,
        "num_attention_heads": shape.n_head,
        "num_key_value_heads": shape.n_kv_head,
        "head_dim": head_dim(shape),
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_seq_len,
        "rms_norm_eps": shape.norm_eps,
        "vocab_size": shape.vocab_size,
        "tie_word_embeddings": shape.tie_embeddings,
        "rope_theta": shape.rope_base,
        "rope_parameters": rope,
        "attention_dropout": 0.0,
        "torch_dtype": "float32",
        "dtype": "float32",
    }
    if family == "llama":
        config |= {"attention_bias": False, "mlp_bias": False}
    if family == "qwen3":
        config |= {"attention_bias": False}
    if family == "qwen2":
        config |= {"use_sliding_window": False}
    if eos_token_id is not None:
        config["eos_token_id"] = eos_token_id
    return config
