"""The desk's web app (Starlette): three pages, their live event streams, /metrics, and the login.

Everything but the login page, the static files and /healthz needs the operator token: as the
session cookie that logging in sets (an HMAC of the token, HttpOnly, SameSite=Strict), or as
`Authorization: Bearer <token>` (Prometheus, scripts). A missing or wrong token gets 401 and
nothing else. The token is never logged, never in a URL the server sees, never in a page.

Each page's stream (`/events/...`, server-sent events) renders the page's sections once per TICK_S
and sends each section whose HTML changed; the page's script swaps it in (services/desk/pages.py).
"""

import asyncio
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


def _sse(event: str, data: dict) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


def build(source: DeskSource, token: str, scrape_token: str = "") -> Starlette:
    """The app over `source`; `token` is the operator token (from its 0600 file); `scrape_token`,
    the stack's metrics token, is let in to /metrics too (one credential scrapes every target)."""

    def refused(request: Request) -> Response | None:
        if authorized(request.headers, request.cookies, token):
            return None
        if request.url.path == "/metrics" and bearer(request.headers, scrape_token):
            return None
        if request.url.path in ("/metrics",) or request.url.path.startswith("/events/"):
            return PlainTextResponse("unauthenticated", status_code=401, headers=HEADERS)
        return _html(pages.login_page("Log in with the operator token."), 401)

    def now() -> datetime:
        return datetime.now(UTC)

    async def runs_sections() -> pages.Sections:
        source.want_runs()
        views = source.runs.runs if source.runs else []
        telemetry = {v.run_id: t for v in views if (t := source.telemetry(v.run_id)) is not None}
        sections = pages.runs_sections(board.run_rows(views, telemetry, now()))
        if source.problem:
            sections["runs"] = f'<p class="error">{escape(source.problem)}</p>' + sections["runs"]
        return sections

    def run_sections_for(run_id: str) -> Callable[[], Awaitable[pages.Sections]]:
        async def sections() -> pages.Sections:
            detail = await source.detail(run_id)
            t = source.telemetry(run_id)
            return pages.run_sections(detail, now(), None if t is None else t.goodput)

        return sections

    async def desk_sections() -> pages.Sections:
        source.want_runs()
        prices = source.runs.prices if source.runs else {}
        return pages.desk_sections(board.breakdowns(source.rollups, source.finished, prices), prices)

    async def runs_page(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        if source.runs_stale():
            await source.refresh_runs()
        return _html(pages.layout("Runs", await runs_sections(), pages.RUNS_ORDER, "/events/runs", "Runs"))

    async def run_page(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        run_id = request.path_params["run_id"]
        try:
            sections = await run_sections_for(run_id)()
        except NotFound:
            return _html(
                pages.layout("Not found", {"summary": "<p>No such run.</p>"}, ["summary"], "", "Not found"),
                404,
            )
        except Unavailable as exc:
            return _html(
                pages.layout(
                    "Unavailable", {"summary": f"<p>{escape(str(exc))}</p>"}, ["summary"], "", "Unavailable"
                ),
                503,
            )
        return _html(
            pages.layout(run_id, sections, pages.RUN_ORDER, f"/events/run/{run_id}", f"Run {run_id}")
        )

    async def desk_page(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        if source.runs_stale():
            await source.refresh_runs()
        return _html(
            pages.layout("Desk", await desk_sections(), pages.DESK_ORDER, "/events/desk", "The desk")
        )

    def stream(request: Request, sections: Callable[[], Awaitable[pages.Sections]]) -> Response:
        async def events() -> AsyncIterator[str]:
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

        return StreamingResponse(
            events(), media_type="text/event-stream", headers={**HEADERS, "X-Accel-Buffering": "no"}
        )

    async def runs_events(request: Request) -> Response:
        return refused(request) or stream(request, runs_sections)

    async def run_events(request: Request) -> Response:
        return refused(request) or stream(request, run_sections_for(request.path_params["run_id"]))

    async def desk_events(request: Request) -> Response:
        return refused(request) or stream(request, desk_sections)

    async def metrics(request: Request) -> Response:
        if (no := refused(request)) is not None:
            return no
        if source.runs_stale():
            await source.refresh_runs()  # a scrape after a quiet spell reads the list itself
        source.want_runs()
        body, content_type = exposition(source)
        return Response(body, media_type=content_type, headers=HEADERS)

    async def login_form(request: Request) -> Response:
        return _html(pages.login_page())

    async def login(request: Request) -> Response:
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_FORM_BYTES:
                return _html(pages.login_page("That is not a token."), 413)
        given = parse_qs(body.decode("utf-8", "replace")).get("token", [""])[0].strip()
        if not given or not hmac.compare_digest(given.encode(), token.encode()):
            log.warning("a login with a wrong token was refused")
            return _html(pages.login_page("Wrong token."), 401)
        response = RedirectResponse("/", status_code=303, headers=HEADERS)
        response.set_cookie(COOKIE, session_value(token), httponly=True, samesite="strict", path="/")
        return response

    async def logout(request: Request) -> Response:
        response = RedirectResponse("/login", status_code=303, headers=HEADERS)
        response.delete_cookie(COOKIE, path="/")
        return response

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok", headers=HEADERS)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await source.start()
        try:
            yield
        finally:
            await source.close()

    return Starlette(
        routes=[
            Route("/", runs_page),
            Route("/runs/{run_id}", run_page),
            Route("/desk", desk_page),
            Route("/events/runs", runs_events),
            Route("/events/run/{run_id}", run_events),
            Route("/events/desk", desk_events),
            Route("/metrics", metrics),
            Route("/login", login_form, methods=["GET"]),
            Route("/login", login, methods=["POST"]),
            Route("/logout", logout, methods=["POST"]),
            Route("/healthz", healthz),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
        ],
        lifespan=lifespan,
    )
