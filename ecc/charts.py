"""Loss curves as text a terminal shows: one sparkline per stage for `ecc ito metrics RUN`.

Pure functions, no terminal library: `sparkline` draws a series in eight block heights, downsampled
to a fixed width so a 100k-step run fits a line; `stage_lines` gives each stage its curve with the
numbers a person checks (first -> last loss, the lowest, the steps, the last throughput).

Downsampling stays honest about the extremes: every column is its bucket's mean, except that the
column holding the series' lowest value shows it (the lowest block) and the one holding its highest
shows that (the highest block), so a spike or a dip never averages away. A non-finite loss (NaN,
inf) is drawn as `!` in its column and left out of the scale: the curve of the finite points stays
readable and the bad step still shows where it happened.
"""

import math
from collections.abc import Sequence

from contracts.runs import Metrics

BLOCKS = "▁▂▃▄▅▆▇█"
NOT_FINITE = "!"
FLAT = BLOCKS[3]  # a constant series sits mid-height: no step looks lower or higher than another
WIDTH = 48  # columns per curve: fits beside the numbers in an 120-column terminal


def _buckets(n: int, width: int) -> list[range]:
    """`n` indices in at most `width` contiguous buckets whose sizes differ by one at most."""
    if n <= width:
        return [range(i, i + 1) for i in range(n)]
    return [range(i * n // width, (i + 1) * n // width) for i in range(width)]


def sparkline(values: Sequence[float], width: int = WIDTH) -> str:
    """`values` as at most `width` block characters, lowest `▁` to highest `█` (see the module doc)."""
    assert width >= 1, "a sparkline needs at least one column"
    buckets = _buckets(len(values), width)
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return NOT_FINITE * len(buckets)
    lo, hi = min(finite), max(finite)
    lowest, highest = list(values).index(lo), list(values).index(hi)  # the first of each extreme
    out = []
    for bucket in buckets:
        chunk = [values[i] for i in bucket]
        if not all(math.isfinite(v) for v in chunk):
            out.append(NOT_FINITE)
            continue
        if hi == lo:
            out.append(FLAT)
            continue
        if highest in bucket:  # a bucket with both extremes shows the high one: a spike must show
            value = hi
        elif lowest in bucket:
            value = lo
        else:
            value = sum(chunk) / len(chunk)
        out.append(BLOCKS[int((value - lo) / (hi - lo) * (len(BLOCKS) - 1) + 0.5)])  # halves round up
    return "".join(out)


def _loss(value: float) -> str:
    return f"{value:.4f}" if math.isfinite(value) else str(value)


def stage_lines(points: Sequence[Metrics], width: int = WIDTH) -> list[str]:
    """One line per stage, in the order the stages first appear: name, curve, then the numbers."""
    by_stage: dict[str, list[Metrics]] = {}
    for p in points:
        by_stage.setdefault(p.stage, []).append(p)
    if not by_stage:
        return []
    name_width = max(len(stage) for stage in by_stage)
    rows = []
    for stage, pts in by_stage.items():
        losses = [p.loss for p in pts]
        finite = [v for v in losses if math.isfinite(v)]
        first, last = pts[0], pts[-1]
        lowest = f"min {_loss(min(finite))}" if finite else "no finite loss"
        rows.append(
            f"{stage:<{name_width}} {sparkline(losses, width):<{width}} "
            f"loss {_loss(first.loss)} -> {_loss(last.loss)}, {lowest}, "
            f"steps {first.step}-{last.step}/{last.total_steps}, {last.tokens_per_s:.0f} tok/s"
        )
    return rows
