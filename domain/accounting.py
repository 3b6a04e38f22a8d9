"""The pure accounting: a run's events -> RunTelemetry, and runs -> rollups.

The run's wall time (accepted -> final state) is cut into consecutive intervals at its events, and
each interval goes to exactly one category, so goodput plus badput is 100 % by construction:
- up to the first `running`: queued;
- a `running` after an interruption: recovery (detection and re-scheduling);
- up to the first step of an attempt or a stage: startup (checkpoint_restore when the step shows a
  resume), and data preparation counts as startup;
- up to a step: the step's compute, less the checkpoint stall and the data wait reported inside it;
  a step that a later attempt redoes is lost_to_interruptions, not goodput;
- up to an eval: eval; up to the watcher's interruption notice: recovery; anything else: other.

A rollup adds `idle`: the GPU-hours of its bookings (every GPU, the whole window) that no run held,
so that the booked GPUs a run leaves unused are counted, not hidden (`booked_gpu_hours`).
"""

import statistics
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from contracts.runs import (
    CheckpointSaved,
    DataProvenance,
    EvalResult,
    Interruption,
    Metrics,
    RunCreated,
    RunEvent,
    StageStarted,
    StateChanged,
)
from contracts.states import RunState
from contracts.telemetry import BADPUT, IDLE, Rollup, RunTelemetry


@dataclass(slots=True)
class _Timeline:
    """What the walk along one run's events carries from one interval to the next."""

    badput: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BADPUT, 0.0))
    steps: defaultdict[tuple[str, int], list[float]] = field(default_factory=lambda: defaultdict(list))
    """Compute time of each occurrence of a (stage, step): a step redone after an interruption
    occurs more than once, and only its last occurrence is goodput."""
    running_seen: bool = False
    interrupted: bool = False
    first_step_pending: bool = True
    stall_pending: float = 0.0
    causes: Counter[str] = field(default_factory=Counter)
    bandwidths: list[float] = field(default_factory=list)

    def close(self, e: RunEvent, span: float) -> bool:
        """Give the interval that `e` ends (`span` seconds) to its category. False when `e` is not
        a boundary: the interval stays open."""
        match e:
            case StateChanged(state=RunState.running):
                after = "recovery" if self.interrupted else "other" if self.running_seen else "queued"
                self.badput[after] += span
                self.running_seen, self.interrupted = True, False
                self.first_step_pending, self.stall_pending = True, 0.0
            case StateChanged(state=RunState.interrupted) | Interruption():
                self.badput["recovery"] += span
                self.interrupted = True
                if isinstance(e, Interruption):
                    self.causes[e.cause] += 1
            case StageStarted():
                self.badput["startup" if self.running_seen else "queued"] += span
                self.first_step_pending = True
            case DataProvenance():
                self.badput["startup"] += span
            case Metrics():
                self._step(e, span)
            case CheckpointSaved():
                self.stall_pending += e.stall_s
                if e.save_s > 0:
                    self.bandwidths.append(e.bytes / e.save_s)
                return False  # its stall is taken out of the step it happened in
            case EvalResult():
                self.badput["eval"] += span
            case _:
                return False  # logs and other notes do not cut the timeline
        return True

    def _step(self, e: Metrics, span: float) -> None:
        if self.first_step_pending:
            # The attempt's first step carries its set-up (or the restore) with it; it still
            # counts as an occurrence, so an earlier run of the same step becomes lost work.
            self.badput["checkpoint_restore" if e.step > 1 else "startup"] += span
            self.steps[(e.stage, e.step)].append(0.0)
            self.first_step_pending = False
        else:
            stall = min(self.stall_pending, span)
            data = min(e.data_wait_s, span - stall)
            self.badput["checkpoint_stall"] += stall
            self.badput["data_loading"] += data
            self.steps[(e.stage, e.step)].append(span - stall - data)
        self.stall_pending = 0.0

    def goodput_s(self) -> float:
        """The last occurrence of each step; every earlier one goes to lost_to_interruptions."""
        goodput_s = 0.0
        for occurrences in self.steps.values():
            goodput_s += occurrences[-1]
            self.badput["lost_to_interruptions"] += sum(occurrences[:-1])
        return goodput_s


def account(created: RunCreated, events: list[RunEvent], ended_at: datetime, state: str) -> RunTelemetry:
    timeline = _Timeline()
    t_prev = created.accepted_at
    for e in sorted(events, key=lambda e: (e.at, e.seq)):
        if e.at < t_prev:  # a clock step backwards: fold it into the interval that is open
            continue
        if timeline.close(e, (e.at - t_prev).total_seconds()):
            t_prev = e.at
    timeline.badput["other"] += max(0.0, (ended_at - t_prev).total_seconds())
    goodput_s = timeline.goodput_s()
    wall = max((ended_at - created.accepted_at).total_seconds(), 0.0)
    bandwidths = timeline.bandwidths
    return RunTelemetry(
        run_id=created.run_id,
        account=created.account,
        booking_id=created.booking_id,
        region=created.region,
        gpu_model=created.gpu_model,
        gpus=created.gpus,
        state=state,
        accepted_at=created.accepted_at,
        ended_at=ended_at,
        wall_s=wall,
        goodput_s=goodput_s,
        badput_s=timeline.badput,
        goodput=goodput_s / wall if wall > 0 else 0.0,
        gpu_hours=wall * created.gpus / 3600.0,
        interruptions=sum(timeline.causes.values()),
        interruption_causes=dict(timeline.causes),
        checkpoint_saves=len(bandwidths),
        checkpoint_bytes_per_s_p50=statistics.median(bandwidths) if bandwidths else None,
        checkpoint_bytes_per_s_min=min(bandwidths) if bandwidths else None,
        booked_gpus=created.booked_gpus,
        booked_gpu_hours=created.booked_gpu_hours,
    )


def booked_gpu_hours(runs: list[RunTelemetry]) -> float:
    """The GPU-hours of every booking these runs ran on, each counted once: its whole window on
    every GPU, or, where the booking's size is not known (0), the GPU-hours its runs held (never
    less than they held)."""
    booked: dict[str, float] = {}
    held: dict[str, float] = {}
    for r in runs:
        booked[r.booking_id] = max(booked.get(r.booking_id, 0.0), r.booked_gpu_hours)
        held[r.booking_id] = held.get(r.booking_id, 0.0) + r.gpu_hours
    return sum(max(booked[b], held[b]) for b in booked)


def rollup(by: str, key: str, runs: list[RunTelemetry], now: datetime) -> Rollup:
    wall = sum(r.gpu_hours for r in runs)
    good = sum(r.goodput_s * r.gpus / 3600.0 for r in runs)
    badput = {c: sum(r.badput_s.get(c, 0.0) * r.gpus / 3600.0 for r in runs) for c in BADPUT}
    booked = booked_gpu_hours(runs)
    badput[IDLE] = max(0.0, booked - wall)
    causes: Counter[str] = Counter()
    for r in runs:
        causes.update(r.interruption_causes)
    interruptions = sum(r.interruptions for r in runs)
    p50s = [r.checkpoint_bytes_per_s_p50 for r in runs if r.checkpoint_bytes_per_s_p50 is not None]
    mins = [r.checkpoint_bytes_per_s_min for r in runs if r.checkpoint_bytes_per_s_min is not None]
    return Rollup(
        by=by,
        key=key,
        runs=len(runs),
        wall_gpu_hours=wall,
        goodput_gpu_hours=good,
        goodput=good / wall if wall > 0 else 0.0,
        badput_gpu_hours=badput,
        interruptions=interruptions,
        interruptions_per_1000_gpu_hours=interruptions / wall * 1000.0 if wall > 0 else 0.0,
        interruption_causes=dict(causes),
        checkpoint_bytes_per_s_p50=statistics.median(p50s) if p50s else None,
        checkpoint_bytes_per_s_min=min(mins) if mins else None,
        updated_at=now,
        booked_gpu_hours=booked,
    )
