"""The rollout engine port (issue 41, item 3): the worker samples only through `generate` and loads
weights only through `load_weights`, so any engine behind the port serves it; the engine here is the
trainer's KV-cache decoder."""

import pytest
import torch

from contracts.models import MODEL_SHAPES
from training.model import Transformer
from training.recipes.generation import Completion, complete
from training.recipes.rollout import RolloutRequest, serve
from training.recipes.rollout_engine import KvCacheEngine, RolloutEngine, Sampling

TINY = MODEL_SHAPES["tiny"]


class FakeEngine:
    """An engine that is not our decoder: what a vLLM-backed engine would be to the worker."""

    def __init__(self) -> None:
        self.version = -1
        self.asked: list[tuple[list[list[int]], Sampling]] = []

    def generate(self, prompts, sampling):
        self.asked.append(([list(p) for p in prompts], sampling))
        return [
            Completion(tokens=[len(p), i], logprobs=[-0.5, -0.25], finished=True)
            for i, p in enumerate(prompts)
        ]

    def load_weights(self, version, tensors):
        self.version = version


def test_the_worker_serves_a_request_through_any_engine_behind_the_port():
    engine: RolloutEngine = FakeEngine()
    engine.load_weights(7, {})
    request = RolloutRequest(
        request_id="r1", prompts=[[1, 2], [3]], group_size=2, max_new_tokens=5, temperature=0.7, seed=11
    )
    batch = serve(engine, request)
    assert batch.version == 7 and batch.request_id == "r1" and batch.prompts == [[1, 2], [3]]
    assert [[c.tokens for c in group] for group in batch.groups] == [[[2, 0], [2, 1]], [[1, 2], [1, 3]]]
    [(prompts, sampling)] = engine.asked  # one call: every prompt's group, batched
    assert prompts == [[1, 2], [1, 2], [3], [3]]
    assert sampling == Sampling(max_new_tokens=5, temperature=0.7, seed=11)


def test_the_kv_cache_engine_samples_as_the_decoder_and_loads_weights_by_version():
    torch.manual_seed(0)
    model = Transformer(TINY)
    engine = KvCacheEngine(model)
    assert engine.version == -1
    prompts = [[10, 20, 30], [40, 50]]
    sampling = Sampling(max_new_tokens=6, temperature=1.0, seed=3)
    got = engine.generate(prompts, sampling)
    want = complete(
        model, prompts, max_new_tokens=6, temperature=1.0, generator=torch.Generator().manual_seed(3)
    )
    assert [c.tokens for c in got] == [c.tokens for c in want]
    assert [c.logprobs for c in got] == [c.logprobs for c in want]

    torch.manual_seed(1)
    other = Transformer(TINY).state_dict()
    engine.load_weights(4, other)
    assert engine.version == 4
    assert all(torch.equal(model.state_dict()[k], v) for k, v in other.items())
    with pytest.raises(RuntimeError, match="Missing key"):
        engine.load_weights(5, {k: v for k, v in other.items() if k != "norm.weight"})
    assert engine.version == 4  # a refused update leaves the version it had


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"max_new_tokens": 0}, "at least 1 token"),
        ({"max_new_tokens": 4, "temperature": -0.1}, "cannot be negative"),
    ],
)
def test_sampling_is_checked(fields, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**fields)
