"""What a person (or a tool, with --json) sees: envelopes, and progress while following a run."""

import argparse
import asyncio
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec

from contracts import subjects
from contracts.api import LogsRequest, StatusRequest
from contracts.envelope import Envelope
from contracts.states import TERMINAL_STATES, RunState
from ecc.transport import Client, SentButUnanswered

POLL_EVERY_S = 1.0
_encoder = msgspec.json.Encoder()


def show(args, env: Envelope) -> None:
    if getattr(args, "json", False):
        print(_encoder.encode(env).decode(), flush=True)
        return
    if not env.ok:
        assert env.error is not None
        print(f"error [{env.error.code.value}]: {env.error.message}", file=sys.stderr)
        return
    if env.notice:
        print(f"note: {env.notice}")
    print(_human(env.data))


def _bound(metric: dict) -> str:
    """A metric's gate: its threshold, or that it is reported and not gated."""
    if metric["threshold"] is None:
        return "reported, not gated"
    return f"gate {metric['op']} {metric['threshold']:.4f}"


def _is_login(data: Any) -> bool:
    return isinstance(data, dict) and set(data) == {"account", "key_id"}


def _login(data: dict) -> str:
    return f"logged in as {data['account']} (key {data['key_id']})"


def _is_bookings(data: Any) -> bool:
    return isinstance(data, list) and all(isinstance(v, dict) and "booking" in v for v in data)


def _bookings(data: list) -> str:
    rows = []
    for v in data:
        b, t = v["booking"], v["booking"]["topology"]
        allows = "allows training" if v["allows_training"] else f"no training: {v['reason']}"
        rows.append(
            f"{b['booking_id']}: {b['state']}, {t['nodes']}x{t['gpus_per_node']} {t['gpu_model']}, "
            f"{b['fabric']}, {b['region']}, until {b['window_end']} ({allows})"
        )
    return "\n".join(rows) or "(no bookings)"


def _is_run(data: Any) -> bool:
    return isinstance(data, dict) and "state" in data and "run_id" in data


def _run(data: dict) -> str:
    """A run's view: one line of state and progress, then one indented line per detail it has."""
    line = f"run {data['run_id']}: {data['state']}"
    if data.get("stage"):
        line += f" (stage {data['stage']}, step {data.get('step', 0)}/{data.get('total_steps', 0)}"
        if data.get("loss") is not None:
            line += f", loss {data['loss']:.4f}"
        line += ")"
    if data.get("message"):
        line += f"\n  {data['message']}"
    for gate in data.get("gates") or []:
        verdict = "passed" if gate["passed"] else "FAILED"
        numbers = ", ".join(f"{m['name']} {m['value']:.4f} ({_bound(m)})" for m in gate["metrics"])
        line += f"\n  gate {gate['stage']}: {verdict}: {numbers}"
    if data.get("provenance"):
        steps = ", ".join(f"{s['name']} {s['before']}->{s['after']}" for s in data["provenance"]["steps"])
        line += f"\n  data: {steps}"
    if data.get("proposal"):
        p = data["proposal"]
        line += (
            f"\n  proposal ({p['reason']}): restart {p['stage']} from checkpoint step {p['checkpoint_step']}, "
            f"skipping batches [{p['skip_from']}, {p['skip_to']}); approve with "
            f"`ecc ito confirm --action restart_from_checkpoint --run {data['run_id']}` then `ecc ito approve`"
        )
    if data.get("parallelism"):
        used = data["parallelism"]
        mesh = " x ".join(f"{dim} {size}" for dim, size in (used.get("mesh") or {}).items()) or "none"
        line += f"\n  parallelism: {used['strategy']}, world size {used['world_size']}, mesh {mesh}"
        if (data.get("nodes") or 1) > 1:
            line += f", {data['nodes']} nodes"
    if data.get("plan"):
        line += f"\n  plan: {data['plan']['strategy']}, estimate {data['plan']['cost']['total_usd']:.6f} USD"
    return line


def _confirmation(data: dict) -> str:
    return f"confirmation_ref: {data['confirmation_ref']} (expires {data['expires_at']})"


def _points(data: dict) -> str:
    return (
        "\n".join(
            f"{p['stage']} step {p['step']}/{p['total_steps']} loss {p['loss']:.4f} "
            f"lr {p['learning_rate']:.2e} {p['tokens_per_s']:.0f} tok/s"
            for p in data["points"]
        )
        or "(none)"
    )


def _checkpoints(data: dict) -> str:
    rows = [
        f"step {c['step']}: {c['bytes'] / 1e6:.1f} MB, loop stalled {c['stall_s'] * 1000:.1f} ms, "
        f"saved in {c['save_s']:.2f} s  {c['path']}"
        for c in data["checkpoints"]
    ]
    return "\n".join(rows) or ("(removed by cleanup)" if data.get("cleaned_up") else "(none yet)")


def _is_evals(data: Any) -> bool:
    return isinstance(data, dict) and "gates" in data and "run_id" in data and len(data) == 2


def _evals(data: dict) -> str:
    rows = []
    for g in data["gates"]:
        rows.append(f"{g['stage']}: {'passed' if g['passed'] else 'FAILED'}")
        rows += [
            f"  {m['name']} = {m['value']:.4f} ({_bound(m)}) {'ok' if m['passed'] else 'FAIL'}"
            for m in g["metrics"]
        ]
    return "\n".join(rows) or "(no stage has been evaluated yet)"


def _cleanup(data: dict) -> str:
    rows = [f"removed {a['path']} ({a['bytes']} bytes)" for a in data["removed"]]
    rows.append(
        f"{len(data['removed'])} artifacts removed; booking release requested: "
        f"{data['booking_release_requested']}"
    )
    return "\n".join(rows)


def _decisions(data: dict) -> str:
    return (
        "\n".join(
            f"{d['at']} {d['gate']}: {'pass' if d['ok'] else 'FAIL ' + str(d['code'])}"
            for d in data["decisions"]
        )
        or "(no decisions)"
    )


def _lines(data: dict) -> str:
    return "\n".join(f"{ln['at']} {ln['level']}: {ln['message']}" for ln in data["lines"]) or "(no lines)"


def _plan(data: dict) -> str:
    cost = data["cost"]
    rows = [
        f"strategy {data['strategy']} {data['degrees']} precision {data['precision']}",
        f"estimate {cost['total_usd']:.4f} USD ({cost['gpu_hours']:.4f} GPU-h at {cost['price_per_gpu_hour_usd']} USD)",
    ]
    rows += [f"  [{'ok' if c['ok'] else 'FAIL'}] {c['name']}: {c['reason']}" for c in data["checks"]]
    rows += [f"  gate {g['stage']}: " + "; ".join(g["rules"]) for g in data.get("gates", [])]
    return "\n".join(rows)


def _has(key: str) -> Callable[[Any], bool]:
    return lambda data: isinstance(data, dict) and key in data


RENDERERS: tuple[tuple[Callable[[Any], bool], Callable[[Any], str]], ...] = (
    (_is_login, _login),
    (_is_bookings, _bookings),
    (_is_run, _run),
    (_has("confirmation_ref"), _confirmation),
    (_has("points"), _points),
    (_has("checkpoints"), _checkpoints),
    (_is_evals, _evals),
    (_has("removed"), _cleanup),
    (_has("decisions"), _decisions),
    (_has("lines"), _lines),
    (_has("checks"), _plan),
)
"""(recognises the answer, renders it), tried in order: the first match wins, so a run view (which
may carry `gates` and `plan`) is recognised before the evals and plan answers."""


def _human(data: Any) -> str:
    for recognises, render in RENDERERS:
        if recognises(data):
            return render(data)
    return _encoder.encode(data).decode()


async def _call(args: argparse.Namespace, suffix: str, request: msgspec.Struct) -> Envelope | None:
    async with Client(args.connect_timeout, args.timeout) as client:
        try:
            return await client.call(suffix, request)
        except SentButUnanswered:
            return None  # a poll that timed out is retried on the next tick


def _progress(view: dict, started: float, first_step: int) -> str:
    step, total = view.get("step", 0), view.get("total_steps", 0)
    line = f"[{view['state']}] {view.get('stage') or '-'}"
    if total:
        line += f" step {step}/{total}"
    if view.get("loss") is not None:
        line += f" loss {view['loss']:.4f}"
    elapsed = time.monotonic() - started
    if total and step > first_step and elapsed > 0:
        rate = (step - first_step) / elapsed
        line += f" ETA {max(0.0, (total - step) / rate):.0f}s"
    return line


async def follow(args, req: StatusRequest) -> Envelope:
    """Poll until the run ends. Any refusal (credential revoked included) stops at once."""
    started, first_step, last_line, since = time.monotonic(), None, None, 0
    while True:
        env = await _call(args, subjects.API_STATUS, req)
        if env is None:
            await asyncio.sleep(POLL_EVERY_S)
            continue
        if not env.ok:
            return env
        view = env.data
        logs = await _call(args, subjects.API_LOGS, LogsRequest(run_id=view["run_id"], since=since))
        if logs is not None and logs.ok:
            since = logs.data["next"]
            for ln in logs.data["lines"]:
                if args.json:
                    print(_encoder.encode({"event": "log", **ln}).decode(), flush=True)
                else:
                    print(f"  log: {ln['message']}", flush=True)
        if first_step is None:
            first_step = view.get("step", 0)
        line = _progress(view, started, first_step)
        if args.json:
            print(_encoder.encode({"event": "status", "run": view}).decode(), flush=True)
        elif line != last_line:
            print(line, flush=True)
            last_line = line
        if RunState(view["state"]) in TERMINAL_STATES:
            return env
        await asyncio.sleep(POLL_EVERY_S)


async def follow_logs(args, req: LogsRequest) -> Envelope:
    since = req.since
    while True:
        env = await _call(args, subjects.API_LOGS, msgspec.structs.replace(req, since=since))
        if env is None:
            await asyncio.sleep(POLL_EVERY_S)
            continue
        if not env.ok:
            return env
        for ln in env.data["lines"]:
            print(
                _encoder.encode(ln).decode() if args.json else f"{ln['at']} {ln['level']}: {ln['message']}",
                flush=True,
            )
        since = env.data["next"]
        status = await _call(args, subjects.API_STATUS, StatusRequest(run_id=req.run_id))
        if (
            status is not None
            and status.ok
            and RunState(status.data["state"]) in TERMINAL_STATES
            and not env.data["lines"]
        ):
            return Envelope(
                ok=True, live_api_contacted=True, notice=None, data={"run_id": req.run_id, "next": since}
            )
        await asyncio.sleep(POLL_EVERY_S)
