"""The trainer's work item and the events a run emits (state, logs, metrics, checkpoints)."""

import enum
from datetime import datetime

import msgspec

from contracts.api import RestartProposal
from contracts.base import Internal
from contracts.evals import EvalMetric, ProvenanceStep, StageGate
from contracts.files import DataInput
from contracts.models import BaseModel
from contracts.plans import Plan
from contracts.states import RunState


class TrainWork(Internal, frozen=True, kw_only=True):
    """One run handed to the trainer's work queue (published with Nats-Msg-Id = run id)."""

    run_id: str
    account: str
    booking_id: str
    manifest_text: str
    manifest_digest: str
    plan: Plan
    checkpoint_dir: str
    restart: RestartProposal | None = None  # an approved restart: resume from it, not from the latest
    # Multi-node runs: one item per node (Nats-Msg-Id `<run id>` for node 0, `<run id>:node-<n>` for
    # the others), each node a torchft replica group. Node 0 hosts `rendezvous` (host:port, chosen
    # by the scheduler): a TCPStore where it publishes its Lighthouse's address and the nodes meet.
    node_rank: int = 0
    nodes: int = 1
    rendezvous: str = ""
    # The run's rendezvous key (multi-node runs): a random secret the scheduler mints per run, from
    # which node 0's store and every node derive the store key (training/launch/rendezvous.py):
    # only the run's own nodes get in. Never logged, never in an event or an answer.
    rendezvous_key: str = ""
    # The base model the manifest names, as the scheduler resolved it from the model store at plan
    # time (its digest checked); the trainer reads its weights from the store by this digest.
    base: BaseModel | None = None
    # The cost bound of the confirmation the run consumed: the most the person authorised it to
    # spend. The run's spend limit is never above it (domain/budget.py); None on items
    # signed before the bound was carried (their limit is the manifest's alone).
    cost_bound_usd: float | None = None
    # The SHA-256 of the run's curriculum (its stages, data, steps and gates) as the scheduler planned
    # and priced it (domain/curriculum.py `curriculum_digest`): the trainer plans the stages
    # once from the manifest above and trains them only if they are these. Empty on items signed
    # before it was carried.
    curriculum_digest: str = ""
    # The tenant's own data refs (uploads, `file:` refs under its root, `s3://` objects through its
    # connections) as the scheduler resolved and checked them at plan time: the trainer reads each
    # by its locator and trains on it only if its bytes are the digest here; it never opens a path
    # the manifest wrote. Empty on items signed before it was carried (their tenant refs are refused).
    inputs: list[DataInput] = []


class LogLevel(enum.StrEnum):
    """A `LogLine`'s level; the values are the wire strings."""

    info = "info"
    warning = "warning"
    error = "error"


class Outcome(enum.StrEnum):
    """How a run's pipeline ended, as the trainer's worker turns it into the run's final state."""

    succeeded = "succeeded"
    gate_failed = "gate_failed"  # a stage's eval gate failed; nothing overrides it
    stopped = "stopped"  # the stop flag was set; the in-flight checkpoint was committed first


class StopReason(enum.StrEnum):
    """Why a trainer stopped a run's training loop before its end."""

    cancelled = "cancelled"  # the lease says the run is being cancelled
    fenced = "fenced"  # the lease is lost or withdrawn: another trainer holds (or will hold) the run
    loss_spike = "loss_spike"  # the spike watch saw a loss spike; the run waits for approval
    budget_exhausted = "budget_exhausted"  # the scheduler stops the run: its spend reached its limit


class RunEventBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):  # internal: lenient
    run_id: str
    seq: int  # per-run, grows; with run_id it is the Nats-Msg-Id of the event
    at: datetime
    epoch: int = 0  # the trainer's lease epoch; events of a fenced (older) epoch are dropped


class StateChanged(RunEventBase, tag="state", frozen=True, kw_only=True):
    state: RunState
    stage: str | None = None
    message: str | None = None
    total_steps: int = 0
    # An `interrupted` for a gang lost past its launcher's restarts: the run's requeues for a lost
    # gang, this one included (stored as `RunView.gang_requeues`); None for any other change.
    gang_requeues: int | None = None


class LogLine(RunEventBase, tag="log", frozen=True, kw_only=True):
    level: str = "info"  # a LogLevel value; kept a str so a reader survives a level it does not know
    message: str


class Metrics(RunEventBase, tag="metrics", frozen=True, kw_only=True):
    stage: str
    step: int
    total_steps: int
    loss: float
    learning_rate: float
    tokens_per_s: float
    grad_norm: float
    data_wait_s: float = 0.0  # time this step waited for its batch (desk telemetry: data loading)


class CheckpointSaved(RunEventBase, tag="checkpoint", frozen=True, kw_only=True):
    step: int
    path: str
    bytes: int
    stall_s: float
    save_s: float


class StageStarted(RunEventBase, tag="stage", frozen=True, kw_only=True):
    stage: str  # "data_prep", "ladder", "pretrain", "midtrain", "long_context", "sft", "dpo", "rlvr"
    total_steps: int = 0


class EvalResult(RunEventBase, tag="eval", frozen=True, kw_only=True):
    """A stage's fixed eval battery and its gate: every metric, its threshold, pass or fail."""

    stage: str
    metrics: list[EvalMetric]
    passed: bool
    findings: list[str] = []  # what the battery noticed but does not gate (e.g. overfitting)


class DataProvenance(RunEventBase, tag="provenance", frozen=True, kw_only=True):
    """What data preparation did: counts before/after each step, input and output digests."""

    steps: list[ProvenanceStep]
    input_digest: str
    output_digest: str


class ProposalMade(RunEventBase, tag="proposal", frozen=True, kw_only=True):
    """The trainer paused the run (`awaiting_approval`) and proposes this restart."""

    proposal: RestartProposal


class ParallelismStarted(RunEventBase, tag="parallelism", frozen=True, kw_only=True):
    """A gang of ranks started a stage: the strategy, world size and mesh it really runs with."""

    stage: str
    strategy: str
    world_size: int
    mesh: dict[str, int] = {}  # dim name -> size, outermost first
    nodes: int = 1


class RunCreated(RunEventBase, tag="created", frozen=True, kw_only=True):
    """Published by the scheduler at hand-off: what desk telemetry rolls a run up by."""

    account: str
    booking_id: str
    region: str
    gpu_model: str
    gpus: int
    accepted_at: datetime
    # The booking the run is on, for the desk's idle GPU-hours: its GPUs and its whole window's
    # GPU-hours (0: not known, a run handed off before these were carried).
    booked_gpus: int = 0
    booked_gpu_hours: float = 0.0


class Interruption(RunEventBase, tag="interruption", frozen=True, kw_only=True):
    """Published by the scheduler's liveness watcher when a run's trainer went silent."""

    cause: str  # "trainer_lost", ...
    silent_s: float
    step: int = 0


RunEvent = (
    StateChanged
    | LogLine
    | Metrics
    | CheckpointSaved
    | StageStarted
    | EvalResult
    | DataProvenance
    | RunCreated
    | Interruption
    | ProposalMade
    | ParallelismStarted
)


class MetricsPage(Internal, frozen=True, kw_only=True):  # `ecc ito metrics`
    run_id: str
    points: list[Metrics]
    next: int


class CheckpointList(Internal, frozen=True, kw_only=True):  # `ecc ito checkpoints`: committed ones only
    run_id: str
    checkpoints: list[CheckpointSaved]
    cleaned_up: bool = False


class EvalList(Internal, frozen=True, kw_only=True):  # `ecc ito evals`
    run_id: str
    gates: list[StageGate]
