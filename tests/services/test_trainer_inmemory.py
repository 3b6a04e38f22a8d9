"""The trainer's handler on an in-memory broker: a work item in, real training, run events out."""

import pathlib

import msgspec
import pytest
from faststream.nats import NatsMessage, TestNatsBroker

from contracts import subjects
from contracts.api import CostEstimate, LeaseAnswer, Plan
from contracts.states import RunState
from contracts.runs import RunEvent, StateChanged, TrainWork
from services.runtime import codec, connections, streams
from services.runtime import settings as settings_mod
from services.runtime.keys import Keys
from services.runtime.service import Wiring
from services.trainer import app as trainer_app

REPO = pathlib.Path(__file__).resolve().parents[2]


def small_manifest_text() -> str:
    raw = msgspec.json.decode((REPO / "examples" / "manifests" / "tiny.json").read_bytes())
    raw["target"] = {"tokens": 12 * 4 * 32, "seq_len": 32, "batch_size": 4, "learning_rate": 0.003}
    return msgspec.json.encode(raw).decode()


def plan() -> Plan:
    cost = CostEstimate(flops=1.0, tokens=1, parameters=1, assumed_mfu=0.4, peak_tflops_per_gpu=1.0, gpus=1,
                        gpu_hours=0.0, price_per_gpu_hour_usd=1.0, compute_usd=0.0, checkpoint_storage_usd=0.0,
                        total_usd=0.0, booked_gpu_hours=1.0, incremental_usd=0.0)
    return Plan(booking_id="b", manifest_digest="d", strategy="single", degrees={"dp_replicate": 1}, precision="bf16",
                cost=cost, checks=[], ok=True)


@pytest.mark.parametrize("body, final", [("valid", "succeeded"), ("garbage", None)])
async def test_trainer_handler(infra_urls, namespace, tmp_path, monkeypatch, body, final):
    monkeypatch.setenv("ITO_TRAINER_THREADS", "1")
    s = settings_mod.load({"ITO_NAMESPACE": namespace, "ITO_DATA_DIR": str(tmp_path),
                           "ITO_NATS_URL": infra_urls[0], "ITO_REDIS_URL": infra_urls[1]})
    broker = connections.make_broker(s, "test")
    w = Wiring(settings=s, broker=broker, redis=connections.make_redis(s), keys=Keys(s))
    trainer_app.register(w)
    events: list[RunEvent] = []
    decoder = msgspec.json.Decoder(RunEvent)

    @broker.subscriber(s.subject(subjects.RUN_LEASE))  # the scheduler's part: this run may train
    async def lease(msg: NatsMessage) -> bytes:
        return codec.ok(LeaseAnswer(run_id="run_t", proceed=True, state=RunState.queued))

    @broker.subscriber(s.subject(subjects.RUN_EVENTS) + ".>", stream=streams.ref(s, subjects.STREAM_RUNS))
    async def collect(msg: NatsMessage) -> None:
        events.append(decoder.decode(msg.body))

    work = TrainWork(run_id="run_t", account="acme", booking_id="b", manifest_text=small_manifest_text(),
                     manifest_digest="d", plan=plan(), checkpoint_dir=str(tmp_path / "ckpt"))
    payload = msgspec.json.encode(work) if body == "valid" else b"{not a work item"
    async with TestNatsBroker(broker) as br:
        # in memory, publish runs the trainer's handler to its end (the whole run) before returning
        await br.publish(payload, s.subject(f"{subjects.WORK_TRAIN}.run_t"), stream=s.stream(subjects.STREAM_WORK))
    await w.redis.aclose()
    states = [e.state.value for e in events if isinstance(e, StateChanged)]
    if final is None:
        assert states == []  # a malformed item is terminated, never trained
        return
    assert states == ["running", final]
    metrics = [e for e in events if type(e).__name__ == "Metrics"]
    assert [m.step for m in metrics] == list(range(1, 13))
    assert any(type(e).__name__ == "CheckpointSaved" for e in events)
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
