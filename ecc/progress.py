"""A followed run on a terminal: one bar per stage, updated in place; verdicts and log lines above.

`Board` is the pure part. Each tick of `ecc ito status --follow` hands it the run's view and the
metric points that arrived since the last tick; it answers what changed (`Tick`: the bars to add or
update, in the order the stages appeared, the gate verdicts that landed since, and the run's state
when it changed: queued, running, awaiting_approval with its message), tested as tables without a
terminal. `Screen` draws ticks with rich, which loads only when a Screen is made: on a
terminal, never for `--json`, a pipe, or `--help` (tests/ecc/test_client_imports.py holds this).

What a bar says comes from two places: the view is authoritative for the stage the run is in
(its step, total and loss, so a restart from a checkpoint moves the bar back); metric points give
every stage its tokens/s, and a stage the run has left its last step and loss. A stage is done once
the run has moved past it, or when the run succeeded. The ETA is this session's own measure:
steps gained since the stage was first seen over the time since then (no guess before it moves).
"""

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from contracts.api import RunView
from contracts.evals import StageGate
from contracts.runs import Metrics
from contracts.states import TERMINAL_STATES, RunState
from ecc.gates import gate_line

if TYPE_CHECKING:  # rich loads when a Screen is made (a terminal), never on import
    from rich.progress import TaskID


class Bar(msgspec.Struct, frozen=True, kw_only=True):
    """One stage's bar as it should look now."""

    stage: str
    step: int = 0
    total: int = 0  # 0: the stage counts no steps (data_prep): the bar pulses until done
    loss: float | None = None
    tokens_per_s: float | None = None
    eta_s: float | None = None  # None: not known yet (the stage has not moved since it was first seen)
    done: bool = False


class Tick(msgspec.Struct, frozen=True, kw_only=True):
    """What one poll changed on the screen."""

    bars: list[Bar] = []  # added or changed, in the order the stages first appeared
    verdicts: list[StageGate] = []  # gates that landed (or changed) since the last tick, in view order
    state: str | None = None  # the run's state and message when they changed (not a final one)


def duration(seconds: float) -> str:
    """`45s`, `5m09s`, `2h03m`: short enough to sit in a bar's line."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def eta_s(first: tuple[float, int], now: tuple[float, int], total: int) -> float | None:
    """Seconds left at the rate measured from `first` (time, step) to `now`; None until steps moved."""
    (t0, step0), (t1, step1) = first, now
    if not total or step1 <= step0 or t1 <= t0:
        return None
    return max(0.0, (total - step1) / ((step1 - step0) / (t1 - t0)))


def describe(bar: Bar) -> str:
    """The words beside a bar: `44/400  loss 2.4615  1234 tok/s  ETA 5m09s`."""
    parts = [f"{bar.step}/{bar.total}" if bar.total else ("done" if bar.done else "working")]
    if bar.loss is not None:
        parts.append(f"loss {bar.loss:.4f}" if math.isfinite(bar.loss) else f"loss {bar.loss}")
    if bar.tokens_per_s is not None:
        parts.append(f"{bar.tokens_per_s:.0f} tok/s")
    if bar.total:
        if bar.done:
            parts.append("done")
        elif bar.eta_s is not None:
            parts.append(f"ETA {duration(bar.eta_s)}")
    return "  ".join(parts)


class Board:
    """The bars and verdicts a followed run has shown so far; `tick` says what one poll changes."""

    def __init__(self) -> None:
        self.bars: dict[str, Bar] = {}  # insertion order is the order stages appeared
        self._first_seen: dict[str, tuple[float, int]] = {}  # stage -> (time, step) it was first seen
        self._shown_gates: set[bytes] = set()
        self._state: tuple[RunState, str | None] | None = None

    def tick(self, view: RunView, points: Sequence[Metrics], now: float) -> Tick:
        latest: dict[str, Metrics] = {}
        for p in points:
            latest[p.stage] = p  # points come in order: the last one of each stage wins
        stages = [*self.bars, *(s for s in latest if s not in self.bars)]
        if view.stage and view.stage not in stages:
            stages.append(view.stage)
        changed = []
        for stage in stages:
            moved_on = stage != stages[-1]  # a later stage has appeared: this one is behind the run
            bar = self._bar(stage, view, latest.get(stage), now, moved_on)
            if self.bars.get(stage) != bar:
                changed.append(bar)
                self.bars[stage] = bar
        verdicts = []
        for gate in view.gates:
            key = msgspec.json.encode(gate)
            if key not in self._shown_gates:
                self._shown_gates.add(key)
                verdicts.append(gate)
        state = None
        if (view.state, view.message) != self._state:
            self._state = (view.state, view.message)
            if view.state not in TERMINAL_STATES:  # the summary after the bars says how it ended
                state = f"{view.state}: {view.message}" if view.message else str(view.state)
        return Tick(bars=changed, verdicts=verdicts, state=state)

    def _bar(self, stage: str, view: RunView, point: Metrics | None, now: float, moved_on: bool) -> Bar:
        old = self.bars.get(stage) or Bar(stage=stage)
        if point is not None:
            old = msgspec.structs.replace(
                old,
                step=point.step,
                total=point.total_steps,
                loss=point.loss,
                tokens_per_s=point.tokens_per_s,
            )
        current = stage == view.stage
        if current:
            loss = view.loss if view.loss is not None else old.loss
            old = msgspec.structs.replace(old, step=view.step, total=view.total_steps, loss=loss)
        if stage not in self._first_seen or old.step < self._first_seen[stage][1]:
            self._first_seen[stage] = (now, old.step)  # first seen, or restarted from a checkpoint
        done = old.done or moved_on or view.state is RunState.succeeded
        eta = None
        if current and not done and view.state is RunState.running:
            eta = eta_s(self._first_seen[stage], (now, old.step), old.total)
        return msgspec.structs.replace(old, done=done, eta_s=eta)


class Screen:
    """A Board drawn with rich: bars in place at the bottom, verdicts and log lines printed above.

    Use as a context manager: leaving it stops the live display and leaves the last bars on screen.
    """

    def __init__(self, console: Any = None) -> None:
        from rich.progress import BarColumn, Progress, TextColumn

        self.board = Board()
        self._progress: Progress = Progress(
            TextColumn("{task.fields[stage]}"),
            BarColumn(bar_width=32),
            TextColumn("{task.description}"),
            console=console,
            refresh_per_second=4,  # the data changes once a second (a poll): more redraws show nothing new
            transient=False,
        )
        self._tasks: dict[str, TaskID] = {}

    def __enter__(self) -> "Screen":
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def log(self, message: str) -> None:
        self._print(f"  log: {message}")

    def update(self, view: RunView, points: Sequence[Metrics], now: float) -> None:
        self.draw(self.board.tick(view, points, now))

    def draw(self, tick: Tick) -> None:
        if tick.state is not None:
            self._print(f"  state: {tick.state}")
        for gate in tick.verdicts:
            self._print(gate_line(gate), style="green" if gate.passed else "bold red")
        width = max((len(stage) for stage in self.board.bars), default=0)
        for bar in tick.bars:
            if bar.stage not in self._tasks:
                self._tasks[bar.stage] = self._progress.add_task("", stage="", total=None)
            total = bar.total or (1 if bar.done else None)  # None: a pulsing bar
            self._progress.update(
                self._tasks[bar.stage],
                total=total,
                completed=(total or 0) if bar.done else bar.step,
                description=describe(bar),
            )
        for stage, task in self._tasks.items():  # names padded alike so the bars line up
            self._progress.update(task, stage=f"{stage:<{width}}")

    def _print(self, line: str, style: str | None = None) -> None:
        from rich.text import Text

        self._progress.console.print(Text(line, style=style or ""), soft_wrap=True)
