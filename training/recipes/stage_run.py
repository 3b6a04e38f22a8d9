"""What every training stage shares once its model, optimizer and schedule are built: where its run
through the engine's loop starts, and the run itself, alone or as one torchft replica group.

Alone, a stage resumes its own latest checkpoint or starts from the previous stage's final weights
(`StageRun.resume`, the loop's `resume_or_init`). On a run of several nodes each node is one replica
group (`Replicas`, training/launch/multinode.py): the stage joins its group around the model,
optimizer and schedule (`StageRun.join`), resumes the group's own checkpoint or starts from the
previous stage's weights, and runs the loop with the group as its `FaultTolerance`; the group is
closed on every path (`StageRun.close`). Next-token stages (pretrain), SFT, DPO and RLVR all start
and run this way; what differs is their data, model and step.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.optim.lr_scheduler import LambdaLR

from training.engine.checkpoint import ModelKeys
from training.engine.checkpoint_load import ResumeState
from training.engine.loop import (
    FaultTolerance,
    LoopResult,
    LoopSettings,
    StepOutput,
    resume_or_init,
    run_loop,
    start_from,
)
from training.engine.reporting import Reporter
from training.model import Transformer


class ReplicaJoin(FaultTolerance, Protocol):
    """What `Replicas.join` gives: the loop's hooks plus the group's step, resume and close
    (fault_tolerance.ReplicaGroup)."""

    @property
    def step(self) -> int: ...
    def resume(self, directory: str) -> object: ...
    def total(self, value: float) -> float: ...
    def close(self) -> None: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Replicas:
    """This process is replica group `replica_id` of `groups` (torchft); `join` builds its group
    around the stage's model, optimizer and schedule."""

    replica_id: int
    groups: int
    join: Callable[[torch.nn.Module, torch.optim.Optimizer, LambdaLR], ReplicaJoin]


class CheckpointedStage(Protocol):
    """The fields of a stage's config that its loop settings are made of (StageConfig, PostConfig)."""

    stage: str
    steps: int
    checkpoint_dir: str
    checkpoint_interval: int
    keep_last: int


def stage_settings(cfg: CheckpointedStage, model_keys: ModelKeys | None = None) -> LoopSettings:
    """The loop settings of a stage's config: its name, steps and checkpoints (`model_keys`: what
    they hold, every key for None); the rest at the loop's defaults."""
    return LoopSettings(
        stage=cfg.stage,
        steps=cfg.steps,
        checkpoint_dir=cfg.checkpoint_dir,
        checkpoint_interval=cfg.checkpoint_interval,
        keep_last=cfg.keep_last,
        model_keys=model_keys,
    )


@dataclass(slots=True)
class StageRun:
    """A stage's model, optimizer, schedule and loop settings, the step its loop starts from, and
    its replica group when it trains as one (closed with `close`)."""

    model: Transformer
    optimizer: torch.optim.Optimizer
    scheduler: LambdaLR
    settings: LoopSettings
    device: torch.device
    start: int = 0
    group: ReplicaJoin | None = None

    def resume(self, report: Reporter, init_from: str | None) -> ResumeState | None:
        """Alone: restore the stage's latest committed checkpoint, or else start from `init_from`'s
        weights (`resume_or_init`); the loop starts where the checkpoint left off, or at 0."""
        resumed = resume_or_init(
            self.settings, self.model, self.optimizer, self.scheduler, report, init_from=init_from
        )
        self.start = resumed.step if resumed else 0
        return resumed

    def join(self, replicas: Replicas, report: Reporter, init_from: str | None) -> bool:
        """As replica group `replicas.replica_id`: join it, and whether it resumed its own checkpoint;
        failing that, the model starts from the previous stage's final weights (`init_from`, this
        node's copy), as `resume` does. Every group starts from the same weights; a group that is
        behind heals from a peer at its first step. The loop starts at the group's step. A failure
        here closes the group (the caller's `close` is for the run that follows)."""
        group = replicas.join(self.model, self.optimizer, self.scheduler)
        try:
            resumed = group.resume(self.settings.checkpoint_dir) is not None
            if not resumed and init_from is not None:
                start_from(self.settings.stage, init_from, self.model, report)
        except BaseException:
            group.close()
            raise
        self.group, self.start = group, group.step
        return resumed

    def run(
        self,
        step_fn: Callable[[int], StepOutput],
        report: Reporter,
        should_stop: Callable[[], bool],
        position: Callable[[], int] = lambda: 0,
    ) -> LoopResult:
        """The loop from `start`; as a replica group, with the group's hooks. `position()`: the data
        position each checkpoint records (a stage whose batch is a function of its step: 0)."""
        ft: FaultTolerance | None = self.group
        return run_loop(
            self.settings,
            self.model,
            self.optimizer,
            self.scheduler,
            step_fn,
            report,
            should_stop,
            start_step=self.start,
            position=position,
            fault_tolerance=ft,
        )

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
