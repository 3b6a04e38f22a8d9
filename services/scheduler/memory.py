"""An in-memory adapter of the run store's ports (`store.Runs`, `store.RunRecords`), for table and
handler tests that run in milliseconds; the contract tests run the same tables against Redis
(`RunStore`).

It shares the store's pure decisions (`in_order`, `lease_decision`) and the one state writer
(`lifecycle.move`), so it differs from Redis only in where the bytes live.
"""

from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from contracts.api import LogLineView, RunView
from contracts.desk import StateRecord
from contracts.runs import CheckpointSaved, Metrics
from contracts.states import TERMINAL_STATES, RunState
from services.scheduler import lifecycle
from services.scheduler.store import (
    MAX_LOG_LINES,
    MAX_METRIC_POINTS,
    MAX_STATE_RECORDS,
    LeaseHeld,
    Position,
    in_order,
    lease_decision,
    state_record,
)


def _page(items: list[Any], since: int, limit: int) -> list[Any]:
    """Redis LRANGE since..since+limit-1 on a list (an index past the end gives nothing)."""
    return items[since : since + limit] if since >= 0 and limit > 0 else []


class InMemoryRuns:
    def __init__(self) -> None:
        self.views: dict[tuple[str, str], RunView] = {}
        self.owners: dict[str, str] = {}
        self.order: dict[str, tuple[int, int]] = {}  # run -> (last epoch, last seq)
        self.leases: dict[str, LeaseHeld] = {}
        self.index: dict[str, str] = {}  # leased run -> account
        self.interrupted: dict[str, list[dict[str, Any]]] = {}
        self.kept: dict[tuple[str, str, str], bytes] = {}  # (account, run, field) -> remembered answer
        self.log_lines: dict[tuple[str, str], list[LogLineView]] = {}
        self.points: dict[tuple[str, str], list[Metrics]] = {}
        self.saved: dict[tuple[str, str], list[CheckpointSaved]] = {}
        self.moves: dict[tuple[str, str], list[StateRecord]] = {}

    async def create(self, view: RunView, work: bytes | None = None) -> bool:
        if (view.account, view.run_id) in self.views:
            return False
        self.views[(view.account, view.run_id)] = view
        self.owners[view.run_id] = view.account
        if work is not None:
            self.kept.setdefault((view.account, view.run_id, "work"), bytes(work))
        return True

    async def owner(self, run_id: str) -> str | None:
        return self.owners.get(run_id)

    async def get(self, account: str, run_id: str) -> RunView | None:
        return self.views.get((account, run_id))

    async def update(
        self,
        account: str,
        run_id: str,
        seq: int | None,
        change: Callable[[RunView], RunView],
        holder_epoch: int | None = None,
    ) -> tuple[RunView | None, bool]:
        return self._write(account, run_id, seq, lifecycle.keeping_state(change), holder_epoch)

    async def move(
        self,
        account: str,
        run_id: str,
        to: RunState | Mapping[RunState, RunState],
        *,
        allowed_from: frozenset[RunState] | None = None,
        at: datetime | None = None,
        seq: int | None = None,
        holder_epoch: int | None = None,
        **details: Any,
    ) -> tuple[RunView | None, bool]:
        when = at or datetime.now(UTC)
        return self._write(
            account,
            run_id,
            seq,
            lifecycle.mover(to, when, allowed_from=allowed_from, **details),
            holder_epoch,
        )

    def _write(
        self,
        account: str,
        run_id: str,
        seq: int | None,
        change: Callable[[RunView], RunView],
        holder_epoch: int | None,
    ) -> tuple[RunView | None, bool]:
        view = self.views.get((account, run_id))
        if view is None:
            return None, False
        held = self.leases.get(run_id, LeaseHeld(0, "", 0.0))
        if holder_epoch is not None and not (0 < held.epoch == holder_epoch):
            return view, False
        last_epoch, last_seq = self.order.get(run_id, (0, 0))
        if seq is not None and not in_order(holder_epoch or 0, seq, last_epoch, last_seq):
            return view, False
        new = change(view)
        self.views[(account, run_id)] = new
        moved = state_record(view, new)
        if moved is not None:
            history = self.moves.setdefault((account, run_id), [])
            history.append(moved)
            del history[:-MAX_STATE_RECORDS]
        if seq is not None:
            self.order[run_id] = (holder_epoch or 0, seq)
        return new, True

    async def lease(
        self,
        account: str,
        run_id: str,
        trainer_id: str,
        epoch: int,
        now: float,
        silence_s: float,
        leasable: Callable[[RunView], bool],
        node: int = 0,
    ) -> tuple[bool, RunView | None, int]:
        view = self.views.get((account, run_id))
        if view is None:
            return False, None, 0
        key = run_id if node == 0 else f"{run_id}:{node}"  # node 0's lease is the run's
        held = self.leases.get(key, LeaseHeld(0, "", 0.0))
        grant = lease_decision(view, held, trainer_id, epoch, now, silence_s, leasable)
        if grant is None:
            return False, view, held.epoch
        holder = held.holder if grant == held.epoch else trainer_id
        self.leases[key] = LeaseHeld(grant, holder, now)
        if node == 0:
            self.index[run_id] = account
        return True, view, grant

    async def leased(self) -> dict[str, str]:
        return dict(self.index)

    async def lease_seen(self, account: str, run_id: str) -> float | None:
        held = self.leases.get(run_id)
        return None if held is None else held.seen

    async def release_lease(self, run_id: str) -> None:
        self.index.pop(run_id, None)

    async def record_interruption(self, account: str, run_id: str, record: dict[str, Any]) -> None:
        self.interrupted.setdefault(run_id, []).append(record)

    async def interruptions(self, account: str, run_id: str) -> list[dict[str, Any]]:
        return list(self.interrupted.get(run_id, []))

    async def remember(self, account: str, run_id: str, field: str, value: bytes) -> None:
        self.kept[(account, run_id, field)] = bytes(value)

    async def recall(self, account: str, run_id: str, field: str) -> bytes | None:
        return self.kept.get((account, run_id, field))

    async def log_count(self, account: str, run_id: str) -> int:
        return len(self.log_lines.get((account, run_id), []))

    async def append_log(self, account: str, run_id: str, line: LogLineView) -> None:
        lines = self.log_lines.setdefault((account, run_id), [])
        lines.append(line)
        del lines[:-MAX_LOG_LINES]  # trimmed as RunStore trims (LTRIM)

    async def logs(self, account: str, run_id: str, since: int, limit: int) -> list[LogLineView]:
        return _page(self.log_lines.get((account, run_id), []), since, limit)

    async def append_metrics(self, account: str, run_id: str, m: Metrics) -> None:
        points = self.points.setdefault((account, run_id), [])
        points.append(m)
        del points[:-MAX_METRIC_POINTS]

    async def metrics(self, account: str, run_id: str, since: int, limit: int) -> list[Metrics]:
        return _page(self.points.get((account, run_id), []), since, limit)

    async def append_checkpoint(self, account: str, run_id: str, c: CheckpointSaved) -> None:
        self.saved.setdefault((account, run_id), []).append(c)

    async def checkpoints(self, account: str, run_id: str) -> list[CheckpointSaved]:
        return list(self.saved.get((account, run_id), []))

    async def forget_checkpoints(self, account: str, run_id: str) -> None:
        self.saved.pop((account, run_id), None)

    async def states(self, account: str, run_id: str) -> list[StateRecord]:
        return list(self.moves.get((account, run_id), []))

    async def newest(self, limit: int) -> list[RunView]:
        return sorted(self.views.values(), key=lambda v: v.created_at, reverse=True)[:limit]

    async def open_at_most(self, account: str) -> int:
        return sum(a == account and v.state not in TERMINAL_STATES for (a, _), v in self.views.items())

    async def open_states(self, account: str) -> list[RunState]:
        return [
            v.state for (a, _), v in self.views.items() if a == account and v.state not in TERMINAL_STATES
        ]

    async def account_runs(
        self, account: str, after: Position | None, count: int
    ) -> list[tuple[Position, RunView | None]]:
        """The account's runs as RunStore reads its index: newest first, ties by run id descending."""
        mine: list[tuple[Position, RunView | None]] = [
            ((v.created_at.timestamp(), v.run_id), v) for (a, _), v in self.views.items() if a == account
        ]
        mine.sort(key=lambda entry: entry[0], reverse=True)
        return [(position, view) for position, view in mine if after is None or position < after][:count]
