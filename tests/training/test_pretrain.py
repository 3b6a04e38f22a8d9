"""The pretraining stage and its checkpoints: loss falls, commits, pruning, exact resume, stop."""

import dataclasses
import json
import pathlib

import msgspec
import pytest
import torch

from contracts.manifest import Manifest
from contracts.runs import CheckpointSaved, LogLine, Metrics
from training.data.corpora import BatchIterator, load_tokens
from training.engine.checkpoint import Checkpointer
from training.engine.checkpoint_dir import MARKER, list_checkpoints, step_dir
from training.engine.checkpoint_load import load_latest
from training.engine.reporting import Recorder
from training.model import Transformer
from training.recipes.pretrain import build_optimizer, stage_config_from_manifest, train_stage

SEQ, BATCH = 32, 8

# The module installs this filter itself, but pytest resets warning filters for every test.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def manifest(steps: int, *, interval: int = 50, keep_last: int = 2, data=None, seed: int = 0) -> Manifest:
    return msgspec.convert(
        {
            "name": "test",
            "model": {"size": "tiny", "revision": "test"},
            "data": data or [{"name": "docs", "source": "builtin:pydoc_topics"}],
            "target": {"tokens": steps * SEQ * BATCH, "seq_len": SEQ, "batch_size": BATCH},
            "checkpoint": {"interval_steps": interval, "keep_last": keep_last},
            "budget_cap_usd": 1.0,
            "seed": seed,
        },
        Manifest,
    )


def never() -> bool:
    return False


def stop_after(calls: int):
    """A should_stop that answers True from its (calls+1)-th call: exactly `calls` steps run."""
    seen = []

    def should_stop() -> bool:
        seen.append(None)
        return len(seen) > calls

    return should_stop


def test_config_from_manifest():
    m = manifest(
        40,
        interval=7,
        keep_last=3,
        data=[
            {"name": "a", "source": "generated:arithmetic"},
            {"name": "b", "source": "generated:reverse"},
            {"name": "e", "source": "builtin:pydoc_topics", "role": "eval"},
        ],
        seed=5,
    )
    cfg = stage_config_from_manifest(m, pathlib.Path("/tmp/x"))
    assert cfg.steps == 40 and cfg.warmup_steps == 2 and cfg.seed == 5
    assert cfg.train_sources == ["generated:arithmetic", "generated:reverse"]
    assert cfg.eval_sources == ["builtin:pydoc_topics"]
    assert (cfg.checkpoint_interval, cfg.keep_last, cfg.checkpoint_dir) == (7, 3, "/tmp/x")
    one = manifest(1)
    few = msgspec.structs.replace(one, target=msgspec.structs.replace(one.target, tokens=5))
    assert stage_config_from_manifest(few, "/tmp/x").steps == 1  # fewer tokens than one step


def test_bad_config_is_refused_in_a_sentence(tmp_path):
    cfg = stage_config_from_manifest(manifest(10), str(tmp_path))
    with pytest.raises(ValueError, match="max_seq_len"):
        dataclasses.replace(cfg, seq_len=10_000)
    with pytest.raises(ValueError, match="Checkpoint interval"):
        dataclasses.replace(cfg, checkpoint_interval=0)


def test_loss_falls_on_pydoc_text(tmp_path):
    emit = Recorder()
    result = train_stage(stage_config_from_manifest(manifest(60), str(tmp_path)), emit, never)
    metrics = emit.of(Metrics)
    assert [m.step for m in metrics] == list(range(1, 61))
    assert result.final_step == 60 and not result.stopped and result.tokens == 60 * SEQ * BATCH
    assert result.first_loss > 5.0  # ~ln(256) = 5.55 at the start
    assert result.final_loss < result.first_loss - 2.0
    assert result.held_out_loss < 3.5
    assert max(m.learning_rate for m in metrics) == pytest.approx(3e-3)
    assert metrics[-1].learning_rate < 1e-3  # cosine decayed
    # Always a checkpoint at the end, reported after its commit.
    assert [c.step for c in emit.of(CheckpointSaved)] == [50, 60]
    assert [c.step for c in list_checkpoints(tmp_path)] == [50, 60]


def test_an_uncommitted_save_is_not_listed(tmp_path):
    torch.manual_seed(0)
    model = Transformer(stage_config_from_manifest(manifest(1), "").shape)
    optimizer = torch.optim.AdamW(model.parameters())
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(3, model, optimizer, data_position=3)
    # The marker is only written when the loop collects the finished future.
    assert not (step_dir(tmp_path, 3) / MARKER).exists()
    assert list_checkpoints(tmp_path) == [] and load_latest(tmp_path, model, optimizer) is None
    [info] = checkpointer.wait()
    assert info.step == 3 and info.bytes > 1_000_000 and info.save_s >= info.stall_s >= 0
    marker = json.loads((step_dir(tmp_path, 3) / MARKER).read_text())
    assert marker == {"step": 3, "bytes": info.bytes, "stall_s": info.stall_s, "save_s": info.save_s}
    assert list_checkpoints(tmp_path) == [info]
    # A dead save (files, no marker) and a torn marker are ignored.
    (step_dir(tmp_path, 9)).mkdir()
    (step_dir(tmp_path, 9) / "__0_0.distcp").write_bytes(b"partial")
    (step_dir(tmp_path, 10)).mkdir()
    (step_dir(tmp_path, 10) / MARKER).write_text("{")
    assert [c.step for c in list_checkpoints(tmp_path)] == [3]
    assert load_latest(tmp_path, model, optimizer).step == 3


def test_keep_last_prunes_older_commits_and_dead_saves(tmp_path):
    model = Transformer(stage_config_from_manifest(manifest(1), "").shape)
    optimizer = torch.optim.AdamW(model.parameters())
    step_dir(tmp_path, 0).mkdir(parents=True)  # a save that died before its marker
    checkpointer = Checkpointer(tmp_path, keep_last=2)
    for step in range(1, 5):
        checkpointer.save(step, model, optimizer)
    # Each save() waited for and committed the previous one; wait() hands all outcomes over once.
    assert [c.step for c in checkpointer.wait()] == [1, 2, 3, 4]
    assert checkpointer.wait() == []
    assert [c.step for c in list_checkpoints(tmp_path)] == [3, 4]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003", "step-00000004"]


def train_steps(model, optimizer, batches, n):
    losses = []
    for _ in range(n):
        x, y = next(batches)
        _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_load_latest_into_fresh_objects_continues_exactly(tmp_path):
    cfg = stage_config_from_manifest(manifest(10), str(tmp_path))
    tokens = load_tokens(cfg.train_sources)
    torch.manual_seed(0)
    model = Transformer(cfg.shape)
    optimizer = build_optimizer(model, cfg)
    batches = BatchIterator(tokens, seq_len=SEQ, batch_size=BATCH, seed=0)
    train_steps(model, optimizer, batches, 3)
    checkpointer = Checkpointer(tmp_path)
    checkpointer.save(3, model, optimizer, data_position=batches.position)
    # Training moves on while the save is in flight: the checkpoint must still hold step 3.
    expected = train_steps(model, optimizer, batches, 2)
    assert [c.step for c in checkpointer.wait()] == [3]

    torch.manual_seed(123)  # a different init, to be overwritten
    fresh_model = Transformer(cfg.shape)
    fresh_optimizer = build_optimizer(fresh_model, cfg)
    resumed = load_latest(tmp_path, fresh_model, fresh_optimizer)
    assert (resumed.step, resumed.data_position) == (3, 3)
    fresh_batches = BatchIterator(
        tokens, seq_len=SEQ, batch_size=BATCH, seed=0, position=resumed.data_position
    )
    assert train_steps(fresh_model, fresh_optimizer, fresh_batches, 2) == expected
    for a, b in zip(model.parameters(), fresh_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_stop_then_resume_matches_an_uninterrupted_run(tmp_path):
    m = manifest(12, interval=4)
    straight = Recorder()
    train_stage(stage_config_from_manifest(m, str(tmp_path / "straight")), straight, never)

    first = Recorder()
    cfg = stage_config_from_manifest(m, str(tmp_path / "resumed"))
    stopped = train_stage(cfg, first, stop_after(6))
    assert stopped.stopped and stopped.final_step == 6 and stopped.held_out_loss is None
    # Step 4 from the interval, step 6 saved on stop; both committed before returning.
    assert [c.step for c in first.of(CheckpointSaved)] == [4, 6]
    assert [c.step for c in list_checkpoints(cfg.checkpoint_dir)] == [4, 6]

    second = Recorder()
    finished = train_stage(cfg, second, never)
    assert any("Resuming" in log.message for log in second.of(LogLine))
    assert finished.final_step == 12 and not finished.stopped and finished.tokens == 12 * SEQ * BATCH
    straight_tail = [(m.step, m.loss, m.learning_rate) for m in straight.of(Metrics)[6:]]
    resumed_tail = [(m.step, m.loss, m.learning_rate) for m in second.of(Metrics)]
    assert resumed_tail == straight_tail  # exact float equality, step by step
    assert finished.final_loss == straight.of(Metrics)[-1].loss


def test_a_finished_stage_resumes_to_nothing(tmp_path):
    cfg = stage_config_from_manifest(manifest(3), str(tmp_path))
    train_stage(cfg, Recorder(), never)
    again = Recorder()
    result = train_stage(cfg, again, never)
    assert result.final_step == 3 and result.first_loss is None and again.of(Metrics) == []
    assert again.of(CheckpointSaved) == [] and result.held_out_loss is not None
