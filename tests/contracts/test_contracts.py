"""Wire contracts: every Struct round-trips through JSON, rejects unknown fields and wrong types;
the Envelope's invariants; the stable error codes; contracts import nothing but msgspec and stdlib."""

import ast
import importlib
import inspect
import pathlib
import pkgutil
import sys
from datetime import UTC, datetime, timedelta

import msgspec
import pytest
import redis

import contracts
from contracts import (
    api,
    audit,
    base,
    booking,
    connection,
    desk,
    envelope,
    errors,
    evals,
    exports,
    files,
    internal,
    manifest,
    manifest_check,
    models,
    plans,
    runs,
    states,
    telemetry,
)
from contracts.api import Action
from contracts.booking import BookingEventKind, BookingState, Fabric
from contracts.errors import ErrorCode
from contracts.manifest import DataRole, ModelSize
from contracts.states import RunState

T0 = datetime(2025, 1, 2, 3, 4, 5, 678000, tzinfo=UTC)
T1 = T0 + timedelta(hours=6)

CONTRACTS_DIR = pathlib.Path(contracts.__file__).parent
MODULES = [importlib.import_module(f"contracts.{m.name}") for m in pkgutil.iter_modules(contracts.__path__)]


def defined_structs() -> list[type[msgspec.Struct]]:
    """Every msgspec.Struct subclass defined (not merely imported) in a contracts module."""
    found = []
    for module in MODULES:
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, msgspec.Struct) and obj.__module__ == module.__name__:
                found.append(obj)
    return found


# --- one sample per Struct; optional fields are set wherever possible so that they travel too ---

TOPOLOGY = booking.Topology(nodes=2, gpus_per_node=8, gpu_model="H200", gpu_memory_gb=141)
BOOKING = booking.Booking(
    booking_id="bk_1",
    account="acct_a",
    state=BookingState.completed,
    version=3,
    topology=TOPOLOGY,
    region="eu-west",
    fabric=Fabric.infiniband,
    window_start=T0,
    window_end=T1,
    updated_at=T0,
)
CREDENTIAL = api.Credential(account="acct_a", api_key="ito_sk_sample_not_a_real_key")
COST = plans.CostEstimate(
    flops=1.5e18,
    tokens=1_000_000,
    parameters=467_712,
    assumed_mfu=0.4,
    peak_tflops_per_gpu=989.0,
    gpus=16,
    gpu_hours=0.25,
    price_per_gpu_hour_usd=3.5,
    compute_usd=0.875,
    checkpoint_storage_usd=0.01,
    total_usd=0.885,
    booked_gpu_hours=96.0,
    incremental_usd=0.0,
)
CHECK_OK = plans.PlanCheck(name="fabric", ok=True, reason="infiniband is fine")
CHECK_FAIL = plans.PlanCheck(name="budget_cap", ok=False, code="budget_exceeded", reason="over the cap")
PLAN = plans.Plan(
    booking_id="bk_1",
    manifest_digest="ab" * 32,
    strategy="hsdp",
    degrees={"dp_replicate": 2, "dp_shard": 8},
    precision="fp8",
    cost=COST,
    checks=[CHECK_OK, CHECK_FAIL],
    ok=False,
    gates=[plans.StageGatePlan(stage="pretrain", rules=["held_out_loss <= 0.99 x the incoming model's"])],
    capacity=plans.CapacityPlan(
        booked_gpus=16,
        held_gpus=8,
        idle_gpus=8,
        held=["node0:gpu0-7"],
        idle=["node1:gpu0-7"],
        idle_fraction=0.5,
        idle_usd_per_hour=28.0,
        idle_usd_during_run=0.4375,
        idle_gpu_hours_in_window=95.75,
        wasteful=False,
        sentence="holds 8 of 16 booked H200 (node0:gpu0-7); 8 stay idle (node1:gpu0-7)",
    ),
    window=plans.WindowPlan(
        window_start=T0,
        window_end=T1,
        expected_wall_hours=0.015625,
        remaining_hours=6.0,
        required_margin_hours=0.0078125,
        margin_hours=5.984375,
        fits=True,
        resumable=False,
        sentence="expected wall time ~56 s against 6.00 h left in the booking's window: fits",
    ),
)
BODY = internal.EligibilityBody(
    account="acct_a",
    booking_id="bk_1",
    booking_version=3,
    topology=TOPOLOGY,
    region="eu-west",
    fabric=Fabric.roce,
    window_start=T0,
    window_end=T1,
    issued_at=T0,
    expires_at=T0 + timedelta(seconds=60),
)
LEDGER_ENTRY = internal.LedgerEntry(
    account="acct_a",
    idempotency_key="key-1",
    fingerprint="f" * 64,
    run_id="run_1",
    action=Action.train,
    handed_off=True,
    created_at=T0,
    work=b"\x00\x01binary\xff",
)
DECONTAMINATION = manifest.Decontamination(
    method="13-gram", against=["gsm8k"], provenance="ito-training data-prep"
)
MANIFEST = manifest.Manifest(
    schema_version=1,
    name="demo",
    model=manifest.ModelSpec(size=ModelSize.b1, revision="r1"),
    data=[
        manifest.DataRef(
            name="topics", source="builtin:pydoc_topics", role=DataRole.train, decontamination=DECONTAMINATION
        ),
        manifest.DataRef(name="heldout", source="generated:arithmetic", role=DataRole.eval),
    ],
    target=manifest.Target(tokens=10_000, seq_len=128, batch_size=8, learning_rate=1e-3),
    post_training=manifest.PostTraining(recipe=["sft", "dpo"]),
    checkpoint=manifest.CheckpointPolicy(interval_steps=10, keep_last=3, storage="/srv/ckpt"),
    resources=manifest.Resources(nodes=2, gpus_per_node=8, region="eu-west", fabric=Fabric.infiniband),
    budget_cap_usd=12.5,
    max_incremental_cost_usd=1.25,
    seed=7,
)

GATE_DECISION = audit.GateDecision(
    request_id="run_1",
    at=datetime(2026, 11, 29, 12, 0, tzinfo=UTC),
    account="acme",
    action=Action.train,
    gate="ledger_accept",
    ok=False,
    code="confirmation_consumed",
    booking_id="bk_1",
    manifest_digest="ab" * 32,
)

EVAL_METRIC = evals.EvalMetric(name="held_out_loss", value=2.5, threshold=3.0, op="<=", passed=True)
STAGE_GATE = evals.StageGate(stage="pretrain", passed=True, metrics=[EVAL_METRIC])
PROVENANCE_STEP = evals.ProvenanceStep(name="exact_dedup", before=10, after=8, detail="2 duplicates")

PARALLELISM = api.Parallelism(strategy="ddp", world_size=4, mesh={"dp_replicate": 4}, stage="pretrain")
RESTART = api.RestartProposal(
    stage="pretrain",
    checkpoint_step=300,
    skip_from=300,
    skip_to=500,
    spike_step=400,
    reason="loss above 4 sigma for 3 steps",
)

RUN_TELEMETRY = telemetry.RunTelemetry(
    run_id="run_1",
    account="acme",
    booking_id="bk_1",
    region="eu",
    gpu_model="H200",
    gpus=8,
    state="succeeded",
    accepted_at=T0,
    ended_at=T1,
    wall_s=100.0,
    goodput_s=80.0,
    badput_s={"queued": 20.0},
    goodput=0.8,
    gpu_hours=0.2,
    interruptions=1,
    interruption_causes={"trainer_lost": 1},
    checkpoint_saves=2,
    checkpoint_bytes_per_s_p50=1e9,
    checkpoint_bytes_per_s_min=5e8,
)

SAMPLES: dict[type, msgspec.Struct] = {
    # base
    base.Contract: base.Contract(),
    base.Internal: base.Internal(),
    # audit
    audit.GateDecision: GATE_DECISION,
    audit.AuditRequest: audit.AuditRequest(credential=CREDENTIAL, run_id="run_1"),
    audit.AuditTrail: audit.AuditTrail(run_id="run_1", decisions=[GATE_DECISION]),
    audit.AuditRecord: audit.AuditRecord(request_id="run_1", decisions=[GATE_DECISION]),
    # api
    api.Credential: CREDENTIAL,
    api.AuthRequest: api.AuthRequest(credential=CREDENTIAL),
    api.FindRequest: api.FindRequest(credential=CREDENTIAL),
    api.PlanRequest: api.PlanRequest(
        credential=CREDENTIAL, booking_id="bk_1", manifest_text="{}", manifest_digest="ab" * 32
    ),
    api.ConfirmRequest: api.ConfirmRequest(
        credential=CREDENTIAL,
        action=Action.train,
        booking_id="bk_1",
        run_id="run_1",
        manifest_text="{}",
        manifest_digest="ab" * 32,
        max_cost_usd=9.5,
    ),
    api.TrainRequest: api.TrainRequest(
        credential=CREDENTIAL,
        booking_id="bk_1",
        manifest_text="{}",
        manifest_digest="ab" * 32,
        idempotency_key="key-1",
        confirmation_ref="cf_1",
    ),
    api.StatusRequest: api.StatusRequest(credential=CREDENTIAL, run_id="run_1", idempotency_key="key-1"),
    api.LogsRequest: api.LogsRequest(credential=CREDENTIAL, run_id="run_1", since=5, limit=50),
    api.AuthInfo: api.AuthInfo(account="acct_a", key_id="kid_1"),
    api.BookingView: api.BookingView(booking=BOOKING, allows_training=False, reason="window over"),
    plans.PlanCheck: CHECK_FAIL,
    plans.CostEstimate: COST,
    plans.Plan: PLAN,
    plans.StageGatePlan: PLAN.gates[0],
    plans.CapacityPlan: PLAN.capacity,
    plans.WindowPlan: PLAN.window,
    plans.MemoryPlan: plans.MemoryPlan(
        state_bytes=24e9,
        activation_bytes=25e9,
        logits_bytes=21e9,
        total_bytes=64e9,
        usable_bytes=72e9,
        margin=0.1,
        basis="cuda-bf16: measured figures",
    ),
    api.ConfirmationIssued: api.ConfirmationIssued(
        confirmation_ref="cf_1",
        action=Action.cancel,
        target="run_1",
        manifest_digest=None,
        max_cost_usd=3.25,
        expires_at=T1,
    ),
    api.RunAccepted: api.RunAccepted(run_id="run_1", state=RunState.queued, replay=True),
    api.RunView: api.RunView(
        run_id="run_1",
        account="acct_a",
        booking_id="bk_1",
        manifest_digest="ab" * 32,
        idempotency_key="key-1",
        state=RunState.running,
        stage="pretrain",
        step=10,
        total_steps=100,
        loss=2.5,
        created_at=T0,
        updated_at=T1,
        plan=PLAN,
        message="training",
        parallelism=PARALLELISM,
    ),
    api.Parallelism: PARALLELISM,
    api.Spend: api.Spend(held_gpus=8, held_gpu_s=480.0, spent_usd=0.4667, limit_usd=5.0, at=T0),
    api.LogLineView: api.LogLineView(index=3, at=T0, level="warning", message="slow step"),
    api.LogPage: api.LogPage(
        run_id="run_1", lines=[api.LogLineView(index=0, at=T0, level="info", message="hi")], next=1
    ),
    # booking
    booking.Topology: TOPOLOGY,
    booking.BookingEvent: booking.BookingEvent(
        event_id="ev_1",
        kind=BookingEventKind.modified,
        booking_id="bk_1",
        account="acct_a",
        version=4,
        topology=TOPOLOGY,
        region="eu-west",
        fabric=Fabric.ethernet,
        window_start=T0,
        window_end=T1,
        emitted_at=T0,
    ),
    booking.Booking: BOOKING,
    # envelope and errors
    envelope.Envelope: envelope.Envelope(
        ok=True, live_api_contacted=True, notice="replay", data={"run_id": "run_1", "n": [1, 2.5, None]}
    ),
    errors.ApiError: errors.ApiError(code=ErrorCode.booking_expired, message="the booking's window is over"),
    # internal
    internal.EligibilityQuery: internal.EligibilityQuery(
        account="acct_a",
        booking_id="bk_1",
        nodes=2,
        gpus_per_node=8,
        region="eu-west",
        fabric=Fabric.infiniband,
    ),
    internal.EligibilityBody: BODY,
    internal.EligibilityStatement: internal.EligibilityStatement(body=BODY, signature="0f" * 32),
    internal.BookingsQuery: internal.BookingsQuery(account="acct_a"),
    internal.BookingsAnswer: internal.BookingsAnswer(bookings=[BOOKING]),
    internal.ConfirmationCreate: internal.ConfirmationCreate(
        account="acct_a",
        action=Action.train,
        target="bk_1",
        manifest_digest="ab" * 32,
        max_cost_usd=9.5,
    ),
    internal.ConfirmationResolve: internal.ConfirmationResolve(
        account="acct_a",
        confirmation_ref="cf_1",
        action=Action.train,
        target="bk_1",
        manifest_digest="ab" * 32,
        cost_usd=1.5,
    ),
    internal.LedgerLookup: internal.LedgerLookup(account="acct_a", idempotency_key="key-1"),
    internal.LedgerEntry: LEDGER_ENTRY,
    internal.LedgerAccept: internal.LedgerAccept(
        account="acct_a",
        idempotency_key="key-1",
        fingerprint="f" * 64,
        run_id="run_1",
        action=Action.train,
        confirmation_ref="cf_1",
        target="bk_1",
        manifest_digest="ab" * 32,
        cost_usd=1.5,
        work=b'{"x":1}',
    ),
    internal.LedgerHandedOff: internal.LedgerHandedOff(account="acct_a", idempotency_key="key-1"),
    internal.LedgerPending: internal.LedgerPending(older_than_s=30.5),
    internal.LedgerPendingAnswer: internal.LedgerPendingAnswer(entries=[LEDGER_ENTRY]),
    internal.Health: internal.Health(service="ledger", ok=True),
    internal.HealthQuery: internal.HealthQuery(),
    internal.BookingRelease: internal.BookingRelease(account="acme", booking_id="bk_1", run_id="run_1"),
    # manifest
    manifest.ModelSpec: manifest.ModelSpec(size=ModelSize.m150, revision="main"),
    manifest.Decontamination: DECONTAMINATION,
    manifest.DataRef: manifest.DataRef(
        name="topics", source="file:/data/x.txt", role=DataRole.eval, decontamination=DECONTAMINATION
    ),
    manifest.Target: manifest.Target(tokens=5000, seq_len=32, batch_size=4, learning_rate=5e-4),
    manifest.PostTraining: manifest.PostTraining(recipe=["sft", "rlvr"]),
    manifest.CheckpointPolicy: manifest.CheckpointPolicy(interval_steps=5, keep_last=1, storage="local"),
    manifest.Resources: manifest.Resources(nodes=1, gpus_per_node=4, region="us-east", fabric=Fabric.roce),
    manifest.Manifest: MANIFEST,
    # models
    models.ModelShape: models.MODEL_SHAPES["8B"],
    # runs
    runs.TrainWork: runs.TrainWork(
        run_id="run_1",
        account="acct_a",
        booking_id="bk_1",
        manifest_text="{}",
        manifest_digest="ab" * 32,
        plan=PLAN,
        checkpoint_dir="/srv/ckpt/acct_a/run_1",
    ),
    runs.RunEventBase: runs.RunEventBase(run_id="run_1", seq=1, at=T0),
    runs.StateChanged: runs.StateChanged(
        run_id="run_1", seq=2, at=T0, state=RunState.running, stage="pretrain", message="go", total_steps=40
    ),
    runs.LogLine: runs.LogLine(run_id="run_1", seq=3, at=T0, level="error", message="oops"),
    runs.Metrics: runs.Metrics(
        run_id="run_1",
        seq=4,
        at=T0,
        stage="pretrain",
        step=3,
        total_steps=40,
        loss=3.25,
        learning_rate=3e-3,
        tokens_per_s=1234.5,
        grad_norm=0.75,
    ),
    runs.CheckpointSaved: runs.CheckpointSaved(
        run_id="run_1", seq=5, at=T0, step=10, path="/srv/ckpt/step_10", bytes=4096, stall_s=0.5, save_s=1.25
    ),
    runs.RunCreated: runs.RunCreated(
        run_id="run_1",
        seq=9,
        at=T0,
        account="acme",
        booking_id="bk_1",
        region="eu",
        gpu_model="H200",
        gpus=8,
        accepted_at=T0,
    ),
    api.RestartProposal: RESTART,
    runs.ProposalMade: runs.ProposalMade(run_id="run_1", seq=11, at=T1, proposal=RESTART),
    runs.ParallelismStarted: runs.ParallelismStarted(
        run_id="run_1",
        seq=12,
        at=T1,
        stage="pretrain",
        strategy="ddp",
        world_size=4,
        mesh={"dp_replicate": 4},
    ),
    api.ApproveRequest: api.ApproveRequest(
        credential=CREDENTIAL, run_id="run_1", idempotency_key="k", confirmation_ref="cf_1", reject=False
    ),
    runs.Interruption: runs.Interruption(
        run_id="run_1", seq=10, at=T1, cause="trainer_lost", silent_s=5.5, step=40
    ),
    # telemetry
    telemetry.RunTelemetry: RUN_TELEMETRY,
    telemetry.Rollup: telemetry.Rollup(
        by="booking",
        key="bk_1",
        runs=1,
        wall_gpu_hours=1.0,
        goodput_gpu_hours=0.8,
        goodput=0.8,
        badput_gpu_hours={"queued": 0.2},
        interruptions=1,
        interruptions_per_1000_gpu_hours=1000.0,
        interruption_causes={"trainer_lost": 1},
        checkpoint_bytes_per_s_p50=1e9,
        checkpoint_bytes_per_s_min=5e8,
        updated_at=T1,
    ),
    runs.StageStarted: runs.StageStarted(run_id="run_1", seq=6, at=T0, stage="midtrain", total_steps=20),
    runs.EvalResult: runs.EvalResult(
        run_id="run_1", seq=7, at=T0, stage="pretrain", metrics=[EVAL_METRIC], passed=False
    ),
    runs.DataProvenance: runs.DataProvenance(
        run_id="run_1", seq=8, at=T0, steps=[PROVENANCE_STEP], input_digest="ab" * 32, output_digest="cd" * 32
    ),
    runs.MetricsPage: runs.MetricsPage(run_id="run_1", points=[], next=0),
    runs.CheckpointList: runs.CheckpointList(run_id="run_1", checkpoints=[], cleaned_up=True),
    runs.EvalList: runs.EvalList(run_id="run_1", gates=[STAGE_GATE]),
    # evals
    evals.EvalMetric: EVAL_METRIC,
    evals.StageGate: STAGE_GATE,
    evals.ProvenanceStep: PROVENANCE_STEP,
    evals.Provenance: evals.Provenance(
        steps=[PROVENANCE_STEP], input_digest="ab" * 32, output_digest="cd" * 32
    ),
    # lifecycle
    api.MetricsRequest: api.MetricsRequest(credential=CREDENTIAL, run_id="run_1", since=3, limit=10),
    api.RunItemsRequest: api.RunItemsRequest(credential=CREDENTIAL, run_id="run_1"),
    api.CancelRequest: api.CancelRequest(
        credential=CREDENTIAL, run_id="run_1", idempotency_key="k", confirmation_ref="cf_1"
    ),
    api.CleanupRequest: api.CleanupRequest(
        credential=CREDENTIAL,
        run_id="run_1",
        idempotency_key="k",
        confirmation_ref="cf_1",
        release_booking=True,
        release_confirmation_ref="cf_2",
    ),
    api.MutationResult: api.MutationResult(
        run_id="run_1", action=Action.cancel, state=RunState.cancelling, replay=True
    ),
    api.RemovedArtifact: api.RemovedArtifact(path="/ckpt/a", bytes=3),
    api.CleanupResult: api.CleanupResult(
        run_id="run_1", removed=[api.RemovedArtifact(path="/ckpt/a", bytes=3)], booking_release_requested=True
    ),
    api.CleanupOrder: api.CleanupOrder(account="acme", run_id="run_1", checkpoint_dir="/ckpt/acme/run_1"),
    api.LeaseQuery: api.LeaseQuery(run_id="run_1"),
    api.LeaseAnswer: api.LeaseAnswer(run_id="run_1", proceed=False, state=RunState.cancelled),
}

GATE = manifest.Gate(max_held_out_loss=2.5, min_task_accuracy=0.1, task_samples=32)
LC_GATE = manifest.LongContextGate(
    max_held_out_loss=3.0,
    min_task_accuracy=0.1,
    task_samples=16,
    max_short_loss_increase=0.2,
    min_needle_accuracy=0.5,
    needle_trials=8,
)
MANIFEST_STAGE_SAMPLES = {
    manifest.Gate: GATE,
    manifest.LongContextGate: LC_GATE,
    manifest.DataPrepStage: manifest.DataPrepStage(
        exact_dedup=False,
        near_dedup=True,
        near_dup_jaccard=0.7,
        minhash_permutations=128,
        minhash_bands=16,
        shingle_words=4,
        decontamination_ngram=8,
    ),
    manifest.LadderStage: manifest.LadderStage(
        proxy_steps=20, max_budget_fraction=0.1, max_loss_regression=0.05
    ),
    manifest.PretrainStage: manifest.PretrainStage(data=["topics"], gate=GATE),
    manifest.MidtrainStage: manifest.MidtrainStage(
        tokens=4096, data=["topics"], learning_rate=1e-4, seq_len=64, gate=GATE
    ),
    manifest.LongContextStage: manifest.LongContextStage(
        tokens=8192,
        seq_len=512,
        rope_base=1e6,
        batch_size=4,
        learning_rate=1e-4,
        data=["topics"],
        gate=LC_GATE,
    ),
    manifest.Stages: manifest.Stages(
        data_prep=manifest.DataPrepStage(),
        ladder=manifest.LadderStage(),
        pretrain=manifest.PretrainStage(),
        midtrain=manifest.MidtrainStage(tokens=4096),
        long_context=manifest.LongContextStage(tokens=8192, seq_len=512),
    ),
    manifest.SftStage: manifest.SftStage(
        steps=10, batch_size=8, learning_rate=1e-4, data=["arith"], gate=GATE
    ),
    manifest.DpoStage: manifest.DpoStage(
        steps=10, batch_size=8, learning_rate=1e-5, beta=0.2, data=["arith"], gate=GATE
    ),
    manifest.RlvrStage: manifest.RlvrStage(
        steps=10,
        prompts_per_step=4,
        group_size=4,
        learning_rate=1e-5,
        eps_low=0.1,
        eps_high=0.3,
        max_response_tokens=32,
        overlong_buffer_tokens=8,
        max_staleness=2,
        temperature=0.8,
        max_sampling_rounds=2,
        data=["arith"],
        gate=GATE,
    ),
}
SAMPLES.update(MANIFEST_STAGE_SAMPLES)
SAMPLES[manifest_check.Checked] = manifest_check.Checked(
    valid=True, name="tiny-demo", manifest_digest="ab" * 32
)
SAMPLES.update(
    {
        desk.DeskRunsRequest: desk.DeskRunsRequest(limit=50),
        desk.DeskRuns: desk.DeskRuns(runs=[SAMPLES[api.RunView]], prices={"H200": 3.5}, at=T0),
        desk.StateRecord: desk.StateRecord(state=RunState.running, at=T0, message="training started"),
        desk.InterruptionRecord: desk.InterruptionRecord(
            detected_at=T0.timestamp(), silent_s=12.5, cause="trainer_lost", step=40, stage="pretrain"
        ),
        desk.DeskRunRequest: desk.DeskRunRequest(run_id="run_1", metrics_since=10, logs_since=2, audit=True),
        desk.DeskRun: desk.DeskRun(
            view=SAMPLES[api.RunView],
            metrics=[SAMPLES[runs.Metrics]],
            metrics_next=11,
            checkpoints=[SAMPLES[runs.CheckpointSaved]],
            states=[desk.StateRecord(state=RunState.running, at=T0)],
            interruptions=[],
            logs=[SAMPLES[api.LogLineView]],
            logs_next=3,
            audit=[GATE_DECISION],
        ),
    }
)

TINY_HF_SHAPE = models.ModelShape(
    n_layer=2,
    d_model=64,
    n_head=4,
    n_kv_head=2,
    d_ff=128,
    vocab_size=300,
    max_seq_len=256,
    rope_base=500_000.0,
    head_dim=32,
    qk_norm=False,
    attention_bias=True,
    tie_embeddings=True,
    norm_eps=1e-5,
    rope_scaling=models.RopeScaling(
        kind="llama3",
        factor=8.0,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=64,
    ),
)
BASE_MODEL = models.BaseModel(
    name="tiny-llama",
    digest="sha256:" + "ab" * 32,
    family="llama",
    architecture="LlamaForCausalLM",
    shape=TINY_HF_SHAPE,
    parameters=93_504,
    tokenizer_vocab=300,
    chat_template=True,
    eos_token="</s>",
    bytes=400_000,
    accounts=["acct_a"],
    added_at="2026-12-03T00:00:00+00:00",
)
SAMPLE_REQUEST = exports.SampleRequest(
    credential=CREDENTIAL,
    run_id="run_1",
    prompt="2+2=",
    stage="sft",
    max_new_tokens=8,
    temperature=0.5,
    seed=3,
    chat=True,
)
RUN_SUMMARY = api.RunSummary(
    run_id="run_1",
    state=RunState.running,
    booking_id="bk_1",
    manifest_digest="ab" * 32,
    idempotency_key="k",
    created_at=T0,
    updated_at=T1,
    stage="pretrain",
    step=3,
    total_steps=40,
    loss=3.25,
    estimate_usd=0.5,
)
EXPORT_FILE = exports.ExportFile(path="model.safetensors", bytes=1024, sha256="cd" * 32)
SAMPLES.update(
    {
        connection.Connection: connection.Connection(
            url="nats://127.0.0.1:4222", namespace="ito", ca="/home/me/.config/ecc/ca.pem"
        ),
        models.RopeScaling: TINY_HF_SHAPE.rope_scaling,
        models.BaseModel: BASE_MODEL,
        manifest.Lora: manifest.Lora(rank=4, alpha=8.0, dropout=0.1, target_modules=["q_proj", "v_proj"]),
        api.ModelsRequest: api.ModelsRequest(credential=CREDENTIAL),
        api.ModelView: api.ModelView(
            name="tiny-llama",
            digest=BASE_MODEL.digest,
            family="llama",
            architecture="LlamaForCausalLM",
            parameters=93_504,
            vocab_size=300,
            max_seq_len=256,
            tokenizer=True,
            chat_template=True,
            bytes=400_000,
        ),
        api.ModelList: api.ModelList(models=[]),
        api.RunsRequest: api.RunsRequest(
            credential=CREDENTIAL,
            state=RunState.running,
            booking_id="bk_1",
            limit=5,
            cursor="1796196601.25:run_1",
        ),
        api.RunSummary: RUN_SUMMARY,
        api.RunList: api.RunList(runs=[RUN_SUMMARY], next="1796196601.25:run_1"),
        exports.ExportRequest: exports.ExportRequest(
            credential=CREDENTIAL, run_id="run_1", stage="dpo", format=exports.ExportFormat.peft
        ),
        exports.ExportFile: EXPORT_FILE,
        exports.ExportView: exports.ExportView(
            run_id="run_1",
            stage="dpo",
            format=exports.ExportFormat.hf,
            state="ready",
            export_id="dpo-hf",
            digest="sha256:" + "ef" * 32,
            files=[EXPORT_FILE],
            bytes=1024,
            step=20,
            message="exported",
        ),
        exports.DownloadRequest: exports.DownloadRequest(
            credential=CREDENTIAL,
            run_id="run_1",
            export_id="dpo-hf",
            path="config.json",
            offset=10,
            length=100,
        ),
        exports.DownloadChunk: exports.DownloadChunk(
            run_id="run_1",
            export_id="dpo-hf",
            path="config.json",
            offset=10,
            data=b"{}",
            size=12,
            sha256="01" * 32,
        ),
        exports.SampleRequest: SAMPLE_REQUEST,
        exports.SampleResult: exports.SampleResult(run_id="run_1", stage="sft", step=60, text="4", tokens=1),
        exports.ExportOrder: exports.ExportOrder(
            account="acct_a",
            run_id="run_1",
            stage="sft",
            format=exports.ExportFormat.hf,
            manifest_digest="ab" * 32,
            storage="/mnt/ckpt",
            manifest_text='{"schema_version": 1}',
            base=BASE_MODEL,
            gates=[STAGE_GATE],
            checkpoint_dir="/mnt/ckpt/acct_a/run_1",
        ),
        exports.DownloadOrder: exports.DownloadOrder(
            account="acct_a",
            run_id="run_1",
            export_id="sft-hf",
            path="config.json",
            offset=0,
            length=100,
            storage="/mnt/ckpt",
        ),
        exports.SampleOrder: exports.SampleOrder(
            account="acct_a",
            run_id="run_1",
            request=SAMPLE_REQUEST,
            storage="local",
            manifest_text='{"schema_version": 1}',
            base=BASE_MODEL,
            checkpoint_dir="/data/checkpoints/acct_a/run_1",
        ),
    }
)

QUOTA_LIMITS = api.QuotaLimits(rate_per_s=2.5, burst=10, confirmations=3, runs=2, queued=1)
QUOTA_USAGE = api.QuotaUsage(tokens=4.5, confirmations=1, runs=1, queued=0)
SAMPLES.update(
    {
        api.QuotaLimits: QUOTA_LIMITS,
        api.QuotaUsage: QUOTA_USAGE,
        api.QuotaStatus: api.QuotaStatus(limits=QUOTA_LIMITS, usage=QUOTA_USAGE),
        errors.QuotaBreach: errors.QuotaBreach(quota="runs", current=2, limit=2),
        internal.OutstandingQuery: internal.OutstandingQuery(account="acct_a"),
        internal.Outstanding: internal.Outstanding(confirmations=1, limit=3),
    }
)

DIGEST = "sha256:" + "ab" * 32
UPLOAD_FILE = files.UploadFile(path="chat.jsonl", bytes=1234, sha256=DIGEST)
FILE_VIEW = files.FileView(
    file_id="file-" + "0a" * 12,
    name="chat.jsonl",
    purpose=files.FilePurpose.train,
    format=manifest.DataFormat.jsonl,
    bytes=1234,
    sha256=DIGEST,
    rows=40,
    kinds=["messages"],
    created_at=T0,
    source="upload:file-" + "0a" * 12,
)
UPLOAD_SESSION = files.UploadSession(
    upload_id="up-" + "0b" * 12,
    kind=files.UploadKind.data,
    name="chat.jsonl",
    state="uploading",
    files=[
        files.UploadedFile(
            path="chat.jsonl",
            bytes=1234,
            sha256=DIGEST,
            received=1000,
            put=files.PresignedPut(url="https://s3.example/put?sig=x", headers={"a": "b"}, expires_at=T0),
        )
    ],
    expires_at=T0,
)
SAMPLES.update(
    {
        files.UploadFile: UPLOAD_FILE,
        files.UploadRequest: files.UploadRequest(
            name="chat.jsonl", files=[UPLOAD_FILE], purpose=files.FilePurpose.eval
        ),
        files.PresignedPut: UPLOAD_SESSION.files[0].put,
        files.UploadedFile: UPLOAD_SESSION.files[0],
        files.UploadSession: UPLOAD_SESSION,
        files.UploadPartRequest: files.UploadPartRequest(
            upload_id="up-" + "0b" * 12, path="chat.jsonl", offset=1000, data=b"{}\n"
        ),
        files.UploadPartAck: files.UploadPartAck(
            upload_id="up-" + "0b" * 12, path="chat.jsonl", received=1003
        ),
        files.UploadCommitRequest: files.UploadCommitRequest(upload_id="up-" + "0b" * 12),
        files.DataReport: files.DataReport(
            format=manifest.DataFormat.jsonl,
            bytes=1234,
            sha256=DIGEST,
            rows=40,
            kinds=["messages"],
            columns=["messages"],
            problems=["line 3: not valid JSON"],
            more_problems=2,
        ),
        files.FileView: FILE_VIEW,
        files.UploadView: files.UploadView(
            upload_id="up-" + "0b" * 12, kind=files.UploadKind.data, state="ready", file=FILE_VIEW
        ),
        files.FilesRequest: files.FilesRequest(),
        files.FileList: files.FileList(files=[FILE_VIEW], uploads=[UPLOAD_SESSION]),
        files.FileRequest: files.FileRequest(file_id=FILE_VIEW.file_id),
        files.FileDeleteRequest: files.FileDeleteRequest(
            file_id=FILE_VIEW.file_id, confirmation_ref="cf_1", idempotency_key="k1"
        ),
        files.FileDeleted: files.FileDeleted(file_id=FILE_VIEW.file_id, bytes=1234, idempotency_key="k1"),
        files.ConnectionsRequest: files.ConnectionsRequest(),
        files.ConnectionView: files.ConnectionView(name="corpus", kind="s3", endpoint="http://minio:9000"),
        files.ConnectionList: files.ConnectionList(
            connections=[files.ConnectionView(name="corpus", kind="s3")]
        ),
        files.DataInput: files.DataInput(
            name="chat",
            kind=files.InputKind.upload,
            locator=FILE_VIEW.file_id,
            digest=DIGEST,
            format=manifest.DataFormat.jsonl,
            bytes=1234,
        ),
    }
)

STRUCTS = defined_structs()
RUN_EVENT_CLASSES = [
    runs.StateChanged,
    runs.LogLine,
    runs.Metrics,
    runs.CheckpointSaved,
    runs.StageStarted,
    runs.EvalResult,
    runs.DataProvenance,
    runs.RunCreated,
    runs.Interruption,
    runs.ProposalMade,
    runs.ParallelismStarted,
]


def name_of(cls: type) -> str:
    return f"{cls.__module__.removeprefix('contracts.')}.{cls.__qualname__}"


# --- discovery: the registry covers every Struct ---


def test_every_listed_module_is_discovered():
    names = {m.__name__ for m in MODULES}
    for module in (
        api,
        audit,
        base,
        booking,
        connection,
        envelope,
        errors,
        evals,
        exports,
        internal,
        manifest,
        models,
        plans,
        runs,
        states,
        telemetry,
    ):
        assert module.__name__ in names


def test_discovery_finds_structs():
    # guards the guard: if discovery broke and found nothing, the coverage test below would pass vacuously
    assert {plans.Plan, runs.Metrics, envelope.Envelope, manifest.Manifest} <= set(STRUCTS)


def test_every_struct_has_a_sample():
    missing = sorted(name_of(c) for c in STRUCTS if c not in SAMPLES)
    assert missing == [], "add a sample to SAMPLES for each new contract Struct"


def test_every_sample_is_an_instance_of_its_key():
    wrong = sorted(name_of(c) for c, s in SAMPLES.items() if type(s) is not c)
    assert wrong == []


# --- round trips ---


@pytest.mark.parametrize("cls", STRUCTS, ids=name_of)
def test_round_trips_through_json(cls):
    sample = SAMPLES[cls]
    encoded = msgspec.json.encode(sample)
    assert msgspec.json.decode(encoded, type=cls) == sample
    # and the encoding is stable: re-encoding the decoded value gives the same bytes
    assert msgspec.json.encode(msgspec.json.decode(encoded, type=cls)) == encoded


@pytest.mark.parametrize("cls", RUN_EVENT_CLASSES, ids=name_of)
def test_run_event_union_decodes_to_the_right_type(cls):
    sample = SAMPLES[cls]
    decoded = msgspec.json.decode(msgspec.json.encode(sample), type=runs.RunEvent)
    assert type(decoded) is cls and decoded == sample


@pytest.mark.parametrize(
    "cls, tag",
    [
        (runs.StateChanged, "state"),
        (runs.LogLine, "log"),
        (runs.Metrics, "metrics"),
        (runs.CheckpointSaved, "checkpoint"),
    ],
    ids=lambda v: v if isinstance(v, str) else v.__name__,
)
def test_run_events_carry_their_kind_tag(cls, tag):
    assert msgspec.json.decode(msgspec.json.encode(SAMPLES[cls]))["kind"] == tag


def test_run_event_union_rejects_an_unknown_kind():
    raw = msgspec.json.encode({**msgspec.to_builtins(SAMPLES[runs.LogLine]), "kind": "bogus"})
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(raw, type=runs.RunEvent)


def test_credential_repr_hides_the_key():
    leaked = CREDENTIAL.api_key in repr(CREDENTIAL)
    assert not leaked, "Credential's repr must not show the api key"
    assert "acct_a" in repr(CREDENTIAL)


# --- strictness ---


def from_outside(cls: type) -> bool:
    """Input that outsiders write: API requests, the manifest, upstream booking events."""
    return (
        cls.__name__.endswith("Request")
        or cls in (api.Credential, base.Contract, files.UploadFile)
        or cls.__module__ == "contracts.manifest"
        or cls in (booking.BookingEvent, booking.Topology)
    )


OUTSIDE = [c for c in STRUCTS if from_outside(c)]
INSIDE = [c for c in STRUCTS if not from_outside(c)]


@pytest.mark.parametrize("cls", STRUCTS, ids=name_of)
def test_is_frozen_and_strict_exactly_where_outsiders_write(cls):
    config = cls.__struct_config__
    assert config.frozen and config.forbid_unknown_fields == from_outside(cls)


@pytest.mark.parametrize("cls", OUTSIDE, ids=name_of)
def test_unknown_field_is_rejected(cls):
    raw = msgspec.json.encode({**msgspec.to_builtins(SAMPLES[cls]), "zz_unknown_field": 1})
    with pytest.raises(msgspec.ValidationError, match="zz_unknown_field"):
        msgspec.json.decode(raw, type=cls)


@pytest.mark.parametrize("cls", INSIDE, ids=name_of)
def test_an_older_reader_survives_a_newer_writer(cls):
    """Rolling upgrade: a newer service added a field; this (older) decoder skips it."""
    raw = msgspec.json.encode(
        {**msgspec.to_builtins(SAMPLES[cls]), "zz_added_in_a_later_version": {"x": [1]}}
    )
    assert msgspec.json.decode(raw, type=cls) == SAMPLES[cls]


def test_a_newer_run_event_and_work_item_still_decode():
    event = {**msgspec.to_builtins(SAMPLES[runs.StateChanged]), "new_field": 1}
    assert msgspec.json.decode(msgspec.json.encode(event), type=runs.RunEvent) == SAMPLES[runs.StateChanged]
    work = {**msgspec.to_builtins(SAMPLES[runs.TrainWork]), "priority": "high"}
    work["plan"] = {**work["plan"], "new_plan_field": [1, 2]}
    assert msgspec.json.decode(msgspec.json.encode(work), type=runs.TrainWork) == SAMPLES[runs.TrainWork]


def typed_fields() -> list[tuple[type, str]]:
    """(Struct, field) for every field with a concrete type (a bare Envelope's data is its type
    parameter left open, so anything goes; `Envelope[RunView]` types it)."""
    out = []
    for cls in STRUCTS:
        for field in msgspec.structs.fields(cls):
            if field.type is not object and str(field.type) not in ("typing.Any", "typing.Optional[~T]"):
                out.append((cls, field.encode_name))
    return out


@pytest.mark.parametrize("cls, field", typed_fields(), ids=lambda v: v if isinstance(v, str) else name_of(v))
def test_a_field_of_the_wrong_type_is_rejected(cls, field):
    # `[[]]` is a valid value for no str, number, bool, enum, datetime, bytes, dict, Struct or
    # list-of-those field, so every typed field must refuse it.
    raw = msgspec.json.encode({**msgspec.to_builtins(SAMPLES[cls]), field: [[]]})
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.json.decode(raw, type=cls)


@pytest.mark.parametrize(
    "cls, field, value",
    [
        (booking.Topology, "nodes", "2"),  # strict: no str -> int coercion
        (booking.Topology, "nodes", 2.5),
        (booking.Topology, "nodes", True),  # a bool is not an int on the wire
        (booking.Booking, "state", "parked"),  # not a BookingState
        (booking.Booking, "window_end", "tomorrow"),
        (api.Credential, "api_key", 5),  # absent is allowed (and refused on the wire by the scheduler)
        (api.TrainRequest, "idempotency_key", 42),
        (api.RunView, "state", "paused"),
        (manifest.Manifest, "budget_cap_usd", "10"),
        (manifest.ModelSpec, "size", "13B"),
        (manifest.DataRef, "role", "test"),
        (plans.Plan, "degrees", {"tp": "2"}),
        (envelope.Envelope, "ok", "yes"),
        (envelope.Envelope, "notice", 0),
        (errors.ApiError, "code", "not_a_code"),
        (internal.LedgerEntry, "work", "not base64!"),
        (runs.Metrics, "loss", "nan"),
    ],
    ids=lambda v: repr(v) if not isinstance(v, type) else v.__name__,
)
def test_specific_wrong_types_are_rejected(cls, field, value):
    raw = msgspec.json.encode({**msgspec.to_builtins(SAMPLES[cls]), field: value})
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(raw, type=cls)


@pytest.mark.parametrize(
    "cls", [c for c in STRUCTS if any(f.required for f in msgspec.structs.fields(c))], ids=name_of
)
def test_a_missing_required_field_is_rejected(cls):
    first_required = next(f.encode_name for f in msgspec.structs.fields(cls) if f.required)
    as_dict = msgspec.to_builtins(SAMPLES[cls])
    del as_dict[first_required]
    with pytest.raises(msgspec.ValidationError, match=first_required):
        msgspec.json.decode(msgspec.json.encode(as_dict), type=cls)


# --- Envelope ---

ERR = errors.ApiError(code=ErrorCode.internal, message="boom")


@pytest.mark.parametrize(
    "ok, error",
    [(True, ERR), (False, None)],
    ids=["ok-with-error", "failed-without-error"],
)
def test_envelope_rejects_inconsistent_ok_and_error(ok, error):
    with pytest.raises(AssertionError):
        envelope.Envelope(ok=ok, live_api_contacted=True, notice=None, error=error)


def test_envelope_decoded_with_ok_and_error_is_refused():
    raw = b'{"ok":true,"live_api_contacted":true,"notice":null,"error":{"code":"internal","message":"x"}}'
    with pytest.raises(AssertionError):
        msgspec.json.decode(raw, type=envelope.Envelope)


@pytest.mark.parametrize(
    "env, expected",
    [
        (
            envelope.Envelope(ok=True, live_api_contacted=True, notice=None),
            {"ok": True, "live_api_contacted": True, "notice": None},
        ),
        (
            envelope.Envelope(ok=True, live_api_contacted=False, notice="cached", data={"a": 1}),
            {"ok": True, "live_api_contacted": False, "notice": "cached", "data": {"a": 1}},
        ),
        (
            envelope.Envelope(ok=False, live_api_contacted=True, notice=None, error=ERR),
            {
                "ok": False,
                "live_api_contacted": True,
                "notice": None,
                "error": {"code": "internal", "message": "boom"},
            },
        ),
    ],
    ids=["ok-no-data", "ok-with-data", "failed"],
)
def test_envelope_wire_shape(env, expected):
    # `notice` is always on the wire (null when there is nothing to say); data/error only when set
    assert msgspec.json.decode(msgspec.json.encode(env)) == expected


def test_envelope_requires_notice_on_decode():
    with pytest.raises(msgspec.ValidationError, match="notice"):
        msgspec.json.decode(b'{"ok":true,"live_api_contacted":true}', type=envelope.Envelope)


# --- error codes ---

STABLE_CODES = [
    "unauthenticated",
    "credential_revoked",
    "forbidden",
    "booking_not_found",
    "booking_incomplete",
    "booking_expired",
    "booking_revoked",
    "booking_released",
    "booking_mismatch",
    "eligibility_stale",
    "manifest_invalid",
    "manifest_not_absolute",
    "manifest_symlink",
    "manifest_not_regular",
    "manifest_unsafe_permissions",
    "manifest_too_large",
    "manifest_changed",
    "manifest_digest_mismatch",
    "manifest_contains_secret",
    "confirmation_required",
    "confirmation_not_found",
    "confirmation_expired",
    "confirmation_consumed",
    "confirmation_mismatch",
    "idempotency_key_invalid",
    "idempotency_key_conflict",
    "idempotency_in_progress",
    "fabric_unsupported",
    "capacity_insufficient",
    "data_policy_violation",
    "checkpoint_storage_unavailable",
    "budget_exceeded",
    "plan_wasteful",
    "run_not_found",
    "run_not_cancellable",
    "timeout",
    "transport_ambiguous",
    "backend_unavailable",
    "internal",
]


@pytest.mark.parametrize("code", list(ErrorCode), ids=lambda c: c.name)
def test_error_code_value_equals_its_name(code):
    assert code.value == code.name


@pytest.mark.parametrize("name", STABLE_CODES)
def test_stable_error_code_exists(name):
    assert ErrorCode(name).name == name


def test_stable_list_has_no_duplicates():
    assert len(set(STABLE_CODES)) == len(STABLE_CODES) == 39


# --- contracts stay pure data ---

CONTRACT_FILES = sorted(CONTRACTS_DIR.glob("*.py"))


def imported_roots(source: str) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add("contracts" if node.level else (node.module or "").split(".")[0])
    return roots


@pytest.mark.parametrize("path", CONTRACT_FILES, ids=lambda p: p.name)
def test_contracts_import_only_msgspec_stdlib_and_contracts(path):
    allowed = set(sys.stdlib_module_names) | {"msgspec", "contracts"}
    assert imported_roots(path.read_text()) - allowed == set()


@pytest.mark.parametrize(
    "source, bad",
    [
        ("import redis", {"redis"}),
        ("from runtime import codec", {"runtime"}),
        ("import json, msgspec", set()),
        ("from .base import Contract", set()),
        ("def f():\n    import numpy", {"numpy"}),
    ],
    ids=["import", "from-import", "stdlib-and-msgspec", "relative", "nested-import"],
)
def test_import_check_catches_foreign_imports(source, bad):
    allowed = set(sys.stdlib_module_names) | {"msgspec", "contracts"}
    assert imported_roots(source) - allowed == bad


def test_contract_files_found():
    assert {p.name for p in CONTRACT_FILES} >= {
        "api.py",
        "booking.py",
        "envelope.py",
        "errors.py",
        "exports.py",
        "internal.py",
        "manifest.py",
        "models.py",
        "plans.py",
        "runs.py",
        "states.py",
    }


@pytest.mark.parametrize(
    "fault",
    [
        redis.exceptions.ConnectionError("connection refused"),
        redis.exceptions.ClusterDownError("CLUSTERDOWN The cluster is down"),
        redis.exceptions.TimeoutError("timed out"),
    ],
)
async def test_a_store_that_does_not_answer_is_backend_unavailable_not_internal(fault):
    """A Redis node lost or a failover under way: the client is told to retry (same key)."""
    from runtime.messaging import codec

    async def handler(request):
        raise fault

    out = codec.decode_envelope(await codec.answer(handler, b"{}", msgspec.json.Decoder(base.Internal)))
    assert out.error is not None and out.error.code is errors.ErrorCode.backend_unavailable
