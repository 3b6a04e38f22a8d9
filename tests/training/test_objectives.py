"""Post-training objectives against values computed by hand (the arithmetic is in the comments)."""

import math

import pytest
import torch

from training.recipes.objectives import (
    DUAL_CLIP_C,
    clipped_policy_loss,
    dpo_loss,
    fresh_rollouts,
    group_advantages,
    informative_groups,
    kl_estimate,
    overlong_penalty,
    sft_loss,
    token_logprobs,
)


def test_dpo_loss_is_the_sigmoid_formula():
    # Pair 1: chosen margin (-1.0 - -1.5) = 0.5, rejected margin (-3.0 - -2.0) = -1.0 -> z = 0.1 * 1.5 = 0.15
    # Pair 2: chosen margin (-2.0 - -2.0) = 0.0, rejected margin (-1.0 - -2.0) = 1.0  -> z = 0.1 * -1.0 = -0.1
    loss, chosen, rejected = dpo_loss(
        torch.tensor([-1.0, -2.0]),
        torch.tensor([-3.0, -1.0]),
        torch.tensor([-1.5, -2.0]),
        torch.tensor([-2.0, -2.0]),
        beta=0.1,
    )
    expected = (
        math.log(1 + math.exp(-0.15)) + math.log(1 + math.exp(0.1))
    ) / 2  # -log sigmoid(z) = log(1 + e^-z)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert chosen.tolist() == pytest.approx([0.05, 0.0])
    assert rejected.tolist() == pytest.approx([-0.1, 0.1])


def test_dpo_loss_at_the_reference_is_log_2_and_beta_scales_the_margin():
    same = torch.tensor([-4.0])
    assert dpo_loss(same, same, same, same, beta=0.1)[0].item() == pytest.approx(math.log(2))
    # chosen up by 1 nat against the reference: z = beta; beta 1.0 gives log(1 + e^-1)
    loss = dpo_loss(torch.tensor([-3.0]), same, same, same, beta=1.0)[0]
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1.0)))


def test_dpo_loss_gradient_raises_chosen_and_lowers_rejected():
    chosen = torch.tensor([-2.0], requires_grad=True)
    rejected = torch.tensor([-2.0], requires_grad=True)
    dpo_loss(chosen, rejected, torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.5)[0].backward()
    # d/dc -log sigmoid(beta (c - r)) = -beta * sigmoid(-z) = -0.5 * 0.5 at z = 0
    assert chosen.grad.item() == pytest.approx(-0.25) and rejected.grad.item() == pytest.approx(0.25)


def test_group_advantages_normalise_within_each_group():
    # [1, 0, 0, 1]: mean 0.5, sample std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.866025
    # [2, 0, 0, 0]: mean 0.5, sample std sqrt((2.25 + 3 * 0.25) / 3) = 1.0 -> [1.5, -0.5, -0.5, -0.5]
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 0.0, 0.0, 0.0]]))
    assert adv[0].tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-5)
    assert adv[1].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)
    assert torch.all(group_advantages(torch.tensor([[0.3, 0.3, 0.3]])) == 0)  # uniform group: zero, finite


@pytest.mark.parametrize(
    "correct, keep",
    [
        ([True, True, True], False),  # all right: zero advantage everywhere
        ([False, False, False], False),  # all wrong, whatever their lengths (rewards may still differ)
        ([True, False, True], True),
        ([False, False, True], True),
    ],
)
def test_dynamic_sampling_keeps_groups_with_both_right_and_wrong_answers(correct, keep):
    assert informative_groups(torch.tensor([correct])).tolist() == [keep]


@pytest.mark.parametrize(
    "length, expected",
    [
        (1, 0.0),
        (12, 0.0),  # up to L_max - L_cache = 12: no penalty
        (13, -0.25),
        (14, -0.5),
        (16, -1.0),  # (12 - L) / 4 inside the buffer
        (17, -1.0),
        (100, -1.0),  # beyond L_max
    ],
)
def test_overlong_penalty(length, expected):
    assert overlong_penalty(length, max_tokens=16, buffer_tokens=4) == pytest.approx(expected)


def test_overlong_buffer_longer_than_l_max_is_refused():
    with pytest.raises(ValueError, match="L_cache"):
        overlong_penalty(3, max_tokens=4, buffer_tokens=5)


def ratio_logprobs(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(new, old) log-probabilities whose exp-difference is the given ratios."""
    new = torch.log(torch.tensor(ratios))
    return new, torch.zeros_like(new)


def test_clip_higher_clips_each_side_where_ppo_would():
    eps_low, eps_high = 0.2, 0.28
    mask = torch.ones(1, 1)
    cases = [
        # (ratio, advantage, per-token loss = -min(r A, clip(r) A), then min(that, 3 |A|) for A < 0; clip binding?)
        (1.5, 1.0, -1.28, True),  # positive A: capped at 1 + eps_high
        (1.2, 1.0, -1.2, False),  # inside [0.8, 1.28]: unclipped (plain PPO at 0.2 would clip here)
        (0.5, 1.0, -0.5, False),  # ratio fell under positive A: min keeps the unclipped, lower value
        (5.0, 1.0, -1.28, True),  # positive A, far past the cap: still 1 + eps_high; no dual clip for A > 0
        (0.5, -1.0, 0.8, True),  # negative A: floored at 1 - eps_low
        (1.5, -1.0, 1.5, False),  # negative A, ratio rose: min keeps r A = -1.5 -> loss 1.5
        (2.9, -1.0, 2.9, False),  # under the dual clip c = 3: unchanged
        (5.0, -1.0, 3.0, True),  # dual clip: loss min(5, 3) * |A|
        (5.0, -0.5, 1.5, True),  # the bound scales with |A|
    ]
    for ratio, advantage, expected, clipped in cases:
        new, old = ratio_logprobs([[ratio]])
        loss, fraction = clipped_policy_loss(new, old, torch.tensor([advantage]), mask, eps_low, eps_high)
        assert loss.item() == pytest.approx(expected, rel=1e-5), (ratio, advantage)
        assert fraction.item() == (1.0 if clipped else 0.0)


def test_dual_clip_bounds_a_negative_advantage_with_a_huge_ratio():
    # A = -2, ratio e^6 ~ 403: without the dual clip the token's loss is 2 * 403 = 807 and its
    # gradient as large; with it, 3 * |A| = 6 and no gradient at all (the bound is a constant).
    new = torch.tensor([[6.0]], requires_grad=True)
    loss, fraction = clipped_policy_loss(
        new, torch.zeros(1, 1), torch.tensor([-2.0]), torch.ones(1, 1), 0.2, 0.28
    )
    loss.backward()
    assert loss.item() == pytest.approx(DUAL_CLIP_C * 2.0) and fraction.item() == 1.0
    assert new.grad.item() == 0.0


def test_an_absurd_log_ratio_gives_a_finite_loss_and_gradient():
    # A stale token whose log-probability moved by 200 nats: exp() would overflow to inf (and its
    # gradient to NaN); the log-ratio is clamped at +-20 first, as verl does.
    new = torch.tensor([[200.0, -200.0, 0.1]], requires_grad=True)
    for advantage in (1.0, -1.0):
        loss, _ = clipped_policy_loss(
            new, torch.zeros(1, 3), torch.tensor([advantage]), torch.ones(1, 3), 0.2, 0.28
        )
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(new.grad).all()
        new.grad = None


def test_dual_clip_constant_must_exceed_1():
    with pytest.raises(ValueError, match="above 1"):
        clipped_policy_loss(
            torch.zeros(1, 1),
            torch.zeros(1, 1),
            torch.tensor([1.0]),
            torch.ones(1, 1),
            0.2,
            0.28,
            clip_ratio_c=1.0,
        )


def test_clipped_tokens_pass_no_gradient():
    new = torch.log(torch.tensor([[1.5, 1.1]])).requires_grad_(True)
    loss, _ = clipped_policy_loss(new, torch.zeros(1, 2), torch.tensor([1.0]), torch.ones(1, 2), 0.2, 0.28)
    loss.backward()
    # token 0 clipped (1.5 > 1.28): no gradient; token 1: d/dlogp of -(r * A) / 2 tokens = -1.1 / 2
    assert new.grad.tolist()[0] == pytest.approx([0.0, -0.55])


def test_loss_is_averaged_over_tokens_not_samples():
    # Sample 0 has 3 response tokens with per-token loss -1 (A = 1, ratio 1); sample 1 has 1 token
    # with per-token loss +1 (A = -1). Token level: (-3 + 1) / 4 = -0.5. A per-sample mean would give
    # (-1 + 1) / 2 = 0: long responses would count as much as short ones.
    new, old = ratio_logprobs([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    loss, _ = clipped_policy_loss(new, old, torch.tensor([1.0, -1.0]), mask, 0.2, 0.28)
    assert loss.item() == pytest.approx(-0.5)


def test_masked_positions_do_not_count():
    new, old = ratio_logprobs([[1.0, 9.0]])  # a huge ratio on a masked (padding) position
    loss, fraction = clipped_policy_loss(new, old, torch.tensor([2.0]), torch.tensor([[1.0, 0.0]]), 0.2, 0.28)
    assert loss.item() == pytest.approx(-2.0) and fraction.item() == 0.0


def test_sft_loss_counts_response_tokens_only():
    logprobs = torch.tensor([[-5.0, -1.0, -3.0], [-7.0, -2.0, -9.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    assert sft_loss(logprobs, mask).item() == pytest.approx((1.0 + 3.0 + 2.0) / 3)


def test_token_logprobs_gather_the_targets():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]]))
    assert token_logprobs(logits, torch.tensor([[1, 2]])).exp()[0].tolist() == pytest.approx([0.25, 0.8])


def test_kl_estimate_is_zero_at_equal_policies_and_k3_otherwise():
    logp = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2)
    assert kl_estimate(logp, logp, mask).item() == 0.0
    # log r = -0.5 on both tokens: e^-0.5 - 1 + 0.5 = 0.106531
    assert kl_estimate(logp, logp - 0.5, mask).item() == pytest.approx(math.exp(-0.5) - 0.5, rel=1e-5)


@pytest.mark.parametrize(
    "versions, current, k, keep",
    [
        ([5, 4, 3], 5, 1, [True, True, False]),  # 3 is two versions behind 5: dropped at k = 1
        ([5, 4, 3], 5, 0, [True, False, False]),  # k = 0: strictly on-policy
        ([5, 4, 3], 5, 2, [True, True, True]),
        ([0], 0, 1, [True]),
    ],
)
def test_rollouts_beyond_the_staleness_bound_are_dropped(versions, current, k, keep):
    assert fresh_rollouts(versions, current, k) == keep
