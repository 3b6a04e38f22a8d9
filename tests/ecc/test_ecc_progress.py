"""What a terminal shows for a run, decided without a terminal: each tick's bars, verdicts and
state (ecc/progress.py `Board`), the words beside a bar, and the loss sparklines of `ecc ito metrics`
(ecc/charts.py)."""

import math
from datetime import UTC, datetime

import msgspec
import pytest

from contracts.api import RunView
from contracts.evals import EvalMetric, StageGate
from contracts.runs import Metrics
from contracts.states import RunState
from ecc import charts, progress
from ecc.progress import Bar

AT = datetime(2026, 12, 2, 7, 30, tzinfo=UTC)
PASSED = StageGate(
    stage="pretrain",
    passed=True,
    metrics=[EvalMetric(name="held_out_loss", value=2.1, threshold=4.0, op="<=")],
)
REDONE = msgspec.structs.replace(PASSED, passed=False)


def view(stage=None, step=0, total=0, loss=None, state=RunState.running, gates=()) -> RunView:
    return RunView(
        run_id="run-1",
        account="acme",
        booking_id="bk-1",
        manifest_digest="d",
        idempotency_key="k",
        state=state,
        stage=stage,
        step=step,
        total_steps=total,
        loss=loss,
        created_at=AT,
        updated_at=AT,
        gates=list(gates),
    )


def point(stage: str, step: int, total: int, loss: float = 2.0, tok: float = 5000.0) -> Metrics:
    return Metrics(
        run_id="run-1",
        seq=step,
        at=AT,
        stage=stage,
        step=step,
        total_steps=total,
        loss=loss,
        learning_rate=1e-3,
        tokens_per_s=tok,
        grad_norm=1.0,
    )


def bar(stage, step=0, total=0, loss=None, tok=None, eta=None, done=False) -> Bar:
    return Bar(stage=stage, step=step, total=total, loss=loss, tokens_per_s=tok, eta_s=eta, done=done)


# Each scenario: ticks of (view, new points, now) and what each tick changes (bars, verdicts).
SCENARIOS = {
    "a stage's bar moves, with tokens/s from the points and an ETA from the measured rate": [
        ((view("pretrain", 10, 100, 3.0), [], 0.0), [bar("pretrain", 10, 100, 3.0)], []),
        (
            (view("pretrain", 30, 100, 2.5), [point("pretrain", 29, 100, tok=5000.0)], 2.0),
            [bar("pretrain", 30, 100, 2.5, 5000.0, eta=7.0)],  # 20 steps in 2 s: 70 left in 7 s
            [],
        ),
        ((view("pretrain", 30, 100, 2.5), [], 2.0), [], []),  # nothing new: nothing redrawn
    ],
    "a later stage leaves the earlier one done with its last numbers": [
        ((view("data_prep"), [], 0.0), [bar("data_prep")], []),
        (
            (view("pretrain", 5, 50, 3.0), [point("pretrain", 5, 50, 3.1, 900.0)], 1.0),
            [bar("data_prep", done=True), bar("pretrain", 5, 50, 3.0, 900.0)],
            [],
        ),
        (
            (view("sft", 0, 20, gates=[PASSED]), [point("pretrain", 50, 50, 1.5, 1000.0)], 9.0),
            [bar("pretrain", 50, 50, 1.5, 1000.0, done=True), bar("sft", 0, 20)],
            [PASSED],
        ),
    ],
    "a verdict lands once, and again only when it changes": [
        ((view("pretrain", 1, 10, gates=[PASSED]), [], 0.0), [bar("pretrain", 1, 10)], [PASSED]),
        ((view("pretrain", 1, 10, gates=[PASSED]), [], 0.0), [], []),
        ((view("pretrain", 1, 10, gates=[REDONE]), [], 0.0), [], [REDONE]),
    ],
    "points ahead of the view: the stage it names is already behind the run": [
        (
            (view("pretrain", 48, 50, 1.6), [point("pretrain", 50, 50, 1.5), point("sft", 2, 20, 1.2)], 0.0),
            [bar("pretrain", 48, 50, 1.6, 5000.0, done=True), bar("sft", 2, 20, 1.2, 5000.0)],
            [],
        ),
    ],
    "a restart from a checkpoint moves the bar back and measures the rate afresh": [
        ((view("pretrain", 40, 100), [], 0.0), [bar("pretrain", 40, 100)], []),
        ((view("pretrain", 30, 100), [], 1.0), [bar("pretrain", 30, 100)], []),
        ((view("pretrain", 40, 100), [], 2.0), [bar("pretrain", 40, 100, eta=6.0)], []),
    ],
    "no ETA while the run is not training; success finishes the last bar": [
        ((view("pretrain", 10, 100), [], 0.0), [bar("pretrain", 10, 100)], []),
        (
            (view("pretrain", 20, 100, state=RunState.awaiting_approval), [], 1.0),
            [bar("pretrain", 20, 100)],
            [],
        ),
        (
            (view("pretrain", 100, 100, state=RunState.succeeded), [], 5.0),
            [bar("pretrain", 100, 100, done=True)],
            [],
        ),
    ],
    "a queued run has no bar yet": [((view(state=RunState.queued), [], 0.0), [], [])],
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_tick_changes_what_it_should(name):
    board = progress.Board()
    for (v, points, now), bars, verdicts in SCENARIOS[name]:
        tick = board.tick(v, points, now)
        assert (tick.bars, tick.verdicts) == (bars, verdicts)


def test_the_state_is_said_when_it_changes_and_not_at_the_end():
    board = progress.Board()
    said = [
        board.tick(
            msgspec.structs.replace(view("pretrain", 1, 10, state=state), message=message), [], 0.0
        ).state
        for state, message in [
            (RunState.queued, None),
            (RunState.queued, None),
            (RunState.running, None),
            (RunState.running, None),
            (RunState.awaiting_approval, "loss spike at step 38"),
            (RunState.queued, None),
            (RunState.succeeded, "pretrain finished"),  # the summary after the bars says this
        ]
    ]
    assert said == [
        "queued",
        None,
        "running",
        None,
        "awaiting_approval: loss spike at step 38",
        "queued",
        None,
    ]


def test_bars_keep_the_order_stages_appeared_in():
    board = progress.Board()
    board.tick(view("data_prep"), [], 0.0)
    board.tick(view("pretrain", 1, 10), [], 1.0)
    board.tick(view("sft", 1, 5), [point("pretrain", 10, 10)], 2.0)
    assert list(board.bars) == ["data_prep", "pretrain", "sft"]
    assert [b.done for b in board.bars.values()] == [True, True, False]


@pytest.mark.parametrize(
    "b, words",
    [
        (bar("pretrain", 44, 400, 2.46151, 1234.4, eta=309.0), "44/400  loss 2.4615  1234 tok/s  ETA 5m09s"),
        (bar("pretrain", 400, 400, 1.0, 1500.0, done=True), "400/400  loss 1.0000  1500 tok/s  done"),
        (bar("pretrain", 3, 400), "3/400"),
        (bar("pretrain", 3, 400, math.nan), "3/400  loss nan"),
        (bar("data_prep"), "working"),
        (bar("data_prep", done=True), "done"),
    ],
)
def test_the_words_beside_a_bar(b, words):
    assert progress.describe(b) == words


@pytest.mark.parametrize(
    "seconds, words",
    [(-5, "0s"), (0, "0s"), (59.4, "59s"), (60, "1m00s"), (309, "5m09s"), (3600, "1h00m"), (7380, "2h03m")],
)
def test_durations_read_short(seconds, words):
    assert progress.duration(seconds) == words


@pytest.mark.parametrize(
    "first, now, total, eta",
    [
        ((0.0, 10), (2.0, 30), 100, 7.0),
        ((0.0, 10), (2.0, 10), 100, None),  # not moved yet
        ((0.0, 10), (0.0, 30), 100, None),  # no time passed
        ((0.0, 10), (2.0, 5), 100, None),  # went back
        ((0.0, 0), (1.0, 10), 0, None),  # the stage counts no steps
        ((0.0, 0), (1.0, 120), 100, 0.0),  # past the end: never negative
    ],
)
def test_eta_from_the_measured_rate(first, now, total, eta):
    assert progress.eta_s(first, now, total) == eta


NAN, INF = math.nan, math.inf


def spike_and_dip() -> list[float]:
    values = [5.0] * 1000
    values[200], values[700] = 0.0, 10.0
    return values


@pytest.mark.parametrize(
    "values, width, line",
    [
        ([], 48, ""),
        ([2.0] * 5, 48, "▄▄▄▄▄"),  # constant: mid-height, no column looks different
        ([1, 2, 3, 4, 5, 6, 7, 8], 48, "▁▂▃▄▅▆▇█"),
        ([8, 7, 6, 5, 4, 3, 2, 1], 4, "█▆▄▁"),  # buckets of two: the ends show the extremes
        ([3.0, NAN, 1.0], 48, "█!▁"),  # NaN marked where it happened, left out of the scale
        ([INF, 2.0, -INF, 2.0], 48, "!▄!▄"),
        ([NAN, INF], 48, "!!"),
        ([NAN] * 10, 4, "!!!!"),
        ([1.0, 9.0, 5.0, 5.0], 2, "█▅"),  # a bucket with both extremes shows the high one
    ],
)
def test_sparkline(values, width, line):
    assert charts.sparkline(values, width) == line


def test_downsampling_keeps_a_single_spike_and_dip():
    """1000 points in 48 columns: a mean per column would average the spike and the dip away."""
    line = charts.sparkline(spike_and_dip(), 48)
    assert len(line) == 48
    assert line.count("█") == 1 and line.count("▁") == 1
    assert set(line) == {"▁", "▅", "█"}
    assert line.index("▁") < line.index("█")  # each where it happened


def test_a_long_decreasing_curve_fits_the_width():
    line = charts.sparkline([100.0 - i for i in range(100_000)], 48)
    assert len(line) == 48 and line[0] == "█" and line[-1] == "▁"
    assert list(line) == sorted(line, reverse=True)


def test_one_line_per_stage_with_its_numbers():
    points = [
        point("pretrain", s, 4, loss, 1000.0 + s) for s, loss in [(1, 4.0), (2, 3.0), (3, 2.5), (4, 2.0)]
    ]
    points += [point("sft", 1, 2, 1.5, 800.0), point("sft", 2, 2, NAN, 750.0)]
    assert charts.stage_lines(points, width=8) == [
        "pretrain █▅▃▁     loss 4.0000 -> 2.0000, min 2.0000, steps 1-4/4, 1004 tok/s",
        "sft      ▄!       loss 1.5000 -> nan, min 1.5000, steps 1-2/2, 750 tok/s",
    ]
    assert charts.stage_lines([]) == []
