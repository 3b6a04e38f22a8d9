"""The desk's two reads: every run (newest first, with the desk's prices), and one run in detail.

Served only to the desk identity (its NATS permissions, and the answer's inbox: services/scheduler/
app.py). Read-only: nothing here writes a run, and no tenant verb goes through it. A run's detail
is paged like the tenant verbs (`metrics_since`, `logs_since`), so a page that stays open asks
for what is new only; the audit trail replays a stream, so it comes only when asked for.
"""

from datetime import UTC, datetime
from typing import Any, Protocol

import msgspec

from contracts.api import LogLineView, RunView
from contracts.audit import GateDecision
from contracts.desk import DeskRun, DeskRunRequest, DeskRuns, DeskRunsRequest, InterruptionRecord, StateRecord
from contracts.errors import ErrorCode
from contracts.runs import CheckpointSaved, Metrics
from runtime.messaging.codec import Refusal
from services.scheduler.prices import PriceTable

MAX_RUNS = 1000  # one answer's runs at most, whatever the request asks
MAX_METRICS = 10_000
MAX_LOGS = 500

_interruption = msgspec.convert  # the watcher's records are plain dicts in the store


class DeskRecords(Protocol):
    """What the desk reads of the run store (RunStore, memory.InMemoryRuns)."""

    async def newest(self, limit: int) -> list[RunView]: ...
    async def owner(self, run_id: str) -> str | None: ...
    async def get(self, account: str, run_id: str) -> RunView | None: ...
    async def metrics(self, account: str, run_id: str, since: int, limit: int) -> list[Metrics]: ...
    async def logs(self, account: str, run_id: str, since: int, limit: int) -> list[LogLineView]: ...
    async def checkpoints(self, account: str, run_id: str) -> list[CheckpointSaved]: ...
    async def states(self, account: str, run_id: str) -> list[StateRecord]: ...
    async def interruptions(self, account: str, run_id: str) -> list[dict[str, Any]]: ...


class AuditReader(Protocol):
    async def read(self, request_id: str) -> list[GateDecision]: ...


class DeskReads:
    def __init__(self, runs: DeskRecords, auditor: AuditReader, prices: PriceTable) -> None:
        self.store = runs
        self.auditor = auditor
        self.prices = {model: gpu.price_per_gpu_hour_usd for model, gpu in prices.gpus.items()}

    async def runs(self, req: DeskRunsRequest) -> DeskRuns:
        limit = max(1, min(req.limit, MAX_RUNS))
        return DeskRuns(runs=await self.store.newest(limit), prices=self.prices, at=datetime.now(UTC))

    async def run(self, req: DeskRunRequest) -> DeskRun:
        account = await self.store.owner(req.run_id)
        view = None if account is None else await self.store.get(account, req.run_id)
        if account is None or view is None:
            raise Refusal(ErrorCode.run_not_found, "no such run")
        m_since, l_since = max(0, req.metrics_since), max(0, req.logs_since)
        metrics = await self.store.metrics(
            account, req.run_id, m_since, max(1, min(req.metrics_limit, MAX_METRICS))
        )
        logs = await self.store.logs(account, req.run_id, l_since, MAX_LOGS)
        return DeskRun(
            view=view,
            metrics=metrics,
            metrics_next=m_since + len(metrics),
            checkpoints=await self.store.checkpoints(account, req.run_id),
            states=await self.store.states(account, req.run_id),
            interruptions=[
                _interruption(r, InterruptionRecord)
                for r in await self.store.interruptions(account, req.run_id)
            ],
            logs=logs,
            logs_next=l_since + len(logs),
            audit=await self.auditor.read(req.run_id) if req.audit else None,
        )
