"""A trainer killed with SIGKILL mid-stage: the run is marked interrupted within seconds, the work
item comes back, a trainer resumes from the last committed checkpoint, and the run succeeds."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests.support import approve_restart, eventually, run_state, run_status

pytestmark = pytest.mark.e2e
ITO_TRAINING = str(pathlib.Path(sys.executable).parent / "ito-training")
LONG = {"tokens": 600 * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003}


def status(stack, env, run_id):
    rc, out = stack.ecc("status", run_id, env=env)
    assert rc == 0, out
    return out["data"]


def rollup_of(stack, booking):
    """The desk's rollup of one booking, once the telemetry service has one (else None)."""
    proc = stack.run("ito-training", "desk", "telemetry", "--json")
    rollups = {(r["by"], r["key"]): r for r in json.loads(proc.stdout.strip().splitlines()[-1] or "[]")}
    return rollups.get(("booking", booking))


@pytest.mark.chaos  # long: `make chaos` runs it (its short version stays in the suite)
def test_kill_9_trainer_resumes_from_checkpoint(make_stack, manifest):
    stack = make_stack()
    account, _, env = stack.account()
    booking = stack.booking(account)
    m = str(manifest(target=LONG, checkpoint={"interval_steps": 50, "keep_last": 2, "storage": "local"}))
    _, conf = stack.ecc("confirm", "--action", "train", "--booking", booking, "--manifest", m, env=env)
    _rc, out = stack.ecc(
        "train",
        "--booking",
        booking,
        "--manifest",
        m,
        "--confirmation-ref",
        conf["data"]["confirmation_ref"],
        "--idempotency-key",
        "ft-1",
        env=env,
    )
    run_id = out["data"]["run_id"]
    run_status(stack, env, run_id, lambda v: (v.get("last_checkpoint_step") or 0) >= 100, timeout=120)
    trainer_pid = json.loads((stack.data_dir / "up.json").read_text())["services"]["trainer"]
    os.kill(trainer_pid, signal.SIGKILL)
    killed_at = status(stack, env, run_id)["step"]

    run_state(stack, env, run_id, {"interrupted"}, timeout=30)  # the watcher notices the silence
    replacement = subprocess.Popen(
        [ITO_TRAINING, "serve", "trainer"],
        env=stack.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        view = run_state(stack, env, run_id, {"succeeded", "failed"}, timeout=120)
        assert view["state"] == "succeeded", view
        _, logs = stack.ecc("logs", run_id, env=env)
        resumed = [ln["message"] for ln in logs["data"]["lines"] if "esum" in ln["message"]]
        assert resumed, "the replacement trainer resumed from a checkpoint and said so"
        _, metrics = stack.ecc("metrics", run_id, "--since", "0", env=env)
        steps = [p["step"] for p in metrics["data"]["points"]]
        restart = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
        assert (
            steps[restart] - 1 in (50, 100, 150) and steps[restart] <= killed_at + 1
        )  # from a committed checkpoint
        assert steps[-1] == 600

        # desk telemetry counts exactly this one interruption, and the run's time adds up to 100 %
        booking_rollup = eventually(
            lambda: rollup_of(stack, booking), timeout=30, interval=0.5, what="the booking's desk rollup"
        )
        assert booking_rollup["runs"] == 1 and booking_rollup["interruptions"] == 1
        assert booking_rollup["interruption_causes"] == {"trainer_lost": 1}
        badput = booking_rollup["badput_gpu_hours"]
        assert (
            badput["recovery"] > 0
            and badput["checkpoint_restore"] > 0
            and badput["lost_to_interruptions"] > 0
        )
        held = sum(v for k, v in badput.items() if k != "idle")  # the run's own hours, every kind
        assert booking_rollup["goodput_gpu_hours"] + held == pytest.approx(
            booking_rollup["wall_gpu_hours"], rel=1e-9
        )
        # and with the booked GPUs no run held, the booking's whole window is accounted for
        assert booking_rollup["goodput_gpu_hours"] + sum(badput.values()) == pytest.approx(
            booking_rollup["booked_gpu_hours"], rel=1e-9
        )
    finally:
        replacement.terminate()
        replacement.wait(timeout=15)


def test_a_planted_loss_spike_waits_for_approval_and_restarts_from_the_proposal(make_stack, manifest):
    from runtime.configuration import faults

    stack = make_stack(env={faults.ENV_FAULT_POINT: faults.TRAINER_LOSS_SPIKE, faults.ENV_SPIKE_STEP: "60"})
    account, _, env = stack.account()
    booking = stack.booking(account)
    m = str(
        manifest(
            target={"tokens": 200 * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003},
            checkpoint={"interval_steps": 20, "keep_last": 3, "storage": "local"},
        )
    )
    _, conf = stack.ecc("confirm", "--action", "train", "--booking", booking, "--manifest", m, env=env)
    _, out = stack.ecc(
        "train",
        "--booking",
        booking,
        "--manifest",
        m,
        "--confirmation-ref",
        conf["data"]["confirmation_ref"],
        "--idempotency-key",
        "spike-1",
        env=env,
    )
    run_id = out["data"]["run_id"]

    def paused(view):
        assert view["state"] in ("queued", "running", "awaiting_approval"), view
        return view["state"] == "awaiting_approval"

    view = run_status(stack, env, run_id, paused, timeout=120)
    proposal = view["proposal"]
    assert proposal["spike_step"] == 60 and proposal["checkpoint_step"] == 40
    assert (proposal["skip_from"], proposal["skip_to"]) == (40, 80)

    rc, out = stack.ecc("approve", run_id, "--idempotency-key", "no-1", env=env)
    assert out["error"]["code"] == "confirmation_required"
    rc, out = stack.ecc("approve", run_id, "--reject", "--idempotency-key", "rej-1", env=env)
    assert rc == 0 and out["data"]["state"] == "awaiting_approval" and "stays paused" in out["notice"]
    time.sleep(2)
    assert status(stack, env, run_id)["state"] == "awaiting_approval"  # never automatic

    approve_restart(stack, env, run_id, "ok-1")
    view = run_state(stack, env, run_id, {"succeeded", "failed", "awaiting_approval"}, timeout=120)
    assert view["state"] == "succeeded", view
    _, logs = stack.ecc("logs", run_id, env=env)
    assert any("Skipping batches [40, 80)" in ln["message"] for ln in logs["data"]["lines"])
    _, metrics = stack.ecc("metrics", run_id, env=env)
    steps = [p["step"] for p in metrics["data"]["points"]]
    assert steps.count(41) == 2 and steps[-1] == 200  # resumed from the proposed checkpoint
