"""The state-dict adapter between the trainer's Transformer and Hugging Face's Llama / Qwen2 /
Qwen3 models: names only, as torchtitan's `StateDictAdapter` (`to_hf` / `from_hf`) does.

No tensor is changed on the way: our RoPE rotates (first half, second half) of each head, which is
transformers' `rotate_half` convention, so q and k need none of the permutation that Meta's
original Llama checkpoints do. Tied embeddings: Hugging Face saves no `lm_head.weight`; `to_hf`
drops it and `from_hf` points ours at the embedding.

`hf_tensor_shapes(shape)` is what a checkpoint of `shape` holds, name by name: the loader checks a
checkpoint's headers against it before reading a byte of weights.
"""

import re
from collections.abc import Mapping
from typing import TypeVar

from contracts.models import ModelShape
from domain.model_shapes import head_dim

T = TypeVar("T")

# Our name inside block i -> Hugging Face's inside model.layers.{i}.
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "attn.wq.bias": "self_attn.q_proj.bias",
    "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.bias": "self_attn.v_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}
_BLOCK_FROM_HF = {hf: ours for ours, hf in _BLOCK.items()}
_TOP = {
    "tok_emb.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_TOP_FROM_HF = {hf: ours for ours, hf in _TOP.items()}
_OURS_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Tensors some checkpoints carry that hold nothing the model needs (older Llama exports saved the
# RoPE table; it is derived from the config).
IGNORED_HF = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def _block_names(shape: ModelShape) -> list[str]:
    names = ["attn_norm.weight", "attn.wq.weight", "attn.wk.weight", "attn.wv.weight", "attn.wo.weight"]
    if shape.attention_bias:
        names += ["attn.wq.bias", "attn.wk.bias", "attn.wv.bias"]
    if shape.qk_norm:
        names += ["attn.q_norm.weight", "attn.k_norm.weight"]
    return [*names, "mlp_norm.weight", "mlp.w_gate.weight", "mlp.w_up.weight", "mlp.w_down.weight"]


def hf_tensor_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor a Hugging Face checkpoint of `shape` holds, with its shape (no lm_head when
    the embeddings are tied)."""
    d, hd, ff = shape.d_model, head_dim(shape), shape.d_ff
    q, kv = shape.n_head * hd, shape.n_kv_head * hd
    block: dict[str, tuple[int, ...]] = {
        "attn_norm.weight": (d,),
        "attn.wq.weight": (q, d),
        "attn.wk.weight": (kv, d),
        "attn.wv.weight": (kv, d),
        "attn.wo.weight": (d, q),
        "attn.wq.bias": (q,),
        "attn.wk.bias": (kv,),
        "attn.wv.bias": (kv,),
        "attn.q_norm.weight": (hd,),
        "attn.k_norm.weight": (hd,),
        "mlp_norm.weight": (d,),
        "mlp.w_gate.weight": (ff, d),
        "mlp.w_up.weight": (ff, d),
        "mlp.w_down.weight": (d, ff),
    }
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, d)}
    for i in range(shape.n_layer):
        for name in _block_names(shape):
            out[f"model.layers.{i}.{_BLOCK[name]}"] = block[name]
    out["model.norm.weight"] = (d,)
    if not shape.tie_embeddings:
        out["lm_head.weight"] = (shape.vocab_size, d)
    return out


def hf_name(name: str, shape: ModelShape) -> str | None:
    """Hugging Face's name for our parameter `name`; None for the tied LM head (HF omits it).
    ValueError for a name that is not one of the model's."""
    if name == "lm_head.weight" and shape.tie_embeddings:
        return None
    if name in _TOP:
        return _TOP[name]
    m = _OURS_BLOCK.fullmatch(name)
    if m is not None and int(m.group(1)) < shape.n_layer and m.group(2) in _block_names(shape):
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"
    raise ValueError(f"The tensor {name} is not a parameter of the trainer's model of this shape.")


def our_name(name: str, shape: ModelShape) -> str | None:
    """Our name for the Hugging Face tensor `name`; None for tensors that hold nothing we need
    (a saved RoPE table, a tied checkpoint's redundant lm_head). ValueError for any other name:
    a tensor the model has no place for means a different architecture."""
    if IGNORED_HF.fullmatch(name) or (name == "lm_head.weight" and shape.tie_embeddings):
        return None
    if name in _TOP_FROM_HF:
        return _TOP_FROM_HF[name]
    m = _HF_LAYER.fullmatch(name)
    if m is not None and int(m.group(1)) < shape.n_layer:
        ours = _BLOCK_FROM_HF.get(m.group(2))
        if ours is not None and ours in _block_names(shape):
            return f"blocks.{m.group(1)}.{ours}"
    raise ValueError(f"The checkpoint's tensor {name} has no place in the model its config.json describes.")


def to_hf(state: Mapping[str, T], shape: ModelShape) -> dict[str, T]:
    """Our state dict in Hugging Face's names (the same tensor objects, nothing copied)."""
    out: dict[str, T] = {}
    for name, value in state.items():
        hf = hf_name(name, shape)
        if hf is not None:
            out[hf] = value
    return out


def from_hf(hf_state: Mapping[str, T], shape: ModelShape) -> dict[str, T]:
    """A Hugging Face state dict in our names (the same tensor objects); with tied embeddings the
    LM head is the embedding, as in the model's own state dict."""
    out: dict[str, T] = {}
    for name, value in hf_state.items():
        ours = our_name(name, shape)
        if ours is not None:
            out[ours] = value
    if shape.tie_embeddings and "tok_emb.weight" in out:
        out["lm_head.weight"] = out["tok_emb.weight"]
    return out
