"""Reading committed checkpoints back: a stage's resume (model, optimizer, scheduler and RNG from its
newest checkpoint, `load_latest`) and a stage's start from weights alone (`load_weights`: the previous
stage's newest checkpoint, or a base model's Hugging Face directory).

Works with no process group and with an initialised one: rank 0 picks the checkpoint and every rank
loads the same one, each its own shards (DCP reshards on load, so a stage saved on 4 ranks resumes
on 2). The directory's layout and markers are `checkpoint_dir`'s; the saves are `checkpoint`'s.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from training.engine import distributed
from training.engine.checkpoint import ModelKeys, only_keys, set_rng_state
from training.engine.checkpoint_dir import SIDECAR, CheckpointInfo, list_checkpoints
from training.weights.lora import plain_linears


@dataclass(frozen=True, slots=True, kw_only=True)
class ResumeState:
    """What `load_latest` restored besides the model and optimizer."""

    step: int
    data_position: int
    path: str


def load_latest(
    directory: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    restore_rng: bool = True,
    model_keys: ModelKeys | None = None,
) -> ResumeState | None:
    """Restore model, optimizer, scheduler and RNG from the newest committed checkpoint, in place.
    Returns None (and touches nothing) when there is none. `model_keys`: only those model keys are
    loaded (a checkpoint saved with the same filter); the rest of the model is left as it is."""
    latest = _latest(directory)
    if latest is None:
        return None
    path = Path(latest.path)
    sidecar = json.loads((path / SIDECAR).read_text())
    # get_state_dict on a fresh optimizer materialises its state (a zero-LR step), giving DCP the
    # template of shapes it loads into.
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": only_keys(model_sd, model_keys), "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=str(path), no_dist=not distributed.initialized())
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=_load_options(model_keys),
    )
    if scheduler is not None and sidecar["scheduler"] is not None:
        scheduler.load_state_dict(sidecar["scheduler"])
    if restore_rng:
        set_rng_state(sidecar["rng"])
    return ResumeState(step=int(sidecar["step"]), data_position=int(sidecar["data_position"]), path=str(path))


def _latest(directory: str | os.PathLike) -> CheckpointInfo | None:
    """The newest committed checkpoint as rank 0 sees it, on every rank: all ranks load the same one."""
    checkpoints = list_checkpoints(directory) if distributed.is_rank0() else []
    return distributed.broadcast_object(checkpoints[-1] if checkpoints else None)


def is_hf_model_dir(directory: str | os.PathLike) -> bool:
    """A Hugging Face checkpoint (a base model of the model store): config.json and safetensors."""
    path = Path(directory)
    return (path / "config.json").is_file() and (
        (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    )


def load_weights(
    directory: str | os.PathLike, model: torch.nn.Module, *, model_keys: ModelKeys | None = None
) -> CheckpointInfo | None:
    """Load only the model weights of the newest committed checkpoint, in place: how a stage starts
    from the previous stage's result with its own fresh optimizer. None (nothing touched) if none.
    `model_keys`: only those keys (a LoRA stage's frozen base, from a checkpoint of a whole model).

    A base model's Hugging Face directory is a checkpoint too (step 0): the run's first stage starts
    from it the way later stages start from the stage before (each rank reads only its shards). It
    holds no adapter, so a LoRA model's adapters keep their initialisation."""
    if is_hf_model_dir(directory):
        from training.weights.hf_load import load_hf_weights  # safetensors / DCP's HF reader

        with plain_linears(model):  # a LoRA model's adapters are not in a base model's files
            load_hf_weights(model, Path(directory))
        return CheckpointInfo(step=0, path=str(directory), bytes=0, stall_s=0.0, save_s=0.0)
    latest = _latest(directory)
    if latest is None:
        return None
    model_sd = only_keys(get_model_state_dict(model), model_keys)
    state = {"model": model_sd}
    dcp.load(state, checkpoint_id=latest.path, no_dist=not distributed.initialized())
    set_model_state_dict(model, state["model"], options=_load_options(model_keys))
    return latest


def _load_options(keys: ModelKeys | None) -> StateDictOptions | None:
    # A filtered state names only part of the model: the rest stays as it is, not "missing".
    return None if keys is None else StateDictOptions(strict=False)
