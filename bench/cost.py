"""Estimate against spend: the demo's manifest and two others, planned, trained and metered on a
stack of every service; per run the plan's estimate, what it spent (the trainer's meter), their
ratio (target 0.7x-1.5x) and the phases the run's events show, which is what the calibration of
services/scheduler/calibration.py is fitted from.
"""

import json
import pathlib
import subprocess
import tempfile
import time
from datetime import datetime

from bench.stack import BIN, REPO, Stack, manifest_text
from services.scheduler import calibration

ALL_SERVICES = "entitlement,confirmation,ledger,scheduler,trainer,telemetry"
RUN_TIMEOUT_S = 900.0  # the full recipe on 2 busy cores takes minutes
ECC_TIMEOUT_S = 60.0
TERMINAL = {"succeeded", "failed", "gate_failed", "cancelled", "budget_exhausted"}


def manifests(mode: str) -> dict[str, str]:
    """name -> manifest text: the demo's (`make demo`), the tests' short one and the full recipe."""
    short = manifest_text()
    if mode == "quick":
        return {"short": short}
    return {
        "demo": (REPO / "examples" / "manifests" / "tiny.json").read_text(),
        "short": short,
        "full_recipe": (REPO / "examples" / "manifests" / "full.json").read_text(),
    }


def _ecc(stack: Stack, *args: str) -> dict:
    proc = subprocess.run(
        [str(BIN / "ecc"), "ito", *args, "--json"],
        env=stack.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=ECC_TIMEOUT_S,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if not lines:
        raise RuntimeError(f"ecc {args[0]} printed nothing: {proc.stderr[-1000:]}")
    return json.loads(lines[-1])


def _at(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def phases(metrics: list[dict], checkpoints: list[dict]) -> dict[str, float]:
    """What the run's events show: per stage its steps and seconds from first to last step
    (scaled by n/(n-1) for the first step's share), and the checkpoint saves' seconds."""
    stages: dict[str, list[float]] = {}
    for m in metrics:
        stages.setdefault(m["stage"], []).append(_at(m["at"]))
    out: dict[str, float] = {}
    for stage, ats in stages.items():
        n = len(ats)
        out[f"{stage}.steps"] = n
        out[f"{stage}.train_s"] = round((max(ats) - min(ats)) * n / max(n - 1, 1), 3)
    out["checkpoint_saves"] = len(checkpoints)
    out["checkpoint_s"] = round(sum(c["save_s"] for c in checkpoints), 3)
    return out


def measure_one(stack: Stack, name: str, text: str, workdir: pathlib.Path) -> dict:
    path = workdir / f"{name}.json"
    path.write_text(text)
    path.chmod(0o644)
    m = str(path)
    planned = _ecc(stack, "plan", "--booking", stack.booking, "--manifest", m)
    if not planned["ok"]:
        raise RuntimeError(f"{name}: plan refused: {planned['error']}")
    ref = _ecc(stack, "confirm", "--action", "train", "--booking", stack.booking, "--manifest", m)["data"][
        "confirmation_ref"
    ]
    key = f"cost-{name}-{int(time.time())}"
    started = time.monotonic()
    train = _ecc(
        stack,
        "train",
        "--booking",
        stack.booking,
        "--manifest",
        m,
        "--confirmation-ref",
        ref,
        "--idempotency-key",
        key,
    )
    if not train["ok"]:
        raise RuntimeError(f"{name}: train refused: {train['error']}")
    run_id = train["data"]["run_id"]
    while True:
        view = _ecc(stack, "status", run_id)["data"]
        if view["state"] in TERMINAL:
            break
        if time.monotonic() - started > RUN_TIMEOUT_S:
            raise RuntimeError(f"{name}: not finished within {RUN_TIMEOUT_S:g}s")
        time.sleep(1.0)
    metrics = _ecc(stack, "metrics", run_id)["data"]["points"]
    checkpoints = _ecc(stack, "checkpoints", run_id)["data"]["checkpoints"]
    cost = planned["data"]["cost"]
    spend = view["spend"]
    actual = spend["spent_usd"] + cost["checkpoint_storage_usd"]
    return {
        "state": view["state"],
        "estimate_usd": cost["total_usd"],
        "actual_usd": round(actual, 6),
        "estimate_over_actual": round(cost["total_usd"] / actual, 3) if actual > 0 else None,
        "estimate_wall_s": cost.get("wall_s", 0.0),
        "held_s": round(spend["held_gpu_s"] / max(spend["held_gpus"], 1), 2),
        "basis": cost.get("basis", "flops"),
        "estimate_phases_s": cost.get("phases_s", {}),
        "measured": phases(metrics, checkpoints),
    }


def run_all(mode: str) -> dict[str, dict]:
    stack = Stack(services=ALL_SERVICES)
    runs: dict[str, dict] = {}
    try:
        stack.up()
        import asyncio

        asyncio.run(stack.provision())
        stack.ecc_login()
        with tempfile.TemporaryDirectory(prefix="ito-bench-cost-") as d:
            for name, text in manifests(mode).items():
                runs[name] = measure_one(stack, name, text, pathlib.Path(d))
    finally:
        stack.close()
    ratios = [r["estimate_over_actual"] for r in runs.values() if r["estimate_over_actual"] is not None]
    figures: dict = {
        "runs": runs,
        "worst_ratio_low": min(ratios) if ratios else 0.0,
        "worst_ratio_high": max(ratios) if ratios else 0.0,
        "within_band": bool(ratios) and all(0.7 <= r <= 1.5 for r in ratios),
    }
    for name in ("demo", "short", "full_recipe"):  # quick mode runs the short one only
        figures[f"{name}_estimate_over_actual"] = runs[name]["estimate_over_actual"] if name in runs else None
    return {"cost_estimate": figures}


def record_figures(gpu_model: str, figures: dict[str, float], measured: str) -> None:
    """Write figures fitted from these runs as `gpu_model`'s measured entry of the desk's calibration
    (services/scheduler/desk_calibration.json): on a GPU backend it replaces the stated one (FLOPs at
    the assumed MFU), and the plan's basis then says "measured"."""
    calibration.write_measured(calibration.CALIBRATION_PATH, gpu_model, figures, measured)
