"""The model's memory-shaped kernels (issue 40): grouped-query attention without K/V copies, and
the loss and log-prob paths without a full (B, T, vocab) float32 tensor, forward or backward."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import training.model as model_module
from contracts.manifest import Lora
from contracts.models import ModelShape
from training.data.corpora import load_text, task_problems
from training.engine.distributed import ParallelDims
from training.model import Transformer
from training.recipes.objectives import clipped_policy_loss, dpo_loss, token_logprobs
from training.recipes.posttrain import sequence_logprobs
from training.weights.lora import BaseModelView, apply_lora

GQA = ModelShape(n_layer=2, d_model=32, n_head=4, n_kv_head=2, d_ff=64, vocab_size=97, max_seq_len=32)
# A vocabulary far above d_model and B * T, so a (B, T, V) tensor stands out from every weight.
WIDE = ModelShape(n_layer=1, d_model=16, n_head=2, n_kv_head=1, d_ff=32, vocab_size=3001, max_seq_len=16)
B, T = 4, 16
CPU = torch.device("cpu")


class Ops(TorchDispatchMode):
    """Records every op's name and every output tensor's (numel, dtype)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.outputs: list[tuple[int, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.names.append(str(func.overloadpacket.__name__))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.outputs.append((t.numel(), t.dtype))
        return out

    def full_fp32_logits(self, numel: int) -> list[tuple[int, torch.dtype]]:
        return [(n, d) for n, d in self.outputs if d == torch.float32 and n >= numel]


def old_attention(attn: model_module.Attention, x, cos, sin) -> torch.Tensor:
    """The path before issue 40: K/V heads expanded with repeat_interleave."""
    b, t, _ = x.shape
    q, k, v = attn.project(x, cos, sin)
    repeat = attn.n_head // attn.n_kv_head
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attn.wo(y.transpose(1, 2).reshape(b, t, attn.n_head * attn.head_dim))


def test_a_gqa_training_step_copies_no_kv_heads_and_equals_the_expanded_path():
    torch.manual_seed(0)
    model = Transformer(GQA)
    idx = torch.randint(0, 97, (2, 24))
    with Ops() as ops:
        _, loss = model(idx, idx, return_logits=False)
        loss.backward()
    assert "repeat_interleave" not in ops.names and "mm" in ops.names
    attn = model.blocks[0].attn
    x = torch.randn(2, 24, 32)
    cos, sin = model.rope_cos[:24], model.rope_sin[:24]
    torch.testing.assert_close(attn(x, cos, sin), old_attention(attn, x, cos, sin), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("rows", "vocab", "budget", "expected"),
    [
        (64, 3001, 10_000, 3),
        (64, 3001, 1 << 24, 64),
        (5, 10, 1, 1),
        (1, 1 << 20, 1 << 24, 1),
    ],
)
def test_chunk_rows_keeps_one_chunk_of_logits_within_the_budget(rows, vocab, budget, expected):
    assert model_module.chunk_rows(rows, vocab, budget) == expected


def small_chunks(monkeypatch) -> None:
    # The default budget holds a whole tiny batch in one chunk: a few rows per chunk here.
    monkeypatch.setattr(model_module, "LOGIT_CHUNK_ELEMENTS", 5 * WIDE.vocab_size, raising=False)


@pytest.mark.parametrize("z", [0.0, 1e-3])
@pytest.mark.parametrize("tie", [False, True])
def test_the_chunked_loss_and_its_gradients_equal_the_full_logits_ones(monkeypatch, z, tie):
    small_chunks(monkeypatch)
    torch.manual_seed(0)
    model = Transformer(WIDE, z_loss=z, tie_embeddings=tie)
    idx, targets = torch.randint(0, 3001, (B, T)), torch.randint(0, 3001, (B, T))
    targets[0, :3] = -100  # ignored, as F.cross_entropy's default
    _, loss = model(idx, targets, return_logits=False)
    flat = model(idx)[0].float().view(-1, WIDE.vocab_size)
    full = F.cross_entropy(flat, targets.reshape(-1)) + z * torch.logsumexp(flat, -1).pow(2).mean()
    torch.testing.assert_close(loss, full)
    loss.backward()
    chunked = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    full.backward()
    for a, b in zip(chunked, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_log_probs_and_their_gradients_equal_the_full_logits_ones(monkeypatch, temperature):
    small_chunks(monkeypatch)
    torch.manual_seed(0)
    model = Transformer(WIDE)
    idx, targets = torch.randint(0, 3001, (B, T)), torch.randint(0, 3001, (B, T))
    new = sequence_logprobs(model, idx, targets, CPU, temperature=temperature)
    old = token_logprobs(model(idx)[0].float() / temperature, targets)
    torch.testing.assert_close(new, old)
    new.sum().backward()
    chunked = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    old.sum().backward()
    for a, b in zip(chunked, [p.grad for p in model.parameters()], strict=True):
        torch.testing.assert_close(a, b)


def test_a_lora_model_and_its_frozen_base_give_the_full_logits_log_probs(monkeypatch):
    small_chunks(monkeypatch)
    torch.manual_seed(0)
    model = apply_lora(Transformer(WIDE), Lora(rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"]))
    for layer in (model.blocks[0].attn.wq, model.blocks[0].attn.wv):
        torch.nn.init.normal_(layer.lora_B.weight)  # a non-zero update, so base and policy differ
    idx, targets = torch.randint(0, 3001, (B, T)), torch.randint(0, 3001, (B, T))
    policy = sequence_logprobs(model, idx, targets, CPU)
    base = sequence_logprobs(BaseModelView(model), idx, targets, CPU)
    torch.testing.assert_close(policy, token_logprobs(model(idx)[0], targets))
    torch.testing.assert_close(base, token_logprobs(BaseModelView(model)(idx)[0], targets))
    assert not torch.allclose(policy, base)


def probe(step) -> Ops:
    """Run `step` (forward and backward) under the op recorder; it saw the backward too."""
    with Ops() as ops:
        step()
    assert any(name.endswith("_backward") for name in ops.names), "the probe saw the backward"
    return ops


def test_a_dpo_step_makes_no_full_float32_logits(monkeypatch):
    small_chunks(monkeypatch)
    torch.manual_seed(0)
    policy, reference = Transformer(WIDE), Transformer(WIDE).eval().requires_grad_(False)
    inputs, targets = torch.randint(0, 3001, (B, T)), torch.randint(0, 3001, (B, T))
    mask = torch.ones(B, T)

    def step() -> None:
        with torch.no_grad():
            ref = (sequence_logprobs(reference, inputs, targets, CPU) * mask).sum(-1)
        pol = (sequence_logprobs(policy, inputs, targets, CPU) * mask).sum(-1)
        loss, _, _ = dpo_loss(pol[:2], pol[2:], ref[:2], ref[2:], beta=0.1)
        loss.backward()

    assert probe(step).full_fp32_logits(B * T * WIDE.vocab_size) == []


def test_a_grpo_loss_step_makes_no_full_float32_logits(monkeypatch):
    small_chunks(monkeypatch)
    torch.manual_seed(0)
    model = Transformer(WIDE)
    inputs, targets = torch.randint(0, 3001, (B, T)), torch.randint(0, 3001, (B, T))
    old, mask, advantages = torch.randn(B, T) - 8.0, torch.ones(B, T), torch.randn(B)

    def step() -> None:
        logprobs = sequence_logprobs(model, inputs, targets, CPU, temperature=0.9)
        loss, _ = clipped_policy_loss(logprobs, old, advantages, mask, 0.2, 0.28)
        loss.backward()

    assert probe(step).full_fp32_logits(B * T * WIDE.vocab_size) == []


def test_the_pretraining_loss_step_makes_no_full_float32_logits(monkeypatch):
    small_chunks(monkeypatch)
    torch.manual_seed(0)
    model = Transformer(WIDE, z_loss=1e-4)
    inputs, targets = torch.randint(0, 3001, (B, T)), torch.randint(0, 3001, (B, T))

    def step() -> None:
        _, loss = model(inputs, targets, return_logits=False)
        loss.backward()

    assert probe(step).full_fp32_logits(B * T * WIDE.vocab_size) == []


def test_build_model_builds_from_scratch_on_meta_and_inits_by_seed_and_name(monkeypatch):
    from training.recipes import pretrain

    built_on: list[torch.device] = []
    original = Transformer.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built_on.append(next(self.parameters()).device)

    monkeypatch.setattr(Transformer, "__init__", recording)

    def build(seed: int, lora: Lora | None = None) -> Transformer:
        torch.manual_seed(seed)
        return pretrain.build_model(GQA, seq_len=32, device=CPU, lora=lora)

    first, again, other = build(3), build(3), build(4)
    assert built_on == [torch.device("meta")] * 3  # no rank ever holds a full random copy on a host
    for (name, a), b, c in zip(
        first.state_dict().items(), again.state_dict().values(), other.state_dict().values(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
        if a.dim() >= 2:
            assert not torch.equal(a, c), name
    # The per-parameter init keeps the scale of reset_parameters, and LoRA's adapters start as they do.
    assert first.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    adapted = build(3, Lora(rank=2, target_modules=["q_proj"]))
    torch.testing.assert_close(adapted.blocks[0].attn.wq.weight, first.blocks[0].attn.wq.weight)
    assert adapted.blocks[0].attn.wq.lora_A.weight.abs().sum() > 0
    assert torch.count_nonzero(adapted.blocks[0].attn.wq.lora_B.weight) == 0


@pytest.mark.parametrize(
    ("device_type", "dtype"), [("cuda", torch.bfloat16), ("cpu", torch.float32), ("mps", torch.float32)]
)
def test_the_dpo_reference_is_bf16_on_cuda_and_float32_elsewhere(device_type, dtype):
    from training.recipes.dpo_reference import reference_dtype

    assert reference_dtype(device_type) == dtype


@pytest.mark.parametrize(
    ("policy", "reference"),
    [
        (ParallelDims(), ParallelDims()),
        (ParallelDims(strategy="fsdp2", dp_shard=4), ParallelDims(strategy="fsdp2", dp_shard=4)),
        (
            ParallelDims(strategy="hsdp", dp_replicate=2, dp_shard=4),
            ParallelDims(strategy="hsdp", dp_replicate=2, dp_shard=4),
        ),
        (
            ParallelDims(strategy="fsdp2+tp", dp_shard=2, tp=2),
            ParallelDims(strategy="fsdp2+tp", dp_shard=2, tp=2),
        ),
        (ParallelDims(strategy="ddp", dp_replicate=4), ParallelDims(strategy="fsdp2", dp_shard=4)),
    ],
)
def test_the_dpo_reference_is_sharded_like_the_policy(policy, reference):
    from training.recipes.dpo_reference import reference_dims

    assert reference_dims(policy) == reference


def test_the_dpo_reference_on_one_cpu_rank_is_the_float32_frozen_incoming_model(tmp_path):
    from training.recipes import dpo_reference, posttrain, pretrain

    cfg = posttrain.PostConfig(
        stage="dpo", shape=GQA, rope_base=None, problems=task_problems(load_text("generated:small_arithmetic")), steps=1, batch_size=2,
        learning_rate=1e-3, seed=5, checkpoint_dir=str(tmp_path), checkpoint_interval=1000,
    )  # fmt: skip
    reference = dpo_reference.frozen_reference(cfg, posttrain.dims_of(cfg), 32, CPU)
    torch.manual_seed(5)
    policy = pretrain.build_model(GQA, seq_len=32, device=CPU)  # as the stage builds its policy
    assert {p.dtype for p in reference.parameters()} == {torch.float32}
    assert not any(p.requires_grad for p in reference.parameters()) and not reference.training
    inputs, targets = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    torch.testing.assert_close(
        sequence_logprobs(reference, inputs, targets, CPU),
        sequence_logprobs(policy, inputs, targets, CPU).detach(),
        rtol=0,
        atol=0,
    )
