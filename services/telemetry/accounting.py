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
"""

import statistics
from collections import Counter, defaultdict
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
from contracts.telemetry import BADPUT, Rollup, RunTelemetry


def account(created: RunCreated, events: list[RunEvent], ended_at: datetime, state: str) -> RunTelemetry:
    badput = dict.fromkeys(BADPUT, 0.0)
    steps: dict[tuple[str, int], list[float]] = defaultdict(list)  # compute time per occurrence
    t_prev = created.accepted_at
    running_seen = interrupted = False
    first_step_pending = True
    stall_pending = 0.0
    causes: Counter[str] = Counter()
    bandwidths: list[float] = []

    for e in sorted(events, key=lambda e: (e.at, e.seq)):
        if e.at < t_prev:  # a clock step backwards: fold it into the interval that is open
            continue
        span = (e.at - t_prev).total_seconds()
        match e:
            case StateChanged(state=RunState.running):
                badput["recovery" if interrupted else "queued" if not running_seen else "other"] += span
                running_seen, interrupted, first_step_pending, stall_pending = True, False, True, 0.0
            case StateChanged(state=RunState.interrupted) | Interruption():
                badput["recovery"] += span
                interrupted = True
                if isinstance(e, Interruption):
                    causes[e.cause] += 1
            case StageStarted():
                badput["startup" if running_seen else "queued"] += span
                first_step_pending = True
            case DataProvenance():
                badput["startup"] += span
            case Metrics():
                if first_step_pending:
                    # The attempt's first step carries its set-up (or the restore) with it; it still
                    # counts as an occurrence, so an earlier run of the same step becomes lost work.
                    badput["checkpoint_restore" if e.step > 1 else "startup"] += span
                    steps[(e.stage, e.step)].append(0.0)
                    first_step_pending = False
                else:
                    stall = min(stall_pending, span)
                    data = min(e.data_wait_s, span - stall)
                    badput["checkpoint_stall"] += stall
                    badput["data_loading"] += data
                    steps[(e.stage, e.step)].append(span - stall - data)
                stall_pending = 0.0
            case CheckpointSaved():
                stall_pending += e.stall_s
                if e.save_s > 0:
                    bandwidths.append(e.bytes / e.save_s)
                continue  # not a boundary: its stall is taken out of the step it happened in
            case EvalResult():
                badput["eval"] += span
            case _:
                continue  # logs and other notes do not cut the timeline
        t_prev = e.at

    badput["other"] += max(0.0, (ended_at - t_prev).total_seconds())
    goodput_s = 0.0
    for occurrences in steps.values():
        goodput_s += occurrences[-1]
        badput["lost_to_interruptions"] += sum(occurrences[:-1])
    wall = max((ended_at - created.accepted_at).total_seconds(), 0.0)
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
        badput_s=badput,
        goodput=goodput_s / wall if wall > 0 else 0.0,
        gpu_hours=wall * created.gpus / 3600.0,
        interruptions=sum(causes.values()),
        interruption_causes=dict(causes),
        checkpoint_saves=len(bandwidths),
        checkpoint_bytes_per_s_p50=statistics.median(bandwidths) if bandwidths else None,
        checkpoint_bytes_per_s_min=min(bandwidths) if bandwidths else None,
    )


def rollup(by: str, key: str, runs: list[RunTelemetry], now: datetime) -> Rollup:
    wall = sum(r.gpu_hours for r in runs)
    good = sum(r.goodput_s * r.gpus / 3600.0 for r in runs)
    badput = {c: sum(r.badput_s.get(c, 0.0) * r.gpus / 3600.0 for r in runs) for c in BADPUT}
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
    )
