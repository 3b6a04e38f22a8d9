"""The trainer reports typed contract events only; its outcomes and stop reasons are enums; a stage's
runtime config holds the manifest's section instead of copying it."""

import asyncio
import dataclasses
import pathlib
import threading

import msgspec
import pytest

from contracts.evals import EvalMetric, ProvenanceStep
from contracts.manifest import CheckpointPolicy, Manifest, RlvrStage
from contracts.models import MODEL_SHAPES
from contracts.runs import (
    CheckpointSaved,
    DataProvenance,
    EvalResult,
    LogLevel,
    LogLine,
    Metrics,
    Outcome,
    RunEvent,
    StageStarted,
    StopReason,
)
from contracts.states import RunState
from domain.curriculum import PostPlan, curriculum_of
from services.trainer.emitter import Emitter
from services.trainer.endings import Stop, final_state
from tests.support import THREADS
from tests.training.replica_process import ReplicaConfig
from training.engine.checkpoint import Checkpointer
from training.engine.loop import LoopSettings
from training.engine.reporting import EventFile, Recorder, Reporter
from training.launch.elastic import EventTail
from training.recipes import pipeline
from training.recipes.pipeline import PipelineResult
from training.recipes.posttrain import PostConfig
from training.recipes.pretrain import StageConfig
from training.recipes.rlvr import RlvrConfig, RlvrResult

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples" / "manifests"
UNTYPED = {"kind": "metrics", "stage": "pretrain", "step": 1, "loss": 2.0}


# --- the reporting interface -------------------------------------------------------------------


def test_every_builder_hands_the_sink_its_contract_event():
    rec = Recorder(run_id="r1")
    rec.log("hello", LogLevel.warning)
    rec.metrics(
        stage="pretrain", step=1, total_steps=2, loss=2.5, learning_rate=1e-3, tokens_per_s=9.0, grad_norm=1.0
    )
    rec.checkpoint(step=1, path="/c", size=10, stall_s=0.1, save_s=0.2)
    rec.stage("pretrain", 2)
    rec.eval("pretrain", [EvalMetric(name="held_out_loss", value=1.0)], True)
    rec.provenance([ProvenanceStep(name="exact_dedup", before=3, after=2)], "a", "b")
    assert [type(e) for e in rec.events] == [
        LogLine,
        Metrics,
        CheckpointSaved,
        StageStarted,
        EvalResult,
        DataProvenance,
    ]
    assert {(e.run_id, e.seq, e.epoch) for e in rec.events} == {("r1", 0, 0)}  # seq: given at publish
    assert rec.of(LogLine)[0].level == "warning" and rec.of(CheckpointSaved)[0].bytes == 10


@pytest.mark.parametrize("payload", [UNTYPED, ("metrics", UNTYPED), "metrics"])
def test_the_reporter_refuses_anything_but_a_contract_event(payload):
    rec = Recorder()
    with pytest.raises(TypeError):
        rec.send(payload)
    assert rec.events == []


class FakeSettings:
    request_timeout_s = 1.0

    def subject(self, name: str) -> str:
        return name

    def stream(self, name: str) -> str:
        return name


@pytest.fixture
def running_loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()


class StreamBus:
    """The Bus the emitter publishes with: stream publishes are recorded."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, RunEvent]] = []

    async def publish_once(self, subject, stream, body, msg_id, timeout, headers=None) -> None:
        self.sent.append((msg_id, msgspec.json.decode(body, type=RunEvent)))


def test_the_emitter_publishes_typed_events_from_the_thread_and_refuses_dicts(running_loop):
    bus = StreamBus()
    sent = bus.sent
    emitter = Emitter(bus, FakeSettings(), "run-1", running_loop, epoch=3)  # type: ignore[arg-type]
    report = emitter.reporter()
    report.log("one")
    report.stage("pretrain", 5)
    with pytest.raises(TypeError):
        emitter.from_thread(UNTYPED)
    assert [(msg_id, type(e), e.seq, e.epoch) for msg_id, e in sent] == [
        ("run-1:3:1", LogLine, 1, 3),
        ("run-1:3:2", StageStarted, 2, 3),
    ]


def test_one_file_sink_written_from_two_threads_reads_back_whole(tmp_path):
    # issue 29: a node's log and a gang's rank-0 events file were two writers of one format (with
    # `EventTail` reading it, three shapes of one thing); `EventFile` is the one file sink now.
    path = tmp_path / "events.jsonl"
    with EventFile(path) as sink:
        reports = [Reporter(sink, run_id=f"run-{i}") for i in range(2)]
        threads = [
            threading.Thread(target=lambda r=r: [r.log(f"line {n}") for n in range(200)]) for r in reports
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    reports[0].log("after the close: dropped, not raised")
    read = EventTail(path).read()
    assert len(read) == 400 and all(isinstance(e, LogLine) for e in read)
    assert sorted(e.run_id for e in read) == ["run-0"] * 200 + ["run-1"] * 200
    with pytest.raises(TypeError):
        EventFile(tmp_path / "other.jsonl")(UNTYPED)  # type: ignore[arg-type]


# --- outcomes and stop reasons ------------------------------------------------------------------


def test_the_enums_keep_their_wire_strings():
    assert [o.value for o in Outcome] == ["succeeded", "gate_failed", "stopped"]
    assert [r.value for r in StopReason] == ["cancelled", "fenced", "loss_spike", "budget_exhausted"]
    assert [level.value for level in LogLevel] == ["info", "warning", "error"]


def test_a_pipeline_result_without_an_outcome_cannot_be_made():
    with pytest.raises(TypeError):
        PipelineResult(last_stage="pretrain", summary="s", final_loss=None, held_out_loss=None)


def result(outcome: Outcome) -> PipelineResult:
    return PipelineResult(last_stage="sft", summary="s", final_loss=1.0, held_out_loss=1.0, outcome=outcome)


@pytest.mark.parametrize(
    ("outcome", "stopped_by", "state"),
    [
        (Outcome.succeeded, None, RunState.succeeded),
        (Outcome.gate_failed, None, RunState.gate_failed),
        (Outcome.stopped, StopReason.cancelled, RunState.cancelled),
        (Outcome.succeeded, StopReason.cancelled, RunState.cancelled),  # stopped after the last step
    ],
)
def test_the_final_state_follows_the_outcome(tmp_path, outcome, stopped_by, state):
    stop = Stop()
    if stopped_by is not None:
        stop.set(stopped_by)
    assert final_state(result(outcome), stop, tmp_path)[0] is state


def test_a_stopped_outcome_without_a_stop_is_an_error(tmp_path):
    with pytest.raises(ValueError):
        final_state(result(Outcome.stopped), Stop(), tmp_path)


# --- configs ------------------------------------------------------------------------------------


def test_rlvr_config_holds_the_section_and_copies_none_of_it():
    copied = {f.name for f in dataclasses.fields(RlvrConfig)} & set(RlvrStage.__struct_fields__)
    assert copied <= {f.name for f in dataclasses.fields(PostConfig)}  # steps, learning_rate: PostConfig's
    cfg = RlvrConfig(
        stage="rlvr",
        shape=MODEL_SHAPES["tiny"],
        rope_base=None,
        problems=[("1+2=", "3")],
        steps=1,
        batch_size=64,
        learning_rate=1e-3,
        seed=0,
        checkpoint_dir="/unused",
    )
    assert cfg.rlvr == RlvrStage()  # its defaults are the manifest's


@pytest.mark.parametrize(
    "section", [{"group_size": 1}, {"max_response_tokens": 4, "overlong_buffer_tokens": 5}]
)
def test_rlvr_config_refuses_a_section_the_manifest_would_refuse(section):
    with pytest.raises(ValueError):
        RlvrConfig(
            stage="rlvr",
            shape=MODEL_SHAPES["tiny"],
            rope_base=None,
            problems=[("1+2=", "3")],
            steps=1,
            batch_size=8,
            learning_rate=1e-3,
            seed=0,
            checkpoint_dir="/unused",
            rlvr=RlvrStage(**section),
        )


def test_the_pipeline_hands_rlvr_the_manifests_section(tmp_path):
    raw = msgspec.json.decode((EXAMPLES / "full.json").read_bytes())
    raw["post_training"]["rlvr"].update(group_size=6, eps_high=0.31, temperature=0.7, max_sampling_rounds=2)
    manifest = msgspec.convert(raw, Manifest)
    seen: list[RlvrConfig] = []

    def train_post(cfg, report, should_stop):  # the pipeline's injected post-stage trainer
        seen.append(cfg)
        return RlvrResult(
            final_step=0, first_loss=None, final_loss=None, stopped=True, stats=[], stale_dropped=0
        )

    plan = curriculum_of(manifest)
    run = pipeline._Run(
        manifest, plan, tmp_path, Recorder(), lambda: False, threads=THREADS, train_post=train_post
    )
    [stage] = [s for s in plan.stages if isinstance(s, PostPlan) and s.name == "rlvr"]
    assert run.post_stage(stage, tmp_path / "rlvr") == ([], True)
    [cfg] = seen
    assert cfg.rlvr == manifest.post_training.rlvr and cfg.rlvr.group_size == 6
    assert cfg.batch_size == manifest.post_training.rlvr.prompts_per_step * 6


def test_the_checkpoint_defaults_are_the_manifests_policy(tmp_path):
    policy = CheckpointPolicy()
    configs = [
        LoopSettings(stage="s", steps=1, checkpoint_dir="/c"),
        StageConfig(
            stage="s",
            shape=MODEL_SHAPES["tiny"],
            train_sources=["builtin:pydoc_topics"],
            seq_len=8,
            batch_size=1,
            learning_rate=1e-3,
            steps=1,
            checkpoint_dir="/c",
        ),
        PostConfig(
            stage="sft",
            shape=MODEL_SHAPES["tiny"],
            rope_base=None,
            problems=[("1+2=", "3")],
            steps=1,
            batch_size=1,
            learning_rate=1e-3,
            seed=0,
            checkpoint_dir="/c",
        ),
    ]
    assert {(c.checkpoint_interval, c.keep_last) for c in configs} == {
        (policy.interval_steps, policy.keep_last)
    }
    assert (
        ReplicaConfig(replica_id=0, lighthouse="", steps=1, checkpoint_dir="").keep_last == policy.keep_last
    )
    assert Checkpointer(tmp_path).keep_last == policy.keep_last
