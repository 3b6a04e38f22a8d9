"""The optimizer loop every training stage shares: step, clip, schedule, metrics, asynchronous
checkpoints, stop requests; and the device, precision and sharding choices made once for all stages.

A stage supplies `step_fn(step) -> StepOutput` (its forward pass and loss); the loop owns the rest,
so pretrain, midtrain, long-context, SFT, DPO and RLVR checkpoint, resume and stop the same way.
The loop reports through `emit(kind, fields)` ("metrics", "checkpoint", "log") and asks
`should_stop()` before every step; on a stop it commits a checkpoint of the current step first.
"""

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from services.trainer.checkpoint import CheckpointFailed, CheckpointInfo, Checkpointer, ResumeState, load_latest, load_weights

Emit = Callable[[str, dict], None]
ShouldStop = Callable[[], bool]


class TrainingError(RuntimeError):
    """The stage cannot go on (diverged loss, final checkpoint not durable, rollout worker died)."""


def pick_device(requested: str | None = None) -> torch.device:
    """cuda when present (the same code path as CPU), else cpu."""
    return torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))


def autocast(device: torch.device) -> torch.autocast:
    # bf16 only on cuda: CPU bf16 matmuls are slow on most hosts and change the numerics the tests pin.
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def maybe_shard(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2 when the process group has more than one rank: each block, then the root. A no-op on
    one device. Untested here (no multi-GPU host); DCP's get_state_dict handles the sharded case."""
    if world_size() <= 1:
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded weights on CPU (gathered under FSDP2): what the rollout worker loads."""
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


@dataclass(kw_only=True, slots=True)
class StepOutput:
    loss: torch.Tensor | None
    """The scalar to minimise; None when the step has nothing to learn from (the step still counts)."""
    tokens: int
    """Tokens processed, for tokens/s."""


@dataclass(kw_only=True, slots=True)
class LoopSettings:
    stage: str
    steps: int
    checkpoint_dir: str
    checkpoint_interval: int = 50
    keep_last: int = 2
    grad_clip: float = 1.0
    save_on_stop: bool = True
    log_interval: int = 0
    """A progress log line every this many steps; 0 means about ten per stage."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopResult:
    final_step: int
    first_loss: float | None  # first step this call ran; None if it ran none (already complete)
    final_loss: float | None
    stopped: bool


def report_checkpoints(emit: Emit, outcomes: list[CheckpointInfo | CheckpointFailed]) -> CheckpointFailed | None:
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


def resume_or_init(
    settings: LoopSettings, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None, emit: Emit, *, init_from: str | None = None,
) -> ResumeState | None:
    """Restore this stage's latest committed checkpoint; failing that, start from the weights of
    the previous stage's final checkpoint (`init_from`) with a fresh optimizer."""
    resumed = load_latest(settings.checkpoint_dir, model, optimizer, scheduler=scheduler)
    if resumed is not None:
        emit("log", {"level": "info", "message": f"Resuming {settings.stage} from step {resumed.step} ({resumed.path})."})
        return resumed
    if init_from is not None:
        source = load_weights(init_from, model)
        if source is None:
            raise TrainingError(f"{settings.stage} starts from {init_from}, which holds no committed checkpoint.")
        emit("log", {"level": "info", "message": f"{settings.stage} starts from {source.path}."})
    return None


def run_loop(
    settings: LoopSettings, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler, step_fn: Callable[[int], StepOutput], emit: Emit,
    should_stop: ShouldStop, *, start_step: int = 0, position: Callable[[], int] = lambda: 0,
) -> LoopResult:
    """Run optimizer steps start_step+1 .. settings.steps. `step_fn(step)` gets the 0-based index of
    the step it computes; `position()` is the data position stored with each checkpoint."""
    checkpointer = Checkpointer(settings.checkpoint_dir, keep_last=settings.keep_last)
    log_every = settings.log_interval or max(1, settings.steps // 10)
    step = start_step
    first_loss = final_loss = None
    saved_step = step if start_step > 0 else -1
    stopped = False
    model.train()
    while step < settings.steps:
        if should_stop():
            stopped = True
            break
        started = time.perf_counter()
        out = step_fn(step)
        learning_rate = scheduler.get_last_lr()[0]  # the LR this step uses
        if out.loss is not None:
            out.loss.backward()
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip))
            optimizer.step()
            loss_value = out.loss.item()  # syncs the device, so the timing below is real
        else:
            grad_norm, loss_value = 0.0, 0.0
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if not math.isfinite(loss_value):
            emit("log", {"level": "error", "message": f"Loss became {loss_value} at step {step}; stopping."})
            checkpointer.wait()
            raise TrainingError(f"The loss diverged at step {step} of {settings.stage}.")
        first_loss = loss_value if first_loss is None else first_loss
        final_loss = loss_value
        emit("metrics", {
            "stage": settings.stage, "step": step, "total_steps": settings.steps, "loss": loss_value,
            "learning_rate": learning_rate, "tokens_per_s": out.tokens / (time.perf_counter() - started),
            "grad_norm": grad_norm,
        })
        report_checkpoints(emit, checkpointer.poll())
        if step % settings.checkpoint_interval == 0 or step == settings.steps:
            checkpointer.save(step, model, optimizer, scheduler=scheduler, data_position=position())
            saved_step = step
            report_checkpoints(emit, checkpointer.poll())
        if step % log_every == 0:
            emit("log", {"level": "info", "message": f"{settings.stage} step {step}/{settings.steps} loss {loss_value:.4f}"})

    if stopped:
        emit("log", {"level": "info", "message": f"Stop requested at step {step}; finishing the checkpoint."})
        if settings.save_on_stop and step > 0 and saved_step != step:
            checkpointer.save(step, model, optimizer, scheduler=scheduler, data_position=position())
    failed = report_checkpoints(emit, checkpointer.wait())
    if failed is not None and failed.step == step and not stopped:
        raise TrainingError(f"The final checkpoint of {settings.stage} at step {step} could not be saved: {failed.message}")
    return LoopResult(final_step=step, first_loss=first_loss, final_loss=final_loss, stopped=stopped)
