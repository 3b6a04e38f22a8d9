"""Prometheus' view of a real stack: `up` gives every service a `/metrics` endpoint behind the
bearer token in the secrets dir; an accepted train and a refused one show in the scheduler's
request histogram, refusal counter and accepted-runs counter; every durable's lag is there; a
scrape without the token (or with a wrong one) gets 401 and no metric text."""

import json
import pathlib
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import confirm_and_train, eventually

pytestmark = pytest.mark.e2e


def scrape(address: str, token: str | None) -> tuple[int, str]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    request = urllib.request.Request(f"http://{address}/metrics", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read().decode()


def samples(text: str) -> list:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(text: str, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when there is none)."""
    return sum(s.value for s in samples(text) if s.name == name and labels.items() <= s.labels.items())


def consumer_series(text: str) -> set[tuple[str, str, str]]:
    return {
        (s.name, s.labels["stream"], s.labels["consumer"])
        for s in samples(text)
        if s.name in ("ito_consumer_pending_messages", "ito_consumer_ack_pending_messages")
    }


def with_consumers(address: str, token: str) -> str | None:
    """A scrape once the first consumer-info refresh has set the lag gauges."""
    status, text = scrape(address, token)
    return text if status == 200 and consumer_series(text) else None


def test_metrics_count_a_train_and_a_refusal_behind_the_token(stack, manifest):
    up = json.loads((stack.data_dir / "up.json").read_text())
    addresses, token = up["metrics"], pathlib.Path(up["metrics_token_file"]).read_text().strip()
    assert set(addresses) == {"scheduler", "entitlement", "confirmation", "ledger", "trainer", "telemetry"}
    assert pathlib.Path(up["metrics_token_file"]).stat().st_mode & 0o777 == 0o600
    scheduler = addresses["scheduler"]
    status, before = scrape(scheduler, token)
    assert status == 200
    accepted_before = value(before, "ito_runs_accepted_total", service="scheduler")

    account, _, env = stack.account()
    booking = stack.booking(account)
    m = str(manifest())
    confirm_and_train(stack, env, booking, m, "metrics-1")
    rc, refused = stack.ecc(
        "train",
        "--booking",
        booking,
        "--manifest",
        m,
        "--confirmation-ref",
        "cf_not_a_real_reference",
        "--idempotency-key",
        "metrics-2",
        env=env,
    )
    assert rc != 0 and not refused["ok"], refused
    code = refused["error"]["code"]

    status, after = scrape(scheduler, token)
    assert status == 200
    train = {"service": "scheduler", "endpoint": "v1.api.train"}
    assert value(after, "ito_request_seconds_count", **train) >= 2
    assert value(after, "ito_request_seconds_bucket", **train, le="+Inf") >= 2
    assert value(after, "ito_refusals_total", **train, code=code) >= 1
    assert value(after, "ito_runs_accepted_total", service="scheduler") == accepted_before + 1
    assert account not in after  # no account in any label
    durables = {
        "scheduler": (f"{up['namespace'].upper()}_RUNS", f"{up['namespace']}-scheduler-runs"),
        "telemetry": (f"{up['namespace'].upper()}_RUNS", f"{up['namespace']}-telemetry-runs"),
        "trainer": (f"{up['namespace'].upper()}_WORK", f"{up['namespace']}-trainer"),
    }
    for service, (stream, durable) in durables.items():
        text = eventually(
            lambda service=service: with_consumers(addresses[service], token),
            timeout=20,
            what=f"{service}'s consumer gauges",
        )
        assert consumer_series(text) == {
            ("ito_consumer_pending_messages", stream, durable),
            ("ito_consumer_ack_pending_messages", stream, durable),
        }, service
        assert value(text, "ito_consumer_info_failures_total") == 0

    for bad in (None, "wrong-token", token[:-1]):
        status, body = scrape(scheduler, bad)
        assert status == 401 and "ito_" not in body and token not in body, (bad, body)
    logs = pathlib.Path(up["logs"])
    assert not any(token in p.read_text(errors="replace") for p in logs.glob("*.log"))


def test_every_service_answers_healthz_without_a_token(stack):
    """The containers' healthcheck and the kubelet's probes (compose.yaml, deploy/k8s/): GET
    /healthz on the metrics port, no credential, `ok` from a service connected to NATS and Redis."""
    up = json.loads((stack.data_dir / "up.json").read_text())
    for name, address in up["metrics"].items():
        if name == "desk":
            continue
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=5) as answer:
            assert (answer.status, answer.read()) == (200, b"ok\n"), name
