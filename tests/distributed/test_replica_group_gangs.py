"""Two gangs of 2 ranks (FSDP2 over each gang's ranks) as two torchft replica groups, on CPU/gloo:
what a multi-node run of several GPUs per node is (training/launch/multinode.py), without the services.
Both start together and meet at their first quorum. Group 1's gang is then SIGKILLed; group 0 steps
on alone; group 1 is started again (as a replacement node's agent would), resumes its own last
checkpoint, joins a later quorum behind group 0 and heals from it, each rank from the same rank of
its peer (its own shards: same mesh, same shard); from then on both groups step together.

The check that the healing carried everything (weights, optimizer moments, schedule): a checkpoint
that both groups committed at the same step after the heal holds the same weights, bit for bit. A
heal that missed the optimizer state or a shard would make the groups drift apart at once.
"""

import os
import signal
import subprocess
import time
from pathlib import Path

import msgspec
import pytest
import torch

pytest.importorskip("torchft", reason="torchft is not installed: `pip install torchft==0.2.0`")

import torch.distributed.checkpoint as dcp

from contracts.models import MODEL_SHAPES
from contracts.runs import LogLine, RunEvent
from tests.distributed import torchrun
from tests.support import eventually, replica_seal
from training.engine.checkpoint_dir import list_checkpoints
from training.engine.fault_tolerance import start_lighthouse
from training.launch.rank import ReplicaJob
from training.model import Transformer

pytestmark = pytest.mark.distributed

REPO = torchrun.REPO
STEPS = 100_000  # never reached: the test stops both gangs once it has seen what it needs
TOGETHER = 4  # steps both groups commit after the heal before their checkpoints are compared
BUDGET_S = 150  # two gangs of 2 ranks on 2 busy cores; ~30 s when idle


class GangGroup:
    """One torchrun gang of 2 ranks that is replica group `replica_id` of 2."""

    def __init__(self, tmp: Path, replica_id: int, lighthouse: str):
        self.dir = tmp / f"group-{replica_id}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.checkpoints = self.dir / "ckpt"
        job = torchrun.stage_job(
            steps=STEPS,
            batch_size=8,
            seq_len=32,
            seed=0,
            strategy="fsdp2",
            degrees={"dp_shard": 2},
            checkpoint_dir=str(self.checkpoints),
            checkpoint_interval=1,
            keep_last=1_000,
            losses_path=str(self.dir / "losses.jsonl"),
            events_path=str(self.dir / "events.jsonl"),
            replica_group=ReplicaJob(
                replica_id=replica_id, groups=2, lighthouse=lighthouse, seal=replica_seal(replica_id)
            ),
        )
        (self.dir / "job.json").write_bytes(msgspec.json.encode(job))
        command = torchrun.command([*torchrun.RANK_MAIN, str(self.dir / "job.json")], 2)
        env = torchrun.env()
        self.log = (self.dir / "torchrun.log").open("ab")
        # Its own session; torchrun starts each rank in a session of its own too (see `stop`).
        self.proc = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )

    def committed_steps(self) -> set[int]:
        return {c.step for c in list_checkpoints(self.checkpoints)}

    def messages(self) -> list[str]:
        path = self.dir / "events.jsonl"
        if not path.exists():
            return []
        decoder = msgspec.json.Decoder(RunEvent)
        events = []
        for line in path.read_text().splitlines():
            try:
                events.append(decoder.decode(line))
            except msgspec.DecodeError:
                continue  # a line still being written
        return [e.message for e in events if isinstance(e, LogLine)]

    def alive(self) -> None:
        if self.proc.poll() is not None:
            pytest.fail(f"{self.dir.name} exited ({self.proc.returncode}):\n{self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        return (self.dir / "torchrun.log").read_text(errors="replace")[-6000:]

    def stop(self) -> None:
        """SIGKILL the ranks and then the agent, as a node that dies takes all of them."""
        if self.proc.poll() is None:
            for rank in _children(self.proc.pid):
                os.killpg(rank, signal.SIGKILL)
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.log.close()


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text() if entry.name.isdigit() else ""
        except OSError:
            continue  # gone meanwhile
        if stat and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def _weights(checkpoint: str) -> dict[str, torch.Tensor]:
    """The model's parameters in a committed checkpoint (DCP gathers every rank's shards)."""
    model = Transformer(MODEL_SHAPES["tiny"])
    state = {"model": dict(model.named_parameters())}
    dcp.load(state, checkpoint_id=checkpoint, no_dist=True)
    return {name: p.detach().clone() for name, p in state["model"].items()}


def test_a_replaced_gang_heals_shard_by_shard_from_its_peer_and_steps_with_it(tmp_path):
    lighthouse = start_lighthouse("[::]:0")
    end = time.monotonic() + BUDGET_S
    groups: list[GangGroup] = []

    def wait(what, predicate, timeout):
        def probe():
            for group in groups:
                group.alive()
            return predicate()

        try:
            return eventually(
                probe, timeout=max(0.0, min(timeout, end - time.monotonic())), interval=0.2, what=what
            )
        except AssertionError:
            pytest.fail(f"no {what}\n" + "\n".join(f"--- {g.dir.name}\n{g.tail()}" for g in groups))

    def heals(group: GangGroup) -> list[int]:
        prefix = "pretrain: replica group 1 healed at step "
        return [int(m.removeprefix(prefix)) for m in group.messages() if m.startswith(prefix)]

    try:
        first = GangGroup(tmp_path, 0, lighthouse.address())
        second = GangGroup(tmp_path, 1, lighthouse.address())
        groups[:] = [first, second]
        wait(
            "2 steps committed by both groups",
            lambda: {1, 2} <= first.committed_steps() & second.committed_steps(),
            120,
        )
        second.stop()  # SIGKILL: group 1's agent and both its ranks, mid-step
        groups[:] = [first]
        lost_at = max(second.committed_steps())
        wait("group 0 stepping on alone", lambda: max(first.committed_steps()) >= lost_at + 3, 60)
        replacement = GangGroup(tmp_path, 1, lighthouse.address())  # same directory: it resumes there
        groups[:] = [first, replacement]
        healed = wait("heal of the replacement", lambda: [s for s in heals(replacement) if s > lost_at], 90)[
            0
        ]
        common = wait(
            f"{TOGETHER} steps committed by both groups after the heal",
            lambda: sorted(
                s for s in first.committed_steps() & replacement.committed_steps() if s >= healed + TOGETHER
            ),
            60,
        )
        assert not set(range(lost_at + 1, healed + 1)) & replacement.committed_steps(), (
            "group 1 committed a step it never trained"
        )
    finally:
        for group in groups:
            group.stop()
        lighthouse.shutdown()

    step = common[0]
    a = _weights(str(first.checkpoints / f"step-{step:08d}"))
    b = _weights(str(replacement.checkpoints / f"step-{step:08d}"))
    differ = [name for name in a if not torch.equal(a[name], b[name])]
    assert not differ, (
        f"after healing at step {healed}, the groups' weights at step {step} differ in {differ}"
    )
