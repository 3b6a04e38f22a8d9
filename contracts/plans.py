"""The `plan` verb's answer: how a run would train on its booking (strategy, degrees, precision), what
it would cost and on what basis, which of the booking's GPUs it holds, whether it fits the booking's
window, every check and every stage's gate. The scheduler's planner writes it (services/scheduler/
planning.py); the run view and the trainer's work item carry it, and the trainer trains as it says.
"""

from datetime import datetime

from contracts.base import Internal


class PlanCheck(Internal, frozen=True, kw_only=True):
    name: str
    ok: bool
    code: str | None = None
    reason: str


class CostEstimate(Internal, frozen=True, kw_only=True):
    flops: float
    tokens: int
    parameters: int
    assumed_mfu: float
    peak_tflops_per_gpu: float
    gpus: int
    gpu_hours: float
    price_per_gpu_hour_usd: float
    compute_usd: float
    checkpoint_storage_usd: float
    total_usd: float
    booked_gpu_hours: float
    incremental_usd: float  # cost beyond what the booking covers
    # The estimate's basis (services/scheduler/calibration.py): wall seconds the run holds its GPUs,
    # by phase, from the backend's measured figures for this GPU model or its documented defaults.
    # `gpu_hours` is then `wall_s` x `gpus`; `flops_gpu_hours` keeps the FLOPs-only figure.
    basis: str = "flops"  # "flops", "telemetry: N runs on <gpu>" or "defaults for <gpu>"
    wall_s: float = 0.0
    phases_s: dict[str, float] = {}  # startup, data_prep, train, eval, checkpoint
    flops_gpu_hours: float = 0.0


class CapacityPlan(Internal, frozen=True, kw_only=True):
    """The booking's GPUs: which the run holds (all GPUs its placement allocates: GPUs 0..g-1 of
    nodes 0..n-1), which stay idle, and what the idle ones cost at the booking's price."""

    booked_gpus: int
    held_gpus: int
    idle_gpus: int
    held: list[str]  # e.g. ["node0:gpu0"]; ranges as "node0:gpu1-7"
    idle: list[str]
    idle_fraction: float  # idle_gpus / booked_gpus
    idle_usd_per_hour: float  # idle GPUs x the price per GPU-hour
    idle_usd_during_run: float  # ... x the run's expected wall hours
    idle_gpu_hours_in_window: float  # the booking's GPU-hours this run leaves unused (whole window)
    wasteful: bool  # most of the booking idle (planning.IDLE_WARN_FRACTION): the plan warns
    sentence: str  # what a person reads: held, idle, cost, and the suggestion when wasteful
    suggestion: str | None = None  # the data-parallel resources that would use the booking, or why none


class WindowPlan(Internal, frozen=True, kw_only=True):
    """Whether the run's expected wall time fits what is left of the booking's window."""

    window_start: datetime
    window_end: datetime
    expected_wall_hours: float  # the plan's GPU-hour estimate over the GPUs the run holds
    remaining_hours: float  # window_end - max(now, window_start) when planned
    required_margin_hours: float  # the slack asked for beyond the expected wall time
    margin_hours: float  # remaining - expected (negative: it does not fit at all)
    fits: bool  # expected + required margin <= remaining
    resumable: bool  # does not fit, but continues from its last checkpoint on a later booking
    sentence: str


class StageGatePlan(Internal, frozen=True, kw_only=True):
    """What a stage's gate will judge: the backend's battery, tightened by the manifest."""

    stage: str
    rules: list[str]  # e.g. "held_out_loss <= 0.99 x the incoming model's"


class MemoryPlan(Internal, frozen=True, kw_only=True):
    """Bytes one GPU holds at the plan's micro-batch, by part (services/scheduler/gpu_memory.py: from
    measured figures, bench/memory_model.py), against what the GPU offers less a stated margin."""

    state_bytes: float  # weights, gradients and optimizer state: this GPU's shard
    activation_bytes: float  # what backward keeps of one micro-batch, under the checkpointing policy
    logits_bytes: float  # the head's output and its loss for one micro-batch
    total_bytes: float
    usable_bytes: float  # the GPU's memory less the margin
    margin: float  # the fraction of the GPU's memory left free (allocator, NCCL buffers, fragmentation)
    basis: str  # which measured figures the estimate comes from


class Plan(Internal, frozen=True, kw_only=True):
    booking_id: str
    manifest_digest: str
    strategy: str  # "single", "ddp", "fsdp2", "hsdp", "fsdp2+tp", ...
    degrees: dict[str, int]
    precision: str
    cost: CostEstimate
    checks: list[PlanCheck]
    ok: bool
    gpu_model: str = ""
    region: str = ""
    gates: list[StageGatePlan] = []  # every stage's gate with its thresholds, in run order
    capacity: CapacityPlan | None = None  # the booking's held and idle GPUs (None: an older plan)
    window: WindowPlan | None = None  # the run against the booking's remaining window
    checkpoint_bytes: int = 0
    """Room the trainer must find in its checkpoint storage before it trains: `keep_last` checkpoints
    of the largest stage (0: a plan made before this field; the trainer checks writability only)."""
    micro_batch_size: int = 0
    """Sequences each data-parallel rank runs through one forward and backward, picked by the memory
    model to fit the GPU; 0: a plan made before this field (the whole per-rank batch at once)."""
    grad_accumulation: int = 1
    """Micro-batches per optimizer step: micro_batch_size x grad_accumulation x data-parallel ranks
    is the manifest's global batch."""
    activation_checkpointing: str = "none"
    """What backward recomputes instead of keeping: "none", "selective" (every other block, as
    torchtitan's selective per-layer policy) or "full" (every block)."""
    memory: MemoryPlan | None = None
    """The per-GPU memory estimate the micro-batch was picked with (None: a plan made before it)."""
