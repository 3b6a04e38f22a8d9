"""Post-training on verifiable tasks: SFT (loss on response tokens only) and DPO (sigmoid loss
against the frozen incoming model). RLVR lives in `rlvr.py`; the objectives in `objectives.py`.

A task is a (prompt, answer) pair from a generated source: "12+35=" -> "47"; the response the model
learns is the answer and a newline. Batches are drawn from a generator seeded by (seed, stage, step)
alone, so a resumed stage sees exactly the batches an uninterrupted one would.

DPO's frozen reference is a function of the batch alone, so its log-probabilities are computed once
per batch, ahead of the steps, many batches to a no-grad forward (`ReferenceLogprobs`), not in every
step beside the policy's forward.

Under several ranks (`PostConfig.parallel`, a gang started by training/launch/elastic.py) every rank
draws the same global batch and trains on its data-parallel slice of it, through the same loop: a
token-level mean is taken over the global batch's tokens (`global_token_mean`), so the gradients the
ranks average and the loss the loop logs are the single process's. DPO's frozen reference is a plain
model on every rank, scoring that rank's slice of the pairs.

On a run of several nodes (`replicas`, training/launch/multinode.py) each node is one torchft replica
group, and SFT and DPO train through the same loop with the group as its `FaultTolerance`, as a
next-token stage does (`stage_run.StageRun.join`): the group resumes its own checkpoint or starts from
the previous stage's weights, heals from a peer when it is behind, and its committed step is the
data position (a batch is a function of the step). The groups split the global batch and each
group's ranks split its share (`distributed.replica_batch_rows`); token means are over the global
batch (`global_token_mean` over groups x ranks slices). The loss a group logs is its share's
contribution to that mean, not the global loss (torchft averages gradients, not the logged loss).
"""

import random
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch.optim.lr_scheduler import LambdaLR

from contracts.manifest import Lora
from contracts.models import ModelShape
from training.data.corpora import ByteTokenizer
from training.engine.checkpoint import CHECKPOINT_DEFAULTS
from training.engine.checkpoint_load import is_hf_model_dir
from training.engine.distributed import (
    ParallelDims,
    adamw_fused,
    batch_rows,
    rank,
    replica_batch_rows,
    world_size,
)
from training.engine.loop import (
    LoopResult,
    LoopSettings,
    StepOutput,
    accumulate,
    autocast,
    pick_device,
    to_device,
)
from training.engine.reporting import Reporter, rank0_only, where
from training.engine.speed import Speed, micro_steps
from training.model import Transformer
from training.recipes.dpo_reference import frozen_reference
from training.recipes.generation import END_TOKEN
from training.recipes.objectives import dpo_loss, sft_loss
from training.recipes.pretrain import build_model, lr_factor
from training.recipes.stage_run import Replicas, StageRun, stage_settings
from training.weights.lora import BaseModelView, is_adapter_key, trainable_parameters

Problem = tuple[str, str]
TokenExample = tuple[list[int], list[int]]
"""An SFT example already rendered and tokenized (a chat's template applied): its token ids and, per
token, 1 where the model learns that token (the assistant's) and 0 elsewhere."""
TokenPair = tuple[list[int], list[int], list[int]]
"""A DPO pair already tokenized: prompt ids (the chat template's generation prompt included), the
chosen completion's and the rejected completion's ids (each ending with the end-of-turn token)."""
WARMUP_FRACTION = 0.05
MIN_LR_RATIO = 0.1
PAD_TOKEN = 0  # never attended to as context (padding sits to the right) and masked out of losses
# Logits one reference forward may hold (64 MiB in float32): large enough that a tiny model's
# batches go through hundreds at a time, small enough for a 128k vocabulary; lower it if memory-bound.
REFERENCE_CHUNK_LOGITS = 1 << 24


@dataclass(kw_only=True, slots=True)
class PostConfig:
    stage: str
    """"sft", "dpo" or "rlvr"."""
    shape: ModelShape
    rope_base: float | None
    problems: list[Problem]
    """Training tasks, already prepared (deduplicated, decontaminated); empty when the stage trains
    on tokenized examples or pairs instead."""
    steps: int
    batch_size: int
    learning_rate: float
    seed: int
    checkpoint_dir: str
    checkpoint_interval: int = CHECKPOINT_DEFAULTS.interval_steps
    keep_last: int = CHECKPOINT_DEFAULTS.keep_last
    init_from: str | None = None
    beta: float = 0.1
    """DPO only."""
    device: str | None = None
    parallel: ParallelDims | None = None
    """The plan's strategy and degrees; None: one process alone (or FSDP2 over every started rank,
    as for a next-token stage). `batch_size` is the global batch, one slice per data-parallel rank."""
    lora: Lora | None = None
    """Low-rank adapters (training/weights/lora.py): the incoming model frozen, only the adapters
    train and are checkpointed; DPO's reference is then the same model with its adapters off.
    None: full fine-tuning. Not yet with `replicas` (torchft groups heal whole models)."""
    examples: list[TokenExample] = field(default_factory=list)
    """SFT on the field's chat data (`messages` rows through the tokenizer's chat template)."""
    pairs: list[TokenPair] = field(default_factory=list)
    """DPO on the field's preference data (`prompt` / `chosen` / `rejected` rows)."""
    pad_id: int = 0
    """The tokenizer's padding id (never a target: padding is masked out of every loss)."""
    speed: Speed = field(default_factory=Speed)
    """Compile, activation checkpointing and the micro-batch (training/engine/speed.py): the plan's.
    SFT and DPO accumulate micro-batches (DPO's micro-batch counts pairs); RLVR's step runs whole."""

    def __post_init__(self) -> None:
        if not (self.problems or self.examples or self.pairs):
            raise ValueError(
                f"{self.stage} needs training data: verifiable tasks (a generated:arithmetic or "
                "generated:reverse ref), chat rows (messages) or preference rows (prompt/chosen/rejected)."
            )
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"{self.stage} needs at least 1 step and a batch of at least 1.")


@dataclass(frozen=True, slots=True, kw_only=True)
class PostResult:
    final_step: int
    first_loss: float | None
    final_loss: float | None
    stopped: bool
    model: Transformer | None = field(default=None, repr=False, compare=False)


def batch_rng(seed: int, stage: str, step: int) -> random.Random:
    return random.Random(f"{stage}:{seed}:{step}")


def wrong_answer(answer: str, rng: random.Random) -> str:
    """A plausible wrong answer for a DPO rejected response: a nearby number, or a letter swap."""
    if answer.lstrip("-").isdigit():
        return str(int(answer) + rng.choice([d for d in range(-10, 11) if d]))
    letters = list(answer)
    if len(set(letters)) > 1:
        while "".join(letters) == answer:
            i, j = rng.sample(range(len(letters)), 2)
            letters[i], letters[j] = letters[j], letters[i]
        return "".join(letters)
    return answer + ("a" if answer[-1:] != "a" else "b")


def response_batch(
    prompts: Sequence[str], responses: Sequence[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, mask) for prompt+response+newline sequences, right-padded; mask is 1 where
    the target is a response token (newline included), 0 on prompt and padding."""
    tok = ByteTokenizer()
    rows = [(tok.encode(p), [*tok.encode(r), END_TOKEN]) for p, r in zip(prompts, responses, strict=True)]
    width = max(len(p) + len(r) for p, r in rows) - 1
    inputs = torch.full((len(rows), width), PAD_TOKEN, dtype=torch.long)
    targets = torch.full((len(rows), width), PAD_TOKEN, dtype=torch.long)
    mask = torch.zeros((len(rows), width))
    for i, (p, r) in enumerate(rows):
        seq = torch.tensor(p + r)
        inputs[i, : len(seq) - 1] = seq[:-1]
        targets[i, : len(seq) - 1] = seq[1:]
        mask[i, len(p) - 1 : len(seq) - 1] = 1.0
    return inputs, targets, mask


def token_batch(
    rows: Sequence[TokenExample], pad_id: int, max_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs, targets, mask) of tokenized examples, truncated to `max_len` + 1 tokens and
    right-padded with `pad_id`: mask is 1 where the target token is one the example learns."""
    cut = [(ids[: max_len + 1], learn[: max_len + 1]) for ids, learn in rows]
    width = max(2, max(len(ids) for ids, _ in cut)) - 1
    inputs = torch.full((len(cut), width), pad_id, dtype=torch.long)
    targets = torch.full((len(cut), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(cut), width))
    for i, (ids, learn) in enumerate(cut):
        n = len(ids) - 1
        if n < 1:
            continue
        inputs[i, :n] = torch.tensor(ids[:-1])
        targets[i, :n] = torch.tensor(ids[1:])
        mask[i, :n] = torch.tensor(learn[1:], dtype=torch.float32)
    return inputs, targets, mask


def pair_examples(pairs: Sequence[TokenPair]) -> list[TokenExample]:
    """The chosen rows of `pairs`, then their rejected rows, each prompt + completion with the
    completion's tokens learnt (DPO's log-probabilities are summed over them)."""
    chosen = [(p + c, [0] * len(p) + [1] * len(c)) for p, c, _ in pairs]
    rejected = [(p + r, [0] * len(p) + [1] * len(r)) for p, _, r in pairs]
    return chosen + rejected


def longest_sequence(cfg: "PostConfig") -> int:
    """The longest training sequence of the stage, in tokens (its model's RoPE tables cover it)."""
    lengths = [len(p.encode()) + len(a.encode()) + 1 for p, a in cfg.problems]
    lengths += [len(ids) for ids, _ in cfg.examples]
    lengths += [len(p) + max(len(c), len(r)) for p, c, r in cfg.pairs]
    return max(lengths)


@torch.no_grad()
def response_loss(
    model: Transformer, examples: Sequence[TokenExample], pad_id: int, batch_size: int = 16
) -> float | None:
    """Mean negative log-likelihood of the learnt tokens of `examples` (a chat eval split: the
    assistant's tokens), over all of them together; None without any. The same every call."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    total, count = 0.0, 0.0
    for first in range(0, len(examples), batch_size):
        inputs, targets, mask = token_batch(
            examples[first : first + batch_size], pad_id, model.shape.max_seq_len
        )
        logprobs = sequence_logprobs(model, inputs, targets, device)
        local = to_device(mask, device)
        total += float(-(logprobs * local).sum())
        count += float(local.sum())
    model.train(was_training)
    return total / count if count else None


@torch.no_grad()
def pair_logprobs(
    model: Transformer, pairs: Sequence[TokenPair], pad_id: int, batch_size: int = 16
) -> torch.Tensor:
    """(pairs, 2): each pair's chosen and rejected completion, its log-probabilities summed, as
    DPO scores them (held-out pairs: the preference gate's input)."""
    if not pairs:
        return torch.zeros((0, 2), dtype=torch.float64)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    examples = pair_examples(pairs)
    sums = []
    for first in range(0, len(examples), batch_size):
        inputs, targets, mask = token_batch(
            examples[first : first + batch_size], pad_id, model.shape.max_seq_len
        )
        logprobs = sequence_logprobs(model, inputs, targets, device)
        sums.append((logprobs * to_device(mask, device)).sum(-1).double().cpu())
    model.train(was_training)
    both = torch.cat(sums)
    return torch.stack([both[: len(pairs)], both[len(pairs) :]], dim=1)


def dims_of(cfg: PostConfig) -> ParallelDims:
    return cfg.parallel or ParallelDims.for_world(world_size())


def rank_rows(cfg: PostConfig, rows: int, replicas: Replicas | None = None) -> tuple[slice, int]:
    """(the rows of a global batch of `rows` this rank trains on, how many slices the batch is cut
    into): the data-parallel ranks' slices (all rows in one process), or, as replica group
    `replicas.replica_id`, the groups' shares of the batch, each cut among the group's ranks."""
    dims = dims_of(cfg)
    if replicas is None:
        return batch_rows(rows, dims.dp_rank(rank()), dims.dp_degree), dims.dp_degree
    return (
        replica_batch_rows(rows, replicas.replica_id, replicas.groups, dims, rank()),
        replicas.groups * dims.dp_degree,
    )


def global_token_mean(
    local_mean: torch.Tensor, local_mask: torch.Tensor, tokens: float, dp: int
) -> torch.Tensor:
    """This rank's token-level mean (over its `local_mask`) rescaled so that the mean over the `dp`
    slices of the batch (data-parallel ranks, times replica groups on several nodes), which is what
    their gradients are averaged as, is the mean over the global batch's `tokens` tokens; unchanged
    in one process."""
    if dp == 1:
        return local_mean
    return local_mean * (local_mask.sum() * (dp / max(tokens, 1.0)))


def sequence_logprobs(
    model: Transformer | BaseModelView,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    device: torch.device,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-token log-probabilities (B, T) float32 of `targets` under the model (logits /
    temperature), computed from the final hidden states a chunk of rows at a time
    (`Transformer.forward(..., logprobs=True)`): no (B, T, vocab) float32 tensor, in forward or
    backward. Through the module's call, so FSDP2's hooks and a LoRA base view apply."""
    with autocast(device):
        _, logprobs = model(
            to_device(inputs, device), to_device(targets, device), logprobs=True, temperature=temperature
        )
    return logprobs


def adamw(model: torch.nn.Module, learning_rate: float) -> torch.optim.AdamW:
    # No weight decay in post-training: it would pull the weights toward zero, away from the
    # pretrained model the small post-training steps are meant to stay near. Over the trainable
    # parameters: every one in full fine-tuning, the adapters alone under LoRA.
    params = list(trainable_parameters(model))
    fused = adamw_fused(params)  # one kernel for the whole update where torch can
    return torch.optim.AdamW(
        params, lr=learning_rate, betas=(0.9, 0.95), weight_decay=0.0, fused=fused or None
    )


def loop_settings(cfg: PostConfig) -> LoopSettings:
    """A post stage's loop settings: under LoRA its checkpoints hold the adapters alone."""
    return stage_settings(cfg, is_adapter_key if cfg.lora is not None else None)


def _setup(cfg: PostConfig, report: Reporter, replicas: Replicas | None = None) -> StageRun:
    device = pick_device(cfg.device)
    torch.manual_seed(cfg.seed)
    longest = longest_sequence(cfg)
    # A base model (an HF directory) starting a full fine-tune: built on the meta device and each
    # rank given only its shards of the checkpoint, never a whole random copy first.
    from_hf = cfg.init_from if cfg.init_from and cfg.lora is None and is_hf_model_dir(cfg.init_from) else None
    model = build_model(
        cfg.shape,
        seq_len=min(longest, cfg.shape.max_seq_len),
        rope_base=cfg.rope_base,
        device=device,
        parallel=dims_of(cfg),
        lora=cfg.lora,
        init_from_hf=Path(from_hf) if from_hf is not None and replicas is None else None,
        speed=cfg.speed,
    )
    optimizer = adamw(model, cfg.learning_rate)
    warmup = max(1, round(WARMUP_FRACTION * cfg.steps))
    scheduler = LambdaLR(
        optimizer, partial(lr_factor, warmup=warmup, total=cfg.steps, min_ratio=MIN_LR_RATIO)
    )
    run = StageRun(model, optimizer, scheduler, loop_settings(cfg), device)
    if replicas is None:
        init_from = None if from_hf is not None else cfg.init_from  # already loaded by build_model
        if run.resume(report, init_from) is None and from_hf is not None:
            report.log(f"{cfg.stage} starts from {where(from_hf)}.")
        return run
    if cfg.lora is not None:
        raise ValueError(f"{cfg.stage} with LoRA does not run as torchft replica groups yet.")
    run.join(replicas, report, cfg.init_from)
    report.log(f"{cfg.stage}: replica group {replicas.replica_id} of {replicas.groups} from step {run.start}")
    return run


def _finish(model: Transformer, result: LoopResult) -> PostResult:
    return PostResult(**result.outcome(), model=model)


def train_sft(
    cfg: PostConfig, report: Reporter, should_stop: Callable[[], bool], replicas: Replicas | None = None
) -> PostResult:
    """Under several ranks every rank calls this alike, and rank 0 reports. With `replicas` this
    process (or gang) is one torchft replica group of a run on several nodes, training its share."""
    report = rank0_only(report)
    dims_of(cfg).check_batch(cfg.batch_size)
    stage = _setup(cfg, report, replicas)
    rows, slices = rank_rows(cfg, cfg.batch_size, replicas)
    model, device = stage.model, stage.device
    count = micro_steps(rows.stop - rows.start, cfg.speed)

    def step_fn(step: int) -> StepOutput:
        rng = batch_rng(cfg.seed, cfg.stage, step)
        if cfg.examples:
            rows_of = [rng.choice(cfg.examples) for _ in range(cfg.batch_size)]
            inputs, targets, mask = token_batch(rows_of, cfg.pad_id, model.shape.max_seq_len)
        else:
            batch = [rng.choice(cfg.problems) for _ in range(cfg.batch_size)]
            inputs, targets, mask = response_batch([p for p, _ in batch], [a for _, a in batch])
        tokens = float(mask.sum())  # the global batch's response tokens (a host tensor: no sync)
        micro = [
            partial(sft_micro_step, model, part, device, tokens, slices, count)
            for part in zip(*(t[rows].chunk(count) for t in (inputs, targets, mask)), strict=True)
        ]
        out = accumulate(micro)
        out.tokens = int(inputs.numel())
        return out

    try:
        return _finish(model, stage.run(step_fn, report, should_stop))
    finally:
        stage.close()


def sft_micro_step(
    model: Transformer,
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    device: torch.device,
    tokens: float,
    slices: int,
    micro_batches: int,
) -> StepOutput:
    """SFT on rows `batch` (inputs, targets, mask) of this rank, one of its `micro_batches`: their
    tokens' share of the step's loss, so that the shares add up, and the mean over the `slices` of
    the global batch is, its mean over its `tokens` tokens whatever tokens each micro-batch holds."""
    inputs, targets, mask = batch
    logprobs = sequence_logprobs(model, inputs, targets, device)
    local = to_device(mask, device)
    if micro_batches == 1:  # the rank's rows whole: its token mean, rescaled over the slices
        return StepOutput(loss=global_token_mean(sft_loss(logprobs, local), local, tokens, slices), tokens=0)
    return StepOutput(loss=-(logprobs * local).sum() * (slices / max(tokens, 1.0)), tokens=0)


def dpo_batch(cfg: PostConfig, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step `step`'s preference pairs as one batch, a function of (seed, stage, step): the
    `batch_size` chosen rows (right answers), then their rejected rows (nearby wrong answers).
    With tokenized `pairs` (the field's preference rows) the pairs are drawn the same way."""
    rng = batch_rng(cfg.seed, cfg.stage, step)
    if cfg.pairs:
        drawn = [rng.choice(cfg.pairs) for _ in range(cfg.batch_size)]
        return token_batch(pair_examples(drawn), cfg.pad_id, cfg.shape.max_seq_len)
    batch = [rng.choice(cfg.problems) for _ in range(cfg.batch_size)]
    prompts = [p for p, _ in batch] * 2
    responses = [a for _, a in batch] + [wrong_answer(a, rng) for _, a in batch]
    return response_batch(prompts, responses)


def pair_slice(
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor], pairs: int, rows: slice
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs `rows` of a DPO batch of `pairs` pairs: their chosen rows, then their rejected rows
    (the whole batch, as it is, when `rows` covers every pair)."""
    if rows.start == 0 and rows.stop == pairs:
        return batch
    chosen, rejected = rows, slice(pairs + rows.start, pairs + rows.stop)
    inputs, targets, mask = (torch.cat([t[chosen], t[rejected]]) for t in batch)
    return inputs, targets, mask


def pair_rows(batch: tuple[torch.Tensor, ...], pairs: int, rows: slice) -> tuple[torch.Tensor, ...]:
    """The pairs `rows` of each tensor of a DPO batch of `pairs` pairs (chosen rows, then rejected
    rows): a micro-batch of the pairs, chosen then rejected again."""
    if rows.start == 0 and rows.stop == pairs:
        return batch
    return tuple(torch.cat([t[rows], t[pairs + rows.start : pairs + rows.stop]]) for t in batch)


class ReferenceLogprobs:
    """The frozen reference's summed response log-probabilities of each step's batch, computed once
    per batch index and handed out once. When a step's are missing, the batches of it and the steps
    after it (up to `chunk_logits` logits) are built and their reference forwards run together, the
    batches of one width concatenated into one forward: a row's values do not depend on the rows
    beside it (bit for bit on CPU), so the results are those of one forward per step, for fewer and
    larger forwards."""

    def __init__(
        self,
        reference: Transformer | BaseModelView,
        batch_of: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        steps: int,
        device: torch.device,
        chunk_logits: int = REFERENCE_CHUNK_LOGITS,
    ):
        self.reference = reference
        self.batch_of = batch_of
        self.steps = steps
        self.device = device
        self.chunk_logits = chunk_logits
        self.batches = 0  # batches whose reference values were computed
        self.forwards = 0
        self.seconds = 0.0  # host time in the reference forwards (on cuda: time to queue them)
        self._ready: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def take(self, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(inputs, targets, mask on the device, reference sums per row) of step `step`'s batch."""
        if step not in self._ready:
            self._fill(step)
        return self._ready.pop(step)

    @torch.no_grad()
    def _fill(self, first: int) -> None:
        started = time.perf_counter()
        vocab = self.reference.shape.vocab_size
        window: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        held = 0
        for step in range(first, self.steps):
            batch = self.batch_of(step)
            size = batch[0].numel() * vocab
            if window and held + size > self.chunk_logits:
                break
            window[step] = batch
            held += size
        by_width: dict[int, list[int]] = defaultdict(list)
        for step, (inputs, _, _) in window.items():
            by_width[inputs.shape[1]].append(step)
        for steps in by_width.values():
            inputs = torch.cat([window[s][0] for s in steps])
            targets = torch.cat([window[s][1] for s in steps])
            mask = to_device(torch.cat([window[s][2] for s in steps]), self.device)
            sums = (sequence_logprobs(self.reference, inputs, targets, self.device) * mask).sum(-1)
            rows = [window[s][0].shape[0] for s in steps]
            for s, m, r in zip(steps, mask.split(rows), sums.split(rows), strict=True):
                self._ready[s] = (window[s][0], window[s][1], m, r)
            self.forwards += 1
        self.batches += len(window)
        self.seconds += time.perf_counter() - started


def dpo_micro_step(
    model: Transformer,
    batch: tuple[torch.Tensor, ...],
    pairs: int,
    device: torch.device,
    beta: float,
    micro_batches: int,
    with_scalars: bool,
) -> StepOutput:
    """DPO on `pairs` pairs (`batch`: inputs, targets, mask, reference sums; chosen rows then
    rejected rows): their mean loss as one of `micro_batches` equal shares of the step's, and, when
    `with_scalars`, the reward accuracy and margin (read with the loss, in the loop's one transfer:
    no sync of their own in the step)."""
    inputs, targets, mask, ref = batch
    policy = (sequence_logprobs(model, inputs, targets, device) * mask).sum(-1)
    loss, chosen, rejected = dpo_loss(policy[:pairs], policy[pairs:], ref[:pairs], ref[pairs:], beta)
    out = StepOutput(loss=loss / micro_batches, tokens=int(inputs.numel()))
    if with_scalars:
        out.scalars = {"accuracy": (chosen > rejected).float().mean(), "margin": (chosen - rejected).mean()}
    return out


def train_dpo(
    cfg: PostConfig, report: Reporter, should_stop: Callable[[], bool], replicas: Replicas | None = None
) -> PostResult:
    """Preference pairs (right answer, nearby wrong answer) on the tasks; the reference is the
    incoming model (the previous stage's final weights), frozen, rebuilt the same on resume. With
    `replicas`, as one replica group of a run on several nodes: each rank scores its own pairs."""
    report = rank0_only(report)
    dims_of(cfg).check_batch(cfg.batch_size)
    stage = _setup(cfg, report, replicas)
    model, device = stage.model, stage.device
    rows, _ = rank_rows(cfg, cfg.batch_size, replicas)
    n = rows.stop - rows.start  # this rank's pairs: the loss is their mean, averaged over the ranks
    count = micro_steps(n, cfg.speed)  # micro-batches of pairs

    def batch_of(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return pair_slice(dpo_batch(cfg, step), cfg.batch_size, rows)

    report_every = max(1, cfg.steps // 5)

    def progress(step: int, values: dict[str, float]) -> None:
        report.log(
            f"dpo step {step + 1}: reward accuracy {values['accuracy']:.2f}, margin {values['margin']:.3f}"
        )

    try:
        # Under LoRA the frozen base is the incoming model itself: the adapters switched off (as
        # peft's disable_adapter), sharded as the policy is, with no second copy of the weights.
        reference = (
            BaseModelView(model)
            if cfg.lora is not None
            else frozen_reference(cfg, dims_of(cfg), model.shape.max_seq_len, device)
        )
        references = ReferenceLogprobs(reference, batch_of, cfg.steps, device)

        def step_fn(step: int) -> StepOutput:
            batch, size, reporting = references.take(step), n // count, (step + 1) % report_every == 0
            parts = [pair_rows(batch, n, slice(m * size, (m + 1) * size)) for m in range(count)]
            micro = [
                partial(dpo_micro_step, model, part, size, device, cfg.beta, count, reporting)
                for part in parts
            ]
            out = accumulate(micro)
            out.on_scalars = partial(progress, step) if reporting else None
            return out

        result = stage.run(step_fn, report, should_stop)
    finally:
        stage.close()
    if references.batches:
        report.log(
            f"dpo: reference log-probs of {references.batches} batches, each computed once, in "
            f"{references.forwards} forwards, {references.seconds:.3f} s"
        )
    return _finish(model, result)
