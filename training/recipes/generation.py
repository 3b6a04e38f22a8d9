"""Batched sampling of short completions, shared by the eval battery (greedy) and the rollout
worker (sampled, with the behaviour policy's log-probabilities).

`complete` batches prompts by length: every row of a forward pass has the same prompt length and
no pad token ever reaches attention. Completions end at END_TOKEN.

A KV cache: the prompts go through the model once (prefill), keeping each layer's keys and values;
every new token then costs one position's forward, attending to the cache, instead of a forward over
its whole prefix. The cached forward is built from the model's own modules (projections, norms, RoPE
tables, MLP), so it computes what `Transformer.forward` does, one position at a time; greedy
decoding gives the same tokens with the cache as without (tests/training/test_waste_generation.py).
Without a cache (`kv_cache=False`, a sharded model, or a prompt plus completion longer than the
model's context, where the uncached path slides its window) every token recomputes the prefix.

Prompts of different lengths in one batch (`decode`, the trainer's `sample`): each prompt is
prefilled on its own, exactly as it would be alone, into one cache; every step then feeds one token
per row at the row's own position, each row attending to its own cached slots through a mask, so
the greedy tokens are those of decoding the prompts one at a time. The cache holds n_kv_head heads
and attention reads them with SDPA's `enable_gqa` (equal to repeating them, STACK.md), never a
copy of K/V expanded to n_head per token. A `deadline` stops decoding early and says so.

Tokens, log-probabilities and lengths stay on the model's device until a batch is done and come to
the host in one transfer. Whether every row has ended is looked at after each token on CPU, where
looking costs nothing, and every EXIT_CHECK_EVERY tokens on an accelerator, where it is a sync.
"""

import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F

from training.engine.loop import autocast
from training.model import Block, Transformer

END_TOKEN = ord("\n")  # a task answer ends with a newline, as every generated task line does
MAX_BATCH = 256  # rows per forward pass; lower it if a long-context eval runs out of memory
# Tokens between two "has every row ended?" checks on an accelerator: each check is a host sync,
# each token past the last row's end is one wasted one-position forward (cheap with the cache).
EXIT_CHECK_EVERY = 8


@dataclass(frozen=True, slots=True)
class Completion:
    tokens: list[int]  # the response, END_TOKEN included when it ended
    logprobs: list[float]  # behaviour-policy log-probability of each response token
    finished: bool  # False: cut off at max_new_tokens


@torch.no_grad()
def complete(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    kv_cache: bool = True,
    end_token: int = END_TOKEN,
) -> list[Completion]:
    """One completion per prompt, in prompt order (each ends at `end_token`: the byte newline, or a
    real tokenizer's id of it). temperature 0 is greedy; otherwise tokens are
    sampled from softmax(logits / temperature) with `generator` (CPU), so a seed fixes the result
    (on CPU the same tokens as ever; on cuda a device generator seeded from it draws them)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, prompt in enumerate(prompts):
        by_length[len(prompt)].append(i)
    results: list[Completion | None] = [None] * len(prompts)
    sampler = _device_generator(generator, device) if temperature else None
    for length in sorted(by_length):
        indices = by_length[length]
        for first in range(0, len(indices), MAX_BATCH):
            rows = indices[first : first + MAX_BATCH]
            batch = torch.tensor([list(prompts[i]) for i in rows], dtype=torch.long, device=device)
            completions = _complete_batch(
                model, batch, max_new_tokens, temperature, sampler, kv_cache, end_token
            )
            for i, completion in zip(rows, completions, strict=True):
                results[i] = completion
    model.train(was_training)
    return results  # type: ignore[return-value]


def _device_generator(generator: torch.Generator | None, device: torch.device) -> torch.Generator | None:
    """Sampling happens where the logits are. On CPU that is `generator` itself; elsewhere a
    generator on the device, seeded from `generator`, so the seed still fixes every sample."""
    if generator is None or device.type == "cpu":
        return generator
    seed = int(torch.randint(0, 2**62, (), generator=generator))
    return torch.Generator(device=device).manual_seed(seed)


def _cacheable(model: torch.nn.Module) -> bool:
    # FSDP2 swaps the class for a subclass whose forward hooks gather the shards; calling its
    # submodules directly would skip them, so a sharded model generates without the cache.
    return type(model) is Transformer


class _Recompute:
    """The logits of the next position from a forward over the whole prefix (last max_seq_len tokens)."""

    def __init__(self, model: Transformer, idx: torch.Tensor):
        self.model = model
        self.idx = idx

    def next_logits(self, new: torch.Tensor | None) -> torch.Tensor:
        if new is not None:
            self.idx = torch.cat((self.idx, new[:, None]), dim=1)
        logits, _ = self.model(self.idx[:, -self.model.shape.max_seq_len :])
        return logits[:, -1, :]


class _Cached:
    """The logits of the next position from the KV cache: the prompt once, then one token a call."""

    def __init__(self, model: Transformer, idx: torch.Tensor, length: int):
        self.model = model
        self.idx: torch.Tensor | None = idx
        self.length = length  # positions the cache holds: prompt + every token fed back
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.pos = 0

    def next_logits(self, new: torch.Tensor | None) -> torch.Tensor:
        idx = self.idx if new is None else new[:, None]
        assert idx is not None, "the prompt is fed once, then one new token a call"
        self.idx = None
        model, T, pos = self.model, idx.shape[1], self.pos
        cos, sin = model.rope_cos[pos : pos + T], model.rope_sin[pos : pos + T]
        x = model.tok_emb(idx)
        for layer, block in enumerate(cast("Iterable[Block]", model.blocks)):  # a ModuleList of Blocks
            x = x + self._attention(layer, block.attn, block.attn_norm(x), cos, sin)
            x = x + block.mlp(block.mlp_norm(x))
        self.pos += T
        return model.lm_head(model.norm(x[:, -1:, :]))[:, -1, :]

    def _attention(
        self, layer: int, attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """`Attention.forward` for positions pos..pos+T-1, their keys and values kept for later ones."""
        B, T, _ = x.shape
        q, k, v = attn.project(x, cos, sin)
        if layer == len(self.keys):  # first call: room for every position this batch will reach
            self.keys.append(k.new_empty(B, attn.n_kv_head, self.length, attn.head_dim))
            self.values.append(v.new_empty(B, attn.n_kv_head, self.length, attn.head_dim))
        end = self.pos + T
        self.keys[layer][:, :, self.pos : end] = k
        self.values[layer][:, :, self.pos : end] = v
        k, v = self.keys[layer][:, :, :end], self.values[layer][:, :, :end]
        # The prompt (from position 0) is causal; a single new token may see every cached position.
        # enable_gqa: each group of query heads reads its K/V head where it lies (no per-token copy).
        y = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=attn.n_kv_head != attn.n_head)
        return attn.wo(y.transpose(1, 2).reshape(B, T, attn.n_head * attn.head_dim))


class _Ragged:
    """The KV cache for prompts of different lengths: each prompt prefilled alone (a `_Cached` of
    one row, the very computation of decoding it alone), then one token a row per call, at the
    row's own position, attending through a mask to the row's own slots."""

    def __init__(self, model: Transformer, prompts: Sequence[Sequence[int]], length: int):
        self.model = model
        self.prompts: Sequence[Sequence[int]] | None = prompts
        self.length = length  # slots per row: the longest prompt + every token fed back
        self.device = model.rope_cos.device
        self.pos = torch.tensor([len(p) for p in prompts], device=self.device)  # each row's next slot
        self.end = max(len(p) for p in prompts)  # slots any row has filled
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def next_logits(self, new: torch.Tensor | None) -> torch.Tensor:
        if new is None:
            return self._prefill()
        return self._step(new)

    def _prefill(self) -> torch.Tensor:
        prompts, self.prompts = self.prompts, None
        assert prompts is not None, "the prompts are fed once, then one new token a call"
        logits = []
        for row, prompt in enumerate(prompts):
            alone = _Cached(self.model, torch.tensor([list(prompt)], device=self.device), len(prompt))
            logits.append(alone.next_logits(None))
            if not self.keys:  # zeros, not empty: a masked slot's value is still multiplied by 0
                self.keys = [
                    k.new_zeros(len(prompts), k.shape[1], self.length, k.shape[3]) for k in alone.keys
                ]
                self.values = [torch.zeros_like(k) for k in self.keys]
            for layer, (k, v) in enumerate(zip(alone.keys, alone.values, strict=True)):
                self.keys[layer][row, :, : len(prompt)] = k[0]
                self.values[layer][row, :, : len(prompt)] = v[0]
        return torch.cat(logits)

    def _step(self, new: torch.Tensor) -> torch.Tensor:
        model, pos = self.model, self.pos
        self.end += 1
        slots = torch.arange(self.end, device=self.device)
        mask = (slots[None, :] <= pos[:, None])[:, None, None, :]  # (B, 1, 1, end): the row's own slots
        # One position per row: the batch goes through the projections as a sequence of B tokens
        # (1, B, C), so RoPE rotates each by its own row's position.
        cos, sin = model.rope_cos[pos], model.rope_sin[pos]
        x = model.tok_emb(new[:, None])
        for layer, block in enumerate(cast("Iterable[Block]", model.blocks)):
            x = x + self._attention(layer, block.attn, block.attn_norm(x), cos, sin, mask)
            x = x + block.mlp(block.mlp_norm(x))
        self.pos = pos + 1
        return model.lm_head(model.norm(x))[:, -1, :]

    def _attention(
        self, layer: int, attn, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        B = x.shape[0]
        q, k, v = (t.transpose(0, 2) for t in attn.project(x.transpose(0, 1), cos, sin))  # (B, H, 1, D)
        rows = torch.arange(B, device=self.device)
        self.keys[layer][rows, :, self.pos] = k[:, :, 0]
        self.values[layer][rows, :, self.pos] = v[:, :, 0]
        keys, values = self.keys[layer][:, :, : self.end], self.values[layer][:, :, : self.end]
        y = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=attn.n_kv_head != attn.n_head
        )
        return attn.wo(y.transpose(1, 2).reshape(B, 1, attn.n_head * attn.head_dim))


@dataclass(frozen=True, slots=True)
class Decoded:
    completions: list[Completion]  # one per prompt, in prompt order
    truncated: bool  # the deadline passed before every row ended or reached max_new_tokens


@torch.no_grad()
def decode(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    end_token: int | None = END_TOKEN,
    deadline: float | None = None,
) -> Decoded:
    """One completion per prompt (of any lengths, in one batch), with the KV cache where prompt and
    completion fit the model's context (otherwise one prompt at a time, recomputing the prefix over
    a sliding window). `end_token` None: only max_new_tokens or the deadline (time.monotonic) stop
    a row. Greedy tokens equal those of decoding each prompt alone."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    sampler = _device_generator(generator, device) if temperature else None
    completions: list[Completion] = []
    truncated = False
    for first in range(0, len(prompts), MAX_BATCH):
        rows = prompts[first : first + MAX_BATCH]
        out = _decode_rows(model, rows, device, max_new_tokens, temperature, sampler, end_token, deadline)
        completions += out.completions
        truncated |= out.truncated
    model.train(was_training)
    return Decoded(completions, truncated)


def _decode_rows(
    model: Transformer,
    prompts: Sequence[Sequence[int]],
    device: torch.device,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator | None,
    end_token: int | None,
    deadline: float | None,
) -> Decoded:
    """One batch of `decode`: the plain cache (one length), the ragged one, or, past the model's
    context, one prompt at a time over a sliding window."""
    longest = max(len(p) for p in prompts)
    run = (max_new_tokens, temperature, generator, end_token, deadline)
    if longest + max_new_tokens - 1 <= model.shape.max_seq_len and _cacheable(model):
        decoder: _Cached | _Ragged
        if all(len(p) == longest for p in prompts):  # one length: the plain cache, no mask
            idx = torch.tensor([list(p) for p in prompts], dtype=torch.long, device=device)
            decoder = _Cached(model, idx, longest + max_new_tokens - 1)
        else:
            decoder = _Ragged(model, prompts, longest + max_new_tokens - 1)
        return _decode_loop(decoder, len(prompts), device, *run)
    completions: list[Completion] = []
    truncated = False
    for prompt in prompts:
        alone = _Recompute(model, torch.tensor([list(prompt)], dtype=torch.long, device=device))
        one = _decode_loop(alone, 1, device, *run)
        completions += one.completions
        truncated |= one.truncated
    return Decoded(completions, truncated)


def _complete_batch(
    model: Transformer,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator | None,
    kv_cache: bool,
    end_token: int = END_TOKEN,
) -> list[Completion]:
    rows, prompt_length = idx.shape
    fits = prompt_length + max_new_tokens - 1 <= model.shape.max_seq_len  # the last token is never fed back
    if kv_cache and fits and _cacheable(model):
        decoder: _Cached | _Recompute = _Cached(model, idx, prompt_length + max_new_tokens - 1)
    else:
        decoder = _Recompute(model, idx)
    out = _decode_loop(decoder, rows, idx.device, max_new_tokens, temperature, generator, end_token, None)
    return out.completions


def _decode_loop(
    decoder: "_Cached | _Ragged | _Recompute",
    rows: int,
    device: torch.device,
    max_new_tokens: int,
    temperature: float,
    generator: torch.Generator | None,
    end_token: int | None,
    deadline: float | None,
) -> Decoded:
    """Tokens until every row ends (end_token), max_new_tokens, or the deadline (then `truncated`)."""
    check_every = 1 if device.type == "cpu" else EXIT_CHECK_EVERY
    tokens = torch.zeros((rows, max_new_tokens), dtype=torch.long, device=device)
    logprobs = torch.zeros((rows, max_new_tokens), device=device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    lengths = torch.full((rows,), max_new_tokens, dtype=torch.long, device=device)
    end = -1 if end_token is None else end_token  # -1: no token id, so no row ends early
    nxt, truncated = None, False
    for t in range(max_new_tokens):
        if deadline is not None and time.monotonic() >= deadline:
            lengths.masked_fill_(~done, t)  # the rows still going keep the tokens so far
            truncated = True
            break
        with autocast(device):
            logits = decoder.next_logits(nxt)
        nxt, logp = _sample(logits.float(), temperature, generator)
        tokens[:, t] = nxt
        logprobs[:, t] = logp.gather(-1, nxt[:, None]).squeeze(-1)
        ended = (nxt == end) & ~done
        lengths.masked_fill_(ended, t + 1)  # not lengths[ended] = ...: a boolean index syncs
        done |= ended
        if (t + 1) % check_every == 0 and bool(done.all()):
            break
    return Decoded(_completions(tokens, logprobs, lengths, done), truncated and not bool(done.all()))


def _sample(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(next token per row, log-probabilities it was drawn from): greedy at temperature 0."""
    if temperature == 0:
        return logits.argmax(dim=-1), F.log_softmax(logits, dim=-1)
    logp = F.log_softmax(logits / temperature, dim=-1)
    return torch.multinomial(logp.exp(), num_samples=1, generator=generator).squeeze(-1), logp


def _completions(
    tokens: torch.Tensor, logprobs: torch.Tensor, lengths: torch.Tensor, done: torch.Tensor
) -> list[Completion]:
    """Each row cut at its length, on the host: the batch's one sync."""
    host_tokens, host_logprobs = tokens.cpu(), logprobs.cpu()
    ends: list[int] = lengths.tolist()
    finished: list[bool] = done.tolist()
    return [
        Completion(
            tokens=host_tokens[r, : ends[r]].tolist(),
            logprobs=host_logprobs[r, : ends[r]].tolist(),
            finished=finished[r],
        )
        for r in range(len(ends))
    ]
