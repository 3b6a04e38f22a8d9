"""The optimizer loop every training stage shares: step, clip, schedule, metrics, asynchronous
checkpoints, stop requests; and the device, precision and sharding choices made once for all stages.

A stage supplies `step_fn(step) -> StepOutput` (its forward pass and loss); the loop owns the rest,
so pretrain, midtrain, long-context, SFT, DPO and RLVR checkpoint, resume and stop the same way.
A step of several micro-batches (gradient accumulation) is `accumulate` over their step functions.
The loop reports through a `Reporter` (metrics, checkpoints, log lines: contract events) and asks
`should_stop()` before every step; on a stop it commits a checkpoint of the current step first.

Host syncs: a step's loss, gradient norm and the stage's own scalars (`StepOutput.scalars`) travel
to the host as one tensor, and are read `read_lag` steps later (one step on an accelerator), so the
device is never drained before `optimizer.step` nor between steps: the host queues step s+1 while
the device finishes step s. Every step's values are still emitted, in order, one step late at most;
before a checkpoint, a stop and the end they are all read first, so a checkpoint never holds a
step whose loss was not yet checked, and the divergence check sees every step.

Under several ranks (see `distributed`) every rank runs this loop in step: the step's values are
averaged over the ranks before they travel to the host (the logged loss is the mean over the
data-parallel ranks, each of which saw its own slice of the global batch), a stop requested on any
rank stops them all at the same step, and only rank 0 reports.

Replica groups (torchft, see `fault_tolerance`): with a `FaultTolerance` passed in, the same loop
asks it for a quorum before the forward pass, has it average the gradients across the groups after
backward (before clipping, so every group clips the same gradient), and steps the optimizer and the
schedule only when it says the step may commit. An attempt that may not commit (a peer died during
its all-reduce) is neither counted, reported as metrics, nor checkpointed: the loop tries the same
step again. The step count is the groups' committed step, which jumps forward when this group heals
from a peer. Without one, none of this runs: the step is exactly the single-group step.
"""

import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypedDict, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from contracts.runs import LogLevel
from training.engine.checkpoint import CHECKPOINT_DEFAULTS, Checkpointer, CheckpointFailed, ModelKeys
from training.engine.checkpoint_dir import CheckpointInfo
from training.engine.checkpoint_load import ResumeState, load_latest, load_weights
from training.engine.distributed import any_true, clip_grad_norm, uses_tp, world_size
from training.engine.reporting import Reporter, rank0_only, where

ShouldStop = Callable[[], bool]

# Under several ranks a stop request is all-reduced (a host round trip that every rank waits on)
# only every this many steps; a request between checks is remembered and acted on at the next one,
# the same step on every rank. At typical steps of 0.05-0.1 s a stop lands within a second; at
# multi-second steps within 8 steps, inside a launcher's SIGTERM grace (30 s and up). One process
# reads its own flag every step: no collective there.
STOP_CHECK_EVERY = 8


def stop_check_due(iteration: int, world: int) -> bool:
    """Whether the loop's `iteration`-th pass (0 first, counted the same on every rank) asks every
    rank for a stop: every pass on one process, every STOP_CHECK_EVERY-th with several ranks."""
    return world == 1 or iteration % STOP_CHECK_EVERY == 0


class FaultTolerance(Protocol):
    """The hooks of replica-group fault tolerance around one optimizer step, in the order the loop
    calls them (`fault_tolerance.ReplicaGroup` implements them with torchft)."""

    def start_step(self, *, before_heal: Callable[[], object]) -> int | None:
        """Before the forward pass: this step's quorum. The step to train when the group has just
        healed from a peer (it jumps to the peer's), else None. `before_heal` is called before a
        peer's state is loaded into the model and optimizer (the loop waits there for the copy a
        checkpoint is taking of them)."""
        ...

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """After backward: average the gradients across the replica groups; a failure is recorded
        for `should_commit`, not raised."""
        ...

    def should_commit(self) -> bool:
        """At the optimizer step: whether every group in the quorum may apply this step."""
        ...

    def end_step(self, loss: torch.Tensor, *, committed: bool) -> int:
        """After the optimizer step: the steps committed so far (the next step's 0-based index)."""
        ...

    def checkpoint_module(self) -> torch.nn.Module:
        """The module a checkpoint saves in place of the model (the model plus the group's state)."""
        ...


class TrainingError(RuntimeError):
    """The stage cannot go on (diverged loss, final checkpoint not durable, rollout worker died)."""


def pick_device(requested: str | None = None) -> torch.device:
    """cuda when present (the same code path as CPU), else cpu."""
    return torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))


def autocast(device: torch.device) -> torch.autocast:
    # bf16 only on cuda: CPU bf16 matmuls are slow on most hosts and change the numerics the tests pin.
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device` without a sync: a copy from pageable memory into cuda waits for the
    device queue, one from pinned memory does not (the caching host allocator keeps the pinned
    buffer alive until the copy is done)."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded weights on CPU (gathered under FSDP2): what the rollout worker loads."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return cast(dict[str, torch.Tensor], state)  # a model's state (unlike an optimizer's) is all tensors


@dataclass(kw_only=True, slots=True)
class StepOutput:
    loss: torch.Tensor | None
    """The scalar to minimise; None when the step has nothing to learn from (the step still counts)."""
    report_loss: torch.Tensor | None = None
    """The step's loss to report when `loss` is only the last micro-batch's share of it (`accumulate`);
    None: `loss` itself."""
    tokens: int
    """Tokens processed, for tokens/s."""
    scalars: dict[str, torch.Tensor] = field(default_factory=dict)
    """Device scalars the stage wants on the host (a KL, a clip fraction): read with the loss in the
    same transfer, without a sync of their own, and handed to `on_scalars` (a step later at most)."""
    on_scalars: Callable[[dict[str, float]], None] | None = None
    """Called with `scalars` as floats once they are on the host, before the step's metrics go out."""


def accumulate(micro: Sequence[Callable[[], StepOutput]]) -> StepOutput:
    """One optimizer step's output from its micro-batches, run in order: backward runs here on each
    but the last, whose loss the loop's backward takes, so gradients add up over them. Each
    micro-step's loss is already its share of the step's loss (a mean over equal micro-batches:
    divided by their count; a token mean: its tokens' share), so the gradients are the whole
    batch's and `report_loss`, the sum of the shares, is the step's loss. Scalars are averaged
    over the micro-batches. One micro-step: its output as it is."""
    if len(micro) == 1:
        return micro[0]()
    losses: list[torch.Tensor] = []
    scalars: dict[str, list[torch.Tensor]] = {}
    tokens = 0
    last = None
    for index, run in enumerate(micro):
        last = run()
        tokens += last.tokens
        for name, value in last.scalars.items():
            scalars.setdefault(name, []).append(value.detach())
        if last.loss is None:
            continue
        losses.append(last.loss.detach())
        if index < len(micro) - 1:
            last.loss.backward()
    assert last is not None
    if not losses:
        return StepOutput(loss=None, tokens=tokens)
    # The last micro-batch learnt nothing: a zero that keeps the loop's one backward harmless.
    loss = last.loss if last.loss is not None else losses[-1].new_zeros((), requires_grad=True)
    return StepOutput(
        loss=loss,
        report_loss=torch.stack(losses).sum(),
        tokens=tokens,
        scalars={name: torch.stack(values).mean() for name, values in scalars.items()},
        on_scalars=last.on_scalars,
    )


@dataclass(kw_only=True, slots=True)
class LoopSettings:
    stage: str
    steps: int
    checkpoint_dir: str
    checkpoint_interval: int = CHECKPOINT_DEFAULTS.interval_steps
    keep_last: int = CHECKPOINT_DEFAULTS.keep_last
    grad_clip: float = 1.0
    save_on_stop: bool = True
    log_interval: int = 0
    """A progress log line every this many steps; 0 means about ten per stage."""
    model_keys: ModelKeys | None = None
    """Which model state-dict keys the stage's checkpoints hold; None: all. A LoRA stage passes
    `lora.is_adapter_key`: its checkpoints hold the adapters alone, and its frozen base comes from
    where it started (`init_from`, or a base model loaded before the loop), on resume too."""
    read_lag: int | None = None
    """Steps the host reads a step's loss and grad norm behind the device. None: 1 on an accelerator
    (the host queues the next step while the device finishes this one), 0 on CPU, where reading is
    not a sync and a lag would only delay the divergence check and stop requests by a step."""


class LoopOutcome(TypedDict):
    """A `LoopResult`'s fields, which every stage's result carries on (`**result.outcome()`)."""

    final_step: int
    first_loss: float | None
    final_loss: float | None
    stopped: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class LoopResult:
    final_step: int
    first_loss: float | None  # first step this call ran; None if it ran none (already complete)
    final_loss: float | None
    stopped: bool

    def outcome(self) -> LoopOutcome:
        return LoopOutcome(
            final_step=self.final_step,
            first_loss=self.first_loss,
            final_loss=self.final_loss,
            stopped=self.stopped,
        )


def report_checkpoints(
    report: Reporter, outcomes: list[CheckpointInfo | CheckpointFailed]
) -> CheckpointFailed | None:
    failed = None
    for outcome in outcomes:
        match outcome:
            case CheckpointInfo():
                report.checkpoint(
                    step=outcome.step,
                    path=outcome.path,
                    size=outcome.bytes,
                    stall_s=outcome.stall_s,
                    save_s=outcome.save_s,
                )
            case CheckpointFailed():
                failed = outcome
                report.log(f"Checkpoint at step {outcome.step} failed: {outcome.message}", LogLevel.warning)
    return failed


def resume_or_init(
    settings: LoopSettings,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None,
    report: Reporter,
    *,
    init_from: str | None = None,
) -> ResumeState | None:
    """Restore this stage's latest committed checkpoint; failing that, start from the weights of
    the previous stage's final checkpoint (`init_from`) with a fresh optimizer."""
    keys = settings.model_keys
    if keys is not None and init_from is not None:
        # Adapter-only checkpoints: the frozen base they adapt is loaded first, resumed or not.
        if load_weights(init_from, model, model_keys=lambda k: not keys(k)) is None:
            raise TrainingError(f"{settings.stage} adapts {init_from}, which holds no committed checkpoint.")
        report.log(f"{settings.stage} adapts the weights of {where(init_from)}.")
    resumed = load_latest(settings.checkpoint_dir, model, optimizer, scheduler=scheduler, model_keys=keys)
    if resumed is not None:
        report.log(f"Resuming {settings.stage} from step {resumed.step} ({where(resumed.path)}).")
        return resumed
    if init_from is not None and keys is None:
        start_from(settings.stage, init_from, model, report)
    return None


def start_from(stage: str, init_from: str, model: torch.nn.Module, report: Reporter) -> None:
    """Load the final weights of the previous stage (`init_from`, its checkpoint directory or a base
    model's) into `model`: how a stage without a checkpoint of its own starts."""
    source = load_weights(init_from, model)
    if source is None:
        raise TrainingError(f"{stage} starts from {init_from}, which holds no committed checkpoint.")
    report.log(f"{stage} starts from {where(source.path)}.")


@dataclass(slots=True)
class _Reading:
    """One finished step whose values are on their way to the host."""

    step: int  # 1-based: the optimizer steps taken after it
    values: torch.Tensor | None  # [loss, grad norm, *scalars] (in flight on cuda); None: nothing learned
    ready: "torch.cuda.Event | None"  # recorded after the copy; None when `values` is read directly
    names: list[str]  # of the scalars after loss and grad norm
    on_scalars: Callable[[dict[str, float]], None] | None
    learning_rate: float
    tokens: int
    started: float


def _send_to_host(out: StepOutput, grad_norm: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """Stack the step's scalars (averaged over the ranks) and start their copy to the host; nothing
    here waits for the device."""
    assert out.loss is not None
    reported = out.loss if out.report_loss is None else out.report_loss
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2: the same norm on every rank
        grad_norm = grad_norm.full_tensor()
    loss = reported.detach().float()
    values = torch.stack(
        [
            loss,
            grad_norm.detach().float().to(loss.device),
            *(v.detach().float().reshape(()).to(loss.device) for v in out.scalars.values()),
        ]
    )
    if world_size() > 1:
        # The mean over every rank is the mean over the data-parallel ranks: the tp ranks of one
        # data-parallel rank hold the same values, and so do all ranks for the grad norm. An
        # asynchronous collective on cuda (nccl), a host one on CPU (gloo: SUM, it has no AVG).
        dist.all_reduce(values)
        values = values / world_size()
    if values.device.type != "cuda":
        return values, None  # CPU: already there; other accelerators: read (and synced) when due
    host = values.to("cpu", non_blocking=True)  # into pinned memory: an asynchronous copy
    ready = torch.cuda.Event()
    ready.record()
    return host, ready


def run_loop(
    settings: LoopSettings,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    step_fn: Callable[[int], StepOutput],
    report: Reporter,
    should_stop: ShouldStop,
    *,
    start_step: int = 0,
    position: Callable[[], int] = lambda: 0,
    fault_tolerance: FaultTolerance | None = None,
) -> LoopResult:
    """Run optimizer steps start_step+1 .. settings.steps. `step_fn(step)` gets the 0-based index of
    the step it computes; `position()` is the data position stored with each checkpoint.
    `fault_tolerance`: this process's replica group, when the run's replicas are torchft groups."""
    loop = _Loop(
        settings,
        model,
        optimizer,
        scheduler,
        rank0_only(report),
        start_step=start_step,
        position=position,
        fault_tolerance=fault_tolerance,
    )
    model.train()
    world, requested, iteration = world_size(), False, 0
    with contextlib.closing(loop.checkpointer):  # its staging buffers go with this call, error or not
        try:
            while loop.step < settings.steps:
                # Any rank's stop request stops every rank at the same step (a flag all-reduced on
                # the host at each check: stop_check_due).
                requested = requested or should_stop()
                if stop_check_due(iteration, world) and (requested if world == 1 else any_true(requested)):
                    loop.stopped = True
                    break
                iteration += 1
                loop.train_step(step_fn)
            loop.read_all()
        except TrainingError:
            raise  # a diverged read: the steps after it are not worth reporting
        except BaseException:
            with contextlib.suppress(Exception):  # the steps that did finish still report, then the error
                loop.read_all()
            raise
        return loop.finish()


class _Loop:
    """The state of one `run_loop` call: the step, the readings in flight, the losses seen."""

    def __init__(
        self,
        settings: LoopSettings,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        report: Reporter,
        *,
        start_step: int,
        position: Callable[[], int],
        fault_tolerance: FaultTolerance | None,
    ) -> None:
        self.settings, self.model, self.optimizer, self.scheduler = settings, model, optimizer, scheduler
        self.report, self.position, self.ft = report, position, fault_tolerance
        # A save copies the state in the background while the next step's forward and backward run;
        # `train_step` waits for the copy right before anything changes what is being copied.
        self.checkpointer = Checkpointer(
            settings.checkpoint_dir,
            keep_last=settings.keep_last,
            overlap_staging=True,
            model_keys=settings.model_keys,
        )
        self.log_every = settings.log_interval or max(1, settings.steps // 10)
        device = next(model.parameters()).device
        self.lag = settings.read_lag if settings.read_lag is not None else (0 if device.type == "cpu" else 1)
        self.params = list(model.parameters())
        self.tp = uses_tp(self.params)
        self.step = start_step
        self.first_loss: float | None = None
        self.final_loss: float | None = None
        self.saved_step = start_step if start_step > 0 else -1
        self.stopped = False
        self.pending: deque[_Reading] = deque()
        self.last_read = 0.0

    def train_step(self, step_fn: Callable[[int], StepOutput]) -> None:
        """One optimizer step, its reading queued; the checkpoint when one is due. Under fault
        tolerance, an attempt that may not commit leaves the step where it was."""
        started = time.perf_counter()
        ft = self.ft
        if (
            ft is not None
            and (healed := ft.start_step(before_heal=self.checkpointer.wait_staged)) is not None
        ):
            self.step = healed  # the peer's step: train its batch, not the one this group left off at
        out = step_fn(self.step)
        learning_rate = float(self.scheduler.get_last_lr()[0])  # the LR this step uses
        values, ready, committed = self._learn(out)
        if committed:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if ft is None:
            self.step += 1
        else:
            assert out.loss is not None
            self.step = ft.end_step(out.loss, committed=committed)
            if not committed:
                report_checkpoints(self.report, self.checkpointer.poll())
                return  # nothing learned, nothing to report: the next attempt is this step again
        self.pending.append(
            _Reading(
                step=self.step,
                values=values,
                ready=ready,
                names=list(out.scalars),
                on_scalars=out.on_scalars if out.loss is not None else None,
                learning_rate=learning_rate,
                tokens=out.tokens,
                started=started,
            )
        )
        checkpoint_due = (
            self.step % self.settings.checkpoint_interval == 0 or self.step == self.settings.steps
        )
        self.read_all(keep=0 if checkpoint_due else self.lag)
        report_checkpoints(self.report, self.checkpointer.poll())
        if checkpoint_due:
            self.save()
            report_checkpoints(self.report, self.checkpointer.poll())

    def _learn(self, out: StepOutput) -> tuple[torch.Tensor | None, "torch.cuda.Event | None", bool]:
        """(the step's values on their way to the host, their copy's event, whether the step may
        commit): backward, the groups' gradient average, clipping and, when the step may commit,
        the optimizer step. A step without a loss learns nothing and commits (alone: no group)."""
        ft = self.ft
        if out.loss is None:
            if ft is not None:
                # The other groups all-reduce gradients in every step: one that skips its part stalls them.
                raise TrainingError(
                    f"A step of {self.settings.stage} without a loss cannot run in a replica group."
                )
            return None, None, True
        out.loss.backward()
        if ft is not None:
            ft.reduce_gradients(self.params)
        grad_norm = clip_grad_norm(self.params, self.settings.grad_clip, tp=self.tp)
        if ft is not None and not ft.should_commit():
            return None, None, False
        self.checkpointer.wait_staged()  # the last save's copy is complete before the step changes it
        self.optimizer.step()
        values, ready = _send_to_host(out, grad_norm)
        return values, ready, True

    def save(self) -> None:
        self.checkpointer.wait_staged()  # nothing to wait for after a step; `checkpoint_module` writes
        saved = self.model if self.ft is None else self.ft.checkpoint_module()
        self.checkpointer.save(
            self.step, saved, self.optimizer, scheduler=self.scheduler, data_position=self.position()
        )
        self.saved_step = self.step

    def read_all(self, keep: int = 0) -> None:
        while len(self.pending) > keep:
            self.read(self.pending.popleft())

    def read(self, reading: _Reading) -> None:
        """The host side of one step: its values, the divergence check, its metrics."""
        if reading.values is None:
            loss_value, grad_norm, scalars = 0.0, 0.0, []
        else:
            if reading.ready is not None:
                reading.ready.synchronize()  # the copy of this step only; later steps keep running
            loss_value, grad_norm, *scalars = reading.values.tolist()
        if reading.on_scalars is not None:
            reading.on_scalars(dict(zip(reading.names, scalars, strict=True)))
        settings = self.settings
        if not math.isfinite(loss_value):
            self.report.log(f"Loss became {loss_value} at step {reading.step}; stopping.", LogLevel.error)
            self.checkpointer.wait()
            raise TrainingError(f"The loss diverged at step {reading.step} of {settings.stage}.")
        self.first_loss = loss_value if self.first_loss is None else self.first_loss
        self.final_loss = loss_value
        now = time.perf_counter()
        # Since the step started, or, when the host ran ahead, since the previous step was read:
        # with a lag the device time of consecutive steps is what the reads are apart.
        elapsed = max(now - max(reading.started, self.last_read), 1e-9)
        self.last_read = now
        self.report.metrics(
            stage=settings.stage,
            step=reading.step,
            total_steps=settings.steps,
            loss=loss_value,
            learning_rate=reading.learning_rate,
            tokens_per_s=reading.tokens / elapsed,
            grad_norm=grad_norm,
        )
        if reading.step % self.log_every == 0:
            self.report.log(f"{settings.stage} step {reading.step}/{settings.steps} loss {loss_value:.4f}")

    def finish(self) -> LoopResult:
        """After the last step or a stop: the checkpoint on stop, then wait for the one in flight."""
        step = self.step
        if self.stopped:
            self.report.log(f"Stop requested at step {step}; finishing the checkpoint.")
            if self.settings.save_on_stop and step > 0 and self.saved_step != step:
                self.save()
        failed = report_checkpoints(self.report, self.checkpointer.wait())
        if failed is not None and failed.step == step and not self.stopped:
            raise TrainingError(
                f"The final checkpoint of {self.settings.stage} at step {step} could not be saved: {failed.message}"
            )
        return LoopResult(
            final_step=step, first_loss=self.first_loss, final_loss=self.final_loss, stopped=self.stopped
        )
