"""Fairness under a flood (docs/quotas.md): one tenant sends `confirm` requests as fast as its
clients can, against a rate quota, while another tenant's sequential `confirm` latency is timed;
the same timing on the idle stack first. Target: the other tenant's p50 within 1.5x of idle."""

import asyncio
import copy
import time

from bench import stats
from bench.stack import ApiClient, Stack

FLOOD_RATE_PER_S = 50  # the flooding tenant's quota: what the services admit of its flood
FLOOD_CLIENTS = 8  # its connections, each sending back to back
TARGET_RATIO = 1.5


async def _timed_confirms(stack: Stack, samples: int) -> list[float]:
    timings = []
    async with ApiClient(stack) as client:
        for i in range(samples + max(3, samples // 10)):
            started = time.perf_counter()
            out = await client.confirm()
            elapsed = time.perf_counter() - started
            if not out["ok"]:
                raise RuntimeError(f"the timed tenant was refused: {out['error']}")
            if i >= max(3, samples // 10):
                timings.append(elapsed)
    return timings


async def fairness(stack: Stack, samples: int) -> dict:
    idle = await _timed_confirms(stack, samples)
    flooder = copy.copy(stack)  # the same stack's servers, another account and booking
    flooder.env = dict(stack.env)
    await flooder.provision()
    rate = str(FLOOD_RATE_PER_S)
    await asyncio.to_thread(
        flooder.ito, "accounts", "quota", flooder.account, "--rate", rate, "--burst", rate
    )
    counts = {"ok": 0, "rate_limited": 0, "other": 0}
    stop = asyncio.Event()

    async def flood() -> None:
        async with ApiClient(flooder) as client:
            while not stop.is_set():
                out = await client.confirm()
                code = "ok" if out["ok"] else out["error"]["code"]
                counts[code if code in counts else "other"] += 1

    floods = [asyncio.create_task(flood()) for _ in range(FLOOD_CLIENTS)]
    await asyncio.sleep(1.0)  # the flood's burst spent: what follows is the flood at its limit
    before, started = dict(counts), time.perf_counter()
    try:
        flooded = await _timed_confirms(stack, samples)
    finally:
        elapsed = time.perf_counter() - started
        stop.set()
        await asyncio.gather(*floods, return_exceptions=True)
    idle_p50, flooded_p50 = stats.percentile(idle, 50), stats.percentile(flooded, 50)
    return {
        "what": "another tenant's sequential confirm while one floods confirm at its rate quota",
        "flood_rate_quota_per_s": FLOOD_RATE_PER_S,
        "flood_clients": FLOOD_CLIENTS,
        "flood_sent_per_s": round(sum(counts[k] - before[k] for k in counts) / elapsed, 1),
        "flood_admitted_per_s": round((counts["ok"] - before["ok"]) / elapsed, 1),
        "flood_refused_rate_limited": counts["rate_limited"],
        "flood_other_errors": counts["other"],
        "idle": stats.latency_summary(idle),
        "flooded": stats.latency_summary(flooded),
        "ratio_p50_flooded_to_idle": round(flooded_p50 / idle_p50, 2),
        "target_ratio": TARGET_RATIO,
        "met": flooded_p50 <= TARGET_RATIO * idle_p50,
    }
