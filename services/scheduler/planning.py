"""Planning: parallelism, precision, memory, fabric, data policy and cost, as pure functions.

`plan()` is called by `ecc ito plan` (which creates nothing) and again at train time; each gate is a
named check with pass/fail and a reason. The I/O it needs (the price table: services/scheduler/
prices.py) is done by the caller and passed in; the measured memory figures (gpu_memory.py) are
read once at import, a file that ships beside it. It touches no other disk: the checkpoint storage
is the trainer's, and the trainer checks it (exists, writable, room for the plan's
`checkpoint_bytes`) before its first step.
"""

import os
import pathlib
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

import msgspec

from contracts.booking import Fabric
from contracts.errors import ErrorCode
from contracts.internal import EligibilityBody
from contracts.manifest import DataRole, Lora, Manifest
from contracts.models import BaseModel, ModelShape
from contracts.plans import CapacityPlan, CostEstimate, Plan, PlanCheck, StageGatePlan, WindowPlan
from domain.curriculum import Curriculum, LmPlan, curriculum_of, model_shape
from domain.model_shapes import count_parameters, head_dim
from services.scheduler import calibration, capacity, gpu_memory
from services.scheduler.prices import GpuPrice, PriceTable

ALLOWED_SOURCE_PREFIXES = ("builtin:", "generated:", "upload:", "s3://", "file:/")  # what data_refs reads
BYTES_PER_PARAM_TRAINING = 16  # bf16 weights + bf16 grads + fp32 master + two fp32 Adam moments
BYTES_PER_PARAM_CHECKPOINT = 12  # fp32 weights + two fp32 Adam moments
BYTES_PER_PARAM_FROZEN = 2  # a LoRA stage's base: bf16 weights, no gradients, no optimizer state
# Activations, logits and the margin left free: measured figures (services/scheduler/gpu_memory.py).
MEMORY = gpu_memory.load()
USABLE_MEMORY_FRACTION = 1.0 - gpu_memory.MARGIN
SMALL_MODEL_PARAMS = 50e6  # below this, more than one GPU only adds communication
MULTI_NODE_MIN_PARAMS = 1e9  # below this, more than one node of GPUs is wasteful
# Post-training compute as a fraction of pretraining tokens, and FLOPs per token per parameter.
POST_TRAINING_TOKENS_FRACTION = 0.05
POST_TRAINING_FLOPS_PER_TOKEN = {"sft": 6.0, "dpo": 2 * 6.0 + 2 * 2.0, "rlvr": 8 * 2.0 + 6.0 + 2.0}


def parameter_count(shape: ModelShape) -> int:
    """Exact for the trainer's model of `shape` (domain/model_shapes.count_parameters:
    GQA, head_dim, q/k/v biases, QK-norm and tied embeddings as the shape has them)."""
    return count_parameters(shape)


def lora_parameters(shape: ModelShape, lora: Lora) -> int:
    """The adapters' parameters: rank r adds A (r x in) and B (out x r), r * (in + out), to each
    targeted Linear of every layer (Hugging Face module names; an unknown name adds nothing)."""
    d, q, kv = shape.d_model, shape.n_head * head_dim(shape), shape.n_kv_head * head_dim(shape)
    dims = {
        "q_proj": (d, q),
        "k_proj": (d, kv),
        "v_proj": (d, kv),
        "o_proj": (q, d),
        "gate_proj": (d, shape.d_ff),
        "up_proj": (d, shape.d_ff),
        "down_proj": (shape.d_ff, d),
    }
    per_layer = sum(lora.rank * sum(dims[m]) for m in set(lora.target_modules) if m in dims)
    return shape.n_layer * per_layer


def stage_loras(manifest: Manifest) -> list[Lora | None]:
    """Each training stage's adapters (None: the whole model trains), in no particular order:
    the next-token stages train everything; a post-training stage may train adapters alone."""
    full: list[Lora | None] = []
    st = manifest.stages
    if st.pretrain is not None or st.midtrain is not None or st.long_context is not None:
        full.append(None)
    for name in manifest.post_training.recipe:
        section = getattr(manifest.post_training, name, None)
        full.append(getattr(section, "lora", None))
    return full or [None]


def training_state_bytes(manifest: Manifest, shape: ModelShape) -> float:
    """Weights, gradients and optimizer state of the most demanding stage: a full stage's
    BYTES_PER_PARAM_TRAINING per parameter; a LoRA stage's frozen bf16 base plus the adapters'
    full training state (their gradients, fp32 master and Adam's two moments)."""
    params = count_parameters(shape)
    worst = 0.0
    for lora in stage_loras(manifest):
        if lora is None:
            worst = max(worst, params * BYTES_PER_PARAM_TRAINING)
        else:
            adapters = lora_parameters(shape, lora)
            worst = max(worst, params * BYTES_PER_PARAM_FROZEN + adapters * BYTES_PER_PARAM_TRAINING)
    return worst


def checkpoint_bytes(manifest: Manifest, shape: ModelShape) -> int:
    """One checkpoint of the largest stage: weights and Adam's moments in fp32, of the whole model,
    or of the adapters alone for a LoRA stage (the frozen base is the store's, not checkpointed)."""
    params = count_parameters(shape)
    sizes = [
        (params if lora is None else lora_parameters(shape, lora)) * BYTES_PER_PARAM_CHECKPOINT
        for lora in stage_loras(manifest)
    ]
    return max(sizes)


def _check(name: str, refusal: tuple[ErrorCode, str] | None, passed: str) -> PlanCheck:
    if refusal is None:
        return PlanCheck(name=name, ok=True, reason=passed)
    return PlanCheck(name=name, ok=False, code=refusal[0].value, reason=refusal[1])


Refusal = tuple[ErrorCode, str]


class Strategy(NamedTuple):
    name: str  # "none" when refused
    degrees: dict[str, int]
    precision: str
    per_gpu_bytes: float
    refusal: Refusal | None
    fit: gpu_memory.Fit | None = None  # the micro-batch, accumulation and checkpointing that fit


def topology_refusal(
    params: int, nodes: int, gpus: int, fabric: Fabric, small_model_gangs: bool = False
) -> Refusal | None:
    """A fabric that cannot carry the run, or more GPUs or nodes than the model can use (several
    GPUs or nodes for a small model only with the operator's `small_model_gangs`: tests and demos
    of gangs and of multi-node replica groups on CPU)."""
    if nodes > 1 and fabric is Fabric.ethernet:
        return (
            ErrorCode.fabric_unsupported,
            "a multi-node run needs InfiniBand or RoCE; the booking has ethernet",
        )
    if gpus > 1 and params < SMALL_MODEL_PARAMS and not small_model_gangs:
        return ErrorCode.plan_wasteful, f"{gpus} GPUs for a {params / 1e6:.1f}M-parameter model: use one GPU"
    if nodes > 1 and params < MULTI_NODE_MIN_PARAMS and not small_model_gangs:
        return (
            ErrorCode.plan_wasteful,
            f"{nodes} nodes for a {params / 1e6:.0f}M-parameter model: use one node",
        )
    return None


def layouts(nodes: int, gpn: int) -> list[tuple[str, dict[str, int], int, int]]:
    """(name, degrees, shard factor, tensor-parallel degree), cheapest communication first:
    replicate, shard in a node, shard everywhere, then add TP."""
    gpus = nodes * gpn
    # Across nodes data parallelism is torchft replica groups, one per node (training/launch/
    # multinode.py); a node of several GPUs shards inside its group, so plain DDP over every GPU of
    # several nodes is not a layout (hsdp is at least as small per GPU).
    replicate = (
        [("single" if gpus == 1 else "ddp", {"dp_replicate": gpus}, 1, 1)] if nodes == 1 or gpn == 1 else []
    )
    candidates = [
        *replicate,
        ("fsdp2" if nodes == 1 else "hsdp", {"dp_replicate": nodes, "dp_shard": gpn}, gpn, 1),
        ("fsdp2", {"dp_shard": gpus}, gpus, 1),
    ]
    for tp in (2, 4, 8):
        if tp <= gpn and gpus // tp >= 1:
            candidates.append(("fsdp2+tp", {"dp_shard": gpus // tp, "tp": tp}, gpus // tp, tp))
    return candidates


def stage_params(manifest: Manifest, shape: ModelShape) -> list[tuple[int, int]]:
    """(trained, frozen) parameters of each training stage: the whole model, or a LoRA stage's
    adapters over its frozen base."""
    params = count_parameters(shape)
    return [
        (params, 0) if lo is None else (lora_parameters(shape, lo), params) for lo in stage_loras(manifest)
    ]


def strategy(
    params: int,
    shape: ModelShape,
    manifest: Manifest,
    gpu: GpuPrice,
    fabric: Fabric,
    small_model_gangs: bool = False,
) -> Strategy:
    """(strategy, degrees, precision, per-GPU bytes, refusal, memory fit) for the GPUs the manifest
    asks for: the first layout (cheapest communication first) whose micro-batch fits
    (services/scheduler/gpu_memory.py, at the trainer's CUDA defaults: bf16, compiled blocks)."""
    nodes, gpn = manifest.resources.nodes, manifest.resources.gpus_per_node
    gpus = nodes * gpn
    gpu_bytes = gpu.memory_gb * 1e9
    cal = MEMORY[gpu_memory.GPU_KIND]
    precision = "bf16"  # fp8 is not built yet (no torchao in the trainer): the plan says what runs
    refused = topology_refusal(params, nodes, gpus, fabric, small_model_gangs)
    if refused is not None:
        return Strategy("none", {}, precision, 0.0, refused)
    wanted = manifest.resources.strategy
    candidates = [c for c in layouts(nodes, gpn) if wanted is None or c[0] == wanted]
    if not candidates:
        return Strategy(
            "none",
            {},
            precision,
            0.0,
            (
                ErrorCode.capacity_insufficient,
                f"resources.strategy {wanted} is not a layout of {nodes} node(s) x {gpn} GPU(s)",
            ),
        )
    why = ""
    for name, degrees, shard, tp in candidates:
        fit = gpu_memory.layout_fit(
            cal,
            shape,
            stage_params(manifest, shape),
            BYTES_PER_PARAM_FROZEN,
            ranks=max(1, gpus // tp),  # data-parallel ranks: every GPU but the TP group's
            batch_size=manifest.target.batch_size,
            seq_len=manifest.target.seq_len,
            gpu_bytes=gpu_bytes,
            shard=shard,
            tp=tp,
        )
        if isinstance(fit, gpu_memory.Fit):
            return Strategy(name, degrees, precision, fit.memory.total_bytes, None, fit)
        why = fit
    state = training_state_bytes(manifest, shape)
    if state / gpus > gpu_bytes * (1.0 - gpu_memory.MARGIN):
        why = (
            f"{params / 1e9:.1f}B parameters need ~{state / 1e9:.0f} GB of training state; "
            f"{gpus} x {gpu.memory_gb:.0f} GB cannot hold it"
        )
    return Strategy("none", {}, precision, state / gpus, (ErrorCode.capacity_insufficient, why))


def cost(
    params: int,
    manifest: Manifest,
    gpu: GpuPrice,
    prices: PriceTable,
    booked_gpu_hours: float,
    window_hours: float,
    shape: ModelShape | None = None,
) -> CostEstimate:
    tokens = manifest.target.tokens
    flops = 6.0 * params * tokens
    for stage in manifest.post_training.recipe:
        flops += (
            POST_TRAINING_FLOPS_PER_TOKEN.get(stage, 6.0) * params * tokens * POST_TRAINING_TOKENS_FRACTION
        )
    gpus = manifest.resources.nodes * manifest.resources.gpus_per_node
    gpu_hours = flops / (gpu.peak_bf16_tflops * 1e12 * gpu.assumed_mfu) / 3600.0
    compute = gpu_hours * gpu.price_per_gpu_hour_usd
    one = checkpoint_bytes(manifest, shape) if shape is not None else params * BYTES_PER_PARAM_CHECKPOINT
    storage_gb = one * manifest.checkpoint.keep_last / 1e9
    storage = storage_gb * prices.storage_usd_per_gb_month * max(window_hours / 730.0, 1.0)
    incremental = max(0.0, gpu_hours - booked_gpu_hours) * gpu.price_per_gpu_hour_usd
    return CostEstimate(
        flops=flops,
        tokens=tokens,
        parameters=params,
        assumed_mfu=gpu.assumed_mfu,
        peak_tflops_per_gpu=gpu.peak_bf16_tflops,
        gpus=gpus,
        gpu_hours=gpu_hours,
        price_per_gpu_hour_usd=gpu.price_per_gpu_hour_usd,
        compute_usd=round(compute, 6),
        checkpoint_storage_usd=round(storage, 6),
        total_usd=round(compute + storage, 6),
        booked_gpu_hours=booked_gpu_hours,
        incremental_usd=round(incremental, 6),
    )


def calibrated(
    estimate: CostEstimate,
    manifest: Manifest,
    shape: ModelShape,
    gpu: GpuPrice,
    prices: PriceTable,
    gpu_model: str,
    base: BaseModel | None = None,
    run: Curriculum | None = None,
) -> CostEstimate:
    """The estimate on the wall seconds the run will hold its GPUs (start-up, data prep, steps,
    evals, checkpoints: calibration.phases), with its basis; unchanged (basis "flops") when the
    table has no figures, or for a manifest that cannot run (its refusal comes from elsewhere)."""
    flops_only = msgspec.structs.replace(estimate, flops_gpu_hours=estimate.gpu_hours)
    if not prices.calibration:
        return flops_only
    run = run or _curriculum(manifest, base)
    if run is None:
        return flops_only
    figures = calibration.figures_for(prices.calibration, gpu_model)
    gpu_flops_s = gpu.peak_bf16_tflops * 1e12 * gpu.assumed_mfu
    phases = calibration.phases(run, manifest, shape, estimate.gpus, gpu_flops_s, figures)
    gpu_hours = phases.wall_s * estimate.gpus / 3600.0
    compute = gpu_hours * gpu.price_per_gpu_hour_usd
    incremental = max(0.0, gpu_hours - estimate.booked_gpu_hours) * gpu.price_per_gpu_hour_usd
    return msgspec.structs.replace(
        flops_only,
        gpu_hours=gpu_hours,
        compute_usd=round(compute, 6),
        total_usd=round(compute + estimate.checkpoint_storage_usd, 6),
        incremental_usd=round(incremental, 6),
        basis=figures.basis,
        wall_s=round(phases.wall_s, 3),
        phases_s=phases.as_dict(),
    )


def _curriculum(manifest: Manifest, base: BaseModel | None) -> Curriculum | None:
    """The manifest's stages, or None for a manifest that cannot run (its refusal comes from the
    manifest gate, not from here)."""
    try:
        return curriculum_of(manifest, base)
    except ValueError:
        return None


def data_policy(manifest: Manifest) -> tuple[ErrorCode, str] | None:
    for ref in manifest.data:
        if not ref.source.startswith(ALLOWED_SOURCE_PREFIXES):
            return ErrorCode.data_policy_violation, f"data {ref.name!r}: source is not in the allowed list"
        if ref.source.startswith("s3://") and ref.connection is None:
            return ErrorCode.data_policy_violation, f"data {ref.name!r}: an s3:// source names no connection"
        if ref.role is DataRole.train and ref.decontamination is None:
            return ErrorCode.data_policy_violation, f"data {ref.name!r}: no decontamination provenance"
    if not any(ref.role is DataRole.train for ref in manifest.data):
        return ErrorCode.data_policy_violation, "the manifest names no training data"
    return None


def stage_gates(
    manifest: Manifest, base: BaseModel | None = None, run: Curriculum | None = None
) -> list[StageGatePlan]:
    """Every stage's gate as the trainer will judge it (domain/gates.py), in run order;
    empty for a manifest that cannot run (the manifest gate refuses it before planning)."""
    run = run or _curriculum(manifest, base)
    if run is None:
        return []
    return [
        StageGatePlan(
            stage=stage.name, rules=[r.describe(run.incoming_label(stage)) for r in run.rules(stage)]
        )
        for stage in run.stages
    ]


def desk_gpu(prices: PriceTable, statement: EligibilityBody) -> tuple[GpuPrice, PlanCheck | None]:
    """The booked GPU's desk price, or a stand-in and a failed `price` check when it has none."""
    topo = statement.topology
    gpu = prices.gpus.get(topo.gpu_model)
    if gpu is not None:
        return gpu, None
    stand_in = GpuPrice(
        price_per_gpu_hour_usd=0.0,
        peak_bf16_tflops=1.0,
        assumed_mfu=1.0,
        memory_gb=topo.gpu_memory_gb,
        fp8=False,
    )
    refusal = (ErrorCode.capacity_insufficient, f"no desk price for GPU model {topo.gpu_model}")
    return stand_in, _check("price", refusal, "")


def layout_checks(s: Strategy, manifest: Manifest, fabric: Fabric) -> list[PlanCheck]:
    """`fabric`, then `parallelism` unless the fabric already refused."""
    fabric_refusal = s.refusal if s.refusal and s.refusal[0] is ErrorCode.fabric_unsupported else None
    checks = [
        _check("fabric", fabric_refusal, f"{fabric.value} is fine for {manifest.resources.nodes} node(s)")
    ]
    if fabric_refusal is None:
        checks.append(
            _check(
                "parallelism",
                s.refusal,
                f"{s.name} {s.degrees}, {s.precision}, "
                + (gpu_memory.sentence(s.fit) if s.fit else f"~{s.per_gpu_bytes / 1e9:.2f} GB per GPU"),
            )
        )
    return checks


def budget_checks(estimate: CostEstimate, manifest: Manifest) -> list[PlanCheck]:
    """`budget_cap` (the whole estimate) and `incremental_cost` (what goes beyond the booking)."""
    cap, allowed = manifest.budget_cap_usd, manifest.max_incremental_cost_usd
    over_cap = (
        ErrorCode.budget_exceeded,
        f"estimate {estimate.total_usd:.2f} USD is above the cap {cap:.2f} USD",
    )
    over_incr = (
        ErrorCode.budget_exceeded,
        f"{estimate.incremental_usd:.2f} USD beyond the booking is above the allowed {allowed:.2f} USD",
    )
    return [
        _check(
            "budget_cap",
            over_cap if estimate.total_usd > cap else None,
            f"estimate {estimate.total_usd:.4f} USD within the cap {cap:.2f} USD",
        ),
        _check(
            "incremental_cost",
            over_incr if estimate.incremental_usd > allowed else None,
            f"{estimate.incremental_usd:.2f} USD beyond the booking",
        ),
    ]


def expected_wall_hours(estimate: CostEstimate) -> float:
    """The run's expected wall time: the estimate's GPU-hours over the GPUs it holds."""
    return estimate.gpu_hours / max(1, estimate.gpus)


def checkpoint_every_hours(
    manifest: Manifest, wall_hours: float, base: BaseModel | None, run: Curriculum | None = None
) -> float:
    """The expected wall time between two checkpoints: the next-token stages' steps in the run's
    wall time, one every checkpoint.interval_steps (the whole run when it has no such steps)."""
    target = manifest.target
    run = run or _curriculum(manifest, base)
    if run is not None:
        steps = sum(s.steps for s in run.stages if isinstance(s, LmPlan))
    else:  # a manifest the manifest gate refuses: the target's own steps
        steps = max(1, target.tokens // (target.seq_len * target.batch_size))
    return wall_hours * min(1.0, manifest.checkpoint.interval_steps / steps) if steps else wall_hours


@dataclass(frozen=True, slots=True)
class Ask:
    """What every part of one plan reads: the manifest on the booking's GPUs at the desk's price,
    its model's shape and parameters, and its stages (None: a manifest that cannot run)."""

    manifest: Manifest
    statement: EligibilityBody
    prices: PriceTable
    gpu: GpuPrice
    shape: ModelShape
    params: int
    base: BaseModel | None
    run: Curriculum | None
    small_model_gangs: bool

    @property
    def window_hours(self) -> float:
        """The booking's whole window."""
        return (self.statement.window_end - self.statement.window_start).total_seconds() / 3600.0


def estimate(ask: Ask) -> CostEstimate:
    """The run's cost on the GPUs it holds: FLOPs at the assumed MFU, then on the calibrated wall time."""
    topo = ask.statement.topology
    booked = topo.nodes * topo.gpus_per_node * ask.window_hours
    flops = cost(ask.params, ask.manifest, ask.gpu, ask.prices, booked, ask.window_hours, ask.shape)
    return calibrated(flops, ask.manifest, ask.shape, ask.gpu, ask.prices, topo.gpu_model, ask.base, ask.run)


def data_parallel_alternative(ask: Ask) -> capacity.Alternative:
    """The plan over every GPU of the booking (the layout the planner picks), for the suggestion."""
    topo = ask.statement.topology
    resources = msgspec.structs.replace(
        ask.manifest.resources, nodes=topo.nodes, gpus_per_node=topo.gpus_per_node, strategy=None
    )
    wide = msgspec.structs.replace(ask.manifest, resources=resources)
    s = strategy(ask.params, ask.shape, wide, ask.gpu, ask.statement.fabric, ask.small_model_gangs)
    est = calibrated(  # the run's stages do not depend on its resources: the same Curriculum
        cost(ask.params, wide, ask.gpu, ask.prices, 0.0, 0.0, ask.shape),
        wide,
        ask.shape,
        ask.gpu,
        ask.prices,
        topo.gpu_model,
        run=ask.run,
    )
    reason = None if s.refusal is None else f"{s.refusal[0].value}: {s.refusal[1]}"
    return capacity.Alternative(
        topo.nodes, topo.gpus_per_node, s.name, s.degrees, reason, expected_wall_hours(est)
    )


def capacity_and_window(
    ask: Ask, estimate: CostEstimate, now: datetime
) -> tuple[CapacityPlan, WindowPlan, PlanCheck]:
    """The booking's held and idle GPUs, the run against the remaining window, and the
    `booking_window` check (services/scheduler/capacity.py)."""
    statement, manifest, topo, res = (
        ask.statement,
        ask.manifest,
        ask.statement.topology,
        ask.manifest.resources,
    )
    wall = expected_wall_hours(estimate)
    alt = None
    if res.nodes * res.gpus_per_node < topo.nodes * topo.gpus_per_node:
        alt = data_parallel_alternative(ask)
    held = capacity.capacity_plan(
        topo, res.nodes, res.gpus_per_node, ask.gpu.price_per_gpu_hour_usd, wall, ask.window_hours, alt
    )
    window = capacity.window_plan(
        statement.window_start,
        statement.window_end,
        now,
        wall,
        checkpoint_every_hours(manifest, wall, ask.base, ask.run),
        manifest.checkpoint.resumable_across_bookings,
    )
    return held, window, _check("booking_window", capacity.window_refusal(window), window.sentence)


def plan(
    manifest: Manifest,
    digest: str,
    statement: EligibilityBody,
    prices: PriceTable,
    *,
    small_model_gangs: bool = False,
    base: BaseModel | None = None,
    now: datetime | None = None,
    run: Curriculum | None = None,
    storage_roots: tuple[pathlib.Path, ...] = (),
) -> Plan:
    """The plan and its checks, in a fixed order: price, fabric, parallelism, data policy,
    checkpoint storage, budget cap, incremental cost, booking window. `now` (default: when the
    eligibility statement was issued) is what the booking's remaining window is measured from.
    `run`: the manifest's stages when the caller has them already (planned once, used by every
    part of the plan below that needs them)."""
    run = run or _curriculum(manifest, base)
    shape = model_shape(manifest, base)
    gpu, price_check = desk_gpu(prices, statement)
    ask = Ask(manifest, statement, prices, gpu, shape, parameter_count(shape), base, run, small_model_gangs)
    chosen = strategy(ask.params, shape, manifest, gpu, statement.fabric, small_model_gangs)
    est = estimate(ask)
    needed = checkpoint_bytes(manifest, shape) * manifest.checkpoint.keep_last
    held, window, window_check = capacity_and_window(ask, est, now or statement.issued_at)
    checks = [
        *([] if price_check is None else [price_check]),
        *layout_checks(chosen, manifest, statement.fabric),
        _check("data_policy", data_policy(manifest), "every source allowed, decontamination declared"),
        _check(
            "checkpoint_storage",
            storage_policy_refusal(manifest, storage_roots),
            f"the trainer checks its storage is writable with ~{needed / 1e9:.1f} GB free before it trains",
        ),
        *budget_checks(est, manifest),
        window_check,
    ]
    return Plan(
        booking_id=statement.booking_id,
        manifest_digest=digest,
        strategy=chosen.name,
        degrees=chosen.degrees,
        precision=chosen.precision,
        cost=est,
        checks=checks,
        gates=stage_gates(manifest, base, run),
        ok=all(c.ok for c in checks),
        gpu_model=statement.topology.gpu_model,
        region=statement.region,
        capacity=held,
        window=window,
        checkpoint_bytes=needed,
        micro_batch_size=chosen.fit.micro_batch_size if chosen.fit else 0,
        grad_accumulation=chosen.fit.grad_accumulation if chosen.fit else 1,
        activation_checkpointing=chosen.fit.activation_checkpointing if chosen.fit else "none",
        memory=chosen.fit.memory if chosen.fit else None,
    )


def storage_policy_refusal(
    manifest: Manifest, roots: tuple[pathlib.Path, ...] = ()
) -> tuple[ErrorCode, str] | None:
    """What the scheduler can judge of the checkpoint storage without touching a disk: it is the
    trainer's own ('local') or a path under one of the storage roots the operator allows (`roots`,
    ITO_CHECKPOINT_ROOTS), judged on its text alone (the same answer whatever is on the disk); the
    trainer checks the rest where it writes, from the root down with no link followed."""
    storage = manifest.checkpoint.storage
    if storage == "local":
        return None
    if os.path.isabs(storage) and within(storage, roots):
        return None
    allowed = "the operator names them" if roots else "this backend allows none"
    return (  # the roots themselves are the operator's to tell: no answer lists a server path
        ErrorCode.checkpoint_storage_unavailable,
        f"checkpoint storage must be 'local' or a path under a storage root the operator allows ({allowed})",
    )


def within(path: str, roots: tuple[pathlib.Path, ...]) -> bool:
    """Is the absolute, normal `path` one of `roots` or below one? (text only)"""
    if os.path.normpath(path) != path:
        return False
    return any(path == str(r) or path.startswith(str(r).rstrip("/") + "/") for r in roots)


def first_refusal(p: Plan) -> tuple[ErrorCode, str] | None:
    for c in p.checks:
        if not c.ok:
            return ErrorCode(c.code or ErrorCode.request_invalid), c.reason  # (a failed check has a code)
    return None
