"""What one rank of a training gang runs: `python -m services.trainer.launch.rank --config job.json`,
started N times by torchrun (or `torch.distributed.launcher.api.elastic_launch`, as the trainer
agent's gang launcher will). Every rank reads the same job, joins the process group torchrun set
up, builds the plan's mesh, trains the stage in step with the others and leaves the group.

The job is a tagged Struct decoded with unknown fields forbidden (the launcher writes it, so a typo
fails loudly): a `StageJob` (a next-token stage) or a `PostJob` (SFT, DPO or RLVR, its tasks in a
file the agent prepared; an RLVR gang's one rollout worker is rank 0's). Rank 0 is the one writer: the run's events (`events_path`) and per-step losses (`losses_path`) as JSON
lines, and one JSON result line on stdout. The other ranks report to a reporter that drops events.

Exit codes: 0 done, 2 a job or plan the ranks cannot run (the reason on stderr, from rank 0).
SIGTERM (what torchrun sends on shutdown) asks every rank to stop at the next step, which saves a
checkpoint of that step first.
"""

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Annotated, Any, TextIO

import msgspec
import torch
from torch.optim.lr_scheduler import LambdaLR

from contracts.manifest import Lora, RlvrStage
from contracts.models import MODEL_SHAPES, ModelShape
from contracts.runs import Metrics, RunEvent
from services.trainer.engine import distributed
from services.trainer.engine.checkpoint import CHECKPOINT_DEFAULTS
from services.trainer.engine.distributed import ParallelDims, ParallelismError
from services.trainer.engine.fault_tolerance import GangStore, ReplicaGroup
from services.trainer.engine.loop import pick_device
from services.trainer.engine.reporting import EventFile, Reporter, Sink, rank0_only
from services.trainer.recipes.posttrain import PostConfig, PostResult, Problem
from services.trainer.recipes.pretrain import Replicas, StageConfig, StageResult, train_stage
from services.trainer.recipes.rlvr import RlvrConfig, RlvrResult, train_post

EXIT_REFUSED = 2
JOB_CAP_BYTES = 1 << 20  # a job is a few hundred bytes; anything near this is not one
PROBLEMS_CAP_BYTES = 256 << 20  # a post stage's tasks: ~20 bytes each, a few MB for 100k of them


class ReplicaJob(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """This gang is replica group `replica_id` of `groups` of a multi-node run (services/trainer/
    launch/multinode.py): its ranks form one torchft group, meeting the other groups at `lighthouse`."""

    replica_id: Annotated[int, msgspec.Meta(ge=0)]
    groups: Annotated[int, msgspec.Meta(ge=1)]
    lighthouse: str


class StageJob(msgspec.Struct, tag="stage", frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One next-token stage (pretrain) on the gang."""

    shape: ModelShape | str = "tiny"
    """A ModelShape, or the name of one in contracts.models.MODEL_SHAPES."""
    steps: Annotated[int, msgspec.Meta(ge=1)]
    batch_size: Annotated[int, msgspec.Meta(ge=1)]
    """The global batch: each data-parallel rank trains on batch_size / dp of its rows."""
    seq_len: Annotated[int, msgspec.Meta(ge=1)]
    seed: int = 0
    learning_rate: float = 3e-3  # the tiny model's; lower it (3e-4) for 150M and up
    warmup_steps: int = 1
    strategy: str = "single"
    """The plan's strategy: single, ddp, fsdp2, hsdp or fsdp2+tp."""
    degrees: dict[str, int] = {}
    """The plan's degrees: dp_replicate, dp_shard, tp (missing ones are 1)."""
    checkpoint_dir: str
    checkpoint_interval: int = CHECKPOINT_DEFAULTS.interval_steps
    keep_last: int = CHECKPOINT_DEFAULTS.keep_last
    train_sources: list[str] = msgspec.field(default_factory=lambda: ["generated:arithmetic"])
    stage: str = "pretrain"
    device: str | None = None
    """None: cuda when present (this rank's GPU, LOCAL_RANK), else cpu."""
    losses_path: str | None = None
    """JSON lines {"step", "loss", "grad_norm", "learning_rate"} from rank 0."""
    events_path: str | None = None
    """Every run event, msgspec JSON, one a line, from rank 0."""
    result_path: str | None = None
    """Rank 0's summary as one JSON object, or {"refused": reason} for a plan it cannot run: how the
    trainer agent reads the outcome of a gang whose output went to per-rank logs."""
    # What a planned stage of the pipeline adds to a plain pretrain (pretrain.lm_stage_config).
    eval_sources: list[str] = []
    min_lr_ratio: float = 0.1
    decay: str = "cosine"
    rope_base: float | None = None
    init_from: str | None = None
    """A previous stage's checkpoint dir: its final weights start this stage."""
    z_loss: float = 0.0
    replica_group: ReplicaJob | None = None
    """Set on each node's gang of a multi-node run; the node's agent reports the run's parallelism."""


class PostJob(msgspec.Struct, tag="post", frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One post-training stage (SFT, DPO or RLVR) on the gang: services/trainer/recipes/posttrain.py and
    rlvr.py's config, the plan's dims and rank 0's files."""

    stage: str
    """"sft", "dpo" or "rlvr"."""
    shape: ModelShape | str = "tiny"
    rope_base: float | None = None
    problems_path: str
    """The stage's prepared tasks: a JSON list of [prompt, answer] pairs, read by every rank."""
    examples_path: str | None = None
    """SFT on chat rows: a JSON list of [token ids, learnt mask] (posttrain.TokenExample)."""
    pairs_path: str | None = None
    """DPO on preference rows: a JSON list of [prompt ids, chosen ids, rejected ids]."""
    pad_id: int = 0
    """The tokenizer's padding id."""
    lora: Lora | None = None
    """The stage's LoRA adapters (the manifest's section); None: full fine-tuning."""
    steps: Annotated[int, msgspec.Meta(ge=1)]
    batch_size: Annotated[int, msgspec.Meta(ge=1)]
    """The global batch (SFT's rows, DPO's pairs, RLVR's prompts_per_step x group_size)."""
    learning_rate: float
    seed: int = 0
    checkpoint_dir: str
    checkpoint_interval: int = CHECKPOINT_DEFAULTS.interval_steps
    keep_last: int = CHECKPOINT_DEFAULTS.keep_last
    init_from: str | None = None
    beta: float = 0.1
    """DPO only."""
    rlvr: RlvrStage | None = None
    """RLVR only: the manifest's section as it is."""
    threads: int = 1
    """Torch threads of rank 0's rollout worker (RLVR)."""
    strategy: str = "single"
    degrees: dict[str, int] = {}
    device: str | None = None
    losses_path: str | None = None
    events_path: str | None = None
    result_path: str | None = None
    replica_group: ReplicaJob | None = None
    """Set on each node's gang of a multi-node run (SFT, DPO); the node's agent reports the run's
    parallelism."""


Job = StageJob | PostJob


def read_job(path: str) -> Job:
    with open(path, "rb") as f:
        data = f.read(JOB_CAP_BYTES + 1)
    if len(data) > JOB_CAP_BYTES:
        raise ValueError(f"The job file is over {JOB_CAP_BYTES} bytes.")
    return msgspec.json.decode(data, type=Job)


def stage_config(job: StageJob, dims: ParallelDims, device: str) -> StageConfig:
    shape = job.shape if isinstance(job.shape, ModelShape) else MODEL_SHAPES.get(job.shape)
    if shape is None:
        raise ValueError(f"No model shape is called {job.shape!r}; known: {', '.join(MODEL_SHAPES)}.")
    return StageConfig(
        stage=job.stage,
        shape=shape,
        train_sources=list(job.train_sources),
        eval_sources=list(job.eval_sources),
        seq_len=job.seq_len,
        batch_size=job.batch_size,
        learning_rate=job.learning_rate,
        warmup_steps=job.warmup_steps,
        min_lr_ratio=job.min_lr_ratio,
        decay=job.decay,
        rope_base=job.rope_base,
        init_from=job.init_from,
        z_loss=job.z_loss,
        steps=job.steps,
        seed=job.seed,
        checkpoint_dir=job.checkpoint_dir,
        checkpoint_interval=job.checkpoint_interval,
        keep_last=job.keep_last,
        device=device,
        parallel=dims,
    )


def read_problems(path: str) -> list[Problem]:
    with open(path, "rb") as f:
        data = f.read(PROBLEMS_CAP_BYTES + 1)
    if len(data) > PROBLEMS_CAP_BYTES:
        raise ValueError(f"The problems file is over {PROBLEMS_CAP_BYTES} bytes.")
    return msgspec.json.decode(data, type=list[tuple[str, str]])


def read_tokens_file(path: str | None, kind: Any) -> list[Any]:
    """A post stage's tokenized examples or pairs (written by the agent), capped like the tasks."""
    if path is None:
        return []
    with open(path, "rb") as f:
        data = f.read(PROBLEMS_CAP_BYTES + 1)
    if len(data) > PROBLEMS_CAP_BYTES:
        raise ValueError(f"The examples file is over {PROBLEMS_CAP_BYTES} bytes.")
    return msgspec.json.decode(data, type=list[kind])


def post_config(job: PostJob, dims: ParallelDims, device: str) -> PostConfig:
    """The stage's PostConfig (an RlvrConfig for rlvr) on this rank."""
    shape = job.shape if isinstance(job.shape, ModelShape) else MODEL_SHAPES.get(job.shape)
    if shape is None:
        raise ValueError(f"No model shape is called {job.shape!r}; known: {', '.join(MODEL_SHAPES)}.")
    cfg = PostConfig(
        stage=job.stage,
        shape=shape,
        rope_base=job.rope_base,
        problems=read_problems(job.problems_path),
        steps=job.steps,
        batch_size=job.batch_size,
        learning_rate=job.learning_rate,
        seed=job.seed,
        checkpoint_dir=job.checkpoint_dir,
        checkpoint_interval=job.checkpoint_interval,
        keep_last=job.keep_last,
        init_from=job.init_from,
        beta=job.beta,
        device=device,
        parallel=dims,
        examples=read_tokens_file(job.examples_path, tuple[list[int], list[int]]),
        pairs=read_tokens_file(job.pairs_path, tuple[list[int], list[int], list[int]]),
        pad_id=job.pad_id,
        lora=job.lora,
    )
    if job.stage != "rlvr":
        return cfg
    if job.rlvr is None:
        raise ValueError("An rlvr job needs its RLVR section.")
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(PostConfig)}
    return RlvrConfig(**fields, rlvr=job.rlvr, threads=job.threads)


def _file_sink(events: EventFile | None, losses: TextIO | None) -> Sink:
    """The events file's sink, and each step's loss line in the losses file (the gang tests' curves)."""

    def sink(event: RunEvent) -> None:
        if events is not None:
            events(event)
        if losses is not None and isinstance(event, Metrics):
            line = {
                "step": event.step,
                "loss": event.loss,
                "grad_norm": event.grad_norm,
                "learning_rate": event.learning_rate,
            }
            losses.write(json.dumps(line) + "\n")
            losses.flush()

    return sink


def replicas(group: ReplicaJob, report: Reporter, stage: str) -> Replicas:
    """This gang as one torchft replica group: every rank's Manager with the gang's rank, world
    size and store (the one torchrun's agent hosts at MASTER_ADDR:MASTER_PORT)."""

    def progress(event: str, /, **fields: object) -> None:
        if event in ("resumed", "healed"):  # every step's line would flood the log
            report.log(f"{stage}: replica group {group.replica_id} {event} at step {fields.get('step')}")

    def join(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: LambdaLR) -> ReplicaGroup:
        return ReplicaGroup(
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            replica_id=group.replica_id,
            lighthouse=group.lighthouse,
            progress=progress,
            expected_groups=group.groups,  # the first step waits (bounded) for every node's gang
            gang=GangStore(
                rank=distributed.rank(),
                world_size=distributed.world_size(),
                host=os.environ[distributed.ENV_MASTER_ADDR],
                port=int(os.environ[distributed.ENV_MASTER_PORT]),
            ),
        )

    return Replicas(replica_id=group.replica_id, groups=group.groups, join=join)


def run(job: Job) -> dict:
    """Train `job` on this rank; rank 0's summary (the other ranks return the same numbers)."""
    dims = ParallelDims.from_plan(job.strategy, job.degrees)
    device = distributed.init(pick_device(job.device).type)
    dims.check_world(distributed.world_size())
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with _rank0_reporter(job) as report:
        if isinstance(job, PostJob):
            cfg_post = post_config(job, dims, str(device))
            if job.replica_group is None:
                _report_parallelism(report, job.stage, dims)
                return _summary(job, dims, train_post(cfg_post, report, stop.is_set))
            group = replicas(job.replica_group, report, job.stage)
            return _summary(job, dims, train_post(cfg_post, report, stop.is_set, group))
        cfg = stage_config(job, dims, str(device))
        if job.replica_group is None:
            _report_parallelism(report, job.stage, dims)
            result = train_stage(cfg, report, stop.is_set)
        else:  # the node's agent reports a multi-node run's parallelism
            result = train_stage(cfg, report, stop.is_set, replicas(job.replica_group, report, job.stage))
    return _summary(job, dims, result) | {"held_out_loss": result.held_out_loss}


@contextmanager
def _rank0_reporter(job: Job) -> Iterator[Reporter]:
    """The job's reporter. Every rank opens the files in append mode and reports through
    `rank0_only`: only rank 0's reporter writes, so the files hold one copy of each event whatever
    the world size."""
    with (
        EventFile(job.events_path) if job.events_path else nullcontext() as events,
        open(job.losses_path, "a") if job.losses_path else nullcontext() as losses,
    ):
        yield rank0_only(Reporter(_file_sink(events, losses), run_id=f"gang-{job.stage}"))


def _report_parallelism(report: Reporter, stage: str, dims: ParallelDims) -> None:
    shape, names = dims.mesh_dims()
    report.parallelism(
        stage=stage,
        strategy=dims.strategy,
        world_size=distributed.world_size(),
        mesh=dict(zip(names, shape, strict=True)),
    )


def _summary(job: Job, dims: ParallelDims, result: StageResult | PostResult | RlvrResult) -> dict:
    summary = {
        "stage": job.stage,
        "final_step": result.final_step,
        "first_loss": result.first_loss,
        "final_loss": result.final_loss,
        "stopped": result.stopped,
        "world_size": distributed.world_size(),
        "strategy": dims.strategy,
        "degrees": dims.degrees(),
    }
    if isinstance(result, RlvrResult):
        summary |= {
            "stats": msgspec.to_builtins(result.stats),
            "stale_dropped": result.stale_dropped,
            "rollout_workers": result.rollout_workers,
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.trainer.launch.rank")
    parser.add_argument("--config", required=True, help="the job, a JSON file (StageJob or PostJob)")
    args = parser.parse_args(argv)
    # torchrun's RANK, read before the group exists and still right after it is gone.
    rank0 = distributed.env_rank() == 0
    try:
        job = read_job(args.config)
        summary = run(job)
    except (ParallelismError, ValueError, msgspec.ValidationError, OSError) as e:
        if rank0:
            print(f"error: {e}", file=sys.stderr)
            _write_result(args.config, {"refused": str(e)})
        return EXIT_REFUSED
    finally:
        distributed.close()
    if rank0:
        print(json.dumps(summary), flush=True)
        _write_result(args.config, summary)
    return 0


def _write_result(config: str, payload: dict) -> None:
    """Rank 0's outcome into the job's `result_path`, atomically (nothing when the job has none or
    could not be read)."""
    try:
        path = read_job(config).result_path
    except (ValueError, msgspec.ValidationError, OSError):
        return
    if path is None:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(payload))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
