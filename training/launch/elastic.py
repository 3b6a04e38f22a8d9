"""The trainer agent's gang launcher: a run whose plan asks for several ranks on this node trains
every stage (next-token and post-training) on a gang that PyTorch's elastic launcher starts, never
on one process.

For each stage the agent writes the stage's job (`launch.rank.job_for`: the stage's own config, whole,
with the plan's dims: pretrain, midtrain, long_context, SFT, DPO, RLVR), starts `python -m torch.distributed.run`
(c10d rendezvous on a loopback port, `--max-restarts`, per-rank logs under the stage's gang
directory) as a child process, and tails rank 0's events file into its own reporter (the spike
watch, then the bus: ranks hold no bus credentials). A stop (cancel, fence, spike) is a SIGTERM to
the launcher, which forwards it to the ranks; they commit a checkpoint of their step and exit. A
rank that dies is restarted with the whole gang by the launcher, from the last committed
checkpoint, up to `max_restarts` times; past that the gang is lost (`GangLost`) and the agent
interrupts the run and requeues its work item, as for a lost trainer.

The agent keeps everything else, once, as rank 0 of the run: data preparation (one provenance), the
ladder's proxy runs (small single-process runs before the stages, whose decision shapes the plan
every stage's job is built from), and the eval batteries, on the weights the gang committed. Inside
the gang, rank 0 alone writes events and runs RLVR's rollout worker (see rlvr.py). A plan the node
cannot realise (too few GPUs, a model or batch the mesh cannot split) is refused, in a sentence,
before anything trains.

Outcomes: rank 0 writes its answer (launch.rank's `StageAnswer`, `PostAnswer` or `RlvrAnswer`), or
its `Refusal`, to the job's `result_path`; the agent reads it with launch.rank's one decoder, and
the launcher's exit code says the rest (see `read_outcome`).
"""

import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from contracts.manifest import DpoStage, Lora, Manifest, SftStage
from contracts.models import ModelShape
from contracts.plans import Plan
from contracts.runs import CheckpointSaved, LogLine, Metrics, ParallelismStarted, RunEvent, StageStarted
from domain.curriculum import Curriculum, LmPlan
from runtime.configuration.settings import DEFAULT_GANG_MAX_RESTARTS as DEFAULT_MAX_RESTARTS
from runtime.configuration.settings import ENV_GANG_MAX_RESTARTS
from training.engine.checkpoint_load import load_weights
from training.engine.distributed import ParallelDims, ParallelismError
from training.engine.loop import pick_device
from training.engine.reporting import Reporter
from training.launch.rank import (
    ANSWER_CAP_BYTES,
    AnswerError,
    AnswerT,
    Job,
    PostAnswer,
    Refusal,
    ReplicaJob,
    RlvrAnswer,
    StageAnswer,
    job_for,
    read_answer,
)
from training.model import Transformer
from training.recipes.posttrain import PostConfig, PostResult
from training.recipes.pretrain import StageConfig, StageResult, build_model
from training.recipes.rlvr import RlvrConfig, RlvrResult
from training.weights.lora import is_adapter_key, is_base_key

POLL_S = 0.2  # how often the agent tails rank 0's events and checks for a stop
STOP_GRACE_S = 90.0  # after a SIGTERM, the ranks save a checkpoint; past this the launcher is killed
EVENT_LINE_CAP = 1 << 20  # one event is a few hundred bytes; a longer line is not one of ours
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
# The events a rank may hand on: what training reports. State, creation and interruption events
# are the agent's and the scheduler's alone.
FORWARDED = (LogLine, Metrics, CheckpointSaved, StageStarted, ParallelismStarted)

_event_decoder = msgspec.json.Decoder(RunEvent)


class GangFailed(RuntimeError):
    """The gang finished its stage wrongly (no answer or one that is not its job's, no checkpoint):
    the run fails."""


class GangLost(RuntimeError):
    """A rank kept dying past `max_restarts`: the run is interrupted and its work item requeued,
    to resume from the last committed checkpoint, as when the trainer itself is lost."""


def gang_dims(plan: Plan) -> ParallelDims | None:
    """The plan's dims when it asks for more than one rank; None for a single process (run as
    today). ParallelismError for a strategy and degrees that do not agree."""
    dims = ParallelDims.from_plan(plan.strategy, plan.degrees)
    return dims if dims.world_size > 1 else None


def refusal(dims: ParallelDims, manifest: Manifest, run_plan: Curriculum) -> str | None:
    """Why this node cannot realise `dims` for this run, or None: more than one node, too few GPUs
    here, or a model or batch the mesh cannot split. (The ladder's proxy runs are the agent's own,
    single-process, before the stages: nothing of them runs on the gang.)"""
    world = f"{dims.strategy} {dims.degrees()} on {dims.world_size} ranks"
    if manifest.resources.nodes > 1:
        return (
            f"The plan's {world} spans {manifest.resources.nodes} nodes; this trainer starts one node's "
            "ranks only."
        )
    if torch.cuda.is_available() and torch.cuda.device_count() < dims.world_size:
        return f"The plan's {world} needs {dims.world_size} GPUs; this node has {torch.cuda.device_count()}."
    try:
        for stage in run_plan.stages:
            dims.check_model(stage.shape)
            if isinstance(stage, LmPlan):
                dims.check_batch(stage.batch_size)
            elif isinstance(stage.section, SftStage | DpoStage):  # RLVR splits its kept rows as they come
                dims.check_batch(stage.section.batch_size)
    except ParallelismError as e:
        return f"The plan's {world} does not fit: {e}"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchSpec:
    """One torchrun of one node's ranks."""

    nproc: int
    port: int
    max_restarts: int
    log_dir: pathlib.Path


def torchrun_command(spec: LaunchSpec, job: pathlib.Path) -> list[str]:
    """The elastic launcher's command line: every rank runs launch.rank on `job`; stdout and stderr
    of each rank go to `log_dir/<run>/attempt_<n>/<rank>/`."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        f"--nproc-per-node={spec.nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{spec.port}",
        f"--max-restarts={spec.max_restarts}",
        f"--log-dir={spec.log_dir}",
        "--redirects=3",
        "-m",
        "training.launch.rank",
        "--config",
        str(job),
    ]


def read_outcome(
    rc: int, result: bytes | None, stopped: bool, spec: LaunchSpec, kind: type[AnswerT]
) -> AnswerT | None:
    """Rank 0's answer (`result`, its bytes) for a finished stage whose job answers a `kind`; None
    when the gang was stopped on request. ParallelismError when rank 0 refused the job (launch.rank's
    exit 2); GangLost when the launcher gave up after `max_restarts` (a non-zero exit); GangFailed for
    a clean exit without an answer, or an answer that is not one of `kind` (launch.rank's
    `read_answer`)."""
    try:
        answer = None if result is None else read_answer(result, kind)
    except AnswerError as e:
        raise GangFailed(f"The gang of {spec.nproc} ranks answered wrongly: {e}") from e
    if isinstance(answer, Refusal):
        raise ParallelismError(f"The gang refused the stage: {answer.reason}")
    if stopped:
        return None
    if rc == 0 and answer is not None:
        return answer
    if rc == 0:
        raise GangFailed(f"The gang of {spec.nproc} ranks exited without a result.")
    raise GangLost(
        f"The gang of {spec.nproc} ranks exited with code {rc} after up to {spec.max_restarts} "
        f"restarts; per-rank logs in {spec.log_dir}."
    )


class EventTail:
    """Rank 0's events file, read from where the last read stopped; only whole lines."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self.offset = 0

    def read(self) -> list[RunEvent]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []
        self.offset += end + 1
        events: list[RunEvent] = []
        for line in data[: end + 1].splitlines():
            if not line.strip() or len(line) > EVENT_LINE_CAP:
                continue
            try:
                event = _event_decoder.decode(line)
            except (msgspec.ValidationError, msgspec.DecodeError):
                continue
            if isinstance(event, FORWARDED):
                events.append(event)
        return events


class Gang:
    """Trains the stages of one run on a gang of this node's ranks: next-token stages
    (`train_stage`, pipeline's `train_lm`) and post-training ones (`train_post`)."""

    def __init__(
        self, dims: ParallelDims, run_dir: pathlib.Path, threads: int, replica_group: ReplicaJob | None = None
    ) -> None:
        """`replica_group`: the gang is this node's torchft replica group of a multi-node run."""
        self.dims = dims
        self.replica_group = replica_group
        self.run_dir = run_dir
        self.threads = threads
        self.max_restarts = int(os.environ.get(ENV_GANG_MAX_RESTARTS, DEFAULT_MAX_RESTARTS))

    def train_stage(self, cfg: StageConfig, report: Reporter, should_stop: Callable[[], bool]) -> StageResult:
        directory = self.run_dir / "gang" / cfg.stage
        directory.mkdir(parents=True, exist_ok=True)
        job = job_for(cfg, self.dims, directory, self.replica_group)
        answer = self._run_job(job, StageAnswer, report, should_stop)
        if answer is None:
            return StageResult(
                final_step=0, first_loss=None, final_loss=None, held_out_loss=None, stopped=True, tokens=0
            )
        return self._result(cfg, answer)

    def train_post(
        self, cfg: PostConfig, report: Reporter, should_stop: Callable[[], bool]
    ) -> PostResult | RlvrResult:
        """SFT, DPO or RLVR (`cfg` an RlvrConfig) on the gang; the data the agent prepared goes to
        the ranks inside the job."""
        directory = self.run_dir / "gang" / cfg.stage
        directory.mkdir(parents=True, exist_ok=True)
        job = job_for(cfg, self.dims, directory, self.replica_group)
        kind: type[PostAnswer | RlvrAnswer] = RlvrAnswer if isinstance(cfg, RlvrConfig) else PostAnswer
        answer = self._run_job(job, kind, report, should_stop)
        if answer is None:
            return PostResult(final_step=0, first_loss=None, final_loss=None, stopped=True)
        model = self._trained_model(
            cfg.stage,
            cfg.checkpoint_dir,
            cfg.shape,
            cfg.shape.max_seq_len,
            cfg.rope_base,
            lora=cfg.lora,
            init_from=cfg.init_from,
        )
        if isinstance(answer, RlvrAnswer):
            return RlvrResult(
                **_numbers(answer),
                stats=answer.stats,
                stale_dropped=answer.stale_dropped,
                rollout_workers=answer.rollout_workers,
                model=model,
            )
        return PostResult(**_numbers(answer), model=model)

    def _run_job(
        self, job: Job, kind: type[AnswerT], report: Reporter, should_stop: Callable[[], bool]
    ) -> AnswerT | None:
        """Launch the gang on `job` (in its stage's directory) and wait for it; rank 0's answer, a
        `kind`, None when stopped on request (see `read_outcome`)."""
        assert job.result_path is not None and job.events_path is not None, "a gang's job names its files"
        result_path = pathlib.Path(job.result_path)
        result_path.unlink(missing_ok=True)
        events_path = pathlib.Path(job.events_path)
        events_path.unlink(missing_ok=True)  # a redelivered run's earlier attempt was reported then
        job_path = result_path.parent / "job.json"
        job_path.with_name("job.json.tmp").write_bytes(msgspec.json.encode(job))
        os.replace(job_path.with_name("job.json.tmp"), job_path)
        spec = LaunchSpec(
            nproc=self.dims.world_size,
            port=free_port(),
            max_restarts=self.max_restarts,
            log_dir=result_path.parent / "logs",
        )
        report.log(
            f"{job.config.stage}: starting a gang of {spec.nproc} ranks ({self.dims.strategy} "
            f"{self.dims.degrees()}) with torchrun, up to {spec.max_restarts} restarts"
        )
        rc, stopped = self._launch(spec, job_path, EventTail(events_path), report, should_stop)
        return read_outcome(rc, _read_capped(result_path), stopped, spec, kind)

    def _launch(
        self,
        spec: LaunchSpec,
        job_path: pathlib.Path,
        tail: EventTail,
        report: Reporter,
        should_stop: Callable[[], bool],
    ) -> tuple[int, bool]:
        """Run the launcher to its end, forwarding rank 0's events; (exit code, stopped on request)."""
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(max(1, self.threads // spec.nproc)),
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
        }
        with open(job_path.parent / "launcher.log", "ab") as log:
            proc = subprocess.Popen(
                torchrun_command(spec, job_path), cwd=REPO_ROOT, env=env, stdout=log, stderr=log
            )
            stopped_at: float | None = None
            try:
                while proc.poll() is None:
                    self._forward(tail, report)
                    if stopped_at is None and should_stop():
                        proc.send_signal(signal.SIGTERM)  # torchrun forwards it to every rank
                        stopped_at = time.monotonic()
                    elif stopped_at is not None and time.monotonic() - stopped_at > STOP_GRACE_S:
                        proc.kill()
                    time.sleep(POLL_S)
            finally:
                if proc.poll() is None:  # the agent itself is going down: take the gang with it
                    proc.kill()
                    proc.wait()
        self._forward(tail, report)
        return proc.returncode, stopped_at is not None

    @staticmethod
    def _forward(tail: EventTail, report: Reporter) -> None:
        for event in tail.read():
            report.send(msgspec.structs.replace(event, run_id=report.run_id, epoch=report.epoch, seq=0))

    @staticmethod
    def _trained_model(
        stage: str,
        checkpoint_dir: str,
        shape: ModelShape,
        seq_len: int,
        rope_base: float | None,
        z_loss: float = 0.0,
        device: str | None = None,
        *,
        lora: Lora | None = None,
        init_from: str | None = None,
    ) -> Transformer:
        """The weights the gang committed last, loaded in the agent (one process), for the eval
        battery. A LoRA stage committed its adapters alone: the frozen base comes from the stage's
        `init_from` (the incoming model), the adapters from the checkpoint."""
        model = build_model(
            shape,
            seq_len=seq_len,
            rope_base=rope_base,
            z_loss=z_loss,
            device=pick_device(device),
            parallel=ParallelDims(),
            lora=lora,
        )
        if lora is not None and init_from is not None:
            load_weights(init_from, model, model_keys=is_base_key)
        keys = is_adapter_key if lora is not None else None
        if load_weights(checkpoint_dir, model, model_keys=keys) is None:
            raise GangFailed(f"The gang finished {stage} but committed no checkpoint.")
        return model

    def _result(self, cfg: StageConfig, answer: StageAnswer) -> StageResult:
        """The stage's result with its trained weights loaded in the agent, for the eval battery."""
        model = self._trained_model(
            cfg.stage, cfg.checkpoint_dir, cfg.shape, cfg.seq_len, cfg.rope_base, cfg.z_loss, cfg.device
        )
        return StageResult(
            **_numbers(answer),
            held_out_loss=answer.held_out_loss,
            tokens=answer.final_step * cfg.batch_size * cfg.seq_len,
            model=model,
        )


def _numbers(answer: StageAnswer | PostAnswer | RlvrAnswer) -> dict[str, Any]:
    """What every recipe's result takes from rank 0's answer, whatever the stage: its last step, its
    first and last losses, and whether it was stopped."""
    return {
        "final_step": answer.final_step,
        "first_loss": answer.first_loss,
        "final_loss": answer.final_loss,
        "stopped": answer.stopped,
    }


def _read_capped(path: pathlib.Path) -> bytes | None:
    """Rank 0's answer file, None when it wrote none; one byte past the cap at most (read_answer
    refuses a longer one)."""
    try:
        with open(path, "rb") as f:
            return f.read(ANSWER_CAP_BYTES + 1)
    except FileNotFoundError:
        return None
