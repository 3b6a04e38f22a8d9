"""`python -m bench.suite_times [--out DIR] [--top N] [-- PYTEST_ARGS]`: where the suite's time goes.

Runs pytest (by default as `make test` does: `-n 2 --dist loadgroup`) with this module loaded as a
plugin: every test's start and end, per xdist worker, goes to one JSON line in DIR. Then it prints
the wall time, each worker's busy time (a worker that waits for another's group shows here), the
sum of all test times (steadier than any one test's time under two busy workers), the slowest
tests and the slowest files, and writes them to DIR/summary.json. `make suite-times` runs it.

Timing lives here, never in asserts: the suite's tests do not know they are timed.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass

import pytest

from runtime.configuration.settings import ENV_SUITE_TIMES_DIR

DEFAULT_PYTEST_ARGS = ("-n", "2", "--dist", "loadgroup")
SUITE_TIMEOUT_S = 3 * 3600  # the suite's tests have their own timeouts; this bounds the whole
REPO = pathlib.Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Record:
    test: str
    worker: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Summary:
    tests: int
    span_s: float
    """First test's start to last test's end."""
    sum_s: float
    busy_s: dict[str, float]
    """Per worker: the sum of its tests' times."""
    slowest: list[tuple[str, float]]
    files: list[tuple[str, float]]


def display_id(nodeid: str) -> str:
    """The test's id without the `@group` suffix that xdist's loadgroup adds (tests/conftest.py);
    an `@` inside a parameter's brackets stays."""
    head, at, group = nodeid.rpartition("@")
    return head if at and "::" in head and not group.endswith("]") else nodeid


def summarise(records: list[Record], top: int = 20) -> Summary:
    """The figures of one timed run (pure: a table test feeds it made-up records)."""
    if not records:
        return Summary(0, 0.0, 0.0, {}, [], [])
    busy: dict[str, float] = defaultdict(float)
    files: dict[str, float] = defaultdict(float)
    for r in records:
        busy[r.worker] += r.seconds
        files[display_id(r.test).split("::", 1)[0]] += r.seconds
    ranked = sorted(records, key=lambda r: (-r.seconds, r.test))[:top]
    return Summary(
        tests=len(records),
        span_s=round(max(r.end for r in records) - min(r.start for r in records), 1),
        sum_s=round(sum(r.seconds for r in records), 1),
        busy_s={w: round(s, 1) for w, s in sorted(busy.items())},
        slowest=[(display_id(r.test), round(r.seconds, 1)) for r in ranked],
        files=[(f, round(s, 1)) for f, s in sorted(files.items(), key=lambda kv: (-kv[1], kv[0]))[:top]],
    )


def read_records(directory: pathlib.Path) -> list[Record]:
    return [
        Record(**json.loads(line))
        for path in sorted(directory.glob("*.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]


def table(s: Summary, wall_s: float | None = None) -> str:
    lines = [f"wall {wall_s:.0f} s"] if wall_s is not None else []
    lines += [
        f"{s.tests} tests; first start to last end {s.span_s:.0f} s; sum of test times {s.sum_s:.0f} s",
        "busy per worker: " + ", ".join(f"{w} {b:.0f} s" for w, b in s.busy_s.items()),
        f"slowest {len(s.slowest)} tests:",
        *(f"  {t:6.1f} s  {name}" for name, t in s.slowest),
        f"slowest {len(s.files)} files:",
        *(f"  {t:6.1f} s  {name}" for name, t in s.files),
    ]
    return "\n".join(lines)


# The plugin: active only where the runner (or a person) set ITO_SUITE_TIMES_DIR.
_sink = None


def _write(record: Record) -> None:
    global _sink
    if _sink is None:
        directory = pathlib.Path(os.environ[ENV_SUITE_TIMES_DIR])
        directory.mkdir(parents=True, exist_ok=True)
        _sink = open(directory / f"{record.worker}.jsonl", "a")  # open for the session
    _sink.write(json.dumps(asdict(record)) + "\n")
    _sink.flush()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.time()
    yield
    if os.environ.get(ENV_SUITE_TIMES_DIR):
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        _write(Record(test=item.nodeid, worker=worker, start=start, end=time.time()))


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """Our flags before `--`, pytest's after it; no `--`: pytest's arguments are `make test`'s."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, list(DEFAULT_PYTEST_ARGS)


def main(argv: list[str] | None = None) -> int:
    ours, pytest_args = split_args(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m bench.suite_times", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=pathlib.Path, default=REPO / "bench" / "suite-times")
    p.add_argument("--top", type=int, default=20)
    args = p.parse_args(ours)
    out: pathlib.Path = args.out.resolve()
    for old in out.glob("*.jsonl"):
        old.unlink()
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "bench.suite_times", *pytest_args],
        cwd=REPO,
        env={**os.environ, ENV_SUITE_TIMES_DIR: str(out)},
        timeout=SUITE_TIMEOUT_S,
    )
    wall_s = time.monotonic() - began
    summary = summarise(read_records(out), args.top)
    (out / "summary.json").write_text(
        json.dumps({"wall_s": round(wall_s, 1), "pytest_rc": done.returncode, **asdict(summary)}, indent=2)
    )
    print(table(summary, wall_s))
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
