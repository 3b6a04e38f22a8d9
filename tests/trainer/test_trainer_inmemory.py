"""The trainer's handler on an in-memory broker: a work item in, real training, run events out."""

import pathlib

import msgspec
import pytest
from faststream.nats import NatsMessage, TestNatsBroker

from contracts import endpoints, subjects
from contracts.api import LeaseAnswer, LeaseQuery
from contracts.manifest import Manifest
from contracts.plans import CostEstimate, Plan
from contracts.runs import RunEvent, StateChanged, TrainWork
from contracts.states import RunState
from runtime.configuration import settings as settings_mod
from runtime.configuration.keys import Keys
from runtime.messaging import connections, streams
from runtime.messaging.bus import LocalBus
from runtime.messaging.service import Wiring
from runtime.security.identities import NATS_IDENTITIES
from runtime.security.order_signatures import Signer
from runtime.security.secrets import Secrets
from services.trainer import app as trainer_app

REPO = pathlib.Path(__file__).resolve().parents[2]


def small_manifest_text() -> str:
    raw = msgspec.json.decode((REPO / "examples" / "manifests" / "tiny.json").read_bytes())
    raw["target"] = {"tokens": 12 * 4 * 32, "seq_len": 32, "batch_size": 4, "learning_rate": 0.003}
    return msgspec.json.encode(raw).decode()


def plan(checkpoint_bytes: int = 0) -> Plan:
    cost = CostEstimate(
        flops=1.0,
        tokens=1,
        parameters=1,
        assumed_mfu=0.4,
        peak_tflops_per_gpu=1.0,
        gpus=1,
        gpu_hours=0.0,
        price_per_gpu_hour_usd=1.0,
        compute_usd=0.0,
        checkpoint_storage_usd=0.0,
        total_usd=0.0,
        booked_gpu_hours=1.0,
        incremental_usd=0.0,
    )
    return Plan(
        booking_id="b",
        manifest_digest="d",
        strategy="single",
        degrees={"dp_replicate": 1},
        precision="bf16",
        cost=cost,
        checks=[],
        ok=True,
        checkpoint_bytes=checkpoint_bytes,
    )


def trainer_wiring(s: settings_mod.Settings, broker) -> Wiring:
    """The trainer's handlers on an in-memory broker; its requests (the lease) go straight to the
    routes a test serves on the same router, its stream publishes to the in-memory broker."""
    w = Wiring(settings=s, broker=broker, redis=None, keys=Keys(s), service="trainer")
    w.bus = LocalBus(w.router, broker)
    trainer_app.register(w)
    return w


@pytest.mark.parametrize(
    "body, final",
    [
        ("valid", "succeeded"),
        ("garbage", None),
        ("unsigned", None),
        ("no room", "failed"),
        ("other curriculum", "failed"),
    ],
)
async def test_trainer_handler(namespace, tmp_path, monkeypatch, body, final):
    monkeypatch.setenv("ITO_TRAINER_THREADS", "1")
    # issue 29: the trainer planned a run's stages up to three times (a gang's or a node share's
    # refusal check and restart in the agent, the pipeline again); the agent plans once and passes
    # the plan down (here the one-process path: one plan, the agent's)
    from domain import curriculum
    from training.recipes import pipeline as pipeline_mod

    planned: list[object] = []
    plan_of = curriculum.curriculum_of

    def counted(manifest, base=None):
        planned.append(manifest)
        return plan_of(manifest, base)

    monkeypatch.setattr(curriculum, "curriculum_of", counted)  # the agent's, through bound_curriculum
    monkeypatch.setattr(pipeline_mod, "curriculum_of", counted)
    s = settings_mod.load({"ITO_NAMESPACE": namespace, "ITO_DATA_DIR": str(tmp_path)})
    Secrets(s.secrets_dir).ensure(NATS_IDENTITIES, ())
    broker = connections.make_broker(s, "trainer")
    w = trainer_wiring(s, broker)
    events: list[RunEvent] = []
    decoder = msgspec.json.Decoder(RunEvent)

    current = [RunState.queued]  # the scheduler's view, as the events it applied make it

    async def lease(_query: LeaseQuery) -> LeaseAnswer:  # the scheduler's part: this run may train
        return LeaseAnswer(
            run_id="run_t",
            proceed=current[0] in (RunState.queued, RunState.running),
            state=current[0],
            epoch=1,
        )

    w.router.serve(endpoints.RUN_LEASE, lease)

    @broker.subscriber(s.subject(subjects.RUN_EVENTS) + ".>", stream=streams.ref(s, subjects.STREAM_RUNS))
    async def collect(msg: NatsMessage) -> None:
        event = decoder.decode(msg.body)
        events.append(event)
        if isinstance(event, StateChanged):
            current[0] = event.state

    work = TrainWork(
        run_id="run_t",
        account="acme",
        booking_id="b",
        manifest_text=small_manifest_text(),
        manifest_digest="d",
        # issue 29: the storage is checked where checkpoints are written: a plan asking more room
        # than the trainer's disk has fails the run before its first step
        plan=plan(checkpoint_bytes=2**62 if body == "no room" else 0),
        checkpoint_dir=str(tmp_path / "ckpt"),
        # issue 29: the scheduler signs the digest of the curriculum it priced; a trainer that plans
        # the stages otherwise (another version) trains nothing
        curriculum_digest="0" * 64
        if body == "other curriculum"
        else curriculum.curriculum_digest(
            curriculum.curriculum_of(msgspec.json.decode(small_manifest_text(), type=Manifest))
        ),
    )
    planned.clear()
    payload = b"{not a work item" if body == "garbage" else msgspec.json.encode(work)
    subject = s.subject(f"{subjects.WORK_TRAIN}.run_t")
    signed = (
        {} if body == "unsigned" else Signer(Secrets(s.secrets_dir).signing_key()).headers(subject, payload)
    )
    async with TestNatsBroker(broker) as br:
        # in memory, publish runs the trainer's handler to its end (the whole run) before returning
        await br.publish(payload, subject, stream=s.stream(subjects.STREAM_WORK), headers=signed)
    states = [e.state.value for e in events if isinstance(e, StateChanged)]
    if final is None:
        assert states == []  # a malformed item is terminated, never trained
        return
    if body == "no room":
        (failed,) = [e for e in events if isinstance(e, StateChanged)]
        assert failed.message is not None and "checkpoint_storage_unavailable" in failed.message
        assert "GB free" in failed.message and not [e for e in events if type(e).__name__ == "Metrics"]
        return
    if body == "other curriculum":
        (failed,) = [e for e in events if isinstance(e, StateChanged)]
        assert failed.message is not None and "otherwise than the scheduler priced them" in failed.message
        assert not [e for e in events if type(e).__name__ == "Metrics"]
        return
    assert states == ["running", final]
    assert len(planned) == 1
    metrics = [e for e in events if type(e).__name__ == "Metrics"]
    assert [m.step for m in metrics] == list(range(1, 13))
    assert any(type(e).__name__ == "CheckpointSaved" for e in events)
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


async def test_a_refused_final_transition_is_never_acknowledged(namespace, tmp_path, monkeypatch):
    """The trainer acks its work item only once the scheduler shows the state it reported; here the
    scheduler never applies it (say, the transition was refused), so the item is given back."""
    from faststream.nats.message import NatsMessage as Message
    from faststream.nats.testing import PatchedMessage as Msg  # what the in-memory broker delivers

    from services.trainer import worker as worker_mod

    monkeypatch.setenv("ITO_TRAINER_THREADS", "1")
    monkeypatch.setattr(worker_mod, "FINAL_STATE_WAIT_S", 1.0)
    outcome: list[str] = []

    async def acked(self, *args, **kwargs):
        if ".v1.work." in self.raw_message.subject:
            outcome.append("ack")

    async def naked(self, *args, **kwargs):
        if ".v1.work." in self.subject:
            outcome.append("nak")

    monkeypatch.setattr(Message, "ack", acked)
    monkeypatch.setattr(Msg, "nak", naked)
    s = settings_mod.load({"ITO_NAMESPACE": namespace, "ITO_DATA_DIR": str(tmp_path)})
    Secrets(s.secrets_dir).ensure(NATS_IDENTITIES, ())
    broker = connections.make_broker(s, "trainer")
    w = trainer_wiring(s, broker)

    async def lease(_query: LeaseQuery) -> LeaseAnswer:  # a scheduler whose view stays `running`
        return LeaseAnswer(run_id="run_r", proceed=True, state=RunState.running, epoch=1)

    w.router.serve(endpoints.RUN_LEASE, lease)

    @broker.subscriber(s.subject(subjects.RUN_EVENTS) + ".>", stream=streams.ref(s, subjects.STREAM_RUNS))
    async def ignore(msg: NatsMessage) -> None:
        pass

    work = TrainWork(
        run_id="run_r",
        account="acme",
        booking_id="b",
        manifest_text=small_manifest_text(),
        manifest_digest="d",
        plan=plan(),
        checkpoint_dir="/ignored",
    )
    payload = msgspec.json.encode(work)
    subject = s.subject(f"{subjects.WORK_TRAIN}.run_r")
    async with TestNatsBroker(broker) as br:
        await br.publish(
            payload,
            subject,
            stream=s.stream(subjects.STREAM_WORK),
            headers=Signer(Secrets(s.secrets_dir).signing_key()).headers(subject, payload),
        )
    assert outcome == ["nak"]
    # the checkpoint directory came from the trainer's own root, not from the message
    assert (tmp_path / "checkpoints" / "acme" / "run_r").is_dir() and not pathlib.Path("/ignored").exists()
