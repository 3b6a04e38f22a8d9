"""A tenant's reads of one of its own runs: `status` (by run id, or by the idempotency key that
created it), `audit`, `metrics`, `checkpoints`, `evals` and `logs`.

Each is scoped to the authenticated account: another account's run gets `run_not_found`, the same
answer as no run at all. Nothing here writes. (`runs`, the list of the caller's runs, is
services/scheduler/listing.py.)
"""

import msgspec

from contracts.api import LogPage, LogsRequest, MetricsRequest, RunItemsRequest, RunView, StatusRequest
from contracts.audit import AuditRequest, AuditTrail
from contracts.errors import ErrorCode
from contracts.runs import CheckpointList, EvalList, MetricsPage
from runtime.messaging.codec import Refusal
from runtime.tenancy.accounts import Credentials
from services.scheduler.admission import authenticate
from services.scheduler.audit import Auditor
from services.scheduler.handoff import Handoff
from services.scheduler.peers import Peers
from services.scheduler.store import RunRecords

METRICS_PAGE_MAX = 5000  # points in one `metrics` answer at most (a run keeps store.MAX_METRIC_POINTS)
LOGS_PAGE_MAX = 1000  # lines in one `logs` answer at most (a run keeps store.MAX_LOG_LINES)


def tenant_view(view: RunView) -> RunView:
    """A run as its tenant reads it: the scheduler's own record less the server's directories (the
    run's checkpoint directory is where the trainer writes, not something a tenant names)."""
    return msgspec.structs.replace(view, checkpoint_dir=None)


class RunReads:
    def __init__(
        self, credentials: Credentials, runs: RunRecords, peers: Peers, handoff: Handoff, auditor: Auditor
    ) -> None:
        self.credentials = credentials
        self.runs = runs
        self.peers = peers  # the ledger: a run looked up by its idempotency key
        self.handoff = handoff  # a run the ledger has but whose view is not written yet
        self.auditor = auditor

    async def _owned(self, caller: str, req, run_id: str) -> tuple[str, RunView]:
        """The caller's account and its run `run_id`, or `run_not_found`."""
        account = (await authenticate(self.credentials, caller, req)).account
        view = await self.runs.get(account, run_id)
        if view is None:
            raise Refusal(ErrorCode.run_not_found, "no such run for this account")
        return account, view

    async def status(self, caller: str, req: StatusRequest) -> RunView:
        return tenant_view(await self._status(caller, req))

    async def _status(self, caller: str, req: StatusRequest) -> RunView:
        if req.run_id is not None:
            return (await self._owned(caller, req, req.run_id))[1]
        account = (await authenticate(self.credentials, caller, req)).account
        if req.idempotency_key is None:
            raise Refusal(ErrorCode.request_invalid, "status needs a run id or --idempotency-key")
        entry = await self.peers.ledger_lookup(account, req.idempotency_key)
        if entry is None:
            raise Refusal(ErrorCode.run_not_found, "no run was created with this idempotency key")
        view = await self.runs.get(account, entry.run_id)
        return view if view is not None else self.handoff.view_from(entry)

    async def audit(self, caller: str, req: AuditRequest) -> AuditTrail:
        """A run's gate decisions, replayed from the audit stream (tenant-scoped)."""
        account, _ = await self._owned(caller, req, req.run_id)
        decisions = [d for d in await self.auditor.read(req.run_id) if d.account == account]
        return AuditTrail(run_id=req.run_id, decisions=decisions)

    async def metrics(self, caller: str, req: MetricsRequest) -> MetricsPage:
        account, _ = await self._owned(caller, req, req.run_id)
        since, limit = max(0, req.since), max(1, min(req.limit, METRICS_PAGE_MAX))
        points = await self.runs.metrics(account, req.run_id, since, limit)
        return MetricsPage(run_id=req.run_id, points=points, next=since + len(points))

    async def checkpoints(self, caller: str, req: RunItemsRequest) -> CheckpointList:
        account, view = await self._owned(caller, req, req.run_id)
        return CheckpointList(
            run_id=req.run_id,
            checkpoints=await self.runs.checkpoints(account, req.run_id),
            cleaned_up=view.cleaned_up,
        )

    async def evals(self, caller: str, req: RunItemsRequest) -> EvalList:
        _, view = await self._owned(caller, req, req.run_id)
        return EvalList(run_id=req.run_id, gates=view.gates)

    async def logs(self, caller: str, req: LogsRequest) -> LogPage:
        account, _ = await self._owned(caller, req, req.run_id)
        since, limit = max(0, req.since), max(1, min(req.limit, LOGS_PAGE_MAX))
        lines = await self.runs.logs(account, req.run_id, since, limit)
        return LogPage(run_id=req.run_id, lines=lines, next=since + len(lines))
