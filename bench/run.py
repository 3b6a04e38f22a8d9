"""`python -m bench.run [--quick] [--out PATH] [--only GROUPS]`: config, infra, benchmarks, report.

Full mode is `make bench`; quick mode runs every benchmark at tiny sizes in well under a minute
(the test suite runs it so the benchmarks cannot rot). Targets are reported, never asserted; the
exit status is non-zero only when a benchmark could not run.

Authentication is on throughout: the stack is `ito-training up` with its own nats-server (nkeys)
and redis-server (ACL users); the machine's unauthenticated servers are never touched.
"""

import argparse
import asyncio
import os
import pathlib
import resource
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from bench import report
from bench.checkpoint_io import Sizes as CheckpointSizes
from bench.hf_compare import Sizes as HfSizes
from bench.sample_compare import Sizes as SampleSizes
from bench.trainer_steps import Sizes as TrainerSizes

GROUPS = ("control_plane", "cli", "trainer", "checkpoint", "hf", "cost")
QUICK_SKIPS = ("cost",)  # trains whole runs (minutes): quick mode runs it only when --only names it
DEFAULT_OUT = pathlib.Path(__file__).resolve().parent / "results.json"


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    mode: str
    latency_samples: int
    """Sequential gated requests timed for p50/p99 (and as many bare round trips)."""
    throughput_requests: int
    """New-key requests sent by 64 clients."""
    once_requests: int
    once_keys: int
    """The exactly-once check: once_requests requests over once_keys idempotency keys."""
    trainer: TrainerSizes
    checkpoint: CheckpointSizes
    cli_runs: int
    """Launches per CLI figure (median)."""
    upload_megabytes: int
    """The file `ecc ito files upload` sends in the upload throughput figure."""
    hf: HfSizes
    """Ours against TRL / datasets / save_pretrained on the tiny HF-format model (bench/hf_compare.py)."""
    sample: SampleSizes
    """`sample` against transformers' `generate` on the same weights (bench/sample_compare.py; the hf group)."""


def full() -> Config:
    return Config(
        mode="full",
        latency_samples=1000,
        throughput_requests=3000,
        once_requests=10_000,
        once_keys=1000,
        trainer=TrainerSizes(steps=40, warmup=5, repeats=8),
        checkpoint=CheckpointSizes(shapes=("tiny", "150M"), repeats=3),  # 150M: ~1.6 GB of state
        cli_runs=9,
        upload_megabytes=500,
        hf=HfSizes(steps=30, warmup=5, repeats=6, corpus_rows=30_000, export_repeats=5),
        sample=SampleSizes(new_tokens=64, repeats=6),
    )


def quick() -> Config:
    return Config(
        mode="quick",
        latency_samples=50,
        throughput_requests=200,
        once_requests=1000,
        once_keys=100,
        trainer=TrainerSizes(steps=6, warmup=2, repeats=2),
        checkpoint=CheckpointSizes(shapes=("tiny",), repeats=1),
        cli_runs=3,
        upload_megabytes=20,
        hf=HfSizes(steps=4, warmup=2, repeats=2, corpus_rows=2000, export_repeats=2),
        sample=SampleSizes(new_tokens=8, repeats=2),
    )


def _machine_busy_s() -> float:
    """CPU seconds all processes on the machine have spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _own_busy_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _measured(run: Callable[[], dict[str, dict]], names: list[str]) -> dict[str, dict]:
    """Run one group; each benchmark becomes {status, figures, ...} or an error. Also records how
    busy the machine was meanwhile: on a shared machine other processes' load moves the figures."""
    load, started, machine, own = os.getloadavg()[0], time.monotonic(), _machine_busy_s(), _own_busy_s()
    try:
        results = run()
    except Exception as e:  # a benchmark that cannot run is reported, and the others still run
        traceback.print_exc()
        return {name: {"status": "error", "error": f"{type(e).__name__}: {e}"} for name in names}
    elapsed = time.monotonic() - started
    context = {
        "elapsed_s": round(elapsed, 2),
        "load_1m_at_start": round(load, 2),
        "machine_busy_cores": round((_machine_busy_s() - machine) / elapsed, 2),
        "bench_process_busy_cores": round((_own_busy_s() - own) / elapsed, 2),  # excludes the services
    }
    out = {}
    for name, figures in results.items():
        if "status" in figures:  # not_available, with its reason
            out[name] = figures
        else:
            out[name] = report.with_targets(name, {"status": "ok", "figures": figures, **context})
    return out


def _stack_groups(cfg: Config, groups: set[str], env: dict) -> dict[str, dict]:
    """The benchmarks that need a running stack: one `ito-training up` (its own authenticated
    NATS and Redis), measured, then stopped. Records the servers it ran on in `env["infra"]`."""
    from bench import cli_startup, control_plane, tenant_inputs
    from bench.stack import Stack, infra_facts

    results: dict[str, dict] = {}
    stack = Stack()
    try:
        stack.up()
        env["infra"] = asyncio.run(infra_facts(stack))
        asyncio.run(stack.provision())
        if "control_plane" in groups:
            results |= _measured(
                lambda: asyncio.run(
                    control_plane.run_all(
                        stack,
                        latency_samples=cfg.latency_samples,
                        throughput_requests=cfg.throughput_requests,
                        once_requests=cfg.once_requests,
                        once_keys=cfg.once_keys,
                    )
                ),
                [
                    "control_plane_latency",
                    "control_plane_throughput",
                    "control_plane_profile",
                    "exactly_once",
                    "quota_fairness",
                ],
            )
        if "control_plane" in groups:  # issue 39: a manifest bounded in work; uploads beside a copy
            results |= _measured(
                lambda: asyncio.run(
                    tenant_inputs.run_all(stack, max(30, cfg.latency_samples // 5), cfg.upload_megabytes)
                ),
                ["heavy_manifests", "upload_throughput"],
            )
        if "cli" in groups:
            results |= _measured(
                lambda: {"cli_startup": asyncio.run(cli_startup.measure(stack, cfg.cli_runs))},
                ["cli_startup"],
            )
    finally:
        stack.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, well under a minute")
    parser.add_argument(
        "--out", type=pathlib.Path, default=DEFAULT_OUT, help=f"results file (default {DEFAULT_OUT})"
    )
    parser.add_argument(
        "--only", default=",".join(GROUPS), help=f"comma-separated groups from {', '.join(GROUPS)}"
    )
    args = parser.parse_args(argv)
    groups = {g.strip() for g in args.only.split(",") if g.strip()}
    if not groups or groups - set(GROUPS):
        parser.error(f"--only takes groups from {', '.join(GROUPS)}")
    cfg = quick() if args.quick else full()
    if args.quick and args.only == parser.get_default("only"):
        groups -= set(QUICK_SKIPS)

    from bench import checkpoint_io, trainer_steps
    from bench.stack import AUTH

    env = report.environment(cfg.mode)
    env["auth"] = AUTH  # every NATS and Redis connection of the stack is authenticated
    env["infra"] = {"auth": AUTH, "started": False}  # replaced by the stack's servers when one runs
    benchmarks: dict[str, dict] = {}
    if groups & {"control_plane", "cli"}:
        benchmarks |= _stack_groups(cfg, groups, env)
    # After the stack is down, so its processes do not compete with the training loops.
    if "trainer" in groups:
        benchmarks |= _measured(lambda: trainer_steps.run_all(cfg.trainer), trainer_steps.RUN_ALL_NAMES)
        from bench import memory_model  # issue 40: the planner's bytes against a measured step's peak

        benchmarks |= _measured(
            lambda: {"memory_estimate": memory_model.bench_row(cfg.mode == "quick")}, ["memory_estimate"]
        )
    if "checkpoint" in groups:
        benchmarks |= _measured(
            lambda: checkpoint_io.run_all(cfg.checkpoint), [f"checkpoint_{s}" for s in cfg.checkpoint.shapes]
        )
    if "hf" in groups:
        from bench import hf_compare

        benchmarks |= _measured(lambda: hf_compare.run_all(cfg.hf), list(hf_compare.BENCHMARKS))
        from bench import sample_compare

        benchmarks |= _measured(lambda: sample_compare.run_all(cfg.sample), list(sample_compare.BENCHMARKS))
    if "cost" in groups:  # last: its stack trains whole runs, and nothing else runs meanwhile
        from bench import cost

        benchmarks |= _measured(lambda: cost.run_all(cfg.mode), ["cost_estimate"])
    report.write(args.out, env, benchmarks)
    report.print_table(env, benchmarks)
    print(f"\nresults: {args.out}")
    return 1 if any(b.get("status") == "error" for b in benchmarks.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
