"""`python -m bench.gpu [--shapes 150M,1B] [--steps N] [--compile/--no-compile] [--fsdp] [--dry-run]
[--out PATH]`: training throughput and MFU of the trainer's model on GPUs.

Trains each shape from `contracts.models.MODEL_SHAPES` (the model of `training/model.py`,
imported as it is) for `--warmup` + `--steps` optimizer steps on one fixed synthetic batch and
reports tokens/s, step time, peak GPU memory, achieved TFLOPS per GPU and MFU. A step is what the
trainer does: forward, cross-entropy, backward, gradient clipping at 1.0, fused AdamW, zero_grad.

- One GPU (default): fp32 parameters (the master copy) under bf16 autocast; each transformer
  block compiled with `torch.compile` (the blocks are identical, so they share one graph; the
  embedding and the fp32 loss over the vocabulary stay eager).
- `--fsdp`: FSDP2 (`fully_shard` per block, then the root) over every local GPU, bf16 parameters
  for compute and fp32 gradient reduction (`MixedPrecisionPolicy`), fp32 sharded master weights.
  With more than one GPU and no launcher the script re-executes itself as
  `python -m torch.distributed.run --standalone --nproc-per-node <GPUs> -m bench.gpu --fsdp ...`
  (the same command works by hand); with one GPU it runs FSDP2 in-process at world size 1.
- `--dry-run`: the same code path on the CPU with the "tiny" shape, 3 timed steps, fp32, no
  compile (gloo instead of NCCL under `--fsdp`). The test suite runs it so this file cannot rot.

FLOPs per token (PaLM appendix B, nanoGPT's `estimate_mfu`):

    flops_per_token = 6 * N + 12 * n_layer * d_model * seq_len

N counts every parameter a token is multiplied by: all of them except the input embedding table
(a lookup); the untied `lm_head` counts. The second term is attention's QK^T and AV products,
forward and backward, counted in full even though causal kernels skip the masked half, as the
convention has it. achieved TFLOPS per GPU = flops_per_token * tokens/s per GPU; MFU = that over
the GPU's dense bf16 peak from `PEAK_BF16_TFLOPS` (null for an unknown GPU and on the CPU).

Warm-up steps (compilation, allocator, autotuning) are outside the timed window, which is
bracketed by `torch.cuda.synchronize()`; per-step times come from CUDA events. Figures are
reported, never asserted; the exit status is non-zero only when a shape could not run. An
out-of-memory halves the batch and retries (under `--fsdp` every rank must hit it alike, else the
others wait in a collective: the device check runs each command under `timeout`).
"""

import argparse
import dataclasses
import gc
import itertools
import json
import math
import os
import pathlib
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass

import torch

from bench import report, stats
from contracts.models import MODEL_SHAPES, ModelShape
from training.model import Transformer, count_parameters

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

# Per-GPU batch (sequences) x sequence length. 150M: 32k tokens a step; 1B: 16k tokens at its full
# context, about 100 GiB at peak on one H200 eager (the fp32 logits over 128k words are ~25 GiB of
# it). Raise --batch-size on a GPU with room; an out-of-memory halves the batch and retries.
DEFAULT_BATCH = {"tiny": (4, 64), "150M": (16, 2048), "1B": (4, 4096), "8B": (1, 8192)}
DRY_RUN_SHAPE, DRY_RUN_STEPS, DRY_RUN_WARMUP = "tiny", 3, 1
GOAL_SHAPE, GOAL_MFU = "1B", 0.40  # issue 14: >= 40 % bf16 MFU for 1B on one H200 (reported, not asserted)
LEARNING_RATE = 3e-4  # the synthetic batch is fixed, so the loss falls: a cheap sanity check
WEIGHT_DECAY = 0.1


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    shapes: tuple[str, ...]
    """Names from contracts.models.MODEL_SHAPES, run one after the other."""
    steps: int
    """Timed optimizer steps per shape."""
    warmup: int
    """Steps before the timed window (compilation happens in the first)."""
    compile: bool
    """torch.compile each transformer block."""
    fsdp: bool
    """FSDP2 over every local GPU instead of one GPU."""
    dry_run: bool
    """CPU, fp32, the tiny shape: the code path without a GPU."""
    batch_size: int | None
    """Sequences per GPU per step; None: DEFAULT_BATCH for the shape."""
    seq_len: int | None
    """Tokens per sequence; None: DEFAULT_BATCH for the shape."""
    out: pathlib.Path

    def __post_init__(self) -> None:
        unknown = [s for s in self.shapes if s not in MODEL_SHAPES]
        if not self.shapes or unknown:
            raise ValueError(f"Shapes must come from {', '.join(MODEL_SHAPES)}; got {unknown or 'none'}.")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError("The benchmark needs at least 1 timed step and no negative warm-up.")
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
    """N of the FLOPs formula: every parameter but the input embedding table (a lookup)."""
    return count_parameters(shape) - shape.vocab_size * shape.d_model


def flops_per_token(shape: ModelShape, seq_len: int) -> int:
    """6 * N + 12 * n_layer * d_model * seq_len (see the module docstring)."""
    return 6 * matmul_params(shape) + 12 * shape.n_layer * shape.d_model * seq_len


# --- the distributed side ----------------------------------------------------------------------


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _init_distributed(device: torch.device) -> None:
    """The default process group: env:// under torchrun, else an in-process group of one."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def _shard(model: Transformer, device: torch.device, bf16: bool) -> None:
    """FSDP2 as torchtitan applies it: each block a unit, then the root (embedding, norm, head)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # cast_forward_inputs=False: the blocks' inputs include the fp32 RoPE tables, which a bf16 cast
    # would round (to ~3 significant digits); the activations arrive in bf16 from the embedding anyway.
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None,
        reduce_dtype=torch.float32 if bf16 else None,
        cast_forward_inputs=False,
    )
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


# --- one shape ---------------------------------------------------------------------------------


def _optimizer(model: torch.nn.Module, fused: bool) -> torch.optim.AdamW:
    """AdamW with decay on matrices only, as the trainer does; fused kernels on the GPU."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LEARNING_RATE,
        betas=(0.9, 0.95),
        fused=fused,
    )


def _empty_run(cfg: Config, name: str, batch: int, seq_len: int, device_name: str) -> dict:
    """Every field of a result, with the figures not yet known as None."""
    shape = MODEL_SHAPES[name]
    _, world = _world()
    on_gpu = not cfg.dry_run
    return {
        "shape": name,
        "status": "error",
        "error": None,
        "parallelism": "fsdp2" if cfg.fsdp else "single",
        "world_size": world,
        "device_name": device_name,
        "precision": ("bf16 params (FSDP2 mixed precision)" if cfg.fsdp else "bf16 autocast")
        if on_gpu
        else "fp32",
        "compile": cfg.compile,
        "batch_size_per_gpu": batch,
        "seq_len": seq_len,
        "tokens_per_step": batch * seq_len * world,
        "steps": cfg.steps,
        "warmup_steps": cfg.warmup,
        "oom_retries": 0,
        "params": count_parameters(shape),
        "matmul_params": matmul_params(shape),
        "flops_per_token": flops_per_token(shape, seq_len),
        "step_time_s": None,
        "step_time_p50_s": None,
        "step_time_max_s": None,
        "tokens_per_s": None,
        "tokens_per_s_per_gpu": None,
        "achieved_tflops_per_gpu": None,
        "peak_tflops_per_gpu": peak_tflops(device_name) if on_gpu else None,
        "mfu": None,
        "peak_memory_gib": None,
        "loss_first": None,
        "loss_last": None,
        "loss_finite": None,
    }


def _train(cfg: Config, name: str, batch: int, seq_len: int, device: torch.device, result: dict) -> None:
    """Build, (compile, shard,) train warm-up + timed steps, and fill `result` in place."""
    shape = MODEL_SHAPES[name]
    cuda = device.type == "cuda"
    bf16 = cuda
    torch.manual_seed(0)  # the same initial weights on every rank
    with device:  # initialise on the device: a 1B model is slow to build on the host
        model = Transformer(shape)
    if cfg.compile:
        for block in model.blocks:
            block.compile()  # before sharding, as torchtitan does; FSDP's hooks stay outside
    if cfg.fsdp:
        _shard(model, device, bf16)
    model.train()
    optimizer = _optimizer(model, fused=cuda)
    rank, _ = _world()
    generator = torch.Generator(device=device).manual_seed(1 + rank)
    tokens = torch.randint(0, shape.vocab_size, (batch, seq_len + 1), device=device, generator=generator)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    autocast = bf16 and not cfg.fsdp  # under FSDP2 the mixed-precision policy casts instead

    def step() -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            _, loss = model(inputs, targets)
        assert loss is not None
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    losses = [step() for _ in range(cfg.warmup)]
    _synchronize(device)
    if cfg.fsdp:  # every rank starts its window together
        import torch.distributed as dist

        dist.barrier()
    marks = [_Mark(cuda)]
    started = time.perf_counter()
    for _ in range(cfg.steps):
        losses.append(step())
        marks.append(_Mark(cuda))
    _synchronize(device)
    elapsed = time.perf_counter() - started
    durations = [b.since(a) for a, b in itertools.pairwise(marks)]
    values = torch.stack(losses).float().tolist()

    _, world = _world()
    per_gpu = batch * seq_len * cfg.steps / elapsed
    achieved = result["flops_per_token"] * per_gpu / 1e12
    peak = result["peak_tflops_per_gpu"]
    result |= {
        "status": "ok",
        "step_time_s": round(elapsed / cfg.steps, 6),
        "step_time_p50_s": round(stats.median(durations), 6),
        "step_time_max_s": round(max(durations), 6),
        "tokens_per_s": round(per_gpu * world, 1),
        "tokens_per_s_per_gpu": round(per_gpu, 1),
        "achieved_tflops_per_gpu": round(achieved, 3),
        "mfu": round(achieved / peak, 4) if peak else None,
        "peak_memory_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
        "loss_first": values[0],
        "loss_last": values[-1],
        "loss_finite": all(math.isfinite(v) for v in values),
    }


class _Mark:
    """A moment in the step stream: a recorded CUDA event on the GPU, a wall-clock time on the CPU
    (recording an event does not wait for the GPU, so marking steps leaves the pipeline alone)."""

    def __init__(self, cuda: bool):
        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        if self.event is not None:
            self.event.record()
        self.wall = time.perf_counter()

    def since(self, earlier: "_Mark") -> float:
        if self.event is not None and earlier.event is not None:
            return earlier.event.elapsed_time(self.event) / 1000.0
        return self.wall - earlier.wall


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run_shape(cfg: Config, name: str, device: torch.device, device_name: str) -> dict:
    """One shape's result; an out-of-memory halves the batch and retries, other errors are recorded."""
    default_batch, default_seq = DEFAULT_BATCH.get(name, (1, MODEL_SHAPES[name].max_seq_len))
    batch = cfg.batch_size or default_batch
    seq_len = min(cfg.seq_len or default_seq, MODEL_SHAPES[name].max_seq_len)
    retries = 0
    while True:
        result = _empty_run(cfg, name, batch, seq_len, device_name)
        result["oom_retries"] = retries
        _free(device)
        try:
            _train(cfg, name, batch, seq_len, device, result)
            return result
        except torch.OutOfMemoryError as e:
            result["error"] = f"OutOfMemoryError: {str(e).splitlines()[0]}"
            if batch == 1:
                return result
            batch, retries = batch // 2, retries + 1
            print(f"{name}: out of memory, retrying with batch {batch}", file=sys.stderr)
        except Exception as e:  # one shape that breaks is reported, and the others still run
            traceback.print_exc()
            result["error"] = f"{type(e).__name__}: {e}"
            return result
        finally:
            _free(device)


# --- report ------------------------------------------------------------------------------------

COLUMNS = (  # (header, field, format)
    ("shape", "shape", "{}"),
    ("parallel", "parallelism", "{}"),
    ("GPUs", "world_size", "{}"),
    ("compile", "compile", "{}"),
    ("batch x seq", None, ""),
    ("step ms", "step_time_s", "{:.1f}"),
    ("tokens/s", "tokens_per_s", "{:,.0f}"),
    ("TFLOPS/GPU", "achieved_tflops_per_gpu", "{:.1f}"),
    ("MFU", "mfu", "{:.1%}"),
    ("peak GiB", "peak_memory_gib", "{:.1f}"),
    ("loss first->last", None, ""),
)


def _cell(run: dict, header: str, field: str | None, fmt: str) -> str:
    if header == "batch x seq":
        return f"{run['batch_size_per_gpu']}x{run['seq_len']}"
    if header == "loss first->last":
        return "-" if run["loss_first"] is None else f"{run['loss_first']:.3f}->{run['loss_last']:.3f}"
    value = run[field] if field else None
    if value is None:
        return "-"
    return fmt.format(value * 1000 if field == "step_time_s" else value)


def table(results: dict) -> str:
    env = results["environment"]
    rows = [[h for h, _, _ in COLUMNS]]
    rows += [[_cell(run, h, f, fmt) for h, f, fmt in COLUMNS] for run in results["runs"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    gpus = f" x{env['gpu_count']}" if env["gpu_count"] else ""
    lines = [
        f"{env['device_name']}{gpus} · torch {env['torch']} · {env['precision']} · {results['formula']}",
        "  ".join(h.ljust(w) for h, w in zip(rows[0], widths, strict=True)),
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows[1:]]
    lines += [f"{run['shape']}: {run['error']}" for run in results["runs"] if run["error"]]
    goal = results["goal"]
    if goal["mfu"] is not None:
        lines.append(f"goal: {goal['target']}: MFU {goal['mfu']:.1%}, {'met' if goal['met'] else 'not met'}")
    return "\n".join(lines)


def goal(runs: list[dict]) -> dict:
    """Issue 14's goal against this run's 1B figure on one H200 (mfu and met stay None without one)."""
    mfu = next(
        (
            r["mfu"]
            for r in runs
            if r["shape"] == GOAL_SHAPE
            and r["parallelism"] == "single"
            and r["mfu"]
            and "H200" in r["device_name"]
        ),
        None,
    )
    return {
        "target": f">= {GOAL_MFU:.0%} bf16 MFU for {GOAL_SHAPE} on one H200",
        "mfu": mfu,
        "met": None if mfu is None else mfu >= GOAL_MFU,
    }


# --- entry point -------------------------------------------------------------------------------


def parse(argv: list[str]) -> Config:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="150M,1B", help="comma-separated MODEL_SHAPES names")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per shape")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation)")
    parser.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=None, help="default: on with CUDA"
    )
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 over every local GPU")
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, 3 steps, fp32, no compile")
    parser.add_argument("--batch-size", type=int, default=None, help="sequences per GPU per step")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sequence")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="default bench/gpu_results.json")
    args = parser.parse_args(argv)
    suffix = ("_dry_run" if args.dry_run else "_results") + ("_fsdp" if args.fsdp else "")
    try:
        return Config(
            shapes=(DRY_RUN_SHAPE,)
            if args.dry_run
            else tuple(s.strip() for s in args.shapes.split(",") if s.strip()),
            steps=DRY_RUN_STEPS if args.dry_run else args.steps,
            warmup=DRY_RUN_WARMUP if args.dry_run else args.warmup,
            compile=False if args.dry_run else (args.compile if args.compile is not None else True),
            fsdp=args.fsdp,
            dry_run=args.dry_run,
            batch_size=args.batch_size,
            seq_len=args.seq_len,
            out=args.out or BENCH_DIR / f"gpu{suffix}.json",
        )
    except ValueError as e:
        parser.error(str(e))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse(argv)
    if not cfg.dry_run and not torch.cuda.is_available():
        print("bench.gpu: no CUDA device here; `--dry-run` runs the same path on the CPU.", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if not cfg.dry_run else 0
    if cfg.fsdp and gpus > 1 and "RANK" not in os.environ:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]
        return subprocess.call([*launcher, "-m", "bench.gpu", *argv], cwd=REPO)

    if cfg.dry_run:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # TF32 for whatever stays fp32 outside autocast
    if cfg.fsdp:
        _init_distributed(device)
    try:
        rank, world = _world()
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        runs = [run_shape(cfg, name, device, device_name) for name in cfg.shapes]
        if rank == 0:
            env = report.environment("dry_run" if cfg.dry_run else "gpu")
            env |= {
                "device_name": device_name,
                "gpu_count": gpus,
                "world_size": world,
                "cuda": torch.version.cuda,
                "precision": runs[0]["precision"],
                "config": {
                    k: str(v) if isinstance(v, pathlib.Path) else v
                    for k, v in dataclasses.asdict(cfg).items()
                },
            }
            results = {
                "environment": env,
                "formula": "flops/token = 6*N + 12*n_layer*d_model*seq_len; MFU = TFLOPS/GPU / dense bf16 peak",
                "runs": runs,
                "goal": goal(runs),
            }
            cfg.out.parent.mkdir(parents=True, exist_ok=True)
            cfg.out.write_text(json.dumps(results, indent=2) + "\n")
            print(table(results))
            print(f"\nresults: {cfg.out}")
        return 0 if all(run["status"] == "ok" for run in runs) else 1
    finally:
        if cfg.fsdp:
            import torch.distributed as dist

            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
