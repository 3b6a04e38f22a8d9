"""The booking's capacity in the plan, as pure functions: which GPUs the run holds and which stay
idle (with their cost), and whether the run fits what is left of the booking's window.

A run holds the GPUs its placement allocates: GPUs 0..g-1 (LOCAL_RANK -> cuda:i) on nodes 0..n-1
of the booking, for a manifest of n nodes x g GPUs per node; the booking's other GPUs are idle.
planning.plan() calls these with its own estimate (the expected wall time is the plan's GPU-hours
over the GPUs held) and the data-parallel alternative it computed; nothing here does I/O.
"""

from datetime import datetime
from typing import NamedTuple

from contracts.booking import Topology
from contracts.errors import ErrorCode
from contracts.plans import CapacityPlan, WindowPlan

# Warn, never refuse, when more than this share of the booking's GPUs stays idle: a small model
# on a big booking is often deliberate (a smoke test before the real run, a booking bought for
# several runs in turn), and refusing it would block those; the plan says so and suggests the
# layout that uses the booking. Lower it to warn sooner.
IDLE_WARN_FRACTION = 0.5
# The slack a run must leave in the window beyond its expected wall time, as a share of that time:
# the estimate is meant to be within 0.7x-1.5x of what the run takes (bench/), so half again covers
# an estimate at the slow end of that range. Raise it where estimates run long.
WINDOW_MARGIN_FRACTION = 0.5


class Alternative(NamedTuple):
    """The data-parallel plan over every GPU of the booking, as planning.strategy() judged it."""

    nodes: int
    gpus_per_node: int
    strategy: str  # "none" when refused
    degrees: dict[str, int]
    refusal: str | None  # why no plan uses the booking's GPUs (e.g. plan_wasteful's reason)
    expected_wall_hours: float


def duration(hours: float) -> str:
    """A wall time for a person: seconds, minutes or hours."""
    if hours < 1 / 60:
        return f"{hours * 3600:.0f} s"
    if hours < 1:
        return f"{hours * 60:.1f} min"
    return f"{hours:.2f} h"


def gpu_ranges(gpus: list[tuple[int, int]]) -> list[str]:
    """(node, gpu) pairs as ranges per node: [(0, 1), (0, 2), (0, 3)] -> ["node0:gpu1-3"]."""
    out: list[str] = []
    by_node: dict[int, list[int]] = {}
    for node, gpu in gpus:
        by_node.setdefault(node, []).append(gpu)
    for node, ids in sorted(by_node.items()):
        ids.sort()
        start = prev = ids[0]
        for i in [*ids[1:], None]:
            if i is not None and i == prev + 1:
                prev = i
                continue
            out.append(f"node{node}:gpu{start}" if start == prev else f"node{node}:gpu{start}-{prev}")
            if i is not None:
                start = prev = i
    return out


def held_and_idle(topo: Topology, nodes: int, gpus_per_node: int) -> tuple[list[str], list[str]]:
    """The booking's GPUs the run's placement allocates, and the rest (as ranges)."""
    held: list[tuple[int, int]] = []
    idle: list[tuple[int, int]] = []
    for node in range(topo.nodes):
        for gpu in range(topo.gpus_per_node):
            (held if node < nodes and gpu < gpus_per_node else idle).append((node, gpu))
    return gpu_ranges(held), gpu_ranges(idle)


def suggestion(alt: Alternative, wall_hours: float, held: int) -> str:
    """What to do about a mostly idle booking: the layout that uses it, or why none does."""
    booked = alt.nodes * alt.gpus_per_node
    if alt.refusal is not None:
        return f"no plan uses more of it ({alt.refusal}); a booking of {held} GPU(s) would leave none idle"
    degrees = " x ".join(f"{k} {v}" for k, v in alt.degrees.items() if v > 1) or "one process"
    return (
        f"resources.nodes {alt.nodes}, resources.gpus_per_node {alt.gpus_per_node} would use all "
        f"{booked}: {alt.strategy} ({degrees}), expected ~{duration(alt.expected_wall_hours)} "
        f"instead of ~{duration(wall_hours)}"
    )


def capacity_plan(
    topo: Topology,
    nodes: int,
    gpus_per_node: int,
    price_per_gpu_hour: float,
    wall_hours: float,
    window_hours: float,
    alt: Alternative | None,
) -> CapacityPlan:
    booked = topo.nodes * topo.gpus_per_node
    held_ranges, idle_ranges = held_and_idle(topo, nodes, gpus_per_node)
    held = min(nodes, topo.nodes) * min(gpus_per_node, topo.gpus_per_node)
    idle = booked - held
    fraction = idle / booked if booked else 0.0
    per_hour = idle * price_per_gpu_hour
    unused = max(0.0, booked * window_hours - held * wall_hours)
    wasteful = fraction > IDLE_WARN_FRACTION
    hint = suggestion(alt, wall_hours, held) if wasteful and alt is not None else None
    sentence = f"holds {held} of {booked} booked {topo.gpu_model} ({', '.join(held_ranges)})"
    if idle:
        sentence += (
            f"; {idle} stay idle ({', '.join(idle_ranges)}): {per_hour:.2f} USD/h, "
            f"{per_hour * wall_hours:.4f} USD during the run's expected ~{duration(wall_hours)}"
        )
    else:
        sentence += "; none idle"
    if wasteful:
        sentence += f"; warning: {fraction:.0%} of the booking stays idle" + (f": {hint}" if hint else "")
    return CapacityPlan(
        booked_gpus=booked,
        held_gpus=held,
        idle_gpus=idle,
        held=held_ranges,
        idle=idle_ranges,
        idle_fraction=fraction,
        idle_usd_per_hour=round(per_hour, 6),
        idle_usd_during_run=round(per_hour * wall_hours, 6),
        idle_gpu_hours_in_window=unused,
        wasteful=wasteful,
        sentence=sentence,
        suggestion=hint,
    )


def window_plan(
    window_start: datetime,
    window_end: datetime,
    now: datetime,
    wall_hours: float,
    checkpoint_every_hours: float,
    resumable_policy: bool,
) -> WindowPlan:
    """The run against the booking's remaining window. Resumable only when the manifest asks for it
    (checkpoint.resumable_across_bookings) and a checkpoint commits inside the window: otherwise
    nothing of the run would carry over to a later booking."""
    remaining = max(0.0, (window_end - max(now, window_start)).total_seconds() / 3600.0)
    required = WINDOW_MARGIN_FRACTION * wall_hours
    margin = remaining - wall_hours
    fits = wall_hours + required <= remaining
    resumable = not fits and resumable_policy and checkpoint_every_hours <= remaining
    head = f"expected wall time ~{duration(wall_hours)} against {duration(remaining)} left in the booking's window"
    if fits:
        sentence = f"{head}: fits, {duration(margin)} to spare (asked: {duration(required)})"
    elif resumable:
        sentence = (
            f"{head}: does not fit; resumable: a checkpoint commits every ~{duration(checkpoint_every_hours)}"
            ", so the work done by the window's end is kept for a later booking"
        )
    elif resumable_policy:
        sentence = (
            f"{head}: does not fit, and no checkpoint commits inside the window "
            f"(one every ~{duration(checkpoint_every_hours)}): lower checkpoint.interval_steps, "
            "book a longer window, or plan fewer tokens"
        )
    else:
        sentence = (
            f"{head} (+{duration(required)} margin): does not fit; book a longer window, plan fewer "
            "tokens, or set checkpoint.resumable_across_bookings to continue on a later booking"
        )
    return WindowPlan(
        window_start=window_start,
        window_end=window_end,
        expected_wall_hours=wall_hours,
        remaining_hours=remaining,
        required_margin_hours=required,
        margin_hours=margin,
        fits=fits,
        resumable=resumable,
        sentence=sentence,
    )


def window_refusal(w: WindowPlan) -> tuple[ErrorCode, str] | None:
    """booking_window_exceeded unless the run fits, or is resumable on a later booking."""
    if w.fits or w.resumable:
        return None
    return ErrorCode.booking_window_exceeded, w.sentence
