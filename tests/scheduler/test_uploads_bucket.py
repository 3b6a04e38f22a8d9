"""Uploads where the tenant store is an S3-compatible bucket (`ITO_FILE_STORE_URL=s3://...`), through
the scheduler's handlers in memory against moto's server: the API hands out one presigned PUT per
file instead of taking parts, the client (`ecc`'s own `put_file`) sends the file there, the commit
checks what the bucket holds and keeps it as a file, and the trainer reads that file back from the
bucket at its digest."""

import hashlib
import json
import pathlib

import pytest
from faststream.nats import TestNatsBroker

from contracts import subjects
from contracts.files import (
    DataInput,
    InputKind,
    UploadCommitRequest,
    UploadFile,
    UploadRequest,
    UploadSession,
    UploadView,
)
from contracts.manifest import DataFormat
from ecc.upload import Local, put_file
from runtime.configuration import settings as settings_mod
from runtime.configuration.keys import Keys
from runtime.messaging import connections
from runtime.messaging.bus import LocalBus
from runtime.messaging.service import Wiring
from runtime.security.identities import NATS_IDENTITIES
from runtime.security.secrets import Secrets
from runtime.storage import s3_objects
from services.trainer.inputs import Reader
from tests.scheduler.test_handlers_inmemory import Bus, call, data, login, register_all
from tests.support import moto_s3

ROWS = b"".join(json.dumps({"text": f"row {i} of the bucket's corpus"}).encode() + b"\n" for i in range(30))


@pytest.fixture(scope="module")
def moto_url():
    with moto_s3() as url:
        yield url


@pytest.fixture
async def bucket_bus(moto_url, namespace, tmp_path, monkeypatch):
    for name, value in {
        settings_mod.ENV_ENTITLEMENT_KEY: "in-memory-test-key",
        "ITO_S3_ENDPOINT_URL": moto_url,
        "AWS_ACCESS_KEY_ID": "backend",  # the backend's own credential for its store (a real one: a 0600 file)
        "AWS_SECRET_ACCESS_KEY": "backend-secret",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    s3_objects.client(s3_objects.Endpoint(endpoint_url=moto_url)).create_bucket(Bucket="tenant-store")
    env = {
        "ITO_NAMESPACE": namespace,
        "ITO_DATA_DIR": str(tmp_path),
        "ITO_FILE_STORE_URL": "s3://tenant-store/t",
        "ITO_S3_ENDPOINT_URL": moto_url,  # the trainer's reader takes it from its settings
    }
    s = settings_mod.load(env)
    Secrets(s.secrets_dir).ensure(NATS_IDENTITIES, ())
    broker = connections.make_broker(s, "scheduler")
    w = Wiring(settings=s, broker=broker, redis=None, keys=Keys(s))
    w.bus = LocalBus(w.router, broker)
    credentials, bookings, quotas = register_all(w, None)
    async with TestNatsBroker(broker) as br:
        yield Bus(br, w, credentials, bookings, [], quotas)


async def test_an_upload_goes_to_the_bucket_by_presigned_put_and_is_kept(bucket_bus, tmp_path):
    bus = bucket_bus
    await login(bus)
    digest = "sha256:" + hashlib.sha256(ROWS).hexdigest()
    begin = UploadRequest(
        name="corpus.jsonl", files=[UploadFile(path="corpus.jsonl", bytes=len(ROWS), sha256=digest)]
    )
    session = data(await call(bus, subjects.API_UPLOAD, begin, "acme"), UploadSession)
    (f,) = session.files
    assert f.put is not None and f.received == 0  # no parts: one PUT straight to the store
    local = tmp_path / "corpus.jsonl"
    local.write_bytes(ROWS)
    put_file(f.put.url, Local(path=local, relative="corpus.jsonl", bytes=len(ROWS), sha256=digest))
    view = None
    for _ in range(100):
        out = await call(
            bus, subjects.API_UPLOAD_COMMIT, UploadCommitRequest(upload_id=session.upload_id), "acme"
        )
        view = data(out, UploadView)
        if view.state != "checking":
            break
    assert view is not None and view.state == "ready" and view.file is not None, view
    assert (view.file.sha256, view.file.rows) == (digest, 30)

    item = DataInput(
        name="mine",
        kind=InputKind.upload,
        locator=view.file.file_id,
        digest=digest,
        format=DataFormat.jsonl,
        bytes=len(ROWS),
    )
    with Reader(bus.w.settings, "acme").opened(item) as fd:
        assert pathlib.Path(f"/proc/self/fd/{fd}").read_bytes() == ROWS
