"""Every request/reply endpoint in one table: its subject, its request type and its answer's type.

Pure data. The scheduler serves the API verbs from `API`, `ecc` decodes each verb's answer into
`API[verb].answer` (never guessing a type from keys), the internal services serve theirs from
`INTERNAL` and the scheduler calls them through the same entries. An answer travels inside the
Envelope: `Envelope[answer]` decodes it in one step.
"""

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from contracts import subjects
from contracts.api import (
    ApproveRequest,
    AuthInfo,
    AuthRequest,
    BookingView,
    CancelRequest,
    CleanupOrder,
    CleanupRequest,
    CleanupResult,
    ConfirmationIssued,
    ConfirmRequest,
    FindRequest,
    LeaseAnswer,
    LeaseQuery,
    LogPage,
    LogsRequest,
    MetricsRequest,
    ModelList,
    ModelsRequest,
    MutationResult,
    PlanRequest,
    RunAccepted,
    RunItemsRequest,
    RunList,
    RunsRequest,
    RunView,
    StatusRequest,
    TrainRequest,
)
from contracts.audit import AuditRequest, AuditTrail
from contracts.desk import DeskRun, DeskRunRequest, DeskRuns, DeskRunsRequest
from contracts.exports import (
    DownloadChunk,
    DownloadOrder,
    DownloadRequest,
    ExportOrder,
    ExportRequest,
    ExportView,
    SampleOrder,
    SampleRequest,
    SampleResult,
)
from contracts.files import (
    ConnectionList,
    ConnectionsRequest,
    FileDeleted,
    FileDeleteRequest,
    FileList,
    FileRequest,
    FilesRequest,
    FileView,
    UploadCommitRequest,
    UploadPartAck,
    UploadPartRequest,
    UploadRequest,
    UploadSession,
    UploadView,
)
from contracts.internal import (
    BookingsAnswer,
    BookingsQuery,
    ConfirmationCreate,
    ConfirmationResolve,
    EligibilityQuery,
    EligibilityStatement,
    LedgerAccept,
    LedgerEntry,
    LedgerHandedOff,
    LedgerLookup,
    LedgerPending,
    LedgerPendingAnswer,
    Outstanding,
    OutstandingQuery,
)
from contracts.plans import Plan
from contracts.runs import CheckpointList, EvalList, MetricsPage

Req = TypeVar("Req")
Ans = TypeVar("Ans")


@dataclass(frozen=True, slots=True)
class Endpoint(Generic[Req, Ans]):
    """One request/reply subject (a suffix under the namespace; an API verb's subject ends in the
    caller's account), what it takes and what it answers."""

    subject: str
    request: type[Req]
    answer: Any  # a type or a type expression (`list[BookingView]`, `LedgerEntry | None`)


API: dict[str, Endpoint[Any, Any]] = {
    "auth": Endpoint(subjects.API_AUTH, AuthRequest, AuthInfo),
    "find": Endpoint(subjects.API_FIND, FindRequest, list[BookingView]),
    "plan": Endpoint(subjects.API_PLAN, PlanRequest, Plan),
    "confirm": Endpoint(subjects.API_CONFIRM, ConfirmRequest, ConfirmationIssued),
    "train": Endpoint(subjects.API_TRAIN, TrainRequest, RunAccepted),
    "status": Endpoint(subjects.API_STATUS, StatusRequest, RunView),
    "runs": Endpoint(subjects.API_RUNS, RunsRequest, RunList),
    "logs": Endpoint(subjects.API_LOGS, LogsRequest, LogPage),
    "audit": Endpoint(subjects.API_AUDIT, AuditRequest, AuditTrail),
    "metrics": Endpoint(subjects.API_METRICS, MetricsRequest, MetricsPage),
    "checkpoints": Endpoint(subjects.API_CHECKPOINTS, RunItemsRequest, CheckpointList),
    "evals": Endpoint(subjects.API_EVALS, RunItemsRequest, EvalList),
    "cancel": Endpoint(subjects.API_CANCEL, CancelRequest, MutationResult),
    "cleanup": Endpoint(subjects.API_CLEANUP, CleanupRequest, CleanupResult),
    "approve": Endpoint(subjects.API_APPROVE, ApproveRequest, MutationResult),
    "models": Endpoint(subjects.API_MODELS, ModelsRequest, ModelList),
    "export": Endpoint(subjects.API_EXPORT, ExportRequest, ExportView),
    "download": Endpoint(subjects.API_DOWNLOAD, DownloadRequest, DownloadChunk),
    "sample": Endpoint(subjects.API_SAMPLE, SampleRequest, SampleResult),
    "upload": Endpoint(subjects.API_UPLOAD, UploadRequest, UploadSession),
    "upload_part": Endpoint(subjects.API_UPLOAD_PART, UploadPartRequest, UploadPartAck),
    "upload_commit": Endpoint(subjects.API_UPLOAD_COMMIT, UploadCommitRequest, UploadView),
    "files": Endpoint(subjects.API_FILES, FilesRequest, FileList),
    "file": Endpoint(subjects.API_FILE, FileRequest, FileView),
    "file_delete": Endpoint(subjects.API_FILE_DELETE, FileDeleteRequest, FileDeleted),
    "connections": Endpoint(subjects.API_CONNECTIONS, ConnectionsRequest, ConnectionList),
}
"""The canonical API, by `ecc ito` verb (login and logout are local: they call `auth`)."""

ELIGIBILITY: Endpoint[EligibilityQuery, EligibilityStatement] = Endpoint(
    subjects.ENTITLEMENT_ELIGIBILITY, EligibilityQuery, EligibilityStatement
)
BOOKINGS: Endpoint[BookingsQuery, BookingsAnswer] = Endpoint(
    subjects.ENTITLEMENT_BOOKINGS, BookingsQuery, BookingsAnswer
)
CONFIRMATION_CREATE: Endpoint[ConfirmationCreate, ConfirmationIssued] = Endpoint(
    subjects.CONFIRMATION_CREATE, ConfirmationCreate, ConfirmationIssued
)
CONFIRMATION_RESOLVE: Endpoint[ConfirmationResolve, ConfirmationIssued] = Endpoint(
    subjects.CONFIRMATION_RESOLVE, ConfirmationResolve, ConfirmationIssued
)
CONFIRMATION_OUTSTANDING: Endpoint[OutstandingQuery, Outstanding] = Endpoint(
    subjects.CONFIRMATION_OUTSTANDING, OutstandingQuery, Outstanding
)
LEDGER_LOOKUP: Endpoint[LedgerLookup, LedgerEntry | None] = Endpoint(
    subjects.LEDGER_LOOKUP, LedgerLookup, LedgerEntry | None
)
LEDGER_ACCEPT: Endpoint[LedgerAccept, LedgerEntry] = Endpoint(
    subjects.LEDGER_ACCEPT, LedgerAccept, LedgerEntry
)
LEDGER_HANDED_OFF: Endpoint[LedgerHandedOff, LedgerEntry] = Endpoint(
    subjects.LEDGER_HANDED_OFF, LedgerHandedOff, LedgerEntry
)
LEDGER_PENDING: Endpoint[LedgerPending, LedgerPendingAnswer] = Endpoint(
    subjects.LEDGER_PENDING, LedgerPending, LedgerPendingAnswer
)
DESK: dict[str, Endpoint[Any, Any]] = {
    "runs": Endpoint(subjects.DESK_RUNS, DeskRunsRequest, DeskRuns),
    "run": Endpoint(subjects.DESK_RUN, DeskRunRequest, DeskRun),
}
"""The desk's reads of the scheduler (only the desk identity may ask; answered to its inbox only)."""

RUN_LEASE: Endpoint[LeaseQuery, LeaseAnswer] = Endpoint(subjects.RUN_LEASE, LeaseQuery, LeaseAnswer)
TRAINER_CLEANUP: Endpoint[CleanupOrder, CleanupResult] = Endpoint(
    subjects.TRAINER_CLEANUP, CleanupOrder, CleanupResult
)
TRAINER_EXPORT: Endpoint[ExportOrder, ExportView] = Endpoint(subjects.TRAINER_EXPORT, ExportOrder, ExportView)
TRAINER_DOWNLOAD: Endpoint[DownloadOrder, DownloadChunk] = Endpoint(
    subjects.TRAINER_DOWNLOAD, DownloadOrder, DownloadChunk
)
TRAINER_SAMPLE: Endpoint[SampleOrder, SampleResult] = Endpoint(
    subjects.TRAINER_SAMPLE, SampleOrder, SampleResult
)

INTERNAL: tuple[Endpoint[Any, Any], ...] = (
    ELIGIBILITY,
    BOOKINGS,
    CONFIRMATION_CREATE,
    CONFIRMATION_RESOLVE,
    LEDGER_LOOKUP,
    LEDGER_ACCEPT,
    LEDGER_HANDED_OFF,
    LEDGER_PENDING,
    RUN_LEASE,
    TRAINER_CLEANUP,
    TRAINER_EXPORT,
    TRAINER_DOWNLOAD,
    TRAINER_SAMPLE,
)
"""Service-to-service endpoints (signed by the scheduler where the service checks it)."""
