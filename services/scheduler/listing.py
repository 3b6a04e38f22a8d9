"""`ecc ito runs`: the caller's own runs, newest first, a page at a time, optionally filtered.

Read from the account's own run index (`RunRecords.account_runs`: `<ns>:{<account>}:runs`, written
beside the run's view when the run is created), so a tenant never reads another account's run,
whatever it sends: the account is the authenticated subject's. The desk's list of every account's
runs is services/scheduler/desk_reads.py and no tenant reaches it.

The cursor is the position of the last run a page read (its creation time and run id), so a page
holds still while new runs are created: asking for the next page never repeats a run nor skips one
(offsets would shift by every run created in between). A filter is applied to what is read, and a
request reads at most MAX_SCAN runs: a page may come back short, or empty, with a `next`.
"""

import math

from contracts.api import RunList, RunsRequest, RunSummary, RunView
from contracts.errors import ErrorCode
from runtime.messaging.codec import Refusal
from runtime.tenancy.accounts import Credentials
from services.scheduler.admission import authenticate
from services.scheduler.store import Position, RunRecords

MAX_SCAN = 1000  # runs read per request at most, whatever the filter: bounds one answer's work
MAX_RUN_ID = 128  # longer than any run id the scheduler makes ("run_" + 24 hex digits)


def summary(view: RunView) -> RunSummary:
    """A run's line in the list: its identifiers, state and progress."""
    return RunSummary(
        run_id=view.run_id,
        state=view.state,
        booking_id=view.booking_id,
        manifest_digest=view.manifest_digest,
        idempotency_key=view.idempotency_key,
        created_at=view.created_at,
        updated_at=view.updated_at,
        stage=view.stage,
        step=view.step,
        total_steps=view.total_steps,
        loss=view.loss,
        estimate_usd=None if view.plan is None else view.plan.cost.total_usd,
        message=view.message,
    )


def encode_cursor(position: Position) -> str:
    """`<creation time>:<run id>` (run ids hold no ':'); the float's repr reads back exactly."""
    at, run_id = position
    return f"{at!r}:{run_id}"


def decode_cursor(cursor: str) -> Position:
    """A position from a cursor this verb gave, or `request_invalid`."""
    at, sep, run_id = cursor.partition(":")
    try:
        when = float(at)
    except ValueError:
        when = math.nan
    if not sep or not run_id or len(run_id) > MAX_RUN_ID or ":" in run_id or not math.isfinite(when):
        raise Refusal(
            ErrorCode.request_invalid,
            "cursor is not one `runs` gave: pass the previous page's `next` as it was, or none for the newest",
        )
    return when, run_id


def wanted(view: RunView, req: RunsRequest) -> bool:
    """Does a run pass the request's filters?"""
    return (req.state is None or view.state is req.state) and (
        req.booking_id is None or view.booking_id == req.booking_id
    )


class RunListing:
    def __init__(self, credentials: Credentials, runs: RunRecords) -> None:
        self.credentials = credentials
        self.store = runs

    async def runs(self, caller: str, req: RunsRequest) -> RunList:
        """The caller's runs after `req.cursor` (from the newest when none) that pass its filters."""
        account = (await authenticate(self.credentials, caller, req)).account
        position = None if req.cursor is None else decode_cursor(req.cursor)
        found: list[RunSummary] = []
        scanned = 0
        batch = req.limit + 1  # one past the page: a full page knows whether another follows
        while True:
            read = await self.store.account_runs(account, position, batch)
            for at, view in read:
                if len(found) == req.limit:  # a run follows a full page
                    assert position is not None, "a page of at least one run moved the position"
                    return RunList(runs=found, next=encode_cursor(position))
                position, scanned = at, scanned + 1
                if view is not None and wanted(view, req):
                    found.append(summary(view))
            if len(read) < batch:  # the oldest run was read: nothing follows
                return RunList(runs=found, next=None)
            if scanned >= MAX_SCAN:
                assert position is not None, "a full batch moved the position"
                return RunList(runs=found, next=encode_cursor(position))
