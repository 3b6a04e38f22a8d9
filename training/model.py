"""The trainer's model: a decoder-only transformer built from a `contracts.models.ModelShape`.

One readable file in the nanoGPT manner. Llama-style choices: RMSNorm (pre-norm), rotary position
embeddings with a configurable base (and Llama 3 / linear RoPE scaling), SwiGLU MLP, grouped-query
attention, causal `F.scaled_dot_product_attention`, and an optional z-loss on the log-partition
function. The shape decides the rest, so the same module tree reproduces the Hugging Face families
exactly: RMSNorm on queries and keys per head (QK-norm: the size table's models and Qwen3), biases on
q/k/v (Qwen2; none anywhere else), an explicit head width (Qwen3), tied embeddings, the norms' eps.
`count_parameters` gives the exact parameter count from the shape alone, so the planner never has to
build a 70B model to count it.
"""

import math
import zlib
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint

from contracts.models import ModelShape, RopeScaling
from domain import model_shapes

RMS_EPS = 1e-6  # float32-safe; raise to 1e-5 if bf16 activations underflow on a new accelerator
# Logits per chunk of the loss and log-prob paths: 16M float32 elements (64 MiB) bound the
# transient (chunk, vocab) logits whatever B * T is; lower it if the head's chunk still OOMs.
LOGIT_CHUNK_ELEMENTS = 1 << 24
IGNORE_INDEX = -100  # F.cross_entropy's default: a target that carries no loss
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


def rope_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """The rotary inverse frequencies, (head_dim // 2,) float32, computed as transformers computes
    them (modeling_rope_utils: the default, `_compute_linear_scaling_rope_parameters` and
    `_compute_llama3_parameters`), so a base model's positions mean what they meant in training."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    if scaling is None or scaling.kind == "default":
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind != "llama3":
        raise ValueError(f"RoPE scaling {scaling.kind!r} is not supported (default, linear, llama3).")
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths (beyond the original context) are slowed by `factor`, short ones kept, and
    # those between interpolated smoothly: Llama 3.1's recipe, step for step.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(
    head_dim: int, max_seq_len: int, base: float, scaling: RopeScaling | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (max_seq_len, head_dim // 2) for rotary embeddings."""
    assert head_dim % 2 == 0, f"RoPE needs an even head dimension, got {head_dim}"
    inv_freq = rope_inv_freq(head_dim, base, scaling)
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
    """Causal self-attention with grouped-query heads, QK-norm and q/k/v biases as the shape says."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.n_head = shape.n_head
        self.n_kv_head = shape.n_kv_head
        self.head_dim = model_shapes.head_dim(shape)
        bias = shape.attention_bias  # Qwen2's: q, k and v only, never the output projection
        self.wq = nn.Linear(shape.d_model, self.n_head * self.head_dim, bias=bias)
        self.wk = nn.Linear(shape.d_model, self.n_kv_head * self.head_dim, bias=bias)
        self.wv = nn.Linear(shape.d_model, self.n_kv_head * self.head_dim, bias=bias)
        self.wo = nn.Linear(self.n_head * self.head_dim, shape.d_model, bias=False)
        # QK-norm keeps attention logits bounded, which lets the tiny model run a high LR. Without
        # it (Llama, Qwen2) there are no modules at all: no weights to load, train or export.
        self.q_norm: RMSNorm | None = RMSNorm(self.head_dim, shape.norm_eps) if shape.qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(self.head_dim, shape.norm_eps) if shape.qk_norm else None

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, n_head, T, head_dim), k and v (B, n_kv_head, T, head_dim): projected, normed and
        rotated. Shared with the KV-cache decoder (training/recipes/generation.py)."""
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.project(x, cos, sin)
        # Grouped-query heads share their K/V inside SDPA (enable_gqa): no (B, n_head, T, head_dim)
        # copies of k and v, and the same numbers as expanding them (bit for bit on CPU).
        gqa = self.n_kv_head != self.n_head
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
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
        self.attn_norm = RMSNorm(shape.d_model, shape.norm_eps)
        self.attn = Attention(shape)
        self.mlp_norm = RMSNorm(shape.d_model, shape.norm_eps)
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
        tie_embeddings: bool | None = None,  # None: the shape's; True saves vocab*d_model params
    ):
        super().__init__()
        check_shape(shape)
        self.shape = shape
        self.z_loss = z_loss
        self.rope_base = rope_base or shape.rope_base
        self.tie_embeddings = shape.tie_embeddings if tie_embeddings is None else tie_embeddings
        self.tok_emb = nn.Embedding(shape.vocab_size, shape.d_model)
        self.blocks = nn.ModuleList(Block(shape) for _ in range(shape.n_layer))
        self.norm = RMSNorm(shape.d_model, shape.norm_eps)
        self.lm_head = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        if self.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        # Non-persistent: derived from the shape, so they stay out of state dicts and checkpoints.
        cos, sin = self._rope_tables()
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def _rope_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.shape
        return rope_tables(model_shapes.head_dim(s), s.max_seq_len, self.rope_base, s.rope_scaling)

    def materialize(self, device: torch.device | str) -> None:
        """Give a model built on the meta device (and parallelized there, each rank then holding
        only its shards) real storage on `device`: the RoPE tables recomputed, the tied head tied
        again. The weights are uninitialized until loaded (or `reset_parameters`)."""
        self.to_empty(device=device)
        if self.tie_embeddings and self.lm_head.weight is not self.tok_emb.weight:
            # to_empty gives a plain parameter new storage per module (FSDP2's DTensors keep one)
            self.lm_head.weight = self.tok_emb.weight
        self.reset_buffers()

    def cast_parameters(self, dtype: torch.dtype) -> None:
        """Cast every parameter to `dtype` in place (a sharded one too: FSDP2 re-registers its
        shards); the RoPE tables stay float32, as apply_rope computes."""
        if all(p.dtype == dtype for p in self.parameters()):
            return
        self.to(dtype)
        self.rope_cos = self.rope_cos.float()
        self.rope_sin = self.rope_sin.float()
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """Recompute the RoPE tables in place (after `to_empty` they hold garbage)."""
        cos, sin = self._rope_tables()
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def init_std(self, name: str) -> float:
        """The normal init's standard deviation of matrix `name` (residual output projections get
        the extra 1/sqrt(2 * n_layer)); vectors are filled instead: norms with 1, biases with 0."""
        if name.endswith(("wo.weight", "w_down.weight")):
            return INIT_STD / math.sqrt(2 * self.shape.n_layer)
        return INIT_STD

    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            if p.dim() < 2:
                # Norm weights start at 1 and biases at 0 (and stay so after `to_empty`).
                with torch.no_grad():
                    p.fill_(0.0 if name.endswith(".bias") else 1.0)
                continue
            nn.init.normal_(p, mean=0.0, std=self.init_std(name))

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """The random init of `reset_parameters`, made independent of the layout: each parameter
        drawn whole on its device from a generator seeded by (seed, its name), then, for a sharded
        parameter (a DTensor), sliced to this rank's shard without communication. So a model built
        on the meta device and parallelized there gets the same weights on any number of ranks,
        and no rank holds more than one full parameter at a time. LoRA adapters are left to
        `LoraLinear.reset_lora_parameters` (training/weights/lora.py)."""
        for name, p in self.named_parameters():
            if ".lora_" in name:
                continue
            if p.dim() < 2:
                p.fill_(0.0 if name.endswith(".bias") else 1.0)  # a DTensor fills its shard
                continue
            full = torch.empty(p.shape, dtype=p.dtype, device=p.device)
            full.normal_(0.0, self.init_std(name), generator=parameter_generator(seed, name, p.device))
            copy_whole(p, full)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        return_logits: bool = True,
        logprobs: bool = False,
        temperature: float = 1.0,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """idx, targets: (B, T) int64. Returns logits (B, T, vocab, the model's dtype) and the mean
        loss or None (plus the z-loss term in training mode). The loss is computed from the hidden
        states a chunk of rows at a time (`chunked_loss`), so no (B, T, vocab) float32 tensor is
        ever made; `return_logits=False` skips the full logits too (the loss path's callers).
        `logprobs=True` returns (None, log p(targets | prefix) per token (B, T) float32) of the
        logits / temperature, chunked likewise (`chunked_logprobs`). Everything goes through
        forward, so FSDP2's hooks on the root module run whichever output is asked for."""
        _, T = idx.shape
        assert T <= self.shape.max_seq_len, f"sequence of {T} exceeds max_seq_len {self.shape.max_seq_len}"
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x, cos, sin)
        hidden = self.norm(x)
        if targets is None:
            return self.lm_head(hidden), None
        if logprobs:
            return None, chunked_logprobs(self.lm_head, hidden, targets, temperature)
        # z-loss is a training penalty only: in eval mode the loss stays the cross-entropy, so
        # held-out loss (and the gates on it) means the same with z-loss on or off.
        z_loss = self.z_loss if self.training else 0.0
        loss = chunked_loss(self.lm_head, hidden, targets, z_loss)
        return (self.lm_head(hidden) if return_logits else None), loss

    def token_logprobs(
        self, idx: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
    ) -> torch.Tensor:
        """log p(targets[b, t] | idx[b, :t + 1]) under logits / temperature: (B, T) float32,
        computed chunk by chunk from the hidden states (no (B, T, vocab) float32 tensor)."""
        out = self(idx, targets, logprobs=True, temperature=temperature)[1]
        assert out is not None
        return out

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


def parameter_generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """A generator on `device` seeded by (seed, parameter name): the same draws on every rank."""
    # The name as a plain model has it: activation checkpointing and compile wrap blocks
    # (training/engine/speed.py), and the weights must not depend on whether they did.
    name = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (1 << 63))
    return g


def copy_whole(param: torch.Tensor, full: torch.Tensor) -> None:
    """Copy the full tensor `full` into `param`, which may be a DTensor: then only this rank's
    shard is kept (`distribute_tensor(src_data_rank=None)` slices locally, no communication)."""
    if isinstance(param, DTensor):
        local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
        param.to_local().copy_(local.to_local())
    else:
        param.copy_(full)


def chunk_rows(rows: int, vocab: int, budget: int | None = None) -> int:
    """Rows of logits per chunk: as many as keep one chunk's (rows, vocab) float32 logits within
    `budget` elements (None: LOGIT_CHUNK_ELEMENTS), at least one."""
    budget = LOGIT_CHUNK_ELEMENTS if budget is None else budget
    return max(1, min(rows, budget // max(vocab, 1)))


def _chunk_loss_sums(head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, z: bool) -> torch.Tensor:
    """(summed cross-entropy, summed logsumexp^2 or 0) of one chunk of rows."""
    logits = head(hidden).float()  # (chunk, vocab) float32 inside the chunk only
    ce = F.cross_entropy(logits, targets, reduction="sum")
    lse2 = torch.logsumexp(logits, dim=-1).pow(2).sum() if z else torch.zeros_like(ce)
    return torch.stack((ce, lse2))


def _chunk_logprobs(
    head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    logits = head(hidden).float()
    if temperature != 1.0:  # dividing by 1 is a pass over (chunk, vocab) that changes no bit
        logits = logits / temperature
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _chunks(
    hidden: torch.Tensor, targets: torch.Tensor, vocab: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    flat_t = targets.reshape(-1)
    rows = chunk_rows(flat_t.numel(), vocab)
    return list(zip(flat_h.split(rows), flat_t.split(rows), strict=True))


def _run_chunk(fn: Any, *args: Any, alone: bool = False) -> torch.Tensor:
    # Under checkpoint, backward recomputes each chunk's logits instead of keeping every chunk's
    # (chunk, vocab) float32 logits and softmax alive from forward to backward. A chunk `alone`
    # (the whole batch within LOGIT_CHUNK_ELEMENTS) is small enough to keep: no recompute.
    if torch.is_grad_enabled() and not alone:
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)


def _map_chunks(fn: Any, head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    chunks = _chunks(hidden, targets, _out_features(head))
    return [_run_chunk(fn, h, t, alone=len(chunks) == 1) for h, t in chunks]


def chunked_loss(
    head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0
) -> torch.Tensor:
    """Mean cross-entropy of `head(hidden)` against targets (ignore_index -100, as F.cross_entropy),
    plus z_loss * mean(logsumexp^2) over every row: the full-logits loss (allclose in float32),
    computed chunk by chunk."""
    fn = partial(_chunk_loss_sums, head, z=bool(z_loss))
    sums = torch.stack(_map_chunks(fn, head, hidden, targets)).sum(0)
    loss = sums[0] / (targets != IGNORE_INDEX).sum().clamp(min=1)
    if z_loss:
        loss = loss + z_loss * sums[1] / targets.numel()
    return loss


def chunked_logprobs(
    head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """log_softmax(head(hidden) / temperature) at targets, (B, T) float32, chunk by chunk."""
    fn = partial(_chunk_logprobs, head, temperature=temperature)
    return torch.cat(_map_chunks(fn, head, hidden, targets)).view(targets.shape)


def _out_features(head: nn.Module) -> int:
    out = getattr(head, "out_features", None)
    assert isinstance(out, int), "the head is a linear layer (nn.Linear or a LoRA wrapper of one)"
    return out


def check_shape(shape: ModelShape) -> None:
    """Raise ValueError in a plain sentence if the shape cannot build a model."""
    if shape.head_dim is None:
        if shape.d_model % shape.n_head:
            raise ValueError(f"d_model {shape.d_model} must be divisible by n_head {shape.n_head}.")
        if (shape.d_model // shape.n_head) % 2:
            raise ValueError("The head dimension (d_model / n_head) must be even for rotary embeddings.")
    elif shape.head_dim < 2 or shape.head_dim % 2:
        raise ValueError(f"The head dimension {shape.head_dim} must be even for rotary embeddings.")
    if shape.n_kv_head < 1 or shape.n_head % shape.n_kv_head:
        raise ValueError(f"n_head {shape.n_head} must be a multiple of n_kv_head {shape.n_kv_head}.")
    if not shape.norm_eps > 0:
        raise ValueError(f"The norms' epsilon must be positive, not {shape.norm_eps}.")
    if shape.rope_scaling is not None and shape.rope_scaling.kind not in model_shapes.ROPE_KINDS:
        raise ValueError(
            f"RoPE scaling {shape.rope_scaling.kind!r} is not supported (default, linear, llama3)."
        )


def count_parameters(shape: ModelShape, *, tie_embeddings: bool | None = None) -> int:
    """Exact parameter count of `Transformer(shape, tie_embeddings=...)` (None: the shape's),
    without building it: domain/model_shapes.py's, which the planner uses too."""
    return model_shapes.count_parameters(shape, tie_embeddings=tie_embeddings)
