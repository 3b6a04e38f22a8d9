"""Rank 0's answer, the way back from a gang (training/launch/rank.py): a tagged union read with one
decoder. Each kind round-trips; anything else (no tag, an unknown tag, a field missing or of the
wrong type, another kind of job's answer) is refused in a sentence; the gang turns a stage's answer
into the recipe's result, and a wrong answer into GangFailed, never a KeyError."""

import dataclasses
import pathlib

import msgspec
import pytest

from contracts.manifest import RlvrStage
from contracts.models import MODEL_SHAPES
from training.engine.distributed import ParallelDims
from training.engine.reporting import Reporter
from training.launch import rank
from training.launch.elastic import Gang, GangFailed
from training.launch.rank import (
    ANSWER_CAP_BYTES,
    AnswerError,
    PostAnswer,
    Refusal,
    RlvrAnswer,
    StageAnswer,
    read_answer,
)
from training.recipes.posttrain import PostConfig, PostResult
from training.recipes.pretrain import StageConfig, StageResult
from training.recipes.rlvr import RlvrConfig, RlvrResult, StepStats

COMMON = {
    "final_step": 4,
    "first_loss": 5.5,
    "final_loss": 3.25,
    "stopped": False,
    "world_size": 2,
    "strategy": "ddp",
    "degrees": {"dp_replicate": 2},
}
STATS = [StepStats(step=1, accuracy=0.5, reward=0.25, groups_kept=2), StepStats(step=2, kl=0.01)]
STAGE = StageAnswer(stage="pretrain", held_out_loss=3.5, **COMMON)
POST = PostAnswer(stage="sft", **COMMON | {"first_loss": None})
RLVR = RlvrAnswer(stage="rlvr", stats=STATS, stale_dropped=1, rollout_workers=1, **COMMON)
REFUSAL = Refusal(reason="tp 3 does not divide n_head 4")


@pytest.mark.parametrize(
    ("answer", "kind"),
    [
        (STAGE, StageAnswer),
        (POST, PostAnswer),
        (RLVR, RlvrAnswer),
        (REFUSAL, StageAnswer),
        (REFUSAL, RlvrAnswer),
    ],
)
def test_each_answer_round_trips(answer, kind):
    assert read_answer(msgspec.json.encode(answer), kind) == answer


GONE = object()


def _raw(answer: msgspec.Struct, **change: object) -> bytes:
    """`answer`'s JSON with fields changed (GONE: removed)."""
    fields = msgspec.to_builtins(answer) | change
    return msgspec.json.encode({k: v for k, v in fields.items() if v is not GONE})


@pytest.mark.parametrize(
    ("data", "kind", "said"),
    [
        (_raw(STAGE, type="gang"), StageAnswer, "Invalid value 'gang' - at `$.type`"),
        (_raw(STAGE, type=GONE), StageAnswer, "missing required field `type`"),
        (_raw(STAGE, final_step=GONE), StageAnswer, "missing required field `final_step`"),
        (_raw(STAGE, held_out_loss=GONE), StageAnswer, "missing required field `held_out_loss`"),
        (_raw(RLVR, stats=GONE), RlvrAnswer, "missing required field `stats`"),
        (_raw(STAGE, final_step="4"), StageAnswer, "Expected `int`, got `str` - at `$.final_step`"),
        (_raw(REFUSAL, reason=GONE), StageAnswer, "missing required field `reason`"),
        (b'{"final_step": 4}', StageAnswer, "missing required field `type`"),  # the old untyped summary
        (b"{", StageAnswer, "cannot be read"),
        (msgspec.json.encode(POST), StageAnswer, "answered a 'post' job; its job was a 'stage' one"),
        (msgspec.json.encode(STAGE), RlvrAnswer, "answered a 'stage' job; its job was a 'rlvr' one"),
        (msgspec.json.encode(RLVR), PostAnswer, "answered a 'rlvr' job; its job was a 'post' one"),
        (b" " * (ANSWER_CAP_BYTES + 1), StageAnswer, "over"),
    ],
)
def test_anything_else_is_refused_in_a_sentence(data, kind, said):
    with pytest.raises(AnswerError, match="Rank 0") as refused:
        read_answer(data, kind)
    assert said in str(refused.value)


@pytest.mark.parametrize(
    ("result", "want"),
    [
        (
            StageResult(
                final_step=4, first_loss=5.5, final_loss=3.25, held_out_loss=3.5, stopped=False, tokens=64
            ),
            STAGE,
        ),
        (PostResult(final_step=4, first_loss=None, final_loss=3.25, stopped=False), POST),
        (
            RlvrResult(
                final_step=4, first_loss=5.5, final_loss=3.25, stopped=False, stats=STATS, stale_dropped=1
            ),
            RLVR,
        ),
    ],
)
def test_rank0_answers_its_kind_of_result(result, want):
    dims = ParallelDims(strategy="ddp", dp_replicate=2)
    answer = rank._answer(want.stage, dims, result)
    # the world size is the process group's: one process here
    assert answer == msgspec.structs.replace(want, world_size=1)


def _post_config(tmp_path: pathlib.Path) -> PostConfig:
    return PostConfig(
        stage="sft",
        shape=MODEL_SHAPES["tiny"],
        rope_base=None,
        problems=[("1+2=", "3")],
        steps=4,
        batch_size=2,
        learning_rate=2e-4,
        seed=7,
        checkpoint_dir=str(tmp_path / "ckpt"),
    )


def _rlvr_config(tmp_path: pathlib.Path) -> RlvrConfig:
    fields = {f.name: getattr(_post_config(tmp_path), f.name) for f in dataclasses.fields(PostConfig)}
    fields |= {"stage": "rlvr", "batch_size": 8}
    return RlvrConfig(**fields, rlvr=RlvrStage(steps=4, prompts_per_step=2, group_size=4))


def _stage_config(tmp_path: pathlib.Path) -> StageConfig:
    return StageConfig(
        stage="pretrain",
        shape=MODEL_SHAPES["tiny"],
        train_sources=["generated:arithmetic"],
        seq_len=32,
        batch_size=8,
        learning_rate=3e-4,
        steps=4,
        checkpoint_dir=str(tmp_path / "ckpt"),
    )


MODEL = object()  # the weights the agent would load from the gang's checkpoint


@pytest.fixture
def gang(tmp_path, monkeypatch):
    """A gang whose launch writes `answers[0]` as rank 0's result and exits 0 (no torchrun)."""
    answers: list[bytes] = []

    def launch(self, spec, job_path, tail, report, should_stop):
        (job_path.parent / "result.json").write_bytes(answers[0])
        return 0, False

    monkeypatch.setattr(Gang, "_launch", launch)
    monkeypatch.setattr(Gang, "_trained_model", staticmethod(lambda *args, **kwargs: MODEL))
    made = Gang(ParallelDims(strategy="ddp", dp_replicate=2), tmp_path / "run", threads=2)
    return made, answers


def _report() -> Reporter:
    return Reporter(lambda event: None, run_id="r")


def test_the_gang_reads_each_kind_of_answer_into_the_recipes_result(gang, tmp_path):
    g, answers = gang
    answers[:] = [msgspec.json.encode(RLVR)]
    got = g.train_post(_rlvr_config(tmp_path), _report(), lambda: False)
    assert isinstance(got, RlvrResult) and got.model is MODEL
    assert (got.final_step, got.first_loss, got.final_loss, got.stopped) == (4, 5.5, 3.25, False)
    assert (got.stats, got.stale_dropped, got.rollout_workers) == (STATS, 1, 1)
    answers[:] = [msgspec.json.encode(POST)]
    got = g.train_post(_post_config(tmp_path), _report(), lambda: False)
    assert got == PostResult(final_step=4, first_loss=None, final_loss=3.25, stopped=False)
    answers[:] = [msgspec.json.encode(STAGE)]
    got = g.train_stage(_stage_config(tmp_path), _report(), lambda: False)
    assert got == StageResult(
        final_step=4, first_loss=5.5, final_loss=3.25, held_out_loss=3.5, stopped=False, tokens=4 * 8 * 32
    )


@pytest.mark.parametrize(
    ("answer", "train", "said"),
    [
        (msgspec.json.encode(STAGE), "rlvr", "answered a 'stage' job; its job was a 'rlvr' one"),
        (msgspec.json.encode(RLVR), "sft", "answered a 'rlvr' job; its job was a 'post' one"),
        (msgspec.json.encode(POST), "pretrain", "answered a 'post' job; its job was a 'stage' one"),
        (_raw(POST, stopped=GONE), "sft", "missing required field `stopped`"),
        (b'{"final_step": 4}', "pretrain", "missing required field `type`"),
    ],
)
def test_the_gang_fails_the_stage_on_a_wrong_answer(gang, tmp_path, answer, train, said):
    g, answers = gang
    answers[:] = [answer]
    with pytest.raises(GangFailed, match="answered wrongly") as failed:
        if train == "pretrain":
            g.train_stage(_stage_config(tmp_path), _report(), lambda: False)
        else:
            cfg = _rlvr_config(tmp_path) if train == "rlvr" else _post_config(tmp_path)
            g.train_post(cfg, _report(), lambda: False)
    assert said in str(failed.value)
