"""Where the desk app's data comes from: the desk identity's NATS connection, and nothing else.

As `desk` it may (runtime/security/identities.py): ask the scheduler's two desk reads (every run;
one run in detail), replay the DESK stream (finished runs' accounting and the rollups) and hear
telemetry's live snapshots of running runs. No Redis, no tenant verb, no write of any kind.

`DeskSource` keeps what the pages need in memory: the run list (asked again every RUNS_EVERY_S by
one loop, whoever is looking), each open run's detail (asked again at most every DETAIL_EVERY_S,
and only for what is new), and every telemetry record heard. Every request is bounded.
"""

import asyncio
import logging
import time
from typing import Any

import msgspec

from contracts import subjects
from contracts.desk import DeskRun, DeskRunRequest, DeskRuns, DeskRunsRequest
from contracts.endpoints import DESK, Endpoint
from contracts.errors import ErrorCode
from contracts.telemetry import Rollup, RunTelemetry
from runtime.configuration.settings import Settings, nats_servers
from runtime.messaging import codec
from runtime.messaging.codec import Refusal
from runtime.messaging.connections import nats_auth
from runtime.security.identities import DESK as DESK_IDENTITY
from services.desk.board import RunDetail

log = logging.getLogger("ito.desk.source")

RUNS_EVERY_S = 1.0  # the run list is asked again this often (one request for every open page)
DETAIL_EVERY_S = 0.5  # an open run's detail at most this often, whatever the number of viewers
DETAIL_IDLE_S = 300.0  # a run nobody has looked at for this long is dropped from memory
MAX_DETAILS = 100
RUN_LIST_LIMIT = 200  # the runs page's newest runs (each a whole view: ~2-5 KB to read and decode)
WANTED_S = 10.0  # the run list is kept fresh while a page, a stream or a scrape asked within this long


class Unavailable(Exception):
    """The scheduler did not answer (in time); the message is safe to show."""


class NotFound(Exception):
    """No such run."""


_rollup = msgspec.json.Decoder(Rollup)
_telemetry = msgspec.json.Decoder(RunTelemetry)


class DeskSource:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.timeout_s = settings.request_timeout_s
        self.runs: DeskRuns | None = None
        self.problem = ""  # why the run list is not fresh, for the page (empty when it is)
        self.finished: dict[str, RunTelemetry] = {}  # run id -> its final accounting (DESK stream)
        self.live: dict[str, RunTelemetry] = {}  # run id -> its accounting so far (live snapshots)
        self.rollups: dict[tuple[str, str], Rollup] = {}
        self._details: dict[str, tuple[RunDetail, float, float]] = {}  # run -> (detail, asked, seen)
        self._locks: dict[str, asyncio.Lock] = {}
        self._nc: Any = None
        self._tasks: list[asyncio.Task] = []
        self._wanted = 0.0  # when a reader last needed the run list (monotonic)

    async def start(self) -> None:
        import nats

        async def errored(exc: Exception) -> None:  # permission violations arrive here only
            log.warning("NATS: %s", exc)

        self._nc = await nats.connect(
            nats_servers(self.settings.nats_url),
            connect_timeout=2,
            name="desk",
            error_cb=errored,
            **nats_auth(self.settings, DESK_IDENTITY),
        )
        if not self._nc._server_info.get("auth_required"):
            await self._nc.close()
            raise RuntimeError("the NATS server does not require authentication; refusing it")
        if self.settings.tls and not self._nc._server_info.get("tls_required"):
            await self._nc.close()
            raise RuntimeError("the NATS server does not speak TLS; refusing it")
        await self._follow_stream()
        await self._nc.subscribe(self.settings.desk_live_root() + ".*", cb=self._on_live)
        self._tasks.append(asyncio.create_task(self._refresh_runs_forever()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._nc is not None:
            await self._nc.close()

    async def _follow_stream(self) -> None:
        """Replay DESK from its start and keep following it (an ordered consumer of our own)."""
        from nats.js.api import ConsumerConfig, DeliverPolicy

        root = self.settings.desk_subject_root()
        js = self._nc.jetstream(timeout=self.timeout_s)

        async def on_message(msg: Any) -> None:
            kind = msg.subject[len(root) + 1 :].split(".", 1)[0]
            try:
                if kind == "rollup":
                    r = _rollup.decode(msg.data)
                    self.rollups[(r.by, r.key)] = r
                elif kind == "run":
                    t = _telemetry.decode(msg.data)
                    self.finished[t.run_id] = t
                    self.live.pop(t.run_id, None)
            except (msgspec.ValidationError, msgspec.DecodeError):
                log.warning("DESK: a message on %s could not be read; skipped", msg.subject)

        await js.subscribe(
            root + ".>",
            ordered_consumer=True,
            stream=self.settings.stream(subjects.STREAM_DESK),  # no stream lookup: not ours to ask
            config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
            cb=on_message,
        )

    async def _on_live(self, msg: Any) -> None:
        try:
            t = _telemetry.decode(msg.data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return
        if t.run_id not in self.finished:
            self.live[t.run_id] = t

    def telemetry(self, run_id: str) -> RunTelemetry | None:
        return self.finished.get(run_id) or self.live.get(run_id)

    async def _ask(self, endpoint: Endpoint[Any, Any], request: Any) -> Any:
        from nats.errors import NoRespondersError
        from nats.errors import TimeoutError as NatsTimeout

        try:
            reply = await self._nc.request(
                self.settings.subject(endpoint.subject), msgspec.json.encode(request), timeout=self.timeout_s
            )
        except (NoRespondersError, NatsTimeout, TimeoutError):
            raise Unavailable("the scheduler did not answer in time") from None
        try:
            return codec.unwrap(reply.data, endpoint.answer)
        except (msgspec.ValidationError, msgspec.DecodeError, AssertionError):
            raise Unavailable("the scheduler's answer could not be read") from None
        except Refusal as refusal:
            if refusal.code is ErrorCode.run_not_found:
                raise NotFound(refusal.message) from None
            raise Unavailable(f"the scheduler refused: {refusal.code.value}") from None

    async def refresh_runs(self) -> None:
        try:
            self.runs = await self._ask(DESK["runs"], DeskRunsRequest(limit=RUN_LIST_LIMIT))
            self.problem = ""
        except Unavailable as exc:
            self.problem = str(exc)

    def runs_stale(self) -> bool:
        """No run list yet, or nobody asked for it lately (so the loop has not kept it fresh)."""
        return self.runs is None or time.monotonic() - self._wanted >= WANTED_S

    def want_runs(self) -> None:
        """A reader needs the run list: keep it fresh for the next WANTED_S."""
        self._wanted = time.monotonic()

    async def _refresh_runs_forever(self) -> None:
        """One request every RUNS_EVERY_S, whoever is looking; none while nobody is."""
        while True:
            if time.monotonic() - self._wanted < WANTED_S:
                await self.refresh_runs()
            await asyncio.sleep(RUNS_EVERY_S)

    async def detail(self, run_id: str) -> RunDetail:
        """The run's detail, fresh within DETAIL_EVERY_S (asked for what is new only)."""
        now = time.monotonic()
        lock = self._locks.setdefault(run_id, asyncio.Lock())
        async with lock:
            cached = self._details.get(run_id)
            if cached is not None and now - cached[1] < DETAIL_EVERY_S:
                self._details[run_id] = (cached[0], cached[1], now)
                return cached[0]
            current = cached[0] if cached else None
            page: DeskRun = await self._ask(
                DESK["run"],
                DeskRunRequest(
                    run_id=run_id,
                    metrics_since=current.metrics_next if current else 0,
                    logs_since=current.logs_next if current else 0,
                    audit=current.audit_due() if current else True,
                ),
            )
            detail = current or RunDetail(view=page.view)
            detail.merge(page)
            self._details[run_id] = (detail, now, now)
            self._forget_idle(now)
            return detail

    def _forget_idle(self, now: float) -> None:
        idle = [r for r, (_, _, seen) in self._details.items() if now - seen > DETAIL_IDLE_S]
        by_age = sorted(self._details, key=lambda r: self._details[r][2])
        for run_id in idle + by_age[: max(0, len(self._details) - MAX_DETAILS)]:
            self._details.pop(run_id, None)
            self._locks.pop(run_id, None)
