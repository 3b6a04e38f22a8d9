"""What the desk's pages show, computed from what the desk may read: pure functions and one cache.

Inputs are the scheduler's desk answers (contracts/desk.py: run views, a run's history) and the
telemetry service's records (contracts/telemetry.py: a finished run's accounting on the DESK
stream, a running run's live one, the rollups). Nothing here does I/O; services/desk/source.py
feeds it and services/desk/pages.py renders it.
"""

import math
from dataclasses import dataclass, field
from datetime import datetime

from contracts.api import LogLineView, RunView
from contracts.audit import GateDecision
from contracts.desk import DeskRun, InterruptionRecord, StateRecord
from contracts.runs import CheckpointSaved, Metrics
from contracts.states import TERMINAL_STATES
from contracts.telemetry import BOOKED_BADPUT, IDLE, ROLLUP_BY, Rollup, RunTelemetry
from domain.accounting import booked_gpu_hours

MAX_LOG_LINES = 200  # a run page shows the newest lines; `ecc ito logs` has them all


@dataclass(frozen=True, slots=True)
class RunRow:
    """One line of the runs page."""

    run_id: str
    account: str
    booking_id: str
    state: str
    stage: str
    step: int
    total_steps: int
    goodput: float | None  # None until telemetry has accounted any of the run
    cost_so_far_usd: float
    estimate_usd: float
    gpu_model: str
    gpus: int
    updated_at: datetime


def elapsed_s(view: RunView, now: datetime) -> float:
    """The run's wall time so far: accepted -> its last change when it has ended, -> now otherwise."""
    end = view.updated_at if view.state in TERMINAL_STATES else now
    return max(0.0, (end - view.created_at).total_seconds())


def cost_so_far(view: RunView, now: datetime) -> float:
    """What the run has spent: its trainer's meter (every GPU of its placement, held from the
    trainer's start until release, at the plan's price: `RunView.spend`). A run recorded before
    metering existed: its wall time since accepted, at the plan's price, as before."""
    if view.spend is not None:
        return view.spend.spent_usd
    if view.plan is None:
        return 0.0
    cost = view.plan.cost
    return elapsed_s(view, now) / 3600.0 * cost.gpus * cost.price_per_gpu_hour_usd


def run_row(view: RunView, telemetry: RunTelemetry | None, now: datetime) -> RunRow:
    plan = view.plan
    return RunRow(
        run_id=view.run_id,
        account=view.account,
        booking_id=view.booking_id,
        state=view.state.value,
        stage=view.stage or "",
        step=view.step,
        total_steps=view.total_steps,
        goodput=None if telemetry is None else telemetry.goodput,
        cost_so_far_usd=cost_so_far(view, now),
        estimate_usd=0.0 if plan is None else plan.cost.total_usd,
        gpu_model=plan.gpu_model if plan else "",
        gpus=plan.cost.gpus if plan else 0,
        updated_at=view.updated_at,
    )


def run_rows(views: list[RunView], telemetry: dict[str, RunTelemetry], now: datetime) -> list[RunRow]:
    """The runs page, newest first: each run with the telemetry the desk has of it (final or live)."""
    return [run_row(v, telemetry.get(v.run_id), now) for v in views]


@dataclass(frozen=True, slots=True)
class StageLoss:
    """One stage's loss curve: every metric point's (step, loss) in order, and the held-out figures
    its gate measured (name, value, threshold)."""

    stage: str
    points: list[tuple[int, float]]
    held_out: list[tuple[str, float, float | None]]


HELD_OUT = ("held_out_loss", "short_context_loss", "held_out_loss_with_custom", "held_out_loss_reference")
"""Gate metrics that are a held-out loss (the same unit as the training loss, so on the same axis)."""


def stage_losses(detail: "RunDetail") -> list[StageLoss]:
    """Per stage in the order it started: training loss per step, and its gate's held-out losses."""
    order: list[str] = []
    points: dict[str, list[tuple[int, float]]] = {}
    for m in detail.metrics:
        if m.stage not in points:
            order.append(m.stage)
            points[m.stage] = []
        points[m.stage].append((m.step, m.loss))
    gates = {g.stage: g for g in detail.view.gates}
    for stage in gates:
        if stage not in points:
            order.append(stage)
            points[stage] = []
    return [
        StageLoss(
            stage=s,
            points=points[s],
            held_out=[
                (m.name, m.value, m.threshold)
                for m in (gates[s].metrics if s in gates else [])
                if m.name in HELD_OUT and math.isfinite(m.value)
            ],
        )
        for s in order
    ]


@dataclass(slots=True)
class RunDetail:
    """What the desk holds of one run: the newest view and history, and every metric point and
    the newest log lines so far (the scheduler is asked only for what is new: `merge`)."""

    view: RunView
    metrics: list[Metrics] = field(default_factory=list)
    metrics_next: int = 0
    checkpoints: list[CheckpointSaved] = field(default_factory=list)
    states: list[StateRecord] = field(default_factory=list)
    interruptions: list[InterruptionRecord] = field(default_factory=list)
    logs: list[LogLineView] = field(default_factory=list)
    logs_next: int = 0
    audit: list[GateDecision] | None = None
    audit_state: str = ""  # the run's state when the audit trail was read: read again when it moves

    def merge(self, page: DeskRun) -> None:
        self.view = page.view
        self.metrics.extend(page.metrics)
        self.metrics_next = page.metrics_next
        self.checkpoints = page.checkpoints
        self.states = page.states
        self.interruptions = page.interruptions
        self.logs = (self.logs + page.logs)[-MAX_LOG_LINES:]
        self.logs_next = page.logs_next
        if page.audit is not None:
            self.audit = page.audit
            self.audit_state = page.view.state.value

    def audit_due(self) -> bool:
        return self.audit is None or self.audit_state != self.view.state.value


@dataclass(frozen=True, slots=True)
class Breakdown:
    """One rollup row of the desk page: where its booked GPU-hours went (idle included), as shares
    of its booked GPU-hours (of its wall GPU-hours where the bookings' size is not known)."""

    by: str
    key: str
    runs: int
    wall_gpu_hours: float  # held by runs
    goodput: float  # goodput's share of the booked GPU-hours
    shares: dict[str, float]  # every BOOKED_BADPUT category's share of the booked GPU-hours
    interruptions: int
    interruptions_per_1000_gpu_hours: float
    causes: dict[str, int]
    checkpoint_p50: float | None  # bytes/s
    checkpoint_min: float | None
    implied_usd_per_useful_gpu_hour: float | None  # None when no goodput or no price is known
    booked_gpu_hours: float = 0.0  # every GPU of its bookings, whole window (>= wall_gpu_hours)
    idle_gpu_hours: float = 0.0  # booked, held by no run


def implied_price(runs: list[RunTelemetry], prices: dict[str, float]) -> float | None:
    """What a useful GPU-hour cost: the booked GPU-hours (every GPU of each booking, its whole
    window: idle ones included) at the desk's price over the GPU-hours of goodput. A run on a GPU
    model with no price is left out of both sums."""
    paid = useful = 0.0
    by_booking: dict[tuple[str, str], list[RunTelemetry]] = {}
    for r in runs:
        if r.gpu_model in prices:
            by_booking.setdefault((r.booking_id, r.gpu_model), []).append(r)
    for mine in by_booking.values():
        paid += booked_gpu_hours(mine) * prices[mine[0].gpu_model]
        useful += sum(r.goodput_s * r.gpus / 3600.0 for r in mine)
    return paid / useful if useful > 0 else None


def rollup_key(run: RunTelemetry, by: str) -> str | None:
    """The key a finished run is rolled up under by `by` (the telemetry service's rule,
    contracts.telemetry.ROLLUP_BY), or None for a `by` the desk does not know."""
    field = ROLLUP_BY.get(by)
    return None if field is None else getattr(run, field)


def breakdowns(
    rollups: dict[tuple[str, str], Rollup], finished: dict[str, RunTelemetry], prices: dict[str, float]
) -> list[Breakdown]:
    """Every rollup (by booking, region, GPU model), ordered by `by` then key."""
    rows = []
    for (by, key), r in sorted(rollups.items()):
        wall = r.wall_gpu_hours
        booked = max(wall, r.booked_gpu_hours)  # an older rollup has no booked hours: its wall ones
        shares = {c: (r.badput_gpu_hours.get(c, 0.0) / booked if booked > 0 else 0.0) for c in BOOKED_BADPUT}
        runs = [t for t in finished.values() if rollup_key(t, by) == key]
        rows.append(
            Breakdown(
                by=by,
                key=key,
                runs=r.runs,
                wall_gpu_hours=wall,
                goodput=r.goodput_gpu_hours / booked if booked > 0 else 0.0,
                shares=shares,
                interruptions=r.interruptions,
                interruptions_per_1000_gpu_hours=r.interruptions_per_1000_gpu_hours,
                causes=dict(r.interruption_causes),
                checkpoint_p50=r.checkpoint_bytes_per_s_p50,
                checkpoint_min=r.checkpoint_bytes_per_s_min,
                implied_usd_per_useful_gpu_hour=implied_price(runs, prices),
                booked_gpu_hours=booked,
                idle_gpu_hours=r.badput_gpu_hours.get(IDLE, 0.0),
            )
        )
    return rows
