"""One training loop, with or without replica groups: `run_loop` without fault tolerance is the plain
PyTorch step (same losses, same weights); a `FaultTolerance` is called around every step in order, and
an attempt it does not commit leaves weights, schedule and step count untouched; a torchft replica
group's process (tests.training.replica_process) trains through `run_loop` itself and, alone in its quorum,
ends with exactly the weights of the plain loop. The kill/heal scenario is in test_torchft_replicas.py.
"""

import ast
import json
import pathlib
import signal

import pytest
import torch
from torch.optim.lr_scheduler import LambdaLR

from contracts.models import MODEL_SHAPES
from contracts.runs import CheckpointSaved, Metrics
from training.data.corpora import BatchIterator, load_tokens
from training.engine import loop as loop_module
from training.engine.loop import LoopSettings, StepOutput, TrainingError, run_loop
from training.engine.reporting import Recorder
from training.model import Transformer

REPO = pathlib.Path(__file__).resolve().parents[2]
STEPS = 6

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:The 'warn' method is deprecated"),  # torchft 0.2.0's own logger
]


def build(seed: int = 0, *, warmup: int = 3):
    """A tiny model, AdamW and a warmup schedule (so a skipped schedule step would show in the LR)."""
    torch.manual_seed(seed)
    model = Transformer(MODEL_SHAPES["tiny"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    return model, optimizer, scheduler


def batches(seq_len: int = 16, batch_size: int = 4) -> BatchIterator:
    tokens = load_tokens(["generated:arithmetic"], seed=0)
    return BatchIterator(tokens, seq_len=seq_len, batch_size=batch_size, seed=0)


def lm_step(model, data: BatchIterator, calls: list[int] | None = None):
    def step_fn(step: int) -> StepOutput:
        if calls is not None:
            calls.append(step)
        x, y = data.batch_at(step)  # a pure function of the step: a retried step sees the same batch
        _, loss = model(x, y)
        return StepOutput(loss=loss, tokens=x.numel())

    return step_fn


def run(tmp_path, *, fault_tolerance=None, calls=None, steps: int = STEPS):
    model, optimizer, scheduler = build()
    report = Recorder()
    settings = LoopSettings(stage="t", steps=steps, checkpoint_dir=str(tmp_path), checkpoint_interval=4)
    hooks = {} if fault_tolerance is None else {"fault_tolerance": fault_tolerance}
    step_fn = lm_step(model, batches(), calls)
    result = run_loop(settings, model, optimizer, scheduler, step_fn, report, lambda: False, **hooks)
    return result, report, model


def plain_pytorch(steps: int = STEPS) -> tuple[list[float], list[float], Transformer]:
    """The step the loop must equal when no replica groups are involved, written out by hand."""
    model, optimizer, scheduler = build()
    data = batches()
    losses, lrs = [], []
    model.train()
    for step in range(steps):
        x, y = data.batch_at(step)
        lrs.append(scheduler.get_last_lr()[0])
        _, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, lrs, model


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


class ScriptedReplicaGroup:
    """A FaultTolerance that records its calls and refuses to commit the attempts in `refuse`
    (1-based attempt numbers), as torchft does when a peer dies during the all-reduce."""

    def __init__(self, refuse: frozenset[int] = frozenset()):
        self.refuse = refuse
        self.calls: list[str] = []
        self.attempt = 0
        self.committed = 0

    def start_step(self, *, before_heal) -> None:
        self.attempt += 1
        self.calls.append("start")

    def reduce_gradients(self, params) -> None:
        assert all(p.grad is not None for p in params), "gradients are reduced after backward"
        self.calls.append("reduce")

    def should_commit(self) -> bool:
        self.calls.append("commit")
        return self.attempt not in self.refuse

    def end_step(self, loss, *, committed: bool) -> int:
        self.calls.append("end")
        self.committed += committed
        return self.committed

    def checkpoint_module(self):
        self.calls.append("checkpoint")
        return self.model

    def bind(self, model) -> "ScriptedReplicaGroup":
        self.model = model
        return self


def test_run_loop_without_fault_tolerance_is_the_plain_pytorch_step(tmp_path):
    result, report, model = run(tmp_path)
    losses, lrs, reference = plain_pytorch()
    metrics = report.of(Metrics)
    assert [m.step for m in metrics] == list(range(1, STEPS + 1))
    assert [m.loss for m in metrics] == losses  # exactly: the same float32 values
    assert [m.learning_rate for m in metrics] == lrs
    assert same_weights(model, reference)
    assert result.final_step == STEPS and result.final_loss == losses[-1]


def test_a_fault_tolerance_that_always_commits_changes_no_number(tmp_path):
    plain, _, plain_model = run(tmp_path / "plain")
    model, optimizer, scheduler = build()
    group = ScriptedReplicaGroup().bind(model)
    report = Recorder()
    settings = LoopSettings(
        stage="t", steps=STEPS, checkpoint_dir=str(tmp_path / "ft"), checkpoint_interval=4
    )
    result = run_loop(
        settings,
        model,
        optimizer,
        scheduler,
        lm_step(model, batches()),
        report,
        lambda: False,
        fault_tolerance=group,
    )
    losses, _, _ = plain_pytorch()
    assert [m.loss for m in report.of(Metrics)] == losses
    assert same_weights(model, plain_model)
    assert (result.first_loss, result.final_loss) == (plain.first_loss, plain.final_loss)
    # In order around every step; the checkpoint (steps 4 and 6) saves what the group hands over.
    step = ["start", "reduce", "commit", "end"]
    assert group.calls == step * 4 + ["checkpoint"] + step * 2 + ["checkpoint"]
    assert [e.step for e in report.of(CheckpointSaved)] == [4, 6]


def test_an_attempt_that_may_not_commit_is_tried_again_without_a_trace(tmp_path):
    calls: list[int] = []
    group = ScriptedReplicaGroup(refuse=frozenset({2, 3, 6}))
    model, optimizer, scheduler = build()
    group.bind(model)
    report = Recorder()
    settings = LoopSettings(stage="t", steps=STEPS, checkpoint_dir=str(tmp_path), checkpoint_interval=100)
    result = run_loop(
        settings,
        model,
        optimizer,
        scheduler,
        lm_step(model, batches(), calls),
        report,
        lambda: False,
        fault_tolerance=group,
    )
    # Attempts 2 and 3 redo step 1, attempt 6 redoes step 3: 9 attempts for 6 committed steps.
    assert calls == [0, 1, 1, 1, 2, 3, 3, 4, 5]
    losses, lrs, reference = plain_pytorch()
    metrics = report.of(Metrics)
    assert [m.step for m in metrics] == list(range(1, STEPS + 1))  # one per committed step
    assert [m.loss for m in metrics] == losses
    assert [m.learning_rate for m in metrics] == lrs  # the schedule stepped on commits only
    assert same_weights(model, reference)  # the optimizer stepped on commits only
    assert result.final_step == STEPS
    assert optimizer.state_dict()["state"][0]["step"] == STEPS


def test_a_step_without_a_loss_cannot_run_in_a_replica_group(tmp_path):
    model, optimizer, scheduler = build()
    settings = LoopSettings(stage="t", steps=2, checkpoint_dir=str(tmp_path))
    with pytest.raises(TrainingError, match="replica group"):
        run_loop(
            settings,
            model,
            optimizer,
            scheduler,
            lambda _: StepOutput(loss=None, tokens=0),
            Recorder(),
            lambda: False,
            fault_tolerance=ScriptedReplicaGroup().bind(model),
        )


def calls_in(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    }


def test_the_replica_modules_have_no_training_step_of_their_own():
    """Backward, the optimizer step and zero_grad happen in loop.py alone; the replica group's
    modules only build, hook and launch (its process, services/trainer/replicas.py then, used to run
    its own loop with all three)."""
    for name in ("tests/training/replica_process.py", "training/engine/fault_tolerance.py"):
        found = calls_in(REPO / name) & {"backward", "step", "zero_grad"}
        assert not found, f"{name} calls {sorted(found)}: a training loop of its own"
    assert {"backward", "step", "zero_grad"} <= calls_in(REPO / "training" / "engine" / "loop.py")


def test_a_replica_group_process_trains_through_run_loop_with_the_plain_loops_weights(tmp_path, monkeypatch):
    pytest.importorskip("torchft", reason="torchft is not installed: `pip install torchft==0.2.0`")
    from tests.training import replica_process
    from training.engine.fault_tolerance import ReplicaGroup, start_lighthouse, weights_checksum

    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("fault_tolerance"))
        return loop_module.run_loop(*args, **kwargs)

    monkeypatch.setattr(replica_process, "run_loop", spy)  # the name replica_process.py trains with
    steps, progress = 4, tmp_path / "replica0.jsonl"
    lighthouse = start_lighthouse()
    handler = signal.getsignal(signal.SIGTERM)
    try:
        argv = ["--replica-id", "0", "--lighthouse", lighthouse.address(), "--steps", str(steps)]
        argv += ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]
        argv += ["--seq-len", "16", "--progress", str(progress)]
        assert replica_process.main(argv) == 0
    finally:
        signal.signal(signal.SIGTERM, handler)
        lighthouse.shutdown()
    assert len(seen) == 1 and isinstance(seen[0], ReplicaGroup)
    events = [json.loads(line) for line in progress.read_text().splitlines()]
    committed = [e for e in events if e["event"] == "step" and e["committed"]]
    assert [e["step"] for e in committed] == list(range(1, steps + 1))
    assert {e["participants"] for e in committed} == {1}
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [2, 4]
    assert [e["step"] for e in events if e["event"] == "finished"] == [steps]

    # The same group alone, without torchft: the plain loop on the same seed, data and schedule.
    config = replica_process.ReplicaConfig(
        replica_id=0, lighthouse="", steps=steps, checkpoint_dir="", seq_len=16
    )
    torch.manual_seed(config.seed)
    data = BatchIterator(
        load_tokens([config.data_source], seed=config.seed),
        seq_len=config.seq_len,
        batch_size=config.batch_size,
        seed=config.seed,
    )
    model = Transformer(MODEL_SHAPES[config.model_size])
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr)
    scheduler = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)

    def step_fn(step: int) -> StepOutput:
        x, y = data.batch_at(step * config.num_replica_groups + config.replica_id)
        _, loss = model(x, y)
        return StepOutput(loss=loss, tokens=x.numel())

    settings = LoopSettings(stage="plain", steps=steps, checkpoint_dir=str(tmp_path / "plain"))
    report = Recorder()
    loop_module.run_loop(settings, model, optimizer, scheduler, step_fn, report, lambda: False)
    assert [round(m.loss, 5) for m in report.of(Metrics)] == [e["loss"] for e in committed]
    assert weights_checksum(model) == committed[-1]["checksum"]
