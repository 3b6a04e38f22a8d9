"""`make bench` in quick mode, end to end, so the benchmarks cannot rot: every benchmark runs
against real NATS, Redis and service processes and writes numeric figures. No timing is asserted
(timing lives in bench/); correctness figures are (exactly-once: N keys -> N runs)."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

from bench.report import HEADLINES, figure

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(540)]  # the fixture runs the whole bench
REPO = pathlib.Path(__file__).resolve().parent.parent.parent
QUICK_BENCHMARKS = {
    "control_plane_latency",
    "control_plane_throughput",
    "control_plane_profile",
    "exactly_once",
    "quota_fairness",
    "heavy_manifests",
    "upload_throughput",
    "cli_startup",
    "trainer_pretrain",
    "trainer_vs_reference_tiny",
    "trainer_vs_reference_small",
    "trainer_dpo",
    "trainer_grpo",
    "memory_estimate",
    "checkpoint_tiny",
    "hf_sft",
    "hf_dpo",
    "hf_tokenize",
    "hf_export",
    "sample_tiny",
    "sample_small",
}
ENVIRONMENT_FIELDS = {"mode", "cpu_count", "cpu_model", "libraries", "python", "torch", "git_commit", "infra"}


def is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.run", "--quick", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=480,  # the hf rows (TRL's trainers) add ~1 min on 2 busy cores
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ratio_p50_to_bare_sum" in proc.stdout  # the table was printed
    return json.loads(out.read_text())


def test_quick_mode_reports_every_benchmark_with_numeric_figures(results):
    env, benchmarks = results["environment"], results["benchmarks"]
    assert env["mode"] == "quick" and ENVIRONMENT_FIELDS <= env.keys(), env
    assert set(benchmarks) == QUICK_BENCHMARKS
    for name, entry in benchmarks.items():
        if entry["status"] == "not_available":  # DPO/GRPO before their losses exist: a reason, not silence
            assert name in {"trainer_dpo", "trainer_grpo"} and entry["reason"], entry
            continue
        assert entry["status"] == "ok", (name, entry)
        for path, _ in HEADLINES[name]:
            assert is_number(figure(entry["figures"], path)), (name, path, entry["figures"])
        for target in entry["targets"]:
            assert isinstance(target["met"], bool), (name, target)


def test_quick_mode_creates_exactly_one_run_per_key(results):
    once = results["benchmarks"]["exactly_once"]["figures"]
    assert once["requests"] == 10 * once["keys"]
    assert once["runs"] == once["keys"] == once["work_queue_messages"]
    assert once["duplicates"] == 0 and once["lost"] == 0 and once["errors"] == {}


def test_quick_mode_compares_the_same_training_work(results):
    """Both sides of each trainer comparison start from the same weights and batch."""
    for name in (
        "trainer_pretrain",
        "trainer_vs_reference_tiny",
        "trainer_vs_reference_small",
        "trainer_dpo",
        "trainer_grpo",
    ):
        entry = results["benchmarks"][name]
        if entry["status"] == "ok":
            assert entry["figures"]["same_first_loss"], (name, entry["figures"])
    for name in ("hf_sft", "hf_dpo"):  # ours and TRL train on the same token ids
        assert results["benchmarks"][name]["figures"]["same_tokens"], results["benchmarks"][name]


def test_quick_mode_says_where_each_services_cpu_goes(results):
    """Issue 30: the gated path's CPU by service and by phase (py-spy), printed with the table."""
    profile = results["benchmarks"]["control_plane_profile"]["figures"]
    assert set(profile["services"]) == {"entitlement", "confirmation", "ledger", "scheduler"}
    for name in ("scheduler", "ledger", "entitlement"):  # each handles part of every train request
        assert profile["services"][name]["samples"] > 0, (name, profile["services"][name])
    for name, service in profile["services"].items():  # the confirmation service: not on the path
        if service["samples"]:
            assert abs(sum(service["phases"].values()) - 1) < 0.01, (name, service["phases"])
    assert "redis client" in profile["services"]["ledger"]["phases"]  # its accept is a Redis script
