"""Post-training objectives as pure tensor functions: SFT's masked loss, DPO's sigmoid loss, and
GRPO with the four DAPO changes (Yu et al., 2025) and verl's dual-clip. No model, no I/O: each is
tested on values computed by hand, and against the published reference formula on random tensors
(tests/training/test_reference_formulas.py).

Conventions: per-token tensors are (batch, tokens) with a float `mask` of 1 on response tokens and
0 on prompt and padding; log-probabilities are natural logs.
"""

import torch
import torch.nn.functional as F

ADVANTAGE_EPS = 1e-6  # keeps a group's normalisation finite (a kept group's shaped rewards can still tie)
# Dual-clip PPO (Ye et al., 2020), verl's default: for A < 0 the per-token loss is at most c * |A|,
# so a token whose probability already rose far above the behaviour policy's cannot blow up the step.
DUAL_CLIP_C = 3.0
# verl clamps log(pi / pi_old) to this before exp(): the ratio stays finite (and its gradient not
# NaN) however far a stale token's log-probability moved; inside the bound the objective is unchanged.
MAX_LOG_RATIO = 20.0


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[b, t] | prefix) for every position: (B, T, V), (B, T) -> (B, T), float32.
    The full-logits form, for logits already at hand (tests, benches); the trainer's steps take
    the chunked path, `Transformer.token_logprobs` (no (B, T, V) float32 tensor)."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over the positions where mask is 1, all rows together (token-level)."""
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def sft_loss(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of the response tokens only, averaged over every response token."""
    return -masked_mean(logprobs, mask)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rafailov et al. (2023): -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), averaged.
    Inputs are summed response log-probabilities, one per pair. Returns (loss, chosen reward,
    rejected reward); the implicit rewards beta * (pi - ref) are detached, for reporting."""
    chosen = policy_chosen - reference_chosen
    rejected = policy_rejected - reference_rejected
    loss = -F.logsigmoid(beta * (chosen - rejected)).mean()
    return loss, (beta * chosen).detach(), (beta * rejected).detach()


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """GRPO: (r - mean) / (std + eps) within each group; rewards (groups, group_size). The std is
    the sample std (n - 1), as in verl, DAPO's reference implementation."""
    mean = rewards.mean(dim=-1, keepdim=True)
    std = rewards.std(dim=-1, keepdim=True, unbiased=True)
    return (rewards - mean) / (std + ADVANTAGE_EPS)


def informative_groups(correct: torch.Tensor) -> torch.Tensor:
    """DAPO dynamic sampling: True for groups whose answers are neither all right nor all wrong;
    `correct` is (groups, group_size), the verifier's accuracy before any reward shaping. Judged on
    correctness, not on the shaped reward: an all-wrong group where one answer ran into the overlong
    buffer has rewards that differ, but normalising them would hand a length penalty the advantage of
    a right answer. A uniform group has zero advantage everywhere and only dilutes the batch."""
    return (correct != correct[..., :1]).any(dim=-1)


def overlong_penalty(length: int, max_tokens: int, buffer_tokens: int) -> float:
    """DAPO soft overlong punishment, added to the task reward: 0 up to L_max - L_cache tokens, then
    falling linearly to -1 at L_max; -1 beyond. A response cut off at L_max (it never ended) thus
    gets exactly -1. `length` counts response tokens including the end-of-answer token."""
    if buffer_tokens > max_tokens:
        raise ValueError("The overlong buffer (L_cache) cannot be longer than L_max.")
    free = max_tokens - buffer_tokens
    if length <= free:
        return 0.0
    if length <= max_tokens:
        return (free - length) / buffer_tokens
    return -1.0


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    clip_ratio_c: float = DUAL_CLIP_C,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's `compute_policy_loss`: the PPO clipped surrogate with DAPO's clip-higher (ratio clipped
    to [1 - eps_low, 1 + eps_high]; eps_high > eps_low leaves low-probability tokens room to rise),
    dual-clip for negative advantages (the loss of a token with A < 0 is at most clip_ratio_c * |A|),
    and token-level averaging (every response token of the batch weighs the same, so long responses
    are not down-weighted as a per-sample mean would). `advantages` is per sequence (B,) or per token
    (B, T). Returns (loss, fraction of response tokens where a clip, either one, chose the value:
    those pass no gradient)."""
    if clip_ratio_c <= 1.0:
        raise ValueError("The dual-clip constant must be above 1.")
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logprobs)
    ratio = torch.exp((logprobs - old_logprobs).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    ppo = torch.maximum(unclipped, clipped)  # the pessimistic of the two: PPO's min over objectives
    bound = -advantages * clip_ratio_c  # positive where A < 0
    per_token = torch.where(advantages < 0, torch.minimum(ppo, bound), ppo)
    binding = (clipped > unclipped) | ((advantages < 0) & (ppo > bound))
    return masked_mean(per_token, mask), masked_mean(binding.float(), mask).detach()


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(policy || ref) from sampled tokens: E[r - 1 - log r] with
    r = p_ref / p_policy; non-negative. Reported only: DAPO drops the KL penalty from the loss."""
    log_r = (ref_logprobs - logprobs).detach()
    return masked_mean(torch.exp(log_r) - 1.0 - log_r, mask)


def fresh_rollouts(versions: list[int], current_version: int, max_staleness: int) -> list[bool]:
    """Bounded staleness: keep[i] is False for a rollout generated more than `max_staleness` policy
    versions before `current_version` (the version the next optimizer step updates)."""
    return [current_version - v <= max_staleness for v in versions]
