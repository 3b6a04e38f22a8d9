"""The desk's web app in-process (no browser, no NATS, no socket): each route's answer, status,
headers and auth, driven straight through ASGI over a source held in memory. The browser test
(tests/e2e/test_desk_browser.py) drives the same app over a real stack."""

import asyncio
import json
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from contracts.api import RunView
from contracts.desk import DeskRuns
from contracts.states import RunState
from services.desk import web
from services.desk.board import RunDetail
from services.desk.source import DeskSource, NotFound, Unavailable

TOKEN = "operator-token-0123456789"
SCRAPE = "scrape-token-0123456789"
T0 = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def run_view(run_id: str = "run_1", state: RunState = RunState.running) -> RunView:
    return RunView(
        run_id=run_id,
        account="acme",
        booking_id="bk",
        manifest_digest="d",
        idempotency_key="k",
        state=state,
        created_at=T0,
        updated_at=T0 + timedelta(minutes=5),
    )


class MemorySource(DeskSource):
    """What the pages read, in memory: one run ("run_1"); "gone" is no run, "away" an unanswered ask."""

    def __init__(self) -> None:  # no settings, no connection: nothing here reaches NATS
        self.runs = DeskRuns(runs=[run_view()], prices={"H200": 3.5}, at=T0)
        self.problem = ""
        self.finished, self.live, self.rollups = {}, {}, {}
        self._wanted = 0.0
        self.refreshed = 0
        self.lifecycle: list[str] = []

    async def start(self) -> None:
        self.lifecycle.append("start")

    async def close(self) -> None:
        self.lifecycle.append("close")

    async def refresh_runs(self) -> None:
        self.refreshed += 1

    async def detail(self, run_id: str) -> RunDetail:
        if run_id == "gone":
            raise NotFound("no such run")
        if run_id == "away":
            raise Unavailable("the scheduler did not answer in time")
        return RunDetail(view=run_view(run_id, RunState.succeeded))  # ended: its sections hold still


class Answer(msgspec.Struct):
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k == name.lower()), None)

    def cookies(self) -> list[str]:
        return [v for k, v in self.headers if k == "set-cookie"]

    @property
    def text(self) -> str:
        return self.body.decode()


async def ask(
    app,
    path: str,
    method: str = "GET",
    headers: Iterable[tuple[str, str]] = (),
    body: bytes = b"",
    stream_s: float = 0.0,
) -> Answer:
    """One request through ASGI; a stream is read for `stream_s` seconds, then the client leaves."""
    sent: list[dict] = []
    leave = asyncio.Event()
    asked = False

    async def receive() -> dict:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": body, "more_body": False}
        await leave.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.start" and stream_s:
            asyncio.get_running_loop().call_later(stream_s, leave.set)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            leave.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8765),
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    start = next(m for m in sent if m["type"] == "http.response.start")
    return Answer(
        status=start["status"],
        headers=[(k.decode().lower(), v.decode()) for k, v in start["headers"]],
        body=b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"),
    )


@pytest.fixture
def source() -> MemorySource:
    return MemorySource()


@pytest.fixture
def app(source, monkeypatch):
    monkeypatch.setattr(web, "TICK_S", 0.01)
    return web.build(source, TOKEN, SCRAPE)


BEARER = [("Authorization", f"Bearer {TOKEN}")]
SESSION = [("Cookie", f"{web.COOKIE}={web.session_value(TOKEN)}")]
GUARDED = ["/", "/runs/run_1", "/desk", "/metrics", "/events/runs", "/events/run/run_1", "/events/desk"]


REFUSED = [
    [],
    [("Authorization", "Bearer wrong")],
    [("Cookie", f"{web.COOKIE}={TOKEN}")],  # the token itself is not the session
    [("Authorization", f"Bearer {SCRAPE}")],  # the scrape token opens /metrics alone
]


@pytest.mark.parametrize(
    "path, headers",
    [(p, h) for p in GUARDED for h in REFUSED if not (p == "/metrics" and h == REFUSED[-1])],
)
async def test_without_the_operator_token_a_guarded_path_answers_401_and_nothing_else(
    app, source, path, headers
):
    out = await ask(app, path, headers=headers)
    assert out.status == 401
    assert out.header("cache-control") == "no-store" and out.header("x-content-type-options") == "nosniff"
    assert "frame-ancestors 'none'" in (out.header("content-security-policy") or "")
    if path == "/metrics" or path.startswith("/events/"):
        assert out.text == "unauthenticated"
    else:
        assert "Log in with the operator token." in out.text and 'id="login"' in out.text
    assert "run_1" not in out.text and TOKEN not in out.text
    assert source.refreshed == 0  # nothing was read on a refused request's behalf


@pytest.mark.parametrize("credential", [BEARER, SESSION])
async def test_the_pages_answer_the_operator(app, source, credential):
    runs = await ask(app, "/", headers=credential)
    assert runs.status == 200 and runs.header("content-type") == "text/html; charset=utf-8"
    assert 'data-events="/events/runs"' in runs.text and 'data-run="run_1"' in runs.text
    assert source.refreshed == 1  # a stale list is read before the page
    desk = await ask(app, "/desk", headers=credential)
    assert (
        desk.status == 200 and 'data-events="/events/desk"' in desk.text and "<h1>The desk</h1>" in desk.text
    )
    run = await ask(app, "/runs/run_1", headers=credential)
    assert (
        run.status == 200
        and 'data-events="/events/run/run_1"' in run.text
        and "<h1>Run run_1</h1>" in run.text
    )
    assert all(a.header("cache-control") == "no-store" for a in (runs, desk, run))


async def test_a_fresh_run_list_is_not_read_again_and_a_problem_is_shown(app, source):
    source.want_runs()
    source.problem = "the scheduler <did not> answer"
    out = await ask(app, "/", headers=BEARER)
    assert source.refreshed == 0
    assert '<p class="error">the scheduler &lt;did not&gt; answer</p>' in out.text


async def test_a_run_that_is_not_there_or_cannot_be_read_says_so(app):
    gone = await ask(app, "/runs/gone", headers=BEARER)
    assert gone.status == 404 and "<p>No such run.</p>" in gone.text and 'data-events=""' in gone.text
    away = await ask(app, "/runs/away", headers=BEARER)
    assert away.status == 503 and "<p>the scheduler did not answer in time</p>" in away.text
    assert gone.header("cache-control") == away.header("cache-control") == "no-store"


async def test_metrics_let_in_the_operator_and_the_scrape_token(app, source):
    for credential in (BEARER, [("Authorization", f"Bearer {SCRAPE}")]):
        out = await ask(app, "/metrics", headers=credential)
        assert out.status == 200 and out.header("cache-control") == "no-store"
        assert (out.header("content-type") or "").startswith("text/plain")
        names = {f.name for f in text_string_to_metric_families(out.text)}
        assert "ito_desk_runs" in names
    assert source.refreshed == 1  # the first scrape read the list; the second found it fresh


def sse(text: str) -> list[tuple[str, dict]]:
    events = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        if "event" in lines:
            events.append((lines["event"], json.loads(lines["data"])))
    return events


@pytest.mark.parametrize(
    "path, sections",
    [
        ("/events/runs", {"runs"}),
        ("/events/run/run_1", {"summary", "loss", "gates", "timeline", "checkpoints", "provenance"}),
        ("/events/desk", {"breakdown", "interruptions", "bandwidth", "prices"}),
    ],
)
async def test_a_stream_sends_each_section_once_until_it_changes(app, path, sections):
    out = await ask(app, path, headers=SESSION, stream_s=0.3)
    assert out.status == 200 and out.header("content-type") == "text/event-stream; charset=utf-8"
    assert out.header("x-accel-buffering") == "no" and out.header("cache-control") == "no-store"
    assert out.text.startswith("retry: 2000\n\n")
    sent = [data["id"] for event, data in sse(out.text) if event == "section"]
    assert sections <= set(sent) and len(sent) == len(set(sent))  # a section again only when it changed


async def test_a_stream_of_a_run_it_cannot_read_says_the_problem(app):
    out = await ask(app, "/events/run/away", headers=BEARER, stream_s=0.3)
    assert sse(out.text)[0] == ("problem", {"message": "the scheduler did not answer in time"})


async def test_logging_in_sets_the_session_and_logging_out_clears_it(app):
    form = await ask(app, "/login")
    assert form.status == 200 and 'id="login"' in form.text and "error" not in form.text
    wrong = await ask(
        app, "/login", "POST", [("Content-Type", "application/x-www-form-urlencoded")], b"token=x"
    )
    assert wrong.status == 401 and "Wrong token." in wrong.text and wrong.cookies() == []
    empty = await ask(app, "/login", "POST", body=b"token=")
    assert empty.status == 401 and "Wrong token." in empty.text
    big = await ask(app, "/login", "POST", body=b"token=" + b"x" * web.MAX_FORM_BYTES)
    assert big.status == 413 and "That is not a token." in big.text
    good = await ask(app, "/login", "POST", body=f"token=+{TOKEN}+".encode())  # spaces around it trimmed
    assert good.status == 303 and good.header("location") == "/"
    (cookie,) = good.cookies()
    assert cookie.startswith(f"{web.COOKIE}={web.session_value(TOKEN)};") and TOKEN not in cookie
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie
    out = await ask(app, "/logout", "POST")
    assert out.status == 303 and out.header("location") == "/login"
    (cleared,) = out.cookies()
    assert cleared.startswith(f'{web.COOKIE}="";') and "Max-Age=0" in cleared
    assert (await ask(app, "/logout")).status == 405  # GET is no logout
    assert (await ask(app, "/login", "PUT")).status == 405


async def test_healthz_and_the_static_files_need_no_token(app):
    health = await ask(app, "/healthz")
    assert (health.status, health.text, health.header("cache-control")) == (200, "ok", "no-store")
    css = await ask(app, "/static/desk.css")
    assert css.status == 200 and (css.header("content-type") or "").startswith("text/css")
    assert (await ask(app, "/static/nothing.css")).status == 404


async def test_the_app_starts_and_closes_its_source(app, source):
    messages = iter([{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}])
    sent = []

    async def receive():
        return next(messages)

    async def send(message):
        sent.append(message["type"])

    await app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, receive, send)
    assert source.lifecycle == ["start", "close"]
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]
