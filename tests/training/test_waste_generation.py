"""Generation with the KV cache: the same greedy tokens as recomputing the prefix, sampling fixed by
its seed, the uncached path where a completion would outgrow the model's context."""

import pytest
import torch

from contracts.models import MODEL_SHAPES, ModelShape
from training.data.corpora import ByteTokenizer, load_text, task_problems
from training.engine.reporting import Recorder
from training.model import Transformer
from training.recipes.generation import END_TOKEN, complete
from training.recipes.pretrain import StageConfig, train_stage

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
GQA = ModelShape(
    n_layer=3, d_model=64, n_head=4, n_kv_head=2, d_ff=128, vocab_size=256, max_seq_len=48, rope_base=10000.0
)


@pytest.fixture(scope="module")
def arithmetic_model(tmp_path_factory) -> Transformer:
    """A tiny model that has seen single-digit sums: its completions end in a newline, at different lengths."""
    cfg = StageConfig(
        stage="pretrain",
        shape=MODEL_SHAPES["tiny"],
        train_sources=["generated:small_arithmetic"],
        seq_len=32,
        batch_size=16,
        learning_rate=3e-3,
        steps=80,
        warmup_steps=4,
        seed=0,
        checkpoint_dir=str(tmp_path_factory.mktemp("gen")),
        checkpoint_interval=1000,
        eval_max_batches=1,
    )
    return train_stage(cfg, Recorder(), lambda: False).model


def random_prompts(n: int, seed: int = 7) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (int(length),), generator=g).tolist()
        for length in torch.randint(1, 12, (n,), generator=g)
    ]


def fields(completions) -> list[tuple[list[int], bool]]:
    return [(c.tokens, c.finished) for c in completions]


def assert_logprobs_close(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        assert len(x.logprobs) == len(y.logprobs)
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [MODEL_SHAPES["tiny"], GQA], ids=["tiny", "grouped-query"])
def test_greedy_tokens_are_the_same_with_and_without_the_cache(shape):
    torch.manual_seed(1)
    model = Transformer(shape)
    prompts = random_prompts(24)
    cached = complete(model, prompts, max_new_tokens=20)
    uncached = complete(model, prompts, max_new_tokens=20, kv_cache=False)
    assert fields(cached) == fields(uncached)
    assert_logprobs_close(cached, uncached)


def test_greedy_answers_end_where_they_did_without_the_cache(arithmetic_model):
    tok = ByteTokenizer()
    problems = sorted(set(task_problems(load_text("generated:small_arithmetic"))))[::10]
    # Partial problems ("3+", "7") make the model write more before its newline: rows end at different steps.
    prompts = [tok.encode(p) for p, _ in problems] + [tok.encode(p) for p in ("12", "3+", "Q", "99+99=", "7")]
    cached = complete(arithmetic_model, prompts, max_new_tokens=6)
    assert fields(cached) == fields(complete(arithmetic_model, prompts, max_new_tokens=6, kv_cache=False))
    assert_logprobs_close(cached, complete(arithmetic_model, prompts, max_new_tokens=6, kv_cache=False))
    ended = [c for c in cached if c.finished]
    assert (
        len(ended) > len(cached) // 2 and len({len(c.tokens) for c in ended}) > 1
    )  # rows end at different steps
    assert all(c.tokens[-1] == END_TOKEN and END_TOKEN not in c.tokens[:-1] for c in ended)
    assert all(len(c.tokens) == len(c.logprobs) for c in cached)


def test_sampling_is_fixed_by_the_seed(arithmetic_model):
    prompts = [ByteTokenizer().encode(p) for p in ("3+4=", "9+9=", "1+0=")] * 8

    def sample(seed: int, **kw):
        return complete(
            arithmetic_model,
            prompts,
            max_new_tokens=8,
            temperature=1.0,
            generator=torch.Generator().manual_seed(seed),
            **kw,
        )

    first = sample(5)
    assert fields(sample(5)) == fields(first) and [c.logprobs for c in sample(5)] == [
        c.logprobs for c in first
    ]
    assert fields(sample(6)) != fields(first)
    # On CPU the cache changes no sample: the same generator draws from (nearly) the same logits.
    assert fields(sample(5, kv_cache=False)) == fields(first)


def test_a_completion_longer_than_the_context_slides_the_window_uncached():
    torch.manual_seed(2)
    model = Transformer(GQA)
    prompts = [list(range(40, 80))] * 2 + [[5, 6, 7]]  # 40 + 30 > 48 positions; 3 + 30 fits
    out = complete(model, prompts, max_new_tokens=30)
    assert fields(out) == fields(complete(model, prompts, max_new_tokens=30, kv_cache=False))
    assert all(len(c.tokens) <= 30 for c in out)


def test_the_model_comes_back_in_its_mode():
    model = Transformer(GQA).train()
    complete(model, [[1, 2, 3]], max_new_tokens=2)
    assert model.training
