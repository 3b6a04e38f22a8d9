"""A run whose plan asks for 4 GPUs on one node trains on a gang of 4 ranks that the trainer agent
starts with torchrun (CPU, gloo): through `ecc ito train`, to `succeeded`, with the strategy, world
size and mesh it really used in `ecc ito status`; per-rank logs in the run's directory. A rank
killed mid-stage is restarted with its gang by the elastic launcher from the last committed
checkpoint, and the run still succeeds. Post-training (SFT, DPO, RLVR) and a ladder on custom data
run with a gang too: the stages on 2 ranks, data preparation and the ladder once, in the agent."""

import os
import pathlib
import signal

import msgspec
import pytest

from contracts.runs import Metrics, RunEvent
from tests.conftest import start_stack
from tests.support import FULL_RECIPE_STEPS, eventually, full_recipe, run_state, run_status

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

GPUS = {"nodes": 1, "gpus_per_node": 4}
RUN_TIMEOUT_S = 300  # 4 ranks of the tiny model on 2 cores: ~30-60 s a run, most of it start-up


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """All services, with the scheduler allowed to plan the tiny model on several GPUs of a node
    (ITO_PLAN_SMALL_MODEL_GANGS): here each "GPU" is a CPU process of the gang."""
    s = start_stack(tmp_path_factory.mktemp("gang-stack"), env={"ITO_PLAN_SMALL_MODEL_GANGS": "1"})
    try:
        yield s
    finally:
        s.run("ito-training", "down", timeout=60)


def _train(stack, env, booking: str, manifest_path: str, key: str) -> str:
    account_booking = booking
    _, conf = stack.ecc(
        "confirm", "--action", "train", "--booking", account_booking, "--manifest", manifest_path, env=env
    )
    rc, train = stack.ecc(
        "train",
        "--booking",
        account_booking,
        "--manifest",
        manifest_path,
        "--confirmation-ref",
        conf["data"]["confirmation_ref"],
        "--idempotency-key",
        key,
        env=env,
    )
    assert rc == 0 and train["ok"], train
    return train["data"]["run_id"]


def _tenant(stack) -> tuple[dict, str]:
    """A new account's env and a booking with room for the 4 GPUs."""
    account, _, env = stack.account()
    return env, stack.booking(account, gpus_per_node=8)


def _rank_logs(run_dir: pathlib.Path, stage: str = "pretrain") -> dict[int, list[int]]:
    """attempt -> the local ranks that wrote logs in it."""
    attempts: dict[int, list[int]] = {}
    for stderr in (run_dir / "gang" / stage / "logs").glob("*/attempt_*/*/stderr.log"):
        attempt = int(stderr.parent.parent.name.removeprefix("attempt_"))
        attempts.setdefault(attempt, []).append(int(stderr.parent.name))
    return {a: sorted(r) for a, r in attempts.items()}


def test_a_four_gpu_plan_trains_on_four_ranks(stack, manifest):
    env, booking = _tenant(stack)
    tokens = 12 * 8 * 32  # 12 steps of the 8 x 32 global batch
    m = manifest(
        resources=GPUS,
        target={"tokens": tokens, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003},
        checkpoint={"interval_steps": 4, "keep_last": 2, "storage": "local"},
    )
    rc, plan = stack.ecc("plan", "--booking", booking, "--manifest", str(m), env=env)
    assert rc == 0 and plan["data"]["ok"], plan
    strategy, degrees = plan["data"]["strategy"], plan["data"]["degrees"]
    assert strategy in ("ddp", "fsdp2") and degrees, plan["data"]

    run_id = _train(stack, env, booking, str(m), "gang-4")
    final = run_state(stack, env, run_id, {"succeeded", "failed", "gate_failed"}, timeout=RUN_TIMEOUT_S)
    assert final["state"] == "succeeded", final
    assert final["step"] == final["total_steps"] == 12

    used = final["parallelism"]
    assert used["strategy"] == strategy and used["world_size"] == 4, used
    assert used["mesh"] == {k: v for k, v in degrees.items() if v > 1}, (used, degrees)
    assert _rank_logs(stack.run_dir(run_id))[0] == [0, 1, 2, 3]

    human = stack.run("ecc", "ito", "status", run_id, env=env)
    assert human.returncode == 0, human.stderr
    mesh = " x ".join(f"{k} {v}" for k, v in used["mesh"].items())
    assert f"parallelism: {strategy}, world size 4, mesh {mesh}" in human.stdout, human.stdout

    rc, logs = stack.ecc("logs", run_id, env=env)
    assert rc == 0, logs
    messages = [ln["message"] for ln in logs["data"]["lines"]]
    assert any("starting a gang of 4 ranks" in msg for msg in messages), messages


def _rank_pids(job: pathlib.Path) -> list[int]:
    """The pids of the ranks running `job` (launch.rank processes, not the launcher)."""
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"training.launch.rank" in cmdline and str(job).encode() in cmdline:
            if b"torch.distributed.run" not in cmdline:
                pids.append(int(proc.name))
    return pids


@pytest.mark.chaos  # long: `make chaos` runs it (its short version stays in the suite)
def test_a_rank_killed_mid_stage_is_restarted_from_the_last_checkpoint(stack, manifest):
    env, booking = _tenant(stack)
    tokens = 60 * 8 * 32
    m = manifest(
        resources=GPUS,
        target={"tokens": tokens, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003},
        checkpoint={"interval_steps": 5, "keep_last": 3, "storage": "local"},
    )
    run_id = _train(stack, env, booking, str(m), "gang-kill")
    view = run_status(
        stack, env, run_id, lambda v: (v.get("last_checkpoint_step") or 0) >= 5, timeout=RUN_TIMEOUT_S
    )
    assert view["state"] == "running" and view["step"] < 60, view
    job = stack.run_dir(run_id) / "gang" / "pretrain" / "job.json"
    pids = eventually(lambda: _rank_pids(job), timeout=30, what="the gang's ranks")
    os.kill(pids[-1], signal.SIGKILL)

    final = run_state(stack, env, run_id, {"succeeded", "failed", "gate_failed"}, timeout=RUN_TIMEOUT_S)
    assert final["state"] == "succeeded", final
    assert final["step"] == 60
    attempts = _rank_logs(stack.run_dir(run_id))
    assert attempts.get(1) == [0, 1, 2, 3], attempts  # the launcher restarted the whole gang once
    rc, logs = stack.ecc("logs", run_id, env=env)
    assert rc == 0, logs
    resumed = [ln["message"] for ln in logs["data"]["lines"] if ln["message"].startswith("Resuming pretrain")]
    assert resumed, "the restarted gang did not resume from a checkpoint"


def test_post_training_and_a_custom_data_ladder_train_on_a_two_rank_gang(stack, manifest, tmp_path):
    """data_prep -> ladder (custom data) -> pretrain -> sft -> rlvr with 2 GPUs planned: every
    stage trains on a gang of 2 ranks; data preparation and the ladder's proxy runs happen once, in
    the agent; each stage's events come once (rank 0's), and RLVR has one rollout worker."""
    account, _, env = stack.account()
    booking = stack.booking(account, gpus_per_node=8)
    m = full_recipe(manifest, stack.file_root(account), {"nodes": 1, "gpus_per_node": 2})
    run_id = _train(stack, env, booking, str(m), "gang-post")
    final = run_state(stack, env, run_id, {"succeeded", "failed", "gate_failed"}, timeout=2 * RUN_TIMEOUT_S)
    assert final["state"] == "succeeded", final
    assert [g["stage"] for g in final["gates"]] == ["ladder", "pretrain", "sft", "rlvr"], final["gates"]
    assert final["parallelism"]["world_size"] == 2 and final["parallelism"]["stage"] == "rlvr", final

    run_dir = stack.run_dir(run_id)
    assert {s["name"] for s in final["provenance"]["steps"]} >= {"exact_dedup", "decontamination"}
    assert [p.relative_to(run_dir) for p in run_dir.rglob("provenance.json")] == [
        pathlib.Path("data_prep/provenance.json")
    ]
    assert (run_dir / "ladder" / "decision.json").exists() and not (run_dir / "gang" / "ladder").exists()
    decoder = msgspec.json.Decoder(RunEvent)
    for stage, steps in FULL_RECIPE_STEPS.items():
        assert _rank_logs(run_dir, stage)[0] == [0, 1], stage
        lines = (run_dir / "gang" / stage / "events.jsonl").read_text().splitlines()
        events = [decoder.decode(line) for line in lines]
        assert [e.step for e in events if isinstance(e, Metrics)] == list(range(1, steps + 1)), stage

    rc, logs = stack.ecc("logs", run_id, env=env)
    assert rc == 0, logs
    messages = [ln["message"] for ln in logs["data"]["lines"]]
    for stage in FULL_RECIPE_STEPS:
        started = [msg for msg in messages if msg.startswith(f"{stage}: starting a gang of 2 ranks")]
        assert len(started) == 1, (stage, started)
    assert messages.count("rlvr: 1 rollout worker (rank 0's) for 2 ranks") == 1, messages
    assert sum(msg.startswith("ladder: custom data ['custom']") for msg in messages) == 1, messages
