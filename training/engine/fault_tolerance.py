"""Replica-group fault tolerance with torchft: the component `loop.run_loop` uses when a run's
data-parallel replicas are torchft replica groups (`ReplicaGroup`), and the Lighthouse they meet at.

This module owns one replica group's torchft `Manager` (its per-group TCPStore, its process group:
`ProcessGroupNCCL` on cuda, `ProcessGroupGloo` on CPU (`replica_process_group`), the Lighthouse address, the state a healing peer receives) and the hooks the one training loop calls
around its step; it has no loop of its own. Per optimizer step the loop calls:
  start_step(before_heal) before the forward pass: `Manager.start_quorum`, waited for (and, when
                          this group heals, `before_heal()` and then the peer's state loaded)
  reduce_gradients(ps)    after backward: every gradient averaged over the quorum with
                          `Manager.allreduce`, one per bucket of ~BUCKET_BYTES (a failed all-reduce is recorded in the Manager, never
                          raised, so a peer dying mid-step does not kill this group)
  should_commit()         at the optimizer step: `Manager.should_commit`; the loop steps the optimizer
                          and the schedule only on True, and otherwise tries the same step again
  end_step(loss, ...)     after it: the group's committed step (it jumps when the group healed) and
                          the progress line (its loss and weights checksum only with `debug_checksum`:
                          each is a device sync, the checksum a host copy of every parameter)
  checkpoint_module()     what a checkpoint holds: the model plus the Manager's progress

What torchft gives through these hooks:
  - Every step asks the Lighthouse for a quorum. A replica group killed with SIGKILL stops
    heartbeating; after the Lighthouse's heartbeat timeout the others form a quorum without it and
    keep stepping. The step in flight when the peer died fails its all-reduce, is not committed and is
    tried again; nothing crashes and nothing restarts.
  - Groups started together meet at their first step: `start_step` asks for quorums (taking no
    step) until `expected_groups` are in one, at most MEET_QUORUMS of them; at step 0 torchft then
    syncs every group to one of them (its initial sync is a heal). Without this, a gang that starts
    a few seconds sooner trains alone, and a short stage may end before the other joins.
  - A replacement (or a group that starts late) joins the next quorum behind the others' step;
    torchft heals it by fetching the model, optimizer and schedule state from a peer
    (`_peer_state` there, `_load_peer_state` here) over the sealed transport: only a group of the
    same run, holding its key, gets a byte, and what arrives is loaded without pickle
    (training/engine/heal_transport.py), and from then on they step together with the
    same weights.
  - The quorum is synchronous (`start_step` waits for it, `use_async_quorum=False`): torchft reads
    the state a peer heals from on its quorum thread, and with FSDP2 that read is only safe while
    the training thread is not inside a forward or backward pass. `Module.state_dict()` runs FSDP2's
    pre-save hook, which reshards the module in place: called mid-forward it frees the unsharded
    parameters under the running pass (the sender's ranks then crash, and the healing group reads
    a truncated stream: torchft's `recv_checkpoint` EOFError). So the sender's state is read while
    its training thread waits in `start_step`, and a healing group loads what it received there too,
    before its forward: it is a full member of the step in which it heals.
  - What travels is each rank's own shards as plain tensors (DTensor -> `to_local()`), never a
    pickled DTensor or device mesh: rank r of a healing gang fetches from rank r of its peer (torchft
    pairs the same group rank), whose mesh and shards are the same, and lays them back out on its
    own parameters' layout (`_like`). A group of one rank sends its whole tensors the same way.
  - `Manager.state_dict()` ({step, batches_committed}) travels in the same DCP snapshot as the model,
    as two int64 buffers under `torchft.*` (see `CheckpointView`): no pickle in the checkpoint, and
    a plain `Transformer` still loads the weights with `load_weights`.

A group is one process (group rank 0 of 1, hosting its own TCPStore), or a gang of ranks under
torchrun (`GangStore`: the gang's rank and world size, and the store torchrun's agent hosts). In a
gang each rank's Manager averages its own gradients over the same rank of the other groups: with
FSDP2 inside the gang these are the local shards after FSDP's reduce-scatter (HSDP with torchft
as the replicate dimension).
"""

import hashlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed import ReduceOp, TCPStore
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only
from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
from torchft.process_group import ProcessGroup

from training.engine.checkpoint_load import ResumeState, load_latest
from training.engine.heal_transport import Seal, SealedTransport

# Lighthouse defaults. torchft's own are 5 s heartbeat and 60 s join timeouts, sized for clusters;
# these are sized for a few processes on one host, so a kill is noticed in ~2 s.
HEARTBEAT_TIMEOUT_MS = 2_000  # a silent replica leaves the quorum after this; raise on a loaded host
JOIN_TIMEOUT_MS = 1_000  # how long a quorum waits for heartbeating replicas that have not asked yet
QUORUM_TICK_MS = 100  # how often the Lighthouse re-checks a pending quorum

# Manager defaults (torchft's are 60 s each): a dead peer turns into a skipped step within seconds.
TIMEOUT_S = 5.0  # the least for collectives and should_commit (`collective_timeout_s` sizes it up)
# The slowest link a replica group's gradient all-reduce is assumed to cross: ~1 GB/s, a 10 Gb/s
# Ethernet between nodes (InfiniBand or NVLink are 10-400x faster). A ring all-reduce moves about
# twice the gradient bytes through each rank's link.
SLOW_BANDWIDTH_BYTES_S = 1e9
# Gradients are averaged in flat buckets of about this size, one all-reduce each (DDP's default is
# 25 MB): a few large messages instead of one per parameter keep a 1B model's step at a few dozen
# collectives, and a bucket stays small beside the gradients themselves (one extra copy at a time).
BUCKET_BYTES = 32 * 2**20
# A healing checkpoint's HTTP transfer (and the sender's lock on its state while it is read): one
# rank's shards of model and optimizer, ~0.5 GB for a 1B model on 8 ranks, seconds on a data-centre
# NIC; torchft would bound it by TIMEOUT_S, which a large model's transfer outlasts.
TRANSFER_TIMEOUT_S = 300.0
QUORUM_TIMEOUT_S = 15.0  # one quorum; must exceed the Lighthouse's heartbeat timeout
CONNECT_TIMEOUT_S = 5.0
# A group's first step waits, quorum after quorum, for the other groups to join (bounded), so that
# groups started together train together from their first step instead of one running ahead alone
# and the other healing from it later. Counted in quorums, not seconds: every rank of a gang sees the
# same quorums, so all of them stop waiting at the same one.
MEET_QUORUMS = 60  # ~30 s at MEET_POLL_S (gangs start seconds apart); then it trains with whoever is there
MEET_POLL_S = 0.5


@dataclass(frozen=True, slots=True, kw_only=True)
class GangStore:
    """Where a replica group's ranks meet: this rank, the group's size, its TCPStore."""

    rank: int
    world_size: int
    host: str
    port: int


class Progress(Protocol):
    """Where the group's progress lines go: an event name and its fields."""

    def __call__(self, event: str, /, **fields: object) -> None: ...


def start_lighthouse(
    bind: str = "[::]:0",
    *,
    min_replicas: int = 1,
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
    join_timeout_ms: int = JOIN_TIMEOUT_MS,
    quorum_tick_ms: int = QUORUM_TICK_MS,
) -> Any:
    """A torchft Lighthouse in this process (a Rust server on its own threads). Its `address()` is
    what replica groups get as their Lighthouse; call `shutdown()` to stop it."""
    from torchft.coordination import LighthouseServer

    return LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )


class ManagerProgress(nn.Module):
    """`Manager.state_dict()` as two persistent int64 buffers, so DCP saves and loads it as tensors."""

    step: torch.Tensor  # buffers (register_buffer below), declared for the type checker
    batches_committed: torch.Tensor

    def __init__(self) -> None:
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
        local = p.detach()
        local = local.to_local() if hasattr(local, "to_local") else local  # a shard: this rank's
        digest.update(local.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def replica_pg_kind(device_type: str) -> type[ProcessGroup]:
    """The process group a replica group's Manager averages over: NCCL for gradients on cuda (Gloo
    would copy every gradient through the host), Gloo on CPU."""
    kinds: dict[str, type[ProcessGroup]] = {"cuda": ProcessGroupNCCL, "cpu": ProcessGroupGloo}
    if device_type not in kinds:
        raise ValueError(f"Replica groups run on {' or '.join(kinds)}, not {device_type}.")
    return kinds[device_type]


def replica_process_group(device_type: str, timeout: timedelta) -> ProcessGroup:
    return replica_pg_kind(device_type)(timeout=timeout)  # type: ignore[call-arg]


def collective_timeout_s(
    gradient_bytes: int,
    *,
    least_s: float = TIMEOUT_S,
    bandwidth_bytes_s: float = SLOW_BANDWIDTH_BYTES_S,
    slack_s: float = TIMEOUT_S,
) -> float:
    """How long the Manager's collectives may take: a ring all-reduce of `gradient_bytes` (twice
    the bytes through each link) at the assumed slow bandwidth plus slack, never under `least_s`.
    A fixed 5 s would time out every step of a model whose gradients outlast it on the wire."""
    return max(least_s, 2 * gradient_bytes / bandwidth_bytes_s + slack_s)


def gradient_bytes(model: nn.Module) -> int:
    """The bytes of this rank's gradients (its local shards under FSDP2): one per parameter."""
    total = 0
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        total += local.numel() * local.element_size()
    return total


def gradient_buckets(grads: list[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Indices of `grads` in buckets: same dtype and device within a bucket, at most `bucket_bytes`
    per bucket (a larger gradient is a bucket of its own), in order within each dtype and device."""
    buckets: list[list[int]] = []
    open_bucket: dict[tuple[torch.dtype, torch.device], tuple[list[int], int]] = {}
    for i, g in enumerate(grads):
        key, size = (g.dtype, g.device), g.numel() * g.element_size()
        current = open_bucket.get(key)
        if current is None or current[1] + size > bucket_bytes:
            buckets.append([i])
            open_bucket[key] = (buckets[-1], size)
        else:
            current[0].append(i)
            open_bucket[key] = (current[0], current[1] + size)
    return buckets


class Averager(Protocol):
    """What `average_in_buckets` needs of a torchft Manager: an in-place averaging all-reduce."""

    def allreduce(self, tensor: torch.Tensor) -> Any: ...


def average_in_buckets(
    manager: Averager, grads: list[torch.Tensor], bucket_bytes: int = BUCKET_BYTES
) -> None:
    """Average `grads` in place over the quorum: each bucket flattened into one tensor, one
    all-reduce per bucket (all queued first, then waited on), then copied back."""
    buckets = gradient_buckets(grads, bucket_bytes)
    flats = [torch.cat([grads[i].reshape(-1) for i in bucket]) for bucket in buckets]
    works = [manager.allreduce(flat) for flat in flats]
    for bucket, flat, work in zip(buckets, flats, works, strict=True):
        work.wait()  # does not raise: a failure is recorded with Manager.report_error
        for i, part in zip(bucket, flat.split([grads[i].numel() for i in bucket]), strict=True):
            grads[i].copy_(part.view_as(grads[i]))


class ReplicaGroup:
    """One replica group's torchft Manager and the hooks `loop.run_loop` calls around its step
    (`loop.FaultTolerance`). Build it after the model, optimizer and schedule, `resume`, pass it to
    `run_loop(..., fault_tolerance=)`, then `close`."""

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        replica_id: int,
        lighthouse: str,
        seal: Seal,
        store_host: str = "127.0.0.1",
        timeout_s: float | None = None,  # None: `collective_timeout_s` of this rank's gradient bytes
        quorum_timeout_s: float = QUORUM_TIMEOUT_S,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        min_replica_size: int = 1,  # 1: keep stepping alone when every other group is gone
        progress: Progress | None = None,
        gang: GangStore | None = None,
        expected_groups: int = 1,  # how many groups the first step waits for (MEET_QUORUMS at most)
        debug_checksum: bool = False,  # each step's line with its loss and weights checksum (tests)
    ) -> None:
        if quorum_timeout_s * 1000 <= HEARTBEAT_TIMEOUT_MS:
            raise ValueError("The quorum timeout needs to be longer than the Lighthouse's heartbeat timeout.")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.replica_id = replica_id
        self.progress, self.debug_checksum = progress, debug_checksum
        self.device = next(model.parameters()).device
        self.manager_progress = ManagerProgress()
        self.view = CheckpointView(model, self.manager_progress)
        # torchft's Manager connects to the group's TCPStore as a client and waits forever if none
        # is listening: a group of one process hosts its own (port 0: any free port); a gang's ranks
        # use the store torchrun's agent hosts, as torchft's own examples do under torchrun.
        self.store: TCPStore | None = None
        if gang is None:
            self.store = TCPStore(store_host, 0, is_master=True, wait_for_workers=False)
            gang = GangStore(rank=0, world_size=1, host=store_host, port=self.store.port)
        self.group_rank = gang.rank
        self.expected_groups = expected_groups
        self._meet_quorums = MEET_QUORUMS  # spent at the first step
        self._before_heal: Callable[[], object] = lambda: None  # set by each `start_step`
        timeout = timedelta(
            seconds=collective_timeout_s(gradient_bytes(model)) if timeout_s is None else timeout_s
        )
        self.manager = Manager(
            pg=replica_process_group(self.device.type, timeout),
            load_state_dict=self._load_peer_state,
            state_dict=self._peer_state,
            min_replica_size=min_replica_size,
            use_async_quorum=False,  # the peer state is read and loaded outside forward/backward (above)
            # healing transfers behind the run's key, loaded without pickle (engine/heal_transport.py)
            checkpoint_transport=SealedTransport(seal, store_host, timedelta(seconds=TRANSFER_TIMEOUT_S)),
            timeout=timeout,
            quorum_timeout=timedelta(seconds=quorum_timeout_s),
            connect_timeout=timedelta(seconds=connect_timeout_s),
            rank=gang.rank,
            world_size=gang.world_size,
            store_addr=gang.host,
            store_port=gang.port,
            lighthouse_addr=lighthouse,
            replica_id=f"replica_{replica_id}",  # torchft reads the trailing digits as the group's rank
        )
        self._write("started", pid=os.getpid(), store_port=gang.port)

    @property
    def step(self) -> int:
        """The steps every group in the quorum has committed (shared by all groups)."""
        return int(self.manager.current_step())

    # --- the loop's hooks (loop.FaultTolerance)

    def start_step(self, *, before_heal: Callable[[], object] = lambda: None) -> int | None:
        before = self.step
        self._before_heal = before_heal  # `_load_peer_state` calls it, within this call
        self.manager.start_quorum()
        # The first step of this process: more quorums (no step taken) until every expected group
        # is in one. A group joining a stage already under way finds the others at once.
        while self._meet_quorums > 0 and self.manager.num_participants() < self.expected_groups:
            self._meet_quorums -= 1
            time.sleep(MEET_POLL_S)
            self.manager.start_quorum()
        self._meet_quorums = 0
        return self.step if self.step != before else None

    def reduce_gradients(self, params: list[nn.Parameter]) -> None:
        # A gradient of a sharded parameter (a DTensor) is reduced in place through its local shard.
        grads = [
            p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None
        ]
        average_in_buckets(self.manager, grads)

    def total(self, value: float) -> float:
        """`value` summed over the groups of this step's quorum (after `start_step`), the same on
        every group: what RLVR's token mean divides by. A failed all-reduce is recorded, as for the
        gradients, and the step is not committed."""
        t = torch.tensor([value], dtype=torch.float64, device=self.device)  # nccl on cuda, gloo on CPU
        self.manager.allreduce(t, reduce_op=ReduceOp.SUM).wait()
        return float(t.item())

    def should_commit(self) -> bool:
        return bool(self.manager.should_commit())

    def end_step(self, loss: torch.Tensor, *, committed: bool) -> int:
        step = self.step
        if self.progress is not None:
            record: dict[str, object] = {
                "step": step,
                "committed": committed,
                "participants": self.manager.num_participants(),
            }
            if self.debug_checksum:  # a device sync and a host copy of every parameter: tests only
                record["loss"] = round(float(loss.detach()), 5)
                record["checksum"] = weights_checksum(self.model)
            if (error := self.manager.errored()) is not None:
                record["error"] = str(error.original_exception).splitlines()[0][:300]
            self.progress("step", **record)
        return step

    def checkpoint_module(self) -> nn.Module:
        self.manager_progress.capture(self.manager.state_dict())
        return self.view

    # --- lifecycle

    def resume(self, directory: str | os.PathLike) -> ResumeState | None:
        """Load this group's latest committed checkpoint, Manager state included, if there is one.
        A peer that is further ahead still heals this group at the first quorum."""
        resumed = load_latest(directory, self.view, self.optimizer, scheduler=self.scheduler)
        if resumed is not None:
            self.manager.load_state_dict(self.manager_progress.manager_state())
            self._write("resumed", step=self.step, path=resumed.path)
        return resumed

    def close(self) -> None:
        """Stop the Manager's servers (the sealed transport, gRPC) and its quorum thread."""
        self.manager.shutdown(wait=False)

    # --- the state a healing peer receives. torchft calls `_peer_state` on its quorum thread while
    # this group's training thread waits for the quorum in `start_step`, and `_load_peer_state` on the
    # training thread in `start_step`: neither runs beside a forward or backward pass.

    def _peer_state(self) -> dict[str, Any]:
        """This rank's model and optimizer state as plain local tensors (its shards under FSDP2),
        and the schedule. The tensors are the live ones (no copy on CPU): torchft serves them before
        this group's next optimizer step (`should_commit` closes the transfer first)."""
        return {
            "model": _local_shards(get_model_state_dict(self.model)),
            # The optimizer's own state_dict, keyed by parameter index: both groups build the same
            # optimizer. (get_optimizer_state_dict would take a zero step to fill an empty state.)
            "optim": _local_shards(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
        }

    def _load_peer_state(self, state: dict[str, Any]) -> None:
        self._before_heal()  # e.g. a checkpoint still copying the state this overwrites
        model = get_model_state_dict(self.model)  # this rank's tensors: the layout to put shards back in
        set_model_state_dict(
            self.model, {name: _like(value, model.get(name)) for name, value in state["model"].items()}
        )
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        optim = state["optim"]
        self.optimizer.load_state_dict(
            {
                **optim,
                "state": {
                    index: {key: _like(value, params[index]) for key, value in per_param.items()}
                    for index, per_param in optim["state"].items()
                },
            }
        )
        self.scheduler.load_state_dict(state["scheduler"])
        # The Manager has already taken the peer's step when it hands the state over.
        self._write("healed", step=self.step)

    def _write(self, event: str, **fields: object) -> None:
        if self.progress is not None:
            self.progress(event, **fields)


def _local_shards(tree: Any) -> Any:
    """Every DTensor in `tree` as this rank's local shard, a plain tensor (other values unchanged)."""
    return tree_map_only(DTensor, lambda t: t.detach().to_local(), tree)


def _like(value: Any, ref: Any) -> Any:
    """A local shard received from the same rank of a peer, laid out again as `ref` (this rank's
    DTensor of the same name: same mesh, placements and global shape). Values that are not a shard of
    `ref` (a plain model, an optimizer's step count, a non-tensor) are returned as they are."""
    if not (isinstance(ref, DTensor) and isinstance(value, torch.Tensor)):
        return value
    local = ref.to_local()
    if value.shape != local.shape:  # e.g. Adam's 0-d `step` beside a sharded parameter
        return value
    return DTensor.from_local(
        value.to(local.device),
        ref.device_mesh,
        ref.placements,
        run_check=False,
        shape=ref.shape,
        stride=ref.stride(),
    )


def replica_checkpoint_dir(parent: str | os.PathLike, replica_id: int) -> Path:
    """Where replica group N keeps its checkpoints: `<parent>/replica-<N>`."""
    return Path(parent) / f"replica-{replica_id}"
