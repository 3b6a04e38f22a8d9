"""The desk's reads on the scheduler (in memory), the router's rule that only the desk's inbox
hears them, and telemetry's live snapshots for the desk: handler logic, no broker."""

from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from contracts.api import LogLineView, RunView
from contracts.audit import GateDecision
from contracts.desk import DeskRunRequest, DeskRunsRequest
from contracts.endpoints import DESK
from contracts.errors import ErrorCode
from contracts.runs import Metrics, RunCreated, StateChanged
from contracts.states import RunState
from runtime.configuration.settings import load
from runtime.messaging.bus import Router
from runtime.messaging.codec import Refusal
from services.scheduler.desk_reads import DeskReads
from services.scheduler.memory import InMemoryRuns
from services.scheduler.prices import load_prices
from services.telemetry.handlers import LIVE_EVERY_S, TelemetryHandlers
from services.telemetry.store import InMemoryTelemetry

T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


class Auditor:
    def __init__(self) -> None:
        self.reads = 0

    async def read(self, request_id: str) -> list[GateDecision]:
        self.reads += 1
        return []


def new_view(account: str, run_id: str, minutes: int) -> RunView:
    return RunView(
        run_id=run_id,
        account=account,
        booking_id="bk",
        manifest_digest="d",
        idempotency_key="k",
        state=RunState.queued,
        created_at=T0 + timedelta(minutes=minutes),
        updated_at=T0 + timedelta(minutes=minutes),
    )


def metric(step: int) -> Metrics:
    return Metrics(
        run_id="run_a",
        seq=step,
        at=T0,
        stage="pretrain",
        step=step,
        total_steps=10,
        loss=2.0,
        learning_rate=1e-3,
        tokens_per_s=1.0,
        grad_norm=1.0,
    )


async def reads() -> tuple[DeskReads, InMemoryRuns, Auditor]:
    runs, auditor = InMemoryRuns(), Auditor()
    for i, (account, run_id) in enumerate([("acme", "run_a"), ("other", "run_b"), ("acme", "run_c")]):
        await runs.create(new_view(account, run_id, i))
    return DeskReads(runs, auditor, load_prices()), runs, auditor


async def test_the_desk_lists_every_accounts_runs_newest_first_with_the_prices():
    desk, _, _ = await reads()
    answer = await desk.runs(DeskRunsRequest())
    assert [v.run_id for v in answer.runs] == ["run_c", "run_b", "run_a"]  # both accounts
    assert answer.prices["H200"] == 3.5
    assert [v.run_id for v in (await desk.runs(DeskRunsRequest(limit=0))).runs] == ["run_c"]  # at least one


async def test_a_runs_detail_is_paged_and_the_audit_comes_only_when_asked():
    desk, runs, auditor = await reads()
    for step in range(1, 6):
        await runs.append_metrics("acme", "run_a", metric(step))
    await runs.append_log("acme", "run_a", LogLineView(index=0, at=T0, level="info", message="hello"))
    await runs.move("acme", "run_a", RunState.running, at=T0 + timedelta(minutes=5))
    await runs.record_interruption(
        "acme",
        "run_a",
        {"detected_at": 1.0, "silent_s": 9.5, "cause": "trainer_lost", "step": 3, "stage": "pretrain"},
    )
    first = await desk.run(DeskRunRequest(run_id="run_a", metrics_limit=3))
    assert [m.step for m in first.metrics] == [1, 2, 3] and first.metrics_next == 3
    assert first.audit is None and auditor.reads == 0
    assert [(s.state, s.at) for s in first.states] == [(RunState.running, T0 + timedelta(minutes=5))]
    assert first.interruptions[0].cause == "trainer_lost" and first.interruptions[0].silent_s == 9.5
    assert [ln.message for ln in first.logs] == ["hello"] and first.logs_next == 1
    rest = await desk.run(DeskRunRequest(run_id="run_a", metrics_since=3, logs_since=1, audit=True))
    assert [m.step for m in rest.metrics] == [4, 5] and rest.logs == [] and rest.audit == []
    assert auditor.reads == 1


async def test_an_unknown_run_is_run_not_found():
    desk, _, _ = await reads()
    with pytest.raises(Refusal) as refused:
        await desk.run(DeskRunRequest(run_id="run_nope"))
    assert refused.value.code is ErrorCode.run_not_found


@pytest.mark.parametrize(
    "reply, answered",
    [
        ("_INBOX_svc_desk.abc", True),
        ("_INBOX_svc_desk_evil.abc", False),  # a prefix of the name is not the inbox
        ("ito.desk.live.x", False),  # a subject others hear
        ("_INBOX_t_acme.abc", False),
        ("", False),  # no reply: nothing is answered (and nothing is read)
    ],
)
async def test_desk_reads_answer_only_into_the_desks_own_inbox(reply, answered):
    desk, _, _ = await reads()
    router = Router("ito")
    router.serve(DESK["runs"], desk.runs, reply_prefix="_INBOX_svc_desk.")
    answer = await router.handle("ito.v1.desk.runs", b"{}", reply)
    assert (answer is not None) is answered
    if answered:
        assert msgspec.json.decode(answer)["ok"] is True


class Broker:
    """The Bus the telemetry handlers publish with: every publish is recorded."""

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.published.append((subject, body))

    async def publish_once(self, subject, stream, body, msg_id, timeout, headers=None) -> None:
        self.published.append((subject, body))


def base(seq: int, at_s: float) -> dict:
    return {"run_id": "run_a", "seq": seq, "at": T0 + timedelta(seconds=at_s)}


async def test_telemetry_publishes_live_goodput_at_moves_and_at_most_every_few_seconds(monkeypatch):
    broker, store = Broker(), InMemoryTelemetry()
    h = TelemetryHandlers(store, broker, load({"ITO_NAMESPACE": "tlive"}))  # type: ignore[arg-type]
    clock = [100.0]
    monkeypatch.setattr("services.telemetry.handlers.time.monotonic", lambda: clock[0])
    created = RunCreated(
        **base(0, 0), account="acme", booking_id="bk", region="eu", gpu_model="H200", gpus=8, accepted_at=T0
    )
    await h.on_event(created)  # the first event of a run: a snapshot at once
    await h.on_event(StateChanged(**base(1, 1), state=RunState.running))  # a move: at once
    m = msgspec.structs.replace(metric(1), **base(2, 2))
    await h.on_event(m)  # a step within the interval: not yet
    clock[0] += LIVE_EVERY_S
    await h.on_event(msgspec.structs.replace(m, seq=3, step=2))  # the interval passed
    subjects_seen = [s for s, _ in broker.published]
    assert subjects_seen == ["tlive.desk.live.run_a"] * 3
    last = msgspec.json.decode(broker.published[-1][1])
    assert last["state"] == "running" and last["gpus"] == 8 and 0.0 <= last["goodput"] <= 1.0
    await h.on_event(StateChanged(**base(4, 3), state=RunState.succeeded))  # the end: the stream has it
    assert not any(s.startswith("tlive.desk.live") for s, _ in broker.published[3:])
