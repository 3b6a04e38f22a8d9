"""`python -m bench.gpu --dry-run`: the GPU benchmark's code path on the CPU (tiny shape, fp32, no
compile): the trainer's own step (`train_stage`, `run_loop`) beside the torchtitan-style reference
loop, so that it is ready when a GPU is lent. Checks the results file's fields, that both sides
trained from the same weights on the same batch, and the FLOPs formula; never timing."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

from bench.gpu import flops_per_token, peak_tflops
from contracts.models import MODEL_SHAPES, ModelShape
from training.model import count_parameters

REPO = pathlib.Path(__file__).resolve().parent.parent.parent
RUN_FIELDS = {
    "shape",
    "status",
    "error",
    "parallelism",
    "world_size",
    "device_name",
    "precision",
    "compile",
    "batch_size_per_gpu",
    "seq_len",
    "tokens_per_step",
    "steps",
    "warmup_steps",
    "oom_retries",
    "params",
    "matmul_params",
    "flops_per_token",
    "step_time_s",
    "step_time_p50_s",
    "step_time_max_s",
    "tokens_per_s",
    "tokens_per_s_per_gpu",
    "achieved_tflops_per_gpu",
    "peak_tflops_per_gpu",
    "mfu",
    "peak_memory_gib",
    "loss_first",
    "loss_last",
    "loss_finite",
    # issue 40: the reference loop beside the trainer's step, attention at d_attn, causal at half
    "attention_width",
    "flops_per_token_causal_half",
    "mfu_causal_half",
    "same_first_loss",
    "trainer_vs_reference",
    "trainer",
    "reference",
}
SIDE_FIELDS = {
    "status",
    "error",
    "speed",
    "batch_size",
    "step_time_s",
    "step_time_p50_s",
    "step_time_max_s",
    "tokens_per_s",
    "achieved_tflops",
    "mfu",
    "mfu_causal_half",
    "peak_allocated_gib",
    "peak_reserved_gib",
    "planner_estimate_gib",
    "planner_basis",
    "oom_retries",
    "loss_first",
    "loss_last",
    "loss_finite",
}


def dry_run(tmp_path: pathlib.Path, *extra: str) -> tuple[dict, str]:
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--dry-run", "--out", str(out), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> tuple[dict, str]:
    return dry_run(tmp_path_factory.mktemp("gpu"))


def is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def test_dry_run_times_the_trainer_and_the_reference_on_the_cpu_and_reports_every_field(single):
    results, stdout = single
    env, [run] = results["environment"], results["runs"]
    assert env["mode"] == "dry_run" and env["device_name"] == "cpu" and env["gpu_count"] == 0
    assert set(run) == RUN_FIELDS
    assert run["status"] == "ok" and run["error"] is None, run
    assert (run["shape"], run["parallelism"], run["precision"], run["compile"]) == (
        "tiny",
        "single",
        "fp32",
        False,
    )
    assert run["steps"] == 3 and run["tokens_per_step"] == run["batch_size_per_gpu"] * run["seq_len"]
    for side in ("trainer", "reference"):
        figures = run[side]
        assert set(figures) == SIDE_FIELDS and figures["status"] == "ok", (side, figures)
        for field in ("step_time_s", "tokens_per_s", "achieved_tflops", "loss_first", "loss_last"):
            assert is_number(figures[field]), (side, field, figures[field])
        # No GPU: no peak to compare with, so no MFU, and no GPU memory figure.
        assert figures["mfu"] is None and figures["mfu_causal_half"] is None
        assert figures["peak_allocated_gib"] is None and figures["peak_reserved_gib"] is None
        assert figures["planner_basis"]  # the estimate, or why there is none
    assert "no training.engine.speed" in run["trainer"]["speed"] or "Speed(" in run["trainer"]["speed"]
    assert "enable_gqa" in run["reference"]["speed"] and "fused AdamW" in run["reference"]["speed"]
    assert run["tokens_per_s"] == run["trainer"]["tokens_per_s"]  # the old fields are the trainer's
    assert is_number(run["trainer_vs_reference"])
    assert results["goal"]["mfu"] is None and results["goal"]["met"] is None
    assert "```json" in stdout and "MFU causal/2" in stdout  # the table and the JSON block


def test_both_sides_train_the_same_weights_on_the_same_batches(single):
    """The reference model loads the trainer's initial weights by name and draws the trainer's
    batches: the first losses agree, and both sides' losses are finite."""
    [run] = single[0]["runs"]
    assert run["same_first_loss"] is True, (run["trainer"]["loss_first"], run["reference"]["loss_first"])
    assert run["trainer"]["loss_finite"] and run["reference"]["loss_finite"]


def test_fsdp_says_where_multi_gpu_runs_went(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--dry-run", "--fsdp", "--out", str(tmp_path / "x.json")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "launcher" in proc.stderr


def test_flops_per_token_is_6n_plus_attention_over_the_attention_width():
    """N excludes the input embedding table (a lookup) and includes the untied head; the table's
    shapes have head_dim = d_model / n_head, so d_attn is d_model there."""
    for name in ("tiny", "150M", "1B"):
        s = MODEL_SHAPES[name]
        n = count_parameters(s) - s.vocab_size * s.d_model
        assert flops_per_token(s, 2048) == 6 * n + 12 * s.n_layer * s.d_model * 2048
    s = MODEL_SHAPES["1B"]
    assert flops_per_token(s, 4096) - flops_per_token(s, 2048) == 12 * s.n_layer * s.d_model * 2048
    # An explicit head_dim (Qwen3's kind): attention is as wide as n_head x head_dim, 32 here, not d_model 8.
    wide = ModelShape(
        n_layer=1,
        d_model=8,
        n_head=2,
        n_kv_head=1,
        head_dim=16,
        d_ff=16,
        vocab_size=10,
        max_seq_len=8,
        qk_norm=False,
    )
    assert flops_per_token(wide, 4) == 6 * (count_parameters(wide) - 80) + 12 * 1 * 32 * 4


@pytest.mark.parametrize(
    ("device_name", "peak"),
    [
        ("NVIDIA H200", 989.0),
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Tesla T4", None),
    ],
)
def test_peak_table_by_device_name(device_name, peak):
    assert peak_tflops(device_name) == peak
