"""Every subject and stream name, in one place.

Names are suffixes under a namespace (`ITO_NAMESPACE`, default `ito`), so that test runs on a
shared server never see each other: the full subject is `f"{namespace}.{suffix}"` and a stream is
`f"{namespace.upper()}_{STREAM}"`. Request/reply subjects (`v1.api.*`, `v1.<service>.*`) are kept
out of every stream's filter: a captured subject would answer with a PubAck, not the reply.
"""

# --- CLI -> scheduler (core NATS request/reply; the scheduler is the canonical API) ---
API_AUTH = "v1.api.auth"
API_FIND = "v1.api.find"
API_PLAN = "v1.api.plan"
API_CONFIRM = "v1.api.confirm"
API_TRAIN = "v1.api.train"
API_STATUS = "v1.api.status"
API_RUNS = "v1.api.runs"  # the caller's own runs, newest first, paged
API_LOGS = "v1.api.logs"
API_AUDIT = "v1.api.audit"
API_METRICS = "v1.api.metrics"
API_CHECKPOINTS = "v1.api.checkpoints"
API_EVALS = "v1.api.evals"
API_CANCEL = "v1.api.cancel"
API_CLEANUP = "v1.api.cleanup"
API_APPROVE = "v1.api.approve"
API_MODELS = "v1.api.models"
API_EXPORT = "v1.api.export"
API_DOWNLOAD = "v1.api.download"
API_SAMPLE = "v1.api.sample"
# A tenant's own inputs (contracts/files.py): uploads in parts, the files they become, connections.
API_UPLOAD = "v1.api.upload"  # begin (or resume) an upload
API_UPLOAD_PART = "v1.api.upload_part"  # one part of one of its files
API_UPLOAD_COMMIT = "v1.api.upload_commit"  # check it and keep it (asked again: its state)
API_FILES = "v1.api.files"  # the account's files and open uploads
API_FILE = "v1.api.file"  # one file
API_FILE_DELETE = "v1.api.file_delete"  # a confirmed, idempotent delete
API_CONNECTIONS = "v1.api.connections"  # the named connections the operator made for the account

# --- desk -> scheduler (core NATS request/reply): every run, and one in detail (contracts/desk.py) ---
DESK_RUNS = "v1.desk.runs"
DESK_RUN = "v1.desk.run"

# --- trainer <-> scheduler (core NATS) ---
RUN_LEASE = "v1.scheduler.lease"  # a trainer asks whether a run may (still) be trained
CONTROL_CANCEL = "v1.control.cancel"  # `<ns>.v1.control.cancel.<run_id>`: stop within seconds
TRAINER_CLEANUP = "v1.trainer.cleanup"  # any trainer (queue group) removes a finished run's artifacts
TRAINER_EXPORT = "v1.trainer.export"  # any trainer writes (or reports) a run's export
TRAINER_DOWNLOAD = "v1.trainer.download"  # any trainer reads one chunk of an export
TRAINER_SAMPLE = "v1.trainer.sample"  # any trainer generates from a run's committed checkpoint
TRAINER_QUEUE = "trainers"
# To ito-compute: `<ns>.compute.v1.requests.release` asks upstream to release a booking.
BOOKING_RELEASE_REQUESTS = "compute.v1.requests.release"

# --- scheduler -> internal services (core NATS request/reply) ---
ENTITLEMENT_ELIGIBILITY = "v1.entitlement.eligibility"
ENTITLEMENT_BOOKINGS = "v1.entitlement.bookings"
CONFIRMATION_CREATE = "v1.confirmation.create"
CONFIRMATION_RESOLVE = "v1.confirmation.resolve"
CONFIRMATION_OUTSTANDING = "v1.confirmation.outstanding"  # how many an account holds (its quota)
LEDGER_LOOKUP = "v1.ledger.lookup"
LEDGER_ACCEPT = "v1.ledger.accept"
LEDGER_HANDED_OFF = "v1.ledger.handed_off"
LEDGER_PENDING = "v1.ledger.pending"

# Every service answers `v1.health.<service>` once it is subscribed and connected.
HEALTH = "v1.health"

# --- JetStream streams: (stream suffix, subject filter suffix) ---
# Upstream booking events from ito-compute: `<ns>.compute.v1.booking.<event>`.
BOOKING_EVENTS = "compute.v1.booking"
STREAM_BOOKINGS = "BOOKINGS"
# The trainer's work queue (retention=workqueue), published with Nats-Msg-Id = run id.
WORK_TRAIN = "v1.work.train"
STREAM_WORK = "WORK"
# Run events from the trainer: `<ns>.v1.run.<run_id>.<kind>`.
RUN_EVENTS = "v1.run"
STREAM_RUNS = "RUNS"
# Gate decisions, replayable: `<ns>.v1.audit.<request_id>` (the request id is the run id).
AUDIT = "v1.audit"
STREAM_AUDIT = "AUDIT"
# Desk telemetry for pricing subscribers: `desk.telemetry.>` (not namespaced for the default
# namespace; tests use `<ns>.desk.telemetry.>`).
DESK_TELEMETRY = "desk.telemetry"
STREAM_DESK = "DESK"
# Live progress of running runs for the desk (core NATS, not kept: the stream has the finished
# runs): `desk.live.<run_id>`, or `<ns>.desk.live.<run_id>` outside the default namespace.
DESK_LIVE = "desk.live"

# Durable consumer names.
CONSUMER_ENTITLEMENT = "entitlement-bookings"
CONSUMER_TRAINER = "trainer"
CONSUMER_SCHEDULER_RUNS = "scheduler-runs"

CONSUMER_TELEMETRY = "telemetry-runs"

SERVICES = ("entitlement", "confirmation", "ledger", "scheduler", "trainer", "telemetry")
