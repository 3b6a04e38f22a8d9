"""How a run's training ends: the stop the training thread reads between steps (a cancel, a fence,
the scheduler's budget stop, a loss spike), the spike watch that sets it on a loss spike and pauses
the run with PaLM's remedy as a proposal, and the final state and message a run is reported with
once its pipeline returned or its gang was lost (services/trainer/worker.py reports them).
"""

import pathlib
import threading

import msgspec

from contracts.api import RestartProposal
from contracts.manifest import Manifest
from contracts.runs import Metrics, Outcome, RunEvent, StopReason, TrainWork
from contracts.states import RunState
from domain import budget
from runtime.configuration.settings import ENV_GANG_MAX_REQUEUES
from services.trainer.emitter import Emitter
from services.trainer.meter import Meter
from training.engine import loss_spikes
from training.engine.checkpoint_dir import committed_positions, list_checkpoints, pin, skip_window
from training.engine.reporting import Sink, check_event
from training.launch.elastic import GangLost
from training.recipes.pipeline import PipelineResult


def last_committed_step(checkpoint_dir: pathlib.Path) -> int | None:
    """The newest committed checkpoint's step across the run's stage directories, if any."""
    steps = [
        c.step
        for d in [checkpoint_dir, *checkpoint_dir.glob("*/")]
        if d.is_dir()
        for c in list_checkpoints(d)
    ]
    return max(steps) if steps else None


class Stop:
    """Why the loop must stop: set once, read by the training thread between steps."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.reason: StopReason | None = None

    def set(self, reason: StopReason) -> None:
        if not self._event.is_set():
            self.reason = reason
            self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


def final_state(
    result: PipelineResult,
    stop: Stop,
    checkpoint_dir: pathlib.Path,
    spent: tuple[float, float] = (0.0, 0.0),
) -> tuple[RunState, str]:
    """The run's final state and message once the pipeline returned (not fenced, no spike): a stop
    is a cancel, or the scheduler's budget stop (`spent`: what the meter says against the limit);
    otherwise the pipeline's outcome decides."""
    if stop.is_set():
        step = last_committed_step(checkpoint_dir)
        kept = f"; last checkpoint at step {step}" if step is not None else "; no checkpoint yet"
        if stop.reason is StopReason.budget_exhausted:
            return RunState.budget_exhausted, budget.exhausted_message(spent[0], spent[1], kept)
        return RunState.cancelled, "cancelled" + kept
    match result.outcome:
        case Outcome.gate_failed:
            return RunState.gate_failed, result.summary
        case Outcome.succeeded:
            return RunState.succeeded, result.summary
        case Outcome.stopped:  # the pipeline stops only when asked to
            raise ValueError("The pipeline stopped although no stop was requested.")


def spent(work: TrainWork, manifest: Manifest, meter: Meter | None) -> tuple[float, float]:
    """What the run spent so far by its meter (node 0's; none: nothing) and the limit the
    scheduler's budget stop holds it to, in USD (`final_state`'s `spent`)."""
    held = meter.held_gpu_s() if meter is not None else 0.0
    return (
        budget.spend_usd(held, work.plan.cost),
        budget.spend_limit(manifest, work.plan.cost, work.cost_bound_usd),
    )


def lost_gang_state(exc: GangLost, requeued: int, max_requeues: int) -> tuple[RunState, str, int | None]:
    """The run's state, message and new requeue count when its gang was lost past the launcher's
    restarts, `requeued` times before (the run's `gang_requeues`, as the lease said when this
    delivery was leased; only lost gangs count, never a redelivery for a lost agent, a fence or a
    lease retry): interrupted and requeued while fewer than `max_requeues`, failed after (no count)."""
    if requeued < max_requeues:
        n = requeued + 1
        return (
            RunState.interrupted,
            f"{exc} Interrupted: requeued to resume from the last checkpoint "
            f"(requeue {n} of at most {max_requeues}; attempt {n + 1} of at most {max_requeues + 1}).",
            n,
        )
    return (
        RunState.failed,
        f"training failed: {exc} Not requeued again: requeued {requeued} times for a lost gang "
        f"already (at most {max_requeues}, {ENV_GANG_MAX_REQUEUES}={max_requeues}).",
        None,
    )


WATCHED_STAGES = frozenset({"pretrain", "midtrain", "long_context"})  # PaLM's remedy is for LM training;
# post-training losses (DPO margins, policy-gradient losses) swing by design and would page people for nothing


class SpikeWatch:
    """Sits between the pipeline and the bus: every step's loss goes through the spike detector; a
    spike stops the loop (its checkpoint is committed first) so the run can be paused for approval.

    Given the run's `checkpoint_dir`, it pins the checkpoint a restart would go back to from the
    first spiking step on, on the training thread and so before any later save prunes: the saves
    around a spike (the one on stop among them) would otherwise evict it by `keep_last`."""

    def __init__(
        self,
        sink: Sink,
        stop: Stop,
        planted_from: int | None = None,
        checkpoint_dir: pathlib.Path | None = None,
    ) -> None:
        """`planted_from`: the trainer.loss_spike fault point's first spiking step (chaos tests);
        None but there."""
        self._sink = sink
        self.stop = stop
        self.checkpoint_dir = checkpoint_dir
        self.detector = loss_spikes.SpikeDetector()
        self.planted_from = planted_from
        self.stage, self.spike_step, self.total_steps, self.reason = "", 0, 0, ""
        self._stage_seen = ""
        self._pinned_for: int | None = None  # the first spiking step the current pin is for

    def send(self, event: RunEvent) -> None:
        """The training thread's sink: metrics of a watched stage go through the detector first."""
        event = check_event(event)
        if isinstance(event, Metrics) and event.stage in WATCHED_STAGES:
            event = self.watch(event)
        self._sink(event)

    def watch(self, metrics: Metrics) -> Metrics:
        """Observe one step's metrics; a spike sets the stop. Returns the metrics to pass on (with
        the planted fault, when one is planted, applied)."""
        if metrics.stage != self._stage_seen:  # each stage has its own loss scale
            self._stage_seen, self.detector = metrics.stage, loss_spikes.SpikeDetector()
        if self.planted_from is not None and metrics.step >= self.planted_from:
            # fault injection (tests, make chaos)
            metrics = msgspec.structs.replace(metrics, loss=metrics.loss * 10.0)
        if self.stop.is_set():  # once stopping, the spike (and its pin) stay as they are
            return metrics
        spiked = self.detector.observe(metrics.step, metrics.loss, metrics.grad_norm)
        if self.detector.first_spike_step != self._pinned_for:  # a suspected spike began or ended
            self._pin(metrics.stage, metrics.total_steps)
        if spiked:
            self.stage, self.total_steps = metrics.stage, metrics.total_steps
            self.spike_step = self.detector.first_spike_step or metrics.step
            self.reason = (
                f"loss above mean + {loss_spikes.K_SIGMA:g} sigma of the last {loss_spikes.WINDOW} steps "
                f"for {loss_spikes.CONSECUTIVE} steps"
            )
            self.stop.set(StopReason.loss_spike)
        return metrics

    def _pin(self, stage: str, total_steps: int) -> None:
        self._pinned_for = self.detector.first_spike_step
        if self.checkpoint_dir is None:
            return
        stage_dir = self.checkpoint_dir / stage
        point = (
            None
            if self._pinned_for is None
            else loss_spikes.restart_point(
                self._pinned_for, total_steps, [c.step for c in list_checkpoints(stage_dir)]
            )
        )
        pin(stage_dir, point)

    def proposal(self, checkpoint_dir: pathlib.Path) -> RestartProposal:
        """PaLM's remedy for the spike that stopped the loop, in data positions, from the checkpoints
        as they are now (the one saved on stop included); its checkpoint stays pinned until the
        restart is carried out."""
        stage_dir = checkpoint_dir / self.stage
        proposal = loss_spikes.propose(
            self.stage,
            self.spike_step,
            self.total_steps,
            committed_positions(stage_dir),
            self.reason,
            skip=skip_window(stage_dir),
        )
        pin(stage_dir, proposal.checkpoint_step)
        return proposal


async def pause_for_approval(emitter: Emitter, checkpoint_dir: pathlib.Path, watch: SpikeWatch) -> None:
    """Pause the run with PaLM's remedy as a proposal; only a confirmed approval restarts it."""
    proposal = watch.proposal(checkpoint_dir)
    await emitter.proposal(proposal)
    await emitter.state(
        RunState.awaiting_approval,
        stage=watch.stage,
        message=(
            f"loss spike at {watch.stage} step {watch.spike_step} ({watch.reason}); proposed: restart from "
            f"checkpoint step {proposal.checkpoint_step}, skipping batches [{proposal.skip_from}, {proposal.skip_to}). "
            "Waiting for a restart_from_checkpoint confirmation."
        ),
    )
