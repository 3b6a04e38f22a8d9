"""A stage's speed settings change how fast its step runs, not its numbers: activation checkpointing
and per-block compile keep the loss, the gradients and the state-dict keys (checkpoints, DCP and
the HF export read the same names); gradient accumulation over micro-batches gives the whole
batch's gradients and losses, for the next-token stage, SFT and DPO."""

import pathlib

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from contracts.models import MODEL_SHAPES
from contracts.runs import Metrics
from training.data.corpora import load_text, task_problems
from training.engine.checkpoint_load import load_weights
from training.engine.reporting import Recorder
from training.engine.speed import Speed, compiles, fitted, is_compiled, micro_steps
from training.model import Transformer
from training.recipes.posttrain import PostConfig, train_dpo, train_sft
from training.recipes.pretrain import StageConfig, _lm_step, build_model, train_stage
from training.weights.hf_export import hf_state_for_export

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

TINY = MODEL_SHAPES["tiny"]
SMALL = "generated:small_arithmetic"
CPU = torch.device("cpu")


def never() -> bool:
    return False


def plain_names(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Parameters by their state-dict names (without the wrappers' prefixes)."""
    return {
        n.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""): p
        for n, p in model.named_parameters()
    }


def loss_and_grads(
    model: Transformer, x: torch.Tensor, y: torch.Tensor
) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    _, loss = model(x, y)
    assert loss is not None
    loss.backward()
    return float(loss.detach()), {
        n: p.grad.clone() for n, p in plain_names(model).items() if p.grad is not None
    }


def batch(rows: int = 8, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, TINY.vocab_size, (rows, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        (
            {"activation_checkpointing": "some"},
            "Activation checkpointing needs to be one of none, selective, full",
        ),
        ({"micro_batch": 0}, "A micro-batch needs to be at least 1 sequence."),
    ],
)
def test_bad_speed_is_refused_in_a_sentence(fields, words):
    with pytest.raises(ValueError, match=words):
        Speed(**fields)


@pytest.mark.parametrize(
    ("compile_", "device", "want"),
    [(None, "cuda", True), (None, "cpu", False), (True, "cpu", True), (False, "cuda", False)],
)
def test_compile_is_on_for_cuda_unless_the_stage_says(compile_, device, want):
    assert compiles(Speed(compile=compile_), device) is want


@pytest.mark.parametrize(
    ("rows", "micro", "want"), [(8, None, 1), (8, 2, 4), (8, 8, 1), (6, 3, 2), (1, 1, 1)]
)
def test_micro_steps_split_the_per_rank_batch(rows, micro, want):
    assert micro_steps(rows, Speed(micro_batch=micro)) == want


@pytest.mark.parametrize(
    ("micro", "rows", "want"),
    [(None, 8, None), (4, 8, 4), (4, 6, 3), (3, 8, 2), (8, 4, 4), (5, 7, 1), (1, 5, 1)],
)
def test_a_stage_of_its_own_batch_gets_the_largest_micro_batch_that_divides_it(micro, rows, want):
    # A post-training stage's batch is its own: the plan's micro-batch (sized for the next-token
    # stages) is lowered to a divisor, never raised past what the memory model fitted.
    assert fitted(Speed(micro_batch=micro, activation_checkpointing="full"), rows) == Speed(
        micro_batch=want, activation_checkpointing="full"
    )


def test_a_micro_batch_that_does_not_divide_the_per_rank_batch_is_refused(tmp_path):
    with pytest.raises(
        ValueError, match="A micro-batch of 3 sequences does not divide the per-rank batch of 8"
    ):
        train_stage(lm_config(tmp_path, Speed(micro_batch=3)), Recorder(), never)


@pytest.mark.parametrize(("policy", "wrapped"), [("full", [0, 1]), ("selective", [0]), ("none", [])])
def test_activation_checkpointing_wraps_blocks_and_keeps_loss_grads_and_keys(policy, wrapped):
    torch.manual_seed(0)
    plain = build_model(TINY, seq_len=16, device=CPU)
    torch.manual_seed(0)
    checkpointed = build_model(TINY, seq_len=16, device=CPU, speed=Speed(activation_checkpointing=policy))
    blocks = list(checkpointed.blocks)
    assert [i for i, b in enumerate(blocks) if isinstance(b, CheckpointWrapper)] == wrapped
    assert list(checkpointed.state_dict()) == list(plain.state_dict())
    for (name, a), b in zip(plain.state_dict().items(), checkpointed.state_dict().values(), strict=True):
        assert torch.equal(a, b), f"{name}: checkpointing the blocks changed the seed's initial weights"
    checkpointed.load_state_dict(plain.state_dict())  # a plain checkpoint loads into it, and back
    plain.load_state_dict(checkpointed.state_dict())
    x, y = batch()
    loss, grads = loss_and_grads(plain, x, y)
    loss_ac, grads_ac = loss_and_grads(checkpointed, x, y)
    assert loss_ac == pytest.approx(loss, rel=1e-6)
    assert grads_ac.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grads_ac[name], grad, rtol=1e-5, atol=1e-7)


def lm_config(root: pathlib.Path, speed: Speed, steps: int = 3) -> StageConfig:
    return StageConfig(
        stage="pretrain",
        shape=TINY,
        train_sources=[SMALL],
        seq_len=16,
        batch_size=8,
        learning_rate=3e-3,
        steps=steps,
        checkpoint_dir=str(root / "pretrain"),
        checkpoint_interval=1000,
        eval_max_batches=1,
        device="cpu",
        speed=speed,
    )


def losses(recorder: Recorder) -> list[float]:
    return [m.loss for m in recorder.of(Metrics)]


def test_compiled_blocks_train_as_eager_and_checkpoint_the_same_keys(tmp_path):
    eager, compiled = Recorder(), Recorder()
    train_stage(lm_config(tmp_path / "eager", Speed(compile=False), steps=2), eager, never)
    speed = Speed(compile=True, activation_checkpointing="full")
    result = train_stage(lm_config(tmp_path / "compiled", speed, steps=2), compiled, never)
    model = result.model
    assert model is not None
    assert all(is_compiled(block) for block in model.blocks)
    assert losses(compiled) == pytest.approx(losses(eager), rel=1e-4)
    plain = Transformer(TINY)
    assert list(model.state_dict()) == list(plain.state_dict())
    # Its DCP checkpoint loads into a plain model, and the HF export reads the same names.
    assert load_weights(str(tmp_path / "compiled" / "pretrain"), plain) is not None
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(tensor, model.state_dict()[name])
    assert (
        hf_state_for_export(model.state_dict(), TINY).keys()
        == hf_state_for_export(plain.state_dict(), TINY).keys()
    )


def test_next_token_micro_batches_give_the_whole_batch_gradients():
    torch.manual_seed(0)
    model = build_model(TINY, seq_len=16, device=CPU)
    x, y = batch()
    grads = {}
    for micro in (None, 2):
        model.zero_grad(set_to_none=True)
        out = _lm_step(model, (x, y), CPU, speed=Speed(micro_batch=micro))
        assert out.loss is not None
        out.loss.backward()
        reported = out.loss if out.report_loss is None else out.report_loss
        grads[micro] = (float(reported.detach()), {n: p.grad.clone() for n, p in model.named_parameters()})
    (whole_loss, whole), (micro_loss, accumulated) = grads[None], grads[2]
    assert micro_loss == pytest.approx(whole_loss, rel=1e-6)
    for name, grad in whole.items():
        torch.testing.assert_close(accumulated[name], grad, rtol=1e-4, atol=1e-7)


def test_next_token_stage_accumulating_four_micro_batches_trains_as_the_whole_batch(tmp_path):
    whole, micro = Recorder(), Recorder()
    a = train_stage(lm_config(tmp_path / "whole", Speed()), whole, never)
    b = train_stage(lm_config(tmp_path / "micro", Speed(micro_batch=2)), micro, never)
    assert len(losses(micro)) == 3
    assert losses(micro) == pytest.approx(losses(whole), rel=1e-4)
    assert a.model is not None and b.model is not None
    for name, tensor in a.model.state_dict().items():
        torch.testing.assert_close(b.model.state_dict()[name], tensor, rtol=1e-3, atol=1e-5)


def post_config(stage: str, root: pathlib.Path, speed: Speed) -> PostConfig:
    return PostConfig(
        stage=stage,
        shape=TINY,
        rope_base=None,
        problems=task_problems(load_text(SMALL)),
        steps=3,
        batch_size=8,
        learning_rate=1e-3,
        seed=0,
        checkpoint_dir=str(root / stage),
        checkpoint_interval=1000,
        device="cpu",
        speed=speed,
    )


@pytest.mark.parametrize(("stage", "train"), [("sft", train_sft), ("dpo", train_dpo)])
def test_post_stage_accumulating_four_micro_batches_trains_as_the_whole_batch(tmp_path, stage, train):
    whole, micro = Recorder(), Recorder()
    a = train(post_config(stage, tmp_path / "whole", Speed()), whole, never)
    b = train(post_config(stage, tmp_path / "micro", Speed(micro_batch=2)), micro, never)
    assert len(losses(micro)) == 3
    assert losses(micro) == pytest.approx(losses(whole), rel=1e-4)
    assert a.model is not None and b.model is not None
    for name, tensor in a.model.state_dict().items():
        torch.testing.assert_close(b.model.state_dict()[name], tensor, rtol=1e-3, atol=1e-5)
