"""A tenant's inputs (issue 39), on the bench's stack:

- `heavy_manifests`: how long the scheduler takes to refuse a manifest of 100,000 empty data entries
  (~400 KB, under every size cap; it took 11-27 s before the manifest was bounded in work), each one
  new bytes, and another tenant's `status` latency while one tenant sends a burst of them, against
  the same tenant's `status` on the idle stack. Target: p95 under the burst <= 2x idle.
- `upload_throughput`: a file sent with `ecc ito files upload` (hashed, sent in 1 MiB parts over
  NATS, checked whole on the server, kept) in MB/s, beside a plain copy of the same file on the same
  machine (`shutil.copyfile`), which is the floor no upload beats.
"""

import asyncio
import copy
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import tempfile
import time
import uuid

from bench import stats
from bench.stack import BIN, REPO, ApiClient, Stack
from contracts import subjects
from contracts.api import PlanRequest, StatusRequest

HEAVY_ENTRIES = 100_000
BURST_CLIENTS = 4  # the heavy tenant's connections, each sending heavy plans back to back
STATUS_WINDOW_S = 3.0  # the other tenant's status is timed this long under the burst, at least
TARGET_RATIO = 2.0


def _heavy_manifest() -> str:
    doc = json.loads((REPO / "examples" / "manifests" / "tiny.json").read_text())
    doc["data"] = [{} for _ in range(HEAVY_ENTRIES)]
    doc["name"] = f"heavy-{uuid.uuid4().hex}"  # new bytes each: nothing remembered answers it
    return json.dumps(doc)


async def _heavy_plan(client: ApiClient) -> tuple[float, str]:
    text = _heavy_manifest()
    req = PlanRequest(
        booking_id=client.stack.booking,
        manifest_text=text,
        manifest_digest=hashlib.sha256(text.encode()).hexdigest(),
    )
    started = time.perf_counter()
    out = await client.call(subjects.API_PLAN, req)
    code = "ok" if out["ok"] else out["error"]["code"]
    return time.perf_counter() - started, code


async def _statuses(stack: Stack, samples: int, min_s: float = 0.0) -> list[float]:
    """`samples` sequential statuses of a run that does not exist (answered from Redis), and more
    until `min_s` have passed."""
    timings: list[float] = []
    began = time.perf_counter()
    async with ApiClient(stack) as client:
        for _ in range(3):  # warm-up
            await client.call(subjects.API_STATUS, StatusRequest(run_id="run_none"))
        while len(timings) < samples or time.perf_counter() - began < min_s:
            started = time.perf_counter()
            out = await client.call(subjects.API_STATUS, StatusRequest(run_id="run_none"))
            timings.append(time.perf_counter() - started)
            if out["ok"] or out["error"]["code"] != "run_not_found":
                raise RuntimeError(f"status answered {out}")
    return timings


async def heavy_manifests(stack: Stack, samples: int) -> dict:
    heavy = copy.copy(stack)  # the same stack's servers, another account and booking
    heavy.env = dict(stack.env)
    await heavy.provision()
    async with ApiClient(heavy) as client:
        alone = [await _heavy_plan(client) for _ in range(max(3, samples // 10))]
    if any(code != "manifest_invalid" for _, code in alone):
        raise RuntimeError(f"a heavy manifest was answered {sorted({c for _, c in alone})}")
    idle = await _statuses(stack, samples)
    stop = asyncio.Event()
    sent: list[str] = []

    async def burst() -> None:
        async with ApiClient(heavy) as c:
            while not stop.is_set():
                sent.append((await _heavy_plan(c))[1])

    tasks = [asyncio.create_task(burst()) for _ in range(BURST_CLIENTS)]
    await asyncio.sleep(0.5)
    try:
        under = await _statuses(stack, samples, STATUS_WINDOW_S)
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
    idle_p95, under_p95 = stats.percentile(idle, 95), stats.percentile(under, 95)
    return {
        "what": "refusing a manifest of 100,000 empty data entries (new bytes each), and another tenant's "
        "status while one sends them back to back from several connections",
        "manifest_bytes": len(_heavy_manifest().encode()),
        "refusal": stats.latency_summary([t for t, _ in alone]),
        "burst_clients": BURST_CLIENTS,
        "burst_answers": {code: sent.count(code) for code in sorted(set(sent))},
        "status_idle": stats.latency_summary(idle),
        "status_under_burst": stats.latency_summary(under),
        "ratio_p95_under_burst_to_idle": round(under_p95 / idle_p95, 2),
        "target_ratio": TARGET_RATIO,
        "met": under_p95 <= TARGET_RATIO * idle_p95,
    }


def _write_data(path: pathlib.Path, megabytes: int) -> None:
    line = (json.dumps({"text": "the river runs under the old stone bridge " * 400}) + "\n").encode()
    with path.open("wb") as f:
        for _ in range(megabytes * 1_000_000 // len(line)):
            f.write(line)


def upload_throughput(stack: Stack, megabytes: int) -> dict:
    """`ecc ito files upload` of a `megabytes` MB JSONL file (the CLI as a user runs it, its start
    included), against a plain copy of the same file on the same disk."""
    stack.ecc_login()
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-upload-"))
    try:
        source = work / "corpus.jsonl"
        _write_data(source, megabytes)
        size = source.stat().st_size
        started = time.perf_counter()
        shutil.copyfile(source, work / "copy.jsonl")
        os.sync()
        copy_s = time.perf_counter() - started
        started = time.perf_counter()
        proc = subprocess.run(
            [str(BIN / "ecc"), "ito", "files", "upload", str(source), "--json"],
            env=stack.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
        upload_s = time.perf_counter() - started
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        if not out["ok"] or out["data"]["state"] != "ready":
            raise RuntimeError(f"the upload was answered {out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "what": "`ecc ito files upload` (hash, 1 MiB parts over NATS, the server's whole-file check, kept) "
        "against shutil.copyfile of the same file",
        "bytes": size,
        "upload_s": round(upload_s, 3),
        "upload_mb_per_s": round(size / upload_s / 1e6, 1),
        "copy_s": round(copy_s, 3),
        "copy_mb_per_s": round(size / copy_s / 1e6, 1),
        "upload_over_copy_time": round(upload_s / copy_s, 1),
    }


async def run_all(stack: Stack, samples: int, upload_megabytes: int) -> dict[str, dict]:
    return {
        "heavy_manifests": await heavy_manifests(stack, samples),
        "upload_throughput": await asyncio.to_thread(upload_throughput, stack, upload_megabytes),
    }
