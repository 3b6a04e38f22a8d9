"""What a person (or a tool, with --json) sees: envelopes, and progress while following a run.

Every answer arrives decoded into its type (contracts/endpoints.py names each verb's); `text`
picks its renderer by that type with `match`, never by the keys it happens to have: a run and its
records read as ecc/run_view.py writes them, the account, bookings, plan and confirmation as
ecc/plan_view.py does, exports and models as ecc/exports_view.py does, uploads and files as
ecc/files_view.py does. The two answers `ecc` makes itself (logout's, and the end of
`logs --follow`) are typed here; the download's (`Downloaded`) beside its renderer.

A person at a terminal (`on_terminal`: stdout is a TTY and no --json) gets pictures: a followed
run's bars (ecc/progress.py, the only module that loads rich) and each stage's loss sparkline
(ecc/charts.py). A pipe gets the plain lines scripts parse, unchanged; --json its events.
"""

import argparse
import asyncio
import sys
import time
from typing import TYPE_CHECKING, Any, assert_never

import msgspec

from contracts.api import (
    AuthInfo,
    BookingView,
    CleanupResult,
    ConfirmationIssued,
    LogPage,
    LogsRequest,
    MetricsRequest,
    ModelList,
    MutationResult,
    RunAccepted,
    RunList,
    RunView,
    StatusRequest,
)
from contracts.audit import AuditTrail
from contracts.endpoints import API, Endpoint
from contracts.envelope import Envelope
from contracts.exports import DownloadChunk, ExportView, SampleResult
from contracts.files import (
    ConnectionList,
    FileDeleted,
    FileList,
    FileView,
    UploadPartAck,
    UploadSession,
    UploadView,
)
from contracts.manifest_check import Checked
from contracts.plans import Plan
from contracts.runs import CheckpointList, EvalList, Metrics, MetricsPage
from contracts.states import TERMINAL_STATES
from ecc import exports_view, files_view, plan_view, run_view
from ecc.exports_view import Downloaded
from ecc.transport import Client, SentButUnanswered

if TYPE_CHECKING:  # ecc.progress (and rich) load only when a terminal follows a run
    from ecc.progress import Screen

POLL_EVERY_S = 1.0
METRIC_PAGES_PER_TICK = 5  # a terminal joining a long run catches up 5 pages (5,000 points) a second
_encoder = msgspec.json.Encoder()


class LoggedOut(msgspec.Struct, frozen=True, kw_only=True):
    """`ecc ito logout`'s answer (local: nothing is called): whether a stored credential was removed."""

    logged_out: bool


class LogsFollowed(msgspec.Struct, frozen=True, kw_only=True):
    """`ecc ito logs --follow`'s last answer: the run ended and every line was printed; `next` is
    where a later `--since` starts."""

    run_id: str
    next: int


Answer = (
    AuthInfo
    | list[BookingView]
    | Plan
    | ConfirmationIssued
    | RunAccepted
    | RunView
    | RunList
    | LogPage
    | AuditTrail
    | MetricsPage
    | CheckpointList
    | EvalList
    | MutationResult
    | CleanupResult
    | ExportView
    | DownloadChunk
    | SampleResult
    | ModelList
    | UploadSession
    | UploadPartAck
    | UploadView
    | FileList
    | FileView
    | FileDeleted
    | ConnectionList
    | LoggedOut
    | LogsFollowed
    | Downloaded
    | Checked
)
"""Every answer `ecc` shows: each API verb's (`API[verb].answer`) and its own four (validate's, `Checked`)."""


def show(args: argparse.Namespace, env: Envelope[Any]) -> None:
    if getattr(args, "json", False):
        print(_encoder.encode(env).decode(), flush=True)
        return
    if not env.ok:
        assert env.error is not None
        print(f"error [{env.error.code.value}]: {env.error.message}", file=sys.stderr)
        if env.error.retry_after_s is not None:
            print(f"retry after: {env.error.retry_after_s:g} s", file=sys.stderr)
        return
    if env.notice:
        print(f"note: {env.notice}")
    print(text(env.data, terminal=on_terminal(args)))


def text(answer: Answer | None, terminal: bool = False) -> str:
    """An answer as lines for a person, by its type. `terminal`: a person reads them, not a script:
    metrics are a loss sparkline per stage (ecc/charts.py) instead of one line per point."""
    match answer:
        case AuthInfo():
            return plan_view.auth(answer)
        case list():  # the one answer that is a list: find's list[BookingView]
            return plan_view.bookings(answer)
        case Plan():
            return plan_view.plan(answer)
        case ConfirmationIssued():
            return plan_view.confirmation(answer)
        case RunAccepted() | MutationResult():
            return f"run {answer.run_id}: {answer.state}"
        case RunView():
            return run_view.run(answer)
        case RunList():
            return run_view.runs(answer)
        case LogPage():
            return "\n".join(run_view.log_line(ln) for ln in answer.lines) or "(no lines)"
        case AuditTrail():
            return run_view.decisions(answer)
        case MetricsPage():
            return run_view.curves(answer) if terminal else run_view.points(answer)
        case CheckpointList():
            return run_view.checkpoints(answer)
        case EvalList():
            return run_view.evals(answer)
        case CleanupResult():
            return run_view.cleanup(answer)
        case ExportView():
            return exports_view.export(answer)
        case DownloadChunk():
            return f"{answer.path}: {len(answer.data)} bytes at {answer.offset} of {answer.size} (sha256 {answer.sha256})"
        case SampleResult():
            return exports_view.sample(answer)
        case Downloaded():
            return exports_view.downloaded(answer)
        case ModelList():
            return exports_view.models(answer)
        case UploadSession():
            return files_view.session(answer)
        case UploadPartAck():
            return files_view.part(answer)
        case UploadView():
            return files_view.upload_view(answer)
        case FileList():
            return files_view.files(answer)
        case FileView():
            return files_view.file_view(answer)
        case FileDeleted():
            return files_view.deleted(answer)
        case ConnectionList():
            return files_view.connections(answer)
        case Checked():
            return f"{answer.name}: valid (sha256 {answer.manifest_digest}); {answer.note}"
        case LoggedOut() | LogsFollowed() | None:  # no words to add: their JSON says it all
            return _encoder.encode(answer).decode()
        case _:
            assert_never(answer)


async def _call(args: argparse.Namespace, endpoint: Endpoint[Any, Any], request: Any) -> Envelope[Any] | None:
    async with Client(args.connect_timeout, args.timeout) as client:
        try:
            return await client.call(endpoint, request)
        except SentButUnanswered:
            return None  # a poll that timed out is retried on the next tick


def _progress(view: RunView, started: float, first_step: int) -> str:
    step, total = view.step, view.total_steps
    line = f"[{view.state}] {view.stage or '-'}"
    if total:
        line += f" step {step}/{total}"
    if view.loss is not None:
        line += f" loss {view.loss:.4f}"
    elapsed = time.monotonic() - started
    if total and step > first_step and elapsed > 0:
        rate = (step - first_step) / elapsed
        line += f" ETA {max(0.0, (total - step) / rate):.0f}s"
    return line


def on_terminal(args: argparse.Namespace) -> bool:
    """Whether a person reads stdout: bars and sparklines then; otherwise the plain lines scripts parse."""
    return not getattr(args, "json", False) and sys.stdout.isatty()


async def follow(args: argparse.Namespace, req: StatusRequest) -> Envelope[RunView]:
    """Poll until the run ends. Any refusal (credential revoked included) stops at once.

    On a terminal the progress is bars that update in place (ecc/progress.py, rich loads there);
    otherwise one plain line per change, or one JSON event per poll with --json."""
    if not on_terminal(args):
        return await _follow(args, req, None)
    from ecc import progress

    with progress.Screen() as screen:
        return await _follow(args, req, screen)


async def _new_points(args: argparse.Namespace, run_id: str, since: int) -> tuple[list[Metrics], int]:
    """The metric points after `since` (a few pages at most per tick) and where the next read starts."""
    points: list[Metrics] = []
    for _ in range(METRIC_PAGES_PER_TICK):
        req = MetricsRequest(run_id=run_id, since=since)
        env = await _call(args, API["metrics"], req)
        if env is None or not env.ok:
            break  # tokens/s waits for the next tick; the bars still move with the status
        page = env.data
        assert isinstance(page, MetricsPage), "metrics answers a MetricsPage"
        points += page.points
        since = page.next
        if len(page.points) < req.limit:
            break
    return points, since


async def _follow(args: argparse.Namespace, req: StatusRequest, screen: "Screen | None") -> Envelope[RunView]:
    started, first_step, last_line, since, points_since = time.monotonic(), None, None, 0, 0
    while True:
        env = await _call(args, API["status"], req)
        if env is None:
            await asyncio.sleep(POLL_EVERY_S)
            continue
        if not env.ok:
            return env
        view = env.data
        assert isinstance(view, RunView), "status answers a RunView (its decoder made it one)"
        logs = await _call(args, API["logs"], LogsRequest(run_id=view.run_id, since=since))
        if logs is not None and logs.ok:
            page = logs.data
            assert isinstance(page, LogPage), "logs answers a LogPage"
            since = page.next
            for ln in page.lines:
                if args.json:
                    print(
                        _encoder.encode({"event": "log", **msgspec.structs.asdict(ln)}).decode(), flush=True
                    )
                elif screen is not None:
                    screen.log(ln.message)
                else:
                    print(f"  log: {ln.message}", flush=True)
        if screen is not None:
            points, points_since = await _new_points(args, view.run_id, points_since)
            screen.update(view, points, time.monotonic())
        else:
            if first_step is None:
                first_step = view.step
            line = _progress(view, started, first_step)
            if args.json:
                print(_encoder.encode({"event": "status", "run": view}).decode(), flush=True)
            elif line.split(" ETA ")[0] != last_line:  # a new step or state, not only a new ETA
                print(line, flush=True)
                last_line = line.split(" ETA ")[0]
        if view.state in TERMINAL_STATES:
            return env
        await asyncio.sleep(POLL_EVERY_S)


async def follow_logs(args: argparse.Namespace, req: LogsRequest) -> Envelope[LogPage | LogsFollowed]:
    since = req.since
    while True:
        env = await _call(args, API["logs"], msgspec.structs.replace(req, since=since))
        if env is None:
            await asyncio.sleep(POLL_EVERY_S)
            continue
        if not env.ok:
            return env
        page = env.data
        assert isinstance(page, LogPage), "logs answers a LogPage"
        for ln in page.lines:
            print(_encoder.encode(ln).decode() if args.json else run_view.log_line(ln), flush=True)
        since = page.next
        status = await _call(args, API["status"], StatusRequest(run_id=req.run_id))
        ended = (
            status is not None
            and status.ok
            and isinstance(status.data, RunView)
            and status.data.state in TERMINAL_STATES
        )
        if ended and not page.lines:
            return Envelope(
                ok=True,
                live_api_contacted=True,
                notice=None,
                data=LogsFollowed(run_id=req.run_id, next=since),
            )
        await asyncio.sleep(POLL_EVERY_S)
