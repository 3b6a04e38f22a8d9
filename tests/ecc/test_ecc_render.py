"""What `ecc` shows for each answer (ecc/render.py): every API verb's answer type has a renderer,
picked by the type and never by keys; the lines a person reads and the JSON a tool reads stay what
the server's answer says (a typed re-encode is the server's own bytes)."""

import argparse
import asyncio
import json
import sys
import typing
from datetime import UTC, datetime

import msgspec
import pytest

from contracts.api import (
    Action,
    AuthInfo,
    BookingView,
    CleanupResult,
    ConfirmationIssued,
    LogLineView,
    LogPage,
    LogsRequest,
    ModelList,
    ModelView,
    MutationResult,
    Parallelism,
    RemovedArtifact,
    RestartProposal,
    RunAccepted,
    RunList,
    RunSummary,
    RunView,
    StatusRequest,
)
from contracts.audit import AuditTrail, GateDecision
from contracts.booking import Booking, BookingState, Fabric, Topology
from contracts.endpoints import API, Endpoint
from contracts.envelope import Envelope
from contracts.errors import ErrorCode
from contracts.evals import EvalMetric, Provenance, ProvenanceStep, StageGate
from contracts.exports import DownloadChunk, ExportFile, ExportFormat, ExportView, SampleResult
from contracts.files import (
    ConnectionList,
    ConnectionView,
    FileDeleted,
    FileList,
    FilePurpose,
    FileView,
    UploadedFile,
    UploadKind,
    UploadPartAck,
    UploadSession,
    UploadView,
)
from contracts.manifest import DataFormat
from contracts.plans import CostEstimate, Plan, PlanCheck, StageGatePlan
from contracts.runs import CheckpointList, CheckpointSaved, EvalList, Metrics, MetricsPage
from contracts.states import RunState
from ecc import plan_view, render, transport, units
from ecc.gates import gate_line

AT = datetime(2026, 12, 2, 7, 30, 1, 250000, tzinfo=UTC)
COST = CostEstimate(
    flops=1.5e15,
    tokens=4096,
    parameters=1_000_000,
    assumed_mfu=0.4,
    peak_tflops_per_gpu=989.0,
    gpus=2,
    gpu_hours=0.0123,
    price_per_gpu_hour_usd=2.5,
    compute_usd=0.03075,
    checkpoint_storage_usd=0.0,
    total_usd=0.03075,
    booked_gpu_hours=8.0,
    incremental_usd=0.0,
)
PLAN = Plan(
    booking_id="bk-1",
    manifest_digest="d" * 64,
    strategy="ddp",
    degrees={"dp": 2},
    precision="bf16",
    cost=COST,
    checks=[
        PlanCheck(name="memory", ok=True, reason="fits in 141 GB"),
        PlanCheck(name="budget", ok=False, code="budget_exceeded", reason="over 1 USD"),
    ],
    ok=False,
    gates=[StageGatePlan(stage="pretrain", rules=["held_out_loss <= 4.0", "finite loss"])],
)
GATE = StageGate(
    stage="pretrain",
    passed=False,
    metrics=[
        EvalMetric(name="held_out_loss", value=3.25, threshold=3.0, op="<=", passed=False),
        EvalMetric(name="perplexity", value=25.8),
    ],
)
VIEW = RunView(
    run_id="run-1",
    account="acme",
    booking_id="bk-1",
    manifest_digest="d" * 64,
    idempotency_key="key-1",
    state=RunState.awaiting_approval,
    stage="pretrain",
    step=40,
    total_steps=100,
    loss=2.5,
    created_at=AT,
    updated_at=AT,
    plan=PLAN,
    message="loss spike at step 38",
    gates=[GATE],
    provenance=Provenance(
        steps=[ProvenanceStep(name="exact_dedup", before=100, after=90)], input_digest="i", output_digest="o"
    ),
    proposal=RestartProposal(
        stage="pretrain", checkpoint_step=30, skip_from=31, skip_to=39, spike_step=38, reason="loss spike"
    ),
    parallelism=Parallelism(strategy="ddp", world_size=4, mesh={"dp_replicate": 2, "dp_shard": 2}, nodes=2),
    nodes=2,
)
BOOKING = Booking(
    booking_id="bk-1",
    account="acme",
    state=BookingState.completed,
    version=3,
    topology=Topology(nodes=1, gpus_per_node=8, gpu_model="H200", gpu_memory_gb=141),
    region="eu-west",
    fabric=Fabric.infiniband,
    window_start=AT,
    window_end=AT,
    updated_at=AT,
)

# One example of every API verb's answer, and every line a person reads for it.
FILE = FileView(
    file_id="file-" + "0a" * 12,
    name="chat.jsonl",
    purpose=FilePurpose.train,
    format=DataFormat.jsonl,
    bytes=1234,
    sha256="sha256:" + "cd" * 32,
    rows=40,
    kinds=["messages"],
    created_at=datetime(2026, 12, 2, tzinfo=UTC),
    source="upload:file-" + "0a" * 12,
)

EXAMPLES: dict[str, tuple[typing.Any, list[str]]] = {
    "auth": (AuthInfo(account="acme", key_id="UAKEY"), ["logged in as acme (key UAKEY)"]),
    "find": (
        [
            BookingView(booking=BOOKING, allows_training=True),
            BookingView(booking=BOOKING, allows_training=False, reason="expired"),
        ],
        [
            "bk-1: completed, 1x8 H200, infiniband, eu-west, until 2026-12-02T07:30:01.250000Z (allows training)",
            "bk-1: completed, 1x8 H200, infiniband, eu-west, until 2026-12-02T07:30:01.250000Z (no training: expired)",
        ],
    ),
    "plan": (
        PLAN,
        [
            "strategy ddp, dp 2 (2 ranks), precision bf16",
            "estimate 0.03 USD (44 GPU-s at 2.50 USD per GPU-hour)",
            "  [ok] memory: fits in 141 GB",
            "  [FAIL] budget: over 1 USD",
            "  gate pretrain: held_out_loss <= 4.0; finite loss",
        ],
    ),
    "confirm": (
        ConfirmationIssued(
            confirmation_ref="cf-1",
            action=Action.train,
            target="bk-1",
            manifest_digest=None,
            max_cost_usd=1.0,
            expires_at=AT,
        ),
        [
            "confirmation_ref: cf-1",
            "  authorises: train on booking bk-1, once",
            "  cost bound: at most 1.00 USD",
            "  expires: 2026-12-02T07:30:01.250000Z",
        ],
    ),
    "runs": (
        RunList(
            runs=[
                RunSummary(
                    run_id="run-2",
                    state=RunState.running,
                    booking_id="bk-1",
                    manifest_digest="d" * 64,
                    idempotency_key="key-2",
                    created_at=AT,
                    updated_at=AT,
                    stage="sft",
                    step=40,
                    total_steps=100,
                    loss=2.5,
                    estimate_usd=0.00018,
                ),
                RunSummary(
                    run_id="run-1",
                    state=RunState.queued,
                    booking_id="bk-10",
                    manifest_digest="d" * 64,
                    idempotency_key="key-1",
                    created_at=AT,
                    updated_at=AT,
                ),
            ],
            next="1796196601.25:run-1",
        ),
        [
            "RUN    STATE    BOOKING  STAGE  STEP    LOSS    EST USD  CREATED (UTC)        KEY",
            "run-2  running  bk-1     sft    40/100  2.5000  0.00018  2026-12-02 07:30:01  key-2",
            "run-1  queued   bk-10    -      -       -       -        2026-12-02 07:30:01  key-1",
            "more: the same command with --cursor 1796196601.25:run-1",
        ],
    ),
    "train": (RunAccepted(run_id="run-1", state=RunState.queued, booking_id="bk-1"), ["run run-1: queued"]),
    "status": (
        VIEW,
        [
            "run run-1: awaiting_approval (stage pretrain, step 40/100, loss 2.5000)",
            "  loss spike at step 38",
            "  gate pretrain: FAILED: held_out_loss 3.2500 (gate <= 3.0000), perplexity 25.8000 (reported, not gated)",
            "  data: exact_dedup 100->90",
            "  proposal (loss spike): restart pretrain from checkpoint step 30, skipping batches [31, 39); "
            "approve with `ecc ito confirm --action restart_from_checkpoint --run run-1` then `ecc ito approve`",
            "  parallelism: ddp, world size 4, mesh dp_replicate 2 x dp_shard 2, 2 nodes",
            "  plan: ddp, estimate 0.03 USD",
        ],
    ),
    "logs": (
        LogPage(
            run_id="run-1",
            lines=[LogLineView(index=0, at=AT, level="info", message="starting a gang of 4 ranks")],
            next=1,
        ),
        ["2026-12-02T07:30:01.250000Z info: starting a gang of 4 ranks"],
    ),
    "audit": (
        AuditTrail(
            run_id="run-1",
            decisions=[
                GateDecision(
                    request_id="run-1", at=AT, account="acme", action=Action.train, gate="booking", ok=True
                ),
                GateDecision(
                    request_id="run-1",
                    at=AT,
                    account="acme",
                    action=Action.train,
                    gate="budget",
                    ok=False,
                    code="budget_exceeded",
                ),
            ],
        ),
        [
            "2026-12-02T07:30:01.250000Z booking: pass",
            "2026-12-02T07:30:01.250000Z budget: FAIL budget_exceeded",
        ],
    ),
    "metrics": (
        MetricsPage(
            run_id="run-1",
            points=[
                Metrics(
                    run_id="run-1",
                    seq=7,
                    at=AT,
                    stage="pretrain",
                    step=5,
                    total_steps=100,
                    loss=3.14159,
                    learning_rate=0.003,
                    tokens_per_s=12345.6,
                    grad_norm=1.0,
                )
            ],
            next=1,
        ),
        ["pretrain step 5/100 loss 3.1416 lr 3.00e-03 12346 tok/s"],
    ),
    "checkpoints": (
        CheckpointList(
            run_id="run-1",
            checkpoints=[
                CheckpointSaved(
                    run_id="run-1",
                    seq=9,
                    at=AT,
                    step=10,
                    path="/ckpt/step-10",
                    bytes=2_500_000,
                    stall_s=0.0123,
                    save_s=1.5,
                )
            ],
        ),
        ["step 10: 2.5 MB, loop stalled 12.3 ms, saved in 1.50 s  /ckpt/step-10"],
    ),
    "evals": (
        EvalList(run_id="run-1", gates=[GATE]),
        [
            "pretrain: FAILED",
            "  held_out_loss = 3.2500 (gate <= 3.0000) FAIL",
            "  perplexity = 25.8000 (reported, not gated) ok",
        ],
    ),
    "cancel": (
        MutationResult(run_id="run-1", action=Action.cancel, state=RunState.cancelling),
        ["run run-1: cancelling"],
    ),
    "cleanup": (
        CleanupResult(
            run_id="run-1",
            removed=[RemovedArtifact(path="/ckpt/step-10", bytes=2500)],
            booking_release_requested=True,
        ),
        ["removed /ckpt/step-10 (2500 bytes)", "1 artifacts removed; booking release requested: True"],
    ),
    "approve": (
        MutationResult(run_id="run-1", action=Action.restart_from_checkpoint, state=RunState.queued),
        ["run run-1: queued"],
    ),
    "export": (
        ExportView(
            run_id="run-1",
            stage="sft",
            format=ExportFormat.hf,
            state="ready",
            export_id="sft-hf",
            digest="sha256:" + "ab" * 32,
            files=[ExportFile(path="config.json", bytes=512, sha256="cd" * 32)],
            bytes=512,
            step=40,
        ),
        [
            "export sft-hf: ready (stage sft, step 40)",
            f"  digest sha256:{'ab' * 32}, 1 files, 512 bytes",
            "  config.json (512 bytes)",
            "  fetch it with `ecc ito download run-1 --export sft-hf --to DIR`",
        ],
    ),
    "download": (
        DownloadChunk(
            run_id="run-1",
            export_id="sft-hf",
            path="config.json",
            offset=0,
            data=b"{}",
            size=2,
            sha256="ef" * 32,
        ),
        [f"config.json: 2 bytes at 0 of 2 (sha256 {'ef' * 32})"],
    ),
    "sample": (SampleResult(run_id="run-1", stage="sft", step=40, text="12+35=47", tokens=5), ["12+35=47"]),
    "models": (
        ModelList(
            models=[
                ModelView(
                    name="tiny-llama",
                    digest="sha256:" + "ab" * 32,
                    family="llama",
                    architecture="LlamaForCausalLM",
                    parameters=45_600,
                    vocab_size=320,
                    max_seq_len=128,
                    tokenizer=True,
                    chat_template=True,
                    bytes=190_000,
                )
            ]
        ),
        [
            "tiny-llama: sha256:"
            + "ab" * 32
            + " (LlamaForCausalLM, 45,600 parameters, vocab 320, context 128, chat template)"
        ],
    ),
    "upload": (
        UploadSession(
            upload_id="up-1",
            kind=UploadKind.data,
            name="chat.jsonl",
            state="uploading",
            files=[UploadedFile(path="chat.jsonl", bytes=3 * 2**20, sha256=FILE.sha256, received=2**20)],
        ),
        ["upload up-1: uploading (data chat.jsonl)", "  chat.jsonl: 1.0 MiB of 3.0 MiB"],
    ),
    "upload_part": (
        UploadPartAck(upload_id="up-1", path="chat.jsonl", received=2048),
        ["chat.jsonl: 2,048 bytes received"],
    ),
    "upload_commit": (
        UploadView(
            upload_id="up-1",
            kind=UploadKind.data,
            state="rejected",
            message="chat.jsonl was not kept: 2 problems",
            problems=["line 14: messages[0].role is 'wizard'; use one of system, user, assistant, tool"],
            more_problems=1,
        ),
        [
            "upload up-1: rejected: chat.jsonl was not kept: 2 problems",
            "  - line 14: messages[0].role is 'wizard'; use one of system, user, assistant, tool",
            "  - ... and 1 more",
        ],
    ),
    "files": (
        FileList(files=[FILE]),
        [f"{FILE.file_id}  chat.jsonl  jsonl  1.2 KiB  40 rows  messages"],
    ),
    "file": (
        FILE,
        [
            f"file {FILE.file_id}: chat.jsonl (jsonl, 1.2 KiB, 40 rows: messages)",
            f"  sha256: {FILE.sha256}",
            "  purpose: train; kept 2026-12-02T00:00:00+00:00",
            f'  in a manifest: {{"name": "chat", "source": "upload:{FILE.file_id}", "digest": "{FILE.sha256}"}}',
        ],
    ),
    "file_delete": (
        FileDeleted(file_id=FILE.file_id, bytes=1234, idempotency_key="k"),
        [f"file {FILE.file_id}: deleted (1.2 KiB freed)"],
    ),
    "connections": (
        ConnectionList(connections=[ConnectionView(name="corpus", kind="s3", endpoint="http://minio:9000")]),
        ["corpus  s3  http://minio:9000"],
    ),
}


def test_every_api_verb_has_an_example_of_its_answer_type():
    assert set(EXAMPLES) == set(API)
    for verb, (answer, _) in EXAMPLES.items():
        builtins = msgspec.to_builtins(answer)
        assert msgspec.convert(builtins, API[verb].answer) == answer, verb


def test_every_api_answer_type_has_a_renderer():
    """A new verb's answer type must join `render.Answer`, and `text` must have its `case`
    (mypy's exhaustiveness check on `assert_never` holds the second half)."""
    shown = set(typing.get_args(render.Answer))
    assert {API[verb].answer for verb in API} <= shown
    assert {render.LoggedOut, render.LogsFollowed, render.Downloaded} <= shown


@pytest.mark.parametrize("verb", sorted(EXAMPLES))
def test_each_answer_renders_its_lines(verb):
    answer, lines = EXAMPLES[verb]
    assert render.text(answer).splitlines() == lines


def test_a_sample_cut_by_the_deadline_says_so():
    cut = SampleResult(run_id="run-1", stage="sft", step=40, text="12+35", tokens=3, truncated=True)
    assert render.text(cut).splitlines() == [
        "12+35",
        "(truncated: the trainer's deadline stopped the sample after 3 tokens; ask for fewer with "
        "--max-new-tokens)",
    ]


def test_empty_answers_say_so():
    assert render.text([]) == "(no bookings)"
    assert render.text(LogPage(run_id="r", lines=[], next=0)) == "(no lines)"
    assert render.text(AuditTrail(run_id="r", decisions=[])) == "(no decisions)"
    assert render.text(MetricsPage(run_id="r", points=[], next=0)) == "(none)"
    assert render.text(CheckpointList(run_id="r", checkpoints=[])) == "(none yet)"
    assert render.text(CheckpointList(run_id="r", checkpoints=[], cleaned_up=True)) == "(removed by cleanup)"
    assert render.text(EvalList(run_id="r", gates=[])) == "(no stage has been evaluated yet)"
    assert render.text(RunList(runs=[])) == "(no runs)"
    bare = msgspec.structs.replace(VIEW, state=RunState.queued, stage=None, message=None, gates=[])
    bare = msgspec.structs.replace(bare, provenance=None, proposal=None, parallelism=None, plan=None)
    assert render.text(bare) == "run run-1: queued"


def test_ecc_s_own_answers_show_their_json():
    assert render.text(render.LoggedOut(logged_out=False)) == '{"logged_out":false}'
    assert render.text(render.LogsFollowed(run_id="r", next=5)) == '{"run_id":"r","next":5}'


def test_renderers_take_types_not_keys():
    assert not hasattr(render, "_human") and not hasattr(render, "RENDERERS")
    run_shaped = msgspec.to_builtins(VIEW)
    with pytest.raises(AssertionError):
        render.text(run_shaped)  # a dict is no answer: nothing guesses what its keys mean


def _wire(answer: typing.Any, notice: str | None = None) -> bytes:
    """The scheduler's bytes for an answer (runtime/codec.ok)."""
    return msgspec.json.encode(Envelope(ok=True, live_api_contacted=True, notice=notice, data=answer))


@pytest.mark.parametrize("verb", sorted(EXAMPLES))
def test_json_output_is_the_servers_answer(verb):
    wire = _wire(EXAMPLES[verb][0])
    typed = transport.answer_decoder(API[verb]).decode(wire)
    assert isinstance(typed.data, type(EXAMPLES[verb][0]))
    assert msgspec.json.encode(typed) == wire
    assert msgspec.json.encode(typed) == msgspec.json.encode(msgspec.json.decode(wire, type=Envelope))


def test_an_answer_of_another_type_is_not_read():
    with pytest.raises(msgspec.ValidationError):
        transport.answer_decoder(API["checkpoints"]).decode(_wire(VIEW))
    assert transport.answer_decoder(API["status"]) is transport.answer_decoder(API["status"])


class _Scripted:
    """`Client` with the network cut out: `call` sends nothing and answers `reply`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, reply: bytes) -> None:
        async def connected(self, account, seed):
            return object()

        async def request(self, nc, suffix, account, payload, timeout):
            return reply

        monkeypatch.setattr(transport, "seed_of", lambda key: b"seed")
        monkeypatch.setattr(transport.Client, "_connected", connected)
        monkeypatch.setattr(transport.Client, "_request", request)

    def call(self, endpoint: Endpoint, request: typing.Any) -> Envelope:
        async def go() -> Envelope:
            async with transport.Client(credential=("acme", "ito_sk_x")) as client:
                return await client.call(endpoint, request)

        return asyncio.run(go())


@pytest.mark.parametrize(
    "reply",
    [
        _wire(VIEW),  # a run view where a checkpoint list belongs
        b'{"ok":true,"live_api_contacted":true,"notice":null,"error":{"code":"internal","message":"x"}}',
        b"not json",
    ],
)
def test_an_unreadable_answer_is_a_local_internal_error(monkeypatch, reply):
    from contracts.api import RunItemsRequest

    env = _Scripted(monkeypatch, reply).call(API["checkpoints"], RunItemsRequest(run_id="run-1"))
    assert not env.ok and env.live_api_contacted
    assert env.error is not None and env.error.code == ErrorCode.internal
    assert env.error.message == "the server's answer could not be read"


def test_a_call_answers_its_endpoint_s_type(monkeypatch):
    env = _Scripted(monkeypatch, _wire(VIEW)).call(API["status"], StatusRequest(run_id="run-1"))
    assert env.ok and env.data == VIEW


def _follow_args(as_json: bool) -> argparse.Namespace:
    return argparse.Namespace(json=as_json, connect_timeout=1.0, timeout=1.0)


def _scripted_calls(monkeypatch, answers: dict[str, list[typing.Any]]) -> None:
    """`render._call` answering each endpoint from its own list, in order (the last one repeats)."""
    by_subject = {API[verb].subject: list(items) for verb, items in answers.items()}

    async def call(args, endpoint, request):
        items = by_subject[endpoint.subject]
        data = items.pop(0) if len(items) > 1 else items[0]
        return Envelope(ok=True, live_api_contacted=True, notice=None, data=data)

    monkeypatch.setattr(render, "_call", call)
    monkeypatch.setattr(render, "POLL_EVERY_S", 0.0)


LINE = LogLineView(index=0, at=AT, level="info", message="step 40")


def test_follow_json_prints_one_log_and_status_event_per_line(monkeypatch, capsys):
    done = msgspec.structs.replace(VIEW, state=RunState.succeeded)
    _scripted_calls(
        monkeypatch,
        {"status": [done], "logs": [LogPage(run_id="run-1", lines=[LINE], next=1)]},
    )
    env = asyncio.run(render.follow(_follow_args(True), StatusRequest(run_id="run-1")))
    assert env.ok and env.data == done
    log, status = (json.loads(ln) for ln in capsys.readouterr().out.splitlines())
    assert log == {"event": "log", **msgspec.to_builtins(LINE)}
    assert list(log) == ["event", "index", "at", "level", "message"]
    assert status == {"event": "status", "run": msgspec.to_builtins(done)}


def test_follow_prints_progress_lines(monkeypatch, capsys):
    running = msgspec.structs.replace(VIEW, state=RunState.running)
    done = msgspec.structs.replace(VIEW, state=RunState.succeeded, step=100)
    _scripted_calls(
        monkeypatch,
        {"status": [running, done], "logs": [LogPage(run_id="run-1", lines=[LINE], next=1)]},
    )
    asyncio.run(render.follow(_follow_args(False), StatusRequest(run_id="run-1")))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "  log: step 40"
    assert out[1] == "[running] pretrain step 40/100 loss 2.5000"
    assert out[-1] == "[succeeded] pretrain step 100/100 loss 2.5000 ETA 0s"


def test_follow_logs_ends_with_where_the_lines_stopped(monkeypatch, capsys):
    done = msgspec.structs.replace(VIEW, state=RunState.succeeded)
    _scripted_calls(
        monkeypatch,
        {
            "status": [done],
            "logs": [
                LogPage(run_id="run-1", lines=[LINE], next=1),
                LogPage(run_id="run-1", lines=[], next=1),
            ],
        },
    )
    env = asyncio.run(render.follow_logs(_follow_args(False), LogsRequest(run_id="run-1")))
    assert capsys.readouterr().out.splitlines() == ["2026-12-02T07:30:01.250000Z info: step 40"]
    assert msgspec.json.encode(env.data) == b'{"run_id":"run-1","next":1}'
    assert msgspec.json.encode(env) == (
        b'{"ok":true,"live_api_contacted":true,"notice":null,"data":{"run_id":"run-1","next":1}}'
    )


def test_a_lost_train_answer_is_found_by_its_key_with_the_same_fields(monkeypatch):
    """`_call_train`'s fallback answers a RunAccepted: the JSON a replay would carry."""
    from contracts.api import TrainRequest
    from ecc import verbs

    async def call(self, endpoint, request):
        if endpoint is API["train"]:
            raise transport.SentButUnanswered()
        assert endpoint is API["status"] and request.idempotency_key == "key-1"
        return Envelope(ok=True, live_api_contacted=True, notice=None, data=VIEW)

    monkeypatch.setattr(transport.Client, "call", call)
    req = TrainRequest(booking_id="bk-1", manifest_text="m", manifest_digest="d", idempotency_key="key-1")
    env = asyncio.run(verbs.answer("train", req, verbs.Bounds(1.0, 1.0)))
    assert (
        env.ok and env.notice == "the answer was lost in transit; this run was found by its idempotency key"
    )
    assert msgspec.json.decode(msgspec.json.encode(env.data)) == {
        "run_id": "run-1",
        "state": "awaiting_approval",
        "replay": True,
        "booking_id": "bk-1",
        "manifest_digest": "d" * 64,
        "idempotency_key": "key-1",
    }
    assert render.text(env.data) == "run run-1: awaiting_approval"


@pytest.mark.parametrize(
    "degrees, words",
    [
        ({}, "one process"),
        ({"dp_replicate": 1}, "one process"),
        ({"dp_replicate": 2}, "dp_replicate 2 (2 ranks)"),
        ({"dp_replicate": 2, "dp_shard": 2, "tp": 1}, "dp_replicate 2 x dp_shard 2 (4 ranks)"),
    ],
)
def test_a_plans_degrees_read_as_words_not_a_python_dict(degrees, words):
    assert plan_view._degrees(degrees) == words


def _point(stage: str, step: int, total: int, loss: float, tok: float) -> Metrics:
    return Metrics(
        run_id="run-1",
        seq=step,
        at=AT,
        stage=stage,
        step=step,
        total_steps=total,
        loss=loss,
        learning_rate=0.003,
        tokens_per_s=tok,
        grad_norm=1.0,
    )


def test_metrics_on_a_terminal_are_a_sparkline_per_stage_not_numbers():
    """The defect: `ecc ito metrics` printed only numbers, one line per point, to a person too.
    A pipe still gets those lines (scripts parse them); a terminal gets each stage's curve."""
    points = [_point("pretrain", s, 8, 4.0 - s * 0.25, 9000.0 + s) for s in range(1, 9)]
    points += [_point("sft", s, 3, 1.5 - s * 0.25, 800.0) for s in range(1, 4)]
    page = MetricsPage(run_id="run-1", points=points, next=len(points))
    assert render.text(page, terminal=True).splitlines() == [
        "pretrain " + "█▇▆▅▄▃▂▁".ljust(48) + " loss 3.7500 -> 2.0000, min 2.0000, steps 1-8/8, 9008 tok/s",
        "sft      " + "█▅▁".ljust(48) + " loss 1.2500 -> 0.7500, min 0.7500, steps 1-3/3, 800 tok/s",
    ]
    assert render.text(page).splitlines()[0] == "pretrain step 1/8 loss 3.7500 lr 3.00e-03 9001 tok/s"
    assert render.text(MetricsPage(run_id="r", points=[], next=0), terminal=True) == "(none)"


def test_follow_on_a_terminal_draws_bars_in_place_of_a_line_per_step(monkeypatch, capsys):
    """The defect: on a terminal `status --follow` printed a new line for every step and every ETA
        change. Now the terminal gets one bar per stage (drawn by rich, here in its non-terminal mode,
        which prints the bars once, as they end); the log line, the state and the verdict are printed
    above, each once."""
    ticks = [
        msgspec.structs.replace(VIEW, state=RunState.running, step=s, gates=[], message=None)
        for s in (10, 20, 30)
    ]
    done = msgspec.structs.replace(VIEW, state=RunState.succeeded, step=100, gates=[GATE])
    _scripted_calls(
        monkeypatch,
        {
            "status": [*ticks, done],
            "logs": [
                LogPage(run_id="run-1", lines=[LINE], next=1),
                LogPage(run_id="run-1", lines=[], next=1),
            ],
            "metrics": [
                MetricsPage(run_id="run-1", points=[_point("pretrain", 10, 100, 2.7, 4321.0)], next=1),
                MetricsPage(run_id="run-1", points=[], next=1),
            ],
        },
    )
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)  # a person's terminal, as ecc sees it
    monkeypatch.setenv("TTY_COMPATIBLE", "0")  # rich draws once, at the end, into the captured output
    monkeypatch.setenv("COLUMNS", "120")
    env = asyncio.run(render.follow(_follow_args(False), StatusRequest(run_id="run-1")))
    assert env.ok and env.data == done
    out = [ln.rstrip() for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert not any(ln.startswith("[") for ln in out), out  # no `[running] pretrain step ...` lines
    assert out[:3] == ["  log: step 40", "  state: running", gate_line(GATE)]
    (bar,) = out[3:]
    assert bar.startswith("pretrain ") and bar.endswith("100/100  loss 2.5000  4321 tok/s  done"), bar


@pytest.mark.parametrize(
    "action, target, digest, cost, lines",
    [
        (
            Action.train,
            "bk-1",
            "ab" * 32,
            0.00018,
            [
                "  authorises: train on booking bk-1, once",
                f"  manifest: sha256 {'ab' * 32}",
                "  cost bound: at most 0.00018 USD",
            ],
        ),
        (Action.cancel, "run-1", None, None, ["  authorises: cancel on run run-1, once"]),
        (Action.release_booking, "bk-2", None, None, ["  authorises: release_booking on booking bk-2, once"]),
        (
            Action.restart_from_checkpoint,
            "run-3",
            None,
            None,
            ["  authorises: restart_from_checkpoint on run run-3, once"],
        ),
    ],
)
def test_confirm_shows_what_it_authorises(action, target, digest, cost, lines):
    """The person sees the action, its target, the manifest's digest and the cost bound where the
    confirmation binds them, and when it expires; --json is the answer itself (the same fields)."""
    issued = ConfirmationIssued(
        confirmation_ref="cf-9",
        action=action,
        target=target,
        manifest_digest=digest,
        max_cost_usd=cost,
        expires_at=AT,
    )
    shown = render.text(issued).splitlines()
    assert shown == ["confirmation_ref: cf-9", *lines, "  expires: 2026-12-02T07:30:01.250000Z"]
    as_json = msgspec.json.decode(msgspec.json.encode(issued))
    assert set(as_json) == {
        "confirmation_ref",
        "action",
        "target",
        "manifest_digest",
        "max_cost_usd",
        "expires_at",
    }


@pytest.mark.parametrize(
    ("gpu_hours", "text"),
    [
        (0.0000077, "0.028 GPU-s"),  # a tiny run: never "0.0000 GPU-h"
        (28 / 3600, "28 GPU-s"),
        (0.5, "30.0 GPU-min"),
        (13.26, "13.26 GPU-h"),
        (1234.5, "1,234.50 GPU-h"),
    ],
)
def test_gpu_time_reads_in_a_unit_that_shows_the_amount(gpu_hours: float, text: str) -> None:
    assert units.gpu_time(gpu_hours) == text


def test_auth_shows_each_quota_beside_what_the_account_uses():
    from contracts.api import QuotaLimits, QuotaStatus, QuotaUsage

    limits = QuotaLimits(rate_per_s=2.5, burst=10, confirmations=3, runs=2, queued=1)
    usage = QuotaUsage(tokens=4.5, confirmations=1, runs=2, queued=0)
    info = AuthInfo(account="acme", key_id="UAKEY", quotas=QuotaStatus(limits=limits, usage=usage))
    lines = render.text(info).splitlines()
    assert lines[0] == "logged in as acme (key UAKEY)"
    assert "2.5/s, bursts of 10 (4.5 available now)" in lines[2]
    assert "1 / 3 outstanding" in lines[3] and "2 / 2 unfinished" in lines[4] and "0 / 1 waiting" in lines[5]


def test_a_gate_reads_as_sentences_with_its_findings():
    said = "held-out loss on the SFT eval split 7.3400 must be at most 2.9799 (1 % below the pretrain model's 3.0100): failed"
    gate = StageGate(
        stage="sft",
        passed=False,
        metrics=[
            EvalMetric(
                name="held_out_loss", value=7.34, threshold=2.9799, op="<=", passed=False, sentence=said
            )
        ],
        findings=["overfitting: training loss 0.1800 is far below held-out loss 1.6700 (x9.3)"],
    )
    assert gate_line(gate) == (
        f"gate sft: FAILED: {said}\n    finding: overfitting: training loss 0.1800 is far below held-out loss 1.6700 (x9.3)"
    )


def test_follow_prints_a_line_per_step_not_per_new_eta(monkeypatch, capsys):
    """The demo's follow printed `step 59/400 ... ETA 147s` then `step 59/400 ... ETA 153s`: the same
    step twice, the estimate alone moved. One line per step or state."""
    first = msgspec.structs.replace(VIEW, state=RunState.running, step=10)
    later = msgspec.structs.replace(VIEW, state=RunState.running, step=40)
    done = msgspec.structs.replace(VIEW, state=RunState.succeeded, step=100)
    clock = iter(float(t) for t in range(0, 1000, 7))
    monkeypatch.setattr(render.time, "monotonic", lambda: next(clock))
    _scripted_calls(
        monkeypatch,
        {"status": [first, later, later, later, done], "logs": [LogPage(run_id="run-1", lines=[], next=0)]},
    )
    asyncio.run(render.follow(_follow_args(False), StatusRequest(run_id="run-1")))
    out = capsys.readouterr().out.splitlines()
    steps = [ln.split(" ETA ")[0] for ln in out]
    assert len(steps) == len(set(steps)) == 3, out


def test_a_plan_shows_its_micro_batch_and_memory_estimate():
    from contracts.plans import MemoryPlan

    memory = MemoryPlan(
        state_bytes=24e9,
        activation_bytes=25e9,
        logits_bytes=21e9,
        total_bytes=64e9,
        usable_bytes=72e9,
        margin=0.1,
        basis="cuda-bf16: issue 40's 1B figures",
    )
    p = msgspec.structs.replace(
        PLAN, micro_batch_size=4, grad_accumulation=4, activation_checkpointing="none", memory=memory
    )
    lines = plan_view.plan(p).splitlines()
    assert (
        "memory: micro-batch 4 x 4 accumulation, activation checkpointing none; ~64.00 GB per GPU of "
        "72.0 GB usable (state 24.00, activations 25.00, logits 21.00 GB; 10% kept free)"
    ) in lines
    assert "  memory figures: cuda-bf16: issue 40's 1B figures" in lines
    assert not any(line.startswith("memory:") for line in plan_view.plan(PLAN).splitlines())  # an older plan
