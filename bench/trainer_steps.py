"""Trainer benchmarks: optimizer steps per second of our training code against a plain torch loop
on the same model, data and batch, for pretraining, DPO and GRPO.

Pretraining runs `training.recipes.pretrain.train_stage` and DPO `training.recipes.posttrain.train_dpo`
on the tiny model. GRPO runs the shared optimizer loop (`training.engine.loop.run_loop`) with a
step built from the pure losses in `training.recipes.objectives` on fixed rollouts: the RLVR stage
also samples its rollouts inside each step, which is generation, not the loss being compared. Each plain loop is what a person would write by hand: forward,
the same loss written inline, backward, gradient clipping, AdamW, zero_grad, `loss.item()`.

A step is timed from one moment the loop has a loss as a Python float to the next (our loop's
"metrics" emit; right after `loss.item()` in the plain loop), after warm-up steps, so start-up,
data loading, the final checkpoint and the held-out evaluation stay outside. The two sides
alternate in short runs, `repeats` times, so that load from other processes on a shared machine
(which can slow a 2-thread torch step tenfold for a few seconds) falls on both; each side's rate
is one over its median step time over all runs.
"""

import itertools
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from bench import stats
from contracts.manifest import RlvrStage
from contracts.models import MODEL_SHAPES
from training.data.corpora import BatchIterator
from training.model import Transformer
from training.recipes.pretrain import build_model

SHAPE = "tiny"
SEQ_LEN, BATCH_SIZE = 64, 16  # examples/manifests/tiny.json's target
LEARNING_RATE = 3e-3
PAIRS = 8  # DPO: 8 (right, wrong answer) pairs -> 16 sequences per step
POST_LEARNING_RATE = 1e-4
GROUPS, GROUP_SIZE, ROLLOUT_LEN = 4, 4, 48  # GRPO: 4 prompts x 4 sampled answers of 48 tokens
DPO_BETA = 0.1
CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # DAPO's clip-higher values


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizes:
    steps: int
    """Timed steps per repeat."""
    warmup: int
    """Steps run before the timed window (allocator and kernel warm-up)."""
    repeats: int


def _step_times(times: list[float], warmup: int) -> list[float]:
    """Durations of the steps after the warm-up, from consecutive end-of-step timestamps."""
    window = times[warmup - 1 :]
    return [b - a for a, b in itertools.pairwise(window)]


def _compare(
    ours: Callable[[], tuple[list[float], float]],
    plain: Callable[[], tuple[list[float], float]],
    sizes: Sizes,
) -> dict:
    """Steps/s of each side from the median step time over all repeats: on a shared 2-core
    machine another process can stall a few steps, and a median is robust to those. The
    mean-based rates (window length over window time) are reported beside it."""
    durations: dict[str, list[float]] = {"ours": [], "plain": []}
    mean_rates: dict[str, list[float]] = {"ours": [], "plain": []}
    first_losses = []
    for repeat in range(sizes.repeats):
        order = (("ours", ours), ("plain", plain))
        for name, side in order if repeat % 2 == 0 else order[::-1]:  # neither side always goes first
            times, first_loss = side()
            steps = _step_times(times, sizes.warmup)
            durations[name] += steps
            mean_rates[name].append(len(steps) / sum(steps))
            first_losses.append(first_loss)
    ours_rate, plain_rate = 1.0 / stats.median(durations["ours"]), 1.0 / stats.median(durations["plain"])
    return {
        "ours_steps_per_s": round(ours_rate, 2),
        "plain_steps_per_s": round(plain_rate, 2),
        "ratio": round(ours_rate / plain_rate, 3),
        "ours_mean_rates": [round(r, 2) for r in mean_rates["ours"]],
        "plain_mean_rates": [round(r, 2) for r in mean_rates["plain"]],
        "ours_p90_step_ms": stats.ms(stats.percentile(durations["ours"], 90)),
        "plain_p90_step_ms": stats.ms(stats.percentile(durations["plain"], 90)),
        # Same initial weights and first batch on both sides: the first losses must agree.
        "same_first_loss": max(first_losses) - min(first_losses) < 1e-4,
        "steps": sizes.steps,
        "warmup_steps": sizes.warmup,
        "repeats": sizes.repeats,
        "torch_threads": torch.get_num_threads(),
    }


def _plain_optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    """AdamW with decay on matrices only, as the trainer does (same update math on both sides)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LEARNING_RATE,
        betas=(0.9, 0.95),
    )


def _plain_loop(
    model: torch.nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    total: int,
    optimizer: torch.optim.Optimizer | None = None,
) -> tuple[list[float], float]:
    optimizer = optimizer or _plain_optimizer(model)
    model.train()
    times, first = [], None
    for _ in range(total):
        loss = loss_fn()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        times.append(time.perf_counter())
        first = value if first is None else first
    return times, first


def _fresh_model(seed: int = 0) -> Transformer:
    """The weights the stage starts from: built as `train_stage` builds them (per-parameter init
    from the seeded RNG: training/model.py init_weights), on the host."""
    torch.manual_seed(seed)
    shape = MODEL_SHAPES[SHAPE]
    return build_model(shape, seq_len=shape.max_seq_len, device=torch.device("cpu"))


# --- pretraining -----------------------------------------------------------------------------


def pretrain(sizes: Sizes) -> dict:
    from training.recipes.pretrain import StageConfig, load_stage_data, train_stage

    total = sizes.warmup + sizes.steps

    def config(directory: str) -> StageConfig:
        return StageConfig(
            stage="bench",
            shape=MODEL_SHAPES[SHAPE],
            train_sources=["builtin:pydoc_topics"],
            seq_len=SEQ_LEN,
            batch_size=BATCH_SIZE,
            learning_rate=LEARNING_RATE,
            steps=total,
            checkpoint_dir=directory,
            checkpoint_interval=total,
            eval_max_batches=1,
            device="cpu",
        )

    def ours() -> tuple[list[float], float]:
        times: list[float] = []
        losses: list[float] = []

        emit = _timed(times, losses)

        with tempfile.TemporaryDirectory(prefix="ito-bench-train-") as directory:
            train_stage(config(directory), emit, lambda: False)
        return times, losses[0]

    def plain() -> tuple[list[float], float]:
        cfg = config("/nonexistent")  # never written: the plain loop does not checkpoint
        train_tokens, _ = load_stage_data(cfg)
        model = _fresh_model(cfg.seed)
        batches = BatchIterator(train_tokens, seq_len=SEQ_LEN, batch_size=BATCH_SIZE, seed=cfg.seed)

        def loss_fn() -> torch.Tensor:
            x, y = next(batches)
            return model(x, y)[1]

        return _plain_loop(model, loss_fn, total)

    return {
        "what": f"train_stage on the {SHAPE} model, batch {BATCH_SIZE}x{SEQ_LEN}",
        **_compare(ours, plain, sizes),
    }


# --- DPO: our stage vs the same loss written inline -------------------------------------------


def dpo(sizes: Sizes) -> dict:
    """`posttrain.train_dpo` (our DPO stage: batches of right/wrong answers to arithmetic tasks,
    policy and frozen reference forwards, `objectives.dpo_loss`, the shared loop) against a plain
    loop that builds the same batches and writes the DPO loss inline."""
    from training.data.corpora import load_text, task_problems
    from training.recipes import posttrain

    total = sizes.warmup + sizes.steps
    problems = task_problems(load_text("generated:arithmetic", seed=0))

    def config(directory: str):
        return posttrain.PostConfig(
            stage="dpo",
            shape=MODEL_SHAPES[SHAPE],
            rope_base=None,
            problems=problems,
            steps=total,
            batch_size=PAIRS,
            learning_rate=POST_LEARNING_RATE,
            seed=0,
            checkpoint_dir=directory,
            checkpoint_interval=total,
            beta=DPO_BETA,
            device="cpu",
        )

    def ours() -> tuple[list[float], float]:
        times: list[float] = []
        losses: list[float] = []

        emit = _timed(times, losses)

        with tempfile.TemporaryDirectory(prefix="ito-bench-dpo-") as directory:
            posttrain.train_dpo(config(directory), emit, lambda: False)
        return times, losses[0]

    def plain() -> tuple[list[float], float]:
        cfg = config("/nonexistent")  # never written: the plain loop does not checkpoint
        model = _fresh_model(cfg.seed)
        reference = _fresh_model(cfg.seed).eval().requires_grad_(False)  # the stage's reference: same init
        step = 0

        def logprobs(m: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.log_softmax(m(inputs)[0].float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)

        def loss_fn() -> torch.Tensor:
            nonlocal step
            rng = posttrain.batch_rng(cfg.seed, cfg.stage, step)
            step += 1
            batch = [rng.choice(problems) for _ in range(PAIRS)]
            responses = [a for _, a in batch] + [posttrain.wrong_answer(a, rng) for _, a in batch]
            inputs, targets, mask = posttrain.response_batch([p for p, _ in batch] * 2, responses)
            policy = (logprobs(model, inputs, targets) * mask).sum(-1)
            with torch.no_grad():
                ref = (logprobs(reference, inputs, targets) * mask).sum(-1)
            margin = (policy[:PAIRS] - ref[:PAIRS]) - (policy[PAIRS:] - ref[PAIRS:])
            return -F.logsigmoid(DPO_BETA * margin).mean()

        optimizer = torch.optim.AdamW(
            model.parameters(), lr=POST_LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.0
        )
        return _plain_loop(model, loss_fn, total, optimizer)

    return {
        "what": f"posttrain.train_dpo, {PAIRS} pairs of arithmetic answers, {SHAPE} model",
        **_compare(ours, plain, sizes),
    }


# --- GRPO: our loop and losses vs the same loss written inline, on fixed rollouts ---------------


def _sequences(n: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, response mask) of `n` random byte sequences; the first third is prompt."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 256, (n, length + 1), generator=g)
    mask = torch.zeros(n, length)
    mask[:, length // 3 :] = 1.0
    return tokens[:, :-1], tokens[:, 1:], mask


def _timed(times: list[float], losses: list[float]):
    """A reporter that notes when each step's metrics arrive, and their loss."""
    from contracts.runs import Metrics, RunEvent
    from training.engine.reporting import Reporter

    def sink(event: RunEvent) -> None:
        if isinstance(event, Metrics):
            times.append(time.perf_counter())
            losses.append(event.loss)

    return Reporter(sink)


def _run_ours(model: torch.nn.Module, step_fn: Callable, total: int) -> tuple[list[float], float]:
    from torch.optim.lr_scheduler import LambdaLR

    from training.engine.loop import LoopSettings, run_loop

    optimizer = _plain_optimizer(model)
    scheduler = LambdaLR(optimizer, lambda _: 1.0)
    times: list[float] = []
    losses: list[float] = []

    emit = _timed(times, losses)

    with tempfile.TemporaryDirectory(prefix="ito-bench-post-") as directory:
        settings = LoopSettings(
            stage="bench", steps=total, checkpoint_dir=directory, checkpoint_interval=total
        )
        run_loop(
            settings,
            model,
            optimizer,
            scheduler,
            step_fn,
            emit,
            lambda: False,
        )
    return times, losses[0]


def _kept(inputs: torch.Tensor, targets: torch.Tensor, old: torch.Tensor, rewards: torch.Tensor):
    """The fixed rollouts as the RL stage holds them after sampling (`rlvr.Kept`): prompts, sampled
    completions with their rollout-time log-probabilities, one reward row per group."""
    from training.recipes.generation import Completion
    from training.recipes.rlvr import Kept

    prompt = ROLLOUT_LEN // 3 + 1  # the mask starts at position len(prompt) - 1 = ROLLOUT_LEN // 3
    rows = torch.cat([inputs, targets[:, -1:]], dim=1)
    return Kept(
        prompts=[rows[i, :prompt].tolist() for i in range(len(rows))],
        completions=[
            Completion(
                tokens=rows[i, prompt:].tolist(), logprobs=old[i, prompt - 1 :].tolist(), finished=True
            )
            for i in range(len(rows))
        ],
        rewards=list(rewards),
    )


def grpo(sizes: Sizes) -> dict:
    """One GRPO/DAPO update on fixed rollouts (rewards, rollout-time log-probabilities): the RL
    stage's own loss path (`rlvr.policy_loss`: the padded batch from the kept groups, group
    advantages, the clipped surrogate, the KL and clip fraction handed to the loop as scalars) in
    `run_loop`, against the same loss written inline in a plain loop. The stage also samples its
    rollouts inside each step; that is generation, not the loss being compared."""
    from training.recipes import objectives, rlvr

    total = sizes.warmup + sizes.steps
    n = GROUPS * GROUP_SIZE
    inputs, targets, mask = _sequences(n, ROLLOUT_LEN, seed=2)
    rewards = torch.randint(0, 2, (GROUPS, GROUP_SIZE), generator=torch.Generator().manual_seed(3)).float()
    with torch.no_grad():  # rollout-time log-probabilities are an input of the step
        old_logprobs = objectives.token_logprobs(_fresh_model()(inputs)[0], targets) * mask
    kept = _kept(inputs, targets, old_logprobs, rewards)
    cfg = rlvr.RlvrConfig(
        stage="rlvr",
        shape=MODEL_SHAPES[SHAPE],
        rope_base=None,
        problems=[("1+1=", "2")],
        steps=total,
        batch_size=GROUPS,
        learning_rate=LEARNING_RATE,
        seed=0,
        checkpoint_dir="/nonexistent",
        device="cpu",
        rlvr=RlvrStage(group_size=GROUP_SIZE, eps_low=CLIP_LOW, eps_high=CLIP_HIGH),
    )
    device = torch.device("cpu")

    def ours() -> tuple[list[float], float]:
        model = _fresh_model()
        st = rlvr.StepStats(step=1)

        def step(_: int):
            from training.engine.loop import StepOutput

            loss, step_mask, scalars = rlvr.policy_loss(model, kept, cfg, device, st)
            return StepOutput(
                loss=loss,
                tokens=int(step_mask.sum().item()),
                scalars=scalars,
                on_scalars=lambda values: rlvr.record_scalars(st, values),
            )

        return _run_ours(model, step, total)

    def plain() -> tuple[list[float], float]:
        model = _fresh_model()

        def loss_fn() -> torch.Tensor:
            mean, std = rewards.mean(-1, keepdim=True), rewards.std(-1, keepdim=True)
            advantages = ((rewards - mean) / (std + 1e-6)).reshape(-1, 1)
            logp = (
                F.log_softmax(model(inputs)[0].float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            )
            ratio = torch.exp(logp - old_logprobs)
            surrogate = torch.minimum(
                ratio * advantages, ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH) * advantages
            )
            return -(surrogate * mask).sum() / mask.sum()

        return _plain_loop(model, loss_fn, total)

    return {
        "what": f"run_loop + rlvr.policy_loss, {GROUPS}x{GROUP_SIZE} rollouts x {ROLLOUT_LEN} tokens, "
        f"{SHAPE} model",
        **_compare(ours, plain, sizes),
    }


# --- the trainer's step against a torchtitan-style reference loop ------------------------------

VERSUS_SHAPES = {"tiny": (16, 64), "small": (8, 128)}  # (batch, seq_len): CPU-sized; "small" is d256 x4


def versus_reference(sizes: Sizes, shape: str) -> dict:
    """`train_stage` (the trainer's step: run_loop, the real data path) against the self-contained
    reference loop of bench/reference_loop.py (fused AdamW, SDPA enable_gqa), eager on the CPU as
    the trainer's defaults are there, same weights and batches."""
    from bench.reference_loop import SHAPES, Run, reference_side, trainer_side

    batch, seq_len = VERSUS_SHAPES[shape]
    run = Run(
        shape=shape,
        batch_size=batch,
        seq_len=seq_len,
        steps=sizes.steps,
        warmup=sizes.warmup,
        device="cpu",
        compile=False,
    )

    def side(fn) -> Callable[[], tuple[list[float], float]]:
        def timed() -> tuple[list[float], float]:
            timing = fn(run)
            return timing.times, timing.losses[0]

        return timed

    s = SHAPES[shape]
    return {
        "what": f"train_stage vs the reference loop, {shape} (d{s.d_model} x{s.n_layer}, "
        f"{s.n_head}:{s.n_kv_head} heads), batch {batch}x{seq_len}, CPU eager",
        **_compare(side(trainer_side), side(reference_side), sizes),
    }


def _not_available(reason: str) -> dict:
    return {"status": "not_available", "reason": reason}


def run_all(sizes: Sizes) -> dict[str, dict]:
    results = {"trainer_pretrain": pretrain(sizes)}
    for shape in VERSUS_SHAPES:
        results[f"trainer_vs_reference_{shape}"] = versus_reference(sizes, shape)
    for name, bench in (("trainer_dpo", dpo), ("trainer_grpo", grpo)):
        try:
            results[name] = bench(sizes)
        except (ImportError, AttributeError) as e:  # the losses are being added to services/trainer
            results[name] = _not_available(f"services.trainer has no usable pure loss for it yet ({e})")
    return results


BENCHMARKS: dict[str, Callable[[Sizes], dict]] = {
    "pretrain": pretrain,
    "dpo": dpo,
    "grpo": grpo,
    **{f"vs_reference_{shape}": partial(versus_reference, shape=shape) for shape in VERSUS_SHAPES},
}
RUN_ALL_NAMES = [
    "trainer_pretrain",
    *(f"trainer_vs_reference_{s}" for s in VERSUS_SHAPES),
    "trainer_dpo",
    "trainer_grpo",
]


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.trainer_steps [--only dpo,grpo] [--steps N] [--threads T]`: the trainer
    figures alone, without the stack, for before/after comparisons of one change."""
    import argparse
    import json

    parser = argparse.ArgumentParser(
        prog="python -m bench.trainer_steps", description=main.__doc__.splitlines()[0]
    )
    parser.add_argument(
        "--only", default=",".join(BENCHMARKS), help=f"comma-separated from {', '.join(BENCHMARKS)}"
    )
    parser.add_argument("--steps", type=int, default=40, help="timed steps per repeat (make bench: 40)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 leaves torch's default")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    if not names or set(names) - set(BENCHMARKS):
        parser.error(f"--only takes names from {', '.join(BENCHMARKS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    sizes = Sizes(steps=args.steps, warmup=args.warmup, repeats=args.repeats)
    results = {f"trainer_{name}": BENCHMARKS[name](sizes) for name in names}
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
