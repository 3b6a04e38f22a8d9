"""What one rank of a training gang runs: `python -m training.launch.rank --config job.json`,
started N times by torchrun (or `torch.distributed.launcher.api.elastic_launch`, as the trainer
agent's gang launcher will). Every rank reads the same job, joins the process group torchrun set
up, builds the plan's mesh, trains the stage in step with the others and leaves the group.

The job is a tagged Struct decoded with unknown fields forbidden (the launcher writes it, so a typo
fails loudly), and its stage's config is the very dataclass the recipe takes, whole: a `StageJob`
(a next-token stage's `StageConfig`), a `PostJob` (SFT or DPO's `PostConfig`, its prepared data
inside) or an `RlvrJob` (an `RlvrConfig`; the gang's one rollout worker is rank 0's). The config's
own checks run on decode; the rank changes only its device. Rank 0 is the one writer: the run's
events (`events_path`) and per-step losses (`losses_path`) as JSON lines, and its answer: one of
another tagged union, `StageAnswer`, `PostAnswer` or `RlvrAnswer` (the stage's numbers), or a
`Refusal`, as one JSON line on stdout and in the job's `result_path`, read back with the one
`read_answer`. The other ranks report to a reporter that drops events.

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
from typing import Annotated, Any, TextIO, TypeVar

import msgspec
import torch
from torch.optim.lr_scheduler import LambdaLR

from contracts.runs import Metrics, RunEvent
from training.engine import distributed
from training.engine.distributed import ParallelDims, ParallelismError
from training.engine.fault_tolerance import GangStore, ReplicaGroup
from training.engine.heal_transport import Seal
from training.engine.loop import pick_device
from training.engine.reporting import EventFile, Reporter, Sink, rank0_only
from training.recipes.posttrain import PostConfig, PostResult
from training.recipes.pretrain import StageConfig, StageResult, train_stage
from training.recipes.rlvr import RlvrConfig, RlvrResult, StepStats, train_post
from training.recipes.stage_run import Replicas

EXIT_REFUSED = 2
JOB_CAP_BYTES = 256 << 20  # a post stage's job carries its tasks (~20 bytes each), examples or pairs
ANSWER_CAP_BYTES = 64 << 20  # RLVR's answer carries one StepStats (~200 bytes) per step


class ReplicaJob(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """This gang is replica group `replica_id` of `groups` of a multi-node run (services/trainer/
    launch/multinode.py): its ranks form one torchft group, meeting the other groups at `lighthouse`."""

    replica_id: Annotated[int, msgspec.Meta(ge=0)]
    groups: Annotated[int, msgspec.Meta(ge=1)]
    lighthouse: str
    seal: Seal  # the run's heal key and this group's place (engine/heal_transport.py); the job file is 0600
    host: str = "127.0.0.1"  # where this node's ranks serve healing transfers to the other groups


class _Files(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Rank 0's files and the gang's place in a multi-node run, the same for every kind of job."""

    losses_path: str | None = None
    """JSON lines {"step", "loss", "grad_norm", "learning_rate"} from rank 0."""
    events_path: str | None = None
    """Every run event, msgspec JSON, one a line, from rank 0 (engine/reporting.py's EventFile)."""
    result_path: str | None = None
    """Rank 0's answer (the job's kind of `Answer`, or a `Refusal` for a plan it cannot run), msgspec
    JSON: how the trainer agent reads the outcome of a gang whose output went to per-rank logs."""
    replica_group: ReplicaJob | None = None
    """Set on each node's gang of a multi-node run; the node's agent reports the run's parallelism."""


class StageJob(_Files, tag="stage", frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One next-token stage (pretrain, midtrain, long-context) on the gang: its `StageConfig` as the
    agent built it, whole (the very dataclass `train_stage` takes; its checks run again on decode),
    the plan's dims in its `parallel`. One shape from the planner to the rank: no field is copied."""

    config: StageConfig


class PostJob(_Files, tag="post", frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One SFT or DPO stage on the gang: its `PostConfig`, whole, its prepared tasks, chat examples
    or preference pairs inside (every rank reads them all, as it read their files before)."""

    config: PostConfig


class RlvrJob(_Files, tag="rlvr", frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One RLVR stage on the gang: its `RlvrConfig`, whole (rank 0 runs the one rollout worker)."""

    config: RlvrConfig


Job = StageJob | PostJob | RlvrJob
_job_decoder = msgspec.json.Decoder(Job)


class _Answer(msgspec.Struct, frozen=True, kw_only=True):
    """What rank 0 answers once its stage has run, whatever its kind (every rank computes the same
    numbers): the stage's losses and the gang it ran on. Unknown fields are skipped (the agent
    wrote the job; an older reader survives a newer rank)."""

    stage: str
    final_step: int
    first_loss: float | None  # None when the stage had no step left to run (resumed complete)
    final_loss: float | None
    stopped: bool
    world_size: int
    strategy: str
    degrees: dict[str, int]


class StageAnswer(_Answer, tag="stage", frozen=True, kw_only=True):
    """A `StageJob`'s answer: a next-token stage's numbers and its held-out loss."""

    held_out_loss: float | None  # None when stopped early


class PostAnswer(_Answer, tag="post", frozen=True, kw_only=True):
    """A `PostJob`'s answer: an SFT or DPO stage's numbers."""


class RlvrAnswer(_Answer, tag="rlvr", frozen=True, kw_only=True):
    """An `RlvrJob`'s answer: the stage's numbers and what its rollouts saw."""

    stats: list[StepStats]
    stale_dropped: int
    rollout_workers: int  # summed over every rank: 1 (rank 0's) however many ranks


class Refusal(msgspec.Struct, tag="refused", frozen=True, kw_only=True):
    """Rank 0's answer to a job or plan the ranks cannot run (exit 2): why, in a sentence."""

    reason: str


Answer = StageAnswer | PostAnswer | RlvrAnswer
AnswerT = TypeVar("AnswerT", bound=_Answer)
_answer_decoder = msgspec.json.Decoder(Answer | Refusal)


class AnswerError(ValueError):
    """Rank 0's answer is not one (malformed, a field missing, an unknown tag), or answers another
    kind of job than the one that was asked."""


def read_answer(data: bytes, kind: type[AnswerT]) -> AnswerT | Refusal:
    """Rank 0's answer to a job whose answer is a `kind`, or its refusal; AnswerError, in a
    sentence, for anything else."""
    if len(data) > ANSWER_CAP_BYTES:
        raise AnswerError(f"Rank 0's answer is over {ANSWER_CAP_BYTES} bytes.")
    try:
        answer = _answer_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise AnswerError(f"Rank 0's answer cannot be read: {e}") from e
    if isinstance(answer, Refusal | kind):
        return answer
    got, want = type(answer).__struct_config__.tag, kind.__struct_config__.tag
    raise AnswerError(f"Rank 0 answered a {got!r} job; its job was a {want!r} one.")


class _ResultOnly(msgspec.Struct):
    """A job read for its result path alone (unknown fields ignored): a job whose config failed
    its checks on decode still gets its refusal written."""

    result_path: str | None = None


_result_decoder = msgspec.json.Decoder(_ResultOnly)


def job_for(
    config: StageConfig | PostConfig,
    dims: ParallelDims,
    directory: str | os.PathLike[str] | None = None,
    replica_group: ReplicaJob | None = None,
) -> Job:
    """The job every rank of the gang runs: the stage's config with the plan's dims (this node's, for
    a multi-node run's replica group) and, given a directory, rank 0's events and result files in it."""
    config = dataclasses.replace(config, parallel=dims)
    files: dict[str, Any] = {"replica_group": replica_group}
    if directory is not None:
        files |= {
            "events_path": os.path.join(directory, "events.jsonl"),
            "result_path": os.path.join(directory, "result.json"),
        }
    if isinstance(config, RlvrConfig):
        return RlvrJob(config=config, **files)
    if isinstance(config, PostConfig):
        return PostJob(config=config, **files)
    return StageJob(config=config, **files)


def read_job(path: str) -> Job:
    with open(path, "rb") as f:
        data = f.read(JOB_CAP_BYTES + 1)
    if len(data) > JOB_CAP_BYTES:
        raise ValueError(f"The job file is over {JOB_CAP_BYTES} bytes.")
    return _job_decoder.decode(data)


def on_this_rank(config: Any, device: str) -> Any:
    """The job's config on this rank: its own device (cuda:LOCAL_RANK, or cpu), the plan's dims
    (one process alone when the job names none)."""
    return dataclasses.replace(config, device=device, parallel=config.parallel or ParallelDims())


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
            seal=group.seal,
            store_host=group.host,
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


def run(job: Job) -> Answer:
    """Train `job` on this rank; rank 0's answer (the other ranks return the same numbers)."""
    dims = job.config.parallel or ParallelDims()
    device = distributed.init(pick_device(job.config.device).type)
    dims.check_world(distributed.world_size())
    config = on_this_rank(job.config, str(device))
    stage = config.stage
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with _rank0_reporter(job) as report:
        group = None if job.replica_group is None else replicas(job.replica_group, report, stage)
        if group is None:  # the node's agent reports a multi-node run's parallelism
            _report_parallelism(report, stage, dims)
        if isinstance(job, StageJob):
            return _answer(stage, dims, train_stage(config, report, stop.is_set, group))
        return _answer(stage, dims, train_post(config, report, stop.is_set, group))


@contextmanager
def _rank0_reporter(job: Job) -> Iterator[Reporter]:
    """The job's reporter. Every rank opens the files in append mode and reports through
    `rank0_only`: only rank 0's reporter writes, so the files hold one copy of each event whatever
    the world size."""
    with (
        EventFile(job.events_path) if job.events_path else nullcontext() as events,
        open(job.losses_path, "a") if job.losses_path else nullcontext() as losses,
    ):
        yield rank0_only(Reporter(_file_sink(events, losses), run_id=f"gang-{job.config.stage}"))


def _report_parallelism(report: Reporter, stage: str, dims: ParallelDims) -> None:
    shape, names = dims.mesh_dims()
    report.parallelism(
        stage=stage,
        strategy=dims.strategy,
        world_size=distributed.world_size(),
        mesh=dict(zip(names, shape, strict=True)),
    )


def _answer(stage: str, dims: ParallelDims, result: StageResult | PostResult | RlvrResult) -> Answer:
    """The stage's result as rank 0 answers it: the kind of answer its kind of job expects."""
    common: dict[str, Any] = {
        "stage": stage,
        "final_step": result.final_step,
        "first_loss": result.first_loss,
        "final_loss": result.final_loss,
        "stopped": result.stopped,
        "world_size": distributed.world_size(),
        "strategy": dims.strategy,
        "degrees": dims.degrees(),
    }
    match result:
        case StageResult():
            return StageAnswer(**common, held_out_loss=result.held_out_loss)
        case RlvrResult():
            return RlvrAnswer(
                **common,
                stats=result.stats,
                stale_dropped=result.stale_dropped,
                rollout_workers=result.rollout_workers,
            )
        case PostResult():
            return PostAnswer(**common)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.launch.rank")
    parser.add_argument("--config", required=True, help="the job, a JSON file (StageJob, PostJob or RlvrJob)")
    args = parser.parse_args(argv)
    # torchrun's RANK, read before the group exists and still right after it is gone.
    rank0 = distributed.env_rank() == 0
    try:
        job = read_job(args.config)
        answer = run(job)
    except (ParallelismError, ValueError, msgspec.ValidationError, OSError) as e:
        if rank0:
            print(f"error: {e}", file=sys.stderr)
            _write_result(args.config, Refusal(reason=str(e)))
        return EXIT_REFUSED
    finally:
        distributed.close()
    if rank0:
        print(msgspec.json.encode(answer).decode(), flush=True)
        _write_result(args.config, answer)
    return 0


def _write_result(config: str, answer: Answer | Refusal) -> None:
    """Rank 0's outcome into the job's `result_path`, atomically (nothing when the job has none or
    could not be read)."""
    try:
        with open(config, "rb") as f:
            path = _result_decoder.decode(f.read(JOB_CAP_BYTES + 1)).result_path
    except (ValueError, msgspec.ValidationError, msgspec.DecodeError, OSError):
        return
    if path is None:
        return
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(msgspec.json.encode(answer))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
