"""`python -m bench.gpu [--shapes 150M,1B] [--steps N] [--warmup N] [--compile/--no-compile]
[--batch-size B] [--seq-len T] [--dry-run] [--out PATH]`: the trainer's own step on one GPU, beside
a reference loop of the same shape, in one run.

For each shape of `contracts.models.MODEL_SHAPES` two sides run one after the other on the same
batches and the same initial weights (bench/reference_loop.py says how):
- "trainer": `training.recipes.pretrain.train_stage` itself: `build_model`, the trainer's
  optimizer and schedule, `run_loop`, the real data path (a `BatchIterator` over the stage's tokens,
  pinned host -> device by `_lm_step`), and the stage's speed switches (`training.engine.speed.Speed`
  where it exists: compile on cuda by default; else the trainer runs eager and the JSON says so).
  Timed from the loop's metrics events.
- "reference": a self-contained loop as torchtitan writes it: per-block `torch.compile`, fused
  AdamW, SDPA with `enable_gqa`, bf16 autocast on cuda.

Reported per side: step time (the timed window's mean; p50 of the host-side step gaps beside it),
tokens/s, achieved TFLOPS, MFU in the 6N + 12·L·d_attn·T convention and with causal attention
counted at half (bench/mfu.py: d_attn = n_head x head_dim), peak allocated and reserved GPU memory
(`torch.cuda.max_memory_allocated/reserved`), and the planner's estimate for the same micro-batch
when `services/scheduler/gpu_memory.py` (helper "mem"'s model) is in the tree (else null, with a
note saying why). MFU is over the GPU's dense bf16 peak (`PEAK_BF16_TFLOPS`; null on the CPU).
The trainer's tokens/s over the reference's is `trainer_vs_reference`.

The prepared GPU run (issue 40, item 7; `bench/gpu_device_check.sh`): 150M and 1B in bf16, 20 timed
steps after 5 warm-up, about 4-6 minutes on one H100/H200 with compilation; no network, nothing
installed. The trainer's imports need msgspec (contracts/ are msgspec Structs): the device check
installs its wheel from a carried `.whl/` folder when the GPU image lacks it. An out-of-memory
halves that side's batch and retries; any other error is recorded and the other side still runs.
Figures are printed as a JSON block and written to `--out`; the exit status is non-zero only when
a side could not run. `--dry-run`: the same code on the CPU with the tiny shape, 3 timed steps,
fp32, no compile: the test suite runs it (tests/bench/test_gpu_dry_run.py) so this file cannot rot.
"""

import argparse
import dataclasses
import gc
import json
import math
import pathlib
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench import mfu, report, stats
from bench.reference_loop import Run, Timing, reference_side, trainer_side, window
from contracts.models import MODEL_SHAPES, ModelShape
from domain.model_shapes import count_parameters

BENCH_DIR = pathlib.Path(__file__).resolve().parent
REPO = BENCH_DIR.parent

# Dense bf16 tensor-core peak per GPU, TFLOPS (vendor datasheets, without sparsity), matched as a
# substring of torch.cuda.get_device_name(); first match wins, so the PCIe H100 precedes "H100".
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),
    ("A100", 312.0),
)

# Per-GPU batch (sequences) x sequence length. 150M: 32k tokens a step; 1B: 16k at its full context
# (measured on an H200 on 2026-12-04: 70 GiB peak compiled; eager with fp32 logits needs more: an
# out-of-memory halves the batch and retries). Raise --batch-size on a GPU with room.
DEFAULT_BATCH = {"tiny": (4, 64), "150M": (16, 2048), "1B": (4, 4096), "8B": (1, 8192)}
DRY_RUN_SHAPE, DRY_RUN_STEPS, DRY_RUN_WARMUP = "tiny", 3, 1
GOAL_SHAPE, GOAL_MFU = "1B", 0.40  # issue 40: >= 40 % bf16 MFU (6N + 12LdT) for 1B on one H100/H200
SIDES = ("trainer", "reference")
# The trainer side's figures repeated at the top of a run: the fields the results file had before.
TRAINER_FIELDS = (
    "step_time_s",
    "step_time_p50_s",
    "tokens_per_s",
    "mfu",
    "mfu_causal_half",
    "oom_retries",
    "loss_first",
    "loss_last",
    "loss_finite",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    shapes: tuple[str, ...]
    """Names from contracts.models.MODEL_SHAPES, run one after the other."""
    steps: int
    """Timed optimizer steps per shape and side."""
    warmup: int
    """Steps before the timed window (compilation happens in the first)."""
    compile: bool | None
    """Both sides; None: the trainer's default (on with cuda)."""
    dry_run: bool
    """CPU, fp32, the tiny shape: the code path without a GPU."""
    batch_size: int | None
    """Sequences per step; None: DEFAULT_BATCH for the shape."""
    seq_len: int | None
    """Tokens per sequence; None: DEFAULT_BATCH for the shape."""
    out: pathlib.Path

    def __post_init__(self) -> None:
        unknown = [s for s in self.shapes if s not in MODEL_SHAPES]
        if not self.shapes or unknown:
            raise ValueError(f"Shapes must come from {', '.join(MODEL_SHAPES)}; got {unknown or 'none'}.")
        if self.steps < 1 or self.warmup < 1:
            raise ValueError("The benchmark needs at least 1 timed step and 1 warm-up step.")
        if (self.batch_size is not None and self.batch_size < 1) or (
            self.seq_len is not None and self.seq_len < 2
        ):
            raise ValueError("The batch size must be at least 1 and the sequence length at least 2.")


def peak_tflops(device_name: str) -> float | None:
    """Dense bf16 peak of a GPU by its name, or None when the name is not in the table."""
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in device_name:
            return tflops
    return None


def matmul_params(shape: ModelShape) -> int:
    """N of the FLOPs formula (bench/mfu.py)."""
    return mfu.matmul_params(shape)


def flops_per_token(shape: ModelShape, seq_len: int) -> int:
    """6 * N + 12 * n_layer * d_attn * seq_len, d_attn = n_head * head_dim (bench/mfu.py)."""
    return mfu.flops(shape, seq_len).per_token


def planner_estimate(run: Run, gpu_bytes: float) -> tuple[int | None, str]:
    """(the planner's bytes for one GPU training `run` unsharded, what they rest on), or None and
    why: helper "mem"'s `services/scheduler/gpu_memory.py` may not be in this tree yet."""
    try:
        from services.scheduler import gpu_memory  # type: ignore[attr-defined,unused-ignore]
    except ImportError:
        return None, "services/scheduler/gpu_memory.py is not in this tree: no planner estimate"
    try:
        shape = MODEL_SHAPES[run.shape]
        cal = gpu_memory.load()[gpu_memory.GPU_KIND]
        plan = gpu_memory.estimate(
            cal,
            shape,
            gpu_memory.state(cal, count_parameters(shape)),
            micro_batch=run.batch_size,
            seq_len=run.seq_len,
            policy="none",
            gpu_bytes=gpu_bytes,
            compiled=run.compiled,
        )
    except Exception as e:  # its interface is another helper's and may move: say so, do not fail
        return None, f"services.scheduler.gpu_memory could not estimate: {type(e).__name__}: {e}"
    return int(plan.total_bytes), plan.basis


# --- one side of one shape -----------------------------------------------------------------------


def side_figures(timing: Timing, run: Run, peak: float | None) -> dict:
    """A side's figures from its step timestamps and losses (pure but for the timing it is given)."""
    step_s = window(timing, run.warmup, run.steps)
    tokens_per_s = run.batch_size * run.seq_len / step_s if step_s > 0 else math.nan
    f = mfu.flops(MODEL_SHAPES[run.shape], run.seq_len)
    gaps = timing.step_times(run.warmup)
    utilisation = mfu.mfu(f.per_token, tokens_per_s, peak)
    causal = mfu.mfu(f.per_token_causal, tokens_per_s, peak)
    gib = 2**30
    return {
        "status": "ok",
        "error": None,
        "speed": timing.speed,
        "batch_size": run.batch_size,
        "step_time_s": round(step_s, 6),
        "step_time_p50_s": round(stats.median(gaps), 6) if gaps else None,
        "step_time_max_s": round(max(gaps), 6) if gaps else None,
        "tokens_per_s": round(tokens_per_s, 1),
        "achieved_tflops": round(mfu.achieved_tflops(f.per_token, tokens_per_s), 4),
        "mfu": None if utilisation is None else round(utilisation, 4),
        "mfu_causal_half": None if causal is None else round(causal, 4),
        "peak_allocated_gib": None
        if timing.peak_allocated is None
        else round(timing.peak_allocated / gib, 2),
        "peak_reserved_gib": None if timing.peak_reserved is None else round(timing.peak_reserved / gib, 2),
        "loss_first": timing.losses[0] if timing.losses else None,
        "loss_last": timing.losses[-1] if timing.losses else None,
        "loss_finite": all(math.isfinite(v) for v in timing.losses),
    }


def run_side(side: Callable[[Run], Timing], run: Run, peak: float | None, gpu_bytes: float) -> dict:
    """One side's figures; an out-of-memory halves the batch and retries, other errors are kept."""
    retries = 0
    while True:
        _free(run.device)
        try:
            figures = side_figures(side(run), run, peak)
            estimate, basis = planner_estimate(run, gpu_bytes)
            figures |= {
                "oom_retries": retries,
                "planner_estimate_gib": None if estimate is None else round(estimate / 2**30, 2),
                "planner_basis": basis,
            }
            return figures
        except torch.OutOfMemoryError as e:
            if run.batch_size == 1:
                return {"status": "error", "error": f"OutOfMemoryError: {str(e).splitlines()[0]}"}
            run, retries = dataclasses.replace(run, batch_size=run.batch_size // 2), retries + 1
            print(f"{run.shape}: out of memory, retrying with batch {run.batch_size}", file=sys.stderr)
        except Exception as e:  # one side that breaks is reported, and the other still runs
            traceback.print_exc()
            return {"status": "error", "error": f"{type(e).__name__}: {e}"}
        finally:
            _free(run.device)


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def run_shape(cfg: Config, name: str, device: str, device_name: str) -> dict:
    """Both sides of one shape, and the trainer's figures again at the top level (the fields the
    results file had before the reference side came)."""
    shape = MODEL_SHAPES[name]
    default_batch, default_seq = DEFAULT_BATCH.get(name, (1, shape.max_seq_len))
    run = Run(
        shape=name,
        batch_size=cfg.batch_size or default_batch,
        seq_len=min(cfg.seq_len or default_seq, shape.max_seq_len),
        steps=cfg.steps,
        warmup=cfg.warmup,
        device=device,
        compile=cfg.compile,
    )
    peak = peak_tflops(device_name) if device == "cuda" else None
    gpu_bytes = torch.cuda.get_device_properties(0).total_memory if device == "cuda" else 0.0
    sides = {"trainer": run_side(trainer_side, run, peak, gpu_bytes)}
    sides["reference"] = run_side(reference_side, run, peak, gpu_bytes)
    trainer, reference = sides["trainer"], sides["reference"]
    f = mfu.flops(shape, run.seq_len)
    both_ok = trainer["status"] == reference["status"] == "ok"
    return {
        "shape": name,
        "status": "ok" if both_ok else "error",
        "error": trainer.get("error") or reference.get("error"),
        "parallelism": "single",
        "world_size": 1,
        "device_name": device_name,
        "precision": "bf16 autocast" if device == "cuda" else "fp32",
        "compile": run.compiled,
        "batch_size_per_gpu": trainer.get("batch_size", run.batch_size),
        "seq_len": run.seq_len,
        "tokens_per_step": trainer.get("batch_size", run.batch_size) * run.seq_len,
        "steps": cfg.steps,
        "warmup_steps": cfg.warmup,
        "params": count_parameters(shape),
        "matmul_params": f.matmul_params,
        "attention_width": f.attention_width,
        "flops_per_token": f.per_token,
        "flops_per_token_causal_half": f.per_token_causal,
        "peak_tflops_per_gpu": peak,
        **{k: trainer.get(k) for k in TRAINER_FIELDS},
        "step_time_max_s": trainer.get("step_time_max_s"),
        "tokens_per_s_per_gpu": trainer.get("tokens_per_s"),
        "achieved_tflops_per_gpu": trainer.get("achieved_tflops"),
        "peak_memory_gib": trainer.get("peak_allocated_gib"),
        "same_first_loss": both_ok
        and math.isclose(
            trainer["loss_first"], reference["loss_first"], rel_tol=2e-2 if device == "cuda" else 1e-5
        ),
        "trainer_vs_reference": round(trainer["tokens_per_s"] / reference["tokens_per_s"], 3)
        if both_ok
        else None,
        "trainer": trainer,
        "reference": reference,
    }


# --- report ------------------------------------------------------------------------------------

COLUMNS = (  # (header, side field, format)
    ("step ms", "step_time_s", "{:.1f}"),
    ("tokens/s", "tokens_per_s", "{:,.0f}"),
    ("TFLOPS", "achieved_tflops", "{:.1f}"),
    ("MFU", "mfu", "{:.1%}"),
    ("MFU causal/2", "mfu_causal_half", "{:.1%}"),
    ("alloc GiB", "peak_allocated_gib", "{:.1f}"),
    ("reserved GiB", "peak_reserved_gib", "{:.1f}"),
    ("planner GiB", "planner_estimate_gib", "{:.1f}"),
)


def _cell(figures: dict, field: str, fmt: str) -> str:
    value = figures.get(field)
    if value is None:
        return "-"
    return fmt.format(value * 1000 if field == "step_time_s" else value)


def table(results: dict) -> str:
    env = results["environment"]
    rows = [["shape", "side", "batch x seq", *(h for h, _, _ in COLUMNS)]]
    for run in results["runs"]:
        for side in SIDES:
            figures = run[side]
            size = f"{figures.get('batch_size', run['batch_size_per_gpu'])}x{run['seq_len']}"
            rows.append([run["shape"], side, size, *(_cell(figures, f, fmt) for _, f, fmt in COLUMNS)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [
        f"{env['device_name']} · torch {env['torch']} · {env['precision']} · {results['formula']}",
        "  ".join(h.ljust(w) for h, w in zip(rows[0], widths, strict=True)),
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows[1:]]
    for run in results["runs"]:
        lines.append(f"{run['shape']}: trainer / reference tokens/s = {run['trainer_vs_reference']}")
        lines += [f"{run['shape']} {side}: {run[side]['error']}" for side in SIDES if run[side].get("error")]
    goal = results["goal"]
    if goal["mfu"] is not None:
        lines.append(f"goal: {goal['target']}: MFU {goal['mfu']:.1%}, {'met' if goal['met'] else 'not met'}")
    return "\n".join(lines)


def goal(runs: list[dict]) -> dict:
    """Issue 40's goal against this run's 1B trainer figure on one H100/H200 (None without one)."""
    value = next(
        (
            r["trainer"].get("mfu")
            for r in runs
            if r["shape"] == GOAL_SHAPE and r["trainer"].get("mfu") and "H" in r["device_name"]
        ),
        None,
    )
    return {
        "target": f">= {GOAL_MFU:.0%} bf16 MFU (6N + 12·L·d_attn·T) for the trainer's {GOAL_SHAPE} step on one H100/H200",
        "mfu": value,
        "met": None if value is None else value >= GOAL_MFU,
    }


# --- entry point -------------------------------------------------------------------------------


def parse(argv: list[str]) -> Config:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="150M,1B", help="comma-separated MODEL_SHAPES names")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per shape and side")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    parser.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=None, help="default: on with CUDA"
    )
    parser.add_argument("--fsdp", action="store_true", help="no longer here: see the error it gives")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, 3 steps, fp32, no compile")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="default bench/gpu_results.json")
    args = parser.parse_args(argv)
    if args.fsdp:
        parser.error(
            "--fsdp is gone: this bench times the trainer's own step on one GPU; several GPUs run the "
            "trainer under its launcher (training/launch), which shards as the plan says."
        )
    try:
        return Config(
            shapes=(DRY_RUN_SHAPE,)
            if args.dry_run
            else tuple(s.strip() for s in args.shapes.split(",") if s.strip()),
            steps=DRY_RUN_STEPS if args.dry_run else args.steps,
            warmup=DRY_RUN_WARMUP if args.dry_run else args.warmup,
            compile=False if args.dry_run else args.compile,
            dry_run=args.dry_run,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            out=args.out or BENCH_DIR / ("gpu_dry_run.json" if args.dry_run else "gpu_results.json"),
        )
    except ValueError as e:
        parser.error(str(e))


def main(argv: list[str] | None = None) -> int:
    cfg = parse(sys.argv[1:] if argv is None else argv)
    if not cfg.dry_run and not torch.cuda.is_available():
        print("bench.gpu: no CUDA device here; `--dry-run` runs the same path on the CPU.", file=sys.stderr)
        return 2
    device = "cpu" if cfg.dry_run else "cuda"
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.set_float32_matmul_precision("high")  # TF32 for whatever stays fp32 outside autocast
    device_name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
    runs = [run_shape(cfg, name, device, device_name) for name in cfg.shapes]
    env = report.environment("dry_run" if cfg.dry_run else "gpu")
    env |= {
        "device_name": device_name,
        "gpu_count": torch.cuda.device_count() if device == "cuda" else 0,
        "cuda": torch.version.cuda,
        "precision": runs[0]["precision"],
        "config": {
            k: str(v) if isinstance(v, pathlib.Path) else v for k, v in dataclasses.asdict(cfg).items()
        },
    }
    results = {
        "environment": env,
        "formula": "flops/token = 6*N + 12*n_layer*d_attn*seq_len (d_attn = n_head*head_dim); "
        "causal/2 counts attention at half; MFU = TFLOPS / dense bf16 peak",
        "runs": runs,
        "goal": goal(runs),
    }
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    print("\n```json\n" + json.dumps({"runs": runs, "goal": results["goal"]}, indent=2) + "\n```")
    print(f"\nresults: {cfg.out}")
    return 0 if all(run["status"] == "ok" for run in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
