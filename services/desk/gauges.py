"""The desk app's /metrics: what the desk knows, as Prometheus gauges, read at scrape time.

Runs by state (the scheduler's run list), and per GPU model (the telemetry rollups): goodput, the
GPU-hours of goodput and of each badput category (`idle` too: booked, held by no run), the booked
GPU-hours per booking, region and GPU model, interruptions (per 1,000 GPU-hours and by
cause) and checkpoint bandwidth (p50 and min). The services' own /metrics carry the request path
(latency per verb, refusals by code, accepted runs, consumer lag).
"""

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from contracts.api import RunView
from contracts.states import RunState
from contracts.telemetry import BOOKED_BADPUT, Rollup


def families(views: list[RunView], rollups: dict[tuple[str, str], Rollup]) -> list[Metric]:
    """The desk's gauges from its run list and rollups (pure: the scrape's whole answer)."""
    by_state = GaugeMetricFamily("ito_desk_runs", "Runs the desk lists, by state", labels=["state"])
    counts = {s.value: 0 for s in RunState}
    for v in views:
        counts[v.state.value] += 1
    for state, n in counts.items():
        by_state.add_metric([state], n)
    goodput = GaugeMetricFamily(
        "ito_desk_goodput_ratio", "Goodput share of wall GPU-hours", labels=["gpu_model"]
    )
    hours = GaugeMetricFamily(
        "ito_desk_gpu_hours",
        "Wall GPU-hours of finished runs, by where they went (kind idle: booked, held by no run)",
        labels=["gpu_model", "kind"],
    )
    booked = GaugeMetricFamily(
        "ito_desk_booked_gpu_hours",
        "GPU-hours of the bookings finished runs ran on (every GPU, whole window)",
        labels=["by", "key"],
    )
    rate = GaugeMetricFamily(
        "ito_desk_interruptions_per_1000_gpu_hours", "Interruptions per 1,000 GPU-hours", labels=["gpu_model"]
    )
    causes = GaugeMetricFamily(
        "ito_desk_interruptions", "Interruptions by cause", labels=["gpu_model", "cause"]
    )
    p50 = GaugeMetricFamily(
        "ito_desk_checkpoint_bandwidth_p50_bytes_per_second",
        "Checkpoint save bandwidth, median",
        labels=["gpu_model"],
    )
    low = GaugeMetricFamily(
        "ito_desk_checkpoint_bandwidth_min_bytes_per_second",
        "Checkpoint save bandwidth, slowest",
        labels=["gpu_model"],
    )
    for (by, key), r in sorted(rollups.items()):
        booked.add_metric([by, key], max(r.booked_gpu_hours, r.wall_gpu_hours))
        if by != "gpu_model":
            continue
        goodput.add_metric([key], r.goodput)
        hours.add_metric([key, "goodput"], r.goodput_gpu_hours)
        for c in BOOKED_BADPUT:  # `idle`: booked GPU-hours no run held
            hours.add_metric([key, c], r.badput_gpu_hours.get(c, 0.0))
        rate.add_metric([key], r.interruptions_per_1000_gpu_hours)
        for cause, n in sorted(r.interruption_causes.items()):
            causes.add_metric([key, cause], n)
        if r.checkpoint_bytes_per_s_p50 is not None:
            p50.add_metric([key], r.checkpoint_bytes_per_s_p50)
        if r.checkpoint_bytes_per_s_min is not None:
            low.add_metric([key], r.checkpoint_bytes_per_s_min)
    return [by_state, goodput, hours, booked, rate, causes, p50, low]


class _Desk:
    def __init__(self, source: Any) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        views = self.source.runs.runs if self.source.runs else []
        yield from families(views, self.source.rollups)


def exposition(source: Any) -> tuple[bytes, str]:
    """The scrape's body and content type (a registry of this one collector, made per scrape)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Desk(source))
    return generate_latest(registry), CONTENT_TYPE_LATEST
