"""An in-memory adapter of the run store's lease and write port (`store.Runs`), for table tests
that run in milliseconds; the contract tests run the same tables against Redis (`RunStore`).

It shares the store's pure decisions (`in_order`, `lease_decision`) and the one state writer
(`lifecycle.move`), so it differs from Redis only in where the bytes live.
"""

from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from contracts.api import RunView
from contracts.states import RunState
from services.scheduler import lifecycle
from services.scheduler.store import LeaseHeld, in_order, lease_decision


class InMemoryRuns:
    def __init__(self) -> None:
        self.views: dict[tuple[str, str], RunView] = {}
        self.owners: dict[str, str] = {}
        self.order: dict[str, tuple[int, int]] = {}  # run -> (last epoch, last seq)
        self.leases: dict[str, LeaseHeld] = {}
        self.index: dict[str, str] = {}  # leased run -> account
        self.interrupted: dict[str, list[dict[str, Any]]] = {}

    async def create(self, view: RunView) -> bool:
        if (view.account, view.run_id) in self.views:
            return False
        self.views[(view.account, view.run_id)] = view
        self.owners[view.run_id] = view.account
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
        def same_state(view: RunView) -> RunView:
            new = change(view)
            if new.state != view.state:
                raise lifecycle.NotAMove(view.state, new.state)
            return new

        return self._write(account, run_id, seq, same_state, holder_epoch)

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
            lambda view: lifecycle.move(view, to, when, allowed_from=allowed_from, **details),
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
    ) -> tuple[bool, RunView | None, int]:
        view = self.views.get((account, run_id))
        if view is None:
            return False, None, 0
        held = self.leases.get(run_id, LeaseHeld(0, "", 0.0))
        grant = lease_decision(view, held, trainer_id, epoch, now, silence_s, leasable)
        if grant is None:
            return False, view, held.epoch
        holder = held.holder if grant == held.epoch else trainer_id
        self.leases[run_id] = LeaseHeld(grant, holder, now)
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
