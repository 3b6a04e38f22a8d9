"""The staged pipeline a run executes. The walking skeleton runs one stage, pretrain; the trainer
issue adds data preparation, the ladder check, midtrain, long-context and post-training here."""

import pathlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from contracts.manifest import Manifest
from services.trainer.pretrain import stage_config_from_manifest, train_stage


@dataclass(frozen=True, slots=True)
class PipelineResult:
    last_stage: str
    summary: str
    final_loss: float | None
    held_out_loss: float | None


def run_pipeline(manifest: Manifest, checkpoint_dir: pathlib.Path, emit: Callable[[str, dict], None],
                 should_stop: Callable[[], bool], threads: int) -> PipelineResult:
    torch.set_num_threads(max(1, threads))
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    cfg = stage_config_from_manifest(manifest, checkpoint_dir, stage="pretrain")
    emit("log", {"level": "info", "message": f"pretrain: {cfg.steps} steps of {manifest.model.size.value}"})
    result = train_stage(cfg, emit, should_stop)
    summary = f"pretrain finished at step {result.final_step}"
    if result.first_loss is not None and result.final_loss is not None:
        summary += f": loss {result.first_loss:.3f} -> {result.final_loss:.3f}"
    else:  # a redelivered run that had already finished: nothing was trained again
        summary += ": already complete (resumed from its final checkpoint)"
    if result.held_out_loss is not None:
        summary += f", held-out loss {result.held_out_loss:.3f}"
    return PipelineResult(last_stage="pretrain", summary=summary, final_loss=result.final_loss,
                          held_out_loss=result.held_out_loss)
