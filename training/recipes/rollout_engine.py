"""The rollout engine port: the one interface RLVR's rollout worker samples through, and the engine
behind it here, the trainer's own KV-cache decoder.

The port is shaped as the production engines' weight-synced generation is (verl's rollout workers,
TRL's vLLM server mode): `generate(prompts, sampling)` takes token ids and returns, per prompt, the
completion's token ids with the behaviour policy's log-probability of each (what GRPO's importance
ratio needs), and `load_weights(version, tensors)` replaces the policy's weights in place, by name,
and records the version every later completion was sampled from (vLLM's offline engine takes its
updates the same way: `llm.collective_rpc` / `model.load_weights(weights=[(name, tensor), ...])`).
The worker never touches a model: it loads weights and serves requests through this port, so an
engine that keeps its weights on a GPU behind its own scheduler fits without the worker changing.

`KvCacheEngine` is the one engine built: training/recipes/generation.py's batched KV-cache decoder
over the trainer's `Transformer`. A vLLM engine is not built: vLLM is a CUDA build that cannot run
on these machines, and an adapter nobody has run is not done.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from training.model import Transformer
from training.recipes.generation import END_TOKEN, Completion, complete


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """How to sample: the decode bound, the temperature (0: greedy), the seed that fixes the draws,
    and the token that ends a completion."""

    max_new_tokens: int
    temperature: float = 1.0
    seed: int = 0
    end_token: int = END_TOKEN

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError("A rollout needs to sample at least 1 token.")
        if self.temperature < 0:
            raise ValueError(f"The sampling temperature cannot be negative, not {self.temperature}.")


class RolloutEngine(Protocol):
    """What the rollout worker samples through (see the module docstring)."""

    @property
    def version(self) -> int:
        """The policy version of the weights loaded last (-1 before any)."""
        ...

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        """One completion per prompt, in prompt order: token ids and their log-probabilities."""
        ...

    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Replace the policy's weights (every name of the model's state dict) with `tensors`."""
        ...


class KvCacheEngine:
    """The trainer's KV-cache decoder behind the port: a `Transformer` in eval mode, prompts decoded
    in batches (generation.complete), weights loaded in place by name."""

    def __init__(self, model: Transformer) -> None:
        self.model = model.eval()
        self._version = -1

    @property
    def version(self) -> int:
        return self._version

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        return complete(
            self.model,
            prompts,
            max_new_tokens=sampling.max_new_tokens,
            temperature=sampling.temperature,
            generator=torch.Generator().manual_seed(sampling.seed),
            end_token=sampling.end_token,
        )

    def load_weights(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self.model.load_state_dict(dict(tensors))  # strict: a missing or stray name is an error
        self._version = version
