"""The stages' optimizers are fused AdamW (one kernel for the whole update), and a fused step is
the step the default (foreach) AdamW takes."""

import copy

import torch

from contracts.models import MODEL_SHAPES
from training.model import Transformer
from training.recipes.posttrain import adamw
from training.recipes.pretrain import StageConfig, build_optimizer


def config() -> StageConfig:
    return StageConfig(
        stage="pretrain",
        shape=MODEL_SHAPES["tiny"],
        train_sources=["generated:arithmetic"],
        seq_len=16,
        batch_size=2,
        learning_rate=1e-3,
        steps=1,
        checkpoint_dir="unused",
    )


def test_pretrain_and_post_training_build_fused_adamw():
    model = Transformer(MODEL_SHAPES["tiny"])
    assert build_optimizer(model, config()).defaults["fused"] is True
    assert adamw(model, 1e-4).defaults["fused"] is True  # SFT, DPO and RLVR (rlvr.py builds with it)


def test_a_fused_step_is_the_foreach_step():
    torch.manual_seed(0)
    model = Transformer(MODEL_SHAPES["tiny"])
    other = copy.deepcopy(model)
    fused = build_optimizer(model, config())
    plain = torch.optim.AdamW(
        [
            {"params": [p for p in other.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in other.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1e-3,
        betas=(0.9, 0.95),
        foreach=True,
    )
    x = torch.randint(0, MODEL_SHAPES["tiny"].vocab_size, (2, 16))
    for _ in range(2):
        for m, opt in ((model, fused), (other, plain)):
            opt.zero_grad()
            m(x, x)[1].backward()
            opt.step()
    for p, q in zip(model.parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(p, q)
