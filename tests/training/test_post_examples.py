"""Post-training on tokenized examples (the field's chat and preference rows, already rendered by a
tokenizer's chat template): batches carry exactly the learnt tokens, a DPO batch is chosen rows then
rejected rows with only the completions learnt, and SFT on examples lowers their loss."""

import torch

from contracts.models import MODEL_SHAPES
from training.engine.reporting import Reporter
from training.recipes.posttrain import (
    PostConfig,
    dpo_batch,
    longest_sequence,
    pair_examples,
    token_batch,
    train_sft,
)

PAD = 9


def test_token_batch_learns_only_the_marked_tokens():
    rows = [([1, 2, 3, 4], [0, 0, 1, 1]), ([5, 6], [0, 1])]
    inputs, targets, mask = token_batch(rows, PAD, max_len=16)
    assert inputs.tolist() == [[1, 2, 3], [5, PAD, PAD]]
    assert targets.tolist() == [[2, 3, 4], [6, PAD, PAD]]
    # mask[t] says whether targets[t] is learnt: tokens 3 and 4 of the first row, 6 of the second
    assert mask.tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]


def test_token_batch_truncates_to_the_model_length():
    inputs, targets, mask = token_batch([(list(range(20)), [1] * 20)], PAD, max_len=8)
    assert inputs.shape == (1, 8) and targets[0, -1].item() == 8 and mask.sum().item() == 8


def test_pair_examples_are_chosen_rows_then_rejected_rows_with_completions_learnt():
    rows = pair_examples([([1, 2], [3], [4, 4]), ([7], [8, 8], [9])])
    assert rows == [
        ([1, 2, 3], [0, 0, 1]),
        ([7, 8, 8], [0, 1, 1]),
        ([1, 2, 4, 4], [0, 0, 1, 1]),
        ([7, 9], [0, 1]),
    ]


def _cfg(tmp_path, **kw) -> PostConfig:
    base = dict(
        stage="sft",
        shape=MODEL_SHAPES["tiny"],
        rope_base=None,
        problems=[],
        steps=30,
        batch_size=8,
        learning_rate=3e-3,
        seed=0,
        checkpoint_dir=str(tmp_path / "ckpt"),
        checkpoint_interval=100,
        pad_id=PAD,
        device="cpu",
    )
    return PostConfig(**(base | kw))


def test_dpo_batch_of_pairs_is_a_function_of_the_step(tmp_path):
    pairs = [([1, 2], [3, 4], [5]), ([6], [7], [8, 8, 8])]
    cfg = _cfg(tmp_path, stage="dpo", pairs=pairs, batch_size=4)
    a, b = dpo_batch(cfg, 3), dpo_batch(cfg, 3)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    inputs, _, _mask = a
    assert inputs.shape[0] == 8  # 4 chosen rows, then their 4 rejected rows
    assert longest_sequence(cfg) == 4


def test_sft_on_examples_lowers_their_loss(tmp_path):
    # "prompt" tokens 10..19 then an "answer" the model must learn: the token after the prompt's last
    examples = [([10 + i, 20 + i, 30 + i], [0, 0, 1]) for i in range(10)]
    result = train_sft(_cfg(tmp_path, examples=examples), Reporter(lambda event: None), lambda: False)
    assert result.first_loss is not None and result.final_loss is not None
    assert result.final_loss < 0.5 * result.first_loss
