"""`ecc ito sample` decodes with the KV cache (issue 40): the prompt through the model once, then one
position per token; the same greedy tokens as recomputing the whole prefix; several prompts of
different lengths in one batch give what each gives alone; a deadline that passes mid-decoding
answers the tokens so far and says `truncated`; grouped-query attention reads the cache's n_kv_head
heads without expanding them."""

import types

import pytest
import torch

from contracts.exports import SampleRequest
from contracts.models import MODEL_SHAPES, ModelShape
from services.trainer import restore, sampling
from training.model import Transformer
from training.recipes import generation

GQA = ModelShape(
    n_layer=2, d_model=64, n_head=4, n_kv_head=2, d_ff=128, vocab_size=256, max_seq_len=48, rope_base=10000.0
)
FAR = 1e18  # a deadline that never passes


def model_of(shape: ModelShape, seed: int = 1) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(shape).eval()


def prompts(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 256, (int(k),), generator=g).tolist()
        for k in torch.randint(1, 14, (n,), generator=g)
    ]


@torch.no_grad()
def full_prefix_greedy(model: Transformer, ids: list[int], n: int) -> list[int]:
    """The old `sample`: a forward over the whole prefix for every new token."""
    context, out = torch.tensor([ids]), []
    for _ in range(n):
        logits, _ = model(context[:, -model.shape.max_seq_len :])
        nxt = int(logits[0, -1].float().argmax())
        out.append(nxt)
        context = torch.cat((context, torch.tensor([[nxt]])), dim=1)
    return out


def greedy(
    model: Transformer, batch: list[list[int]], n: int, eos: int | None = None
) -> "sampling.Generated":
    return sampling.generate_batch(
        model, batch, max_new_tokens=n, temperature=0, seed=0, eos_id=eos, deadline=FAR
    )


def test_the_prefix_goes_through_the_model_once_then_one_token_a_step():
    model = model_of(MODEL_SHAPES["tiny"])
    lengths: list[int] = []
    model.tok_emb.register_forward_hook(lambda _m, args, _out: lengths.append(args[0].shape[1]))
    sampling.generate(
        model, list(range(1, 8)), max_new_tokens=5, temperature=0, seed=0, eos_id=None, deadline=FAR
    )
    assert lengths == [7, 1, 1, 1, 1]  # not 7, 8, 9, 10, 11: the cache holds the prefix


@pytest.mark.parametrize("shape", [MODEL_SHAPES["tiny"], GQA], ids=["tiny", "grouped-query"])
def test_greedy_tokens_are_those_of_recomputing_the_prefix(shape):
    model = model_of(shape)
    for ids in prompts(6):
        assert sampling.generate(
            model, ids, max_new_tokens=12, temperature=0, seed=0, eos_id=None, deadline=FAR
        ) == full_prefix_greedy(model, ids, 12)


@pytest.mark.parametrize("shape", [MODEL_SHAPES["tiny"], GQA], ids=["tiny", "grouped-query"])
def test_a_batch_of_prompts_of_different_lengths_gives_what_each_gives_alone(shape):
    model = model_of(shape)
    batch = prompts(7)
    assert len({len(p) for p in batch}) > 2
    together = greedy(model, batch, 15)
    assert together.tokens == [greedy(model, [p], 15).tokens[0] for p in batch]
    assert not together.truncated
    # each row stops at its own end-of-sequence token, the others go on
    eos = together.tokens[0][3]
    ended = greedy(model, batch, 15, eos=eos)
    assert ended.tokens == [greedy(model, [p], 15, eos=eos).tokens[0] for p in batch]
    assert ended.tokens[0] == together.tokens[0][: together.tokens[0].index(eos)]


def test_a_batch_decodes_every_row_in_one_forward_a_step():
    model = model_of(GQA)
    batch = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [9]]
    shapes: list[tuple[int, int]] = []
    model.tok_emb.register_forward_hook(lambda _m, args, _out: shapes.append(tuple(args[0].shape)))
    greedy(model, batch, 6)
    # each prompt's prefill alone, then one forward a step for the three rows together
    assert shapes == [(1, 3), (1, 8), (1, 1)] + [(3, 1)] * 5


def stepping_clock(monkeypatch, passes_after: int) -> None:
    """generation's clock reads 0 for `passes_after` looks, then far past any deadline."""
    looks = iter(range(10**6))
    clock = types.SimpleNamespace(monotonic=lambda: 0.0 if next(looks) < passes_after else 2 * FAR)
    monkeypatch.setattr(generation, "time", clock)


def test_a_deadline_mid_decoding_answers_the_tokens_so_far_and_says_truncated(monkeypatch):
    model = model_of(MODEL_SHAPES["tiny"])
    batch = prompts(3)
    free = greedy(model, batch, 10)
    stepping_clock(monkeypatch, passes_after=4)
    cut = sampling.generate_batch(
        model, batch, max_new_tokens=10, temperature=0, seed=0, eos_id=None, deadline=1.0
    )
    assert cut.truncated and cut.tokens == [t[:4] for t in free.tokens]


def test_the_sample_answer_says_the_deadline_cut_it(monkeypatch):
    model = model_of(MODEL_SHAPES["tiny"])
    tokenizer = types.SimpleNamespace(
        encode=lambda text: [ord(c) for c in text], decode=lambda ids: repr(ids)
    )
    monkeypatch.setattr(restore, "load_run_tokenizer", lambda src, root: tokenizer)
    monkeypatch.setattr(restore, "eos_id_of", lambda tok: None)
    sampler = sampling.Sampler(None, loader=lambda src, root: (model, types.SimpleNamespace(step=3)))  # type: ignore[arg-type]
    src = types.SimpleNamespace(
        run_id="run_1", stage=types.SimpleNamespace(name="pretrain"), checkpoint=types.SimpleNamespace(step=3)
    )
    req = SampleRequest(run_id="run_1", prompt="12+35=", max_new_tokens=8)
    whole = sampler.sample(src, req)  # type: ignore[arg-type]
    assert whole.tokens == 8 and not whole.truncated
    stepping_clock(monkeypatch, passes_after=3)
    cut = sampler.sample(src, req)  # type: ignore[arg-type]
    assert cut.truncated and cut.tokens == 3


def test_the_cache_reads_grouped_query_heads_without_expanding_them(monkeypatch):
    model = model_of(GQA)
    batch = prompts(5)
    same_length = [p[:1] + p for p in [[9, 8, 7]] * 3]
    before = generation.complete(model, batch + same_length, max_new_tokens=10, kv_cache=False)
    before_ragged = [full_prefix_greedy(model, p, 10) for p in batch]

    def probe(*args, **kwargs):
        raise AssertionError("K/V expanded with repeat_interleave")

    monkeypatch.setattr(torch.Tensor, "repeat_interleave", probe)
    monkeypatch.setattr(torch, "repeat_interleave", probe)
    cached = generation.complete(model, batch + same_length, max_new_tokens=10)
    assert [c.tokens for c in cached] == [c.tokens for c in before]
    assert greedy(model, batch, 10).tokens == before_ragged
