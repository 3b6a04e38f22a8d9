"""Export, download and sample through the scheduler's API and a trainer's endpoints in one process
(the in-memory adapters of tests/scheduler/test_handlers_inmemory.py, the trainer's three routes on
the same router, its orders signed by the scheduler): tenant-scoped (another account's run is
`run_not_found`), no confirmation, an export asked twice is one job, a download reads only a ready
export's listed files, a sample answers text."""

import asyncio
import json
import pathlib

import msgspec
import pytest
from faststream.nats import TestNatsBroker

from contracts import endpoints, subjects
from contracts.errors import ErrorCode
from contracts.exports import (
    DownloadChunk,
    DownloadRequest,
    ExportFormat,
    ExportRequest,
    ExportView,
    SampleRequest,
    SampleResult,
)
from contracts.manifest import Manifest
from runtime.configuration import settings as settings_mod
from runtime.configuration.keys import Keys
from runtime.messaging import connections
from runtime.messaging.bus import LocalBus
from runtime.messaging.service import Wiring, scheduler_verifier
from runtime.security.identities import NATS_IDENTITIES
from runtime.security.secrets import Secrets
from services.trainer import exports
from services.trainer.trainer_settings import TrainerSettings
from services.trainer.worker import Worker
from tests.scheduler.test_handlers_inmemory import (
    REPO_MANIFEST,
    Bus,
    call,
    code,
    confirmed_run,
    data,
    login,
    register_all,
)
from tests.trainer.test_exports import commit_checkpoint, fake_writer


@pytest.fixture
async def stack(namespace, tmp_path, monkeypatch):
    """Every service's handlers in memory, and a trainer's export/download/sample endpoints."""
    monkeypatch.setenv(settings_mod.ENV_ENTITLEMENT_KEY, "in-memory-test-key")
    s = settings_mod.load({"ITO_NAMESPACE": namespace, "ITO_DATA_DIR": str(tmp_path)})
    Secrets(s.secrets_dir).ensure(NATS_IDENTITIES, ())
    broker = connections.make_broker(s, "scheduler")
    w = Wiring(settings=s, broker=broker, redis=None, keys=Keys(s))
    w.bus = LocalBus(w.router, broker)
    credentials, bookings, quotas = register_all(w, None)
    worker = Worker(w.bus, s, TrainerSettings(threads=1))
    calls: list[str] = []
    worker.exports.writers = exports.Writers(hf=fake_writer(calls), tokenizer_files=lambda src, d: {})
    verifier = scheduler_verifier(s)
    for endpoint, handler in (
        (endpoints.TRAINER_EXPORT, worker.export),
        (endpoints.TRAINER_DOWNLOAD, worker.download),
        (endpoints.TRAINER_SAMPLE, worker.sample),
    ):
        w.router.serve(endpoint, handler, verifier)
    async with TestNatsBroker(broker) as br:
        yield Bus(br, w, credentials, bookings, [], quotas), worker, calls, tmp_path


async def trained_run(bus: Bus, data_dir: pathlib.Path) -> str:
    """A run (accepted, handed off) whose pretrain stage has a committed checkpoint at step 8."""
    await login(bus)
    _, run = await confirmed_run(bus, "b1", "k1")
    manifest = msgspec.json.decode(REPO_MANIFEST.read_bytes(), type=Manifest)
    commit_checkpoint(data_dir / "checkpoints" / "acme" / run.run_id / "pretrain", manifest, 8)
    return run.run_id


async def ready(bus: Bus, req: ExportRequest) -> ExportView:
    for _ in range(400):
        view = data(await call(bus, subjects.API_EXPORT, req), ExportView)
        if view.state != "pending":
            return view
        await asyncio.sleep(0.05)
    raise AssertionError("the export did not become ready")


async def test_export_download_sample_of_the_callers_run(stack):
    bus, worker, calls, data_dir = stack
    run_id = await trained_run(bus, data_dir)
    req = ExportRequest(run_id=run_id)
    first = data(await call(bus, subjects.API_EXPORT, req), ExportView)
    assert (first.state, first.export_id, first.stage, first.step) == (
        "pending",
        "pretrain-hf",
        "pretrain",
        8,
    )
    view = await ready(bus, req)
    assert view.state == "ready" and len(calls) == 1  # asked again and again: one job
    assert view.digest.startswith("sha256:") and view.files
    card = (data_dir / "checkpoints" / "acme" / run_id / "exports" / "pretrain-hf" / "README.md").read_text()
    assert card == f"run {run_id} stage pretrain step 8\n"

    entry = next(f for f in view.files if f.path == "README.md")
    dl = DownloadRequest(run_id=run_id, export_id="pretrain-hf", path="README.md")
    chunk = data(await call(bus, subjects.API_DOWNLOAD, dl), DownloadChunk)
    assert chunk.data == card.encode() and (chunk.size, chunk.sha256) == (entry.bytes, entry.sha256)
    for path in ("EXPORT.json", "../pretrain/step-00000008/.metadata"):
        out = await call(bus, subjects.API_DOWNLOAD, msgspec.structs.replace(dl, path=path))
        assert code(out) is ErrorCode.export_not_found
    nothing = msgspec.structs.replace(dl, export_id="pretrain-peft")
    assert code(await call(bus, subjects.API_DOWNLOAD, nothing)) is ErrorCode.export_not_found

    sample = data(
        await call(bus, subjects.API_SAMPLE, SampleRequest(run_id=run_id, prompt="12+35=", max_new_tokens=4)),
        SampleResult,
    )
    assert (sample.run_id, sample.stage, sample.step) == (run_id, "pretrain", 8) and sample.tokens <= 4
    assert isinstance(sample.text, str) and worker.sampler.loads == 1


async def test_another_accounts_run_is_not_found_and_nothing_is_started(stack):
    bus, _, calls, data_dir = stack
    run_id = await trained_run(bus, data_dir)
    await login(bus, "other")
    for suffix, req in (
        (subjects.API_EXPORT, ExportRequest(run_id=run_id)),
        (subjects.API_DOWNLOAD, DownloadRequest(run_id=run_id, export_id="pretrain-hf", path="README.md")),
        (subjects.API_SAMPLE, SampleRequest(run_id=run_id, prompt="x")),
    ):
        assert code(await call(bus, suffix, req, account="other")) is ErrorCode.run_not_found
    assert calls == []
    assert not (data_dir / "checkpoints" / "acme" / run_id / "exports").exists()


async def test_no_checkpoint_no_lora_or_unknown_stage_is_export_not_found(stack):
    bus, _, calls, data_dir = stack
    await login(bus)
    _, run = await confirmed_run(bus, "b2", "k2")
    assert (
        code(await call(bus, subjects.API_EXPORT, ExportRequest(run_id=run.run_id)))
        is ErrorCode.export_not_found
    )
    manifest = msgspec.json.decode(REPO_MANIFEST.read_bytes(), type=Manifest)
    commit_checkpoint(data_dir / "checkpoints" / "acme" / run.run_id / "pretrain", manifest, 8)
    for req, words in (
        (ExportRequest(run_id=run.run_id, format=ExportFormat.peft), "trained no LoRA adapter"),
        (ExportRequest(run_id=run.run_id, stage="sft"), "no stage 'sft'"),
    ):
        out = await call(bus, subjects.API_EXPORT, req)
        assert code(out) is ErrorCode.export_not_found and words in out.error.message
    assert calls == []


async def test_an_unsigned_order_reaches_no_trainer(stack):
    bus, _, calls, data_dir = stack
    run_id = await trained_run(bus, data_dir)
    order = json.dumps(
        {"account": "acme", "run_id": run_id, "stage": None, "format": "hf", "manifest_digest": "x"}
    ).encode()
    subject = bus.w.settings.subject(endpoints.TRAINER_EXPORT.subject)
    out = await bus.w.bus.request(subject, order, None, timeout=5)
    assert b"forbidden" in out and calls == []
