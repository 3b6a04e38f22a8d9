"""RLVR: GRPO on verifiable rewards with the four DAPO changes and verl's dual-clip, rollouts from a
separate process.

Per optimizer step s (the policy is then at version s):
  1. publish the weights of version s to the rollout worker;
  2. prefetch: request step s+1's first rollouts now, so they are sampled (from version s) while
     this step trains; they are one version old when used, within the default bound k = 1;
  3. take step s's rollouts (requested during step s-1, or now on the first step), drop them if
     they are more than k versions old, score them (exact answer, plus the overlong penalty), and
     keep only groups whose answers are neither all right nor all wrong (dynamic sampling, judged on
     correctness as DAPO does, not on the shaped reward), requesting refills (sampled from version
     s) until `prompts_per_step` groups are kept or `max_sampling_rounds` is spent;
  4. group-normalised advantages of the shaped rewards, and the clipped (clip-higher, dual-clip
     c = 3), token-averaged policy loss over the kept groups.
No KL term in the loss (DAPO drops it); the k3 estimate against the behaviour policy is logged.

Under several ranks (a gang, `PostConfig.parallel`) there is exactly one rollout worker, rank 0's:
every rank gathers the full weights (a collective under FSDP2; rank 0 keeps them) and rank 0 alone
publishes them, requests, collects, scores and filters the rollouts, then broadcasts the kept groups
and the step's stats; every rank computes the advantages of the whole kept batch and the loss on its
slice of the rows, scaled so that the ranks' mean is the token-level loss over every kept token.

On a run of several nodes each node is one torchft replica group (`replicas`, services/trainer/
launch/multinode.py) and RLVR samples per group: rank 0 of each group runs one rollout worker and samples the
group's share of `prompts_per_step` (prompts of its own: the group's id is in the sampling seed),
filters, and broadcasts the kept groups within its group. The token mean is over every group's kept
tokens (their count summed over the groups with torchft's all-reduce, `Across.total`), so torchft's
average of the groups' gradients is the loss over all of them. A group that kept none trains a
weightless row (`placeholder`): it still steps with the others. Each group reports its own stats.

Resume: the stage restarts from its latest checkpoint (policy, optimizer, step) with a fresh worker;
the first batch after a resume is sampled from the restored policy instead of the prefetched,
one-version-older one, so an RLVR resume continues correctly but not bit-identically.
"""

import random
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR

from contracts.manifest import RlvrStage
from contracts.runs import LogLevel
from training.data.corpora import ByteTokenizer
from training.engine import distributed
from training.engine.loop import StepOutput, full_state_dict, pick_device
from training.engine.reporting import Reporter, rank0_only
from training.model import Transformer
from training.recipes.generation import END_TOKEN, Completion
from training.recipes.objectives import (
    DUAL_CLIP_C,
    clipped_policy_loss,
    fresh_rollouts,
    group_advantages,
    informative_groups,
    kl_estimate,
    overlong_penalty,
)
from training.recipes.posttrain import (
    PAD_TOKEN,
    PostConfig,
    PostResult,
    adamw,
    dims_of,
    global_token_mean,
    loop_settings,
    sequence_logprobs,
    train_dpo,
    train_sft,
)
from training.recipes.pretrain import build_model, lr_factor
from training.recipes.rollout import RolloutBatch, RolloutRequest, RolloutWorker
from training.recipes.stage_run import Replicas, StageRun
from training.weights.lora import merge_state_dict

# A fresh Adam's first updates are lr * sign(grad) on every weight: on a small trained model that
# alone can undo SFT, so RL warms up over the first 10% of its steps (measured: tiny, lr 3e-4).
WARMUP_FRACTION = 0.1


@dataclass(kw_only=True, slots=True)
class RlvrConfig(PostConfig):
    rlvr: RlvrStage = field(default_factory=RlvrStage)
    """The manifest's RLVR section as it is: group size, clip range, L_max / L_cache, staleness bound,
    temperature and sampling rounds are read from it, never copied (their defaults live there)."""
    threads: int = 1
    """Torch threads of the rollout worker."""

    def __post_init__(self) -> None:
        PostConfig.__post_init__(self)
        # The manifest's decoder enforces its field bounds; a section built in code skips them, and
        # the L_cache <= L_max rule spans two fields, so both are checked here.
        if self.rlvr.group_size < 2:
            raise ValueError("A GRPO group needs at least 2 completions.")
        if self.rlvr.overlong_buffer_tokens > self.rlvr.max_response_tokens:
            raise ValueError("The overlong buffer (L_cache) cannot be longer than L_max.")


@dataclass(kw_only=True, slots=True)
class StepStats:
    """What one RL step saw; `accuracy` is over every rollout sampled, before any filtering."""

    step: int
    accuracy: float = 0.0
    reward: float = 0.0
    groups_kept: int = 0
    groups_uniform: int = 0  # all right or all wrong: dropped by dynamic sampling
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
    rollout_workers: int = 1
    """Rollout workers the stage started, summed over every rank: 1 (rank 0's) however many ranks."""
    model: Transformer | None = field(default=None, repr=False, compare=False)


def score(completion: Completion, answer: str, *, max_tokens: int, buffer_tokens: int) -> tuple[float, bool]:
    """(reward, correct): 1 for the exact answer ended by a newline, else 0; plus the overlong
    penalty (a completion that never ended counts as max_tokens + 1 long)."""
    text = ByteTokenizer().decode(completion.tokens)
    correct = completion.finished and text[:-1] == answer
    length = len(completion.tokens) if completion.finished else max_tokens + 1
    return float(correct) + overlong_penalty(length, max_tokens, buffer_tokens), correct


def score_group(group: list[Completion], answer: str, cfg: RlvrConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(shaped rewards, correct) of one group, both (group_size,): the rewards feed the advantages,
    the verifier's bare correctness decides whether dynamic sampling keeps the group."""
    scored = [
        score(
            c, answer, max_tokens=cfg.rlvr.max_response_tokens, buffer_tokens=cfg.rlvr.overlong_buffer_tokens
        )
        for c in group
    ]
    return torch.tensor([r for r, _ in scored]), torch.tensor([ok for _, ok in scored])


def policy_batch(
    prompts: list[list[int]], completions: list[Completion]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, mask, old log-probs) of prompt+completion rows, right-padded. Built from
    padded Python rows with one tensor per field: per-row tensors and slice copies were a third of
    the GRPO step's host time at the bench's tiny shape (bench/trainer_steps.py `trainer_grpo`)."""
    pairs = list(zip(prompts, completions, strict=True))
    width = max(len(p) + len(c.tokens) for p, c in pairs)  # tokens per row, the last one a target only
    seq = torch.tensor([p + c.tokens + [PAD_TOKEN] * (width - len(p) - len(c.tokens)) for p, c in pairs])
    old = torch.tensor(
        [[0.0] * (len(p) - 1) + c.logprobs + [0.0] * (width - len(p) - len(c.tokens)) for p, c in pairs]
    )
    # Row i's targets seq[i, 1:n+1] are completion tokens from position len(p) - 1 up to n - 1.
    starts = torch.tensor([len(p) - 1 for p, _ in pairs])[:, None]
    ends = torch.tensor([len(p) + len(c.tokens) - 1 for p, c in pairs])[:, None]
    position = torch.arange(width - 1)[None]
    mask = ((position >= starts) & (position < ends)).float()
    inputs = seq[:, :-1].masked_fill(position >= ends, PAD_TOKEN)  # a row's last token is a target only
    return inputs, seq[:, 1:].contiguous(), mask, old[:, : width - 1].contiguous()


class Sampler:
    """Asks the worker for rollouts of step s, round r: which prompts and which sampling seed are a
    function of (seed, s, r) alone, and of the replica group `group` on a run of several nodes (each
    group samples prompts of its own)."""

    def __init__(self, cfg: RlvrConfig, worker: RolloutWorker, group: int | None = None):
        self.cfg = cfg
        self.worker = worker
        self.stream = "" if group is None else f"g{group}:"
        self.tok = ByteTokenizer()
        self.requested: set[str] = set()
        self.answers: dict[str, list[str]] = {}

    def request(self, step: int, round_: int, prompts: int) -> str:
        request_id = f"{step}:{round_}"
        if request_id in self.requested:
            return request_id
        rng = random.Random(f"rlvr:{self.cfg.seed}:{self.stream}{request_id}")
        chosen = [rng.choice(self.cfg.problems) for _ in range(prompts)]
        self.answers[request_id] = [a for _, a in chosen]
        self.worker.request(
            RolloutRequest(
                request_id=request_id,
                prompts=[self.tok.encode(p) for p, _ in chosen],
                group_size=self.cfg.rlvr.group_size,
                max_new_tokens=self.cfg.rlvr.max_response_tokens,
                temperature=self.cfg.rlvr.temperature,
                seed=rng.randrange(2**62),
            )
        )
        self.requested.add(request_id)
        return request_id

    def collect(self, request_id: str) -> tuple[RolloutBatch, list[str]]:
        return self.worker.collect(request_id), self.answers.pop(request_id)


@dataclass(slots=True)
class Kept:
    """What a step sampled: the groups kept for the loss, and totals over every fresh rollout (the
    reported accuracy and reward are before any filtering)."""

    prompts: list[list[int]] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    rewards: list[torch.Tensor] = field(default_factory=list)
    sampled: int = 0
    right: int = 0
    reward_sum: float = 0.0
    weightless: bool = False  # a stand-in batch of a replica group that kept none (`placeholder`)


def placeholder(prompt: list[int]) -> Kept:
    """What a replica group that kept no group trains: two one-token rows of no weight. Its ranks
    still run the forward and backward pass, so every gradient exists for torchft's average over
    the groups (a step without a loss cannot run in a replica group), and contributes zero."""
    done = Completion(tokens=[END_TOKEN], logprobs=[0.0], finished=True)
    return Kept(
        prompts=[prompt, prompt],
        completions=[done, done],
        rewards=[torch.tensor([0.0, 1.0])],
        weightless=True,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Across:
    """This process (or gang) is replica group `replica_id` of `groups` on a run of several nodes:
    `total(x)` sums a float over the groups of the step's quorum (torchft's all-reduce)."""

    replica_id: int
    groups: int
    total: Callable[[float], float]


def take_batch(
    batch: RolloutBatch,
    answers: list[str],
    cfg: RlvrConfig,
    kept: Kept,
    st: StepStats,
    prompts: int | None = None,
) -> None:
    """Score a fresh batch and keep, up to `prompts` (default `prompts_per_step`), the groups dynamic
    sampling lets through."""
    prompts = cfg.rlvr.prompts_per_step if prompts is None else prompts
    for prompt, group, answer in zip(batch.prompts, batch.groups, answers, strict=True):
        rewards, correct = score_group(group, answer, cfg)
        kept.sampled += len(group)
        kept.right += int(correct.sum())
        kept.reward_sum += float(rewards.sum())
        if not bool(informative_groups(correct[None])[0]):
            st.groups_uniform += 1
        elif len(kept.rewards) < prompts:
            kept.prompts += [prompt] * len(group)
            kept.completions += group
            kept.rewards.append(rewards)


def sample_step(
    step: int, first: str, cfg: RlvrConfig, sampler: Sampler, st: StepStats, prompts: int | None = None
) -> Kept:
    """Step `step`'s groups: the batch `first`, then refills until enough are kept (`prompts`, default
    `prompts_per_step`) or the rounds run out; a batch more than `max_staleness` versions old is
    dropped whole."""
    prompts = cfg.rlvr.prompts_per_step if prompts is None else prompts
    kept = Kept()
    request_id, round_ = first, 0
    while True:
        batch, answers = sampler.collect(request_id)
        st.rounds += 1
        if fresh_rollouts([batch.version], step, cfg.rlvr.max_staleness)[0]:
            take_batch(batch, answers, cfg, kept, st, prompts)
        else:
            st.stale_dropped += sum(len(g) for g in batch.groups)
        if len(kept.rewards) >= prompts or round_ + 1 >= cfg.rlvr.max_sampling_rounds:
            break
        round_ += 1
        request_id = sampler.request(step, round_, prompts)
    st.groups_kept = len(kept.rewards)
    st.accuracy = kept.right / kept.sampled if kept.sampled else 0.0
    st.reward = kept.reward_sum / kept.sampled if kept.sampled else 0.0
    return kept


def rank_share(rows: int, dp_rank: int, dp_degree: int) -> tuple[slice, bool]:
    """(the rows of a kept batch this data-parallel rank trains on, whether they are its own): as
    even a split as the row count allows; a rank left without a row takes row 0 with no weight, so
    that it still joins the backward pass's gradient collectives."""
    per, extra = divmod(rows, dp_degree)
    start = dp_rank * per + min(dp_rank, extra)
    stop = start + per + (1 if dp_rank < extra else 0)
    return (slice(start, stop), True) if stop > start else (slice(0, 1), False)


def policy_loss(
    model: Transformer,
    kept: Kept,
    cfg: RlvrConfig,
    device: torch.device,
    st: StepStats,
    across: Across | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(this rank's loss, the kept batch's response mask, device scalars for the loop to read) over
    the kept groups: advantages normalised within each group of shaped rewards, the clipped policy
    loss on this rank's rows (all of them in one process); the k3 KL and the clip fraction, over
    every kept token, go to `st`. In one data-parallel rank they stay on the device, as the scalars
    the loop reads with the loss in its one transfer (`record_scalars` puts them in `st`): reading
    them here would be two host syncs a step, draining the GPU's queue before the backward pass.
    `across`: this is one replica group's kept batch, and the token mean is over every group's
    kept tokens."""
    inputs, targets, mask, old = policy_batch(kept.prompts, kept.completions)
    advantages = group_advantages(torch.stack(kept.rewards)).reshape(-1)
    dims = dims_of(cfg)
    rows, own = rank_share(len(kept.completions), dims.dp_rank(distributed.rank()), dims.dp_degree)
    tokens = 0.0 if kept.weightless else float(mask.sum())
    own = own and not kept.weightless
    group_tokens = tokens
    slices = dims.dp_degree
    if across is not None:
        tokens, slices = across.total(tokens), across.groups * dims.dp_degree
    local = mask[rows].to(device) * (1.0 if own else 0.0)
    old_local = old[rows].to(device)
    logprobs = sequence_logprobs(model, inputs[rows], targets[rows], device, temperature=cfg.rlvr.temperature)
    loss, clip_fraction = clipped_policy_loss(
        logprobs, old_local, advantages[rows].to(device), local, cfg.rlvr.eps_low, cfg.rlvr.eps_high
    )
    loss = global_token_mean(loss, local, tokens, slices)
    if dims.dp_degree == 1:
        return loss, mask, {"kl": kl_estimate(logprobs, old_local, local), "clip_fraction": clip_fraction}
    # Token means over the kept batch: each rank's share, weighted by its tokens.
    share = float(local.sum()) * dims.dp_degree / max(group_tokens, 1.0)
    st.kl = distributed.all_reduce_mean(float(kl_estimate(logprobs, old_local, local)) * share)
    st.clip_fraction = distributed.all_reduce_mean(float(clip_fraction) * share)
    return loss, mask, {}


def record_scalars(st: StepStats, values: dict[str, float]) -> None:
    """The step's KL and clip fraction, once the loop has read them off the device."""
    st.kl = values.get("kl", st.kl)
    st.clip_fraction = values.get("clip_fraction", st.clip_fraction)


def train_rlvr(
    cfg: RlvrConfig,
    report: Reporter,
    should_stop: Callable[[], bool],
    *,
    worker_factory: Callable[..., RolloutWorker] = RolloutWorker,
    replicas: Replicas | None = None,
) -> RlvrResult:
    """`worker_factory(shape, rope_base, threads=, device=)` builds the rollout worker (a context
    manager); tests pass a fake one to exercise staleness without timing. `replicas`: this process
    (or gang) is one replica group of a run on several nodes (see `Across`)."""
    report = rank0_only(report)
    run = _policy(cfg, pick_device(cfg.device))
    across: Across | None = None
    if replicas is None:
        run.resume(report, cfg.init_from)
    else:
        if cfg.lora is not None:
            raise ValueError("rlvr with LoRA does not run as torchft replica groups yet.")
        if cfg.rlvr.prompts_per_step % replicas.groups:
            raise ValueError(
                f"rlvr's {cfg.rlvr.prompts_per_step} prompts per step do not split over {replicas.groups} replica groups."
            )
        run.join(replicas, report, cfg.init_from)
        assert run.group is not None  # joined just above
        across = Across(replica_id=replicas.replica_id, groups=replicas.groups, total=run.group.total)
    try:
        return _train_rlvr(cfg, report, should_stop, worker_factory, run, across)
    finally:
        run.close()


def _train_rlvr(
    cfg: RlvrConfig,
    report: Reporter,
    should_stop: Callable[[], bool],
    worker_factory: Callable[..., RolloutWorker],
    run: StageRun,
    across: Across | None,
) -> RlvrResult:
    stats: list[StepStats] = []
    if run.start < cfg.steps:
        report.log(_plan_line(cfg, run.start))
    # Rank 0's worker alone: the other ranks get its rollouts from rank 0's broadcast.
    opened = (
        worker_factory(run.model.shape, cfg.rope_base, threads=cfg.threads, device=run.device.type)
        if distributed.is_rank0()
        else nullcontext(None)
    )
    with opened as worker:
        workers = _count_workers(worker is not None, report, across)
        step_fn = partial(
            rl_step,
            cfg=cfg,
            model=run.model,
            worker=worker,
            sampler=(
                Sampler(cfg, worker, None if across is None else across.replica_id)
                if worker is not None
                else None
            ),
            device=run.device,
            stats=stats,
            report=report,
            across=across,
        )
        result = run.run(step_fn, report, should_stop)
    stale_total = sum(st.stale_dropped for st in stats)
    if stale_total:
        report.log(
            f"rlvr dropped {stale_total} stale rollouts (older than {cfg.rlvr.max_staleness} versions)"
        )
    return RlvrResult(
        **result.outcome(),
        stats=stats,
        stale_dropped=stale_total,
        rollout_workers=workers,
        model=run.model,
    )


def _count_workers(mine: bool, report: Reporter, across: Across | None) -> int:
    """The rollout workers started, summed over the ranks (`mine`: this rank started one), and a log
    line of them: the one-worker rule is counted, not assumed. Collective: every rank calls it."""
    workers = round(distributed.all_reduce_mean(float(mine)) * distributed.world_size())
    ranks = distributed.world_size()
    report.log(
        f"rlvr: {workers} rollout worker{'s' if workers != 1 else ''} (rank 0's) for "
        f"{ranks} rank{'s' if ranks != 1 else ''}"
        + ("" if across is None else f" of replica group {across.replica_id} of {across.groups}")
    )
    return workers


def _policy(cfg: RlvrConfig, device: torch.device) -> StageRun:
    """The policy (seeded init, long enough for the longest prompt and L_max), AdamW, warmup then
    flat, and the stage's loop settings."""
    torch.manual_seed(cfg.seed)
    longest_prompt = max(len(p.encode()) for p, _ in cfg.problems)
    seq_len = min(longest_prompt + cfg.rlvr.max_response_tokens, cfg.shape.max_seq_len)
    model = build_model(cfg.shape, seq_len=seq_len, rope_base=cfg.rope_base, device=device, lora=cfg.lora)
    optimizer = adamw(model, cfg.learning_rate)
    warmup = max(1, round(WARMUP_FRACTION * cfg.steps))
    scheduler = LambdaLR(optimizer, partial(lr_factor, warmup=warmup, total=cfg.steps, min_ratio=1.0))
    return StageRun(model, optimizer, scheduler, loop_settings(cfg), device)


def _plan_line(cfg: RlvrConfig, start: int) -> str:
    rl = cfg.rlvr
    return (
        f"rlvr: {cfg.steps - start} steps of {rl.prompts_per_step} groups x {rl.group_size} rollouts, "
        f"clip [{1 - rl.eps_low:.2f}, {1 + rl.eps_high:.2f}], dual-clip {DUAL_CLIP_C:g}, "
        f"L_max {rl.max_response_tokens}, L_cache {rl.overlong_buffer_tokens}, staleness <= {rl.max_staleness}"
    )


def rl_step(
    step: int,
    *,
    cfg: RlvrConfig,
    model: Transformer,
    worker: RolloutWorker | None,
    sampler: Sampler | None,
    device: torch.device,
    stats: list[StepStats],
    report: Reporter,
    across: Across | None = None,
) -> StepOutput:
    """One RL step's loss (the loop's `step_fn`): publish version `step`, prefetch the next step's
    rollouts, sample this step's groups, and the clipped policy loss over the kept ones. Under
    several ranks only rank 0 holds a worker and a sampler; the others receive its kept groups. As a
    replica group (`across`), its rank 0 samples the group's share of the step's prompts (prompts of
    its own), and the token mean is over every group's kept tokens."""
    prompts = cfg.rlvr.prompts_per_step // (1 if across is None else across.groups)
    weights = full_state_dict(model)  # every rank: a collective under FSDP2 (rank 0 keeps the result)
    sampled: tuple[Kept, StepStats] | None = None
    if worker is not None and sampler is not None:
        st = StepStats(step=step + 1)
        if cfg.lora is not None:  # the worker's model is a plain one: the adapters folded in
            weights = merge_state_dict(weights, cfg.lora)
        worker.publish(step, weights)
        first = sampler.request(step, 0, prompts)
        if cfg.rlvr.max_staleness >= 1 and step + 1 < cfg.steps:
            sampler.request(step + 1, 0, prompts)  # sampled from version `step`
        sampled = (sample_step(step, first, cfg, sampler, st, prompts), st)
    del weights
    kept, st = distributed.broadcast_object(sampled)  # rank 0's groups and stats on every rank
    stats.append(st)
    if not kept.rewards and across is not None:  # the other groups may have kept some: join their step
        kept = placeholder(ByteTokenizer().encode(cfg.problems[0][0]))
    if not kept.rewards:
        report.log(
            f"rlvr step {step + 1}: no group with both right and wrong answers after {st.rounds} "
            "rounds; nothing to learn",
            LogLevel.warning,
        )
        return StepOutput(loss=None, tokens=0)
    loss, mask, scalars = policy_loss(model, kept, cfg, device, st, across)

    def on_scalars(values: dict[str, float]) -> None:  # the KL and clip fraction are on the host now
        record_scalars(st, values)
        report.log(
            f"rlvr step {step + 1}: reward {st.reward:.3f}, accuracy {st.accuracy:.3f}, kl {st.kl:.4f}, "
            f"clipped {st.clip_fraction:.3f}, groups kept {st.groups_kept} (uniform dropped {st.groups_uniform}), "
            f"stale rollouts dropped {st.stale_dropped}, rounds {st.rounds}"
        )

    tokens = 0 if kept.weightless else int(mask.sum().item())  # a host tensor: no sync
    return StepOutput(loss=loss, tokens=tokens, scalars=scalars, on_scalars=on_scalars)


def train_post(
    cfg: PostConfig, report: Reporter, should_stop: Callable[[], bool], replicas: Replicas | None = None
) -> PostResult | RlvrResult:
    """The post-training stage `cfg.stage` in this process (one rank of a gang, or alone): SFT, DPO,
    or RLVR (`cfg` an RlvrConfig). `replicas`: as one replica group of a run on several nodes."""
    match cfg.stage:
        case "sft":
            return train_sft(cfg, report, should_stop, replicas)
        case "dpo":
            return train_dpo(cfg, report, should_stop, replicas)
        case "rlvr":
            if not isinstance(cfg, RlvrConfig):
                raise ValueError("An rlvr stage needs its RLVR section (an RlvrConfig).")
            return train_rlvr(cfg, report, should_stop, replicas=replicas)
    raise ValueError(f"Unknown post-training stage {cfg.stage!r}; the trainer runs sft, dpo and rlvr.")
