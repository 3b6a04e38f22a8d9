"""What the distributed tests share: starting a script or the rank entry (training/launch/rank.py) on N ranks under torchrun
(or in one process), and reading what rank 0 wrote (its summary, losses and events)."""

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import msgspec

from contracts.models import MODEL_SHAPES
from contracts.runs import RunEvent
from training.engine.distributed import ParallelDims
from training.launch.rank import Answer, Job, PostJob, ReplicaJob, RlvrJob, StageJob
from training.recipes.posttrain import PostConfig
from training.recipes.pretrain import StageConfig
from training.recipes.rlvr import RlvrConfig

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 240  # one torchrun of 2-4 ranks takes 10-30 s on 2 cores, longer beside other gangs
RANK_MAIN = ["-m", "training.launch.rank", "--config"]


def rank0_files(directory: Path) -> dict[str, str]:
    """A job's checkpoint directory and rank 0's files, all under `directory` (made here)."""
    directory.mkdir(parents=True, exist_ok=True)
    return {
        "checkpoint_dir": str(directory / "ckpt"),
        "losses_path": str(directory / "losses.jsonl"),
        "events_path": str(directory / "events.jsonl"),
    }


FILES = ("losses_path", "events_path", "result_path")


def stage_job(
    *,
    strategy: str = "single",
    degrees: dict[str, int] | None = None,
    replica_group: ReplicaJob | None = None,
    **fields,
) -> StageJob:
    """A tiny next-token stage's job: rank 0's files and the config's fields by name (the tiny
    model, generated arithmetic, lr 3e-3 unless given), the plan's dims from strategy and degrees."""
    files = {k: fields.pop(k) for k in FILES if k in fields}
    config = StageConfig(
        **{
            "stage": "pretrain",
            "shape": MODEL_SHAPES["tiny"],
            "train_sources": ["generated:arithmetic"],
            "learning_rate": 3e-3,
            **fields,
        }
    )
    dims = ParallelDims.from_plan(strategy, degrees or {})
    return StageJob(config=dataclasses.replace(config, parallel=dims), replica_group=replica_group, **files)


def post_job(
    *,
    strategy: str = "single",
    degrees: dict[str, int] | None = None,
    replica_group: ReplicaJob | None = None,
    **fields,
) -> Job:
    """A post stage's job (an RlvrJob when the fields name an `rlvr` section), as `stage_job`."""
    files = {k: fields.pop(k) for k in FILES if k in fields}
    fields = {"shape": MODEL_SHAPES["tiny"], "rope_base": None, "seed": 0, **fields}
    config = RlvrConfig(**fields) if "rlvr" in fields else PostConfig(**fields)
    dims = ParallelDims.from_plan(strategy, degrees or {})
    kind = RlvrJob if isinstance(config, RlvrConfig) else PostJob
    return kind(config=dataclasses.replace(config, parallel=dims), replica_group=replica_group, **files)


def write_job(directory: Path, job: msgspec.Struct) -> Path:
    path = directory / "job.json"
    path.write_bytes(msgspec.json.encode(job))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    """One CPU thread per rank (2 cores shared by up to 4 ranks), the repository importable."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def command(target: list[str], ranks: int) -> list[str]:
    """`target` (a script and its arguments, or `-m module ...`) in one process (ranks 1, no
    process group) or on `ranks` ranks under torchrun's c10d rendezvous on a free loopback port,
    never restarted."""
    launcher = [sys.executable]
    if ranks > 1:
        launcher += [
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={ranks}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=localhost:{free_port()}",
            "--max-restarts=0",
        ]
    return [*launcher, *target]


def launch(target: list[str], ranks: int) -> subprocess.CompletedProcess:
    """`command(target, ranks)` run to its end (bounded), its output captured."""
    return subprocess.run(
        command(target, ranks), cwd=REPO, env=env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S
    )


def run_rank(job: Path, ranks: int) -> subprocess.CompletedProcess:
    return launch([*RANK_MAIN, str(job)], ranks)


def summary(result: subprocess.CompletedProcess) -> dict:
    """Rank 0's answer line of a run that succeeded (one, whatever the world size), as a dict of
    its fields once it has read as one of launch.rank's typed answers."""
    assert result.returncode == 0, result.stderr[-4000:]
    summaries = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 1, f"one summary (rank 0), got {result.stdout}"
    msgspec.json.decode(summaries[0], type=Answer)  # a typed answer, or msgspec.ValidationError
    return json.loads(summaries[0])


def losses(directory: Path) -> dict[int, float]:
    """Rank 0's per-step losses, each step once."""
    steps = [json.loads(line) for line in (directory / "losses.jsonl").read_text().splitlines()]
    by_step = {s["step"]: s["loss"] for s in steps}
    assert len(by_step) == len(steps), "a step was logged twice"
    return by_step


def events(directory: Path) -> list[RunEvent]:
    decoder = msgspec.json.Decoder(RunEvent)
    return [decoder.decode(line) for line in (directory / "events.jsonl").read_text().splitlines()]


def assert_same_curve(got: dict[int, float], want: dict[int, float], atol: float) -> None:
    assert sorted(got) == sorted(want)
    worst = max(abs(got[s] - want[s]) for s in want)
    assert worst <= atol, f"loss differs by {worst:.2e} from the single process: {got} vs {want}"


def summary_of(job: Path, ranks: int) -> dict:
    """The rank entry on `job` (one process, or `ranks` under torchrun): rank 0's summary."""
    return summary(run_rank(job, ranks))
