"""Batched sampling of short completions, shared by the eval battery (greedy) and the rollout
worker (sampled, with the behaviour policy's log-probabilities).

The model has no padding mask, so prompts are batched by length: every row of a forward pass has
the same prompt length and no pad token ever reaches attention. Completions end at END_TOKEN.
No KV cache: the completions here are a few dozen tokens from a small model, where recomputing the
prefix costs less than the cache's bookkeeping; a serving engine takes over at scale.
"""

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from services.trainer.loop import autocast
from services.trainer.model import Transformer

END_TOKEN = ord("\n")  # a task answer ends with a newline, as every generated task line does
MAX_BATCH = 256  # rows per forward pass; lower it if a long-context eval runs out of memory


@dataclass(frozen=True, slots=True)
class Completion:
    tokens: list[int]  # the response, END_TOKEN included when it ended
    logprobs: list[float]  # behaviour-policy log-probability of each response token
    finished: bool  # False: cut off at max_new_tokens


@torch.no_grad()
def complete(
    model: Transformer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[Completion]:
    """One completion per prompt, in prompt order. temperature 0 is greedy; otherwise tokens are
    sampled from softmax(logits / temperature) with `generator` (CPU), so a seed fixes the result."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    by_length: dict[int, list[int]] = defaultdict(list)
    for i, prompt in enumerate(prompts):
        by_length[len(prompt)].append(i)
    results: list[Completion | None] = [None] * len(prompts)
    for length in sorted(by_length):
        indices = by_length[length]
        for first in range(0, len(indices), MAX_BATCH):
            rows = indices[first : first + MAX_BATCH]
            batch = torch.tensor([list(prompts[i]) for i in rows], dtype=torch.long, device=device)
            for i, completion in zip(rows, _complete_batch(model, batch, max_new_tokens, temperature, generator), strict=True):
                results[i] = completion
    model.train(was_training)
    return results  # type: ignore[return-value]


def _complete_batch(model: Transformer, idx: torch.Tensor, max_new_tokens: int, temperature: float,
                    generator: torch.Generator | None) -> list[Completion]:
    device = idx.device
    rows = idx.shape[0]
    tokens = torch.zeros((rows, max_new_tokens), dtype=torch.long)
    logprobs = torch.zeros((rows, max_new_tokens))
    done = torch.zeros(rows, dtype=torch.bool)
    lengths = torch.full((rows,), max_new_tokens, dtype=torch.long)
    for t in range(max_new_tokens):
        with autocast(device):
            logits, _ = model(idx[:, -model.shape.max_seq_len :])
        logits = logits[:, -1, :].float().cpu()
        if temperature == 0:
            nxt = logits.argmax(dim=-1)
            logp = F.log_softmax(logits, dim=-1)
        else:
            logp = F.log_softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(logp.exp(), num_samples=1, generator=generator).squeeze(-1)
        tokens[:, t] = nxt
        logprobs[:, t] = logp.gather(-1, nxt[:, None]).squeeze(-1)
        ended = (nxt == END_TOKEN) & ~done
        lengths[ended] = t + 1
        done |= ended
        if bool(done.all()):
            break
        idx = torch.cat((idx, nxt[:, None].to(device)), dim=1)
    return [
        Completion(tokens=tokens[r, : lengths[r]].tolist(), logprobs=logprobs[r, : lengths[r]].tolist(), finished=bool(done[r]))
        for r in range(rows)
    ]
