"""The desk's charts, drawn as SVG on the server: no script, no network, the same bytes on any
screen (each chart scales to its box through its viewBox).

Pure functions of the board's values (services/desk/board.py) to SVG text. Every value that comes
from outside is escaped; every number is finite before it becomes a coordinate. The elements carry
classes (and `data-` counts) that services/desk/static/desk.css colours and the browser tests read.
"""

import math
from collections.abc import Callable
from datetime import datetime
from html import escape

from contracts.states import TERMINAL_STATES, RunState
from contracts.telemetry import BOOKED_BADPUT
from services.desk.board import RunDetail, StageLoss

W, H = 640, 220  # a loss chart's viewBox; it is drawn at the width of its box
PAD_L, PAD_R, PAD_T, PAD_B = 52, 14, 12, 30


def _num(x: float) -> str:
    return f"{x:.1f}"


def _ticks(lo: float, hi: float, n: int = 4) -> list[float]:
    if hi <= lo:
        return [lo]
    return [lo + (hi - lo) * i / n for i in range(n + 1)]


def _fmt(v: float) -> str:
    return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"


def loss_chart(s: StageLoss) -> str:
    """One stage's training loss over its steps (a polyline with a point per metric event) and its
    gate's held-out losses (a marker each at the stage's last step, a dashed line at a threshold)."""
    pts = [(step, loss) for step, loss in s.points if math.isfinite(loss)]
    values = [v for _, v in pts] + [v for _, v, _ in s.held_out]
    values += [t for _, _, t in s.held_out if t is not None and math.isfinite(t)]
    label = f"{s.stage}: training loss over {len(pts)} steps"
    if not values:
        return (
            f'<svg class="chart loss" viewBox="0 0 {W} {H}" role="img" aria-label="{escape(label)}">'
            f'<text class="empty" x="{W / 2}" y="{H / 2}" text-anchor="middle">no steps yet</text></svg>'
        )
    lo, hi = min(values), max(values)
    span = hi - lo or max(abs(hi), 1.0) * 0.1
    lo, hi = lo - span * 0.05, hi + span * 0.05
    steps = [step for step, _ in pts] or [0]
    x0, x1 = min(steps), max(steps)
    x1 = x1 if x1 > x0 else x0 + 1

    def x(step: float) -> float:
        return PAD_L + (step - x0) / (x1 - x0) * (W - PAD_L - PAD_R)

    def y(v: float) -> float:
        return PAD_T + (hi - v) / (hi - lo) * (H - PAD_T - PAD_B)

    parts = [f'<svg class="chart loss" viewBox="0 0 {W} {H}" role="img" aria-label="{escape(label)}">']
    for t in _ticks(lo, hi):
        parts.append(
            f'<line class="grid" x1="{PAD_L}" x2="{W - PAD_R}" y1="{_num(y(t))}" y2="{_num(y(t))}"/>'
            f'<text class="tick" x="{PAD_L - 6}" y="{_num(y(t) + 4)}" text-anchor="end">{_fmt(t)}</text>'
        )
    for step in sorted({x0, (x0 + x1) // 2, x1}):
        parts.append(
            f'<text class="tick" x="{_num(x(step))}" y="{H - 10}" text-anchor="middle">{step}</text>'
        )
    parts.append(f'<text class="axis" x="4" y="{H - 10}">step</text>')
    coords = " ".join(f"{_num(x(step))},{_num(y(loss))}" for step, loss in pts)
    parts.append(f'<polyline class="train-loss" data-points="{len(pts)}" points="{coords}"/>')
    for name, value, threshold in s.held_out:
        if threshold is not None and math.isfinite(threshold):
            parts.append(
                f'<line class="threshold" x1="{PAD_L}" x2="{W - PAD_R}" y1="{_num(y(threshold))}" '
                f'y2="{_num(y(threshold))}"><title>{escape(name)} threshold {threshold:.4f}</title></line>'
            )
        parts.append(
            f'<circle class="held-out" cx="{_num(x(x1))}" cy="{_num(y(value))}" r="5">'
            f"<title>{escape(name)} {value:.4f}</title></circle>"
        )
    parts.append("</svg>")
    return "".join(parts)


TL_W, TL_H = 1200, 132  # the timeline's viewBox: as wide as a desktop card, so its text reads at 1:1


X = Callable[[datetime | float], float]  # a moment (datetime or epoch seconds) to its x on the timeline


def timeline(detail: RunDetail, now: datetime) -> str:
    """The run on a time axis from its acceptance: its states as spans, its steps as a progress
    line with each committed checkpoint, and each interruption and recovery as a marker."""
    view = detail.view
    start = view.created_at
    moments = [view.updated_at, *(r.at for r in detail.states), *(m.at for m in detail.metrics)]
    end = max(moments) if view.state in TERMINAL_STATES else now
    total = max((end - start).total_seconds(), 1e-3)

    def x(at: datetime | float) -> float:
        secs = at - start.timestamp() if isinstance(at, float) else (at - start).total_seconds()
        return PAD_L + min(max(secs / total, 0.0), 1.0) * (TL_W - PAD_L - PAD_R)

    parts = [
        f'<svg class="chart timeline" viewBox="0 0 {TL_W} {TL_H}" role="img" '
        f'aria-label="run timeline over {total:.0f} s">',
        '<text class="lane" x="4" y="24">state</text>',
        '<text class="lane" x="4" y="62">steps</text>',
        '<text class="lane" x="4" y="98">faults</text>',
        *_state_spans(detail, start, end, x),
        *_progress(detail, x),
        *_faults(detail, x),
        *_time_ticks(total),
        "</svg>",
    ]
    return "".join(parts)


def _state_spans(detail: RunDetail, start: datetime, end: datetime, x: X) -> list[str]:
    """The state lane: each state from its move to the next (the last until `end`)."""
    # A run's view is created queued (its hand-off); every later move is in its history.
    spans = [(start, RunState.queued.value), *((r.at, r.state.value) for r in detail.states)]
    parts = []
    for n, (at, state) in enumerate(spans):
        until = spans[n + 1][0] if n + 1 < len(spans) else end
        x_a, x_b = x(at), x(until)
        parts.append(
            f'<rect class="state s-{escape(state)}" x="{_num(x_a)}" y="12" width="{_num(max(x_b - x_a, 1.0))}" '
            f'height="18"><title>{escape(state)}</title></rect>'
        )
    return parts


def _progress(detail: RunDetail, x: X) -> list[str]:
    """The steps lane: a line through every metric event, and each committed checkpoint."""
    parts = []
    if detail.metrics:
        n = len(detail.metrics)
        coords = " ".join(
            f"{_num(x(m.at))},{_num(76 - 32 * (i + 1) / n)}" for i, m in enumerate(detail.metrics)
        )
        parts.append(f'<polyline class="progress" points="{coords}"/>')
    for c in detail.checkpoints:
        parts.append(
            f'<line class="checkpoint" x1="{_num(x(c.at))}" x2="{_num(x(c.at))}" y1="40" y2="78">'
            f"<title>checkpoint step {c.step}: {c.bytes / 1e6:.1f} MB, stall {c.stall_s * 1000:.1f} ms</title></line>"
        )
    return parts


def _faults(detail: RunDetail, x: X) -> list[str]:
    """The faults lane: each interruption where it was detected, each recovery where the run ran
    again after one."""
    parts = []
    for lost in detail.interruptions:
        cx = x(lost.detected_at)
        parts.append(
            f'<path class="interruption" d="M{_num(cx)},86 l7,14 h-14 z"><title>interrupted: '
            f"{escape(lost.cause)} (silent {lost.silent_s:.1f} s) at step {lost.step}</title></path>"
        )
    previous = ""
    for r in detail.states:
        if r.state is RunState.running and previous == RunState.interrupted.value:
            cx = x(r.at)
            parts.append(
                f'<circle class="recovery" cx="{_num(cx)}" cy="94" r="6"><title>recovered: running again'
                "</title></circle>"
            )
        previous = r.state.value
    return parts


def _time_ticks(total: float) -> list[str]:
    parts = []
    for t in _ticks(0.0, total, 4):
        xt = PAD_L + t / total * (TL_W - PAD_L - PAD_R)
        parts.append(
            f'<text class="tick" x="{_num(xt)}" y="{TL_H - 8}" text-anchor="middle">{t:.0f} s</text>'
        )
    return parts


BAR_W, BAR_H = 480, 20


def stacked_bar(goodput: float, shares: dict[str, float]) -> str:
    """Where 100 % of the GPU-hours went: goodput, then each badput category (`idle` last, for a
    rollup's booked GPU-hours), left to right."""
    parts = [
        f'<svg class="chart stacked" viewBox="0 0 {BAR_W} {BAR_H}" preserveAspectRatio="none" role="img">'
    ]
    x = 0.0
    for name, share in [("goodput", goodput), *((c, shares.get(c, 0.0)) for c in BOOKED_BADPUT)]:
        share = share if math.isfinite(share) and share > 0 else 0.0
        width = share * BAR_W
        if width <= 0:
            continue
        parts.append(
            f'<rect class="seg seg-{name}" x="{_num(x)}" y="0" width="{width:.2f}" height="{BAR_H}">'
            f"<title>{name} {share:.1%}</title></rect>"
        )
        x += width
    parts.append("</svg>")
    return "".join(parts)
