"""Post-training stages (SFT, DPO, RLVR) trained by a gang of ranks under torchrun, on CPU with
gloo, against the same stage in one process: for the same global batch and seed SFT and DPO give
the single process's loss curve on 2 ranks (DDP and FSDP2); a 2-rank FSDP2 RLVR stage starts
exactly one rollout worker (rank 0's, counted over every rank), trains its first step to the single
process's loss and every step to the end, with one set of events.

Tolerance: every step's loss within LOSS_ATOL of the single process's. Seen here (torch 2.13 CPU):
SFT DDP and FSDP2 within 4.8e-7 over 8 steps, DPO DDP and FSDP2 within 6e-8 over 6 steps (each
rank sums its share of the tokens in another order). What the defects do, measured on these
batches: a token mean taken per rank instead of over the global batch moves a step's loss by up to
2e-3 (whenever the ranks' slices hold different numbers of response tokens), both ranks training
the same rows by 2e-2 to 5e-2.
"""

from pathlib import Path

import msgspec
import pytest

from contracts.manifest import RlvrStage
from contracts.runs import CheckpointSaved, LogLine, Metrics, ParallelismStarted
from tests.distributed import torchrun
from training.data.corpora import load_text, task_problems
from training.engine.checkpoint_dir import list_checkpoints

pytestmark = pytest.mark.distributed

LOSS_ATOL = 1e-5
SFT_STEPS = 8
DPO_STEPS = 6
RL_STEPS = 4


@pytest.fixture(scope="module")
def post_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("post-gang")


@pytest.fixture(scope="module")
def problems(post_dir) -> Path:
    """The prepared task file a gang's ranks read: what the agent writes for a post stage."""
    path = post_dir / "problems.json"
    path.write_bytes(msgspec.json.encode(task_problems(load_text("generated:small_arithmetic"))[:2000]))
    return path


def _job(tmp: Path, problems: Path, name: str, stage: str, **overrides) -> Path:
    job = torchrun.post_job(
        stage=stage,
        problems=msgspec.json.decode(problems.read_bytes(), type=list[tuple[str, str]]),
        steps=overrides.pop("steps"),
        batch_size=overrides.pop("batch_size", 8),
        learning_rate=overrides.pop("learning_rate", 1e-3),
        seed=0,
        checkpoint_interval=4,
        keep_last=2,
        **torchrun.rank0_files(tmp / name),
        **overrides,
    )
    return torchrun.write_job(tmp / name, job)


@pytest.fixture(scope="module")
def single_sft(post_dir, problems) -> dict[int, float]:
    """The reference: SFT in one process, no process group (as the trainer runs it today)."""
    summary = torchrun.summary_of(_job(post_dir, problems, "sft_single", "sft", steps=SFT_STEPS), 1)
    assert summary["world_size"] == 1 and summary["final_step"] == SFT_STEPS
    losses = torchrun.losses(post_dir / "sft_single")
    assert losses[SFT_STEPS] < losses[1] - 1.0, "the reference does not learn: the comparison means nothing"
    return losses


@pytest.mark.parametrize(("strategy", "degrees"), [("ddp", {"dp_replicate": 2}), ("fsdp2", {"dp_shard": 2})])
def test_sft_on_two_ranks_trains_the_single_process_curve(post_dir, problems, single_sft, strategy, degrees):
    name = f"sft_{strategy}"
    job = _job(post_dir, problems, name, "sft", steps=SFT_STEPS, strategy=strategy, degrees=degrees)
    summary = torchrun.summary_of(job, 2)
    assert (summary["world_size"], summary["strategy"], summary["final_step"]) == (2, strategy, SFT_STEPS)
    torchrun.assert_same_curve(torchrun.losses(post_dir / name), single_sft, LOSS_ATOL)
    assert [c.step for c in list_checkpoints(post_dir / name / "ckpt")] == [4, 8]
    events = torchrun.events(post_dir / name)
    assert [e.step for e in events if isinstance(e, Metrics)] == list(range(1, SFT_STEPS + 1))
    assert [e.step for e in events if isinstance(e, CheckpointSaved)] == [4, 8]
    (started,) = [e for e in events if isinstance(e, ParallelismStarted)]
    assert (started.stage, started.strategy, started.world_size) == ("sft", strategy, 2)


@pytest.fixture(scope="module")
def single_dpo(post_dir, problems, single_sft) -> dict[int, float]:
    """DPO in one process from the SFT model (the reference of the gangs below)."""
    summary = torchrun.summary_of(_dpo_job(post_dir, problems, "dpo_single"), 1)
    assert summary["world_size"] == 1 and summary["final_step"] == DPO_STEPS
    return torchrun.losses(post_dir / "dpo_single")


def _dpo_job(post_dir: Path, problems: Path, name: str, **overrides) -> Path:
    return _job(
        post_dir,
        problems,
        name,
        "dpo",
        steps=DPO_STEPS,
        learning_rate=1e-3,  # 10x the manifest's default: the curve moves enough to compare
        init_from=str(post_dir / "sft_single" / "ckpt"),
        **overrides,
    )


@pytest.mark.parametrize(("strategy", "degrees"), [("ddp", {"dp_replicate": 2}), ("fsdp2", {"dp_shard": 2})])
def test_dpo_on_two_ranks_trains_the_single_process_curve(post_dir, problems, single_dpo, strategy, degrees):
    """DPO from the SFT model, its frozen reference a whole model on each rank, scoring the rank's
    slice of the pairs."""
    name = f"dpo_{strategy}"
    summary = torchrun.summary_of(_dpo_job(post_dir, problems, name, strategy=strategy, degrees=degrees), 2)
    assert (summary["world_size"], summary["final_step"]) == (2, DPO_STEPS)
    torchrun.assert_same_curve(torchrun.losses(post_dir / name), single_dpo, LOSS_ATOL)
    logs = [e.message for e in torchrun.events(post_dir / name) if isinstance(e, LogLine)]
    assert sum(m.startswith("dpo: reference log-probs") for m in logs) == 1, logs


@pytest.fixture(scope="module")
def rl_problems(post_dir) -> Path:
    """A task with one answer whatever the prompt: 16 SFT steps leave the model sampling it about
    half the time, so RLVR's groups mix right and wrong answers and every step has something to
    learn (measured: 2 of 2 groups kept at steps 1-4, in 1-2 sampling rounds)."""
    path = post_dir / "rl_problems.json"
    path.write_bytes(msgspec.json.encode([(f"{a}+{b}=", "1") for a in range(10) for b in range(10)]))
    return path


@pytest.fixture(scope="module")
def rl_warm(post_dir, rl_problems) -> Path:
    job = _job(post_dir, rl_problems, "rl_warm", "sft", steps=16, learning_rate=3e-3)
    assert torchrun.summary_of(job, 1)["final_step"] == 16
    return post_dir / "rl_warm" / "ckpt"


def _rl_job(post_dir: Path, problems: Path, warm: Path, name: str, **overrides) -> Path:
    section = RlvrStage(
        steps=RL_STEPS, prompts_per_step=2, group_size=4, max_response_tokens=4, overlong_buffer_tokens=2
    )
    return _job(
        post_dir,
        problems,
        name,
        "rlvr",
        steps=RL_STEPS,
        batch_size=section.prompts_per_step * section.group_size,
        learning_rate=2e-4,
        init_from=str(warm),
        rlvr=section,
        **overrides,
    )


@pytest.fixture(scope="module")
def single_rl(post_dir, rl_problems, rl_warm) -> dict:
    return torchrun.summary_of(_rl_job(post_dir, rl_problems, rl_warm, "rlvr_single"), 1)


def test_rlvr_on_two_ranks_starts_one_rollout_worker(post_dir, rl_problems, rl_warm, single_rl):
    """FSDP2: gathering the weights to publish is a collective every rank joins; rank 0 alone
    samples and broadcasts the kept groups. Step 1 (both sampled from the same version-0 weights)
    has the single process's loss; later steps sample from weights that differ in the last bits."""
    single = single_rl
    name = "rlvr_fsdp2"
    summary = torchrun.summary_of(
        _rl_job(post_dir, rl_problems, rl_warm, name, strategy="fsdp2", degrees={"dp_shard": 2}), 2
    )
    assert summary["rollout_workers"] == 1 == single["rollout_workers"], summary  # counted on every rank
    assert (summary["world_size"], summary["final_step"], summary["stopped"]) == (2, RL_STEPS, False)
    assert [s["groups_kept"] for s in summary["stats"]] == [2] * RL_STEPS, summary["stats"]
    first, want_first = summary["stats"][0], single["stats"][0]
    assert first["kl"] == pytest.approx(want_first["kl"], abs=1e-7)  # summed by rank, then over ranks
    assert {**first, "kl": 0} == {**want_first, "kl": 0}  # the same rollouts, kept and scored alike
    losses, want = torchrun.losses(post_dir / name), torchrun.losses(post_dir / "rlvr_single")
    assert sorted(losses) == list(range(1, RL_STEPS + 1))
    assert abs(losses[1] - want[1]) <= LOSS_ATOL and losses[1] != 0.0, (losses, want)
    events = torchrun.events(post_dir / name)
    assert [e.step for e in events if isinstance(e, Metrics)] == list(range(1, RL_STEPS + 1))
    logs = [e.message for e in events if isinstance(e, LogLine)]
    assert sum(m == "rlvr: 1 rollout worker (rank 0's) for 2 ranks" for m in logs) == 1, logs
    assert sum(m.startswith(f"rlvr step {RL_STEPS}: reward") for m in logs) == 1, logs
    assert [c.step for c in list_checkpoints(post_dir / name / "ckpt")] == [4]
