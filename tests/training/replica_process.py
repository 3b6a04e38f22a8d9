"""A replica group's process: configuration and entry point for data-parallel training whose replicas
are torchft replica groups. The training is `loop.run_loop`, the one loop every stage uses, with a
`fault_tolerance.ReplicaGroup` passed in (quorum per step, gradients averaged across the groups,
`should_commit`, healing from a peer); this module only builds the model, data, optimizer and the
group, runs the loop, and writes what happens as progress lines.

Each replica group is one process here (group world size 1); the groups find each other through a
torchft Lighthouse (`--serve-lighthouse`, or `fault_tolerance.start_lighthouse` in process).

  - A group killed with SIGKILL stops heartbeating; the others keep stepping without it, in the same
    process (see `fault_tolerance`). A replacement resumes from its own latest checkpoint, then
    heals from a peer that is ahead and steps with it.
  - Checkpoints go through the loop's `Checkpointer` (async DCP, COMMITTED marker, pruning) into
    `<checkpoint-dir>/replica-<N>/step-XXXXXXXX/`, with the Manager's state beside the weights.
  - Data: group N of R draws batch number `step * R + N` (`BatchIterator.batch_at`), so the data
    position is a function of the committed step and is restored with it, by healing or resuming.
    While a group is missing its batches are skipped, not redone (torchft's per-group sampling).

Progress is written as JSON lines (stdout, or `--progress FILE`), one object per event:
  started    {pid, store_port}
  resumed    {step, path}                  own checkpoint loaded before joining
  healed     {step}                        state received from a peer; step is the peer's step
  step       {step, committed, loss, participants, checksum[, error]}   every attempt
  checkpoint {step, path, bytes}           a committed checkpoint (the loop's CheckpointSaved)
  log        {level, message}              the loop's log lines (a failed checkpoint among them)
  finished   {step} / failed {error}
Every object also has `event`, `replica_id` and `t` (Unix time).

Run (one Lighthouse, then one process per replica group):
  python -m tests.training.replica_process --serve-lighthouse '[::]:29510'
  python -m tests.training.replica_process --replica-id 0 --lighthouse http://HOST:29510 --steps 500 \
      --checkpoint-dir /tmp/ft
  python -m tests.training.replica_process --replica-id 1 --lighthouse http://HOST:29510 --steps 500 \
      --checkpoint-dir /tmp/ft
"""

import argparse
import json
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import TextIO

import torch

from contracts.models import MODEL_SHAPES
from contracts.runs import CheckpointSaved, LogLine, RunEvent
from tests.support import replica_seal
from training.data.corpora import BatchIterator, load_tokens
from training.engine.checkpoint import CHECKPOINT_DEFAULTS
from training.engine.fault_tolerance import (
    CONNECT_TIMEOUT_S,
    HEARTBEAT_TIMEOUT_MS,
    QUORUM_TIMEOUT_S,
    TIMEOUT_S,
    ReplicaGroup,
    replica_checkpoint_dir,
    start_lighthouse,
)
from training.engine.loop import LoopSettings, StepOutput, run_loop
from training.engine.reporting import Reporter
from training.model import Transformer

STAGE = "replicas"  # the stage name in the loop's log lines and metrics


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
    """Save every this many committed steps (and at the last one, and on a stop)."""
    keep_last: int = CHECKPOINT_DEFAULTS.keep_last
    """Committed checkpoints kept per replica group."""
    num_replica_groups: int = 2
    """R in the data layout `step * R + N`: the most groups that draw distinct batches."""
    model_size: str = "tiny"
    seq_len: int = 64  # short windows keep a step at tens of ms on one CPU core
    batch_size: int = 8
    lr: float = 1e-3
    grad_clip: float = 1.0
    """Clipped after the gradients are averaged across the groups, so every group clips alike."""
    seed: int = 0
    """Seeds the initial weights (identical in every group) and the batch stream."""
    data_source: str = "generated:arithmetic"
    timeout_s: float = TIMEOUT_S
    """Gloo collectives, should_commit, and the HTTP transfer of a healing checkpoint."""
    quorum_timeout_s: float = QUORUM_TIMEOUT_S
    """How long one quorum may take; must exceed the Lighthouse's heartbeat timeout."""
    connect_timeout_s: float = CONNECT_TIMEOUT_S
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
        if self.checkpoint_every < 1:
            raise ValueError("The checkpoint interval needs to be at least 1 step.")
        if self.num_replica_groups <= self.replica_id:
            raise ValueError("The number of replica groups needs to be larger than the replica id.")
        if self.model_size not in MODEL_SHAPES:
            raise ValueError(f"Unknown model size {self.model_size!r}: use one of {', '.join(MODEL_SHAPES)}.")
        if self.quorum_timeout_s * 1000 <= HEARTBEAT_TIMEOUT_MS:
            raise ValueError("The quorum timeout needs to be longer than the Lighthouse's heartbeat timeout.")


class ProgressLog:
    """JSON lines, one per event, flushed at once so a watcher sees them while the run goes on."""

    def __init__(self, replica_id: int, path: str | None):
        self.replica_id = replica_id
        self._out: TextIO = open(path, "a", encoding="utf-8") if path else sys.stdout
        self._owned = path is not None

    def write(self, event: str, /, **fields: object) -> None:
        record = {"event": event, "replica_id": self.replica_id, "t": round(time.time(), 3), **fields}
        self._out.write(json.dumps(record) + "\n")
        self._out.flush()

    def sink(self, event: RunEvent) -> None:
        """The loop's contract events as progress lines: checkpoints and log lines (a step's metrics
        are in its `step` line already)."""
        match event:
            case CheckpointSaved():
                self.write("checkpoint", step=event.step, path=event.path, bytes=event.bytes)
            case LogLine():
                self.write("log", level=event.level, message=event.message)

    def close(self) -> None:
        if self._owned:
            self._out.close()


def train_replica(config: ReplicaConfig, log: ProgressLog, stop: threading.Event) -> int:
    """Build this group's model, data, optimizer and torchft group, resume, and run the one training
    loop until `config.steps` committed steps or `stop`; returns the group's committed step."""
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)  # every group starts from the same weights
    tokens = load_tokens([config.data_source], seed=config.seed)
    batches = BatchIterator(tokens, seq_len=config.seq_len, batch_size=config.batch_size, seed=config.seed)
    model = Transformer(MODEL_SHAPES[config.model_size])
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    scheduler = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    directory = replica_checkpoint_dir(config.checkpoint_dir, config.replica_id)
    group = ReplicaGroup(
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        replica_id=config.replica_id,
        lighthouse=config.lighthouse,
        seal=replica_seal(config.replica_id),
        store_host=config.store_host,
        timeout_s=config.timeout_s,
        quorum_timeout_s=config.quorum_timeout_s,
        connect_timeout_s=config.connect_timeout_s,
        progress=log.write,
        debug_checksum=True,  # the tests compare the groups' weights and losses through these lines
    )
    groups, me = config.num_replica_groups, config.replica_id

    def step_fn(step: int) -> StepOutput:
        x, y = batches.batch_at(step * groups + me)
        _, loss = model(x, y)
        return StepOutput(loss=loss, tokens=x.numel())

    try:
        group.resume(directory)
        settings = LoopSettings(
            stage=STAGE,
            steps=config.steps,
            checkpoint_dir=str(directory),
            checkpoint_interval=config.checkpoint_every,
            keep_last=config.keep_last,
            grad_clip=config.grad_clip,
        )
        result = run_loop(
            settings,
            model,
            optimizer,
            scheduler,
            step_fn,
            Reporter(log.sink, run_id=f"replica-{me}"),
            stop.is_set,
            start_step=group.step,
            position=lambda: group.step * groups + me,
            fault_tolerance=group,
        )
        return result.final_step
    finally:
        group.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.training.replica_process", description=__doc__.split("\n")[0]
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
        "grad_clip",
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
    stop = threading.Event()
    # SIGTERM finishes the current step, commits a checkpoint of it and leaves cleanly.
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        step = train_replica(config, log, stop)
        log.write("finished", step=step)
        return 0
    except Exception as e:  # a quorum that cannot form, a store that cannot bind: say so, exit non-zero
        log.write("failed", error=f"{type(e).__name__}: {e}"[:500])
        traceback.print_exc()  # the full story goes to stderr, next to torchft's own log
        return 1
    finally:
        log.close()


if __name__ == "__main__":
    sys.exit(main())
