"""torchft replica groups on CPU (tests.training.replica_process): a replica killed with SIGKILL, the
survivor keeps stepping alone, a replacement heals from its peer over HTTP, and both step together
again with the same weights. Also: the Manager's state is in the DCP checkpoints.

Two replica processes and an in-process Lighthouse; every wait has a deadline and every process
is killed in `finally`. Nothing here asserts on durations: the timings are printed (run with -s).
"""

import functools
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("torchft", reason="torchft is not installed: `pip install torchft==0.2.0`")

import torch.distributed.checkpoint as dcp

from contracts.models import MODEL_SHAPES
from tests.support import eventually
from training.engine.checkpoint import Checkpointer
from training.engine.checkpoint_dir import list_checkpoints
from training.engine.checkpoint_load import load_latest, load_weights
from training.engine.fault_tolerance import (
    CheckpointView,
    ManagerProgress,
    start_lighthouse,
    weights_checksum,
)
from training.model import Transformer

REPO = pathlib.Path(__file__).resolve().parents[2]
STEPS = 1_000_000  # never reached: the test stops the replicas itself
CHECKPOINT_EVERY = 10
BUDGET_S = 90  # the whole kill/rejoin scenario, imports included; ~10 s on 2 idle cores

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class Replica:
    """One `python -m tests.training.replica_process` process and the JSON lines it writes."""

    def __init__(self, replica_id: int, tag: str, lighthouse: str, tmp: pathlib.Path):
        self.tag = tag
        self.progress = tmp / f"{tag}.jsonl"
        self.log_path = tmp / f"{tag}.log"
        self.launched = time.time()
        command = [
            sys.executable,
            "-m",
            "tests.training.replica_process",
            "--replica-id",
            str(replica_id),
            "--lighthouse",
            lighthouse,
            "--steps",
            str(STEPS),
            "--checkpoint-dir",
            str(tmp / "checkpoints"),
            "--checkpoint-every",
            str(CHECKPOINT_EVERY),
            "--progress",
            str(self.progress),
        ]
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)

    def events(self, kind: str | None = None) -> list[dict]:
        if not self.progress.exists():
            return []
        found = []
        for line in self.progress.read_text().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line still being written
            if kind is None or event["event"] == kind:
                found.append(event)
        return found

    def committed(self, participants: int | None = None) -> list[dict]:
        return [
            e
            for e in self.events("step")
            if e["committed"] and (participants is None or e["participants"] == participants)
        ]

    def log_tail(self) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        events = "\n".join(json.dumps(e) for e in self.events()[-5:])
        return (
            f"--- {self.tag} (exit {self.proc.poll()}) ---\n{text[-3000:]}\n--- its last events ---\n{events}"
        )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


def wait_for(what: str, predicate, *, deadline_s: float, alive: list[Replica], budget_end: float):
    """Poll until `predicate()` is truthy and return it; fail if a replica in `alive` exits, or
    after `deadline_s` or at the end of the test's budget, whichever comes first."""

    def probe():
        if result := predicate():
            return result
        for replica in alive:
            if replica.proc.poll() is not None:
                pytest.fail(f"{replica.tag} exited while waiting for {what}\n{replica.log_tail()}")
        return None

    timeout = max(0.0, min(deadline_s, budget_end - time.monotonic()))
    try:
        return eventually(probe, timeout=timeout, interval=0.2, what=what)
    except AssertionError:
        pytest.fail(f"no {what} before the deadline\n" + "\n".join(r.log_tail() for r in alive))


def matching_step(a: Replica, b: Replica, *, after: int) -> dict | None:
    """The first step above `after` that both committed with 2 participants and the same weights."""
    b_steps = {e["step"]: e for e in b.committed(participants=2) if e["step"] > after}
    for event in a.committed(participants=2):
        other = b_steps.get(event["step"])
        if other is not None and other["checksum"] == event["checksum"]:
            return event
    return None


def test_killed_replica_survivor_continues_and_replacement_heals_from_peer(tmp_path):
    wait = functools.partial(wait_for, budget_end=time.monotonic() + BUDGET_S)
    lighthouse = start_lighthouse()
    replicas: list[Replica] = []
    try:
        r0 = Replica(0, "replica0", lighthouse.address(), tmp_path)
        r1 = Replica(1, "replica1", lighthouse.address(), tmp_path)
        replicas += [r0, r1]
        both = wait(
            "step committed by both replicas together",
            lambda: matching_step(r0, r1, after=0),
            deadline_s=40,
            alive=[r0, r1],
        )
        # Let replica 1 commit a checkpoint, so that its replacement resumes from it before healing.
        wait("checkpoint of replica 1", lambda: r1.events("checkpoint"), deadline_s=20, alive=[r0, r1])

        os.kill(r1.proc.pid, signal.SIGKILL)
        killed_at = time.time()
        r1.proc.wait(timeout=10)
        r0_step_at_kill = r0.committed()[-1]["step"]
        r1_last_step = r1.committed()[-1]["step"]

        def alone_after_kill() -> list[dict]:
            return [e for e in r0.committed(participants=1) if e["step"] > r0_step_at_kill]

        first_alone = wait(
            "step of replica 0 alone after the kill", alone_after_kill, deadline_s=30, alive=[r0]
        )[0]
        # It keeps stepping, in the same process: the job was never restarted.
        wait(
            "further steps of replica 0 alone",
            lambda: len(alone_after_kill()) >= 3,
            deadline_s=20,
            alive=[r0],
        )
        assert not r0.events("resumed")
        assert len(r0.events("started")) == 1

        r1b = Replica(1, "replica1-replacement", lighthouse.address(), tmp_path)
        replicas.append(r1b)
        healed = wait(
            "heal of the replacement",
            lambda: [e for e in r1b.events("healed") if e["step"] > 0],
            deadline_s=40,
            alive=[r0, r1b],
        )[0]
        together = wait(
            "step committed by replica 0 and the replacement with the same weights",
            lambda: matching_step(r0, r1b, after=healed["step"]),
            deadline_s=30,
            alive=[r0, r1b],
        )

        # The replacement resumed from its own older checkpoint, then took its peer's newer state:
        # the step replica 0 had reached alone, not the one replica 1 died at.
        resumed = r1b.events("resumed")
        assert resumed and resumed[0]["step"] <= r1_last_step
        assert healed["step"] > first_alone["step"] > r1_last_step
        # Its first committed step already has replica 0's weights at that step.
        first = r1b.committed()[0]
        peer = next(e for e in r0.committed() if e["step"] == first["step"])
        assert first["checksum"] == peer["checksum"]
        assert together["step"] > healed["step"]

        print(
            f"\nboth stepping at {both['step']}; SIGKILL of replica 1 at its step {r1_last_step} "
            f"(replica 0 at {r0_step_at_kill}); replica 0 alone from step {first_alone['step']}, "
            f"{first_alone['t'] - killed_at:.1f} s after the kill; replacement resumed at {resumed[0]['step']}, "
            f"healed to {healed['step']} {healed['t'] - r1b.launched:.1f} s after its launch; "
            f"both at step {together['step']} with checksum {together['checksum']}"
        )

        # SIGTERM stops replica 0 cleanly: it finishes its step and the checkpoint in flight.
        r0.proc.send_signal(signal.SIGTERM)
        assert r0.proc.wait(timeout=30) == 0, r0.log_tail()
        finished = r0.events("finished")
        assert finished and finished[0]["step"] >= together["step"]
    finally:
        for replica in replicas:
            replica.kill()
        lighthouse.shutdown()

    # The Manager's state is in replica 0's DCP checkpoints, next to the model and optimizer.
    saved = list_checkpoints(tmp_path / "checkpoints" / "replica-0")
    assert saved
    for info in saved:
        state = {
            "model": {
                "torchft.step": torch.zeros((), dtype=torch.int64),
                "torchft.batches_committed": torch.zeros((), dtype=torch.int64),
            }
        }
        dcp.load(state, checkpoint_id=info.path, no_dist=True)
        assert int(state["model"]["torchft.step"]) == info.step
        assert int(state["model"]["torchft.batches_committed"]) >= info.step


def test_checkpoint_view_saves_manager_state_beside_model_and_optimizer(tmp_path):
    shape = MODEL_SHAPES["tiny"]
    torch.manual_seed(0)
    model = Transformer(shape)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, shape.vocab_size, (2, 16))
    _, loss = model(x, x)
    loss.backward()
    optimizer.step()
    progress = ManagerProgress()
    progress.capture({"step": 7, "batches_committed": 13})
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(7, CheckpointView(model, progress), optimizer)
    assert [info.step for info in checkpointer.wait()] == [7]

    restored_model = Transformer(shape)
    restored_progress = ManagerProgress()
    restored_optimizer = torch.optim.AdamW(restored_model.parameters(), lr=1e-3)
    resumed = load_latest(tmp_path, CheckpointView(restored_model, restored_progress), restored_optimizer)
    assert resumed is not None and resumed.step == 7
    assert restored_progress.manager_state() == {"step": 7, "batches_committed": 13}
    assert weights_checksum(restored_model) == weights_checksum(model)
    assert restored_optimizer.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]

    # The same checkpoint still loads into a plain Transformer: the torchft keys are extra.
    plain = Transformer(shape)
    assert load_weights(tmp_path, plain) is not None
    assert weights_checksum(plain) == weights_checksum(model)
