"""The desk's pure parts as tables: what a run costs so far, the rows and curves it shows, the
charts' SVG, the pages' escaping, the token check and the desk's Prometheus gauges."""

import math
import re
from datetime import UTC, datetime, timedelta

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from contracts.api import RunView, Spend
from contracts.desk import DeskRun, InterruptionRecord, StateRecord
from contracts.evals import EvalMetric, StageGate
from contracts.plans import CostEstimate, Plan
from contracts.runs import CheckpointSaved, Metrics
from contracts.states import RunState
from contracts.telemetry import BADPUT, BOOKED_BADPUT, IDLE, Rollup, RunTelemetry
from services.desk import board, charts, gauges, pages
from services.desk.web import authorized, session_value

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def cost(gpus: int = 8, price: float = 3.5, total: float = 10.0) -> CostEstimate:
    return CostEstimate(
        flops=1.0,
        tokens=1,
        parameters=1,
        assumed_mfu=0.4,
        peak_tflops_per_gpu=989.0,
        gpus=gpus,
        gpu_hours=1.0,
        price_per_gpu_hour_usd=price,
        compute_usd=total,
        checkpoint_storage_usd=0.0,
        total_usd=total,
        booked_gpu_hours=192.0,
        incremental_usd=0.0,
    )


def view(state=RunState.running, minutes: float = 30, **fields) -> RunView:
    plan = Plan(
        booking_id="bk",
        manifest_digest="d",
        strategy="fsdp2",
        degrees={"dp_shard": 8},
        precision="bf16",
        cost=cost(),
        checks=[],
        ok=True,
        gpu_model="H200",
        region="eu",
    )
    base = RunView(
        run_id="run_1",
        account="acme",
        booking_id="bk",
        manifest_digest="d",
        idempotency_key="k",
        state=state,
        created_at=T0,
        updated_at=T0 + timedelta(minutes=minutes),
        plan=plan,
        stage="pretrain",
        step=5,
        total_steps=10,
    )
    return msgspec.structs.replace(base, **fields)


def metric(stage: str, step: int, loss: float, at_s: float = 0.0) -> Metrics:
    return Metrics(
        run_id="run_1",
        seq=step,
        at=T0 + timedelta(seconds=at_s or step),
        stage=stage,
        step=step,
        total_steps=10,
        loss=loss,
        learning_rate=1e-3,
        tokens_per_s=100.0,
        grad_norm=1.0,
    )


@pytest.mark.parametrize(
    "state, minutes, now_minutes, expected_usd",
    [
        (RunState.running, 30, 60, 8 * 3.5 * 1.0),  # running: up to now (an hour, 8 GPUs at 3.5)
        (RunState.succeeded, 30, 600, 8 * 3.5 * 0.5),  # ended: up to its last change, whatever now is
        (RunState.queued, 0, 0, 0.0),
        (RunState.running, 0, -5, 0.0),  # a clock behind the run's creation counts nothing, not less
    ],
)
def test_cost_so_far_is_the_gpu_hours_held_at_the_plans_price(state, minutes, now_minutes, expected_usd):
    v = view(state, minutes)
    assert board.cost_so_far(v, T0 + timedelta(minutes=now_minutes)) == pytest.approx(expected_usd)


@pytest.mark.parametrize(
    "state, held_gpu_s, spent_usd",
    [
        (RunState.queued, 0.0, 0.0),  # queued since accepted an hour ago: nothing held, nothing spent
        (RunState.running, 8 * 60.0, 0.4667),  # a minute of 8 GPUs, as metered, whatever the wall clock says
        (RunState.budget_exhausted, 8 * 90.0, 0.7),
    ],
)
def test_cost_so_far_is_what_the_trainer_metered_not_the_time_since_accepted(state, held_gpu_s, spent_usd):
    metered = Spend(held_gpus=8, held_gpu_s=held_gpu_s, spent_usd=spent_usd, limit_usd=1.0, at=T0)
    v = view(state, 60, spend=metered)
    assert board.cost_so_far(v, T0 + timedelta(hours=1)) == spent_usd
    assert board.run_row(v, None, T0 + timedelta(hours=1)).cost_so_far_usd == spent_usd


def test_cost_so_far_of_a_run_without_a_plan_is_zero():
    assert board.cost_so_far(view(plan=None), T0 + timedelta(hours=1)) == 0.0


def telemetry(run_id="run_1", goodput=0.8, gpu_model="H200", gpu_hours=8.0, gpus=8, **fields) -> RunTelemetry:
    base = RunTelemetry(
        run_id=run_id,
        account="acme",
        booking_id="bk",
        region="eu",
        gpu_model=gpu_model,
        gpus=gpus,
        state="succeeded",
        accepted_at=T0,
        ended_at=T0 + timedelta(hours=1),
        wall_s=3600.0,
        goodput_s=goodput * 3600.0,
        badput_s=dict.fromkeys(BADPUT, 0.0),
        goodput=goodput,
        gpu_hours=gpu_hours,
        interruptions=0,
        interruption_causes={},
        checkpoint_saves=0,
    )
    return msgspec.structs.replace(base, **fields)


def test_a_run_row_carries_its_telemetry_and_its_estimate():
    (row,) = board.run_rows([view()], {"run_1": telemetry(goodput=0.75)}, T0 + timedelta(hours=1))
    assert (row.state, row.stage, row.step, row.total_steps, row.goodput) == (
        "running",
        "pretrain",
        5,
        10,
        0.75,
    )
    assert (row.estimate_usd, row.gpu_model, row.gpus) == (10.0, "H200", 8)
    (unaccounted,) = board.run_rows([view()], {}, T0)
    assert unaccounted.goodput is None


@pytest.mark.parametrize(
    "runs, prices, expected",
    [
        ([telemetry(goodput=0.5)], {"H200": 3.5}, 7.0),  # half the hours were useful: twice the price
        ([telemetry(goodput=1.0)], {"H200": 3.5}, 3.5),
        ([telemetry(goodput=0.0)], {"H200": 3.5}, None),  # nothing useful: no price to speak of
        ([telemetry(gpu_model="X1")], {"H200": 3.5}, None),  # no price for the model
        (
            [telemetry(goodput=0.5), telemetry(run_id="r2", goodput=1.0, gpu_model="A100")],
            {"H200": 3.5, "A100": 1.6},
            (8 * 3.5 + 8 * 1.6) / (4 + 8),
        ),
    ],
)
def test_implied_price_per_useful_gpu_hour(runs, prices, expected):
    got = board.implied_price(runs, prices)
    assert got == (None if expected is None else pytest.approx(expected))


def rollup(by="gpu_model", key="H200", goodput=0.8, **fields) -> Rollup:
    base = Rollup(
        by=by,
        key=key,
        runs=1,
        wall_gpu_hours=8.0,
        goodput_gpu_hours=8.0 * goodput,
        goodput=goodput,
        badput_gpu_hours={"queued": 0.8, "checkpoint_stall": 0.8},
        interruptions=2,
        interruptions_per_1000_gpu_hours=250.0,
        interruption_causes={"trainer_lost": 2},
        checkpoint_bytes_per_s_p50=2e9,
        checkpoint_bytes_per_s_min=1e9,
        updated_at=T0,
    )
    return msgspec.structs.replace(base, **fields)


def test_breakdowns_give_every_category_its_share_and_a_price_per_key():
    rows = board.breakdowns(
        {("gpu_model", "H200"): rollup(), ("booking", "bk"): rollup(by="booking", key="bk")},
        {"run_1": telemetry(goodput=0.8)},
        {"H200": 3.5},
    )
    assert [(r.by, r.key) for r in rows] == [("booking", "bk"), ("gpu_model", "H200")]
    for r in rows:
        assert set(r.shares) == set(BOOKED_BADPUT) and r.shares[IDLE] == 0.0  # no booked hours known
        assert r.shares["queued"] == pytest.approx(0.1) and r.shares["eval"] == 0.0
        assert r.goodput + sum(r.shares.values()) == pytest.approx(1.0)
        assert r.implied_usd_per_useful_gpu_hour == pytest.approx(3.5 / 0.8)


def test_stage_losses_follow_the_stages_in_order_with_their_held_out_figures():
    gate = StageGate(
        stage="pretrain",
        passed=True,
        metrics=[
            EvalMetric(name="held_out_loss", value=2.0, threshold=2.5, op="<="),
            EvalMetric(name="task_accuracy", value=0.4),  # not a loss: not on the loss axis
            EvalMetric(name="held_out_loss", value=math.nan),  # not finite: not drawn
        ],
    )
    detail = board.RunDetail(view=view(gates=[gate, StageGate(stage="sft", passed=False, metrics=[])]))
    detail.metrics = [metric("pretrain", 1, 3.0), metric("pretrain", 2, 2.5), metric("midtrain", 1, 2.4)]
    got = board.stage_losses(detail)
    assert [(s.stage, s.points, s.held_out) for s in got] == [
        ("pretrain", [(1, 3.0), (2, 2.5)], [("held_out_loss", 2.0, 2.5)]),
        ("midtrain", [(1, 2.4)], []),
        ("sft", [], []),  # gated before any step reached the desk: still a row
    ]


def page(run_view: RunView, metrics=(), next_: int = 0, audit=None, **fields) -> DeskRun:
    return DeskRun(
        view=run_view,
        metrics=list(metrics),
        metrics_next=next_,
        checkpoints=[],
        states=[],
        interruptions=[],
        logs=[],
        logs_next=0,
        audit=audit,
        **fields,
    )


def test_a_run_detail_appends_new_pages_and_reads_the_audit_again_when_the_state_moves():
    detail = board.RunDetail(view=view())
    assert detail.audit_due()
    detail.merge(page(view(), [metric("pretrain", 1, 3.0)], 1, audit=[]))
    assert not detail.audit_due() and detail.metrics_next == 1
    detail.merge(page(view(step=2), [metric("pretrain", 2, 2.9)], 2))
    assert [m.step for m in detail.metrics] == [1, 2] and detail.view.step == 2 and detail.audit == []
    detail.merge(page(view(RunState.succeeded), [], 2))
    assert detail.audit_due()


def test_the_loss_chart_has_a_point_per_finite_step_and_marks_the_held_out_loss():
    s = board.StageLoss(
        stage="pre<train>",
        points=[(1, 3.0), (2, math.nan), (3, 2.0), (4, 1.5)],
        held_out=[("held_out_loss", 1.8, 2.0)],
    )
    svg = charts.loss_chart(s)
    line = re.search(r'<polyline class="train-loss" data-points="(\d+)" points="([^"]*)"', svg)
    assert line is not None and line.group(1) == "3" and len(line.group(2).split()) == 3
    assert svg.count('class="held-out"') == 1 and svg.count('class="threshold"') == 1
    assert "pre<train>" not in svg and "pre&lt;train&gt;" in svg
    assert "nan" not in svg.lower().replace("nanos", "")
    assert "no steps yet" in charts.loss_chart(board.StageLoss(stage="sft", points=[], held_out=[]))


def test_a_single_step_or_a_flat_loss_still_draws_inside_the_box():
    for points in ([(1, 2.0)], [(1, 2.0), (2, 2.0), (3, 2.0)]):
        svg = charts.loss_chart(board.StageLoss(stage="s", points=points, held_out=[]))
        coords = re.search(r' points="([^"]*)"', svg)
        assert coords is not None
        for pair in coords.group(1).split():
            x, y = (float(v) for v in pair.split(","))
            assert 0 <= x <= charts.W and 0 <= y <= charts.H


def test_the_timeline_shows_states_checkpoints_interruptions_and_recoveries():
    detail = board.RunDetail(view=view(RunState.succeeded, minutes=10))
    detail.states = [
        StateRecord(state=RunState.running, at=T0 + timedelta(minutes=1)),
        StateRecord(state=RunState.interrupted, at=T0 + timedelta(minutes=4)),
        StateRecord(state=RunState.running, at=T0 + timedelta(minutes=5)),
        StateRecord(state=RunState.succeeded, at=T0 + timedelta(minutes=10)),
    ]
    detail.interruptions = [
        InterruptionRecord(
            detected_at=(T0 + timedelta(minutes=4)).timestamp(), silent_s=12.0, cause="trainer_lost"
        )
    ]
    detail.checkpoints = [
        CheckpointSaved(
            run_id="run_1",
            seq=1,
            at=T0 + timedelta(minutes=3),
            step=100,
            path="/x",
            bytes=5_000_000,
            stall_s=0.02,
            save_s=0.1,
        )
    ]
    detail.metrics = [metric("pretrain", i, 2.0, at_s=60 + i) for i in range(1, 4)]
    svg = charts.timeline(detail, T0 + timedelta(hours=5))  # ended: the axis ends at its end, not now
    assert svg.count('class="state s-') == 5  # queued, running, interrupted, running, succeeded
    assert svg.count('class="interruption"') == 1 and svg.count('class="recovery"') == 1
    assert svg.count('class="checkpoint"') == 1 and "5.0 MB" in svg
    assert "600 s" in svg


def test_the_stacked_bar_spans_exactly_what_was_accounted():
    svg = charts.stacked_bar(0.5, {"queued": 0.25, "eval": 0.25, "other": math.nan})
    widths = [float(w) for w in re.findall(r'width="([\d.]+)"', svg)]
    assert sum(widths) == pytest.approx(charts.BAR_W)
    assert "seg-other" not in svg  # a NaN share is drawn as nothing


HOSTILE = '<script>alert("x")</script>'


def test_pages_escape_what_comes_from_outside_and_give_each_stage_its_gate_rows():
    gate = StageGate(
        stage=HOSTILE, passed=False, metrics=[EvalMetric(name=HOSTILE, value=1.0, threshold=0.5, op="<=")]
    )
    detail = board.RunDetail(
        view=view(
            account=HOSTILE,
            booking_id=HOSTILE,
            message=HOSTILE,
            gates=[gate, StageGate(stage="sft", passed=True, metrics=[])],
        )
    )
    sections = pages.run_sections(detail, T0 + timedelta(hours=1), 0.5)
    html = "".join(sections.values())
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert len(re.findall(r'<tbody class="gate" data-stage=', sections["gates"])) == 2
    assert 'data-verdict="failed"' in sections["gates"] and 'data-verdict="passed"' in sections["gates"]
    rows = pages.runs_sections(board.run_rows([view(account=HOSTILE)], {}, T0))["runs"]
    assert "<script>" not in rows
    assert set(sections) == set(pages.RUN_ORDER)


@pytest.mark.parametrize(
    "headers, cookies, ok",
    [
        ({"authorization": "Bearer tok-123"}, {}, True),
        ({}, {"ito_desk_session": session_value("tok-123")}, True),
        ({}, {}, False),
        ({"authorization": "Bearer tok-12"}, {}, False),
        ({"authorization": "tok-123"}, {}, False),  # not a bearer header
        ({}, {"ito_desk_session": "tok-123"}, False),  # the token is not a session cookie
        ({}, {"ito_desk_session": session_value("other")}, False),
        ({}, {"ito_desk_session": ""}, False),
    ],
)
def test_only_the_operator_token_or_its_session_is_let_in(headers, cookies, ok):
    assert authorized(headers, cookies, "tok-123") is ok


def test_the_session_cookie_is_not_the_token():
    assert "tok-123" not in session_value("tok-123") and session_value("a") != session_value("b")


class FakeSource:
    """What the gauges read of a DeskSource: its run list and rollups."""

    def __init__(self, views: list[RunView], rollups: dict) -> None:
        self.runs = type("Runs", (), {"runs": views})()
        self.rollups = rollups


def test_the_desk_gauges_parse_with_the_clients_own_parser():
    views = [view(), view(RunState.succeeded, run_id="run_2")]
    rollups = {("gpu_model", "H200"): rollup(), ("region", "eu"): rollup(by="region", key="eu")}
    body, content_type = gauges.exposition(FakeSource(views, rollups))
    assert content_type.startswith("text/plain")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }
    assert samples[("ito_desk_runs", (("state", "running"),))] == 1
    assert samples[("ito_desk_runs", (("state", "succeeded"),))] == 1
    assert samples[("ito_desk_runs", (("state", "failed"),))] == 0
    assert samples[("ito_desk_goodput_ratio", (("gpu_model", "H200"),))] == pytest.approx(0.8)
    assert samples[("ito_desk_interruptions_per_1000_gpu_hours", (("gpu_model", "H200"),))] == 250.0
    assert samples[("ito_desk_interruptions", (("cause", "trainer_lost"), ("gpu_model", "H200")))] == 2
    assert samples[("ito_desk_checkpoint_bandwidth_p50_bytes_per_second", (("gpu_model", "H200"),))] == 2e9
    assert samples[("ito_desk_gpu_hours", (("gpu_model", "H200"), ("kind", "goodput")))] == pytest.approx(6.4)
    assert not any(dict(labels).get("gpu_model") == "eu" for _, labels in samples)  # regions are not models
