"""SFT on two gangs of 2 ranks (FSDP2 over each gang's ranks) as two torchft replica groups, on
CPU/gloo: a run of several GPUs per node on several nodes, post-training, without the services
(launch.rank's PostJob with a `replica_group`). Each rank trains its quarter of every global batch;
both gangs finish every step and hold the same weights; the weights are one process's on the whole
batch (token means over the global batch), within float tolerance."""

import subprocess
from pathlib import Path

import msgspec
import pytest
import torch

pytest.importorskip("torchft", reason="torchft is not installed: `pip install torchft==0.2.0`")

from contracts.models import MODEL_SHAPES
from tests.distributed import torchrun
from tests.support import replica_seal
from training.data.corpora import load_text, task_problems
from training.engine.checkpoint_load import load_weights
from training.engine.fault_tolerance import start_lighthouse
from training.launch.rank import ReplicaJob
from training.model import Transformer

pytestmark = pytest.mark.distributed

STEPS = 4
BUDGET_S = 300  # two gangs of 2 ranks on 2 busy cores; ~40 s when idle


def _job(directory: Path, replica_group: ReplicaJob | None, **dims) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    problems = directory / "problems.json"
    problems.write_bytes(msgspec.json.encode(task_problems(load_text("generated:small_arithmetic"))))
    job = torchrun.post_job(
        stage="sft",
        problems=msgspec.json.decode(problems.read_bytes(), type=list[tuple[str, str]]),
        steps=STEPS,
        batch_size=8,
        learning_rate=1e-3,
        checkpoint_dir=str(directory / "ckpt"),
        checkpoint_interval=1000,
        events_path=str(directory / "events.jsonl"),
        replica_group=replica_group,
        **dims,
    )
    return torchrun.write_job(directory, job)


def _weights(directory: Path) -> torch.Tensor:
    model = Transformer(MODEL_SHAPES["tiny"])
    assert load_weights(directory / "ckpt", model) is not None, directory
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def test_sft_on_two_gangs_as_replica_groups_ends_with_one_process_weights(tmp_path):
    alone = torchrun.summary_of(_job(tmp_path / "alone", None), 1)
    assert alone["final_step"] == STEPS
    lighthouse = start_lighthouse()
    procs, logs = [], []
    try:
        for i in (0, 1):
            group = ReplicaJob(replica_id=i, groups=2, lighthouse=lighthouse.address(), seal=replica_seal(i))
            job = _job(tmp_path / f"group-{i}", group, strategy="fsdp2", degrees={"dp_shard": 2})
            log = (tmp_path / f"group-{i}.log").open("wb")
            logs.append(log)
            command = torchrun.command([*torchrun.RANK_MAIN, str(job)], 2)
            env = torchrun.env()
            procs.append(
                subprocess.Popen(command, cwd=torchrun.REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
            )
        codes = [p.wait(timeout=BUDGET_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        for log in logs:
            log.close()
        lighthouse.shutdown()
    tails = [(tmp_path / f"group-{i}.log").read_text(errors="replace")[-3000:] for i in (0, 1)]
    assert codes == [0, 0], tails
    for i in (0, 1):  # each gang trained as its replica group, rank 0 reporting once
        messages = [getattr(e, "message", "") for e in torchrun.events(tmp_path / f"group-{i}")]
        assert messages.count(f"sft: replica group {i} of 2 from step 0") == 1, messages
    torch.manual_seed(0)  # the seed the stage builds its model with (no init_from here)
    start = torch.nn.utils.parameters_to_vector(Transformer(MODEL_SHAPES["tiny"]).parameters()).detach()
    one = _weights(tmp_path / "alone")
    a, b = _weights(tmp_path / "group-0"), _weights(tmp_path / "group-1")
    assert torch.equal(a, b)  # the two groups hold the same weights
    moved = (one - start).norm()
    assert (a - one).norm() < 1e-3 * moved, ((a - one).norm(), moved)
