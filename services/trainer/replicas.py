"""Replica-level fault tolerance for data-parallel training on CPU, with torchft.

This module owns one replica group's training worker: the tiny Transformer of `model.py`, trained on
`data.py` batches, under a torchft `Manager` with `ProcessGroupGloo`, torchft's
`DistributedDataParallel` and its `Optimizer` wrapper. Each replica group is one process here
(group world size 1); the groups find each other through a torchft Lighthouse.

What torchft gives, and what this worker adds around it:
  - Every step asks the Lighthouse for a quorum. A replica killed with SIGKILL stops heartbeating;
    after the Lighthouse's heartbeat timeout the survivors form a quorum without it and keep
    stepping. The step that was in flight when the peer died fails its all-reduce (Gloo error or
    timeout), is reported to the Manager and is not committed; nothing crashes and nothing restarts.
    (That needs `FaultTolerantDDP` below: torchft 0.2.0's own DDP hook raises out of `backward`
    right there and kills the survivor as well.)
  - A replacement started later joins the next quorum behind the others' step; torchft heals it by
    fetching the model and optimizer state from a peer over HTTP (`load_state_dict` below), and
    from then on both step together with the same weights.
  - Checkpoints go through `services.trainer.checkpoint` unchanged (async DCP, COMMITTED marker,
    pruning). `Manager.state_dict()` ({step, batches_committed}) travels in the same DCP snapshot as
    two int64 buffers under the key `torchft.*` of the model state (see `CheckpointView`): no pickle
    in the checkpoint, and a plain `Transformer` still loads the weights with `load_weights`.
    A restarted replica loads its own latest checkpoint first, then heals from a peer if one is ahead.
  - Data: replica N of R draws batch number `step * R + N` (`BatchIterator.batch_at`), so the data
    position is a function of the committed step and is restored with it, by healing or resuming.
    While a group is missing its batches are skipped, not redone (torchft's per-group sampling).
  - The quorum runs asynchronously (torchft's default), overlapped with the forward pass. So the
    step in which a replica heals runs its forward on its old weights; its gradient is zeroed before
    the all-reduce, its logged loss is the old weights' loss, and it is not counted in
    `participants` for that one step. From the next step on it is an equal member.

Progress is written as JSON lines (stdout, or `--progress FILE`), one object per event:
  started    {pid, store_port}
  resumed    {step, path}                  own checkpoint loaded before joining
  healed     {step}                        state received from a peer; step is the peer's step
  step       {step, committed, loss, participants, checksum[, error]}
  checkpoint {step, path, bytes} / checkpoint_failed {step, message}
  finished   {step} / failed {error}
Every object also has `event`, `replica_id` and `t` (Unix time).

Run (one Lighthouse, then one process per replica group):
  python -m services.trainer.replicas --serve-lighthouse '[::]:29510'
  python -m services.trainer.replicas --replica-id 0 --lighthouse http://HOST:29510 --steps 500 \
      --checkpoint-dir /tmp/ft
  python -m services.trainer.replicas --replica-id 1 --lighthouse http://HOST:29510 --steps 500 \
      --checkpoint-dir /tmp/ft
"""

import argparse
import hashlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TextIO

import torch
from torch import nn
from torch.distributed import TCPStore
from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

from contracts.models import MODEL_SHAPES
from services.trainer.checkpoint import (
    CHECKPOINT_DEFAULTS,
    Checkpointer,
    CheckpointFailed,
    CheckpointInfo,
    load_latest,
)
from services.trainer.data import BatchIterator, load_tokens
from services.trainer.model import Transformer

# Lighthouse defaults. torchft's own are 5 s heartbeat and 60 s join timeouts, sized for clusters;
# these are sized for a few processes on one host, so a kill is noticed in ~2 s.
HEARTBEAT_TIMEOUT_MS = 2_000  # a silent replica leaves the quorum after this; raise on a loaded host
JOIN_TIMEOUT_MS = 1_000  # how long a quorum waits for heartbeating replicas that have not asked yet
QUORUM_TICK_MS = 100  # how often the Lighthouse re-checks a pending quorum


@dataclass(kw_only=True, slots=True)
class ReplicaConfig:
    replica_id: int
    """This replica group's number, 0-based. Its torchft id is `replica_<N>` (torchft reads the
    trailing digits as the group's global rank)."""
    lighthouse: str
    """The Lighthouse's address, e.g. `http://host:29510` (what `LighthouseServer.address()` says)."""
    steps: int
    """Stop after this many committed steps (the Manager's step, shared by all replica groups)."""
    checkpoint_dir: str
    """Parent of this group's checkpoints, which go to `<dir>/replica-<N>/step-XXXXXXXX/`."""
    checkpoint_every: int = 20
    """Save every this many committed steps; 0 turns saving off."""
    keep_last: int = CHECKPOINT_DEFAULTS.keep_last
    """Committed checkpoints kept per replica group."""
    num_replica_groups: int = 2
    """R in the data layout `step * R + N`: the most groups that draw distinct batches."""
    model_size: str = "tiny"
    seq_len: int = 64  # short windows keep a step at tens of ms on one CPU core
    batch_size: int = 8
    lr: float = 1e-3
    seed: int = 0
    """Seeds the initial weights (identical in every group) and the batch stream."""
    data_source: str = "generated:arithmetic"
    timeout_s: float = 5.0
    """Gloo collectives, should_commit, and the HTTP transfer of a healing checkpoint."""
    quorum_timeout_s: float = 15.0
    """How long one quorum may take; must exceed the Lighthouse's heartbeat timeout."""
    connect_timeout_s: float = 5.0
    store_host: str = "127.0.0.1"
    """The address this group's TCPStore is reached at by its peers; a routable one across hosts."""
    progress: str | None = None
    """File the JSON lines are appended to; None writes them to stdout."""
    threads: int = 1  # torch intra-op threads: one per replica process on a 2-core machine

    def __post_init__(self) -> None:
        if self.replica_id < 0:
            raise ValueError("The replica id needs to be 0 or more.")
        if self.steps < 1:
            raise ValueError("The number of steps needs to be at least 1.")
        if self.checkpoint_every < 0:
            raise ValueError("The checkpoint interval needs to be 0 (off) or at least 1 step.")
        if self.num_replica_groups <= self.replica_id:
            raise ValueError("The number of replica groups needs to be larger than the replica id.")
        if self.model_size not in MODEL_SHAPES:
            raise ValueError(f"Unknown model size {self.model_size!r}: use one of {', '.join(MODEL_SHAPES)}.")
        if self.quorum_timeout_s * 1000 <= HEARTBEAT_TIMEOUT_MS:
            raise ValueError("The quorum timeout needs to be longer than the Lighthouse's heartbeat timeout.")


def start_lighthouse(
    bind: str = "[::]:0",
    *,
    min_replicas: int = 1,
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
    join_timeout_ms: int = JOIN_TIMEOUT_MS,
    quorum_tick_ms: int = QUORUM_TICK_MS,
):
    """A torchft Lighthouse in this process (a Rust server on its own threads). Its `address()` is
    what replicas get as `--lighthouse`; call `shutdown()` to stop it."""
    from torchft.coordination import LighthouseServer

    return LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )


class FaultTolerantDDP(DistributedDataParallel):
    """torchft's DDP wrapper with a gradient hook that survives a failed all-reduce.

    torchft 0.2.0's hook ends with `assert fut._fut`, and `_fut` is only set when the all-reduce
    succeeded. When a peer is killed in the middle of an all-reduce, Gloo raises ("Connection reset
    by peer", or its timeout), torchft records the error in the Manager as designed, and then the
    assert turns it into an AssertionError out of `loss.backward()` that kills the survivor too.
    A bucket reduced after an error gets a `_DummyWork` whose future has no `_fut` at all (same
    failure; upstream torchft issues #294 and #304). Here a failed bucket completes with its local
    gradient instead: the Manager holds the error, so `should_commit` says no and no optimizer
    steps on it, and the next quorum drops the dead peer.
    """

    @staticmethod
    def _comm_hook(manager: Manager, bucket) -> torch.futures.Future[torch.Tensor]:
        work = manager.allreduce(bucket.buffer())
        work.wait()  # does not raise: a failure is recorded with manager.report_error
        reduced = getattr(work.get_future(), "_fut", None)
        if reduced is not None:
            return reduced
        local: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        local.set_result(bucket.buffer())
        return local


class ManagerProgress(nn.Module):
    """`Manager.state_dict()` as two persistent int64 buffers, so DCP saves and loads it as tensors."""

    step: torch.Tensor  # buffers (register_buffer below), declared for the type checker
    batches_committed: torch.Tensor

    def __init__(self):
        super().__init__()
        self.register_buffer("step", torch.zeros((), dtype=torch.int64))
        self.register_buffer("batches_committed", torch.zeros((), dtype=torch.int64))

    def capture(self, manager_state: dict[str, int]) -> None:
        self.step.fill_(manager_state["step"])
        self.batches_committed.fill_(manager_state["batches_committed"])

    def manager_state(self) -> dict[str, int]:
        return {"step": int(self.step), "batches_committed": int(self.batches_committed)}


class CheckpointView(nn.Module):
    """What a checkpoint holds: the model's own submodules under their own names (the same tensors,
    not copies) plus `torchft`, the Manager's progress. Keys are those of a plain Transformer
    checkpoint plus `torchft.step` and `torchft.batches_committed`."""

    def __init__(self, model: nn.Module, progress: ManagerProgress):
        super().__init__()
        # Direct parameters of the model would be missed by a view built from its children.
        assert not list(model.parameters(recurse=False)), "the model must keep its parameters in submodules"
        for name, child in model.named_children():
            self.add_module(name, child)
        self.torchft = progress


def weights_checksum(model: nn.Module) -> str:
    """A short hash of every parameter's bytes: equal in two replicas iff their weights are equal."""
    digest = hashlib.blake2b(digest_size=8)
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class ProgressLog:
    """JSON lines, one per event, flushed at once so a watcher sees them while the run goes on."""

    def __init__(self, replica_id: int, path: str | None):
        self.replica_id = replica_id
        self._out: TextIO = open(path, "a", encoding="utf-8") if path else sys.stdout
        self._owned = path is not None

    def write(self, event: str, **fields: object) -> None:
        record = {"event": event, "replica_id": self.replica_id, "t": round(time.time(), 3), **fields}
        self._out.write(json.dumps(record) + "\n")
        self._out.flush()

    def close(self) -> None:
        if self._owned:
            self._out.close()


class ReplicaWorker:
    """One replica group of one process: build, `train`, `close`."""

    def __init__(self, config: ReplicaConfig, log: ProgressLog):
        self.config = config
        self.log = log
        self.stop_requested = threading.Event()
        torch.set_num_threads(config.threads)
        torch.manual_seed(config.seed)  # every group starts from the same weights

        shape = MODEL_SHAPES[config.model_size]
        tokens = load_tokens([config.data_source], seed=config.seed)
        self.batches = BatchIterator(
            tokens, seq_len=config.seq_len, batch_size=config.batch_size, seed=config.seed
        )
        self.model = Transformer(shape)
        self.progress = ManagerProgress()
        self.view = CheckpointView(self.model, self.progress)

        # torchft's Manager connects to this group's TCPStore as a client and waits forever if none
        # is listening, so the group's rank 0 (this process) hosts it. Port 0: any free port.
        self.store = TCPStore(config.store_host, 0, is_master=True, wait_for_workers=False)
        timeout = timedelta(seconds=config.timeout_s)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout),
            load_state_dict=self._load_peer_state,
            state_dict=self._peer_state,
            min_replica_size=1,  # keep stepping alone when the other group is gone
            timeout=timeout,
            quorum_timeout=timedelta(seconds=config.quorum_timeout_s),
            connect_timeout=timedelta(seconds=config.connect_timeout_s),
            rank=0,
            world_size=1,
            store_addr=config.store_host,
            store_port=self.store.port,
            lighthouse_addr=config.lighthouse,
            replica_id=f"replica_{config.replica_id}",
        )
        self.ddp = FaultTolerantDDP(self.manager, self.model)
        self.optimizer = Optimizer(self.manager, torch.optim.AdamW(self.model.parameters(), lr=config.lr))
        # The inner optimizer, never the wrapper, goes to the checkpointer: DCP's template step on a
        # fresh optimizer would otherwise run a torchft should_commit outside the training loop.
        self.checkpointer = Checkpointer(
            Path(config.checkpoint_dir) / f"replica-{config.replica_id}", keep_last=config.keep_last
        )
        self.log.write("started", pid=os.getpid(), store_port=self.store.port)

    # --- the state a healing peer receives (torchft calls these on the training thread or its quorum thread)

    def _peer_state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.optimizer.optim.state_dict()}

    def _load_peer_state(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.optim.load_state_dict(state["optim"])
        # The Manager has already taken the peer's step when it hands the state over.
        self.log.write("healed", step=self.manager.current_step())

    # --- lifecycle

    def resume(self) -> None:
        """Load this group's latest committed checkpoint, Manager state included, if there is one.
        A peer that is further ahead still heals this group at the first quorum."""
        resumed = load_latest(self.checkpointer.directory, self.view, self.optimizer.optim)
        if resumed is None:
            return
        self.manager.load_state_dict(self.progress.manager_state())
        self.log.write("resumed", step=self.manager.current_step(), path=resumed.path)

    def train(self) -> int:
        """Step until `steps` committed steps or a stop request; returns the Manager's step."""
        config = self.config
        while not self.stop_requested.is_set() and self.manager.current_step() < config.steps:
            before = self.manager.current_step()
            x, y = self.batches.batch_at(before * config.num_replica_groups + config.replica_id)
            self.optimizer.zero_grad()  # starts this step's quorum (asynchronously)
            _, loss = self.ddp(x, y)
            loss.backward()  # gradients all-reduced across the quorum through the Manager
            self.optimizer.step()  # steps AdamW only if every group in the quorum can commit
            step = self.manager.current_step()
            record = {
                "step": step,
                "committed": step > before,
                "loss": round(loss.item(), 5),
                "participants": self.manager.num_participants(),
                "checksum": weights_checksum(self.model),
            }
            if (error := self.manager.errored()) is not None:
                record["error"] = str(error.original_exception).splitlines()[0][:300]
            self.log.write("step", **record)
            if step > before and config.checkpoint_every and step % config.checkpoint_every == 0:
                self._save(step)
            self._report_checkpoints(self.checkpointer.poll())
        return self.manager.current_step()

    def _save(self, step: int) -> None:
        self.progress.capture(self.manager.state_dict())
        data_position = step * self.config.num_replica_groups + self.config.replica_id
        self.checkpointer.save(step, self.view, self.optimizer.optim, data_position=data_position)

    def _report_checkpoints(self, outcomes: list[CheckpointInfo | CheckpointFailed]) -> None:
        for outcome in outcomes:
            match outcome:
                case CheckpointInfo():
                    self.log.write("checkpoint", step=outcome.step, path=outcome.path, bytes=outcome.bytes)
                case CheckpointFailed():
                    self.log.write("checkpoint_failed", step=outcome.step, message=outcome.message)

    def close(self) -> None:
        """Finish the checkpoint in flight, then stop the Manager's servers (HTTP, gRPC)."""
        try:
            self._report_checkpoints(self.checkpointer.wait())
        finally:
            self.manager.shutdown(wait=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m services.trainer.replicas", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--serve-lighthouse", metavar="BIND", help="run only a Lighthouse on BIND, e.g. '[::]:29510'"
    )
    parser.add_argument("--min-replicas", type=int, default=1, help="with --serve-lighthouse")
    parser.add_argument("--replica-id", type=int)
    parser.add_argument("--lighthouse", help="the Lighthouse address, e.g. http://host:29510")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--checkpoint-dir")
    defaults = ReplicaConfig(replica_id=0, lighthouse="", steps=1, checkpoint_dir="")
    for name in (
        "checkpoint_every",
        "keep_last",
        "num_replica_groups",
        "model_size",
        "seq_len",
        "batch_size",
        "lr",
        "seed",
        "data_source",
        "timeout_s",
        "quorum_timeout_s",
        "connect_timeout_s",
        "store_host",
        "progress",
        "threads",
    ):
        default = getattr(defaults, name)
        kind = str if default is None else type(default)
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=default)
    args = parser.parse_args(argv)
    if args.serve_lighthouse is None:
        missing = [
            f"--{n.replace('_', '-')}"
            for n in ("replica_id", "lighthouse", "steps", "checkpoint_dir")
            if getattr(args, n) is None
        ]
        if missing:
            parser.error(f"a replica needs {', '.join(missing)} (or run --serve-lighthouse BIND)")
    return args


def serve_lighthouse(bind: str, min_replicas: int) -> int:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    lighthouse = start_lighthouse(bind, min_replicas=min_replicas)
    print(json.dumps({"event": "lighthouse", "address": lighthouse.address()}), flush=True)
    try:
        while not stop.wait(0.5):
            pass
    except KeyboardInterrupt:
        pass
    finally:
        lighthouse.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_lighthouse is not None:
        return serve_lighthouse(args.serve_lighthouse, args.min_replicas)
    fields = {k: v for k, v in vars(args).items() if k not in ("serve_lighthouse", "min_replicas")}
    try:
        config = ReplicaConfig(**fields)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log = ProgressLog(config.replica_id, config.progress)
    worker = None
    try:
        worker = ReplicaWorker(config, log)
        # SIGTERM finishes the current step, waits for the checkpoint in flight and leaves cleanly.
        signal.signal(signal.SIGTERM, lambda *_: worker.stop_requested.set())
        worker.resume()
        step = worker.train()
        log.write("finished", step=step)
        return 0
    except Exception as e:  # a quorum that cannot form, a store that cannot bind: say so, exit non-zero
        log.write("failed", error=f"{type(e).__name__}: {e}"[:500])
        traceback.print_exc()  # the full story goes to stderr, next to torchft's own log
        return 1
    finally:
        if worker is not None:
            worker.close()
        log.close()


if __name__ == "__main__":
    sys.exit(main())
