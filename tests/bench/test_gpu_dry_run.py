"""`python -m bench.gpu --dry-run`: the GPU benchmark's code path on the CPU (tiny shape, fp32, no
compile), alone and under FSDP2 at world size 1, so that it is ready when a GPU is lent. Checks the
results file's fields, that training steps ran, and the FLOPs formula; never timing."""

import json
import math
import pathlib
import subprocess
import sys

import pytest

from bench.gpu import flops_per_token, peak_tflops
from contracts.models import MODEL_SHAPES
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
}


def dry_run(tmp_path: pathlib.Path, *extra: str) -> dict:
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu", "--dry-run", "--out", str(out), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "tokens/s" in proc.stdout and "MFU" in proc.stdout  # the table was printed
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return dry_run(tmp_path_factory.mktemp("gpu"))


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> dict:
    return dry_run(tmp_path_factory.mktemp("gpu_fsdp"), "--fsdp")


def is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def test_dry_run_trains_the_tiny_shape_on_the_cpu_and_reports_every_field(single):
    env, [run] = single["environment"], single["runs"]
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
    for field in ("step_time_s", "tokens_per_s", "achieved_tflops_per_gpu", "loss_first", "loss_last"):
        assert is_number(run[field]), (field, run[field])
    # No GPU: no peak to compare with, so no MFU, and no GPU memory figure.
    assert run["mfu"] is None and run["peak_tflops_per_gpu"] is None and run["peak_memory_gib"] is None
    assert single["goal"]["mfu"] is None and single["goal"]["met"] is None


def test_dry_run_steps_train_the_model(single):
    """The training step ran: finite losses, falling on the fixed synthetic batch."""
    [run] = single["runs"]
    assert run["loss_finite"] is True
    assert run["loss_last"] < run["loss_first"], run


def test_fsdp_dry_run_matches_the_single_process_step(single, fsdp):
    """FSDP2 at world size 1 (gloo) trains the same weights on the same batch: same losses."""
    [one], [sharded] = single["runs"], fsdp["runs"]
    assert sharded["status"] == "ok" and sharded["parallelism"] == "fsdp2" and sharded["world_size"] == 1
    assert set(sharded) == RUN_FIELDS
    assert math.isclose(sharded["loss_first"], one["loss_first"], rel_tol=1e-5)
    assert math.isclose(sharded["loss_last"], one["loss_last"], rel_tol=1e-4)


def test_flops_per_token_is_6n_plus_attention():
    """N excludes the input embedding table (a lookup) and includes the untied head."""
    for name in ("tiny", "150M", "1B"):
        s = MODEL_SHAPES[name]
        n = count_parameters(s) - s.vocab_size * s.d_model
        assert flops_per_token(s, 2048) == 6 * n + 12 * s.n_layer * s.d_model * 2048
    s = MODEL_SHAPES["1B"]
    assert flops_per_token(s, 4096) - flops_per_token(s, 2048) == 12 * s.n_layer * s.d_model * 2048


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
