"""RLVR: GRPO on verifiable rewards with the four DAPO changes, rollouts from a separate process.

Per optimizer step s (the policy is then at version s):
  1. publish the weights of version s to the rollout worker;
  2. prefetch: request step s+1's first rollouts now, so they are sampled (from version s) while
     this step trains; they are one version old when used, within the default bound k = 1;
  3. take step s's rollouts (requested during step s-1, or now on the first step), drop them if
     they are more than k versions old, score them (exact answer, plus the overlong penalty), and
     keep only groups whose rewards differ (dynamic sampling), requesting refills (sampled from
     version s) until `prompts_per_step` groups are kept or `max_sampling_rounds` is spent;
  4. the clipped (clip-higher), token-averaged policy loss over the kept groups.
No KL term in the loss (DAPO drops it); the k3 estimate against the behaviour policy is logged.

Resume: the stage restarts from its latest checkpoint (policy, optimizer, step) with a fresh worker;
the first batch after a resume is sampled from the restored policy instead of the prefetched,
one-version-older one, so an RLVR resume continues correctly but not bit-identically.
"""

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR

from services.trainer.data import ByteTokenizer
from services.trainer.generation import Completion
from services.trainer.loop import Emit, LoopSettings, StepOutput, full_state_dict, pick_device, resume_or_init, run_loop
from services.trainer.objectives import (
    clipped_policy_loss,
    fresh_rollouts,
    group_advantages,
    informative_groups,
    kl_estimate,
    overlong_penalty,
)
from services.trainer.posttrain import PAD_TOKEN, PostConfig, adamw, sequence_logprobs
from services.trainer.pretrain import build_model, lr_factor
from services.trainer.rollout import RolloutBatch, RolloutRequest, RolloutWorker

# A fresh Adam's first updates are lr * sign(grad) on every weight: on a small trained model that
# alone can undo SFT, so RL warms up over the first 10% of its steps (measured: tiny, lr 3e-4).
WARMUP_FRACTION = 0.1


@dataclass(kw_only=True, slots=True)
class RlvrConfig(PostConfig):
    prompts_per_step: int = 8
    group_size: int = 8
    eps_low: float = 0.2
    eps_high: float = 0.28
    max_response_tokens: int = 16
    overlong_buffer_tokens: int = 4
    max_staleness: int = 1
    temperature: float = 1.0
    max_sampling_rounds: int = 4
    threads: int = 1
    """Torch threads of the rollout worker."""

    def __post_init__(self) -> None:
        PostConfig.__post_init__(self)
        if self.group_size < 2:
            raise ValueError("A GRPO group needs at least 2 completions.")
        if self.overlong_buffer_tokens > self.max_response_tokens:
            raise ValueError("The overlong buffer (L_cache) cannot be longer than L_max.")


@dataclass(kw_only=True, slots=True)
class StepStats:
    """What one RL step saw; `accuracy` is over every rollout sampled, before any filtering."""

    step: int
    accuracy: float = 0.0
    reward: float = 0.0
    groups_kept: int = 0
    groups_uniform: int = 0
    stale_dropped: int = 0
    rounds: int = 0
    kl: float = 0.0
    clip_fraction: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RlvrResult:
    final_step: int
    first_loss: float | None
    final_loss: float | None
    stopped: bool
    stats: list[StepStats]
    stale_dropped: int
    model: torch.nn.Module | None = field(default=None, repr=False, compare=False)


def score(completion: Completion, answer: str, *, max_tokens: int, buffer_tokens: int) -> tuple[float, bool]:
    """(reward, correct): 1 for the exact answer ended by a newline, else 0; plus the overlong
    penalty (a completion that never ended counts as max_tokens + 1 long)."""
    text = ByteTokenizer().decode(completion.tokens)
    correct = completion.finished and text[:-1] == answer
    length = len(completion.tokens) if completion.finished else max_tokens + 1
    return float(correct) + overlong_penalty(length, max_tokens, buffer_tokens), correct


def policy_batch(prompts: list[list[int]], completions: list[Completion]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, mask, old log-probs) of prompt+completion rows, right-padded."""
    width = max(len(p) + len(c.tokens) for p, c in zip(prompts, completions, strict=True)) - 1
    rows = len(prompts)
    inputs = torch.full((rows, width), PAD_TOKEN, dtype=torch.long)
    targets = torch.full((rows, width), PAD_TOKEN, dtype=torch.long)
    mask = torch.zeros((rows, width))
    old = torch.zeros((rows, width))
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        seq = torch.tensor(p + c.tokens)
        n = len(seq) - 1
        inputs[i, :n], targets[i, :n] = seq[:-1], seq[1:]
        mask[i, len(p) - 1 : n] = 1.0
        old[i, len(p) - 1 : n] = torch.tensor(c.logprobs)
    return inputs, targets, mask, old


class Sampler:
    """Asks the worker for rollouts of step s, round r: which prompts and which sampling seed are a
    function of (seed, s, r) alone."""

    def __init__(self, cfg: RlvrConfig, worker: RolloutWorker):
        self.cfg = cfg
        self.worker = worker
        self.tok = ByteTokenizer()
        self.requested: set[str] = set()
        self.answers: dict[str, list[str]] = {}

    def request(self, step: int, round_: int, prompts: int) -> str:
        request_id = f"{step}:{round_}"
        if request_id in self.requested:
            return request_id
        rng = random.Random(f"rlvr:{self.cfg.seed}:{request_id}")
        chosen = [rng.choice(self.cfg.problems) for _ in range(prompts)]
        self.answers[request_id] = [a for _, a in chosen]
        self.worker.request(RolloutRequest(
            request_id=request_id, prompts=[self.tok.encode(p) for p, _ in chosen], group_size=self.cfg.group_size,
            max_new_tokens=self.cfg.max_response_tokens, temperature=self.cfg.temperature,
            seed=rng.randrange(2**62),
        ))
        self.requested.add(request_id)
        return request_id

    def collect(self, request_id: str) -> tuple[RolloutBatch, list[str]]:
        return self.worker.collect(request_id), self.answers.pop(request_id)


def train_rlvr(cfg: RlvrConfig, emit: Emit, should_stop: Callable[[], bool], *,
               worker_factory: Callable[..., RolloutWorker] = RolloutWorker) -> RlvrResult:
    """`worker_factory(shape, rope_base, threads=, device=)` builds the rollout worker (a context
    manager); tests pass a fake one to exercise staleness without timing."""
    device = pick_device(cfg.device)
    torch.manual_seed(cfg.seed)
    longest_prompt = max(len(p.encode()) for p, _ in cfg.problems)
    seq_len = min(longest_prompt + cfg.max_response_tokens, cfg.shape.max_seq_len)
    model = build_model(cfg.shape, seq_len=seq_len, rope_base=cfg.rope_base, device=device)
    optimizer = adamw(model, cfg.learning_rate)
    warmup = max(1, round(WARMUP_FRACTION * cfg.steps))
    scheduler = LambdaLR(optimizer, partial(lr_factor, warmup=warmup, total=cfg.steps, min_ratio=1.0))
    settings = LoopSettings(stage=cfg.stage, steps=cfg.steps, checkpoint_dir=cfg.checkpoint_dir,
                            checkpoint_interval=cfg.checkpoint_interval, keep_last=cfg.keep_last)
    resumed = resume_or_init(settings, model, optimizer, scheduler, emit, init_from=cfg.init_from)
    start = resumed.step if resumed else 0
    stats: list[StepStats] = []
    stale_total = 0
    if start < cfg.steps:
        emit("log", {"level": "info", "message": (
            f"rlvr: {cfg.steps - start} steps of {cfg.prompts_per_step} groups x {cfg.group_size} rollouts, "
            f"clip [{1 - cfg.eps_low:.2f}, {1 + cfg.eps_high:.2f}], L_max {cfg.max_response_tokens}, "
            f"L_cache {cfg.overlong_buffer_tokens}, staleness <= {cfg.max_staleness}")})

    with worker_factory(model.shape, cfg.rope_base, threads=cfg.threads, device=device.type) as worker:
        sampler = Sampler(cfg, worker)

        def step_fn(step: int) -> StepOutput:
            nonlocal stale_total
            st = StepStats(step=step + 1)
            worker.publish(step, full_state_dict(model))
            first = sampler.request(step, 0, cfg.prompts_per_step)
            if cfg.max_staleness >= 1 and step + 1 < cfg.steps:
                sampler.request(step + 1, 0, cfg.prompts_per_step)  # sampled from version `step`
            prompts: list[list[int]] = []
            completions: list[Completion] = []
            rewards: list[torch.Tensor] = []
            sampled = right = 0
            reward_sum = 0.0
            request_id, round_ = first, 0
            while True:
                batch, answers = sampler.collect(request_id)
                st.rounds += 1
                if not fresh_rollouts([batch.version], step, cfg.max_staleness)[0]:
                    st.stale_dropped += sum(len(g) for g in batch.groups)
                else:
                    for prompt, group, answer in zip(batch.prompts, batch.groups, answers, strict=True):
                        scored = [score(c, answer, max_tokens=cfg.max_response_tokens,
                                        buffer_tokens=cfg.overlong_buffer_tokens) for c in group]
                        group_rewards = torch.tensor([r for r, _ in scored])
                        sampled += len(group)
                        right += sum(ok for _, ok in scored)
                        reward_sum += float(group_rewards.sum())
                        if not bool(informative_groups(group_rewards[None])[0]):
                            st.groups_uniform += 1
                        elif len(rewards) < cfg.prompts_per_step:
                            prompts += [prompt] * len(group)
                            completions += group
                            rewards.append(group_rewards)
                needed = cfg.prompts_per_step - len(rewards)
                if needed <= 0 or round_ + 1 >= cfg.max_sampling_rounds:
                    break
                round_ += 1
                request_id = sampler.request(step, round_, cfg.prompts_per_step)
            stale_total += st.stale_dropped
            st.groups_kept = len(rewards)
            st.accuracy = right / sampled if sampled else 0.0
            st.reward = reward_sum / sampled if sampled else 0.0
            stats.append(st)
            if not rewards:
                emit("log", {"level": "warning", "message": (
                    f"rlvr step {step + 1}: no group with differing rewards after {st.rounds} rounds; nothing to learn")})
                return StepOutput(loss=None, tokens=0)
            inputs, targets, mask, old = policy_batch(prompts, completions)
            mask, old = mask.to(device), old.to(device)
            advantages = group_advantages(torch.stack(rewards)).reshape(-1).to(device)
            logprobs = sequence_logprobs(model, inputs, targets, device, temperature=cfg.temperature)
            loss, clip_fraction = clipped_policy_loss(logprobs, old, advantages, mask, cfg.eps_low, cfg.eps_high)
            st.kl = float(kl_estimate(logprobs, old, mask))
            st.clip_fraction = float(clip_fraction)
            emit("log", {"level": "info", "message": (
                f"rlvr step {step + 1}: reward {st.reward:.3f}, accuracy {st.accuracy:.3f}, kl {st.kl:.4f}, "
                f"clipped {st.clip_fraction:.3f}, groups kept {st.groups_kept} (uniform dropped {st.groups_uniform}), "
                f"stale rollouts dropped {st.stale_dropped}, rounds {st.rounds}")})
            return StepOutput(loss=loss, tokens=int(mask.sum().item()))

        result = run_loop(settings, model, optimizer, scheduler, step_fn, emit, should_stop, start_step=start,
                          position=lambda: 0)
    if stale_total:
        emit("log", {"level": "info", "message": f"rlvr dropped {stale_total} stale rollouts (older than {cfg.max_staleness} versions)"})
    return RlvrResult(final_step=result.final_step, first_loss=result.first_loss, final_loss=result.final_loss,
                      stopped=result.stopped, stats=stats, stale_dropped=stale_total, model=model)
