"""Faults of a 2-rank gang (CPU, gloo) through real `ecc` processes. With no restarts left to the
elastic launcher (ITO_GANG_MAX_RESTARTS=0), a rank killed mid-stage interrupts the run as a lost
trainer does: `interrupted`, the work item back on the queue, resumed from the last committed
checkpoint, `succeeded`. A confirmed `ecc ito cancel` stops every rank of the gang and leaves the
run `cancelled` with its last checkpoint."""

import os
import pathlib
import signal

import pytest

from tests.conftest import start_stack
from tests.e2e.test_gang_e2e import _rank_logs, _rank_pids, _train
from tests.support import eventually, run_state, run_status

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

GPUS = {"nodes": 1, "gpus_per_node": 2}
RUN_TIMEOUT_S = 240  # 2 ranks of the tiny model on 2 cores: ~20-40 s an attempt, most of it start-up
TERMINAL = {"succeeded", "failed", "gate_failed", "cancelled"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """All services; the tiny model planned on a node's GPUs, and a gang the launcher never
    restarts, so that one lost rank is a lost gang."""
    env = {"ITO_PLAN_SMALL_MODEL_GANGS": "1", "ITO_GANG_MAX_RESTARTS": "0", "OMP_NUM_THREADS": "1"}
    s = start_stack(tmp_path_factory.mktemp("gang-faults"), env=env)
    try:
        yield s
    finally:
        s.run("ito-training", "down", timeout=60)


def _start(stack, manifest, steps: int, key: str) -> tuple[dict, str]:
    account, _, env = stack.account()
    booking = stack.booking(account, gpus_per_node=8)
    m = manifest(
        resources=GPUS,
        target={"tokens": steps * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003},
        checkpoint={"interval_steps": 5, "keep_last": 3, "storage": "local"},
    )
    return env, _train(stack, env, booking, str(m), key)


def _running_ranks(stack, env, run_id: str) -> tuple[dict, pathlib.Path, list[int]]:
    """The run's status once it has a checkpoint, its gang's job file, and the pids of its ranks."""
    view = run_status(
        stack, env, run_id, lambda v: (v.get("last_checkpoint_step") or 0) >= 5, timeout=RUN_TIMEOUT_S
    )
    assert view["state"] == "running", view
    job = stack.run_dir(run_id) / "gang" / "pretrain" / "job.json"
    pids = eventually(lambda: len(p := _rank_pids(job)) == 2 and p, timeout=30, what="the gang's 2 ranks")
    return view, job, pids


def _gang_processes(job: pathlib.Path) -> list[int]:
    """Every process of the gang running `job`: its launcher and its ranks."""
    pids = []
    for proc in pathlib.Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(job).encode() in (proc / "cmdline").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_a_gang_lost_past_its_restarts_is_interrupted_requeued_and_resumed(stack, manifest):
    env, run_id = _start(stack, manifest, 60, "gang-lost")
    _view, _job, pids = _running_ranks(stack, env, run_id)
    os.kill(pids[-1], signal.SIGKILL)

    # Not `failed`: interrupted (as for a lost trainer), then back on the queue.
    seen = run_state(stack, env, run_id, {"interrupted"} | TERMINAL, timeout=RUN_TIMEOUT_S)
    assert seen["state"] == "interrupted", seen
    # JetStream's delivery count bounds the requeues; a slow first lease on a loaded machine may
    # already have cost a delivery, so the count is not pinned here.
    assert "after up to 0 restarts" in seen["message"] and "of at most 3)" in seen["message"], seen

    final = run_state(stack, env, run_id, TERMINAL, timeout=RUN_TIMEOUT_S)
    assert final["state"] == "succeeded", final
    assert final["step"] == final["total_steps"] == 60
    rc, logs = stack.ecc("logs", run_id, env=env)
    assert rc == 0, logs
    messages = [ln["message"] for ln in logs["data"]["lines"]]
    resumed = [m for m in messages if m.startswith("Resuming pretrain")]
    assert resumed, "the requeued run did not resume from a checkpoint"
    assert sum("starting a gang of 2 ranks" in m for m in messages) == 2, messages  # one per delivery
    assert _rank_logs(stack.run_dir(run_id)), "no per-rank logs"


def test_a_confirmed_cancel_stops_every_rank_of_the_gang(stack, manifest):
    env, run_id = _start(stack, manifest, 4000, "gang-cancel")
    _view, job, _pids = _running_ranks(stack, env, run_id)
    assert len(_gang_processes(job)) == 3  # the launcher and its 2 ranks

    rc, out = stack.ecc("confirm", "--action", "cancel", "--run", run_id, env=env)
    assert rc == 0, out
    ref = out["data"]["confirmation_ref"]
    rc, out = stack.ecc("cancel", run_id, "--confirmation-ref", ref, "--idempotency-key", "gc-1", env=env)
    assert rc == 0 and out["data"]["state"] in ("cancelling", "cancelled"), out

    final = run_state(stack, env, run_id, TERMINAL, timeout=120)
    assert final["state"] == "cancelled", final
    assert "last checkpoint at step" in final["message"], final
    assert final["step"] < final["total_steps"]
    assert final["last_checkpoint_step"] >= 5, final
    # Every rank of this run is gone, and so is its launcher: nothing of the gang is left.
    eventually(lambda: not _gang_processes(job), timeout=30, what="no process of the cancelled gang left")
