"""Fairness under a flood (docs/quotas.md): one tenant sends `confirm` requests from several
connections against its rate quota while another tenant's sequential `confirm` latency is timed,
and the same timing on the idle stack (before and after, for the machine's drift). Two floods:
one at its limit (its clients paced to the quota's rate together, and waiting the `retry_after_s`
they are told when early), one that ignores its quota and sends back to back. Target: the other tenant's p50 within 1.5x of idle while one floods at its limit."""

import asyncio
import copy
import time

from bench import stats
from bench.stack import ApiClient, Stack

FLOOD_RATE_PER_S = 20  # the flooding tenant's quota (and its burst): what the services admit of it
FLOOD_CLIENTS = 8  # its connections
TARGET_RATIO = 1.5


FLOODED_WINDOW_S = 3.0  # the timed tenant's window under a flood, at least: long beside the burst


async def _timed_confirms(stack: Stack, samples: int, min_s: float = 0.0) -> list[float]:
    """`samples` sequential confirms (after a warm-up), and more until `min_s` have passed."""
    warmup = max(3, samples // 10)
    timings: list[float] = []
    began = time.perf_counter()
    async with ApiClient(stack) as client:
        i = 0
        while len(timings) < samples or time.perf_counter() - began < min_s:
            i += 1
            started = time.perf_counter()
            out = await client.confirm()
            elapsed = time.perf_counter() - started
            if not out["ok"]:
                raise RuntimeError(f"the timed tenant was refused: {out['error']}")
            if i > warmup:
                timings.append(elapsed)
    return timings


async def _flooded(stack: Stack, flooder: Stack, samples: int, at_limit: bool) -> dict:
    """The other tenant's timings while `flooder` floods, and what the flood sent and got."""
    counts = {"ok": 0, "rate_limited": 0, "other": 0}
    stop = asyncio.Event()

    async def flood(n: int) -> None:
        interval = FLOOD_CLIENTS / FLOOD_RATE_PER_S  # paced: together, exactly the quota's rate
        async with ApiClient(flooder) as client:
            due = time.perf_counter() + n * interval / FLOOD_CLIENTS
            while not stop.is_set():
                if at_limit:  # never faster than the pace, never catching up in a burst
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                    due = max(due, time.perf_counter()) + interval
                out = await client.confirm()
                code = "ok" if out["ok"] else out["error"]["code"]
                counts[code if code in counts else "other"] += 1
                if at_limit and code == "rate_limited":  # early: wait what the answer says
                    await asyncio.sleep(out["error"].get("retry_after_s") or 0.0)

    floods = [asyncio.create_task(flood(n)) for n in range(FLOOD_CLIENTS)]
    await asyncio.sleep(1.5)  # the flood's burst spent: what follows is the flood at its rate
    before, started = dict(counts), time.perf_counter()
    try:
        timings = await _timed_confirms(stack, samples, FLOODED_WINDOW_S)
    finally:
        elapsed = time.perf_counter() - started
        stop.set()
        await asyncio.gather(*floods, return_exceptions=True)
    return {
        "timings": timings,
        "sent_per_s": round(sum(counts[k] - before[k] for k in counts) / elapsed, 1),
        "admitted_per_s": round((counts["ok"] - before["ok"]) / elapsed, 1),
        "other_errors": counts["other"],
    }


async def fairness(stack: Stack, samples: int) -> dict:
    flooder = copy.copy(stack)  # the same stack's servers, another account and booking
    flooder.env = dict(stack.env)
    await flooder.provision()
    rate = str(FLOOD_RATE_PER_S)
    await asyncio.to_thread(
        flooder.ito, "accounts", "quota", flooder.account, "--rate", rate, "--burst", rate
    )
    idle_before = await _timed_confirms(stack, samples)
    at_limit = await _flooded(stack, flooder, samples, at_limit=True)
    await asyncio.sleep(1.0)  # the refusals remembered by the scheduler are over
    ignoring = await _flooded(stack, flooder, samples, at_limit=False)
    idle_after = await _timed_confirms(stack, samples)
    idle_p50 = (stats.percentile(idle_before, 50) + stats.percentile(idle_after, 50)) / 2
    at_limit_p50 = stats.percentile(at_limit["timings"], 50)
    ignoring_p50 = stats.percentile(ignoring["timings"], 50)
    return {
        "what": "another tenant's sequential confirm while one floods confirm against its rate quota",
        "flood_rate_quota_per_s": FLOOD_RATE_PER_S,
        "flood_clients": FLOOD_CLIENTS,
        "idle_before": stats.latency_summary(idle_before),
        "idle_after": stats.latency_summary(idle_after),
        "at_limit": stats.latency_summary(at_limit["timings"]),
        "at_limit_flood_sent_per_s": at_limit["sent_per_s"],
        "at_limit_flood_admitted_per_s": at_limit["admitted_per_s"],
        "ratio_p50_at_limit_to_idle": round(at_limit_p50 / idle_p50, 2),
        "ignoring_retry_after": stats.latency_summary(ignoring["timings"]),
        "ignoring_flood_sent_per_s": ignoring["sent_per_s"],
        "ignoring_flood_admitted_per_s": ignoring["admitted_per_s"],
        "ratio_p50_ignoring_retry_after_to_idle": round(ignoring_p50 / idle_p50, 2),
        "flood_other_errors": at_limit["other_errors"] + ignoring["other_errors"],
        "target_ratio": TARGET_RATIO,
        "met": at_limit_p50 <= TARGET_RATIO * idle_p50,
    }
