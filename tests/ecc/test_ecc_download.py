"""`ecc ito download` (ecc/download.py) against a scripted server, and the export rules both ends
share (contracts/export_files.py), as tables: export ids, the path rule, the digest, chunk
arithmetic; a whole download, a resumed `.part`, a tampered chunk refused, a different file never
overwritten, a lost chunk answer retried within its bound."""

import asyncio
import hashlib
import stat

import msgspec
import pytest

from contracts import export_files as ef
from contracts.envelope import Envelope
from contracts.errors import ApiError, ErrorCode
from contracts.exports import (
    DOWNLOAD_CHUNK_MAX,
    DownloadChunk,
    DownloadRequest,
    ExportFile,
    ExportFormat,
    ExportRequest,
    ExportView,
)
from ecc import credentials, download, transport

KEY = "ito_sk_SUAFAKESEEDFORTESTSONLYNOTAREALKEY0000000000000000000000"


@pytest.mark.parametrize(
    "value, parsed",
    [
        ("sft-hf", ("sft", ExportFormat.hf)),
        ("long_context-peft", ("long_context", ExportFormat.peft)),
        ("dpo-gguf", None),
        ("-hf", None),
        ("sft", None),
        ("../x-hf", None),
        ("SFT-hf", None),
    ],
)
def test_export_ids(value, parsed):
    assert ef.parse_export_id(value) == parsed
    if parsed:
        assert ef.export_id(*parsed) == value


@pytest.mark.parametrize(
    "path, safe",
    [
        ("config.json", True),
        ("tok/tokenizer.json", True),
        ("", False),
        ("/etc/passwd", False),
        ("../x", False),
        ("a/../b", False),
        ("./a", False),
        ("a//b", False),
        ("a/", False),
        ("a\\b", False),
        ("a\0b", False),
        ("x" * 513, False),
    ],
)
def test_the_path_rule(path, safe):
    assert ef.safe_relative(path) is safe


def test_the_digest_is_over_sorted_path_and_sha_lines():
    a, b = ExportFile(path="b", bytes=1, sha256="11"), ExportFile(path="a", bytes=2, sha256="22")
    expected = "sha256:" + hashlib.sha256(b"a\x0022\nb\x0011\n").hexdigest()
    assert ef.export_digest([a, b]) == ef.export_digest([b, a]) == expected
    assert ef.export_digest([a, ExportFile(path="a", bytes=2, sha256="23")]) != expected


@pytest.mark.parametrize(
    "size, start, chunk, expected",
    [
        (0, 0, 4, []),
        (4, 0, 4, [(0, 4)]),
        (5, 0, 4, [(0, 4), (4, 1)]),
        (9, 3, 4, [(3, 4), (7, 2)]),
        (9, 9, 4, []),
        (9, 12, 4, []),
    ],
)
def test_chunk_arithmetic(size, start, chunk, expected):
    assert ef.chunks(size, start, chunk) == expected


# --- a scripted server: one ready export of two files ---

FILES = {
    "config.json": b'{"a": 1}',
    "sub/model.safetensors": bytes(range(256)) * (DOWNLOAD_CHUNK_MAX // 128 + 3),
}


def entries() -> list[ExportFile]:
    return [
        ExportFile(path=p, bytes=len(d), sha256=hashlib.sha256(d).hexdigest())
        for p, d in sorted(FILES.items())
    ]


VIEW = ExportView(
    run_id="run-1",
    stage="sft",
    format=ExportFormat.hf,
    state="ready",
    export_id="sft-hf",
    digest=ef.export_digest(entries()),
    files=entries(),
    bytes=sum(len(d) for d in FILES.values()),
    step=10,
)


class Server:
    def __init__(self, monkeypatch, *, tamper_at: int | None = None, lose: int = 0, view: ExportView = VIEW):
        self.calls: list[tuple[str, int]] = []
        self.tamper_at, self.lose, self.view = tamper_at, lose, view

        async def call(client, endpoint, request):
            if isinstance(request, ExportRequest):
                return Envelope(ok=True, live_api_contacted=True, notice=None, data=self.view)
            assert isinstance(request, DownloadRequest) and request.export_id == "sft-hf"
            self.calls.append((request.path, request.offset))
            if self.lose:
                self.lose -= 1
                raise transport.SentButUnanswered()
            data = FILES[request.path]
            chunk = data[request.offset : request.offset + request.length]
            if self.tamper_at is not None and request.offset == self.tamper_at:
                chunk = bytes([chunk[0] ^ 1]) + chunk[1:]
            entry = next(f for f in entries() if f.path == request.path)
            return Envelope(
                ok=True,
                live_api_contacted=True,
                notice=None,
                data=DownloadChunk(
                    run_id="run-1",
                    export_id="sft-hf",
                    path=request.path,
                    offset=request.offset,
                    data=chunk,
                    size=entry.bytes,
                    sha256=entry.sha256,
                ),
            )

        monkeypatch.setattr(transport.Client, "call", call)
        monkeypatch.setattr(download, "BACKOFF_S", 0.0)


@pytest.fixture(autouse=True)
def logged_in(tmp_path, monkeypatch):
    monkeypatch.setenv(credentials.ENV_CONFIG_DIR, str(tmp_path / "ecc"))
    credentials.save("acme", KEY)


def fetch(to, export="sft-hf"):
    return asyncio.run(download.download("run-1", export, str(to), 1.0, 1.0))


def test_a_whole_download_is_private_and_its_digest_verified(monkeypatch, tmp_path):
    server = Server(monkeypatch)
    env = fetch(tmp_path / "out")
    assert env.ok, env.error
    done = env.data
    assert done.digest == VIEW.digest and done.fetched_bytes == VIEW.bytes == done.bytes
    for path, data in FILES.items():
        assert (tmp_path / "out" / path).read_bytes() == data
        assert stat.S_IMODE((tmp_path / "out" / path).stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o700
    assert not list((tmp_path / "out").rglob("*.part"))
    big = len(FILES["sub/model.safetensors"])
    assert [o for p, o in server.calls if p == "sub/model.safetensors"] == [o for o, _ in ef.chunks(big)]
    again = fetch(tmp_path / "out")  # everything is there already: nothing fetched, digest checked again
    assert again.ok and again.data.fetched_bytes == 0


def test_a_part_resumes_from_its_size(monkeypatch, tmp_path):
    server = Server(monkeypatch)
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    have = DOWNLOAD_CHUNK_MAX + 100
    (out / "sub" / "model.safetensors.part").write_bytes(FILES["sub/model.safetensors"][:have])
    env = fetch(out)
    assert env.ok, env.error
    assert env.data.fetched_bytes == VIEW.bytes - have
    assert next(o for p, o in server.calls if p == "sub/model.safetensors") == have
    assert (out / "sub" / "model.safetensors").read_bytes() == FILES["sub/model.safetensors"]


def test_a_tampered_chunk_is_refused_and_its_part_removed(monkeypatch, tmp_path):
    Server(monkeypatch, tamper_at=DOWNLOAD_CHUNK_MAX)
    env = fetch(tmp_path / "out")
    assert not env.ok and env.error.code is ErrorCode.internal and "SHA-256" in env.error.message
    assert not (tmp_path / "out" / "sub" / "model.safetensors").exists()
    assert not (tmp_path / "out" / "sub" / "model.safetensors.part").exists()


def test_a_different_existing_file_is_never_overwritten(monkeypatch, tmp_path):
    Server(monkeypatch)
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text("mine")
    env = fetch(out)
    assert not env.ok and env.error.code is ErrorCode.forbidden and "not overwritten" in env.error.message
    assert (out / "config.json").read_text() == "mine"


def test_a_lost_chunk_answer_is_asked_again_within_a_bound(monkeypatch, tmp_path):
    server = Server(monkeypatch, lose=2)
    assert fetch(tmp_path / "a").ok
    assert server.calls[:3] == [("config.json", 0)] * 3
    Server(monkeypatch, lose=100)
    env = fetch(tmp_path / "b")
    assert not env.ok and env.error.code is ErrorCode.timeout and "resume" in env.error.message


def test_an_export_not_ready_or_unsafe_writes_nothing(monkeypatch, tmp_path):
    Server(monkeypatch, view=ExportView(run_id="run-1", stage="sft", format=ExportFormat.hf, state="pending"))
    env = fetch(tmp_path / "p")
    assert not env.ok and env.error.code is ErrorCode.export_not_found and "pending" in env.error.message
    evil = ExportFile(path="../escape", bytes=1, sha256="00")
    Server(monkeypatch, view=msgspec.structs.replace(VIEW, files=[evil]))
    env = fetch(tmp_path / "e")
    assert not env.ok and env.error.code is ErrorCode.forbidden
    assert not (tmp_path / "escape").exists()
    assert fetch(tmp_path / "x", export="nonsense").error.code is ErrorCode.request_invalid


def test_a_refusal_is_the_answer(monkeypatch, tmp_path):
    async def call(client, endpoint, request):
        return Envelope(
            ok=False,
            live_api_contacted=True,
            notice=None,
            error=ApiError(code=ErrorCode.run_not_found, message="no such run for this account"),
        )

    monkeypatch.setattr(transport.Client, "call", call)
    env = fetch(tmp_path / "r")
    assert not env.ok and env.error.code is ErrorCode.run_not_found
