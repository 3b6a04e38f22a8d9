"""How a run's stages train on this node: the one decision, made from the signed plan.

The agent asks `launch(...)` once per run and hands the pipeline what it returns: the same
`Trainers` port whatever the process count. The launcher decides how many processes train:

- one rank (the plan's dims ask for one): every stage trains in the agent's own process;
- several ranks on one node (DDP, FSDP2, HSDP, TP): a gang of this node's ranks under torch's
  elastic launcher (training/launch/elastic.py), post-training included; the ladder's
  proxy runs stay in the agent's process;
- a multi-node run: this node's replica group (training/launch/multinode.py), the ladder
  decided once on node 0 and shared.

A plan this node cannot realise (too few GPUs, a model or batch the mesh cannot split, a gang
asked to span nodes) is `ParallelismError` with the sentence, before anything trains.
"""

import pathlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from contracts.manifest import Manifest
from contracts.runs import TrainWork
from domain.curriculum import Curriculum
from training.engine.distributed import ParallelismError
from training.launch import elastic, multinode
from training.recipes.pipeline import IN_PROCESS, Trainers


class Mode(StrEnum):
    in_process = "in_process"  # one rank: the agent's own process
    gang = "gang"  # this node's ranks under the elastic launcher
    node_share = "node_share"  # this node's replica group of a multi-node run


def _nothing() -> None:
    return None


@dataclass(frozen=True, slots=True, kw_only=True)
class Launch:
    """What trains the run's stages (`trainers`), how (`mode`, `processes` on this node), and what
    to release when the pipeline ends (`close`: a node share's store and Lighthouse)."""

    mode: Mode
    processes: int
    trainers: Trainers = IN_PROCESS
    close: Callable[[], None] = _nothing


def _multinode(work: TrainWork, manifest: Manifest) -> bool:
    return manifest.resources.nodes > 1 or work.nodes > 1


def mode_for(work: TrainWork, manifest: Manifest) -> Mode:
    """In process, a gang or a node share: decided by the plan's nodes and its ranks (pure)."""
    if _multinode(work, manifest):
        return Mode.node_share
    return Mode.gang if elastic.gang_dims(work.plan) is not None else Mode.in_process


def launch(
    work: TrainWork,
    manifest: Manifest,
    curriculum: Curriculum,
    checkpoint_dir: pathlib.Path,
    threads: int,
    epoch: int = 0,
) -> Launch:
    """This node's way of training the run's stages; ParallelismError for a plan it cannot realise."""
    if _multinode(work, manifest):
        refused = multinode.refusal(work, manifest, curriculum)
        if refused is not None:
            raise ParallelismError(refused)
        share = multinode.NodeShare(work, checkpoint_dir, threads, epoch)
        return Launch(
            mode=Mode.node_share,
            processes=share.gang_dims.world_size if share.gang_dims is not None else 1,
            trainers=Trainers(lm=share.train_stage, post=share.train_post, ladder=share.ladder),
            close=share.close,
        )
    dims = elastic.gang_dims(work.plan)  # ParallelismError for strategy and degrees that disagree
    if dims is None:
        return Launch(mode=Mode.in_process, processes=1)
    refused = elastic.refusal(dims, manifest, curriculum)
    if refused is not None:
        raise ParallelismError(refused)
    gang = elastic.Gang(dims, checkpoint_dir, threads)
    return Launch(
        mode=Mode.gang,
        processes=dims.world_size,
        trainers=Trainers(lm=gang.train_stage, post=gang.train_post),
    )
