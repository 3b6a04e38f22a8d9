"""Where the suite's time goes (bench/suite_times.py): the figures as a table on made-up records,
and the plugin and runner on a real pytest session of two tests."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from bench.suite_times import Record, display_id, split_args, summarise

REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("nodeid", "shown"),
    [
        ("tests/a.py::test_x", "tests/a.py::test_x"),
        ("tests/a.py::test_x@serial", "tests/a.py::test_x"),
        ("tests/a.py::test_x@tests/a.py", "tests/a.py::test_x"),
        ("tests/a.py::test_x[ddp-2]@tests/a.py", "tests/a.py::test_x[ddp-2]"),
        ("tests/a.py::test_x[me@host]", "tests/a.py::test_x[me@host]"),  # a parameter's @ stays
        ("tests/a@b.py", "tests/a@b.py"),
    ],
)
def test_the_group_suffix_is_dropped_from_the_shown_id(nodeid, shown):
    assert display_id(nodeid) == shown


@pytest.mark.parametrize(
    ("argv", "ours", "theirs"),
    [
        ([], [], ["-n", "2", "--dist", "loadgroup"]),  # make test's arguments
        (["--top", "5"], ["--top", "5"], ["-n", "2", "--dist", "loadgroup"]),
        (["--", "-q", "tests/x.py"], [], ["-q", "tests/x.py"]),
        (["--out", "d", "--"], ["--out", "d"], []),  # `make suite-times PYTEST_ARGS=`: one process
    ],
)
def test_flags_before_the_dashes_are_ours_and_after_them_pytests(argv, ours, theirs):
    assert split_args(argv) == (ours, theirs)


def test_the_summary_adds_per_worker_and_per_file_and_ranks_the_slowest():
    records = [
        Record("tests/a.py::t1@tests/a.py", "gw0", 100.0, 110.0),
        Record("tests/a.py::t2@tests/a.py", "gw0", 110.0, 113.0),
        Record("tests/b.py::t3", "gw1", 100.5, 105.5),
        Record("tests/c.py::t4@serial", "gw1", 105.5, 125.0),
    ]
    s = summarise(records, top=3)
    assert s.tests == 4
    assert s.span_s == 25.0 and s.sum_s == 37.5
    assert s.busy_s == {"gw0": 13.0, "gw1": 24.5}
    assert s.slowest == [("tests/c.py::t4", 19.5), ("tests/a.py::t1", 10.0), ("tests/b.py::t3", 5.0)]
    assert s.files == [("tests/c.py", 19.5), ("tests/a.py", 13.0), ("tests/b.py", 5.0)]
    assert summarise([], top=3).tests == 0


def test_a_timed_run_records_every_test_and_keeps_pytests_exit_status(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "test_two.py").write_text(
        "def test_passes():\n    pass\n\n\ndef test_fails():\n    assert False\n"
    )
    out = tmp_path / "times"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this worker's id
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.suite_times",
            "--out",
            str(out),
            "--",
            "-q",
            "-p",
            "no:cacheprovider",
            str(suite),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]  # pytest's: one test failed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["tests"] == 2 and summary["pytest_rc"] == 1
    assert summary["busy_s"].keys() == {"main"}
    assert {name.rsplit("::", 1)[1] for name, _ in summary["slowest"]} == {"test_passes", "test_fails"}
    assert "sum of test times" in done.stdout and "slowest 2 tests" in done.stdout
