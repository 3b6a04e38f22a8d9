"""A tenant's uploads and files through the API handlers (services/scheduler/uploads.py), in memory
and on Redis (the fixtures of test_handlers_inmemory), on a tenant store on disk: a file sent in
parts is checked whole and kept; an interrupted upload resumes; bytes that are not the declared
ones, and rows a stage cannot read, are refused with every problem at its line and their quota
given back; another tenant can neither see nor name any of it; a delete is a separate, confirmed,
idempotent mutation; an upload left uncommitted expires and gives its quota back; and a manifest
names a file as `upload:<id>`, resolved into the work item (issue 39)."""

import asyncio
import hashlib
import json
import uuid
from datetime import UTC, datetime

import msgspec
import pytest

from contracts import subjects
from contracts.api import Action, ConfirmationIssued, ConfirmRequest, PlanRequest, RunAccepted, TrainRequest
from contracts.envelope import Envelope
from contracts.errors import ErrorCode
from contracts.files import (
    FileDeleted,
    FileDeleteRequest,
    FileList,
    FileRequest,
    FilesRequest,
    UploadCommitRequest,
    UploadFile,
    UploadKind,
    UploadPartAck,
    UploadPartRequest,
    UploadRequest,
    UploadSession,
    UploadView,
)
from contracts.plans import Plan
from contracts.runs import TrainWork
from services.scheduler.file_records import MAX_OPEN_UPLOADS
from services.scheduler.manifests import digest_of
from services.scheduler.uploads import SWEEP_AFTER_S, Uploads, paths_refusal
from tests.scheduler.test_handlers_inmemory import (
    REPO_MANIFEST,
    Bus,
    booking_event,
    call,
    code,
    data,
    login,
    publish_booking,
)
from tests.scheduler.test_handlers_inmemory import bus as bus
from tests.scheduler.test_handlers_inmemory import redis_infra as redis_infra

TEXT_ROWS = b"".join(
    json.dumps({"text": f"line {i}: the river runs under the bridge"}).encode() + b"\n" for i in range(300)
)
CHUNK = 4096


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def begin(data: bytes, name: str = "corpus.jsonl", declared: bytes | None = None) -> UploadRequest:
    declared = data if declared is None else declared
    return UploadRequest(name=name, files=[UploadFile(path=name, bytes=len(declared), sha256=sha(declared))])


async def send(bus: Bus, account: str, session: UploadSession, data: bytes, until: int | None = None) -> int:
    """Parts from what the server holds, up to `until` bytes (all by default); what it holds after."""
    path = session.files[0].path
    offset = session.files[0].received
    end = len(data) if until is None else until
    while offset < end:
        part = UploadPartRequest(
            upload_id=session.upload_id,
            path=path,
            offset=offset,
            data=data[offset : min(end, offset + CHUNK)],
        )
        offset = data_of(await call(bus, subjects.API_UPLOAD_PART, part, account), UploadPartAck).received
    return offset


def data_of(out: Envelope, t):
    return data(out, t)


async def committed(bus: Bus, account: str, upload_id: str) -> Envelope:
    for _ in range(200):  # the check runs in a child process: asked again while it is "checking"
        out = await call(bus, subjects.API_UPLOAD_COMMIT, UploadCommitRequest(upload_id=upload_id), account)
        if not out.ok or msgspec.convert(out.data, UploadView).state != "checking":
            return out
    raise AssertionError("the upload was still being checked")


async def uploaded(
    bus: Bus, account: str, content: bytes = TEXT_ROWS, name: str = "corpus.jsonl"
) -> UploadView:
    session = data(await call(bus, subjects.API_UPLOAD, begin(content, name), account), UploadSession)
    await send(bus, account, session, content)
    return data(await committed(bus, account, session.upload_id), UploadView)


def uploads_of(bus: Bus) -> Uploads:
    (found,) = [t.__self__ for t in bus.w.tasks if isinstance(getattr(t, "__self__", None), Uploads)]
    return found


async def test_a_file_sent_in_parts_is_checked_whole_and_kept(bus):
    await login(bus)
    view = await uploaded(bus, "acme")
    assert view.state == "ready" and view.file is not None
    f = view.file
    assert (f.rows, f.kinds, f.bytes, f.sha256) == (300, ["text"], len(TEXT_ROWS), sha(TEXT_ROWS))
    assert f.source == f"upload:{f.file_id}" and f.file_id.startswith("file-")
    listed = data(await call(bus, subjects.API_FILES, FilesRequest(), "acme"), FileList)
    assert [x.file_id for x in listed.files] == [f.file_id] and listed.uploads == []
    assert data(await call(bus, subjects.API_FILE, FileRequest(file_id=f.file_id), "acme"), type(f)) == f
    usage = await uploads_of(bus).records.usage("acme")
    assert usage == {"file_bytes": len(TEXT_ROWS), "files": 1, "models": 0}


async def test_an_interrupted_upload_resumes_where_the_server_stopped(bus):
    await login(bus)
    request = begin(TEXT_ROWS)
    first = data(await call(bus, subjects.API_UPLOAD, request, "acme"), UploadSession)
    held = await send(bus, "acme", first, TEXT_ROWS, until=CHUNK * 2)
    again = data(await call(bus, subjects.API_UPLOAD, request, "acme"), UploadSession)  # the client ran again
    assert again.upload_id == first.upload_id and again.resumed and again.files[0].received == held
    # a part the server holds already is not written twice; one past what it holds is refused
    early = UploadPartRequest(upload_id=first.upload_id, path="corpus.jsonl", offset=0, data=b"x" * 10)
    assert data(await call(bus, subjects.API_UPLOAD_PART, early, "acme"), UploadPartAck).received == held
    late = msgspec.structs.replace(early, offset=held + 1)
    out = await call(bus, subjects.API_UPLOAD_PART, late, "acme")
    assert code(out) is ErrorCode.request_invalid and f"holds {held} bytes" in out.error.message
    out = await call(bus, subjects.API_UPLOAD_COMMIT, UploadCommitRequest(upload_id=first.upload_id), "acme")
    assert code(out) is ErrorCode.upload_incomplete and f"{held:,} of {len(TEXT_ROWS):,}" in out.error.message
    await send(bus, "acme", again, TEXT_ROWS)
    view = data(await committed(bus, "acme", first.upload_id), UploadView)
    assert view.state == "ready" and view.file is not None and view.file.sha256 == sha(TEXT_ROWS)


async def test_bytes_that_are_not_the_declared_ones_are_not_kept(bus):
    await login(bus)
    other = TEXT_ROWS.replace(b"river", b"rover")
    session = data(
        await call(bus, subjects.API_UPLOAD, begin(other, declared=TEXT_ROWS), "acme"), UploadSession
    )
    await send(bus, "acme", session, other)
    out = await committed(bus, "acme", session.upload_id)
    assert code(out) is ErrorCode.data_digest_mismatch and "not the ones declared" in out.error.message
    assert await uploads_of(bus).records.usage("acme") == {"file_bytes": 0, "files": 0, "models": 0}


async def test_rows_a_stage_cannot_read_are_refused_with_every_problem_at_its_line(bus):
    # issue 39: non-UTF-8 bytes and a role "wizard" passed the plan and failed (or silently trained)
    # the paid run; a malformed line 15 was reported as "row 14"
    await login(bus)
    good = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
    lines = [json.dumps(good).encode()] * 13
    lines += [
        json.dumps(
            {"messages": [{"role": "wizard", "content": "x"}, {"role": "assistant", "content": "y"}]}
        ).encode()
    ]
    lines += [b'{"messages": [oops', json.dumps(good).encode().replace(b"2+2?", b"\xff\xfe")]
    content = b"\n".join(lines) + b"\n"
    session = data(await call(bus, subjects.API_UPLOAD, begin(content, "chat.jsonl"), "acme"), UploadSession)
    await send(bus, "acme", session, content)
    out = await committed(bus, "acme", session.upload_id)
    assert code(out) is ErrorCode.data_schema_invalid
    message = out.error.message
    assert message.startswith("chat.jsonl was not kept: 3 problems:")
    assert "- line 14: messages[0].role is 'wizard'" in message
    assert "- line 15: not valid JSON" in message
    assert "- line 16: not UTF-8 text" in message
    assert data(await call(bus, subjects.API_FILES, FilesRequest(), "acme"), FileList).files == []
    assert await uploads_of(bus).records.usage("acme") == {"file_bytes": 0, "files": 0, "models": 0}


async def test_the_accounts_storage_quotas_hold(bus):
    await login(bus)
    await bus.quotas.set_limits("acme", {"file_bytes": len(TEXT_ROWS) + 100, "files": 1})
    await uploaded(bus, "acme")
    out = await call(bus, subjects.API_UPLOAD, begin(b'{"text": "x"}\n', "more.jsonl"), "acme")
    assert code(out) is ErrorCode.quota_exceeded
    assert out.error.quota is not None and out.error.quota.quota == "files"
    await bus.quotas.set_limits("acme", {"files": 5})
    out = await call(bus, subjects.API_UPLOAD, begin(TEXT_ROWS, "again.jsonl"), "acme")
    assert code(out) is ErrorCode.quota_exceeded and out.error.quota.quota == "file_bytes"


async def test_another_tenant_can_neither_see_nor_name_the_files(bus):
    await login(bus)
    await login(bus, "rival")
    view = await uploaded(bus, "acme")
    assert view.file is not None
    mine = view.file.file_id
    assert data(await call(bus, subjects.API_FILES, FilesRequest(), "rival"), FileList).files == []
    theirs = await call(bus, subjects.API_FILE, FileRequest(file_id=mine), "rival")
    nobodys = await call(bus, subjects.API_FILE, FileRequest(file_id="file-" + "9" * 24), "rival")
    assert code(theirs) is code(nobodys) is ErrorCode.data_not_found
    assert theirs.error.message.replace(mine, "X") == nobodys.error.message.replace("file-" + "9" * 24, "X")
    # nor can it plan with it: the same answer as for an id nobody has
    await publish_booking(bus, booking_event("rival", "bk-rival"))
    answers = []
    for file_id in (mine, "file-" + "9" * 24):
        out = await call(bus, subjects.API_PLAN, plan_request("bk-rival", upload_manifest(file_id)), "rival")
        answers.append((code(out), out.error.message.replace(file_id, "X")))
    assert answers[0] == answers[1] and answers[0][0] is ErrorCode.data_not_found


async def test_a_delete_is_confirmed_idempotent_and_gives_the_bytes_back(bus):
    await login(bus)
    view = await uploaded(bus, "acme")
    assert view.file is not None
    file_id = view.file.file_id
    out = await call(
        bus, subjects.API_FILE_DELETE, FileDeleteRequest(file_id=file_id, idempotency_key="d1"), "acme"
    )
    assert code(out) is ErrorCode.confirmation_required and "--action delete_file --file" in out.error.message
    issued = data(
        await call(
            bus, subjects.API_CONFIRM, ConfirmRequest(action=Action.delete_file, file_id=file_id), "acme"
        ),
        ConfirmationIssued,
    )
    req = FileDeleteRequest(file_id=file_id, idempotency_key="d1", confirmation_ref=issued.confirmation_ref)
    done = data(await call(bus, subjects.API_FILE_DELETE, req, "acme"), FileDeleted)
    assert done.bytes == len(TEXT_ROWS) and not done.replay
    again = data(await call(bus, subjects.API_FILE_DELETE, req, "acme"), FileDeleted)
    assert again.replay
    assert (
        code(await call(bus, subjects.API_FILE, FileRequest(file_id=file_id), "acme"))
        is ErrorCode.data_not_found
    )
    assert await uploads_of(bus).records.usage("acme") == {"file_bytes": 0, "files": 0, "models": 0}
    # the consumed confirmation deletes nothing else
    other = (await uploaded(bus, "acme", name="other.jsonl")).file
    assert other is not None
    out = await call(
        bus,
        subjects.API_FILE_DELETE,
        FileDeleteRequest(
            file_id=other.file_id, idempotency_key="d2", confirmation_ref=issued.confirmation_ref
        ),
        "acme",
    )
    assert not out.ok and out.error.code is not ErrorCode.internal


async def test_an_upload_left_uncommitted_expires_and_gives_its_quota_back(bus):
    await login(bus)
    session = data(await call(bus, subjects.API_UPLOAD, begin(TEXT_ROWS), "acme"), UploadSession)
    await send(bus, "acme", session, TEXT_ROWS, until=CHUNK)
    uploads = uploads_of(bus)
    assert (await uploads.records.usage("acme"))["file_bytes"] == len(TEXT_ROWS)
    assert await uploads.expire_once(now=session.expires_at.timestamp() + 1) == 1
    assert await uploads.records.usage("acme") == {"file_bytes": 0, "files": 0, "models": 0}
    assert uploads.store.received("acme", session.upload_id, "corpus.jsonl") == 0
    out = await call(
        bus, subjects.API_UPLOAD_COMMIT, UploadCommitRequest(upload_id=session.upload_id), "acme"
    )
    assert not out.ok


def upload_manifest(file_id: str) -> str:
    doc = json.loads(REPO_MANIFEST.read_text())
    decontamination = {"method": "13-gram", "against": [], "provenance": "test"}
    doc["data"].append(
        {"name": "mine", "source": f"upload:{file_id}", "role": "train", "decontamination": decontamination}
    )
    doc["name"] = f"uploads-{uuid.uuid4().hex[:6]}"
    return json.dumps(doc)


def plan_request(booking: str, text: str) -> PlanRequest:
    return PlanRequest(booking_id=booking, manifest_text=text, manifest_digest=digest_of(text.encode()))


async def test_a_manifest_names_an_upload_and_the_work_item_carries_it_resolved(bus, monkeypatch):
    from services.scheduler.api import Api

    items: list[TrainWork] = []
    work = Api._work

    def kept(self, *args, **kwargs):
        items.append(work(self, *args, **kwargs))
        return items[-1]

    monkeypatch.setattr(Api, "_work", kept)
    await login(bus)
    view = await uploaded(bus, "acme")
    assert view.file is not None
    await publish_booking(bus, booking_event("acme", "bk-up"))
    text = upload_manifest(view.file.file_id)
    assert data(await call(bus, subjects.API_PLAN, plan_request("bk-up", text), "acme"), Plan).ok
    digest = digest_of(text.encode())
    confirm = ConfirmRequest(
        action=Action.train, booking_id="bk-up", manifest_text=text, manifest_digest=digest
    )
    issued = data(await call(bus, subjects.API_CONFIRM, confirm, "acme"), ConfirmationIssued)
    train = TrainRequest(
        booking_id="bk-up",
        manifest_text=text,
        manifest_digest=digest,
        confirmation_ref=issued.confirmation_ref,
        idempotency_key="k-up",
    )
    run = data(await call(bus, subjects.API_TRAIN, train, "acme"), RunAccepted)
    (work,) = items
    assert work.run_id == run.run_id
    (item,) = work.inputs
    assert (item.name, item.kind.value, item.locator) == ("mine", "upload", view.file.file_id)
    assert (item.digest, item.bytes) == (view.file.sha256, view.file.bytes)


# --- what the attacker found (issue 39's review) ----------------------------------------------------


def twin(uploads: Uploads) -> Uploads:
    """A second scheduler instance: the same records, store and quotas, its own checks."""
    u = uploads
    return Uploads(u.credentials, u.records, u.store, u.quotas, u.peers, u.settings, u.model_store)


async def checking(bus: Bus, account: str = "acme"):
    session = data(await call(bus, subjects.API_UPLOAD, begin(TEXT_ROWS), account), UploadSession)
    await send(bus, account, session, TEXT_ROWS)
    uploads = uploads_of(bus)
    record = await uploads.records.upload(account, session.upload_id)
    record = msgspec.structs.replace(record, state="checking")
    await uploads.records.save(record)
    return uploads, record


async def test_two_instances_check_an_upload_once_and_its_quota_is_counted_once(bus):
    await login(bus)
    first, record = await checking(bus)
    second = twin(first)
    await asyncio.gather(
        first._guarded(record, first._check_data), second._guarded(record, second._check_data)
    )
    listed = data(await call(bus, subjects.API_FILES, FilesRequest(), "acme"), FileList)
    assert len(listed.files) == 1
    assert await first.records.usage("acme") == {"file_bytes": len(TEXT_ROWS), "files": 1, "models": 0}
    view = data(await committed(bus, "acme", record.upload_id), UploadView)
    assert view.state == "ready" and view.file == listed.files[0]


async def test_the_expiry_waits_for_a_live_check_and_never_releases_a_kept_file(bus):
    await login(bus)
    uploads, record = await checking(bus)
    late = record.expires_at.timestamp() + 1
    assert await uploads.records.claim(record, "another-instance", late, late + 600)
    await uploads.expire_once(now=late)  # another instance's check is live: the upload stays
    assert (await uploads.records.upload("acme", record.upload_id)).state == "checking"
    assert (await uploads.records.usage("acme"))["file_bytes"] == len(TEXT_ROWS)
    await uploads.expire_once(now=late + 601)  # that instance died: its claim ran out
    assert (await uploads.records.upload("acme", record.upload_id)).state == "expired"
    assert await uploads.records.usage("acme") == {"file_bytes": 0, "files": 0, "models": 0}
    # a kept upload is never released, whoever asks
    kept = await uploaded(bus, "acme", name="kept.jsonl")
    record = await uploads.records.upload("acme", kept.upload_id)
    assert record is not None and record.state == "ready"
    assert not await uploads.records.release(msgspec.structs.replace(record, state="expired"))
    assert not await uploads.records.claim(record, "anyone", late, late + 1)
    assert await uploads.records.usage("acme") == {"file_bytes": len(TEXT_ROWS), "files": 1, "models": 0}


async def test_what_a_late_put_leaves_after_an_upload_is_over_is_swept(bus):
    await login(bus)
    view = await uploaded(bus, "acme")
    assert view.state == "ready"
    uploads = uploads_of(bus)
    uploads.store.write("acme", view.upload_id, "corpus.jsonl", 0, b"late")  # a PUT that came late
    assert uploads.store.received("acme", view.upload_id, "corpus.jsonl") == 4
    await uploads.expire_once(now=datetime.now(UTC).timestamp() + SWEEP_AFTER_S + 1)
    assert uploads.store.received("acme", view.upload_id, "corpus.jsonl") == 0
    assert await uploads.records.expired(datetime.now(UTC).timestamp() + 10 * SWEEP_AFTER_S) == []


@pytest.mark.parametrize(
    "paths, why",
    [
        (["a.jsonl"], None),
        (["config.json", "model.safetensors", "tok/vocab.json"], None),
        (["config.json", "config.json"], "each file once"),
        (["tok", "tok/vocab.json"], "is a file and the directory of"),
        (["a/b", "a/b/c/d"], "is a file and the directory of"),
        (["../etc/passwd"], "not a plain relative path"),
        (["/abs"], "not a plain relative path"),
        (["x" * 256], "longer than 255 bytes"),
        (["d/" + "é" * 128], "longer than 255 bytes"),
    ],
)
def test_an_uploads_paths_are_files_a_file_system_holds(paths, why):
    found = paths_refusal(paths)
    assert (found is None) if why is None else (found is not None and why in found)


async def test_a_model_upload_whose_paths_conflict_is_refused_before_anything_is_reserved(bus):
    await login(bus)
    files = [UploadFile(path=p, bytes=1, sha256=sha(b"x")) for p in ("tok", "tok/vocab.json")]
    req = UploadRequest(kind=UploadKind.model, name="mine", files=files)
    out = await call(bus, subjects.API_UPLOAD, req, "acme")
    assert code(out) is ErrorCode.request_invalid and "directory of" in out.error.message
    assert await uploads_of(bus).records.usage("acme") == {"file_bytes": 0, "files": 0, "models": 0}


async def test_an_account_has_a_bounded_number_of_uploads_open(bus):
    await login(bus)
    for i in range(MAX_OPEN_UPLOADS):
        data(await call(bus, subjects.API_UPLOAD, begin(TEXT_ROWS, f"c{i}.jsonl"), "acme"), UploadSession)
    out = await call(bus, subjects.API_UPLOAD, begin(TEXT_ROWS, "one-more.jsonl"), "acme")
    assert code(out) is ErrorCode.quota_exceeded and out.error.quota.quota == "open_uploads"
    assert "begun and not committed" in out.error.message
    # the same request again is the upload it began, not one more
    again = await call(bus, subjects.API_UPLOAD, begin(TEXT_ROWS, "c0.jsonl"), "acme")
    assert data(again, UploadSession).resumed


async def test_beginning_uploads_spends_the_accounts_request_rate(bus):
    await login(bus)
    await bus.quotas.set_limits("acme", {"rate_per_s": 0.01, "burst": 2})  # no refill during the test
    for i in range(2):
        data(await call(bus, subjects.API_UPLOAD, begin(TEXT_ROWS, f"r{i}.jsonl"), "acme"), UploadSession)
    out = await call(bus, subjects.API_UPLOAD, begin(TEXT_ROWS, "r2.jsonl"), "acme")
    assert code(out) is ErrorCode.rate_limited
