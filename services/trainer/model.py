"""The trainer's model: a decoder-only transformer built from a `contracts.models.ModelShape`.

One readable file in the nanoGPT manner. Llama-style choices: RMSNorm (pre-norm), rotary position
embeddings with a configurable base, SwiGLU MLP, RMSNorm on queries and keys per head (QK-norm),
grouped-query attention, causal `F.scaled_dot_product_attention`, and an optional z-loss on the
log-partition function. No biases anywhere. `count_parameters` gives the exact parameter count from
the shape alone, so the planner never has to build a 70B model to count it.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from contracts.models import ModelShape

RMS_EPS = 1e-6  # float32-safe; raise to 1e-5 if bf16 activations underflow on a new accelerator
INIT_STD = 0.02  # GPT-2 / Llama init; residual output projections get an extra 1/sqrt(2 * n_layer)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 whatever the activation dtype."""

    def __init__(self, dim: int, eps: float = RMS_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return out.type_as(x)


def rope_tables(head_dim: int, max_seq_len: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (max_seq_len, head_dim // 2) for rotary embeddings."""
    assert head_dim % 2 == 0, f"RoPE needs an even head dimension, got {head_dim}"
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the last dim; x is (B, H, T, head_dim)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    cos, sin = cos[None, None], sin[None, None]  # (1, 1, T, half)
    out = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.type_as(x)


class Attention(nn.Module):
    """Causal self-attention with grouped-query heads and QK-norm."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.n_head = shape.n_head
        self.n_kv_head = shape.n_kv_head
        self.head_dim = shape.d_model // shape.n_head
        self.wq = nn.Linear(shape.d_model, self.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(shape.d_model, self.n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(shape.d_model, self.n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_head * self.head_dim, shape.d_model, bias=False)
        # QK-norm keeps attention logits bounded, which lets the tiny model run a high LR.
        self.q_norm = RMSNorm(self.head_dim)
        self.k_norm = RMSNorm(self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_head != self.n_head:
            # Expand KV heads explicitly: SDPA's enable_gqa is not supported by every backend.
            repeat = self.n_head // self.n_kv_head
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.w_gate = nn.Linear(shape.d_model, shape.d_ff, bias=False)
        self.w_up = nn.Linear(shape.d_model, shape.d_ff, bias=False)
        self.w_down = nn.Linear(shape.d_ff, shape.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.attn_norm = RMSNorm(shape.d_model)
        self.attn = Attention(shape)
        self.mlp_norm = RMSNorm(shape.d_model)
        self.mlp = SwiGLU(shape)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Token embedding, `n_layer` pre-norm blocks, final RMSNorm, language-model head."""

    rope_cos: torch.Tensor  # buffers (register_buffer below), declared for the type checker
    rope_sin: torch.Tensor

    def __init__(
        self,
        shape: ModelShape,
        *,
        rope_base: float | None = None,  # None: shape.rope_base; raise (e.g. 500k) for long context
        z_loss: float = 0.0,  # 1e-4 is the PaLM value; keeps logits from drifting in long bf16 runs
        tie_embeddings: bool = False,  # True saves vocab*d_model params; untied trains a bit better
    ):
        super().__init__()
        check_shape(shape)
        self.shape = shape
        self.z_loss = z_loss
        self.tie_embeddings = tie_embeddings
        self.tok_emb = nn.Embedding(shape.vocab_size, shape.d_model)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.n_layer))
        self.norm = RMSNorm(shape.d_model)
        self.lm_head = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        if tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # Non-persistent: derived from the shape, so they stay out of state dicts and checkpoints.
        cos, sin = rope_tables(shape.d_model // shape.n_head, shape.max_seq_len, rope_base or shape.rope_base)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        residual_std = INIT_STD / math.sqrt(2 * self.shape.n_layer)
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # norm weights stay at 1
            std = residual_std if name.endswith(("wo.weight", "w_down.weight")) else INIT_STD
            nn.init.normal_(p, mean=0.0, std=std)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, T) int64. Returns logits (B, T, vocab) and the mean loss or None (plus
        the z-loss term in training mode)."""
        _, T = idx.shape
        assert T <= self.shape.max_seq_len, f"sequence of {T} exceeds max_seq_len {self.shape.max_seq_len}"
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits, None
        flat = logits.float().view(-1, logits.shape[-1])
        loss = F.cross_entropy(flat, targets.reshape(-1))
        if self.z_loss and self.training:
            # A training penalty only: in eval mode the loss stays the cross-entropy, so held-out
            # loss (and the gates on it) means the same with z-loss on or off.
            loss = loss + self.z_loss * torch.logsumexp(flat, dim=-1).pow(2).mean()
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0) -> torch.Tensor:
        """Sample continuations of idx (B, T); temperature 0 is greedy. For demos, not serving."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.shape.max_seq_len :]
            logits, _ = self(context)
            logits = logits[:, -1, :].float()
            if temperature == 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                nxt = torch.multinomial(F.softmax(logits / temperature, dim=-1), num_samples=1)
            idx = torch.cat((idx, nxt), dim=1)
        return idx


def check_shape(shape: ModelShape) -> None:
    """Raise ValueError in a plain sentence if the shape cannot build a model."""
    if shape.d_model % shape.n_head:
        raise ValueError(f"d_model {shape.d_model} must be divisible by n_head {shape.n_head}.")
    if (shape.d_model // shape.n_head) % 2:
        raise ValueError("The head dimension (d_model / n_head) must be even for rotary embeddings.")
    if shape.n_kv_head < 1 or shape.n_head % shape.n_kv_head:
        raise ValueError(f"n_head {shape.n_head} must be a multiple of n_kv_head {shape.n_kv_head}.")


def count_parameters(shape: ModelShape, *, tie_embeddings: bool = False) -> int:
    """Exact parameter count of `Transformer(shape, tie_embeddings=...)`, without building it."""
    d, hd = shape.d_model, shape.d_model // shape.n_head
    q_dim, kv_dim = shape.n_head * hd, shape.n_kv_head * hd
    attn = d * q_dim + 2 * d * kv_dim + q_dim * d + 2 * hd  # wq, wk, wv, wo, q_norm, k_norm
    mlp = 3 * d * shape.d_ff  # gate, up, down
    block = attn + mlp + 2 * d  # + attn_norm, mlp_norm
    embeddings = shape.vocab_size * d * (1 if tie_embeddings else 2)
    return embeddings + shape.n_layer * block + d  # + final norm
