"""What a person (or a tool, with --json) sees: envelopes, and progress while following a run.

Every answer arrives decoded into its type (contracts/endpoints.py names each verb's); `text`
picks its renderer by that type with `match`, never by the keys it happens to have. The two
answers `ecc` makes itself (logout's, and the end of `logs --follow`) are typed here.

A person at a terminal (`on_terminal`: stdout is a TTY and no --json) gets pictures: a followed
run's bars (ecc/progress.py, the only module that loads rich) and each stage's loss sparkline
(ecc/charts.py). A pipe gets the plain lines scripts parse, unchanged; --json its events.
"""

import argparse
import asyncio
import math
import sys
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, assert_never

import msgspec

from contracts.api import (
    BOOKING_ACTIONS,
    FILE_ACTIONS,
    AuthInfo,
    BookingView,
    CleanupResult,
    ConfirmationIssued,
    LogLineView,
    LogPage,
    LogsRequest,
    MetricsRequest,
    ModelList,
    MutationResult,
    RunAccepted,
    RunList,
    RunSummary,
    RunView,
    StatusRequest,
)
from contracts.audit import AuditTrail
from contracts.endpoints import API, Endpoint
from contracts.envelope import Envelope
from contracts.exports import DownloadChunk, ExportFile, ExportView, SampleResult
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
from ecc import charts, files_view
from ecc.gates import bound, gate_line
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


class Downloaded(msgspec.Struct, frozen=True, kw_only=True):
    """`ecc ito download`'s answer (ecc/download.py): where the export is now, and that its
    digest, recomputed from the files on disk, is the export's."""

    run_id: str
    export_id: str
    directory: str
    digest: str
    files: list[ExportFile]
    bytes: int
    fetched_bytes: int  # sent over the wire by this call (the rest was on disk already)


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


def _auth(info: AuthInfo) -> str:
    """Who, then the account's quotas: each limit beside what it uses now."""
    lines = [f"logged in as {info.account} (key {info.key_id})"]
    if info.quotas is not None:
        lim, use = info.quotas.limits, info.quotas.usage
        confirmations = "?" if use.confirmations is None else str(use.confirmations)
        lines += [
            "quotas (in use / limit):",
            f"  requests       {lim.rate_per_s:g}/s, bursts of {lim.burst} ({use.tokens:g} available now)",
            f"  confirmations  {confirmations} / {lim.confirmations} outstanding",
            f"  runs           {use.runs} / {lim.runs} unfinished",
            f"  queued         {use.queued} / {lim.queued} waiting for a trainer",
        ]
        if lim.files:  # 0: a scheduler from before uploads
            lines.append(
                f"  files          {use.files} / {lim.files} ({files_view.size(use.file_bytes)} of "
                f"{files_view.size(lim.file_bytes)}), models {use.models} / {lim.models}"
            )
    return "\n".join(lines)


def text(answer: Answer | None, terminal: bool = False) -> str:
    """An answer as lines for a person, by its type. `terminal`: a person reads them, not a script:
    metrics are a loss sparkline per stage (ecc/charts.py) instead of one line per point."""
    match answer:
        case AuthInfo():
            return _auth(answer)
        case list():  # the one answer that is a list: find's list[BookingView]
            return _bookings(answer)
        case Plan():
            return _plan(answer)
        case ConfirmationIssued():
            return _confirmation(answer)
        case RunAccepted() | MutationResult():
            return f"run {answer.run_id}: {answer.state}"
        case RunView():
            return _run(answer)
        case RunList():
            return _runs(answer)
        case LogPage():
            return "\n".join(_line(ln) for ln in answer.lines) or "(no lines)"
        case AuditTrail():
            return _decisions(answer)
        case MetricsPage():
            return _curves(answer) if terminal else _points(answer)
        case CheckpointList():
            return _checkpoints(answer)
        case EvalList():
            return _evals(answer)
        case CleanupResult():
            return _cleanup(answer)
        case ExportView():
            return _export(answer)
        case DownloadChunk():
            return f"{answer.path}: {len(answer.data)} bytes at {answer.offset} of {answer.size} (sha256 {answer.sha256})"
        case SampleResult():
            return answer.text
        case Downloaded():
            return _downloaded(answer)
        case ModelList():
            return _models(answer)
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


def _when(at: datetime) -> str:
    """A time as the wire spells it (RFC 3339, `Z` for UTC)."""
    return _encoder.encode(at).decode().strip('"')


def _line(ln: LogLineView) -> str:
    return f"{_when(ln.at)} {ln.level}: {ln.message}"


def _bookings(views: list[BookingView]) -> str:
    rows = []
    for v in views:
        b, t = v.booking, v.booking.topology
        allows = "allows training" if v.allows_training else f"no training: {v.reason}"
        rows.append(
            f"{b.booking_id}: {b.state}, {t.nodes}x{t.gpus_per_node} {t.gpu_model}, "
            f"{b.fabric}, {b.region}, until {_when(b.window_end)} ({allows})"
        )
    return "\n".join(rows) or "(no bookings)"


def _usd(amount: float) -> str:
    """Dollars to the cent, or to two significant digits below a cent (a tiny run costs 0.00018 USD,
    not 0.00)."""
    if amount >= 0.01 or amount <= 0:
        return f"{amount:.2f} USD"
    digits = min(12, 1 - math.floor(math.log10(amount)))
    return f"{amount:.{digits}f} USD"


def gpu_time(gpu_hours: float) -> str:
    """GPU time in the unit that reads: GPU-seconds under a GPU-minute, GPU-minutes under a
    GPU-hour, GPU-hours above (a tiny run is "28 GPU-s", not "0.0000 GPU-h")."""
    seconds = gpu_hours * 3600
    if seconds < 60:
        return f"{seconds:.2g} GPU-s" if seconds < 10 else f"{seconds:.0f} GPU-s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} GPU-min"
    return f"{gpu_hours:,.2f} GPU-h"


def _confirmation(issued: ConfirmationIssued) -> str:
    """What the person just authorised, every bound of it: the reference, then the action and its
    target, the manifest (by digest) and the most it may cost, where bound, and when it expires."""
    target = (
        "booking" if issued.action in BOOKING_ACTIONS else "file" if issued.action in FILE_ACTIONS else "run"
    )
    rows = [
        f"confirmation_ref: {issued.confirmation_ref}",
        f"  authorises: {issued.action.value} on {target} {issued.target}, once",
    ]
    if issued.manifest_digest:
        rows.append(f"  manifest: sha256 {issued.manifest_digest}")
    if issued.max_cost_usd is not None:
        rows.append(f"  cost bound: at most {_usd(issued.max_cost_usd)}")
    rows.append(f"  expires: {_when(issued.expires_at)}")
    return "\n".join(rows)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Columns as wide as their widest cell, two spaces apart; the last one unpadded."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]
    ]


def _run_row(run: RunSummary) -> list[str]:
    progress = f"{run.step}/{run.total_steps}" if run.total_steps else "-"
    loss = "-" if run.loss is None else f"{run.loss:.4f}"
    cost = "-" if run.estimate_usd is None else _usd(run.estimate_usd).removesuffix(" USD")
    return [
        run.run_id,
        str(run.state),
        run.booking_id,
        run.stage or "-",
        progress,
        loss,
        cost,
        f"{run.created_at.astimezone(UTC):%Y-%m-%d %H:%M:%S}",
        run.idempotency_key,
    ]


def _runs(page: RunList) -> str:
    """One row per run, newest first, then where the next page starts when there is one."""
    header = ["RUN", "STATE", "BOOKING", "STAGE", "STEP", "LOSS", "EST USD", "CREATED (UTC)", "KEY"]
    rows = _table(header, [_run_row(r) for r in page.runs]) if page.runs else ["(no runs)"]
    if page.next is not None:
        rows.append(f"more: the same command with --cursor {page.next}")
    return "\n".join(rows)


def _run(view: RunView) -> str:
    """A run's view: one line of state and progress, then one indented line per detail it has."""
    line = f"run {view.run_id}: {view.state}"
    if view.stage:
        line += f" (stage {view.stage}, step {view.step}/{view.total_steps}"
        if view.loss is not None:
            line += f", loss {view.loss:.4f}"
        line += ")"
    if view.message:
        line += f"\n  {view.message}"
    for gate in view.gates:
        line += f"\n  {gate_line(gate)}"
    if view.provenance:
        steps = ", ".join(f"{s.name} {s.before}->{s.after}" for s in view.provenance.steps)
        line += f"\n  data: {steps}"
    if view.proposal:
        p = view.proposal
        line += (
            f"\n  proposal ({p.reason}): restart {p.stage} from checkpoint step {p.checkpoint_step}, "
            f"skipping batches [{p.skip_from}, {p.skip_to}); approve with "
            f"`ecc ito confirm --action restart_from_checkpoint --run {view.run_id}` then `ecc ito approve`"
        )
    if view.parallelism:
        used = view.parallelism
        mesh = " x ".join(f"{dim} {size}" for dim, size in used.mesh.items()) or "none"
        line += f"\n  parallelism: {used.strategy}, world size {used.world_size}, mesh {mesh}"
        if view.nodes > 1:
            line += f", {view.nodes} nodes"
    if view.plan:
        line += f"\n  plan: {view.plan.strategy}, estimate {_usd(view.plan.cost.total_usd)}"
    if view.spend is not None and view.spend.held_gpu_s > 0:
        sp = view.spend
        line += (
            f"\n  spent: {sp.spent_usd:.6f} USD of its limit {sp.limit_usd:.6f} USD "
            f"({sp.held_gpus} GPU(s) held {sp.held_gpu_s / max(sp.held_gpus, 1):.1f}s)"
        )
    return line


def _points(page: MetricsPage) -> str:
    return (
        "\n".join(
            f"{p.stage} step {p.step}/{p.total_steps} loss {p.loss:.4f} "
            f"lr {p.learning_rate:.2e} {p.tokens_per_s:.0f} tok/s"
            for p in page.points
        )
        or "(none)"
    )


def _curves(page: MetricsPage) -> str:
    return "\n".join(charts.stage_lines(page.points)) or "(none)"


def _checkpoints(listed: CheckpointList) -> str:
    rows = [
        f"step {c.step}: {c.bytes / 1e6:.1f} MB, loop stalled {c.stall_s * 1000:.1f} ms, "
        f"saved in {c.save_s:.2f} s  {c.path}"
        for c in listed.checkpoints
    ]
    return "\n".join(rows) or ("(removed by cleanup)" if listed.cleaned_up else "(none yet)")


def _evals(listed: EvalList) -> str:
    rows = []
    for g in listed.gates:
        rows.append(f"{g.stage}: {'passed' if g.passed else 'FAILED'}")
        rows += [
            f"  {m.name} = {m.value:.4f} ({bound(m)}) {'ok' if m.passed else 'FAIL'}"
            + (f"\n    {m.sentence}" if m.sentence else "")
            for m in g.metrics
        ]
        rows += [f"  finding: {f}" for f in g.findings]
    return "\n".join(rows) or "(no stage has been evaluated yet)"


def _cleanup(result: CleanupResult) -> str:
    rows = [f"removed {a.path} ({a.bytes} bytes)" for a in result.removed]
    rows.append(
        f"{len(result.removed)} artifacts removed; booking release requested: "
        f"{result.booking_release_requested}"
    )
    return "\n".join(rows)


def _export(view: ExportView) -> str:
    line = f"export {view.export_id or view.stage + '-' + view.format}: {view.state}"
    if view.step:
        line += f" (stage {view.stage}, step {view.step})"
    if view.message:
        line += f"\n  {view.message}"
    if view.state == "ready":
        line += f"\n  digest {view.digest}, {len(view.files)} files, {view.bytes} bytes"
        line += "".join(f"\n  {f.path} ({f.bytes} bytes)" for f in view.files)
        line += f"\n  fetch it with `ecc ito download {view.run_id} --export {view.export_id} --to DIR`"
    return line


def _downloaded(done: Downloaded) -> str:
    rows = [f"{f.path} ({f.bytes} bytes)" for f in done.files]
    rows.append(
        f"export {done.export_id} in {done.directory}: {len(done.files)} files, {done.bytes} bytes "
        f"({done.fetched_bytes} fetched), digest {done.digest} verified"
    )
    return "\n".join(rows)


def _models(listed: ModelList) -> str:
    rows = [
        f"{m.name}: {m.digest} ({m.architecture}, {m.parameters:,} parameters, vocab {m.vocab_size:,}, "
        f"context {m.max_seq_len:,}"
        + ("" if m.tokenizer else ", no tokenizer")
        + (", chat template" if m.chat_template else "")
        + ")"
        for m in listed.models
    ]
    return "\n".join(rows) or "(no models for this account)"


def _decisions(trail: AuditTrail) -> str:
    return (
        "\n".join(f"{_when(d.at)} {d.gate}: {'pass' if d.ok else f'FAIL {d.code}'}" for d in trail.decisions)
        or "(no decisions)"
    )


def _degrees(degrees: dict[str, int]) -> str:
    """A plan's parallel degrees in words: `dp_replicate 2 x dp_shard 2 (4 ranks)`."""
    used = {dim: size for dim, size in degrees.items() if size > 1}
    if not used:
        return "one process"
    ranks = 1
    for size in used.values():
        ranks *= size
    return " x ".join(f"{dim} {size}" for dim, size in used.items()) + f" ({ranks} ranks)"


def _capacity(plan: Plan) -> list[str]:
    """The booking's GPUs as the plan states them: held, idle, their cost, and the suggestion when
    most stay idle (the window is the `booking_window` check's line)."""
    return [] if plan.capacity is None else [f"GPUs: {plan.capacity.sentence}"]


def _plan(plan: Plan) -> str:
    cost = plan.cost
    rows = [
        f"strategy {plan.strategy}, {_degrees(plan.degrees)}, precision {plan.precision}",
        f"estimate {_usd(cost.total_usd)} ({gpu_time(cost.gpu_hours)} at "
        f"{cost.price_per_gpu_hour_usd:.2f} USD per GPU-hour)",
    ]
    rows += _capacity(plan)
    rows += _estimate_basis(plan)
    rows += [f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.reason}" for c in plan.checks]
    rows += [f"  gate {g.stage}: " + "; ".join(g.rules) for g in plan.gates]
    return "\n".join(rows)


def _estimate_basis(plan: Plan) -> list[str]:
    """What the estimate stands on: the wall seconds by phase and where its figures come from."""
    cost = plan.cost
    if not cost.phases_s:  # FLOPs at the assumed MFU alone: the line above says all there is
        return []
    phases = ", ".join(f"{name} {s:.1f}s" for name, s in cost.phases_s.items() if s > 0)
    return [
        f"  basis: {cost.wall_s:.1f}s held x {cost.gpus} GPU(s) ({phases}); figures: {cost.basis}",
        "  spend is metered while the run runs: it stops with a checkpoint before budget_cap_usd is crossed",
    ]


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
            print(_encoder.encode(ln).decode() if args.json else _line(ln), flush=True)
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
