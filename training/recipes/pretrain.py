"""Next-token training stages: pretrain, midtrain and long-context share this loop body and differ
only in their `StageConfig` (data, sequence length, RoPE base, LR schedule, starting weights).

`train_stage` does no I/O besides reading data and writing checkpoints: it reports through a
`Reporter` (metrics, log lines and checkpoints as `contracts.runs` events) and asks `should_stop()`
before every step. The caller wires both to the bus.

With `replicas` (a multi-node run's node share, training/launch/multinode.py) this process is one
torchft replica group among `groups`: it trains its slice of every global batch, the same loop runs
with the group as its `FaultTolerance`, and the group's committed step is the data position (a
group that healed from a peer jumps to the peer's step and batch).
"""

import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import msgspec
import torch
from torch.optim.lr_scheduler import LambdaLR

from contracts.manifest import Lora, Manifest
from contracts.models import ModelShape
from domain.curriculum import LmPlan, curriculum_of
from training.data.corpora import (
    VOCAB_SIZE,
    BatchIterator,
    eval_batches,
    load_eval_tokens,
    load_tokens,
    split_held_out,
)
from training.data.token_files import CorpusBatchIterator, TokenCorpus
from training.engine.checkpoint import CHECKPOINT_DEFAULTS
from training.engine.checkpoint_dir import batches_to_skip, skip_window
from training.engine.distributed import (
    ParallelDims,
    adamw_fused,
    all_reduce_sum,
    batch_rows,
    build_mesh,
    eval_rows,
    initialized,
    parallelize,
    rank,
    replica_batch_rows,
    world_size,
)
from training.engine.loop import (
    LoopResult,
    LoopSettings,
    StepOutput,
    TrainingError,
    accumulate,
    autocast,
    pick_device,
    to_device,
)
from training.engine.reporting import Reporter, rank0_only
from training.engine.speed import Speed, micro_steps
from training.model import Transformer, count_parameters
from training.recipes.stage_run import Replicas, StageRun, stage_settings
from training.weights import lora as lora_adapters
from training.weights.hf_load import load_hf_weights

__all__ = [
    "StageConfig",
    "StageResult",
    "TrainingError",
    "build_model",
    "build_optimizer",
    "held_out_loss",
    "lm_loss",
    "lm_stage_config",
    "lr_factor",
    "stage_config_from_manifest",
    "train_stage",
]


@dataclass(kw_only=True, slots=True)
class StageConfig:
    stage: str
    """Name reported in metrics ("pretrain")."""
    shape: ModelShape
    """Model shape; its vocab_size must cover the byte tokenizer's 256 tokens."""
    train_sources: list[str]
    """Data source strings, concatenated in order."""
    eval_sources: list[str] = field(default_factory=list)
    """Held-out data; empty means the tail `held_out_fraction` of the training text."""
    seq_len: int
    batch_size: int
    learning_rate: float
    """Peak learning rate, reached at the end of warmup."""
    steps: int
    """Optimizer steps in the whole stage (a resumed run continues toward the same number)."""
    warmup_steps: int = 1
    min_lr_ratio: float = 0.1
    """The cosine decays to this fraction of the peak learning rate."""
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    checkpoint_dir: str
    checkpoint_interval: int = CHECKPOINT_DEFAULTS.interval_steps
    keep_last: int = CHECKPOINT_DEFAULTS.keep_last
    save_on_stop: bool = True
    """On a stop request, also save the current step (a preemption loses nothing)."""
    held_out_fraction: float = 0.1
    eval_max_batches: int = 8
    """Held-out loss is averaged over at most this many batches; raise for a steadier figure."""
    z_loss: float = 0.0
    log_interval: int = 0
    """Emit a progress log line every this many steps; 0 means about ten per stage."""
    device: str | None = None
    """None picks cuda when available, else cpu."""
    rope_base: float | None = None
    """None: the shape's; long-context raises it. The shape's max_seq_len grows to seq_len if needed."""
    decay: str = "cosine"
    """"cosine" to min_lr_ratio, or "linear" (midtrain: annealed linearly to min_lr_ratio = 0)."""
    init_from: str | None = None
    """A previous stage's checkpoint dir: its final weights start this stage (fresh optimizer)."""
    parallel: ParallelDims | None = None
    """The plan's strategy and degrees; None: one process alone, or FSDP2 over every started rank.
    `batch_size` is the global batch, cut into one slice per data-parallel rank."""
    speed: Speed = field(default_factory=Speed)
    """Compile, activation checkpointing and the micro-batch (training/engine/speed.py): the plan's."""

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError("A stage needs at least 1 step.")
        if not 0 <= self.warmup_steps <= self.steps:
            raise ValueError("Warmup needs to be between 0 steps and the stage's steps.")
        if self.checkpoint_interval < 1:
            raise ValueError("Checkpoint interval needs to be at least 1 step.")
        if self.keep_last < 1:
            raise ValueError("keep_last needs to be at least 1 checkpoint.")
        if not self.train_sources:
            raise ValueError("A stage needs at least one training data source.")
        if self.seq_len < 1 or self.batch_size < 1:
            raise ValueError("seq_len and batch_size need to be at least 1.")
        if self.seq_len > self.shape.max_seq_len:
            raise ValueError(
                f"seq_len {self.seq_len} exceeds the model's max_seq_len {self.shape.max_seq_len}."
            )
        if self.decay not in ("cosine", "linear"):
            raise ValueError(f"The LR decay must be cosine or linear, not {self.decay!r}.")
        raw = not any(src.startswith(TOKENS_SOURCE) for src in self.train_sources)
        if raw and self.shape.vocab_size < VOCAB_SIZE:  # raw sources are read as bytes
            raise ValueError(
                f"The model's vocabulary ({self.shape.vocab_size}) is smaller than the {VOCAB_SIZE} bytes."
            )
        if not self.learning_rate > 0:
            raise ValueError("The learning rate needs to be positive.")


@dataclass(frozen=True, slots=True, kw_only=True)
class StageResult:
    final_step: int
    first_loss: float | None  # first step this call ran; None if it ran none (already complete)
    final_loss: float | None
    held_out_loss: float | None  # None when stopped early
    stopped: bool
    tokens: int  # tokens trained on over the whole stage, resumed part included
    model: Transformer | None = field(
        default=None, repr=False, compare=False
    )  # the trained model, for the eval battery


def lm_stage_config(
    plan: LmPlan,
    manifest: Manifest,
    checkpoint_dir: str | os.PathLike,
    *,
    train_sources: list[str],
    eval_sources: list[str],
    init_from: str | None = None,
) -> StageConfig:
    """The StageConfig of a planned next-token stage; sources are source strings (prepared or raw)."""
    return StageConfig(
        stage=plan.name,
        shape=plan.shape,
        train_sources=train_sources,
        eval_sources=eval_sources,
        seq_len=plan.seq_len,
        batch_size=plan.batch_size,
        learning_rate=plan.learning_rate,
        steps=plan.steps,
        warmup_steps=plan.warmup_steps,
        min_lr_ratio=plan.min_lr_ratio,
        decay=plan.decay,
        rope_base=plan.rope_base,
        init_from=init_from,
        seed=manifest.seed,
        checkpoint_dir=str(checkpoint_dir),
        checkpoint_interval=manifest.checkpoint.interval_steps,
        keep_last=manifest.checkpoint.keep_last,
        z_loss=manifest.target.z_loss,
    )


def stage_config_from_manifest(
    manifest: Manifest, checkpoint_dir: str | os.PathLike, stage: str = "pretrain"
) -> StageConfig:
    """The config of one planned next-token stage on the manifest's raw (unprepared) data."""
    plan = curriculum_of(manifest)
    lm = next((p for p in plan.stages if p.name == stage and isinstance(p, LmPlan)), None)
    if lm is None:
        raise ValueError(f"The manifest does not run a {stage} stage.")
    return lm_stage_config(
        lm,
        manifest,
        checkpoint_dir,
        train_sources=[plan.train_refs[n] for n in lm.data],
        eval_sources=list(plan.eval_refs.values()),
    )


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float, decay: str = "cosine") -> float:
    """Multiplier on the peak LR for optimizer step `step` (0-based): linear warmup, then cosine or
    linear decay to `min_ratio` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if decay == "cosine" else 1.0 - progress
    return min_ratio + (1.0 - min_ratio) * shape


def build_model(
    shape: ModelShape,
    *,
    seq_len: int,
    rope_base: float | None = None,
    z_loss: float = 0.0,
    device: torch.device | None = None,
    parallel: ParallelDims | None = None,
    lora: Lora | None = None,
    init_from_hf: Path | None = None,
    speed: Speed | None = None,
) -> Transformer:
    """The model for a stage: max_seq_len grown to seq_len when a stage trains longer sequences
    (RoPE tables are derived, not weights, so the same weights load), parallelized as `parallel`
    says (None: as `ParallelDims.for_world`) when distributed. Every rank builds the same weights
    from the same seed before they are split. With `lora`, the adapters go on before the model is
    sharded (training/weights/lora.py) and everything else is frozen.

    Every model is built on the meta device and parallelized there, then given storage on `device`
    (each rank only its shards) and initialised there, one parameter at a time, from generators
    seeded by (a seed drawn from the global RNG, the parameter's name): the same weights whatever
    the layout, and no rank ever holds a full random copy of the model.

    `init_from_hf`: a Hugging Face directory (config.json + safetensors; the model store's
    `ModelStore.path(digest)`) whose weights start the stage instead of a random init. `shape`
    must be the checkpoint's (`model_shapes.shape_from_hf_config` of its config.json). The model is
    then built on the meta device and parallelized there, so each rank allocates only its shards
    and reads only those (hf_load.load_hf_weights); no rank ever holds a full random copy. A
    checkpoint that does not fit the shape raises ValueError naming the tensor. Collective when
    distributed: every rank calls it. `speed`: its blocks checkpointed and compiled as it says
    (between tensor parallel and FSDP2; state-dict keys unchanged)."""
    if seq_len > shape.max_seq_len:
        shape = msgspec.structs.replace(shape, max_seq_len=seq_len)
    device = device or pick_device()
    dims = parallel or ParallelDims.for_world(world_size())
    dims.check_model(shape)
    # Drawn from the caller's seeded global RNG (alike on every rank): the per-parameter init's seed.
    seed = int(torch.randint(0, 1 << 62, ()).item())
    with torch.device("meta"):
        model = Transformer(shape, rope_base=rope_base, z_loss=z_loss)
    if lora is not None:
        lora_adapters.check_parallel(dims.tp)
        lora_adapters.apply_lora(model, lora)
    model = parallelize(model, dims, build_mesh(dims, device.type), speed, device.type)
    model.materialize(device)
    if init_from_hf is not None and lora is None:
        load_hf_weights(model, Path(init_from_hf))
        return model
    # (A LoRA model's base loads after its adapters are on: checkpoint_load.load_weights does it.)
    model.init_weights(seed)
    if lora is not None:
        lora_adapters.reset_adapters(model)
    return model


def build_optimizer(model: torch.nn.Module, cfg: StageConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (embeddings included, as in nanoGPT), none on norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = adamw_fused(decay + no_decay)  # one kernel for the whole update where torch can
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=cfg.betas, fused=fused or None)


TOKENS_SOURCE = "tokens:"  # a directory of token files (training/data/token_files.py), memory-mapped
# Held-out tokens read from token files into memory: 1M, 4 MiB as int32, far more than the eval's
# fixed windows read (eval_max_batches x batch_size x seq_len).
HELD_OUT_CAP_TOKENS = 1 << 20


def _token_dir(sources: list[str]) -> Path | None:
    """The one token directory `sources` names, None for raw sources; ValueError for a mix."""
    dirs = [s.removeprefix(TOKENS_SOURCE) for s in sources if s.startswith(TOKENS_SOURCE)]
    if not dirs:
        return None
    if len(dirs) != len(sources) or len(dirs) > 1:
        raise ValueError("A stage reads one token directory, or raw sources, not both.")
    return Path(dirs[0])


def _in_memory(corpus: TokenCorpus) -> torch.Tensor:
    """The first HELD_OUT_CAP_TOKENS tokens of a corpus (held-out windows are read from the start)."""
    return torch.from_numpy(corpus.read(0, min(len(corpus), HELD_OUT_CAP_TOKENS)).astype("int32"))


def load_stage_data(cfg: StageConfig) -> tuple[torch.Tensor | TokenCorpus, torch.Tensor]:
    """(train tokens, held-out tokens). Token files (a `tokens:<dir>` source) stay on disk, memory-
    mapped: a corpus larger than memory trains; its held-out part is read up to a cap."""
    directory = _token_dir(cfg.train_sources)
    if directory is not None:
        corpus = TokenCorpus(directory)
        held_dir = _token_dir(cfg.eval_sources) if cfg.eval_sources else None
        if held_dir is not None:
            return corpus, _in_memory(TokenCorpus(held_dir))
        train_part, held_part = corpus.split_held_out(cfg.held_out_fraction)
        return train_part, _in_memory(held_part)
    train = load_tokens(cfg.train_sources, seed=cfg.seed)
    if cfg.eval_sources:
        # The eval suites: generated with another seed, so they are not the training lines.
        return train, load_eval_tokens(cfg.eval_sources, seed=cfg.seed)
    return split_held_out(train, cfg.held_out_fraction)


@torch.no_grad()
def held_out_loss(
    model: Transformer,
    tokens: torch.Tensor,
    cfg: StageConfig,
    device: torch.device,
    seq_len: int | None = None,
) -> float | None:
    """Mean loss over fixed windows of the held-out tokens (at `seq_len`, default the stage's);
    under a gang each data-parallel rank evaluates its share (see `lm_loss`)."""
    return lm_loss(
        model,
        tokens,
        seq_len=seq_len or cfg.seq_len,
        batch_size=cfg.batch_size,
        max_batches=cfg.eval_max_batches,
        device=device,
        parallel=cfg.parallel,
    )


@torch.no_grad()
def lm_loss(
    model: Transformer,
    tokens: torch.Tensor,
    *,
    seq_len: int,
    batch_size: int,
    max_batches: int,
    device: torch.device,
    parallel: ParallelDims | None = None,
) -> float | None:
    """Mean next-token loss over the same fixed windows every call (the mean of each batch's
    mean); None if none fits. Under several data-parallel ranks (`parallel`, default FSDP2 over
    the world) every rank evaluates its rows of each batch (`eval_rows`) and the per-batch token
    sums and counts are all-reduced, so every rank returns the one-process figure after 1/dp of
    the forwards. A rank with no rows in a short last batch still runs one row, weighted 0: a
    sharded model's forward is collective."""
    # Without a process group this process evaluates everything, whatever the plan says (the
    # agent judging a gang's committed weights alone).
    dims = (parallel if initialized() else None) or ParallelDims.for_world(world_size())
    dp_rank, dp = dims.dp_rank(rank()), dims.dp_degree
    was_training = model.training
    model.eval()
    sums, counts = [], []
    for x, y in eval_batches(tokens, seq_len=seq_len, batch_size=batch_size, max_batches=max_batches):
        rows = eval_rows(len(x), dp_rank, dp)
        xs, ys, weight = x[rows], y[rows], 1.0
        if len(xs) == 0:
            xs, ys, weight = x[:1], y[:1], 0.0
        with autocast(device):
            _, loss = model(to_device(xs, device), to_device(ys, device), return_logits=False)
        sums.append(loss.float() * (ys.numel() * weight))
        counts.append(ys.numel() * weight)
    model.train(was_training)
    if not sums:
        return None
    # One collective and one host sync for every batch: [token-loss sums; token counts]. The tp
    # ranks of one data-parallel rank add the same rows, which scales sums and counts alike.
    totals = torch.stack([torch.stack(sums), torch.tensor(counts, device=sums[0].device)])
    if dp > 1 or dims.tp > 1:
        all_reduce_sum(totals)
    per_batch = (totals[0] / totals[1]).tolist()
    return sum(per_batch) / len(per_batch)


def train_stage(
    cfg: StageConfig, report: Reporter, should_stop: Callable[[], bool], replicas: Replicas | None = None
) -> StageResult:
    """Train one stage; under several ranks every rank calls this alike, and rank 0 reports."""
    device = pick_device(cfg.device)
    report = rank0_only(report)
    dims = cfg.parallel or ParallelDims.for_world(world_size())
    dims.check_batch(cfg.batch_size)
    # A micro-batch that does not divide the per-rank batch is refused before anything is built.
    micro_steps(cfg.batch_size // dims.dp_degree, cfg.speed)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    train_tokens, held_out = load_stage_data(cfg)
    if len(held_out) < cfg.seq_len + 1:
        raise ValueError(
            f"The held-out data has {len(held_out)} tokens, fewer than one window of {cfg.seq_len + 1}."
        )
    model = build_model(
        cfg.shape,
        seq_len=cfg.seq_len,
        rope_base=cfg.rope_base,
        z_loss=cfg.z_loss,
        device=device,
        parallel=dims,
        speed=cfg.speed,
    )
    optimizer = build_optimizer(model, cfg)
    run = StageRun(model, optimizer, _schedule(optimizer, cfg), _loop_settings(cfg), device)
    batches = _batches(cfg, train_tokens, dims, replicas)
    if replicas is not None:
        return _train_replica(cfg, run, batches, held_out, report, should_stop, replicas)
    _resume(cfg, run, batches, report)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    result = run.run(
        lambda _: _lm_step(model, next(batches), device, tokens_per_step, cfg.speed),
        report,
        should_stop,
        position=lambda: batches.position,
    )
    return _stage_result(cfg, model, held_out, device, report, result)


def _batches(
    cfg: StageConfig, tokens: torch.Tensor | TokenCorpus, dims: ParallelDims, replicas: Replicas | None
) -> BatchIterator | CorpusBatchIterator:
    """The stage's batches: every rank draws the same global batch and trains on its data-parallel
    slice of it (as a replica group, on its slice of the group's share)."""
    iterator = CorpusBatchIterator if isinstance(tokens, TokenCorpus) else BatchIterator
    return iterator(
        tokens,  # type: ignore[arg-type]  # each iterator takes its own kind of tokens
        seq_len=cfg.seq_len,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        rows=(
            batch_rows(cfg.batch_size, dims.dp_rank(rank()), dims.dp_degree)
            if replicas is None
            else replica_batch_rows(cfg.batch_size, replicas.replica_id, replicas.groups, dims, rank())
        ),
    )


def _lm_step(
    model: Transformer,
    batch: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
    tokens: int | None = None,
    speed: Speed | None = None,
) -> StepOutput:
    """One next-token step's loss (the loop's `step_fn`) on `batch`; `tokens` counted for tokens/s
    (None: the batch's own). With `speed.micro_batch`, the batch runs in micro-batches of that many
    sequences (gradients accumulated; each loss a mean over the same number of tokens, so the
    step's loss is their mean)."""
    x, y = to_device(batch[0], device), to_device(batch[1], device)
    count = micro_steps(x.shape[0], speed or Speed())
    scale = 1.0 / count

    def micro(xs: torch.Tensor, ys: torch.Tensor) -> StepOutput:
        with autocast(device):
            _, loss = model(xs, ys, return_logits=False)
        assert loss is not None  # targets given
        return StepOutput(loss=loss * scale if count > 1 else loss, tokens=0)

    out = accumulate([partial(micro, xs, ys) for xs, ys in zip(x.chunk(count), y.chunk(count), strict=True)])
    out.tokens = x.numel() if tokens is None else tokens
    return out


def _train_replica(
    cfg: StageConfig,
    run: StageRun,
    batches: BatchIterator | CorpusBatchIterator,
    held_out: torch.Tensor,
    report: Reporter,
    should_stop: Callable[[], bool],
    replicas: Replicas,
) -> StageResult:
    """The stage as replica group `replicas.replica_id`: resume its own checkpoint, then the loop
    with the group's hooks; batch `step` of the global stream at every step, shifted past an
    approved loss-spike skip (every group has the same window, so they stay on the same batches)."""
    skip = skip_window(cfg.checkpoint_dir)  # here a position is a step until the skip: one skip a stage

    def position(step: int) -> int:
        return step + skip[1] - skip[0] if skip is not None and step >= skip[0] else step

    resumed = run.join(replicas, report, cfg.init_from)
    try:
        if not resumed:
            report.log(
                f"Starting {cfg.stage} as replica group {replicas.replica_id} of {replicas.groups}: "
                f"{count_parameters(cfg.shape):,} parameters, {cfg.steps} steps on {run.device.type}."
            )
        if skip is not None and run.start == skip[0]:
            report.log(f"Skipping batches [{skip[0]}, {skip[1]}) of {cfg.stage}.")
        group = run.group
        assert group is not None  # joined above
        result = run.run(
            lambda step: _lm_step(run.model, batches.batch_at(position(step)), run.device, speed=cfg.speed),
            report,
            should_stop,
            position=lambda: position(group.step),
        )
    finally:
        run.close()
    return _stage_result(cfg, run.model, held_out, run.device, report, result)


def _stage_result(
    cfg: StageConfig,
    model: Transformer,
    held_out: torch.Tensor,
    device: torch.device,
    report: Reporter,
    result: LoopResult,
) -> StageResult:
    """The stage's result; its held-out loss unless it was stopped early."""
    held_out_value = None if result.stopped else held_out_loss(model, held_out, cfg, device)
    if held_out_value is not None:
        report.log(f"{cfg.stage} done at step {result.final_step}: held-out loss {held_out_value:.4f}")
    return StageResult(
        **result.outcome(),
        held_out_loss=held_out_value,
        tokens=result.final_step * cfg.batch_size * cfg.seq_len,
        model=model,
    )


def _schedule(optimizer: torch.optim.Optimizer, cfg: StageConfig) -> LambdaLR:
    """Warmup, then cosine or linear decay to min_lr_ratio of the peak."""
    return LambdaLR(
        optimizer,
        partial(
            lr_factor, warmup=cfg.warmup_steps, total=cfg.steps, min_ratio=cfg.min_lr_ratio, decay=cfg.decay
        ),
    )


def _loop_settings(cfg: StageConfig) -> LoopSettings:
    return replace(
        stage_settings(cfg),
        grad_clip=cfg.grad_clip,
        save_on_stop=cfg.save_on_stop,
        log_interval=cfg.log_interval,
    )


def _resume(
    cfg: StageConfig, run: StageRun, batches: BatchIterator | CorpusBatchIterator, report: Reporter
) -> None:
    """Where the stage continues (`run.start`, 0 for a fresh start); `batches` placed where it
    resumes, past an approved loss-spike skip window."""
    resumed = run.resume(report, cfg.init_from)
    if resumed is None:
        report.log(
            f"Starting {cfg.stage}: {count_parameters(cfg.shape):,} parameters, {cfg.steps} steps of "
            f"{cfg.batch_size}x{cfg.seq_len} tokens on {run.device.type}."
        )
        return
    batches.position = resumed.data_position
    skip_to = batches_to_skip(cfg.checkpoint_dir, batches.position)
    if skip_to is not None:  # an approved loss-spike restart: PaLM's skip of the batches around it
        report.log(f"Skipping batches [{batches.position}, {skip_to}) of {cfg.stage}.")
        batches.position = skip_to
