"""Checkpoint staging: one reused DCP stager per Checkpointer, the copy of the state made in the
background while the next forward and backward run, and the loop waiting for it only right before
the optimizer step that would change what is being copied. A save still holds exactly the state at
its call, and its reported stall includes the wait for the copy.

Staging is made slow on purpose here (a gate or a sleep inside the stager's copy), so that a loop
or a Checkpointer that did not wait for the copy would write state from a later step."""

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.optim.lr_scheduler import LambdaLR
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_map_only

from contracts.models import MODEL_SHAPES
from contracts.runs import CheckpointSaved
from training.data.corpora import BatchIterator, load_tokens
from training.engine import checkpoint as checkpoint_module
from training.engine.checkpoint import Checkpointer
from training.engine.checkpoint_dir import MARKER, CheckpointInfo, list_checkpoints, step_dir
from training.engine.loop import LoopSettings, StepOutput, run_loop
from training.engine.reporting import Recorder
from training.model import Transformer

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

RELEASE_S = 0.3  # how long a gated copy is held back: far longer than a save call on the tiny model


def build(seed: int = 0):
    torch.manual_seed(seed)
    model = Transformer(MODEL_SHAPES["tiny"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer


def train_step(model, optimizer, step: int) -> None:
    x = torch.randint(
        0, MODEL_SHAPES["tiny"].vocab_size, (2, 16), generator=torch.Generator().manual_seed(step)
    )
    _, loss = model(x, x)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def snapshot(model, optimizer) -> dict:
    """A deep copy of what a checkpoint of (model, optimizer) holds now."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return tree_map_only(
        torch.Tensor, lambda t: t.detach().clone(), {"model": model_sd, "optimizer": optim_sd}
    )


def saved_state(path: str) -> dict:
    """The checkpoint at `path`, loaded into a fresh model and optimizer's layout."""
    model, optimizer = build(seed=123)
    train_step(model, optimizer, 0)  # materialise the optimizer state to load into
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optimizer": optim_sd}
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


def tensors(state: dict) -> dict[str, torch.Tensor]:
    """Every tensor of a state dict by its path (the LR and other settings are the sidecar's, or the
    optimizer's own, and differ between the fresh template and the trained optimizer)."""
    leaves, _ = tree_flatten_with_path(state)
    return {keystr(path): leaf for path, leaf in leaves if isinstance(leaf, torch.Tensor)}


def assert_same_state(a: dict, b: dict) -> None:
    a_tensors, b_tensors = tensors(a), tensors(b)
    assert a_tensors.keys() == b_tensors.keys() and len(a_tensors) > 10
    for name, tensor in a_tensors.items():
        assert torch.equal(tensor, b_tensors[name]), name


@pytest.fixture
def stagers(monkeypatch) -> dict[str, int]:
    """Counts DefaultStager constructions and closes, wherever they happen (ours or DCP's own)."""
    counts = {"created": 0, "closed": 0}
    mine: list[DefaultStager] = []  # a close from another test's leftover thread does not count
    init, close = DefaultStager.__init__, DefaultStager.close

    def counting_init(self, *args, **kwargs):
        counts["created"] += 1
        mine.append(self)
        init(self, *args, **kwargs)

    def counting_close(self):
        counts["closed"] += any(self is stager for stager in mine)
        close(self)

    monkeypatch.setattr(DefaultStager, "__init__", counting_init)
    monkeypatch.setattr(DefaultStager, "close", counting_close)
    return counts


@pytest.fixture
def gate(monkeypatch) -> threading.Event:
    """Holds every staging copy until the event is set (released again right after each copy)."""
    event = threading.Event()
    stage = DefaultStager._stage

    def gated(self, state_dict, **kwargs):
        assert event.wait(timeout=30), "the test never released the staging copy"
        event.clear()
        return stage(self, state_dict, **kwargs)

    monkeypatch.setattr(DefaultStager, "_stage", gated)
    return event


def release_later(event: threading.Event) -> None:
    threading.Timer(RELEASE_S, event.set).start()


def test_one_stager_serves_every_save_and_is_closed_with_the_checkpointer(tmp_path, stagers):
    model, optimizer = build()
    checkpointer = Checkpointer(tmp_path, keep_last=5)
    for step in range(1, 4):
        train_step(model, optimizer, step)
        checkpointer.save(step, model, optimizer, data_position=step)
    assert [info.step for info in checkpointer.wait()] == [1, 2, 3]
    assert stagers == {"created": 1, "closed": 0}  # one staging buffer, reused by every save
    checkpointer.close()
    assert stagers == {"created": 1, "closed": 1}
    with pytest.raises(RuntimeError, match="closed"):
        checkpointer.save(4, model, optimizer)


def test_a_save_holds_the_state_at_its_call_while_training_goes_on(tmp_path, gate):
    model, optimizer = build()
    train_step(model, optimizer, 0)
    checkpointer = Checkpointer(tmp_path, keep_last=5, overlap_staging=True)
    expected = {}
    for step in (1, 2, 3):
        expected[step] = snapshot(model, optimizer)
        checkpointer.save(step, model, optimizer, data_position=step)
        # The copy is held back: only waiting for it makes the step below safe.
        release_later(gate)
        assert checkpointer.wait_staged() > 0
        train_step(model, optimizer, step)  # changes every parameter and the optimizer state
    infos = checkpointer.wait()
    checkpointer.close()
    assert [info.step for info in infos] == [1, 2, 3]
    for step, state in expected.items():
        assert_same_state(saved_state(str(step_dir(tmp_path, step))), state)
    assert checkpointer.wait_staged() == 0.0  # nothing left to wait for


def test_the_reported_stall_includes_the_wait_for_staging(tmp_path, gate):
    model, optimizer = build()
    train_step(model, optimizer, 0)
    checkpointer = Checkpointer(tmp_path, overlap_staging=True)
    checkpointer.save(1, model, optimizer)
    release_later(gate)
    waited = checkpointer.wait_staged()
    assert waited > 0
    [info] = checkpointer.wait()
    checkpointer.close()
    assert isinstance(info, CheckpointInfo)
    # The loop was blocked by the call and by the wait: the stall counts both (the call alone is
    # far shorter than the held-back copy).
    assert info.stall_s >= round(waited, 6)
    assert list_checkpoints(tmp_path) == [info]
    assert f'"stall_s": {info.stall_s}' in (step_dir(tmp_path, 1) / MARKER).read_text()


def test_without_overlap_a_save_returns_with_the_state_copied(tmp_path, gate):
    """The fallback for callers that do not call wait_staged: save itself waits for the copy."""
    model, optimizer = build()
    train_step(model, optimizer, 0)
    checkpointer = Checkpointer(tmp_path)
    expected = snapshot(model, optimizer)
    release_later(gate)
    checkpointer.save(1, model, optimizer)
    train_step(model, optimizer, 1)  # straight away, no wait_staged
    [info] = checkpointer.wait()
    checkpointer.close()
    assert info.stall_s > 0
    assert_same_state(saved_state(str(step_dir(tmp_path, 1))), expected)


def test_the_loop_waits_for_staging_before_each_step_and_reports_the_wait(tmp_path, monkeypatch, stagers):
    """run_loop saves every other step while the copy of each save is slow: every checkpoint still
    holds the state of its step, and its CheckpointSaved stall includes what the loop waited."""
    stage = DefaultStager._stage

    def slow(self, state_dict, **kwargs):
        threading.Event().wait(RELEASE_S)  # longer than a tiny step: the loop has to wait
        return stage(self, state_dict, **kwargs)

    monkeypatch.setattr(DefaultStager, "_stage", slow)
    expected: dict[int, dict] = {}
    waits: dict[int, float] = {}
    save, wait_staged = Checkpointer.save, Checkpointer.wait_staged

    def recording_save(self, step, model, optimizer, **kwargs):
        expected[step] = snapshot(model, optimizer)
        save(self, step, model, optimizer, **kwargs)
        waits[step] = 0.0

    def recording_wait_staged(self):
        waited = wait_staged(self)
        if self._pending is not None:  # the save whose copy it waited for
            waits[self._pending["step"]] += waited
        return waited

    monkeypatch.setattr(Checkpointer, "save", recording_save)
    monkeypatch.setattr(Checkpointer, "wait_staged", recording_wait_staged)
    torch.manual_seed(0)
    model = Transformer(MODEL_SHAPES["tiny"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = LambdaLR(optimizer, lambda s: 1.0)
    data = BatchIterator(load_tokens(["generated:arithmetic"], seed=0), seq_len=16, batch_size=4, seed=0)

    def step_fn(step: int) -> StepOutput:
        x, y = data.batch_at(step)
        return StepOutput(loss=model(x, y)[1], tokens=x.numel())

    report = Recorder()
    settings = LoopSettings(
        stage="t", steps=6, checkpoint_dir=str(tmp_path), checkpoint_interval=2, keep_last=5
    )
    run_loop(settings, model, optimizer, scheduler, step_fn, report, lambda: False)

    saved = report.of(CheckpointSaved)
    assert [event.step for event in saved] == [2, 4, 6]
    for step in (2, 4, 6):
        assert_same_state(saved_state(str(step_dir(tmp_path, step))), expected[step])
    for event in saved[:2]:  # followed by a step: the loop waited for their copies
        assert waits[event.step] > 0 and event.stall_s >= round(waits[event.step], 6)
    assert stagers == {"created": 1, "closed": 1}  # one stager for the stage, closed at its end


def test_the_loop_closes_its_stager_when_a_step_fails(tmp_path, stagers):
    model, optimizer = build()
    scheduler = LambdaLR(optimizer, lambda s: 1.0)

    def step_fn(step: int) -> StepOutput:
        if step == 3:
            raise ValueError("a broken batch")
        x = torch.randint(0, MODEL_SHAPES["tiny"].vocab_size, (2, 16))
        return StepOutput(loss=model(x, x)[1], tokens=x.numel())

    settings = LoopSettings(stage="t", steps=6, checkpoint_dir=str(tmp_path), checkpoint_interval=2)
    with pytest.raises(ValueError, match="broken batch"):
        run_loop(settings, model, optimizer, scheduler, step_fn, Recorder(), lambda: False)
    assert stagers == {"created": 1, "closed": 1}


def test_the_staging_options_fit_the_machine():
    """No pinned memory without cuda, no non-blocking copy without an accelerator (DefaultStager
    refuses it), and a stager made with them copies in the background."""
    options = checkpoint_module.staging_options()
    assert options.use_async_staging and not options.use_shared_memory
    assert options.use_pinned_memory == torch.cuda.is_available()
    assert options.use_non_blocking_copy == torch.accelerator.is_available()
    stager = DefaultStager(options)
    try:
        staged = stager.stage({"w": torch.ones(3)})
        assert torch.equal(staged.result()["w"], torch.ones(3))
    finally:
        stager.close()


class HealingGroup:
    """A FaultTolerance whose quorum at `heal_at` (1-based attempt) heals: it calls `before_heal`,
    then overwrites every parameter in place, as loading a peer's state does."""

    def __init__(self, model: torch.nn.Module, heal_at: int):
        self.model, self.heal_at = model, heal_at
        self.attempt = 0

    def start_step(self, *, before_heal) -> None:
        self.attempt += 1
        if self.attempt == self.heal_at:
            before_heal()
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(1.0)

    def reduce_gradients(self, params) -> None:
        pass

    def should_commit(self) -> bool:
        return True

    def end_step(self, loss, *, committed: bool) -> int:
        return self.attempt

    def checkpoint_module(self) -> torch.nn.Module:
        return self.model


def test_a_heal_at_the_quorum_waits_for_the_copy_of_the_last_save(tmp_path, monkeypatch):
    """A replica group that heals right after a save overwrites the parameters before the next
    forward pass: the save still holds the state of its step."""
    stage = DefaultStager._stage

    def slow(self, state_dict, **kwargs):
        threading.Event().wait(RELEASE_S)
        return stage(self, state_dict, **kwargs)

    monkeypatch.setattr(DefaultStager, "_stage", slow)
    expected: dict[int, dict] = {}
    save = Checkpointer.save

    def recording_save(self, step, model, optimizer, **kwargs):
        expected[step] = snapshot(model, optimizer)
        save(self, step, model, optimizer, **kwargs)

    monkeypatch.setattr(Checkpointer, "save", recording_save)
    model, optimizer = build()
    scheduler = LambdaLR(optimizer, lambda s: 1.0)

    def step_fn(step: int) -> StepOutput:
        x = torch.randint(
            0, MODEL_SHAPES["tiny"].vocab_size, (2, 16), generator=torch.Generator().manual_seed(step)
        )
        return StepOutput(loss=model(x, x)[1], tokens=x.numel())

    settings = LoopSettings(
        stage="t", steps=4, checkpoint_dir=str(tmp_path), checkpoint_interval=2, keep_last=5
    )
    group = HealingGroup(model, heal_at=3)  # the quorum right after the save at step 2
    run_loop(settings, model, optimizer, scheduler, step_fn, Recorder(), lambda: False, fault_tolerance=group)
    assert [info.step for info in list_checkpoints(tmp_path)] == [2, 4]
    for step in (2, 4):
        assert_same_state(saved_state(str(step_dir(tmp_path, step))), expected[step])


def test_the_loop_thread_only_starts_a_save_one_writer_thread_does_the_rest(tmp_path, monkeypatch):
    """Issue 30: a tiny model's save stalled the loop twice as long as torch.save: DCP started a
    thread per save, and the loop itself read the state dict and fsync'd the sidecar. Now the
    loop's call starts the save; one writer thread, the same for every save, does those."""
    threads: dict[str, set[int]] = {"state_dict": set(), "sidecar": set()}
    read, write_json = checkpoint_module.get_state_dict, checkpoint_module.write_json_atomic

    def recording_read(*args, **kwargs):
        threads["state_dict"].add(threading.get_ident())
        return read(*args, **kwargs)

    def recording_write(path, value):
        if path.name == checkpoint_module.SIDECAR:
            threads["sidecar"].add(threading.get_ident())
        return write_json(path, value)

    monkeypatch.setattr(checkpoint_module, "get_state_dict", recording_read)
    monkeypatch.setattr(checkpoint_module, "write_json_atomic", recording_write)
    model, optimizer = build()
    checkpointer = Checkpointer(tmp_path, keep_last=5, overlap_staging=True)
    expected = {}
    for step in range(1, 4):
        train_step(model, optimizer, step)
        expected[step] = snapshot(model, optimizer)
        checkpointer.save(step, model, optimizer, data_position=step)
        checkpointer.wait_staged()
    assert [info.step for info in checkpointer.wait()] == [1, 2, 3]
    checkpointer.close()
    loop = threading.get_ident()
    assert len(threads["state_dict"]) == 1 and loop not in threads["state_dict"]
    assert threads["sidecar"] == threads["state_dict"]  # the same writer thread, every save
    for step in range(1, 4):
        assert_same_state(saved_state(str(step_dir(tmp_path, step))), expected[step])


class _Plain:
    """An object the stager copies through `__reduce_ex__` (its class among the arguments)."""

    def __init__(self) -> None:
        self.n = 3


def test_a_stager_whose_copy_table_was_emptied_is_replaced(tmp_path):
    # Seen on an H200 with torch 2.11: its stager empties its copy table after every copy, so every
    # save after a Checkpointer's first failed with `KeyError: <class 'type'>`; the run's final
    # checkpoint failed and so did the run. Here 2.11's emptied table is made by clearing it.
    from training.engine.checkpoint import copy_table_intact

    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    stager = DefaultStager(checkpoint_module.staging_options())
    state = {"w": torch.ones(3), "extra": _Plain()}
    try:
        stager._state_dict_stager._deepcopy_dispatch.clear()  # what 2.11's close() leaves
        assert not copy_table_intact(stager)
        with pytest.raises(KeyError):
            copy = stager.stage(state)
            copy.result() if hasattr(copy, "result") else copy
    finally:
        stager.close()
    checkpointer = Checkpointer(tmp_path)
    try:
        for step in (1, 2, 3):
            checkpointer.save(step, model, optimizer)
            checkpointer.wait()
            checkpointer._stager._state_dict_stager._deepcopy_dispatch.clear()  # 2.11, after each copy
        assert [c.step for c in list_checkpoints(tmp_path)][-1] == 3
    finally:
        checkpointer.close()
