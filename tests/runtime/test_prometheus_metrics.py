"""Prometheus metrics (runtime/messaging/metrics.py): the bearer check and the label mapping as
tables; the router's counting, the consumer-lag refresh and the `/metrics` server in one process
(no NATS, no stack); the token file, the port setting and `up`'s port choice."""

import asyncio
import dataclasses
import os
import signal

import msgspec
import nats.errors
import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from contracts.endpoints import Endpoint
from contracts.errors import ErrorCode
from devstack import stack
from runtime.configuration import settings as settings_mod
from runtime.messaging import codec
from runtime.messaging.bus import Router
from runtime.messaging.codec import Refusal
from runtime.messaging.metrics import (
    MetricsServer,
    ServiceMetrics,
    authorized,
    endpoint_label,
    metrics_app,
)
from runtime.security.identities import tenant_inbox
from runtime.security.order_signatures import Verifier
from runtime.security.secrets import SecretError, Secrets

TOKEN = "s3cret-token_value"


@pytest.mark.parametrize(
    ("headers", "token", "expected"),
    [
        ({"authorization": f"Bearer {TOKEN}"}, TOKEN, True),
        ({"authorization": f"bearer {TOKEN}"}, TOKEN, True),  # the scheme in any case (RFC 7235)
        ({"authorization": f"BEARER  {TOKEN} "}, TOKEN, True),
        ({"authorization": "Bearer wrong"}, TOKEN, False),
        ({"authorization": f"Bearer {TOKEN[:-1]}"}, TOKEN, False),  # a prefix of the token
        ({"authorization": f"Bearer {TOKEN}x"}, TOKEN, False),
        ({"authorization": f"Basic {TOKEN}"}, TOKEN, False),
        ({"authorization": TOKEN}, TOKEN, False),  # no scheme
        ({"authorization": "Bearer"}, TOKEN, False),
        ({"authorization": "Bearer "}, "", False),  # an empty token lets nobody in
        ({}, TOKEN, False),
        ({}, "", False),
        ({"x-token": TOKEN}, TOKEN, False),
    ],
)
def test_authorized(headers, token, expected):
    assert authorized(headers, token) is expected


@pytest.mark.parametrize(
    ("namespace", "subject", "label"),
    [
        ("ito", "ito.v1.api.train", "v1.api.train"),
        ("t123", "t123.v1.ledger.accept", "v1.ledger.accept"),
        ("t123", "t123.v1.health.scheduler", "v1.health.scheduler"),
        ("ito", "other.v1.api.train", "other.v1.api.train"),  # not ours: left whole
        ("ito", "itox.v1.api.train", "itox.v1.api.train"),  # a prefix of a token is not the namespace
    ],
)
def test_endpoint_label(namespace, subject, label):
    assert endpoint_label(namespace, subject) == label


class Ask(msgspec.Struct):
    n: int


def families(metrics: ServiceMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())}


def samples(metrics: ServiceMetrics, name: str) -> list:
    fam = families(metrics)
    return [] if name not in fam else fam[name].samples


async def test_router_times_every_answer_and_counts_refusals_by_code():
    m = ServiceMetrics("scheduler")
    router = Router("t1", metrics=m)

    async def echo(req: Ask) -> Ask:
        return req

    async def refuse(_account: str, req: Ask) -> Ask:
        raise Refusal(ErrorCode.confirmation_not_found, "no such reference")

    router.serve(Endpoint("v1.echo", Ask, Ask), echo)
    router.serve(Endpoint("v1.signed", Ask, Ask), echo, Verifier(os.urandom(32)))  # nobody signs here
    router.serve_tenant(Endpoint("v1.api.train", Ask, Ask), refuse)
    body = msgspec.json.encode(Ask(n=1))
    inbox = tenant_inbox("acme") + ".x"

    for _ in range(3):
        assert codec.decode_envelope(await router.handle("t1.v1.echo", body)).ok
    assert (await router.handle("t1.v1.echo", b"{not json")) is not None  # request_invalid
    unsigned = codec.decode_envelope(await router.handle("t1.v1.signed", body))
    assert unsigned.error is not None and unsigned.error.code == ErrorCode.forbidden
    for _ in range(2):
        await router.handle("t1.v1.api.train.acme", body, reply=inbox)
    assert await router.handle("t1.v1.api.train.acme", body, reply=tenant_inbox("victim") + ".x") is None

    counts = {
        s.labels["endpoint"]: s.value for s in samples(m, "ito_request_seconds") if s.name.endswith("_count")
    }
    assert counts == {"v1.echo": 4, "v1.signed": 1, "v1.api.train": 2}  # the unanswered one is not timed
    refusals = {
        (s.labels["endpoint"], s.labels["code"]): s.value
        for s in samples(m, "ito_refusals")
        if s.name == "ito_refusals_total"
    }
    assert refusals == {
        ("v1.echo", "request_invalid"): 1,
        ("v1.signed", "forbidden"): 1,
        ("v1.api.train", "confirmation_not_found"): 2,
    }
    unanswered = [s for s in samples(m, "ito_requests_unanswered") if s.name.endswith("_total")]
    assert {s.labels["endpoint"]: s.value for s in unanswered}["v1.api.train"] == 1
    assert {s.labels["service"] for s in samples(m, "ito_request_seconds")} == {"scheduler"}
    text = generate_latest(m.registry).decode()
    assert "acme" not in text and "victim" not in text  # no account in any label


async def test_a_router_without_metrics_answers_the_same():
    router = Router("t1")

    async def echo(req: Ask) -> Ask:
        return req

    router.serve(Endpoint("v1.echo", Ask, Ask), echo)
    counted = Router("t1", metrics=ServiceMetrics("x"))
    counted.serve(Endpoint("v1.echo", Ask, Ask), echo)
    body = msgspec.json.encode(Ask(n=7))
    assert await router.handle("t1.v1.echo", body) == await counted.handle("t1.v1.echo", body)


async def _raise(exc: BaseException):
    raise exc


async def _ok(value):
    return value


@pytest.mark.parametrize(
    ("handler", "raw", "code"),
    [
        (lambda req: _ok(req), b'{"n": 1}', None),
        (lambda req: _ok((req, "a notice")), b'{"n": 1}', None),
        (
            lambda req: _raise(Refusal(ErrorCode.budget_exceeded, "no")),
            b'{"n": 1}',
            ErrorCode.budget_exceeded,
        ),
        (lambda req: _ok(req), b'{"n": "x"}', ErrorCode.request_invalid),
        (lambda req: _raise(RuntimeError("boom")), b'{"n": 1}', ErrorCode.internal),
        (lambda req: _raise(codec.STORE_UNAVAILABLE[0]()), b'{"n": 1}', ErrorCode.backend_unavailable),
    ],
)
async def test_answer_coded_returns_the_code_the_envelope_carries(handler, raw, code):
    envelope, got = await codec.answer_coded(handler, raw, msgspec.json.Decoder(Ask))
    decoded = codec.decode_envelope(envelope)
    assert got == code
    assert (decoded.error.code if decoded.error else None) == code
    assert envelope == await codec.answer(handler, raw, msgspec.json.Decoder(Ask))


class FakeJetStream:
    """consume_info as nats-py's JetStream context answers it, or fails as it does."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.asked: list[tuple[str, str]] = []

    async def consumer_info(self, stream: str, durable: str):
        self.asked.append((stream, durable))
        if self.fail:
            raise nats.errors.TimeoutError
        return type("Info", (), {"num_pending": 7, "num_ack_pending": 1, "num_redelivered": 0})()


async def test_consumer_lag_is_refreshed_per_durable_and_failures_are_counted():
    m = ServiceMetrics("scheduler")
    m.watch_consumer("T_RUNS", "t-scheduler-runs")
    failing = FakeJetStream(fail=True)
    await m.refresh_consumers(failing)
    assert failing.asked == [("T_RUNS", "t-scheduler-runs")]
    assert [s.value for s in samples(m, "ito_consumer_info_failures") if s.name.endswith("_total")] == [1]
    assert [s.value for s in samples(m, "ito_consumer_info_timestamp_seconds")] == [0]  # never read yet

    await m.refresh_consumers(FakeJetStream(fail=False))
    by_name = {s.name: (s.labels, s.value) for fam in families(m).values() for s in fam.samples}
    assert by_name["ito_consumer_pending_messages"] == (
        {"stream": "T_RUNS", "consumer": "t-scheduler-runs"},
        7,
    )
    assert by_name["ito_consumer_ack_pending_messages"][1] == 1
    assert by_name["ito_consumer_info_timestamp_seconds"][1] > 0


async def _get(port: int, path: str, headers: dict[str, str]) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    lines = [f"GET {path} HTTP/1.1", "Host: localhost", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), timeout=5)
    writer.close()
    head, _, body = raw.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


async def test_the_server_wants_the_token_and_leaves_the_signals_alone():
    m = ServiceMetrics("trainer")
    m.runs_accepted()()
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    server = MetricsServer(metrics_app(m.registry, TOKEN), "127.0.0.1", 0)
    await server.start()
    try:
        # uvicorn's own serve() would have put its handle_exit on both while it runs
        assert {sig: signal.getsignal(sig) for sig in before} == before
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Basic {TOKEN}"}):
            status, body = await _get(server.port, "/metrics", headers)
            assert status == 401 and "ito_" not in body and TOKEN not in body, (headers, body)
        status, body = await _get(server.port, "/metrics", {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200
        names = {f.name for f in text_string_to_metric_families(body)}
        assert {"ito_runs_accepted", "process_cpu_seconds"} <= names
        assert (await _get(server.port, "/other", {"Authorization": f"Bearer {TOKEN}"}))[0] == 404
    finally:
        await server.stop()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", server.port)


async def test_a_port_in_use_fails_the_start():
    first = MetricsServer(metrics_app(ServiceMetrics("a").registry, TOKEN), "127.0.0.1", 0)
    await first.start()
    try:
        second = MetricsServer(metrics_app(ServiceMetrics("b").registry, TOKEN), "127.0.0.1", first.port)
        with pytest.raises(OSError):
            await second.start()
    finally:
        await first.stop()


async def test_healthz_needs_no_token_and_says_only_up_or_down():
    state = {"ok": True}

    async def healthy() -> bool:
        if state["ok"] is None:
            raise ConnectionError("redis down")
        return bool(state["ok"])

    server = MetricsServer(metrics_app(ServiceMetrics("ledger").registry, TOKEN, healthy), "127.0.0.1", 0)
    await server.start()
    try:
        assert await _get(server.port, "/healthz", {}) == (200, "ok\n")
        state["ok"] = False
        assert await _get(server.port, "/healthz", {}) == (503, "unhealthy\n")
        state["ok"] = None  # a check that raises is a 503, never a traceback
        assert await _get(server.port, "/healthz", {}) == (503, "unhealthy\n")
        assert (await _get(server.port, "/metrics", {}))[0] == 401  # the metrics still want the token
    finally:
        await server.stop()


def test_an_app_without_a_token_is_refused():
    with pytest.raises(ValueError):
        metrics_app(ServiceMetrics("a").registry, "")


def test_the_token_file_is_made_once_private_and_refused_when_readable(tmp_path):
    sec = Secrets(tmp_path / "secrets")
    sec.ensure((), ())
    token = sec.metrics_token()
    assert len(token) >= 32 and sec.metrics_token_path().stat().st_mode & 0o777 == 0o600
    sec.ensure((), ())
    assert sec.metrics_token() == token  # kept: rotation is explicit
    sec.metrics_token_path().chmod(0o644)
    with pytest.raises(SecretError):
        sec.metrics_token()


@pytest.mark.parametrize(
    ("raw", "port"), [(None, 0), ("", 0), ("0", 0), ("9464", 9464), ("x", None), ("70000", None)]
)
def test_metrics_port_setting(raw, port):
    env = {} if raw is None else {settings_mod.ENV_METRICS_PORT: raw}
    if port is None:
        with pytest.raises(ValueError):
            settings_mod.load(env)
    else:
        s = settings_mod.load(env)
        assert s.metrics_port == port and s.metrics_host == "127.0.0.1"


def test_up_gives_every_process_a_port_of_its_own(monkeypatch):
    handed = iter([5000, 5000, 5001, 5000, 5002])  # a kernel that hands a port out twice
    monkeypatch.setattr(stack.infra, "free_port", lambda: next(handed))
    assert stack.metrics_ports(["scheduler-1", "scheduler-2", "trainer-1"]) == {
        "scheduler-1": 5000,
        "scheduler-2": 5001,
        "trainer-1": 5002,
    }


def test_settings_replace_keeps_the_port_checked():
    s = settings_mod.load({})
    with pytest.raises(ValueError):
        dataclasses.replace(s, metrics_port=-1)
