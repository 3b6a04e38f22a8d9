"""The desk's web app (Starlette): three pages, their live event streams, /metrics, and the login.

Everything but the login page, the static files and /healthz needs the operator token: as the
session cookie that logging in sets (an HMAC of the token, HttpOnly, SameSite=Strict), or as
`Authorization: Bearer <token>` (Prometheus, scripts). A missing or wrong token gets 401 and
nothing else. The token is never logged, never in a URL the server sees, never in a page.

Each page's stream (`/events/...`, server-sent events) renders the page's sections once per TICK_S
and sends each section whose HTML changed; the page's script swaps it in (services/desk/pages.py).
"""

import asyncio
import functools
import hashlib
import hmac
import json
import logging
import pathlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from html import escape
from urllib.parse import parse_qs

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from runtime.messaging.metrics import authorized as bearer
from services.desk import board, pages
from services.desk.gauges import exposition
from services.desk.source import DeskSource, NotFound, Unavailable

log = logging.getLogger("ito.desk.web")

TICK_S = 1.0  # a page's sections are rendered again this often while it is open
STREAM_MAX_S = 3600.0  # a stream ends after an hour; the browser reconnects by itself
KEEPALIVE_S = 15.0
MAX_FORM_BYTES = 4096
COOKIE = "ito_desk_session"
STATIC = pathlib.Path(__file__).parent / "static"
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def session_value(token: str) -> str:
    """The cookie's value: proof of the token without being it (a leaked cookie is not the token)."""
    return hmac.new(token.encode(), b"ito-desk-session", hashlib.sha256).hexdigest()


def authorized(headers: Mapping[str, str], cookies: Mapping[str, str], token: str) -> bool:
    """Bearer token (runtime/messaging/metrics.py's check) or session cookie, compared in constant
    time; anything else is refused."""
    if bearer(headers, token):
        return True
    cookie = cookies.get(COOKIE, "")
    return (
        bool(token) and bool(cookie) and hmac.compare_digest(cookie.encode(), session_value(token).encode())
    )


def _html(text: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(text, status_code=status, headers=HEADERS)


def _notice(title: str, text: str, status: int) -> HTMLResponse:
    """A page of one sentence, with no stream: a run that is not there, or cannot be read now."""
    return _html(pages.layout(title, {"summary": f"<p>{escape(text)}</p>"}, ["summary"], "", title), status)


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


Handler = Callable[[Request], Awaitable[Response]]
Render = Callable[[], Awaitable[pages.Sections]]  # a page's sections, rendered now


async def _changed_sections(request: Request, sections: Render) -> AsyncIterator[str]:
    """A page's stream: every TICK_S, each section whose HTML changed since it was last sent (a
    keepalive when nothing was for KEEPALIVE_S), until the client leaves or STREAM_MAX_S is up."""
    sent: dict[str, str] = {}
    began = last = time.monotonic()
    yield "retry: 2000\n\n"
    while time.monotonic() - began < STREAM_MAX_S and not await request.is_disconnected():
        try:
            current = await sections()
        except (Unavailable, NotFound) as exc:
            yield _sse("problem", {"message": str(exc)})
            current = {}
        for sid, html in current.items():
            if sent.get(sid) != html:
                sent[sid] = html
                yield _sse("section", {"id": sid, "html": html})
                last = time.monotonic()
        if time.monotonic() - last > KEEPALIVE_S:
            yield ": keepalive\n\n"
            last = time.monotonic()
        await asyncio.sleep(TICK_S)


def _stream(request: Request, sections: Render) -> Response:
    return StreamingResponse(
        _changed_sections(request, sections),
        media_type="text/event-stream",
        headers={**HEADERS, "X-Accel-Buffering": "no"},
    )


async def login_form(request: Request) -> Response:
    return _html(pages.login_page())


async def logout(request: Request) -> Response:
    response = RedirectResponse("/login", status_code=303, headers=HEADERS)
    response.delete_cookie(COOKIE, path="/")
    return response


async def healthz(request: Request) -> Response:
    return PlainTextResponse("ok", headers=HEADERS)


async def _form_token(request: Request) -> str | None:
    """The login form's token (empty when it names none); None when the body is over MAX_FORM_BYTES."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            return None
    return parse_qs(body.decode("utf-8", "replace")).get("token", [""])[0].strip()


class Desk:
    """The desk's handlers over one source: `routes` is the table of what answers where. `token` is
    the operator token (from its 0600 file); `scrape_token`, the stack's metrics token, is let in
    to /metrics too (one credential scrapes every target)."""

    def __init__(self, source: DeskSource, token: str, scrape_token: str = "") -> None:
        self.source = source
        self.token = token
        self.scrape_token = scrape_token

    def routes(self) -> list[Route | Mount]:
        guarded = self.guarded
        return [
            Route("/", guarded(self.runs_page)),
            Route("/runs/{run_id}", guarded(self.run_page)),
            Route("/desk", guarded(self.desk_page)),
            Route("/events/runs", guarded(self.runs_events)),
            Route("/events/run/{run_id}", guarded(self.run_events)),
            Route("/events/desk", guarded(self.desk_events)),
            Route("/metrics", guarded(self.metrics)),
            Route("/login", login_form, methods=["GET"]),
            Route("/login", self.login, methods=["POST"]),
            Route("/logout", logout, methods=["POST"]),
            Route("/healthz", healthz),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ]

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.source.start()
        try:
            yield
        finally:
            await self.source.close()

    # --- who is let in ---

    def refused(self, request: Request) -> Response | None:
        """None for the operator (and for the scrape token at /metrics); else the 401 answer: plain
        text for a scrape or a stream, the login page for a page."""
        path = request.url.path
        if authorized(request.headers, request.cookies, self.token):
            return None
        if path == "/metrics" and bearer(request.headers, self.scrape_token):
            return None
        if path in ("/metrics",) or path.startswith("/events/"):
            return PlainTextResponse("unauthenticated", status_code=401, headers=HEADERS)
        return _html(pages.login_page("Log in with the operator token."), 401)

    def guarded(self, handler: Handler) -> Handler:
        """`handler`, answered only once `refused` let the request in (nothing is read before)."""

        @functools.wraps(handler)
        async def guard(request: Request) -> Response:
            no = self.refused(request)
            return no if no is not None else await handler(request)

        return guard

    async def login(self, request: Request) -> Response:
        given = await _form_token(request)
        if given is None:
            return _html(pages.login_page("That is not a token."), 413)
        if not given or not hmac.compare_digest(given.encode(), self.token.encode()):
            log.warning("a login with a wrong token was refused")
            return _html(pages.login_page("Wrong token."), 401)
        response = RedirectResponse("/", status_code=303, headers=HEADERS)
        response.set_cookie(COOKIE, session_value(self.token), httponly=True, samesite="strict", path="/")
        return response

    # --- each page's sections, rendered now ---

    async def _fresh_runs(self) -> None:
        """The run list read now when nobody kept it fresh (a page or a scrape after a quiet spell)."""
        if self.source.runs_stale():
            await self.source.refresh_runs()

    async def runs_sections(self) -> pages.Sections:
        source = self.source
        source.want_runs()
        views = source.runs.runs if source.runs else []
        telemetry = {v.run_id: t for v in views if (t := source.telemetry(v.run_id)) is not None}
        sections = pages.runs_sections(board.run_rows(views, telemetry, datetime.now(UTC)))
        if source.problem:
            sections["runs"] = f'<p class="error">{escape(source.problem)}</p>' + sections["runs"]
        return sections

    async def run_sections(self, run_id: str) -> pages.Sections:
        detail = await self.source.detail(run_id)
        t = self.source.telemetry(run_id)
        return pages.run_sections(detail, datetime.now(UTC), None if t is None else t.goodput)

    async def desk_sections(self) -> pages.Sections:
        source = self.source
        source.want_runs()
        prices = source.runs.prices if source.runs else {}
        return pages.desk_sections(board.breakdowns(source.rollups, source.finished, prices), prices)

    # --- the pages, their streams and the scrape (each behind `guarded`) ---

    async def runs_page(self, request: Request) -> Response:
        await self._fresh_runs()
        sections = await self.runs_sections()
        return _html(pages.layout("Runs", sections, pages.RUNS_ORDER, "/events/runs", "Runs"))

    async def run_page(self, request: Request) -> Response:
        run_id = request.path_params["run_id"]
        try:
            sections = await self.run_sections(run_id)
        except NotFound:
            return _notice("Not found", "No such run.", 404)
        except Unavailable as exc:
            return _notice("Unavailable", str(exc), 503)
        return _html(
            pages.layout(run_id, sections, pages.RUN_ORDER, f"/events/run/{run_id}", f"Run {run_id}")
        )

    async def desk_page(self, request: Request) -> Response:
        await self._fresh_runs()
        sections = await self.desk_sections()
        return _html(pages.layout("Desk", sections, pages.DESK_ORDER, "/events/desk", "The desk"))

    async def runs_events(self, request: Request) -> Response:
        return _stream(request, self.runs_sections)

    async def run_events(self, request: Request) -> Response:
        return _stream(request, functools.partial(self.run_sections, request.path_params["run_id"]))

    async def desk_events(self, request: Request) -> Response:
        return _stream(request, self.desk_sections)

    async def metrics(self, request: Request) -> Response:
        await self._fresh_runs()
        self.source.want_runs()
        body, content_type = exposition(self.source)
        return Response(body, media_type=content_type, headers=HEADERS)


def build(source: DeskSource, token: str, scrape_token: str = "") -> Starlette:
    """The app over `source` (see `Desk` for the tokens)."""
    desk = Desk(source, token, scrape_token)
    return Starlette(routes=desk.routes(), lifespan=desk.lifespan)
