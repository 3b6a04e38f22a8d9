"""One node's share of a multi-node run: this agent's process is one torchft replica group.

A run booked on N nodes is N work items (services/scheduler/handoff.py), one per node, each leased
by one trainer agent. Data parallelism across the nodes is torchft's (`fault_tolerance.ReplicaGroup`,
replica id = node rank): the nodes need no shared c10d rendezvous, only a Lighthouse. Node 0 hosts
the run's rendezvous store at the endpoint the scheduler put in the work item (`TrainWork.rendezvous`)
and, per stage, a Lighthouse whose address it publishes there; every node reads it, waits (bounded)
for the others so that they start together, and trains the stage with the same loop as any run,
its group passed in (`pretrain.Replicas`). A node lost mid-stage does not stop the others (they go
on without it after the Lighthouse's heartbeat timeout); its replacement resumes from its own
checkpoint and heals from a peer.

What each node keeps apart: its checkpoints (`node_checkpoint_dir`), its lease, its log. Node 0's
reporter is the run's (events to the bus); the others write a per-node log file and publish nothing
(see the worker). Node 0 hosts the rendezvous and the Lighthouse, so losing node 0 interrupts the run
(its lease lapses and the scheduler's watcher marks it interrupted, as for a one-node run).

A node of several GPUs (the plan's hsdp {dp_replicate: nodes, dp_shard: gpus_per_node}) trains its
share on a gang of its ranks under torchrun (gang.py), FSDP2 over them; the gang's ranks together
are the node's replica group (rank_main.replicas: each rank's Manager with the gang's rank, world
size and store), and torchft averages each rank's gradient shards over the groups. A gang that
starts late, or replaces a lost one, heals rank by rank from the same rank of a peer gang (its local
shards; see fault_tolerance).

Not yet: stages other than next-token ones; refused in a sentence (`refusal`).
"""

import os
import pathlib
import time
from datetime import timedelta
from typing import Any, Final
from urllib.parse import urlparse

import torch
from torch.distributed import TCPStore
from torch.optim.lr_scheduler import LambdaLR

from contracts.manifest import Manifest
from contracts.runs import TrainWork
from services.domain.curriculum import LmPlan, PostPlan, RunPlan
from services.trainer.distributed import ParallelDims, ParallelismError
from services.trainer.fault_tolerance import ReplicaGroup, start_lighthouse
from services.trainer.gang import Gang
from services.trainer.pretrain import Replicas, StageConfig, StageResult, train_stage
from services.trainer.rank_main import ReplicaJob
from services.trainer.reporting import Reporter

ENV_NODE_HOST: Final = "ITO_NODE_HOST"
# The operator switch that let several GPUs per node on several nodes train while such plans were
# refused by default (a late group's heal from its peer failed with FSDP2 state; fixed in
# fault_tolerance: a synchronous quorum, local shards). They train by default now; the variable is
# still accepted and changes nothing.
ENV_MULTINODE_GANGS: Final = "ITO_MULTINODE_GANGS"
DEFAULT_NODE_HOST = "127.0.0.1"  # where this node's replica group store is reached; routable across hosts
CONNECT_TIMEOUT_S = 60.0  # a follower waits this long for node 0's store (node 0 may still be preparing data)
MEET_TIMEOUT_S = 60.0  # past this a node trains without the missing ones (torchft takes them in later)
DONE_GRACE_S = 30.0  # node 0 keeps a stage's Lighthouse up this long for nodes still finishing it
POLL_S = 0.1


def node_checkpoint_dir(run_dir: pathlib.Path, node_rank: int) -> pathlib.Path:
    """Node 0 keeps the run's directory; node n > 0 a `node-<n>` directory inside it (two agents on
    one machine share the checkpoint root)."""
    return run_dir if node_rank == 0 else run_dir / f"node-{node_rank}"


def refusal(work: TrainWork, manifest: Manifest, run_plan: RunPlan) -> str | None:
    """Why this node cannot train its share, or None."""
    nodes, gpn = manifest.resources.nodes, manifest.resources.gpus_per_node
    if work.nodes != nodes or not 0 <= work.node_rank < nodes:
        return f"The work item's node {work.node_rank} of {work.nodes} does not match the manifest's {nodes} nodes."
    if not work.rendezvous:
        return f"The work item for {nodes} nodes names no rendezvous endpoint."
    try:
        dims = ParallelDims.from_plan(work.plan.strategy, work.plan.degrees)
    except ParallelismError as e:
        return f"The plan for {nodes} nodes does not fit: {e}"
    if dims.dp_replicate != nodes or dims.tp != 1 or dims.dp_shard != gpn:
        return (
            f"The plan {dims.strategy} {dims.degrees()} does not lay {nodes} nodes of {gpn} GPUs out as "
            "replica groups (dp_replicate the nodes, dp_shard the GPUs of each)."
        )
    if gpn > 1 and torch.cuda.is_available() and torch.cuda.device_count() < gpn:
        return f"The plan needs {gpn} GPUs on each node; this node has {torch.cuda.device_count()}."
    post = [s.name for s in run_plan.stages if isinstance(s, PostPlan)]
    if post or (run_plan.ladder is not None and run_plan.ladder.custom):
        names = ", ".join(
            (["ladder"] if run_plan.ladder is not None and run_plan.ladder.custom else []) + post
        )
        return (
            f"A run on {nodes} nodes cannot run {names} yet: only next-token stages (pretrain, midtrain, "
            "long_context) train as replica groups; book one node for the others."
        )
    for stage in run_plan.stages:
        if isinstance(stage, LmPlan) and stage.batch_size % dims.dp_degree:
            return (
                f"The global batch of {stage.batch_size} does not split evenly over {dims.dp_degree} "
                f"data-parallel ranks ({nodes} nodes of {gpn})."
            )
    return None


def node_gang(work: TrainWork) -> ParallelDims | None:
    """This node's ranks when it has more than one: FSDP2 over its GPUs (the replica group's
    gang); None for one rank per node (the agent's process is the group)."""
    shard = ParallelDims.from_plan(work.plan.strategy, work.plan.degrees).dp_shard
    return ParallelDims(strategy="fsdp2", dp_shard=shard) if shard > 1 else None


class Rendezvous:
    """The run's rendezvous store: node 0 hosts it, the others connect. Per stage: the stage's
    Lighthouse address (node 0 starts it) and two counters, `joined` and `done`."""

    def __init__(self, endpoint: str, node_rank: int, nodes: int) -> None:
        host, _, port = endpoint.rpartition(":")
        self.host, self.node_rank, self.nodes = host, node_rank, nodes
        self.store = TCPStore(
            host,
            int(port),
            is_master=node_rank == 0,
            wait_for_workers=False,
            timeout=timedelta(seconds=CONNECT_TIMEOUT_S),
        )
        self.lighthouses: dict[str, Any] = {}

    def lighthouse(self, stage: str) -> str:
        """The stage's Lighthouse address: node 0 starts one and publishes it; the others read it
        (waiting up to CONNECT_TIMEOUT_S)."""
        key = f"{stage}:lighthouse"
        if self.node_rank == 0:
            server = self.lighthouses[stage] = start_lighthouse("[::]:0")
            address = f"http://{self.host}:{urlparse(server.address()).port}"
            self.store.set(key, address)
            return address
        return self.store.get(key).decode()

    def meet(self, stage: str, what: str, timeout_s: float) -> int:
        """Count this node in `what` and wait until every node has, or `timeout_s`; the count seen."""
        key = f"{stage}:{what}"
        count = int(self.store.add(key, 1))
        deadline = time.monotonic() + timeout_s
        while count < self.nodes and time.monotonic() < deadline:
            time.sleep(POLL_S)
            count = int(self.store.add(key, 0))
        return count

    def end_stage(self, stage: str) -> None:
        server = self.lighthouses.pop(stage, None)
        if server is not None:
            server.shutdown()

    def close(self) -> None:
        for stage in list(self.lighthouses):
            self.end_stage(stage)


class NodeShare:
    """Trains this node's share of each next-token stage (the pipeline's `train_lm`); `close` when
    the pipeline is over. The rendezvous is opened on the training thread at the first stage (a
    follower's connect waits for node 0)."""

    def __init__(self, work: TrainWork, run_dir: pathlib.Path | None = None, threads: int = 1) -> None:
        """`run_dir` and `threads`: where this node's gang keeps its files and how many CPU threads
        its ranks share, when the node has several ranks (`node_gang`)."""
        self.work = work
        self.run_dir, self.threads = run_dir, threads
        self.gang_dims = node_gang(work)
        self.node_rank, self.nodes = work.node_rank, work.nodes
        self.node_host = os.environ.get(ENV_NODE_HOST) or DEFAULT_NODE_HOST
        self._rendezvous: Rendezvous | None = None

    def close(self) -> None:
        if self._rendezvous is not None:
            self._rendezvous.close()
            # Node 0's store stops listening with its last reference: a restart or a redelivery of
            # the run hosts the same endpoint again (in this process too) and must find it free.
            self._rendezvous = None

    def train_stage(self, cfg: StageConfig, report: Reporter, should_stop: Any) -> StageResult:
        if self._rendezvous is None:
            self._rendezvous = Rendezvous(self.work.rendezvous, self.node_rank, self.nodes)
        rdzv = self._rendezvous
        lighthouse = rdzv.lighthouse(cfg.stage)
        met = rdzv.meet(cfg.stage, "joined", MEET_TIMEOUT_S)
        report.log(
            f"{cfg.stage}: node {self.node_rank} of {self.nodes} joins as replica group {self.node_rank} "
            f"({min(met, self.nodes)} of {self.nodes} nodes met; Lighthouse {lighthouse})"
        )
        gang = self.gang_dims
        report.parallelism(
            stage=cfg.stage,
            strategy=self.work.plan.strategy,
            world_size=self.nodes * (gang.world_size if gang else 1),
            mesh={"dp_replicate": self.nodes, **({"dp_shard": gang.dp_shard} if gang else {})},
        )
        if gang is not None:  # this node's ranks under torchrun are the group (rank_main.replicas)
            assert self.run_dir is not None, "a node of several ranks needs its run directory"
            group = ReplicaJob(replica_id=self.node_rank, groups=self.nodes, lighthouse=lighthouse)
            try:
                return Gang(gang, self.run_dir, self.threads, group).train_stage(cfg, report, should_stop)
            finally:
                rdzv.meet(cfg.stage, "done", DONE_GRACE_S if self.node_rank == 0 else 0.0)
                rdzv.end_stage(cfg.stage)

        def progress(event: str, /, **fields: object) -> None:
            if event in ("resumed", "healed"):  # every step's line would flood the log
                report.log(
                    f"{cfg.stage}: replica group {self.node_rank} {event} at step {fields.get('step')}"
                )

        def join(
            model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: LambdaLR
        ) -> ReplicaGroup:
            return ReplicaGroup(
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                replica_id=self.node_rank,
                lighthouse=lighthouse,
                store_host=self.node_host,
                progress=progress,
                expected_groups=self.nodes,  # the first step waits (bounded) for every node
            )

        try:
            replicas = Replicas(replica_id=self.node_rank, groups=self.nodes, join=join)
            return train_stage(cfg, report, should_stop, replicas)
        finally:
            rdzv.meet(cfg.stage, "done", DONE_GRACE_S if self.node_rank == 0 else 0.0)
            rdzv.end_stage(cfg.stage)
