"""CLI benchmark: cold start of `ecc`, as a person or an agent feels it (subprocess wall time).

`ecc --help` imports no client library; `ecc ito status RUN --json` connects to NATS and asks the
scheduler. Both are compared with a bare `python -c pass` on the same interpreter, the floor no
Python CLI can go under. Each figure is the median of `runs` launches.
"""

import subprocess
import sys
import time

from bench import stats
from bench.stack import BIN, REPO, ApiClient, Stack, confirmations

CLI_TIMEOUT_S = 60.0


def _wall(argv: list[str], env: dict[str, str], runs: int) -> tuple[float, list[float]]:
    """Median wall seconds of `runs` launches (after one unmeasured launch that warms the page cache)."""
    timings = []
    for i in range(runs + 1):
        started = time.perf_counter()
        proc = subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
        elapsed = time.perf_counter() - started
        if proc.returncode != 0:
            raise RuntimeError(
                f"{' '.join(argv[:3])} exited {proc.returncode}: {proc.stdout[-500:]} {proc.stderr[-500:]}"
            )
        if i:
            timings.append(elapsed)
    return stats.median(timings), timings


async def _a_run(stack: Stack) -> str:
    """A run id this account owns (a fresh gated train)."""
    [ref] = await confirmations(stack, 1, concurrency=1)
    async with ApiClient(stack) as client:
        out = await client.train(ref, "cli-status")
    if not out["ok"]:
        raise RuntimeError(f"train refused: {out['error']}")
    return out["data"]["run_id"]


async def measure(stack: Stack, runs: int) -> dict:
    stack.ecc_login()
    run_id = await _a_run(stack)
    python, _ = _wall([sys.executable, "-c", "pass"], stack.env, runs)
    help_s, help_all = _wall([str(BIN / "ecc"), "--help"], stack.env, runs)
    status_s, status_all = _wall([str(BIN / "ecc"), "ito", "status", run_id, "--json"], stack.env, runs)
    return {
        "ecc_help_s": round(help_s, 4),
        "ecc_status_json_s": round(status_s, 4),
        "python_bare_start_s": round(python, 4),
        "ecc_help_all_s": [round(t, 4) for t in help_all],
        "ecc_status_all_s": [round(t, 4) for t in status_all],
        "runs": runs,
    }
