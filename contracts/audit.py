"""Gate decisions: who asked, for what, which gate, pass or fail with its code. Never a secret."""

from datetime import datetime

from contracts.api import Action, Credential
from contracts.base import Contract, Internal


class GateDecision(Internal, frozen=True, kw_only=True):
    request_id: str  # the run id the request would create (or created)
    at: datetime
    account: str
    action: Action
    gate: str
    ok: bool
    code: str | None = None
    booking_id: str | None = None
    manifest_digest: str | None = None


class AuditRequest(Contract, frozen=True, kw_only=True):
    credential: Credential | None = None  # optional: the account comes from the authenticated subject
    run_id: str


class AuditTrail(Internal, frozen=True, kw_only=True):
    run_id: str
    decisions: list[GateDecision]


class AuditRecord(Internal, frozen=True, kw_only=True):
    """One request's gate decisions, in the order they were made: one message on
    `<ns>.v1.audit.<request_id>` per request (published when the request ends, whatever the outcome)."""

    request_id: str
    decisions: list[GateDecision]
