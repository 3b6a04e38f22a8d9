"""The `ecc ito` verbs: read local inputs safely, make one bounded call, print the answer.

Each verb's work is `answer(verb, request, bounds)`: a typed API request in, an Envelope out, with
the verb's rule for a lost answer (a read says nothing changed; `train` asks status by its
idempotency key; a mutation answers `transport_ambiguous`). The argparse handlers below and the MCP
tools (`ecc.tools`) both build the request (`load_manifest` reads a manifest for either) and call it.
"""

import argparse
import asyncio
import getpass
import hashlib
import os
import pathlib
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

from contracts.api import (
    Action,
    ApproveRequest,
    AuthRequest,
    CancelRequest,
    CleanupRequest,
    ConfirmRequest,
    FindRequest,
    LogsRequest,
    MetricsRequest,
    ModelsRequest,
    PlanRequest,
    RunAccepted,
    RunItemsRequest,
    RunsRequest,
    RunView,
    StatusRequest,
    TrainRequest,
    accepted,
)
from contracts.audit import AuditRequest
from contracts.endpoints import API, Endpoint
from contracts.envelope import Envelope
from contracts.environment import ENV_NATS_CA
from contracts.errors import ErrorCode
from contracts.exports import ExportFormat, ExportRequest, SampleRequest
from contracts.runs import Metrics, MetricsPage
from ecc import credentials, render
from ecc.manifest_file import ManifestError, read_manifest
from ecc.transport import Client, SentButUnanswered, local_error, seed_of


class Bounds(NamedTuple):
    """One call's connect and overall timeouts (`--connect-timeout`, `--timeout`; `ecc mcp`'s own)."""

    connect_timeout_s: float
    timeout_s: float


def bounds_of(args: argparse.Namespace) -> Bounds:
    return Bounds(args.connect_timeout, args.timeout)


MUTATIONS = frozenset({"cancel", "cleanup", "approve", "file_delete"})
"""The verbs besides `train` that change a run: each takes a confirmation and an idempotency key."""


def _logged_in() -> Envelope[Any] | None:
    if credentials.load() is None:
        return local_error(ErrorCode.unauthenticated, "not logged in; run `ecc ito login --account ACCOUNT`")
    return None


def load_manifest(path: str) -> tuple[str, str] | Envelope[Any]:
    """(text, SHA-256 hex) of the manifest at `path`, read by the safe reader (one descriptor,
    O_NOFOLLOW, owner and mode checked, size capped, hashed exactly), or why not."""
    try:
        data, digest = read_manifest(path)
    except ManifestError as exc:
        return local_error(exc.code, exc.message)
    try:
        return data.decode("utf-8"), digest
    except UnicodeDecodeError:
        return local_error(ErrorCode.manifest_invalid, "the manifest is not UTF-8 text")


async def answer(verb: str, request: Any, bounds: Bounds) -> Envelope[Any]:
    """One API verb's bounded call with its rule for a lost answer."""
    if verb == "train":
        return await _call_train(bounds, request)
    if verb in MUTATIONS:
        return await _mutate(bounds, API[verb], request)
    return await _read(bounds, API[verb], request)


async def _read(bounds: Bounds, endpoint: Endpoint[Any, Any], request: Any) -> Envelope[Any]:
    async with Client(*bounds) as client:
        try:
            return await client.call(endpoint, request)
        except SentButUnanswered:
            return local_error(
                ErrorCode.timeout, "no answer in time; nothing was changed by this read", contacted=True
            )


async def _call_train(bounds: Bounds, request: TrainRequest) -> Envelope[RunAccepted]:
    """A train whose answer is lost is resolved by asking status by its idempotency key first."""
    async with Client(*bounds) as client:
        try:
            return await client.call(API["train"], request)
        except SentButUnanswered:
            pass
    async with Client(bounds.connect_timeout_s, max(bounds.timeout_s / 2, 5.0)) as client:
        try:
            status = await client.call(API["status"], StatusRequest(idempotency_key=request.idempotency_key))
        except SentButUnanswered:
            status = None
    if status is not None and status.ok:
        view = status.data
        assert isinstance(view, RunView), "status answers a RunView (its decoder made it one)"
        return Envelope(
            ok=True,
            live_api_contacted=True,
            notice="the answer was lost in transit; this run was found by its idempotency key",
            data=accepted(
                msgspec.structs.replace(view, idempotency_key=request.idempotency_key), replay=True
            ),
        )
    return local_error(
        ErrorCode.transport_ambiguous,
        "no answer in time and the run could not be found yet; ask "
        "`ecc ito status --idempotency-key KEY` before retrying",
        contacted=True,
    )


async def _mutate(bounds: Bounds, endpoint: Endpoint[Any, Any], request: Any) -> Envelope[Any]:
    """A lost answer to a mutation is not retried blindly: its key makes a retry safe, so say so."""
    async with Client(*bounds) as client:
        try:
            return await client.call(endpoint, request)
        except SentButUnanswered:
            return local_error(
                ErrorCode.transport_ambiguous,
                "no answer in time; the request may have taken effect. Retry with the same "
                "--idempotency-key: it is applied at most once",
                contacted=True,
            )


def _run(verb: str, request: Any, args: argparse.Namespace) -> Envelope[Any]:
    return asyncio.run(answer(verb, request, bounds_of(args)))


def _login(args: argparse.Namespace) -> Envelope[Any]:
    if sys.stdin.isatty():
        api_key = getpass.getpass("API key: ").strip()
    else:
        api_key = sys.stdin.readline().strip()
    if not api_key:
        return local_error(ErrorCode.unauthenticated, "no API key given on stdin")
    if seed_of(api_key) is None:
        return local_error(ErrorCode.unauthenticated, "that is not an ito-training API key")

    ca = getattr(args, "ca", None) or os.environ.get(ENV_NATS_CA) or None
    if ca:  # recorded as an absolute path: later calls run from anywhere
        ca = str(pathlib.Path(ca).expanduser().absolute())

    async def check() -> Envelope[Any]:
        async with Client(
            args.connect_timeout, args.timeout, credential=(args.account, api_key), fresh=True, ca=ca
        ) as c:
            try:
                return await c.call(API["auth"], AuthRequest())
            except SentButUnanswered:
                return local_error(ErrorCode.timeout, "no answer in time; nothing was stored", contacted=True)

    env = asyncio.run(check())
    if env.ok:
        where = credentials.save(args.account, api_key, ca)
        notice = f"credential stored in {where}" + (f" (the server is verified with {ca})" if ca else "")
        return Envelope(ok=True, live_api_contacted=True, notice=notice, data=env.data)
    return env


def validate(path: str | None = None, text: str | None = None) -> Envelope[Any]:
    """A manifest (at `path`, read by the safe reader, or its `text`) checked against its schema
    here: nothing is sent, no login needed. Every problem is in the one `manifest_invalid` message."""
    from contracts import manifest_check

    if text is None:
        assert path is not None, "a path or a text"
        read = load_manifest(os.path.abspath(path))  # a relative path is fine: this binds nothing
        if isinstance(read, Envelope):
            return read
        text = read[0]
    manifest, problems = manifest_check.check(text)
    if manifest is None:
        return local_error(ErrorCode.manifest_invalid, manifest_check.message(problems))
    checked = manifest_check.Checked(
        valid=True, name=manifest.name, manifest_digest=hashlib.sha256(text.encode()).hexdigest()
    )
    return Envelope(ok=True, live_api_contacted=False, notice=None, data=checked)


def _validate(args: argparse.Namespace) -> Envelope[Any]:
    return validate(path=args.manifest)


def _logout(args: argparse.Namespace) -> Envelope[Any]:
    removed = credentials.remove()
    return Envelope(ok=True, live_api_contacted=False, notice=None, data=render.LoggedOut(logged_out=removed))


def _auth(args: argparse.Namespace) -> Envelope[Any]:
    return _run("auth", AuthRequest(), args)


def _find(args: argparse.Namespace) -> Envelope[Any]:
    return _run("find", FindRequest(), args)


def _models(args: argparse.Namespace) -> Envelope[Any]:
    return _run("models", ModelsRequest(), args)


def _plan(args: argparse.Namespace) -> Envelope[Any]:
    m = load_manifest(args.manifest)
    if isinstance(m, Envelope):
        return m
    text, digest = m
    return _run(
        "plan", PlanRequest(booking_id=args.booking, manifest_text=text, manifest_digest=digest), args
    )


def _train(args: argparse.Namespace) -> Envelope[Any]:
    """The manifest read here, then a call whose lost answer `_call_train` resolves."""
    m = load_manifest(args.manifest)
    if isinstance(m, Envelope):
        return m
    text, digest = m
    req = TrainRequest(
        booking_id=args.booking,
        manifest_text=text,
        manifest_digest=digest,
        confirmation_ref=args.confirmation_ref,
        idempotency_key=args.idempotency_key,
    )
    return _run("train", req, args)


def _confirm(args: argparse.Namespace) -> Envelope[Any]:
    text: str | None = None
    digest: str | None = None
    if args.manifest:
        m = load_manifest(args.manifest)
        if isinstance(m, Envelope):
            return m
        text, digest = m
    req = ConfirmRequest(
        action=Action(args.action),
        booking_id=args.booking,
        run_id=args.run,
        manifest_text=text,
        manifest_digest=digest,
        max_cost_usd=args.max_cost,
        file_id=args.file,
    )
    return _run("confirm", req, args)


def _status(args: argparse.Namespace) -> Envelope[Any]:
    if not args.run and not args.idempotency_key:
        return local_error(ErrorCode.request_invalid, "give a run id or --idempotency-key")
    req = StatusRequest(run_id=args.run, idempotency_key=args.idempotency_key)
    if args.follow:
        return asyncio.run(render.follow(args, req))
    return _run("status", req, args)


def _runs(args: argparse.Namespace) -> Envelope[Any]:
    fields = {"state": args.state, "booking_id": args.booking, "limit": args.limit, "cursor": args.cursor}
    try:  # the contract's bounds (limit 1-100), checked here before anything is sent
        req = msgspec.convert({k: v for k, v in fields.items() if v is not None}, RunsRequest)
    except msgspec.ValidationError as exc:
        return local_error(ErrorCode.request_invalid, f"invalid arguments: {exc}")
    return _run("runs", req, args)


CHART_PAGES = 20  # a terminal's sparkline reads up to 20 pages (20,000 points): a long run's curve, bounded


async def _chart_points(args: argparse.Namespace, req: MetricsRequest) -> Envelope[Any]:
    """Every point from `req.since` (CHART_PAGES pages at most), as one page: a curve drawn from the
    first page alone would stop at step 1,000. A refusal or timeout on any page is the answer."""
    points: list[Metrics] = []
    since, notice = req.since, None
    for _ in range(CHART_PAGES):
        env = await _read(bounds_of(args), API["metrics"], msgspec.structs.replace(req, since=since))
        if not env.ok:
            return env
        page = env.data
        assert isinstance(page, MetricsPage), "metrics answers a MetricsPage"
        points += page.points
        since, notice = page.next, env.notice
        if len(page.points) < req.limit:
            break
    else:
        notice = f"the first {len(points)} points from {req.since}; `--since {since}` shows any after them"
    page = MetricsPage(run_id=req.run_id, points=points, next=since)
    return Envelope(ok=True, live_api_contacted=True, notice=notice, data=page)


def _metrics(args: argparse.Namespace) -> Envelope[Any]:
    """Text on a terminal is a sparkline per stage over the whole run; JSON and pipes get the one
    page asked for (`--since`), byte for byte what the server answered."""
    req = MetricsRequest(run_id=args.run, since=args.since)
    if render.on_terminal(args):
        return asyncio.run(_chart_points(args, req))
    return _run("metrics", req, args)


def _checkpoints(args: argparse.Namespace) -> Envelope[Any]:
    return _run("checkpoints", RunItemsRequest(run_id=args.run), args)


def _evals(args: argparse.Namespace) -> Envelope[Any]:
    return _run("evals", RunItemsRequest(run_id=args.run), args)


def _cancel(args: argparse.Namespace) -> Envelope[Any]:
    req = CancelRequest(
        run_id=args.run, confirmation_ref=args.confirmation_ref, idempotency_key=args.idempotency_key
    )
    return _run("cancel", req, args)


def _cleanup(args: argparse.Namespace) -> Envelope[Any]:
    req = CleanupRequest(
        run_id=args.run,
        confirmation_ref=args.confirmation_ref,
        idempotency_key=args.idempotency_key,
        release_booking=args.release_booking,
        release_confirmation_ref=args.release_confirmation_ref,
    )
    return _run("cleanup", req, args)


def _approve(args: argparse.Namespace) -> Envelope[Any]:
    req = ApproveRequest(
        run_id=args.run,
        confirmation_ref=args.confirmation_ref,
        idempotency_key=args.idempotency_key,
        reject=args.reject,
    )
    return _run("approve", req, args)


def _audit(args: argparse.Namespace) -> Envelope[Any]:
    return _run("audit", AuditRequest(run_id=args.run), args)


def _logs(args: argparse.Namespace) -> Envelope[Any]:
    req = LogsRequest(run_id=args.run, since=args.since)
    if args.follow:
        return asyncio.run(render.follow_logs(args, req))
    return _run("logs", req, args)


def _export(args: argparse.Namespace) -> Envelope[Any]:
    req = ExportRequest(run_id=args.run, stage=args.stage, format=ExportFormat(args.format))
    return _run("export", req, args)


def _download(args: argparse.Namespace) -> Envelope[Any]:
    from ecc import download  # its hashing and file writing load only for this verb

    return asyncio.run(download.download(args.run, args.export, args.to, args.connect_timeout, args.timeout))


def _models_verb(args: argparse.Namespace) -> Envelope[Any]:
    """`models` lists; `models upload DIR` sends a checkpoint (ecc/upload.py)."""
    if args.action == "list":
        return _models(args)
    if not args.directory:
        return local_error(ErrorCode.request_invalid, "models upload needs the checkpoint's directory")
    from contracts.files import UploadKind
    from ecc import upload

    directory = pathlib.Path(args.directory).expanduser().absolute()
    try:
        files = upload.model_files(directory)
    except upload.UploadFailed as exc:
        return local_error(exc.code, exc.message)
    name = args.name or directory.name
    return asyncio.run(
        upload.upload(UploadKind.model, name, files, args.connect_timeout, args.timeout, wait_s=args.wait)
    )


def _files(args: argparse.Namespace) -> Envelope[Any]:
    """`files upload PATH | list | show ID | delete ID`."""
    from contracts.files import FileDeleteRequest, FileRequest, FilesRequest

    if args.action == "list":
        return _run("files", FilesRequest(), args)
    if not args.target:
        what = "the file's path" if args.action == "upload" else "the file's id (`ecc ito files list`)"
        return local_error(ErrorCode.request_invalid, f"files {args.action} needs {what}")
    if args.action == "show":
        return _run("file", FileRequest(file_id=args.target), args)
    if args.action == "delete":
        if not args.idempotency_key:
            return local_error(
                ErrorCode.request_invalid, "files delete needs --idempotency-key (a new unique string)"
            )
        req = FileDeleteRequest(
            file_id=args.target, confirmation_ref=args.confirmation_ref, idempotency_key=args.idempotency_key
        )
        return _run("file_delete", req, args)
    return upload_file(args.target, args.name, args.purpose, args.format, bounds_of(args), args.wait)


def upload_file(
    path: str, name: str | None, purpose: str, fmt: str | None, bounds: Bounds, wait_s: float
) -> Envelope[Any]:
    """A data file's whole upload (the CLI's `files upload` and the MCP `upload` tool)."""
    from contracts.files import FilePurpose, UploadKind
    from contracts.manifest import DataFormat
    from ecc import upload

    local = pathlib.Path(path).expanduser().absolute()
    return asyncio.run(
        upload.upload(
            UploadKind.data,
            name or local.name,
            [(local, local.name)],
            bounds.connect_timeout_s,
            bounds.timeout_s,
            purpose=FilePurpose(purpose),
            fmt=DataFormat(fmt) if fmt else None,
            wait_s=wait_s,
        )
    )


def _connections(args: argparse.Namespace) -> Envelope[Any]:
    from contracts.files import ConnectionsRequest

    return _run("connections", ConnectionsRequest(), args)


def _sample(args: argparse.Namespace) -> Envelope[Any]:
    try:
        req = msgspec.convert(
            {
                "run_id": args.run,
                "prompt": args.prompt,
                "stage": args.stage,
                "max_new_tokens": args.max_new_tokens,
                "temperature": args.temperature,
                "seed": args.seed,
                "chat": args.chat,
            },
            SampleRequest,
        )
    except (
        msgspec.ValidationError
    ) as exc:  # the contract's bounds: prompt length, max_new_tokens, temperature
        return local_error(ErrorCode.request_invalid, f"invalid arguments: {exc}")
    return _run("sample", req, args)


Verb = Callable[[argparse.Namespace], Envelope[Any]]

WITHOUT_LOGIN: dict[str, Verb] = {"login": _login, "logout": _logout, "validate": _validate}
"""Verbs that run without a stored credential."""
LOGGED_IN: dict[str, Verb] = {
    "auth": _auth,
    "find": _find,
    "plan": _plan,
    "train": _train,
    "confirm": _confirm,
    "runs": _runs,
    "status": _status,
    "metrics": _metrics,
    "checkpoints": _checkpoints,
    "evals": _evals,
    "cancel": _cancel,
    "cleanup": _cleanup,
    "approve": _approve,
    "audit": _audit,
    "logs": _logs,
    "export": _export,
    "download": _download,
    "sample": _sample,
    "models": _models_verb,
    "files": _files,
    "connections": _connections,
}
"""Verbs that need a stored credential: without one they answer `unauthenticated` and call nothing."""


def run_verb(args: argparse.Namespace) -> Envelope[Any]:
    if args.verb in WITHOUT_LOGIN:
        return WITHOUT_LOGIN[args.verb](args)
    missing = _logged_in()
    if missing is not None:
        return missing
    verb = LOGGED_IN.get(args.verb)
    if verb is None:
        return local_error(ErrorCode.request_invalid, f"unknown verb {args.verb}")
    return verb(args)


def dispatch(args: argparse.Namespace) -> int:
    env = run_verb(args)
    render.show(args, env)
    return 0 if env.ok else 1
