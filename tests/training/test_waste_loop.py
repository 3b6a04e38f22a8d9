"""The shared loop reads each step's values late and once: every step's loss and grad norm are
still emitted, in order and with the same values; the reads come after the next step was queued;
a diverged loss never reaches a checkpoint; stops and checkpoints read every pending step first."""

import math

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from contracts.models import MODEL_SHAPES
from contracts.runs import CheckpointSaved, LogLine, Metrics, RunEvent
from training.engine.checkpoint_dir import list_checkpoints
from training.engine.loop import LoopSettings, StepOutput, TrainingError, run_loop
from training.engine.reporting import Recorder
from training.model import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def setup(seed: int = 0, spy: list | None = None):
    torch.manual_seed(seed)
    model = Transformer(MODEL_SHAPES["tiny"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    if spy is not None:  # records the order of optimizer steps (and, in Recorder, of metric emits)
        optimizer.register_step_post_hook(lambda *_: spy.append("optimizer.step"))
    scheduler = LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    data = torch.randint(0, 256, (12, 4, 17), generator=torch.Generator().manual_seed(seed))
    return model, optimizer, scheduler, data


def lm_step(model, data, *, nan_at: int | None = None):
    def step_fn(step: int) -> StepOutput:
        batch = data[step % len(data)]
        _, loss = model(batch[:, :-1], batch[:, 1:])
        if step == nan_at:
            loss = loss * float("nan")
        return StepOutput(
            loss=loss,
            tokens=batch[:, :-1].numel(),
            scalars={"step": torch.tensor(float(step))},
            on_scalars=lambda values: None,
        )

    return step_fn


def train(
    tmp_path,
    read_lag: int,
    *,
    steps: int = 9,
    interval: int = 4,
    stop_after: int | None = None,
    nan_at: int | None = None,
    spy: list | None = None,
) -> tuple[Recorder, object]:
    model, optimizer, scheduler, data = setup(spy=spy)
    emit = SpyRecorder(spy)
    calls = []

    def should_stop() -> bool:
        calls.append(None)
        return stop_after is not None and len(calls) > stop_after

    settings = LoopSettings(
        stage="t",
        steps=steps,
        checkpoint_dir=str(tmp_path / f"lag{read_lag}"),
        checkpoint_interval=interval,
        read_lag=read_lag,
    )
    result = run_loop(
        settings, model, optimizer, scheduler, lm_step(model, data, nan_at=nan_at), emit, should_stop
    )
    return emit, result


class SpyRecorder(Recorder):
    """Also notes each metrics event in `spy`, beside the optimizer steps."""

    def __init__(self, spy: list | None = None):
        super().__init__()
        self.spy = spy

    def record(self, event: RunEvent) -> None:
        super().record(event)
        if self.spy is not None and isinstance(event, Metrics):
            self.spy.append(f"metrics {event.step}")


def tag_of(event: RunEvent) -> str:
    return type(event).__struct_config__.tag


def values(emit) -> list[tuple]:
    return [(m.step, m.loss, m.grad_norm, m.learning_rate) for m in emit.of(Metrics)]


def test_a_late_read_reports_every_step_in_order_with_the_same_values(tmp_path):
    now, _ = train(tmp_path, read_lag=0)
    late, result = train(tmp_path, read_lag=1)
    assert [m.step for m in late.of(Metrics)] == list(range(1, 10))
    assert values(late) == values(now)  # exact: the same steps, read later
    assert result.first_loss == now.of(Metrics)[0].loss and result.final_loss == now.of(Metrics)[-1].loss
    assert all(m.tokens_per_s > 0 and math.isfinite(m.grad_norm) for m in late.of(Metrics))
    # A checkpoint is reported after the metrics of its step, whatever the lag.
    for emit in (now, late):
        order = [(tag_of(e), e.step) for e in emit.events if isinstance(e, (Metrics, CheckpointSaved))]
        for kind, step in order:
            if kind == "checkpoint":
                assert order.index(("metrics", step)) < order.index(("checkpoint", step))
    assert [c.step for c in late.of(CheckpointSaved)] == [4, 8, 9]
    assert [c.step for c in list_checkpoints(tmp_path / "lag1")] == [8, 9]  # keep_last 2


def test_with_a_lag_a_step_is_read_after_the_next_one_was_queued(tmp_path):
    spy: list[str] = []
    train(tmp_path, read_lag=1, steps=5, interval=100, spy=spy)
    assert spy == [
        "optimizer.step",
        "optimizer.step",
        "metrics 1",
        "optimizer.step",
        "metrics 2",
        "optimizer.step",
        "metrics 3",
        "optimizer.step",
        "metrics 4",
        "metrics 5",
    ]
    spy.clear()
    train(tmp_path, read_lag=0, steps=3, interval=100, spy=spy)
    assert spy == [
        "optimizer.step",
        "metrics 1",
        "optimizer.step",
        "metrics 2",
        "optimizer.step",
        "metrics 3",
    ]


def test_scalars_come_with_their_step_before_its_metrics(tmp_path):
    model, optimizer, scheduler, data = setup()
    emit = Recorder()
    inner = lm_step(model, data)

    def step_fn(step: int) -> StepOutput:
        out = inner(step)
        out.scalars = {"twice": torch.tensor(2.0 * step), "half": torch.tensor(step / 2)}
        out.on_scalars = lambda got: emit.log(f"{step}: {got}")
        return out

    settings = LoopSettings(
        stage="t", steps=4, checkpoint_dir=str(tmp_path), checkpoint_interval=100, read_lag=1
    )
    run_loop(settings, model, optimizer, scheduler, step_fn, emit, lambda: False)
    seen = [
        ("metrics", e.step) if isinstance(e, Metrics) else ("log", e.message)
        for e in emit.events
        if isinstance(e, Metrics) or (isinstance(e, LogLine) and "{" in e.message)
    ]
    assert seen[:8] == [
        ("log", "0: {'twice': 0.0, 'half': 0.0}"),
        ("metrics", 1),
        ("log", "1: {'twice': 2.0, 'half': 0.5}"),
        ("metrics", 2),
        ("log", "2: {'twice': 4.0, 'half': 1.0}"),
        ("metrics", 3),
        ("log", "3: {'twice': 6.0, 'half': 1.5}"),
        ("metrics", 4),
    ]


def test_a_diverged_step_read_late_never_reaches_a_checkpoint(tmp_path):
    # The 4th step's loss is NaN and the 4th step is a checkpoint step: its values are read before
    # the save, so the run stops there with nothing committed.
    with pytest.raises(TrainingError, match="diverged at step 4"):
        train(tmp_path, read_lag=1, nan_at=3, interval=4)
    assert list_checkpoints(tmp_path / "lag1") == []


def test_a_diverged_step_is_reported_a_step_late_at_most(tmp_path):
    emit = Recorder()
    model, optimizer, scheduler, data = setup()
    settings = LoopSettings(
        stage="t", steps=9, checkpoint_dir=str(tmp_path), checkpoint_interval=100, read_lag=1
    )
    with pytest.raises(TrainingError, match="diverged at step 2"):
        run_loop(settings, model, optimizer, scheduler, lm_step(model, data, nan_at=1), emit, lambda: False)
    assert [m.step for m in emit.of(Metrics)] == [1]
    assert "Loss became nan at step 2" in emit.of(LogLine)[-1].message


def test_a_stop_reads_the_pending_steps_before_its_checkpoint(tmp_path):
    emit, result = train(tmp_path, read_lag=1, stop_after=3, interval=100)
    assert result.stopped and result.final_step == 3
    assert [m.step for m in emit.of(Metrics)] == [1, 2, 3]
    kinds = [tag_of(e) for e in emit.events if not isinstance(e, LogLine) or "Stop requested" in e.message]
    assert kinds == ["metrics", "metrics", "metrics", "log", "checkpoint"]
    assert [c.step for c in list_checkpoints(tmp_path / "lag1")] == [3]


def test_the_lag_follows_the_device_by_default(tmp_path):
    spy: list[str] = []
    model, optimizer, scheduler, data = setup()
    settings = LoopSettings(stage="t", steps=2, checkpoint_dir=str(tmp_path), checkpoint_interval=100)
    assert settings.read_lag is None

    class Spy(Recorder):
        def record(self, event: RunEvent) -> None:
            if isinstance(event, Metrics):
                spy.append(event.step)

    def step_fn(step):
        spy.append(f"step {step}")
        return lm_step(model, data)(step)

    run_loop(settings, model, optimizer, scheduler, step_fn, Spy(), lambda: False)
    assert spy == ["step 0", 1, "step 1", 2]  # CPU: read at once, nothing gained by waiting
