"""A tenant's data in S3-compatible stores, against moto's server on a loopback port (as the
checkpoint store's test): the tenant store in a bucket takes an upload by the presigned PUT the API
hands out and keeps it as a file; a named connection's secret is read from a 0600 file and kept
0600, reaches the tenant's own bucket at plan time (the object's digest and rows) and at train
time (the copy the run trains on), and never shows in what the backend says or logs."""

import asyncio
import hashlib
import json
import logging
import os
import urllib.request

import pytest

from contracts.files import DataInput, InputKind
from contracts.manifest import DataFormat
from runtime.configuration import settings as settings_mod
from runtime.storage import data_connections, s3_objects
from runtime.storage.data_connections import BadConnection
from runtime.storage.tenant_files import BucketStore, StoreError
from services.scheduler.data_facts import DataFacts
from services.trainer.inputs import Reader
from tests.support import moto_s3

ROWS = b"".join(json.dumps({"text": f"the river runs under bridge {i}"}).encode() + b"\n" for i in range(40))
KEY_ID, SECRET = "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


@pytest.fixture(scope="module")
def moto():
    with moto_s3() as url:
        endpoint = s3_objects.Endpoint(endpoint_url=url, access_key_id=KEY_ID, secret_access_key=SECRET)
        client = s3_objects.client(endpoint)
        for bucket in ("tenant-store", "acme-corpora"):
            client.create_bucket(Bucket=bucket)
        yield endpoint


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def test_an_upload_goes_by_presigned_put_into_the_bucket_and_is_kept(moto, tmp_path):
    store = BucketStore(bucket="tenant-store", prefix="uploads", endpoint=moto, spool=tmp_path / "spool")
    url, _ = store.presign("acme", "up-1", "corpus.jsonl", len(ROWS))
    assert store.received("acme", "up-1", "corpus.jsonl") == 0
    request = urllib.request.Request(
        url, data=ROWS, method="PUT", headers={"Content-Type": "application/octet-stream"}
    )
    with urllib.request.urlopen(request, timeout=10) as answer:  # what `ecc ito files upload` sends
        assert answer.status == 200
    assert store.received("acme", "up-1", "corpus.jsonl") == len(ROWS)
    with store.opened_upload("acme", "up-1", "corpus.jsonl") as fd:
        assert os.read(fd, len(ROWS) + 1) == ROWS
    store.keep("acme", "up-1", "corpus.jsonl", "file-1")
    with store.opened_file("acme", "file-1") as fd:
        assert os.read(fd, len(ROWS) + 1) == ROWS
    assert list((tmp_path / "spool").iterdir()) == []  # a read's copy has no name: nothing is left
    keys = {
        o["Key"]
        for o in s3_objects.client(moto).list_objects_v2(Bucket="tenant-store", Prefix="uploads/")["Contents"]
    }
    assert keys == {"uploads/acme/files/file-1"}  # the upload's object became the file's


def secret_file(tmp_path, mode=0o600):
    path = tmp_path / "acme-corpora.json"
    path.write_text(json.dumps({"access_key_id": KEY_ID, "secret_access_key": SECRET}))
    path.chmod(mode)
    return path


def test_a_connection_reads_its_secret_from_a_0600_file_and_keeps_it_0600(moto, tmp_path):
    secrets = tmp_path / "secrets"
    with pytest.raises(BadConnection, match="mode 0600"):
        data_connections.add(secrets, "acme", "corpora", secret_file(tmp_path, 0o644))
    view = data_connections.add(
        secrets, "acme", "corpora", secret_file(tmp_path), endpoint_url=moto.endpoint_url
    )
    assert (view.name, view.kind, view.endpoint) == ("corpora", "s3", moto.endpoint_url)
    kept = secrets / "connections" / "acme" / "corpora.json"
    assert kept.stat().st_mode & 0o777 == 0o600 and kept.parent.stat().st_mode & 0o777 == 0o700
    assert SECRET not in repr(view) and SECRET not in repr(
        data_connections.endpoint_of(secrets, "acme", "corpora")
    )
    assert data_connections.endpoint_of(secrets, "rival", "corpora") is None  # another account: not there
    assert [c.name for c in data_connections.listed(secrets, "acme")] == ["corpora"]


def test_an_object_is_checked_at_plan_time_and_copied_at_train_time_through_the_connection(
    moto, tmp_path, caplog
):
    caplog.set_level(logging.DEBUG)
    secrets = tmp_path / "secrets"
    data_connections.add(secrets, "acme", "corpora", secret_file(tmp_path), endpoint_url=moto.endpoint_url)
    s3_objects.client(moto).put_object(Bucket="acme-corpora", Key="chat/rows.jsonl", Body=ROWS)
    facts = DataFacts(None, secrets, tmp_path / "spool")
    found = asyncio.run(facts.s3("acme", "corpora", "acme-corpora", "chat/rows.jsonl", DataFormat.jsonl))
    assert found.report is not None and found.report.sha256 == sha(ROWS) and found.report.rows == 40
    theirs = asyncio.run(facts.s3("rival", "corpora", "acme-corpora", "chat/rows.jsonl", DataFormat.jsonl))
    assert theirs.report is None and theirs.unreadable == "no connection 'corpora' for this account"

    settings = settings_mod.load({"ITO_DATA_DIR": str(tmp_path / "data"), "ITO_SECRETS_DIR": str(secrets)})
    item = DataInput(
        name="mine",
        kind=InputKind.s3,
        locator="acme-corpora/chat/rows.jsonl",
        digest=sha(ROWS),
        format=DataFormat.jsonl,
        bytes=len(ROWS),
        connection="corpora",
    )
    with Reader(settings, "acme").opened(item) as fd:
        assert os.read(fd, len(ROWS) + 1) == ROWS
    ours = "\n".join(r.getMessage() for r in caplog.records if not r.name.startswith(("moto", "werkzeug")))
    assert SECRET not in ours and KEY_ID not in ours  # the backend's logs (moto's own are its server's)


def test_a_put_after_the_check_is_never_kept(moto, tmp_path):
    """The object is kept at the ETag that was checked: bytes put after the check make the keep
    fail, and nothing unchecked becomes a file."""
    store = BucketStore(bucket="tenant-store", prefix="race", endpoint=moto, spool=tmp_path / "spool")
    client = s3_objects.client(moto)
    key = "race/acme/uploads/up-2/corpus.jsonl"
    client.put_object(Bucket="tenant-store", Key=key, Body=ROWS)
    checked = store.version("acme", "up-2", "corpus.jsonl")
    with store.opened_upload("acme", "up-2", "corpus.jsonl", checked) as fd:
        assert os.read(fd, len(ROWS) + 1) == ROWS
    client.put_object(Bucket="tenant-store", Key=key, Body=b'{"text": "swapped after the check"}\n')
    with pytest.raises(StoreError):
        store.keep("acme", "up-2", "corpus.jsonl", "file-2", checked)
    with pytest.raises(StoreError):
        with store.opened_upload("acme", "up-2", "corpus.jsonl", checked):
            pass
    listed = client.list_objects_v2(Bucket="tenant-store", Prefix="race/acme/files/").get("Contents", [])
    assert listed == []
