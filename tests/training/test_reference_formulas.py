"""The objectives against the published reference formulas, each written out again here as its
source writes it, compared on random tensors so they stay exact beyond the hand-computed tables:
TRL's DPO sigmoid loss, verl's `compute_policy_loss` (clip-higher, dual-clip, token-mean), GRPO's
group-normalised advantages, and DAPO's soft overlong punishment."""

import math

import pytest
import torch
import torch.nn.functional as F

from training.recipes.objectives import (
    ADVANTAGE_EPS,
    clipped_policy_loss,
    dpo_loss,
    group_advantages,
    overlong_penalty,
)

SEEDS = [0, 1, 2]


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- DPO: TRL's DPOTrainer.dpo_loss, loss_type="sigmoid", label_smoothing 0 ---------------------


def trl_sigmoid_dpo(pi_c, pi_r, ref_c, ref_r, beta):
    """TRL: logits = (pi_c - pi_r) - (ref_c - ref_r); losses = -logsigmoid(beta * logits);
    rewards = beta * (pi - ref), detached."""
    logits = (pi_c - pi_r) - (ref_c - ref_r)
    losses = -F.logsigmoid(beta * logits)
    return losses.mean(), beta * (pi_c - ref_c).detach(), beta * (pi_r - ref_r).detach()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("beta", [0.01, 0.1, 0.5, 2.0])
def test_dpo_loss_is_trls_sigmoid_loss(seed, beta):
    g = generator(seed)
    # summed response log-probabilities: negative, tens of nats, policy and reference apart
    pi_c, pi_r, ref_c, ref_r = (-30.0 * torch.rand(64, generator=g) for _ in range(4))
    pi_c.requires_grad_(True)
    pi_r.requires_grad_(True)
    ours = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta)
    theirs = trl_sigmoid_dpo(pi_c, pi_r, ref_c, ref_r, beta)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b)
    grads = torch.autograd.grad(ours[0], (pi_c, pi_r))
    torch.testing.assert_close(grads, torch.autograd.grad(theirs[0], (pi_c, pi_r)))


# --- the policy loss: verl's core_algos.compute_policy_loss, loss_agg_mode="token-mean" ----------


def verl_policy_loss(
    old_log_prob, log_prob, advantages, response_mask, cliprange_low, cliprange_high, clip_ratio_c=3.0
):
    """verl, step by step under its own names; returns (pg_loss, pg_clipfrac, pg_clipfrac_lower)."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = torch.gt(pg_losses2, pg_losses1).float()
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float()
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)

    def token_mean(x):
        return (x * response_mask).sum() / response_mask.sum()

    return token_mean(pg_losses), token_mean(pg_clipfrac), token_mean(pg_clipfrac_lower)


def random_rollouts(seed: int, rows: int = 16, tokens: int = 12):
    """(log_prob, old_log_prob, per-sequence advantages, mask): log-ratios in [-4, 4] (ratios from
    0.02 to 55, so both clips and the dual clip bind), advantages of both signs, ragged responses."""
    g = generator(seed)
    old = -5.0 * torch.rand(rows, tokens, generator=g)
    new = old + 8.0 * torch.rand(rows, tokens, generator=g) - 4.0
    advantages = 2.0 * torch.randn(rows, generator=g)
    lengths = torch.randint(1, tokens + 1, (rows,), generator=g)
    mask = (torch.arange(tokens)[None] < lengths[:, None]).float()
    return new, old, advantages, mask


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("eps_low, eps_high", [(0.2, 0.28), (0.2, 0.2), (0.1, 0.5)])
def test_policy_loss_is_verls_with_clip_higher_and_dual_clip(seed, eps_low, eps_high):
    new, old, advantages, mask = random_rollouts(seed)
    assert (advantages < 0).any() and (advantages > 0).any()
    per_token = advantages[:, None].expand_as(new)
    ref_loss, clipfrac, clipfrac_lower = verl_policy_loss(old, new, per_token, mask, eps_low, eps_high)
    assert clipfrac > 0 and clipfrac_lower > 0  # every branch is exercised
    logprobs = new.clone().requires_grad_(True)
    loss, fraction = clipped_policy_loss(logprobs, old, advantages, mask, eps_low, eps_high)
    torch.testing.assert_close(loss, ref_loss)
    # ours reports the tokens where either clip binds; the two are disjoint in verl's definition
    torch.testing.assert_close(fraction, clipfrac + clipfrac_lower)
    reference_input = new.clone().requires_grad_(True)
    (ref_grad,) = torch.autograd.grad(
        verl_policy_loss(old, reference_input, per_token, mask, eps_low, eps_high)[0], reference_input
    )
    torch.testing.assert_close(torch.autograd.grad(loss, logprobs)[0], ref_grad)


@pytest.mark.parametrize("seed", SEEDS)
def test_policy_loss_takes_per_token_advantages_and_extreme_ratios_like_verl(seed):
    new, old, _, mask = random_rollouts(seed)
    g = generator(seed + 100)
    advantages = 3.0 * torch.randn(new.shape, generator=g)
    new = (new + 60.0 * (torch.rand(new.shape, generator=g) > 0.9)).requires_grad_(
        True
    )  # past verl's +-20 clamp
    loss, _ = clipped_policy_loss(new, old, advantages, mask, 0.2, 0.28)
    torch.testing.assert_close(loss, verl_policy_loss(old, new, advantages, mask, 0.2, 0.28)[0])
    assert torch.isfinite(torch.autograd.grad(loss, new)[0]).all()


# --- GRPO advantages: (r - mean) / (std + eps) per group, sample std ----------------------------


def grpo_advantages(rewards: list[list[float]], eps: float) -> list[list[float]]:
    """Per group, in plain Python: mean, sample standard deviation (n - 1), then normalise."""
    out = []
    for group in rewards:
        n = len(group)
        mean = sum(group) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (n - 1))
        out.append([(r - mean) / (std + eps) for r in group])
    return out


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("group_size", [2, 8, 16])
def test_group_advantages_are_grpos(seed, group_size):
    g = generator(seed)
    correct = (torch.rand(32, group_size, generator=g) > 0.5).double()
    shaped = correct - torch.rand(32, group_size, generator=g).double() * (
        torch.rand(32, group_size, generator=g) > 0.7
    )
    for rewards in (correct, shaped):
        expected = torch.tensor(grpo_advantages(rewards.tolist(), ADVANTAGE_EPS), dtype=torch.float64)
        torch.testing.assert_close(group_advantages(rewards), expected)


# --- DAPO's soft overlong punishment (Yu et al., 2025, eq. 13) ----------------------------------


def dapo_overlong(length: int, l_max: int, l_cache: int) -> float:
    """0 if |y| <= L_max - L_cache; ((L_max - L_cache) - |y|) / L_cache if L_max - L_cache < |y| <= L_max;
    -1 if L_max < |y|."""
    if length <= l_max - l_cache:
        return 0.0
    if length <= l_max:
        return ((l_max - l_cache) - length) / l_cache
    return -1.0


@pytest.mark.parametrize("l_max, l_cache", [(16, 4), (8, 3), (20, 20), (4096, 512), (5, 1), (7, 0)])
def test_overlong_penalty_is_dapos(l_max, l_cache):
    lengths = sorted(
        {0, 1, l_max - l_cache, l_max - l_cache + 1, l_max - 1, l_max, l_max + 1, 2 * l_max}
        | set(range(max(0, l_max - l_cache - 2), min(l_max + 3, l_max - l_cache + 600)))
    )
    for length in lengths:
        assert overlong_penalty(length, l_max, l_cache) == pytest.approx(
            dapo_overlong(length, l_max, l_cache), abs=1e-12
        ), length
