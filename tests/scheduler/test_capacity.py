"""The booking's capacity in the plan (services/scheduler/capacity.py, planning.plan) as tables:
which GPUs the run holds and which stay idle with their cost, the warning and the data-parallel
suggestion when most stay idle, and the run against the booking's remaining window.

Arithmetic (H200 at 3.50 USD/GPU-h, 989 TFLOPs, MFU 0.4): 1B x 1e9 tokens = 6.313 GPU-h, so 6.313 h
of wall time on one GPU; the window asks for half again (WINDOW_MARGIN_FRACTION 0.5): 9.47 h.
"""

from datetime import timedelta

import msgspec
import pytest

from contracts.booking import Topology
from ecc import render
from services.scheduler import capacity
from services.scheduler.planning import plan
from services.scheduler.prices import load_prices
from tests.scheduler.test_planning import ETH, T0, body, code_of, manifest, run_plan

H200 = 3.5
WALL_1B = 6.3131  # hours: 1B x 1e9 tokens on one H200


def topo(nodes: int, gpn: int) -> Topology:
    return Topology(nodes=nodes, gpus_per_node=gpn, gpu_model="H200", gpu_memory_gb=141)


# --- which GPUs are held, which idle ---


@pytest.mark.parametrize(
    "pairs, ranges",
    [
        ([(0, 0)], ["node0:gpu0"]),
        ([(0, 1), (0, 2), (0, 3)], ["node0:gpu1-3"]),
        ([(0, 0), (0, 2), (0, 3), (1, 0)], ["node0:gpu0", "node0:gpu2-3", "node1:gpu0"]),
        ([], []),
    ],
    ids=["one", "a-run", "gaps-and-nodes", "none"],
)
def test_gpu_ranges(pairs, ranges):
    assert capacity.gpu_ranges(pairs) == ranges


@pytest.mark.parametrize(
    "booking, asked, held, idle",
    [
        ((1, 8), (1, 1), ["node0:gpu0"], ["node0:gpu1-7"]),
        ((1, 8), (1, 8), ["node0:gpu0-7"], []),
        ((2, 8), (1, 8), ["node0:gpu0-7"], ["node1:gpu0-7"]),
        ((2, 8), (2, 4), ["node0:gpu0-3", "node1:gpu0-3"], ["node0:gpu4-7", "node1:gpu4-7"]),
    ],
    ids=["demo-1-of-8", "whole-node", "one-of-two-nodes", "half-of-each-node"],
)
def test_held_and_idle(booking, asked, held, idle):
    assert capacity.held_and_idle(topo(*booking), *asked) == (held, idle)


def test_the_demo_plan_says_which_gpus_stay_idle_and_their_cost():
    """Issue 26: the demo books 8 x H200 and the plan said `single, one process`, nothing about
    the 7 GPUs left idle. It warns (never refuses) and says why no wider plan helps."""
    p = run_plan(manifest("tiny"), body(1, 8))
    c = p.capacity
    assert c is not None and p.ok  # the rule warns: a smoke test on a big booking is allowed
    assert (c.booked_gpus, c.held_gpus, c.idle_gpus) == (8, 1, 7)
    assert (c.held, c.idle) == (["node0:gpu0"], ["node0:gpu1-7"])
    assert c.idle_usd_per_hour == pytest.approx(7 * H200)
    assert c.idle_fraction == pytest.approx(7 / 8) and c.wasteful
    assert c.suggestion is not None and "plan_wasteful" in c.suggestion  # a 0.5M model uses one GPU
    text = render.text(p)
    assert "7 stay idle (node0:gpu1-7): 24.50 USD/h" in text and "warning: 88% of the booking" in text


def test_a_mostly_idle_booking_suggests_the_data_parallel_plan_that_uses_it():
    p = run_plan(manifest("1B", tokens=10**9), body(1, 8))
    c = p.capacity
    assert c is not None and c.wasteful and p.ok
    assert c.idle_usd_during_run == pytest.approx(7 * H200 * WALL_1B, rel=1e-3)
    assert c.suggestion is not None
    assert (
        "resources.nodes 1, resources.gpus_per_node 8 would use all 8: ddp (dp_replicate 8)" in c.suggestion
    )
    assert f"~{WALL_1B / 8 * 60:.1f} min instead of ~6.31 h" in c.suggestion


@pytest.mark.parametrize(
    "booking, asked, wasteful",
    [((1, 8), (1, 4), False), ((1, 8), (1, 3), True), ((1, 8), (1, 8), False), ((1, 1), (1, 1), False)],
    ids=["half-idle-is-not-most", "five-of-eight-idle", "none-idle", "single-gpu-booking"],
)
def test_the_wasteful_rule_is_more_than_half_idle(booking, asked, wasteful):
    p = run_plan(manifest("1B", asked[0], asked[1], tokens=10**6), body(*booking))
    assert p.capacity is not None and p.capacity.wasteful is wasteful and p.ok
    assert (p.capacity.suggestion is not None) is wasteful


def test_idle_gpu_hours_in_the_window():
    # 8 GPUs x 24 h booked; one GPU held for 6.31 h
    p = run_plan(manifest("1B", tokens=10**9), body(1, 8, window_hours=24.0))
    assert p.capacity is not None
    assert p.capacity.idle_gpu_hours_in_window == pytest.approx(8 * 24 - WALL_1B, rel=1e-4)


# --- the booking's window ---


@pytest.mark.parametrize(
    "window_hours, resumable, code, fits, resumes",
    [
        (24.0, False, None, True, False),
        (9.5, False, None, True, False),  # 6.31 h + 3.16 h margin = 9.47 h
        (9.4, False, "booking_window_exceeded", False, False),  # fits without the margin only
        (2.0, False, "booking_window_exceeded", False, False),
        (2.0, True, None, False, True),  # a checkpoint every 50 steps commits inside the window
    ],
    ids=["a-day", "fits-with-margin", "inside-the-margin", "too-short", "too-short-but-resumable"],
)
def test_the_run_against_the_window(window_hours, resumable, code, fits, resumes):
    p = run_plan(manifest("1B", tokens=10**9, resumable=resumable), body(window_hours=window_hours))
    w = p.window
    assert w is not None and code_of(p) == code
    assert (w.fits, w.resumable) == (fits, resumes)
    assert w.expected_wall_hours == pytest.approx(WALL_1B, rel=1e-4)
    assert w.remaining_hours == pytest.approx(window_hours)
    assert w.margin_hours == pytest.approx(window_hours - WALL_1B, rel=1e-3)
    check = next(c for c in p.checks if c.name == "booking_window")
    assert (check.ok, check.code) == (code is None, code)
    if resumes:
        assert "resumable" in check.reason and "later booking" in check.reason
    if code:
        assert "does not fit" in check.reason and "resumable_across_bookings" in check.reason


def planning_at(m, b, now):
    return plan(m, "d" * 64, b, load_prices(), now=now)


def test_the_remaining_window_is_measured_from_now():
    b = body(window_hours=24.0)
    late = T0 + timedelta(hours=20)  # 4 h left: a 6.31 h run no longer fits
    assert code_of(run_plan(manifest("1B", tokens=10**9), b)) is None
    p = planning_at(manifest("1B", tokens=10**9), b, late)
    assert code_of(p) == "booking_window_exceeded" and p.window is not None
    assert p.window.remaining_hours == pytest.approx(4.0)


def test_a_window_that_has_not_started_counts_from_its_start():
    b = msgspec.structs.replace(body(window_hours=10.0), issued_at=T0 - timedelta(hours=5))
    p = run_plan(manifest("1B", tokens=10**9), b)
    assert p.window is not None and p.window.remaining_hours == pytest.approx(10.0) and p.ok


def test_resumable_needs_a_checkpoint_inside_the_window():
    m = manifest("1B", tokens=10**9, resumable=True)
    # 1e9 tokens / (64 x 16) = 976,562 steps: a checkpoint every 900,000 steps is every ~5.8 h
    sparse = msgspec.structs.replace(
        m, checkpoint=msgspec.structs.replace(m.checkpoint, interval_steps=900_000)
    )
    p = run_plan(sparse, body(window_hours=2.0))
    assert code_of(p) == "booking_window_exceeded"
    assert p.window is not None and "no checkpoint commits inside the window" in p.window.sentence


@pytest.mark.parametrize(
    "wall, remaining, fits",
    [(1.0, 1.5, True), (1.0, 1.4999, False), (0.0, 0.0, True)],
    ids=["exactly-the-margin", "just-inside-the-margin", "nothing-to-do"],
)
def test_window_margin_boundary(wall, remaining, fits):
    w = capacity.window_plan(T0, T0 + timedelta(hours=remaining), T0, wall, wall, False)
    assert w.fits is fits and (capacity.window_refusal(w) is None) is fits


def test_fabric_is_kept_in_the_alternative():
    # an ethernet booking of 2 nodes: the wider plan is refused for its fabric, and says so
    p = run_plan(manifest("1B", tokens=10**6), body(2, 8, fabric=ETH))
    assert p.capacity is not None and p.capacity.suggestion is not None
    assert "fabric_unsupported" in p.capacity.suggestion
