"""How a post-training batch is cut over data-parallel ranks (pure parts; the gangs themselves are in
tests/distributed/test_posttrain_gang.py): RLVR's kept rows as evenly as they come, a rank without a
row still joining the backward pass with no weight; DPO's pairs with their chosen and rejected rows
together; token means rescaled so that the ranks' mean is the global batch's mean."""

import pytest
import torch

from training.recipes.objectives import masked_mean
from training.recipes.posttrain import global_token_mean, pair_slice
from training.recipes.rlvr import rank_share


@pytest.mark.parametrize(
    ("rows", "dp", "want"),
    [
        (8, 1, [(slice(0, 8), True)]),
        (8, 2, [(slice(0, 4), True), (slice(4, 8), True)]),
        (6, 4, [(slice(0, 2), True), (slice(2, 4), True), (slice(4, 5), True), (slice(5, 6), True)]),
        (2, 4, [(slice(0, 1), True), (slice(1, 2), True), (slice(0, 1), False), (slice(0, 1), False)]),
    ],
)
def test_rlvr_rows_are_split_as_evenly_as_they_come(rows, dp, want):
    assert [rank_share(rows, r, dp) for r in range(dp)] == want


def test_a_dpo_slice_keeps_each_pair_together():
    pairs = 4
    inputs = torch.arange(2 * pairs)[:, None]  # chosen rows 0-3, rejected rows 4-7
    batch = (inputs, inputs + 100, inputs.float())
    got, targets, mask = pair_slice(batch, pairs, slice(2, 4))
    assert got.flatten().tolist() == [2, 3, 6, 7]
    assert targets.flatten().tolist() == [102, 103, 106, 107] and mask.flatten().tolist() == [2, 3, 6, 7]
    assert pair_slice(batch, pairs, slice(0, 4)) is batch


def test_the_ranks_mean_of_rescaled_token_means_is_the_global_token_mean():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0], [10.0, 11.0, 12.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    tokens = float(mask.sum())
    shares = [
        global_token_mean(masked_mean(values[rows], mask[rows]), mask[rows], tokens, 2)
        for rows in (slice(0, 2), slice(2, 4))
    ]
    assert float(sum(shares) / 2) == pytest.approx(float(masked_mean(values, mask)))
    # The plain per-rank means would average to another number: the defect the rescaling removes.
    plain = [masked_mean(values[rows], mask[rows]) for rows in (slice(0, 2), slice(2, 4))]
    assert float(sum(plain) / 2) != pytest.approx(float(masked_mean(values, mask)))
    assert global_token_mean(shares[0], mask, tokens, 1) is shares[0]  # one process: untouched
