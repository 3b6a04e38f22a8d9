"""Stable error codes: public API. Add codes, never rename or remove one."""

import enum

from contracts.base import Internal


class ErrorCode(enum.StrEnum):
    unauthenticated = "unauthenticated"
    credential_revoked = "credential_revoked"
    forbidden = "forbidden"
    booking_not_found = "booking_not_found"
    booking_incomplete = "booking_incomplete"
    booking_expired = "booking_expired"
    booking_revoked = "booking_revoked"
    booking_released = "booking_released"
    booking_mismatch = "booking_mismatch"
    eligibility_stale = "eligibility_stale"
    manifest_invalid = "manifest_invalid"
    manifest_not_absolute = "manifest_not_absolute"
    manifest_symlink = "manifest_symlink"
    manifest_not_regular = "manifest_not_regular"
    manifest_unsafe_permissions = "manifest_unsafe_permissions"
    manifest_too_large = "manifest_too_large"
    manifest_changed = "manifest_changed"
    manifest_digest_mismatch = "manifest_digest_mismatch"
    manifest_contains_secret = "manifest_contains_secret"
    confirmation_required = "confirmation_required"
    confirmation_not_found = "confirmation_not_found"
    confirmation_expired = "confirmation_expired"
    confirmation_consumed = "confirmation_consumed"
    confirmation_mismatch = "confirmation_mismatch"
    idempotency_key_invalid = "idempotency_key_invalid"
    idempotency_key_conflict = "idempotency_key_conflict"
    idempotency_in_progress = "idempotency_in_progress"
    fabric_unsupported = "fabric_unsupported"
    capacity_insufficient = "capacity_insufficient"
    data_policy_violation = "data_policy_violation"
    checkpoint_storage_unavailable = "checkpoint_storage_unavailable"
    budget_exceeded = "budget_exceeded"
    plan_wasteful = "plan_wasteful"
    run_not_found = "run_not_found"
    run_not_cancellable = "run_not_cancellable"
    timeout = "timeout"
    transport_ambiguous = "transport_ambiguous"
    backend_unavailable = "backend_unavailable"
    internal = "internal"
    # Added by the walking skeleton: a request that is not a valid message at all (unknown
    # field, wrong type, over the size cap). Distinct from manifest_invalid, which is about
    # the manifest the request carries.
    request_invalid = "request_invalid"
    # Added by the lifecycle: cleanup (and other after-the-end actions) of a run still going.
    run_not_finished = "run_not_finished"
    # Added with loss-spike approvals: approve/reject on a run that has no pending proposal.
    proposal_not_found = "proposal_not_found"
    # Added with base models and the field's data formats: refused at plan time, before anything is
    # reserved, each with the manifest's field path in the message.
    model_not_found = "model_not_found"  # no such model in the store, or not for this account
    model_digest_mismatch = "model_digest_mismatch"  # model.revision is not the stored copy's digest
    model_unsupported = "model_unsupported"  # an architecture or setting the trainer cannot train
    tokenizer_mismatch = "tokenizer_mismatch"  # the tokenizer does not fit the embeddings, or is missing
    data_schema_invalid = "data_schema_invalid"  # a data file's columns are not what its stage reads
    data_digest_mismatch = "data_digest_mismatch"  # a data file's bytes are not its declared digest
    # Added with exports: the run (or stage) has no committed checkpoint to export or sample, or the
    # export asked for is not (yet) there.
    export_not_found = "export_not_found"
    # Added with the runs list and clearer refusals: a confirmation made for another action (a train
    # one given to cancel, a cleanup one as the release one). The message names both actions and the
    # `ecc ito confirm` command that makes the right one; nothing is consumed.
    confirmation_action_mismatch = "confirmation_action_mismatch"
    # Added with TLS (docs/tls.md): the NATS server's certificate is not signed by the CA ecc was
    # given, none was given for a server that requires TLS, or a CA was given and the server speaks
    # no TLS. The message names the address and what to set (ITO_NATS_CA or `ecc ito login --ca`);
    # nothing was sent.
    tls_untrusted = "tls_untrusted"
    # Added with idle capacity and the booking's window: the run's expected wall time (with the
    # plan's margin) does not fit the booking's remaining window, and its checkpoint policy does not
    # make it resumable on a later booking. Refused at plan, confirm and train; nothing reserved.
    booking_window_exceeded = "booking_window_exceeded"
    # Added with per-tenant quotas (docs/quotas.md): over the account's request rate (the error
    # carries `retry_after_s`), or over one of its quotas (the error carries `quota`: which one,
    # its current use and its limit). Nothing was created or reserved.
    rate_limited = "rate_limited"
    quota_exceeded = "quota_exceeded"
    # Added with cost as spent: the run's metered spend reached its limit (budget_cap_usd, or the
    # booking plus max_incremental_cost_usd) and the scheduler stopped it with a checkpoint. The run
    # ends in state `budget_exhausted`; its message says what was spent against which limit.
    budget_exhausted = "budget_exhausted"
    # Added with a tenant's own inputs (contracts/files.py): a data ref, upload, file or connection
    # that is not this account's (or is not there: the two are never told apart); an upload
    # committed before every byte of it arrived (the message says which file and how much).
    data_not_found = "data_not_found"
    upload_incomplete = "upload_incomplete"


class QuotaBreach(Internal, frozen=True, kw_only=True):
    """Which quota a refused request would have gone over: its name (`confirmations`, `runs`,
    `queued`), what the account holds now and its limit."""

    quota: str
    current: int
    limit: int


class ApiError(Internal, frozen=True, kw_only=True, omit_defaults=True):
    """An error as a value: a stable code and a message that is safe to show (no secrets).
    The optional fields are on the wire only when set (older readers skip them)."""

    code: ErrorCode
    message: str
    retry_after_s: float | None = None  # rate_limited: seconds until a retry can be admitted
    quota: QuotaBreach | None = None  # quota_exceeded: which quota, the current use and the limit
