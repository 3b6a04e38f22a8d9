"""One node's share of a multi-node run: this agent's process is one torchft replica group.

A run booked on N nodes is N work items (services/scheduler/handoff.py), one per node, each leased
by one trainer agent. Data parallelism across the nodes is torchft's (`fault_tolerance.ReplicaGroup`,
replica id = node rank): the nodes need no shared c10d rendezvous, only a Lighthouse. Node 0 hosts
the run's rendezvous store at the endpoint the scheduler put in the work item (`TrainWork.rendezvous`)
and, per stage, a Lighthouse on its loopback behind a sealed relay (launch/lighthouse_relay.py), whose
address it publishes there; every node reads it, dials it through a sealed entry of its own, waits (bounded)
for the others so that they start together, and trains the stage with the same loop as any run,
its group passed in (`stage_run.Replicas`). A node lost mid-stage does not stop the others (they go
on without it after the Lighthouse's heartbeat timeout); its replacement resumes from its own
checkpoint and heals from a peer.

What each node keeps apart: its checkpoints (`node_checkpoint_dir`), its lease, its log. Node 0's
reporter is the run's (events to the bus); the others write a per-node log file and publish nothing
(see the worker). Node 0 hosts the rendezvous and the Lighthouse, so losing node 0 interrupts the run
(its lease lapses and the scheduler's watcher marks it interrupted, as for a one-node run).

A node of several GPUs (the plan's hsdp {dp_replicate: nodes, dp_shard: gpus_per_node}) trains its
share on a gang of its ranks under torchrun (launch/elastic.py), FSDP2 over them; the gang's ranks together
are the node's replica group (launch.rank.replicas: each rank's Manager with the gang's rank, world
size and store), and torchft averages each rank's gradient shards over the groups. A gang that
starts late, or replaces a lost one, heals rank by rank from the same rank of a peer gang (its local
shards; see fault_tolerance).

Post-training trains the same way (`NodeShare.train_post`): each node's share is its replica group
(its process, or its gang with a `replica_group` in the gang's job). SFT and DPO: the groups
split the global batch and each group's ranks its share, token means over the global batch
(training/recipes/posttrain.py). RLVR: rank 0 of each group runs one rollout worker and samples the
group's share of the step's prompts (prompts of its own), and the token mean is over every group's
kept tokens (training/recipes/rlvr.py); its prompts per step must split over the nodes (`refusal`).

The custom-data ladder: node 0 alone runs the proxy runs and publishes its decision in the
rendezvous store; the other nodes wait for it there and record it as their own (`NodeShare.ladder`),
so every node trains the same data whatever its hardware's numerics (two nodes deciding alone could
differ at the threshold; the checkpoint root is not shared across hosts).
"""

import os
import pathlib
import time
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlparse

import msgspec
import torch
from torch.optim.lr_scheduler import LambdaLR

from contracts.manifest import DpoStage, Manifest, RlvrStage, SftStage
from contracts.runs import TrainWork
from domain.curriculum import Curriculum, LadderPlan, LmPlan, PostPlan
from runtime.configuration.settings import DEFAULT_NODE_HOST, ENV_NODE_HOST
from runtime.configuration.settings import ENV_MULTINODE_GANGS as ENV_MULTINODE_GANGS  # tests flip it
from training.engine.distributed import ParallelDims, ParallelismError
from training.engine.fault_tolerance import ReplicaGroup, start_lighthouse
from training.engine.heal_transport import Seal, heal_key
from training.engine.reporting import Reporter
from training.launch.elastic import Gang
from training.launch.lighthouse_relay import Entry, Relay, relay_key
from training.launch.rank import ReplicaJob
from training.launch.rendezvous import RendezvousClient, RendezvousServer, store_key
from training.recipes.data_ladder import (
    LadderDecision,
    record_decision,
    recorded_decision,
    run_ladder,
)
from training.recipes.posttrain import PostConfig, PostResult
from training.recipes.pretrain import StageConfig, StageResult, train_stage
from training.recipes.rlvr import RlvrResult, train_post
from training.recipes.stage_run import Replicas

T = TypeVar("T")

CONNECT_TIMEOUT_S = 60.0  # a follower waits this long for node 0's store (node 0 may still be preparing data)
MEET_TIMEOUT_S = 60.0  # past this a node trains without the missing ones (torchft takes them in later)
DONE_GRACE_S = 30.0  # node 0 keeps a stage's Lighthouse up this long for nodes still finishing it
POLL_S = 0.1
LADDER_KEY = "ladder:decision"  # node 0's ladder decision (msgspec JSON) in the rendezvous store


def node_checkpoint_dir(run_dir: pathlib.Path, node_rank: int) -> pathlib.Path:
    """Node 0 keeps the run's directory; node n > 0 a `node-<n>` directory inside it (two agents on
    one machine share the checkpoint root)."""
    return run_dir if node_rank == 0 else run_dir / f"node-{node_rank}"


def refusal(work: TrainWork, manifest: Manifest, run_plan: Curriculum) -> str | None:
    """Why this node cannot train its share, or None."""
    nodes, gpn = manifest.resources.nodes, manifest.resources.gpus_per_node
    if work.nodes != nodes or not 0 <= work.node_rank < nodes:
        return f"The work item's node {work.node_rank} of {work.nodes} does not match the manifest's {nodes} nodes."
    if not work.rendezvous:
        return f"The work item for {nodes} nodes names no rendezvous endpoint."
    if not work.rendezvous_key:
        return (
            f"The work item for {nodes} nodes carries no rendezvous key (node 0's store admits only its run)."
        )
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
    for stage in run_plan.stages:
        if isinstance(stage, PostPlan) and isinstance(stage.section, RlvrStage):
            if stage.section.prompts_per_step % nodes:
                return (
                    f"rlvr's {stage.section.prompts_per_step} prompts per step do not split evenly over "
                    f"{nodes} nodes (each node samples its share)."
                )
    for stage in run_plan.stages:
        batch = (
            stage.batch_size
            if isinstance(stage, LmPlan)
            else stage.section.batch_size
            if isinstance(stage.section, SftStage | DpoStage)
            else 0
        )
        if batch % dims.dp_degree:
            return (
                f"The global batch of {batch} does not split evenly over {dims.dp_degree} "
                f"data-parallel ranks ({nodes} nodes of {gpn})."
            )
    return None


def node_gang(work: TrainWork) -> ParallelDims | None:
    """This node's ranks when it has more than one: FSDP2 over its GPUs (the replica group's
    gang); None for one rank per node (the agent's process is the group)."""
    shard = ParallelDims.from_plan(work.plan.strategy, work.plan.degrees).dp_shard
    return ParallelDims(strategy="fsdp2", dp_shard=shard) if shard > 1 else None


class Rendezvous:
    """The run's rendezvous store: node 0 hosts it, every node (node 0 too) connects with the run's
    key and its lease epoch (launch/rendezvous.py: nothing else gets in). Per stage: the stage's
    Lighthouse's relay address (node 0 starts both) and two counters, `joined` and `done`."""

    def __init__(self, work: TrainWork, epoch: int) -> None:
        host, _, port = work.rendezvous.rpartition(":")
        self.host, self.node_rank, self.nodes = host, work.node_rank, work.nodes
        key = store_key(work.rendezvous_key, work.run_id)
        self.server = (
            RendezvousServer(host.strip("[]"), int(port), work.run_id, key) if work.node_rank == 0 else None
        )
        self.store = RendezvousClient(
            work.rendezvous, key, work.run_id, work.node_rank, epoch, timeout_s=CONNECT_TIMEOUT_S
        )
        self.run_id, self.epoch = work.run_id, epoch
        self.relay_key = relay_key(work.rendezvous_key, work.run_id)  # never logged
        self.lighthouses: dict[str, list[Callable[[], object]]] = {}  # a stage's: what to stop at its end

    def lighthouse(self, stage: str) -> str:
        """The stage's Lighthouse, as this node's replica group dials it. Node 0 starts one on its
        loopback with a sealed relay in front (launch/lighthouse_relay.py) and publishes the relay's
        address; the others read it (waiting up to CONNECT_TIMEOUT_S) and dial it through a sealed
        entry on their own loopback."""
        key = f"{stage}:lighthouse"
        if self.node_rank == 0:
            server = start_lighthouse("127.0.0.1:0")
            port = urlparse(server.address()).port
            assert port is not None, "a started Lighthouse has a port"
            relay = Relay(self.host.strip("[]"), port, self.relay_key, self.run_id)
            self.lighthouses[stage] = [relay.close, server.shutdown]
            self.store.set(key, relay.address)
            return f"http://127.0.0.1:{port}"
        entry = Entry(self.store.get(key).decode(), self.relay_key, self.run_id, self.node_rank, self.epoch)
        self.lighthouses[stage] = [entry.close]
        return entry.lighthouse

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
        for stop in self.lighthouses.pop(stage, []):
            stop()

    def close(self) -> None:
        for stage in list(self.lighthouses):
            self.end_stage(stage)
        self.store.close()
        if self.server is not None:
            self.server.close()


class NodeShare:
    """Trains this node's share of each next-token stage and of SFT and DPO, and takes node 0's
    ladder decision (the pipeline's `Trainers`); `close` when the pipeline is over. The rendezvous is opened on the training thread at the first stage (a
    follower's connect waits for node 0)."""

    def __init__(
        self, work: TrainWork, run_dir: pathlib.Path | None = None, threads: int = 1, epoch: int = 0
    ) -> None:
        """`run_dir` and `threads`: where this node's gang keeps its files and how many CPU threads
        its ranks share, when the node has several ranks (`node_gang`); `epoch`: this node's lease
        epoch, which it presents to node 0's store (a fenced holder's is refused)."""
        self.work, self.epoch = work, epoch
        self.run_dir, self.threads = run_dir, threads
        self.gang_dims = node_gang(work)
        self.node_rank, self.nodes = work.node_rank, work.nodes
        self.node_host = os.environ.get(ENV_NODE_HOST) or DEFAULT_NODE_HOST
        # the healing transfers between the nodes' groups, behind the run's key (never logged)
        self.seal = Seal(
            key=heal_key(work.rendezvous_key, work.run_id),
            run_id=work.run_id,
            replica_id=work.node_rank,
            epoch=epoch,
        )
        self._rendezvous: Rendezvous | None = None

    def close(self) -> None:
        if self._rendezvous is not None:
            self._rendezvous.close()
            # Node 0's store stops listening with its last reference: a restart or a redelivery of
            # the run hosts the same endpoint again (in this process too) and must find it free.
            self._rendezvous = None

    def _open(self) -> Rendezvous:
        if self._rendezvous is None:
            self._rendezvous = Rendezvous(self.work, self.epoch)
        return self._rendezvous

    def train_stage(self, cfg: StageConfig, report: Reporter, should_stop: Any) -> StageResult:
        """A next-token stage as this node's replica group (the pipeline's `Trainers.lm`)."""

        def on_gang(gang: Gang) -> StageResult:
            return gang.train_stage(cfg, report, should_stop)

        def here(replicas: Replicas) -> StageResult:
            return train_stage(cfg, report, should_stop, replicas)

        return self._as_group(cfg.stage, report, on_gang, here)

    def train_post(self, cfg: PostConfig, report: Reporter, should_stop: Any) -> PostResult | RlvrResult:
        """SFT, DPO or RLVR as this node's replica group (the pipeline's `Trainers.post`)."""

        def on_gang(gang: Gang) -> PostResult | RlvrResult:
            return gang.train_post(cfg, report, should_stop)

        def here(replicas: Replicas) -> PostResult | RlvrResult:
            return train_post(cfg, report, should_stop, replicas)

        return self._as_group(cfg.stage, report, on_gang, here)

    def ladder(
        self, plan: LadderPlan, *, directory: Any, should_stop: Any, **kwargs: Any
    ) -> LadderDecision | None:
        """The ladder's decision (the pipeline's `Trainers.ladder`): node 0 runs the proxies (or reads
        its record) and publishes the decision in the rendezvous store; the others wait for it there
        (as long as node 0's store is up and no stop is asked) and record it as their own, so that
        every node trains the same data. None when stopped."""
        rdzv = self._open()
        if self.node_rank == 0:
            decision = run_ladder(plan, directory=directory, should_stop=should_stop, **kwargs)
            if decision is not None:
                rdzv.store.set(LADDER_KEY, msgspec.json.encode(decision).decode())
            return decision
        if (recorded := recorded_decision(pathlib.Path(directory))) is not None:
            return recorded  # a replaced node's: node 0 publishes only when it decides (or re-reads)
        while not rdzv.store.check([LADDER_KEY]):
            if should_stop():
                return None
            time.sleep(POLL_S)
        decision = msgspec.json.decode(rdzv.store.get(LADDER_KEY), type=LadderDecision)
        record_decision(pathlib.Path(directory), decision)
        return decision

    def _as_group(
        self, stage: str, report: Reporter, on_gang: Callable[[Gang], T], here: Callable[[Replicas], T]
    ) -> T:
        """Meet the other nodes at the stage's Lighthouse and train it as replica group `node_rank`:
        on this node's gang (`on_gang`) or in this process (`here`)."""
        rdzv = self._open()
        lighthouse = rdzv.lighthouse(stage)
        met = rdzv.meet(stage, "joined", MEET_TIMEOUT_S)
        report.log(
            f"{stage}: node {self.node_rank} of {self.nodes} joins as replica group {self.node_rank} "
            f"({min(met, self.nodes)} of {self.nodes} nodes met; Lighthouse {lighthouse})"
        )
        gang = self.gang_dims
        report.parallelism(
            stage=stage,
            strategy=self.work.plan.strategy,
            world_size=self.nodes * (gang.world_size if gang else 1),
            mesh={"dp_replicate": self.nodes, **({"dp_shard": gang.dp_shard} if gang else {})},
        )
        try:
            if gang is not None:  # this node's ranks under torchrun are the group (launch.rank.replicas)
                assert self.run_dir is not None, "a node of several ranks needs its run directory"
                group = ReplicaJob(
                    replica_id=self.node_rank,
                    groups=self.nodes,
                    lighthouse=lighthouse,
                    seal=self.seal,
                    host=self.node_host,
                )
                return on_gang(Gang(gang, self.run_dir, self.threads, group))

            def progress(event: str, /, **fields: object) -> None:
                if event in ("resumed", "healed"):  # every step's line would flood the log
                    report.log(
                        f"{stage}: replica group {self.node_rank} {event} at step {fields.get('step')}"
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
                    seal=self.seal,
                    store_host=self.node_host,
                    progress=progress,
                    expected_groups=self.nodes,  # the first step waits (bounded) for every node
                )

            return here(Replicas(replica_id=self.node_rank, groups=self.nodes, join=join))
        finally:
            rdzv.meet(stage, "done", DONE_GRACE_S if self.node_rank == 0 else 0.0)
            rdzv.end_stage(stage)
