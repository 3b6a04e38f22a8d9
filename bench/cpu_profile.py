"""Where the gated path's CPU goes (issue 30): each service process sampled by py-spy while 64
clients send gated train requests, each sample put in one phase, shares printed per service.

py-spy attaches to the running services from outside (ptrace): nothing in the services changes
for it, and the timed figures of `control_plane` are taken before, without it. A sample is the
stack of the thread holding the GIL (`--gil`: a pool thread waiting for work, or C code that let
the GIL go, is not the interpreter's CPU; without it idle pool threads were half the samples); its phase is the first frame,
from the innermost out, that belongs to a phase below (`phase_of`, a pure function tested as a
table): a Redis reply parsed inside the audit's code counts as Redis, and a frame of our own code
with nothing named under it counts as that module. The split is by samples, so it is a share of
each process's CPU, not a timing; the CPU per request beside it comes from /proc.

msgspec and PyNaCl run in C: their time shows on the Python line that called them (the codec's
decode and encode lines, the signing module's verify), which is why those modules are phases.
"""

import asyncio
import collections
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable

from bench.stack import Stack, confirmations, cpu_delta, cpu_seconds, drive

PHASES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("signatures", ("runtime/security/order_signatures.py", "nacl/", "hashlib")),
    ("decode/encode", ("runtime/messaging/codec.py", "msgspec/")),
    ("redis client", ("redis/",)),
    ("nats client", ("nats/",)),
    ("faststream", ("faststream/", "fast_depends/", "pydantic/")),
    ("audit", ("services/scheduler/audit.py",)),
    ("metrics", ("prometheus_client/", "runtime/messaging/metrics.py")),
    ("logging", ("logging/",)),
    (
        "plan and gate 5",
        ("services/scheduler/planning.py", "domain/", "services/scheduler/capacity.py"),
    ),
    (
        "manifest",
        (
            "services/scheduler/manifests.py",
            "services/scheduler/inputs.py",
            "services/scheduler/secret_scan.py",
        ),
    ),
)
"""Phase -> file path prefixes (as py-spy prints them: our files from the repository root, the
standard library's and site-packages' from the package). The first phase with a match wins."""
EVENT_LOOP = "event loop"  # asyncio and the selector, with nothing of ours or of a client under it
EVENT_LOOP_FILES = ("asyncio/", "selectors.py", "selector_events.py", "concurrent/", "threading.py")

SAMPLE_RATE_HZ = 250
ATTACH_WAIT_S = 1.0  # py-spy reads the process's memory maps before its first sample
STOP_TIMEOUT_S = 30.0  # py-spy writes its file once interrupted
_FRAME = re.compile(r"^(?P<function>.*) \((?P<path>.*):\d+\)$")


def frame_path(frame: str) -> str:
    """`answer_coded (runtime/messaging/codec.py:122)` -> `runtime/messaging/codec.py`."""
    m = _FRAME.match(frame.strip())
    return m["path"] if m else ""


def _inside_the_loop(frames: list[str]) -> list[str]:
    """The frames a callback of the event loop runs (after the loop's own `Handle._run`), or those
    after `_run_once` when the loop is between callbacks: `main -> asyncio.run -> run_forever` is
    every sample's root and says nothing about where the time goes."""
    for marker in ("Handle._run (asyncio/events.py", "BaseEventLoop._run_once (asyncio/base_events.py"):
        at = [i for i, f in enumerate(frames) if f.startswith(marker)]
        if at:
            return frames[at[-1] + 1 :]
    return frames


def phase_of(frames: list[str]) -> str:
    """The phase of one sample, its frames outermost first (py-spy's raw format)."""
    inside = _inside_the_loop(frames)
    if frames and not inside:
        return EVENT_LOOP  # the loop itself: selecting, scheduling
    paths = [frame_path(f) for f in reversed(inside)]  # innermost first
    for path in paths:
        for phase, prefixes in PHASES:
            if path.startswith(prefixes) or any(f"/{p}" in path for p in prefixes):
                return phase
        if path.startswith(("services/", "contracts/")):
            return path.removeprefix("services/")  # our own code, with no phase under it
    if paths and paths[0].startswith(EVENT_LOOP_FILES):
        return EVENT_LOOP
    return "other"


def breakdown(raw: Iterable[str]) -> tuple[int, dict[str, float]]:
    """(samples, share of samples per phase, largest first) from py-spy's raw output: one line a
    distinct stack, `frame;frame;... count`."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw:
        stack, _, n = line.rstrip().rpartition(" ")
        if stack and n.isdigit():
            counts[phase_of(stack.split(";"))] += int(n)
    total = sum(counts.values())
    if not total:
        return 0, {}
    return total, {phase: round(n / total, 3) for phase, n in counts.most_common()}


def py_spy() -> str | None:
    found = pathlib.Path(sys.executable).parent / "py-spy"
    return str(found) if found.exists() else shutil.which("py-spy")


async def profile(stack: Stack, requests: int, clients: int) -> dict:
    """Gated train requests (new keys, confirmations made first and not sampled) from `clients`
    connections while py-spy samples every service; the phases' shares per service."""
    binary = py_spy()
    if binary is None:
        return {
            "status": "not_available",
            "reason": "py-spy is not installed (make install puts it in .venv)",
        }
    refs = await confirmations(stack, requests)
    jobs = [(ref, f"prof-{i}") for i, ref in enumerate(refs)]
    pids = stack.service_pids()
    out = pathlib.Path(tempfile.mkdtemp(prefix="ito-bench-profile-"))
    samplers: dict[str, subprocess.Popen] = {}
    try:
        for name, pid in pids.items():
            samplers[name] = subprocess.Popen(
                [
                    binary,
                    "record",
                    "--pid",
                    str(pid),
                    "--rate",
                    str(SAMPLE_RATE_HZ),
                    "--gil",
                    "--format",
                    "raw",
                    "--output",
                    str(out / f"{name}.raw"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        await asyncio.sleep(ATTACH_WAIT_S)
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        answers, wall = await drive(stack, jobs, clients)
        cpu = {name: cpu_delta(cpu_seconds(pid), before[name]) for name, pid in pids.items()}
    finally:
        errors = {}
        for name, p in samplers.items():
            p.send_signal(signal.SIGINT)
            try:
                _, err = await asyncio.to_thread(p.communicate, timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                p.kill()
                err = "py-spy did not stop"
            if p.returncode not in (0, -signal.SIGINT):
                errors[name] = (err or "").strip()[-300:]
    services = {}
    for name in pids:
        raw = out / f"{name}.raw"
        if not raw.exists():
            services[name] = {"status": "error", "error": errors.get(name, "no samples written")}
            continue
        samples, shares = breakdown(raw.read_text().splitlines())
        user, system = cpu[name]
        services[name] = {
            "samples": samples,
            "cpu_ms_per_request": round(1000 * (user + system) / requests, 3),
            "phases": shares,
        }
    shutil.rmtree(out, ignore_errors=True)
    if all("phases" not in s for s in services.values()):
        # ptrace refused (a container without CAP_SYS_PTRACE, or yama's ptrace_scope)
        return {"status": "not_available", "reason": f"py-spy could not sample: {errors}"}
    return {
        "requests": requests,
        "clients": clients,
        "accepted": sum(1 for a in answers if a["ok"]),
        "wall_s": round(wall, 3),
        "sample_rate_hz": SAMPLE_RATE_HZ,
        "services": services,
    }


def lines(figures: dict) -> list[str]:
    """The breakdown as the table prints it: a line per service, its phases above 2 %."""
    out = []
    for name, s in figures["services"].items():
        if "phases" not in s:
            out.append(f"  {name}: {s.get('error', '?')}")
            continue
        if not s["samples"]:
            out.append(f"  {name} ({s['cpu_ms_per_request']:.2f} ms CPU/request): no sample, not on the path")
            continue
        shown = ", ".join(f"{p} {100 * v:.0f}%" for p, v in s["phases"].items() if v >= 0.02)
        out.append(
            f"  {name} ({s['cpu_ms_per_request']:.2f} ms CPU/request, {s['samples']} samples): {shown}"
        )
    return out
