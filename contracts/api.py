"""Requests from `ecc` to the scheduler (the canonical API) and the data its answers carry: the
account, bookings, confirmations, runs and their lifecycle, and the scheduler's lease with the
trainer. The `plan` verb's answer is contracts/plans.py; exports, downloads and samples of a trained
model are contracts/exports.py; uploads and files are contracts/files.py.
"""

import enum
from datetime import datetime
from typing import Annotated

import msgspec

from contracts.base import Contract, Internal
from contracts.booking import Booking
from contracts.evals import Provenance, StageGate
from contracts.plans import Plan
from contracts.states import RunState


class Credential(Contract, frozen=True, kw_only=True):
    """Identity, not authority. Kept for compatibility: the caller's account now comes from the NATS
    credential that the server authenticated; `api_key` must be absent (a key on the wire is refused)."""

    account: str
    api_key: str | None = None

    def __repr__(self) -> str:  # never print the key
        return f"Credential(account={self.account!r}, api_key=<redacted>)"


class Action(enum.StrEnum):
    train = "train"
    cancel = "cancel"
    cleanup = "cleanup"
    release_booking = "release_booking"
    restart_from_checkpoint = "restart_from_checkpoint"
    delete_file = "delete_file"  # one of the account's uploaded files (`ecc ito files delete`)


BOOKING_ACTIONS: frozenset[Action] = frozenset({Action.train, Action.release_booking})
"""The actions whose confirmation targets a booking; the others target one of the account's runs
(or, FILE_ACTIONS, one of its files)."""
FILE_ACTIONS: frozenset[Action] = frozenset({Action.delete_file})
"""The actions whose confirmation targets one of the account's uploaded files."""


RUNS_PAGE_DEFAULT = 20  # runs in one `ecc ito runs` page: a screenful
RUNS_PAGE_MAX = 100  # a summary is ~0.5 KB: a full page stays far under NATS's 1 MiB payload

# --- requests ---


class AuthRequest(Contract, frozen=True, kw_only=True):
    credential: Credential | None = None  # optional: the account comes from the authenticated subject


class FindRequest(Contract, frozen=True, kw_only=True):
    credential: Credential | None = None  # optional: the account comes from the authenticated subject


class PlanRequest(Contract, frozen=True, kw_only=True):
    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    booking_id: str
    manifest_text: str  # the exact bytes the client hashed, as UTF-8 text
    manifest_digest: str  # the client's SHA-256; the server recomputes it and never trusts it alone


class ConfirmRequest(Contract, frozen=True, kw_only=True):
    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    action: Action
    booking_id: str | None = None
    run_id: str | None = None
    manifest_text: str | None = None
    manifest_digest: str | None = None
    max_cost_usd: float | None = None
    file_id: str | None = None  # delete_file: the file (`ecc ito files list`)


class TrainRequest(Contract, frozen=True, kw_only=True):
    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    booking_id: str
    manifest_text: str
    manifest_digest: str
    idempotency_key: str
    confirmation_ref: str | None = None


class StatusRequest(Contract, frozen=True, kw_only=True):
    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    run_id: str | None = None
    idempotency_key: str | None = None


class RunsRequest(Contract, frozen=True, kw_only=True):
    """`ecc ito runs`: the caller's own runs, newest first, one page at a time."""

    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    state: RunState | None = None  # only runs in this state
    booking_id: str | None = None  # only runs on this booking
    limit: Annotated[int, msgspec.Meta(ge=1, le=RUNS_PAGE_MAX)] = RUNS_PAGE_DEFAULT
    cursor: Annotated[str, msgspec.Meta(max_length=256)] | None = None  # the previous page's `next`


class LogsRequest(Contract, frozen=True, kw_only=True):
    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    run_id: str
    since: int = 0  # index of the first line wanted
    limit: int = 200


# --- answers (Envelope.data) ---


class QuotaLimits(Internal, frozen=True, kw_only=True):
    """An account's quotas (the operator's `ito-training accounts quota`; docs/quotas.md)."""

    rate_per_s: float  # plan, confirm and train requests per second, sustained (the bucket's refill)
    burst: int  # requests admitted at once after a quiet spell (the bucket's size)
    confirmations: int  # confirmations issued and neither consumed nor expired
    runs: int  # runs not finished (every state but succeeded, failed, gate_failed, cancelled)
    queued: int  # runs waiting for a trainer (accepted, queued, interrupted)
    # Added with uploads (contracts/files.py): what the account may keep in the tenant store and the
    # model store. 0: not reported (an older scheduler).
    file_bytes: int = 0  # bytes of files and uploaded models, uploads under way included
    files: int = 0  # data files, uploads under way included
    models: int = 0  # models the account uploaded (`ecc ito models upload`)


class QuotaUsage(Internal, frozen=True, kw_only=True):
    tokens: float  # requests the bucket would admit right now (at most `burst`)
    confirmations: int | None  # None: the confirmation service did not answer in time
    runs: int
    queued: int
    file_bytes: int = 0
    files: int = 0
    models: int = 0


class QuotaStatus(Internal, frozen=True, kw_only=True):
    limits: QuotaLimits
    usage: QuotaUsage


class AuthInfo(Internal, frozen=True, kw_only=True):
    account: str
    key_id: str
    quotas: QuotaStatus | None = None  # the account's limits and what it uses now (None: an older scheduler)


class BookingView(Internal, frozen=True, kw_only=True):
    booking: Booking
    allows_training: bool
    reason: str | None = None


class ConfirmationIssued(Internal, frozen=True, kw_only=True):
    confirmation_ref: str
    action: Action
    target: str
    manifest_digest: str | None
    max_cost_usd: float | None
    expires_at: datetime


class RunAccepted(Internal, frozen=True, kw_only=True):
    run_id: str
    state: RunState
    replay: bool = False
    # The spec's stable identifiers, on the first answer and on a replay alike.
    booking_id: str = ""
    manifest_digest: str = ""
    idempotency_key: str = ""


class RestartProposal(Internal, frozen=True, kw_only=True):
    """PaLM's remedy for a loss spike: go back to an earlier checkpoint and skip the batches around
    the spike. Proposed by the trainer, carried out only with a `restart_from_checkpoint` confirmation."""

    stage: str
    checkpoint_step: int
    skip_from: int  # first batch (data position) to skip
    skip_to: int  # one past the last batch to skip
    spike_step: int
    reason: str


class Parallelism(Internal, frozen=True, kw_only=True):
    """How a run's training actually ran: the gang's strategy, its world size and device mesh."""

    strategy: str  # "ddp", "fsdp2", "hsdp", "fsdp2+tp"
    world_size: int
    mesh: dict[str, int] = {}  # dim name -> size, outermost first ("dp_replicate", "dp_shard", "tp")
    nodes: int = 1
    stage: str | None = None  # the stage whose gang reported it last


class Spend(Internal, frozen=True, kw_only=True):
    """What a run has spent so far, as its trainer metered it: every GPU of its placement, held
    from the trainer's start of the run until release, at the booking's price (services/scheduler/
    budget.py). Grows only; a resumed attempt carries the earlier attempts' GPU-seconds."""

    held_gpus: int
    held_gpu_s: float  # GPU-seconds held, all attempts together
    spent_usd: float  # held_gpu_s / 3600 x the plan's price per GPU-hour
    limit_usd: float  # the lowest of budget_cap_usd, the booking plus max_incremental_cost_usd, and the confirmation's cost bound
    at: datetime


class RunView(Internal, frozen=True, kw_only=True):
    run_id: str
    account: str
    booking_id: str
    manifest_digest: str
    idempotency_key: str
    state: RunState
    stage: str | None = None
    step: int = 0
    total_steps: int = 0
    loss: float | None = None
    created_at: datetime
    updated_at: datetime
    plan: Plan | None = None
    message: str | None = None
    gates: list[StageGate] = []  # every stage's eval gate as it really is; a failed one shows failed
    provenance: Provenance | None = None
    checkpoint_dir: str | None = None
    last_checkpoint_step: int | None = None
    cleaned_up: bool = False
    proposal: RestartProposal | None = None  # while awaiting_approval: what the trainer proposes
    parallelism: Parallelism | None = None  # a gang's strategy, world size and mesh, as it started
    nodes: int = 1  # the nodes (trainer agents, one torchft replica group each) the run trains on
    # Requeues for a gang lost past its launcher's restarts (this count, not JetStream's deliveries,
    # is what ITO_GANG_MAX_REQUEUES bounds: a redelivery for a lost agent or a fence costs nothing).
    gang_requeues: int = 0
    spend: Spend | None = None  # set at hand-off (nothing spent yet), then by every meter reading
    # Why the scheduler is stopping the run, as an error code ("budget_exhausted"), while it stops;
    # a person's cancel leaves it empty.
    stop_code: str = ""


class RunSummary(Internal, frozen=True, kw_only=True):
    """One line of `ecc ito runs`: a run's identifiers, state and progress (`status` has the rest)."""

    run_id: str
    state: RunState
    booking_id: str
    manifest_digest: str
    idempotency_key: str
    created_at: datetime
    updated_at: datetime
    stage: str | None = None
    step: int = 0
    total_steps: int = 0
    loss: float | None = None
    estimate_usd: float | None = None  # the plan's total, when the run has one
    message: str | None = None


class RunList(Internal, frozen=True, kw_only=True):
    """A page of the caller's runs, newest first. `next`: pass it as `cursor` for the page after
    (None: there are no more). A filtered page may hold fewer than `limit` runs and still have a
    `next`: the scheduler reads a bounded number of runs per request."""

    runs: list[RunSummary]
    next: str | None = None


def accepted(view: RunView, replay: bool = False) -> RunAccepted:
    """The train answer for a run: its stable identifiers and state (the scheduler's first answer
    and replays, and `ecc`'s answer found by idempotency key after a lost one, alike)."""
    return RunAccepted(
        run_id=view.run_id,
        state=view.state,
        replay=replay,
        booking_id=view.booking_id,
        manifest_digest=view.manifest_digest,
        idempotency_key=view.idempotency_key,
    )


class LogLineView(Internal, frozen=True, kw_only=True):
    index: int
    at: datetime
    level: str
    message: str


class LogPage(Internal, frozen=True, kw_only=True):
    run_id: str
    lines: list[LogLineView]
    next: int


class MetricsRequest(Contract, frozen=True, kw_only=True):
    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    run_id: str
    since: int = 0
    limit: int = 1000


class RunItemsRequest(Contract, frozen=True, kw_only=True):
    """`checkpoints` and `evals`: one run's list."""

    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    run_id: str


class CancelRequest(Contract, frozen=True, kw_only=True):
    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    run_id: str
    idempotency_key: str
    confirmation_ref: str | None = None


class CleanupRequest(Contract, frozen=True, kw_only=True):
    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    run_id: str
    idempotency_key: str
    confirmation_ref: str | None = None
    release_booking: bool = False
    release_confirmation_ref: str | None = None  # its own `release_booking` confirmation


class MutationResult(Internal, frozen=True, kw_only=True):
    run_id: str
    action: Action
    state: RunState
    replay: bool = False
    booking_id: str = ""  # the target run's
    manifest_digest: str = ""  # the target run's
    idempotency_key: str = ""  # this mutation's


class RemovedArtifact(Internal, frozen=True, kw_only=True):
    path: str
    bytes: int


class CleanupResult(Internal, frozen=True, kw_only=True):
    run_id: str
    removed: list[RemovedArtifact]
    booking_release_requested: bool = False
    replay: bool = False
    booking_id: str = ""  # the target run's
    manifest_digest: str = ""  # the target run's
    idempotency_key: str = ""  # this cleanup's


class CleanupOrder(Internal, frozen=True, kw_only=True):
    """scheduler -> trainer: remove a finished run's artifacts (-> CleanupResult)."""

    account: str
    run_id: str
    checkpoint_dir: str  # informational: the trainer derives the directory from its own root
    storage: str = "local"  # the manifest's checkpoint storage: "local" or an absolute root


class LeaseQuery(Internal, frozen=True, kw_only=True):
    """trainer -> scheduler: may this run be trained now? (-> LeaseAnswer)

    Epoch 0 asks for a new lease; a held epoch renews it, and each renewal is the trainer's
    heartbeat. A lease granted to another trainer raises the epoch and fences the old holder."""

    run_id: str
    trainer_id: str = ""
    epoch: int = 0
    # The work item's binding: a lease is granted only when it matches the run record (a forged or
    # swapped item for a real run id gets nothing). Empty on renewals.
    account: str = ""
    booking_id: str = ""
    manifest_digest: str = ""
    plan_sha256: str = ""
    node_rank: int = 0  # a multi-node run's nodes each hold their own lease; node 0's is the run's
    # Node n > 0's own failure, as a safe sentence: the run fails naming the node (its holder at
    # `epoch` only). Node 0 reports through the run's events instead.
    failure: str = ""
    # Node 0's meter (renewals only): the GPUs its placement holds and the GPU-seconds held so far
    # (all attempts), and how long a clean stop would take now (a step plus a checkpoint save).
    held_gpus: int = 0
    held_gpu_s: float = 0.0
    stop_s: float = 0.0


class LeaseAnswer(Internal, frozen=True, kw_only=True):
    run_id: str
    proceed: bool
    state: RunState | None = None
    epoch: int = 0
    gang_requeues: int = 0  # the run's `RunView.gang_requeues` when asked: how many it has used
    held_gpu_s: float = 0.0  # GPU-seconds metered so far: a resumed attempt's meter starts here
    stop_code: str = ""  # the run's `RunView.stop_code`: why the scheduler stops it ("budget_exhausted")


class ApproveRequest(Contract, frozen=True, kw_only=True):
    """Approve (with a `restart_from_checkpoint` confirmation) or reject a paused run's proposal."""

    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    run_id: str
    idempotency_key: str
    confirmation_ref: str | None = None
    reject: bool = False


# --- models (the Hugging Face base models a manifest may name; exports and samples of a trained
# model: contracts/exports.py) ---


class ModelsRequest(Contract, frozen=True, kw_only=True):
    """`ecc ito models`: the base models this account may name in a manifest."""

    credential: Credential | None = None  # optional: the account comes from the authenticated subject


class ModelView(Internal, frozen=True, kw_only=True):
    name: str
    digest: str  # put it in the manifest's model.revision
    family: str
    architecture: str
    parameters: int
    vocab_size: int
    max_seq_len: int
    tokenizer: bool
    chat_template: bool
    bytes: int


class ModelList(Internal, frozen=True, kw_only=True):
    models: list[ModelView]
