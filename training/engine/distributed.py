"""The trainer's distributed core: the process group torchrun sets up, the device mesh a plan's
degrees describe, and the parallelisms applied to the model in torchtitan's order (TP, then FSDP2,
HSDP or DDP); plus the few rank helpers the loop, the checkpointer and the entry point need.

A plan (contracts.plans.Plan) names a strategy and its degrees; `ParallelDims.from_plan` checks that
the two agree and `ParallelDims.check_world` that the ranks torchrun started can realise them. A
plan that does not fit is refused with a `ParallelismError` naming the mismatch, never trained some
other way. The mesh's dimension names are torchtitan's: "dp_replicate", "dp_shard", "tp".

Ranks are laid out row-major over (dp_replicate, dp_shard, tp): the tp ranks of one data-parallel
rank are neighbours (one node, the fast links), and the data-parallel rank is `rank // tp`.

Collectives on the host (flags, barriers, the logged loss on CPU) run on the default group from the
training thread only. On cuda the default group is "cpu:gloo,cuda:nccl", so CPU tensors go over
gloo and device tensors over nccl. DCP's asynchronous saves get a group of their own (see
`checkpoint_group`), as in torchtitan: their background collectives must never interleave with
FSDP's all-gathers on one group.

With no torchrun environment (WORLD_SIZE unset or 1) nothing here starts a process group, and
every helper answers for a world of one.
"""

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from contracts.models import ModelShape
from training.engine.speed import Speed, apply_speed
from training.model import Attention

# torchrun's environment (torch.distributed.run sets these for every worker).
ENV_WORLD_SIZE: Final = "WORLD_SIZE"
ENV_RANK: Final = "RANK"
ENV_LOCAL_RANK: Final = "LOCAL_RANK"
ENV_MASTER_ADDR: Final = "MASTER_ADDR"
ENV_MASTER_PORT: Final = "MASTER_PORT"
ENV_RESTART_COUNT: Final = "TORCHELASTIC_RESTART_COUNT"  # which attempt of the gang this is (0 first)
ENV_USE_AGENT_STORE: Final = "TORCHELASTIC_USE_AGENT_STORE"  # "True": the agent hosts the store

# How long a collective may wait for its peers before the group reports an error; a rank that died
# without the launcher noticing turns into this timeout rather than a hang.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # raise for checkpoints of many GB on slow storage

# NCCL's settings before the process group starts, as torchtitan's `init_distributed` sets them; an
# operator's own value wins. Not TORCH_NCCL_AVOID_RECORD_STREAMS: FSDP2 frees its buffers by stream
# events, not record_stream, and torchtitan no longer sets it.
NCCL_ENV: Final = {
    # On a failed or timed-out collective the watchdog tears the process down without NCCL's
    # cleanup (3, not 1): the launcher restarts the gang, and the flight recorder's dump survives.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
    # The flight recorder: the last 20,000 collectives per rank (torchtitan's default), dumped to
    # /tmp/nccl_trace_rank_<r> when a collective times out: which rank hung, in which collective.
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
}

STRATEGIES: Final = ("single", "ddp", "fsdp2", "hsdp", "fsdp2+tp")
DEGREE_NAMES: Final = ("dp_replicate", "dp_shard", "tp")  # the mesh's dims, outermost first

M = TypeVar("M", bound=nn.Module)


class ParallelismError(ValueError):
    """A plan the ranks or the model cannot realise."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ParallelDims:
    """The degrees of one run's parallelisms; their product is the world size."""

    strategy: str = "single"
    dp_replicate: int = 1
    """Full replicas that all-reduce gradients (DDP; HSDP's outer dim: usually the node count)."""
    dp_shard: int = 1
    """Ranks that shard parameters, gradients and optimizer state (FSDP2; HSDP's inner dim)."""
    tp: int = 1
    """Tensor-parallel ranks that split each attention and MLP projection (within a node)."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ParallelismError(
                f"The trainer does not know the strategy {self.strategy!r}; it runs {', '.join(STRATEGIES)}."
            )
        for name in DEGREE_NAMES:
            if getattr(self, name) < 1:
                raise ParallelismError(
                    f"The degree {name} needs to be at least 1, not {getattr(self, name)}."
                )
        expected = {
            "single": self.world_size == 1,
            "ddp": self.dp_shard == 1 and self.tp == 1,
            "fsdp2": self.dp_replicate == 1 and self.tp == 1,
            "hsdp": self.dp_replicate > 1 and self.dp_shard > 1 and self.tp == 1,
            "fsdp2+tp": self.dp_replicate == 1 and self.tp > 1,
        }
        if not expected[self.strategy]:
            raise ParallelismError(
                f"The strategy {self.strategy} does not go with the degrees {self.degrees()}: "
                + _STRATEGY_RULES[self.strategy]
            )

    @classmethod
    def from_plan(cls, strategy: str, degrees: dict[str, int]) -> "ParallelDims":
        """The dims of a plan's strategy and degrees (missing degrees are 1)."""
        unknown = sorted(set(degrees) - set(DEGREE_NAMES))
        if unknown:
            raise ParallelismError(
                f"The plan names degrees the trainer does not know: {', '.join(unknown)} "
                f"(it knows {', '.join(DEGREE_NAMES)})."
            )
        return cls(strategy=strategy, **{name: int(degrees.get(name, 1)) for name in DEGREE_NAMES})

    @classmethod
    def for_world(cls, world_size: int) -> "ParallelDims":
        """No plan given: one process trains alone, more shard everything (plain FSDP2)."""
        return cls() if world_size == 1 else cls(strategy="fsdp2", dp_shard=world_size)

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp_degree(self) -> int:
        """Data-parallel ranks: how many slices each global batch is cut into."""
        return self.dp_replicate * self.dp_shard

    def degrees(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in DEGREE_NAMES if getattr(self, name) > 1}

    def mesh_dims(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """(shape, names) of the device mesh: the dims of degree > 1, outermost first (torchtitan
        leaves out the trivial ones too). Empty for a single process."""
        dims = [(getattr(self, name), name) for name in DEGREE_NAMES if getattr(self, name) > 1]
        return tuple(d for d, _ in dims), tuple(n for _, n in dims)

    def dp_rank(self, rank: int) -> int:
        """The data-parallel rank of global `rank` (the tp ranks of one dp rank read the same slice)."""
        return rank // self.tp

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise ParallelismError(
                f"The plan {self.strategy} {self.degrees() or '{}'} needs {self.world_size} "
                f"rank{'s' if self.world_size != 1 else ''}, but {world_size} "
                f"{'were' if world_size != 1 else 'was'} started."
            )

    def check_model(self, shape: ModelShape) -> None:
        """Tensor parallelism splits heads and the MLP width: each must divide by tp."""
        if self.tp == 1:
            return
        for name, value in (("n_head", shape.n_head), ("n_kv_head", shape.n_kv_head), ("d_ff", shape.d_ff)):
            if value % self.tp:
                raise ParallelismError(f"tp {self.tp} does not divide the model's {name} {value}.")

    def check_batch(self, batch_size: int) -> None:
        if batch_size % self.dp_degree:
            raise ParallelismError(
                f"The global batch of {batch_size} does not split evenly over {self.dp_degree} "
                "data-parallel ranks."
            )


_STRATEGY_RULES = {
    "single": "it runs on one rank, every degree 1.",
    "ddp": "it replicates (dp_replicate), with no dp_shard or tp.",
    "fsdp2": "it shards over dp_shard, with no dp_replicate or tp.",
    "hsdp": "it needs dp_replicate and dp_shard both above 1, and no tp.",
    "fsdp2+tp": "it needs tp above 1 (with dp_shard), and no dp_replicate.",
}


def batch_rows(batch_size: int, dp_rank: int, dp_degree: int) -> slice:
    """The rows of a global batch that data-parallel rank `dp_rank` trains on."""
    if batch_size % dp_degree or not 0 <= dp_rank < dp_degree:
        raise ParallelismError(
            f"A batch of {batch_size} has no slice {dp_rank} of {dp_degree} data-parallel ranks."
        )
    per_rank = batch_size // dp_degree
    return slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)


def eval_rows(batch_size: int, dp_rank: int, dp_degree: int) -> slice:
    """The rows of an eval batch that data-parallel rank `dp_rank` evaluates: contiguous shares of
    ceil(batch / dp) rows, so any batch (a short last one too) is covered once; a rank past the
    last row gets an empty slice."""
    per_rank = -(-batch_size // dp_degree)
    start = min(batch_size, dp_rank * per_rank)
    return slice(start, min(batch_size, start + per_rank))


def replica_batch_rows(batch_size: int, replica_id: int, groups: int, dims: ParallelDims, rank: int) -> slice:
    """The rows `rank` of replica group `replica_id` (of `groups`, each a gang laid out as `dims`)
    trains on: the groups split the global batch, and each group's data-parallel ranks its share."""
    return batch_rows(batch_size, replica_id * dims.dp_degree + dims.dp_rank(rank), groups * dims.dp_degree)


# ---- the process group -------------------------------------------------------------------------


def env_world_size() -> int:
    return int(os.environ.get(ENV_WORLD_SIZE, "1"))


def env_rank() -> int:
    return int(os.environ.get(ENV_RANK, "0"))


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if initialized() else 1


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def is_rank0() -> bool:
    return rank() == 0


def nccl_env(device_type: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment to set before the process group starts: NCCL_ENV's values that `environ`
    does not already name, on cuda; nothing elsewhere."""
    if device_type != "cuda":
        return {}
    return {name: value for name, value in NCCL_ENV.items() if name not in environ}


def group_options(device: torch.device) -> dict[str, Any]:
    """`init_process_group`'s backend and device: on cuda the rank's own GPU is named, so NCCL
    binds its communicator to it at once (no guess from the current device, no lazy init)."""
    if device.type == "cuda":
        return {"backend": "cpu:gloo,cuda:nccl", "device_id": device}
    return {"backend": "gloo"}


def init(device_type: str) -> torch.device:
    """Join torchrun's process group when WORLD_SIZE > 1 (a no-op otherwise); the device this rank
    trains on: its own GPU on cuda (LOCAL_RANK), the CPU otherwise."""
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ.get(ENV_LOCAL_RANK, "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device(device_type)
    if env_world_size() > 1 and not initialized():
        os.environ.update(nccl_env(device_type, os.environ))
        options = group_options(device)
        attempt = os.environ.get(ENV_RESTART_COUNT)
        if attempt is None or os.environ.get(ENV_USE_AGENT_STORE) != "True":
            dist.init_process_group(**options, timeout=COLLECTIVE_TIMEOUT)
        else:
            dist.init_process_group(
                **options,
                store=_attempt_store(int(attempt)),
                rank=env_rank(),
                world_size=env_world_size(),
                timeout=COLLECTIVE_TIMEOUT,
            )
    return device


def _attempt_store(attempt: int) -> dist.Store:
    """The elastic agent's store, under a prefix of its own per attempt. The agent keeps one store
    across restarts, so a restarted gang would read the addresses its dead predecessors published
    there and fail to connect (seen with torch 2.13: "Gloo connectFullMesh failed ... Connection
    refused")."""
    store = dist.TCPStore(
        os.environ[ENV_MASTER_ADDR],
        int(os.environ[ENV_MASTER_PORT]),
        is_master=False,
        timeout=COLLECTIVE_TIMEOUT,
    )
    return dist.PrefixStore(f"ito/attempt_{attempt}", store)


def close() -> None:
    """Leave the process group (after the last collective), so the process exits cleanly."""
    global _checkpoint_group
    if initialized():
        dist.destroy_process_group()
    _meshes.clear()
    _checkpoint_group = None


_meshes: dict[tuple[ParallelDims, str], DeviceMesh] = {}


def build_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh | None:
    """The mesh of `dims` over the started ranks (made once per process: each mesh creates process
    groups, collectively); None for a single process. Refuses a plan that does not match the world."""
    dims.check_world(world_size())
    shape, names = dims.mesh_dims()
    if not shape:
        return None
    key = (dims, device_type)
    if key not in _meshes:
        _meshes[key] = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return _meshes[key]


_checkpoint_group: Any = None


def checkpoint_group() -> Any:
    """A gloo group for DCP's asynchronous saves alone (None without a process group), made once
    by every rank (`new_group` is itself collective)."""
    global _checkpoint_group
    if not initialized():
        return None
    if _checkpoint_group is None:
        _checkpoint_group = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    return _checkpoint_group


def all_reduce_mean(value: float) -> float:
    """The mean of `value` over every rank (itself alone on one process)."""
    if not initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)  # SUM: gloo has no AVG
    return float(t.item()) / world_size()


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """`t` summed over every rank, in place (itself alone on one process); on the tensor's device
    (nccl on cuda, gloo on CPU)."""
    if initialized():
        dist.all_reduce(t)
    return t


def all_true(flag: bool) -> bool:
    """True on every rank when `flag` is true on every rank: a decision all ranks take together."""
    if not initialized():
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def any_true(flag: bool) -> bool:
    """True on every rank when `flag` is true on any rank."""
    return not all_true(not flag)


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (a picklable value made by this code, never read from outside)."""
    if not initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    """Every rank reaches this point before any goes on (a CPU all-reduce: gloo on every backend)."""
    if initialized():
        dist.all_reduce(torch.zeros(1))


# ---- applying the parallelisms -------------------------------------------------------------------


def parallelize(
    model: M, dims: ParallelDims, mesh: DeviceMesh | None, speed: Speed | None = None, device_type: str = ""
) -> M:
    """TP, activation checkpointing and compile (`speed`), then FSDP2 / HSDP per block and the root,
    or DDP: torchtitan's order. The model is on its device already (or on meta: `device_type` then
    names where it will live; "" means its parameters' device). For a single process only `speed`
    applies."""
    if mesh is None:
        if speed is not None:
            apply_speed(model, speed, device_type or _device_type(model))
        return model
    device_type = mesh.device_type
    if dims.tp > 1:
        _apply_tp(model, mesh["tp"])
    if speed is not None:
        apply_speed(model, speed, device_type)
    if dims.strategy == "ddp":
        from torch.distributed._composable.replicate import replicate

        replicate(model, device_mesh=mesh)
        return model
    dp_names = tuple(n for n in ("dp_replicate", "dp_shard") if n in (mesh.mesh_dim_names or ()))
    if dp_names:
        _apply_fsdp(model, mesh[dp_names], device_type)
    return model


def _device_type(model: nn.Module) -> str:
    return next(model.parameters()).device.type


def _apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    """Megatron-style: q/k/v and the MLP's gate and up split by columns (heads, width), the output
    projections by rows; their outputs are all-reduced, so every other module sees full activations.
    Each attention module then holds n_head / tp of the heads, as torchtitan adjusts them."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    tp = tp_mesh.size()
    for block in model.get_submodule("blocks").children():
        attn = block.get_submodule("attn")
        assert isinstance(attn, Attention), f"a block's attn is an Attention, not {type(attn).__name__}"
        plan: dict[str, Any] = {
            # Colwise splits q/k/v's biases (Qwen2) with their rows: each rank keeps its heads'.
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(),
            "mlp.w_gate": ColwiseParallel(),
            "mlp.w_up": ColwiseParallel(),
            "mlp.w_down": RowwiseParallel(),
        }
        if attn.q_norm is not None:
            # QK-norm's weights are shared by every head, but each tp rank holds only its own
            # heads: as replicated DTensors over the head dim their gradients are summed over
            # the tp ranks (as torchtitan's Qwen3 does); as plain tensors each rank would
            # step them with its own heads' part of the gradient and the ranks would drift.
            plan["attn.q_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
            plan["attn.k_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
        parallelize_module(block, tp_mesh, plan)
        attn.n_head //= tp  # the local heads: forward reshapes by these
        attn.n_kv_head //= tp


def mixed_precision(device_type: str) -> Any:
    """FSDP2's precision: bf16 compute with fp32 gradient reduction on cuda; fp32 throughout on CPU,
    where bf16 matmuls are slow and would change the numbers the tests compare with a single
    process. Forward inputs are never cast: FSDP's default would round each block's RoPE cos/sin
    tables to bf16, which one process (no FSDP) does not; the activations are bf16 already."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if device_type == "cuda":
        return MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    return MixedPrecisionPolicy(cast_forward_inputs=False)


@dataclass(frozen=True, slots=True)
class FsdpUnit:
    """Modules sharded as one FSDP2 unit (all-gathered and reduce-scattered together); "" is the root."""

    modules: tuple[str, ...]
    reshard_after_forward: bool


def fsdp_units(model: nn.Module) -> list[FsdpUnit]:
    """torchtitan's cut, innermost first and the root last: the embedding, each block, then the
    final norm with the head. The last unit stays gathered after the forward (the backward needs it
    at once; torchtitan's default). With tied embeddings the embedding and the head hold one
    parameter, which must live in one unit: the embedding joins the norm and head."""
    blocks = [
        FsdpUnit((f"blocks.{name}",), True) for name, _ in model.get_submodule("blocks").named_children()
    ]
    if getattr(model, "tie_embeddings", False):
        return [*blocks, FsdpUnit(("tok_emb", "norm", "lm_head"), False), FsdpUnit(("",), True)]
    return [
        FsdpUnit(("tok_emb",), True),
        *blocks,
        FsdpUnit(("norm", "lm_head"), False),
        FsdpUnit(("",), True),
    ]


def _apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, device_type: str) -> None:
    from torch.distributed.fsdp import fully_shard

    policy = mixed_precision(device_type)
    for unit in fsdp_units(model):
        modules = [model.get_submodule(name) for name in unit.modules]
        fully_shard(
            modules if len(modules) > 1 else modules[0],
            mesh=dp_mesh,
            mp_policy=policy,
            reshard_after_forward=unit.reshard_after_forward,
        )


def adamw_fused(params: list[nn.Parameter]) -> bool:
    """Whether AdamW may run fused (one kernel for the whole update, cuda and CPU): not when sharded
    and plain parameters mix (tensor parallelism without FSDP: TP splits the projections, the norms
    stay plain tensors), which torch's fused kernel refuses ("mixed torch.Tensor and DTensor");
    there AdamW keeps its default, foreach. Under FSDP2 every parameter is a DTensor."""
    sharded = {isinstance(p, DTensor) for p in params}
    return len(sharded) <= 1


def uses_tp(params: list[nn.Parameter]) -> bool:
    """Whether any parameter is split by tensor parallelism (a DTensor on a mesh with a "tp" dim)."""
    for p in params:
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
            return True
    return False


def clip_grad_norm(params: list[nn.Parameter], max_norm: float, *, tp: bool) -> torch.Tensor:
    """Clip to a global norm of `max_norm`; the norm before clipping. Under TP, parameters are a
    mix of sharded DTensors and plain tensors (every tp rank holds the same copy) that one foreach
    norm cannot take: as torchtitan's `clip_grad_norm_`, each rank sums its local squares per mesh
    and one collective per mesh makes them whole; the coefficient scales the local tensors on the
    device (no `.item()`: no host sync)."""
    if not tp:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    total_sq = _grad_squares(grads)
    total = total_sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    torch._foreach_mul_(local, coef.to(local[0].device))  # a DTensor's local tensor is its data
    return total


def _grad_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """The squared global norm of `grads`, the same on every rank: plain tensors (a copy on every
    rank) counted as they are; each mesh's sharded or replicated DTensors summed locally (a
    replicated one's share divided by its copies), then one all-reduce (a Partial DTensor's
    `full_tensor`) per mesh; pending sums (Partial gradients, e.g. TP's replicated norm weights)
    made whole together first, one all-reduce per mesh and layout."""
    from torch.distributed.tensor import Partial, Replicate

    plain = [g for g in grads if not isinstance(g, DTensor)]
    per_mesh: dict[DeviceMesh, list[torch.Tensor]] = {}
    pending: dict[tuple[DeviceMesh, tuple[Any, ...]], list[DTensor]] = {}
    for g in grads:
        if not isinstance(g, DTensor):
            continue
        if any(isinstance(p, Partial) for p in g.placements):
            pending.setdefault((g.device_mesh, tuple(g.placements)), []).append(g)
            continue
        copies = 1
        for size, placement in zip(g.device_mesh.shape, g.placements, strict=True):
            copies *= size if isinstance(placement, Replicate) else 1
        per_mesh.setdefault(g.device_mesh, []).append(_square(g.to_local()) / copies)
    device = grads[0].to_local().device if isinstance(grads[0], DTensor) else grads[0].device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in plain:
        total = total + _square(g)
    for (mesh, placements), group in pending.items():
        if all(isinstance(p, Partial | Replicate) for p in placements):  # flattened side by side
            flat = torch.cat([g.to_local().reshape(-1) for g in group])
            total = total + _square(DTensor.from_local(flat, mesh, placements, run_check=False).full_tensor())
        else:  # a pending sum of a shard: each gradient whole on its own (none in our models)
            total = total + sum((_square(g.full_tensor()) for g in group), torch.zeros((), device=device))
    for mesh, squares in per_mesh.items():
        partial = DTensor.from_local(
            torch.stack(squares).sum(), mesh, [Partial()] * mesh.ndim, run_check=False
        )
        total = total + partial.full_tensor()
    return total


def _square(t: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(t, dtype=torch.float32) ** 2
