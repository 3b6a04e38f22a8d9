"""The pretraining stage: one manifest's next-token training loop, resumable and stoppable.

`train_stage` does no I/O besides reading data and writing checkpoints: it reports through
`emit(kind, fields)` with kind "metrics", "log" or "checkpoint" (fields named as in
`contracts.runs`), and asks `should_stop()` before every step. The caller wires both to the bus.
"""

import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.optim.lr_scheduler import LambdaLR

from contracts.manifest import DataRole, Manifest
from contracts.models import MODEL_SHAPES, ModelShape
from services.trainer.checkpoint import CheckpointFailed, CheckpointInfo, Checkpointer, load_latest
from services.trainer.data import VOCAB_SIZE, BatchIterator, eval_batches, load_tokens, split_held_out
from services.trainer.model import Transformer, count_parameters

Emit = Callable[[str, dict], None]

WARMUP_FRACTION = 0.05  # of all steps; 1-2% is enough for long runs, tiny runs need a few steps at least


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
    checkpoint_interval: int = 50
    keep_last: int = 2
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
            raise ValueError(f"seq_len {self.seq_len} exceeds the model's max_seq_len {self.shape.max_seq_len}.")
        if self.shape.vocab_size < VOCAB_SIZE:
            raise ValueError(f"The model's vocabulary ({self.shape.vocab_size}) is smaller than the {VOCAB_SIZE} bytes.")
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


class TrainingError(RuntimeError):
    """The stage cannot go on (diverged loss, final checkpoint not durable)."""


def stage_config_from_manifest(
    manifest: Manifest, checkpoint_dir: str | os.PathLike, stage: str = "pretrain"
) -> StageConfig:
    target = manifest.target
    steps = max(1, target.tokens // (target.seq_len * target.batch_size))
    return StageConfig(
        stage=stage,
        shape=MODEL_SHAPES[manifest.model.size.value],
        train_sources=[ref.source for ref in manifest.data if ref.role == DataRole.train],
        eval_sources=[ref.source for ref in manifest.data if ref.role == DataRole.eval],
        seq_len=target.seq_len,
        batch_size=target.batch_size,
        learning_rate=target.learning_rate,
        steps=steps,
        warmup_steps=max(1, round(WARMUP_FRACTION * steps)),
        seed=manifest.seed,
        checkpoint_dir=str(checkpoint_dir),
        checkpoint_interval=manifest.checkpoint.interval_steps,
        keep_last=manifest.checkpoint.keep_last,
    )


def lr_factor(step: int, *, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier on the peak LR for optimizer step `step` (0-based): linear warmup, cosine decay."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: StageConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (embeddings included, as in nanoGPT), none on norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=cfg.betas)


def load_stage_data(cfg: StageConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(train tokens, held-out tokens)."""
    train = load_tokens(cfg.train_sources, seed=cfg.seed)
    if cfg.eval_sources:
        # Another seed, so a generated eval source does not repeat the generated training lines.
        return train, load_tokens(cfg.eval_sources, seed=cfg.seed + 1)
    return split_held_out(train, cfg.held_out_fraction)


@torch.no_grad()
def held_out_loss(model: Transformer, tokens: torch.Tensor, cfg: StageConfig, device: torch.device) -> float | None:
    was_training = model.training
    model.eval()
    losses = []
    for x, y in eval_batches(tokens, seq_len=cfg.seq_len, batch_size=cfg.batch_size, max_batches=cfg.eval_max_batches):
        with _autocast(device):
            _, loss = model(x.to(device), y.to(device))
        losses.append(loss.item())
    model.train(was_training)
    return sum(losses) / len(losses) if losses else None


def _autocast(device: torch.device) -> torch.autocast:
    # bf16 only on cuda: CPU bf16 matmuls are slow on most hosts and change the numerics the tests pin.
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def _report(emit: Emit, outcomes: list[CheckpointInfo | CheckpointFailed]) -> CheckpointFailed | None:
    failed = None
    for outcome in outcomes:
        match outcome:
            case CheckpointInfo():
                emit("checkpoint", {"step": outcome.step, "path": outcome.path, "bytes": outcome.bytes,
                                    "stall_s": outcome.stall_s, "save_s": outcome.save_s})
            case CheckpointFailed():
                failed = outcome
                emit("log", {"level": "warning", "message": f"Checkpoint at step {outcome.step} failed: {outcome.message}"})
    return failed


def train_stage(cfg: StageConfig, emit: Emit, should_stop: Callable[[], bool]) -> StageResult:
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    train_tokens, held_out = load_stage_data(cfg)
    if len(held_out) < cfg.seq_len + 1:
        raise ValueError(f"The held-out data has {len(held_out)} tokens, fewer than one window of {cfg.seq_len + 1}.")

    model = Transformer(cfg.shape, z_loss=cfg.z_loss).to(device)
    optimizer = build_optimizer(model, cfg)
    warmup = cfg.warmup_steps
    scheduler = LambdaLR(optimizer, partial(lr_factor, warmup=warmup, total=cfg.steps, min_ratio=cfg.min_lr_ratio))
    batches = BatchIterator(train_tokens, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed)
    checkpointer = Checkpointer(cfg.checkpoint_dir, keep_last=cfg.keep_last)

    step = 0
    resumed = load_latest(cfg.checkpoint_dir, model, optimizer, scheduler=scheduler)
    if resumed is not None:
        step, batches.position = resumed.step, resumed.data_position
        emit("log", {"level": "info", "message": f"Resuming {cfg.stage} from step {step} ({resumed.path})."})
    else:
        emit("log", {"level": "info", "message": (
            f"Starting {cfg.stage}: {count_parameters(cfg.shape):,} parameters, {cfg.steps} steps of "
            f"{cfg.batch_size}x{cfg.seq_len} tokens on {device.type}.")})

    log_every = cfg.log_interval or max(1, cfg.steps // 10)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    first_loss = final_loss = None
    saved_step = step if resumed is not None else -1
    stopped = False
    model.train()
    while step < cfg.steps:
        if should_stop():
            stopped = True
            break
        started = time.perf_counter()
        x, y = next(batches)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with _autocast(device):
            _, loss = model(x, y)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        learning_rate = scheduler.get_last_lr()[0]  # the LR this step uses
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        loss_value = loss.item()  # syncs the device, so the timing below is real
        if not math.isfinite(loss_value):
            emit("log", {"level": "error", "message": f"Loss became {loss_value} at step {step}; stopping."})
            checkpointer.wait()
            raise TrainingError(f"The loss diverged at step {step}.")
        first_loss = loss_value if first_loss is None else first_loss
        final_loss = loss_value
        emit("metrics", {
            "stage": cfg.stage, "step": step, "total_steps": cfg.steps, "loss": loss_value,
            "learning_rate": learning_rate, "tokens_per_s": tokens_per_step / (time.perf_counter() - started),
            "grad_norm": float(grad_norm),
        })
        _report(emit, checkpointer.poll())
        if step % cfg.checkpoint_interval == 0 or step == cfg.steps:
            checkpointer.save(step, model, optimizer, scheduler=scheduler, data_position=batches.position)
            saved_step = step
            _report(emit, checkpointer.poll())
        if step % log_every == 0:
            emit("log", {"level": "info", "message": f"{cfg.stage} step {step}/{cfg.steps} loss {loss_value:.4f}"})

    if stopped:
        emit("log", {"level": "info", "message": f"Stop requested at step {step}; finishing the checkpoint."})
        if cfg.save_on_stop and step > 0 and saved_step != step:
            checkpointer.save(step, model, optimizer, scheduler=scheduler, data_position=batches.position)
    failed = _report(emit, checkpointer.wait())
    if failed is not None and failed.step == step and not stopped:
        raise TrainingError(f"The final checkpoint at step {step} could not be saved: {failed.message}")

    held_out_value = None if stopped else held_out_loss(model, held_out, cfg, device)
    if held_out_value is not None:
        emit("log", {"level": "info", "message": f"{cfg.stage} done at step {step}: held-out loss {held_out_value:.4f}"})
    return StageResult(
        final_step=step,
        first_loss=first_loss,
        final_loss=final_loss,
        held_out_loss=held_out_value,
        stopped=stopped,
        tokens=step * tokens_per_step,
    )
