"""The desk's window in a real browser (Playwright driving Debian's chromium): a run started
through `ecc` is listed, its page draws a loss curve with a point per metric event and a gate row
per stage, new events reach the open page without a reload, a missing or wrong token gets nothing,
and the desk's /metrics parses with the Prometheus client's own parser.

Screenshots of each page (1280x800 and a phone's 390x844) go to `ITO_SCREENSHOT_DIR` (default
`.ito/screenshots`, not committed); `make screenshots` writes the README's into docs/.
"""

import json
import os
import pathlib
import shutil
import subprocess
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.security.secrets import DESK_TOKEN, Secrets
from tests.conftest import BIN, REPO, write_manifest
from tests.support import confirm_and_train, eventually, run_state

pytestmark = pytest.mark.e2e

STEPS = 240  # long enough that the open page sees points arrive (the tiny model: ~30 steps/s here)
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


def chromium() -> str:
    found = shutil.which("chromium")
    if found is None:
        pytest.fail("chromium is missing: `.ci/system-deps` (make sysdeps) installs it as root on Debian")
    return found


@pytest.fixture(scope="module")
def desk(stack):
    """`ito-training desk serve` on the session's stack: (base URL, token)."""
    log = open(stack.data_dir / "desk-browser.log", "ab")
    proc = subprocess.Popen(
        [str(BIN / "ito-training"), "desk", "serve", "--port", "0", "--json"],
        env=stack.env,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    try:
        first = proc.stdout.readline() if proc.stdout else ""
        assert first, f"the desk app printed nothing; see {stack.data_dir / 'desk-browser.log'}"
        where = json.loads(first)
        token = Secrets(stack.settings.secrets_dir).token(DESK_TOKEN)
        assert token not in first  # it says where the token is, never the token
        yield where["url"].rstrip("/"), token
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def http(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def shots() -> pathlib.Path:
    target = pathlib.Path(os.environ.get("ITO_SCREENSHOT_DIR") or REPO / ".ito" / "screenshots")
    target.mkdir(parents=True, exist_ok=True)
    return target


def test_a_missing_or_wrong_token_gets_nothing(desk, stack):
    base, token = desk
    for path in ("/", "/desk", "/runs/run_x", "/events/runs", "/metrics"):
        for headers in (
            {},
            {"Authorization": "Bearer not-the-token"},
            {"Cookie": f"ito_desk_session={token}"},
        ):
            status, body = http(base + path, headers)
            assert status == 401, (path, headers, status)
            assert "run_" not in body and "ito_desk_runs" not in body and token not in body
    assert http(base + "/", {"Authorization": f"Bearer {token}"})[0] == 200


def points_on_page(page) -> int:
    return page.eval_on_selector_all(
        "polyline.train-loss", "lines => lines.reduce((n, l) => n + Number(l.dataset.points), 0)"
    )


def test_a_person_watches_a_run_on_the_desk(desk, stack, tmp_path):
    from playwright.sync_api import sync_playwright

    base, token = desk
    account, _, env = stack.account()
    booking = stack.booking(account)
    manifest = write_manifest(
        tmp_path, target={"tokens": STEPS * 8 * 32, "seq_len": 32, "batch_size": 8, "learning_rate": 0.003}
    )
    eventually(lambda: stack.ecc("find", env=env)[1]["data"], timeout=30, what="the booking")
    run_id = confirm_and_train(stack, env, booking, str(manifest), "desk-" + account)["data"]["run_id"]
    out = shots()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport=DESKTOP)
            page.goto(base + "/")
            assert page.locator("form#login").is_visible() and run_id not in page.content()
            page.fill("#token", "not-the-token")
            page.click("form#login button")
            assert "Wrong token" in page.content() and run_id not in page.content()

            page.goto(base + f"/login#token={token}")  # the demo's link: the token rides in the fragment
            page.wait_for_url(base + "/")
            assert "#token" not in page.url
            page.wait_for_selector(f'tr[data-run="{run_id}"]', timeout=30_000)
            assert account in page.inner_text(f'tr[data-run="{run_id}"]')
            page.screenshot(path=out / "desk-runs.png", full_page=True)

            page.click(f'tr[data-run="{run_id}"] a')
            page.wait_for_url(base + f"/runs/{run_id}")
            page.evaluate("window.__same_page = true")  # gone if anything reloads the page
            page.wait_for_function(
                "() => [...document.querySelectorAll('polyline.train-loss')]"
                ".some(l => Number(l.dataset.points) > 0)",
                timeout=90_000,
            )
            first = points_on_page(page)
            page.wait_for_function(
                f"() => [...document.querySelectorAll('polyline.train-loss')]"
                f".reduce((n, l) => n + Number(l.dataset.points), 0) > {first}",
                timeout=60_000,
            )
            assert page.evaluate("window.__same_page === true")  # the new points came live

            finished = run_state(stack, env, run_id, {"succeeded"}, timeout=240)
            _, evals = stack.ecc("evals", run_id, env=env)
            stages = [g["stage"] for g in evals["data"]["gates"]]
            assert stages and finished["gates"]
            metric_events = 0
            since = 0
            while True:
                _, metrics = stack.ecc("metrics", run_id, "--since", str(since), env=env)
                metric_events += len(metrics["data"]["points"])
                if metrics["data"]["next"] == since:
                    break
                since = metrics["data"]["next"]
            assert metric_events >= STEPS
            page.wait_for_selector("section#summary .badge.s-succeeded", timeout=30_000)
            page.wait_for_function(
                f"() => [...document.querySelectorAll('polyline.train-loss')]"
                f".reduce((n, l) => n + Number(l.dataset.points), 0) === {metric_events}",
                timeout=30_000,
            )
            gate_rows = page.eval_on_selector_all("tbody.gate", "rows => rows.map(r => r.dataset.stage)")
            assert gate_rows == stages
            assert page.eval_on_selector_all("tbody.gate", "rows => rows.map(r => r.dataset.verdict)") == [
                "passed" if g["passed"] else "failed" for g in evals["data"]["gates"]
            ]
            assert page.locator("#timeline svg.timeline rect.state").count() >= 2
            assert page.locator("#checkpoints tbody tr").count() >= 1
            assert page.locator("#provenance tbody tr").count() >= 1
            assert "hand_off" in page.inner_text("#audit")
            assert page.evaluate("window.__same_page === true")
            page.screenshot(path=out / "desk-run.png", full_page=True)

            page.goto(base + "/desk")
            page.wait_for_selector('table[data-by="booking"] tr[data-key="' + booking + '"]', timeout=60_000)
            page.screenshot(path=out / "desk-desk.png", full_page=True)

            phone = browser.new_context(viewport=PHONE, storage_state=page.context.storage_state()).new_page()
            for name, path in (("runs", "/"), ("run", f"/runs/{run_id}"), ("desk", "/desk")):
                phone.goto(base + path)
                width = phone.evaluate("document.documentElement.scrollWidth")
                assert width <= PHONE["width"] + 1, (name, width)  # nothing runs off a phone's screen
                phone.screenshot(path=out / f"desk-{name}-phone.png", full_page=True)
        finally:
            browser.close()

    status, body = http(base + "/metrics", {"Authorization": f"Bearer {token}"})
    assert status == 200
    scrape = Secrets(stack.settings.secrets_dir).metrics_token()  # the stack's one scrape credential
    assert http(base + "/metrics", {"Authorization": f"Bearer {scrape}"})[0] == 200
    assert http(base + "/", {"Authorization": f"Bearer {scrape}"})[0] == 401  # a scrape token opens no page
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }
    assert samples[("ito_desk_runs", (("state", "succeeded"),))] >= 1
    assert ("ito_desk_goodput_ratio", (("gpu_model", "H200"),)) in samples
