"""The results file and the table: the environment of a run, the headline figures of each
benchmark, the targets of issues 8 and 25 and whether this run reached them.

Targets are reported, never asserted: a benchmark that misses one still writes its numbers.
"""

import datetime
import json
import os
import pathlib
import platform
import sys
from dataclasses import dataclass

REPO = pathlib.Path(__file__).resolve().parent.parent


@dataclass(frozen=True, slots=True)
class Target:
    benchmark: str
    figure: str
    op: str  # "<=", ">=" or "=="
    limit: float | bool
    why: str

    def met(self, value) -> bool:
        match self.op:
            case "<=":
                return value <= self.limit
            case ">=":
                return value >= self.limit
        return value == self.limit


TARGETS = [
    Target(
        "control_plane_latency",
        "ratio_p50_to_bare_sum",
        "<=",
        3.0,
        "gated p50 <= 3x the fixed reference (6 NATS + 1 JetStream + 4 Redis round trips, bare)",
    ),
    Target(
        "control_plane_throughput", "accepted_per_s", ">=", 500.0, ">= 500 accepted requests/s on 2 cores"
    ),
    Target("exactly_once", "exactly_once", "==", True, "N keys -> exactly N runs, 0 duplicates, 0 lost"),
    Target(
        "quota_fairness",
        "ratio_p50_at_limit_to_idle",
        "<=",
        1.5,
        "another tenant's p50 <= 1.5x idle while one floods at its rate quota",
    ),
    Target(
        "heavy_manifests",
        "ratio_p95_under_burst_to_idle",
        "<=",
        2.0,
        "another tenant's status p95 <= 2x idle while one sends manifests of 100,000 entries",
    ),
    Target("trainer_pretrain", "ratio", ">=", 0.95, "trainer >= 0.95x the plain loop"),
    Target("trainer_dpo", "ratio", ">=", 0.95, "DPO step >= 0.95x the plain loop"),
    # Issue 40: the trainer's step against the torchtitan-style reference loop (bench/reference_loop.py).
    Target("trainer_vs_reference_tiny", "ratio", ">=", 0.95, "trainer >= 0.95x the reference loop, tiny"),
    Target("trainer_vs_reference_small", "ratio", ">=", 0.95, "trainer >= 0.95x the reference loop, small"),
    Target("trainer_grpo", "ratio", ">=", 0.95, "GRPO step >= 0.95x the plain loop"),
    Target("memory_estimate", "min_ratio", ">=", 0.85, "planner bytes >= 0.85x a measured step's peak"),
    Target("memory_estimate", "max_ratio", "<=", 1.15, "planner bytes <= 1.15x a measured step's peak"),
    Target("checkpoint_tiny", "stall_ratio", "<=", 0.10, "async stall <= 10% of a sync torch.save"),
    Target("checkpoint_150M", "stall_ratio", "<=", 0.10, "async stall <= 10% of a sync torch.save"),
    Target("cli_startup", "ecc_help_s", "<=", 0.3, "`ecc --help` <= 0.3 s"),
    # Issue 25: ours against the Hugging Face stack on the same tiny HF model and rows (rate =
    # their time / ours: >= 1.0 means ours is no slower).
    Target("hf_sft", "rate", ">=", 1.0, "SFT step no slower than trl.SFTTrainer"),
    Target("hf_sft", "same_tokens", "==", True, "both sides train on the same token ids"),
    Target("hf_sft", "same_first_loss", "==", True, "same weights, same first batch, same loss"),
    Target("hf_dpo", "rate", ">=", 1.0, "DPO step no slower than trl.DPOTrainer"),
    Target("hf_dpo", "same_tokens", "==", True, "both sides train on the same token ids"),
    # Issue 40: `sample` (the KV-cache decoder) against transformers' `generate`, same weights, greedy.
    Target("sample_tiny", "rate", ">=", 1.0, "sample no slower than transformers' generate (tiny)"),
    Target("sample_tiny", "same_tokens", "==", True, "both sides generate the same greedy tokens"),
    Target("sample_small", "rate", ">=", 1.0, "sample no slower than transformers' generate (d256 x 4)"),
    Target("sample_small", "same_tokens", "==", True, "both sides generate the same greedy tokens"),
    # Issue 26: the plan's estimate against what the run spent (the trainer's meter).
    Target("cost_estimate", "worst_ratio_low", ">=", 0.7, "every estimate >= 0.7x what the run spent"),
    Target("cost_estimate", "worst_ratio_high", "<=", 1.5, "every estimate <= 1.5x what the run spent"),
]

# The figures the table shows (and the quick-mode test checks are numbers), per benchmark.
HEADLINES: dict[str, list[tuple[str, str]]] = {  # benchmark -> [(figure path, unit)]
    "control_plane_latency": [
        ("gated.p50_ms", "ms"),
        ("gated.p99_ms", "ms"),
        ("bare_nats_request_reply.p50_ms", "ms"),
        ("bare_jetstream_publish.p50_ms", "ms"),
        ("bare_redis_evalsha.p50_ms", "ms"),
        ("bare_sum_ms", "ms"),
        ("ratio_p50_to_bare_sum", "x"),
        ("round_trips_needed.redis", ""),
        ("extra_publishes_per_request", ""),
        ("ratio_p50_to_bare_sum_with_extra_publishes", "x"),
        ("service_hop_echo.p50_ms", "ms"),
        # What authentication adds (p50 with minus p50 without; see control_plane.auth_cost).
        ("auth_cost.nats_connect_extra_ms", "ms"),
        ("auth_cost.nats_request_reply_extra_ms", "ms"),
        ("auth_cost.nats_tenant_request_reply_extra_ms", "ms"),
        ("auth_cost.redis_connect_extra_ms", "ms"),
        ("auth_cost.redis_evalsha_extra_ms", "ms"),
    ],
    "control_plane_throughput": [
        ("accepted_per_s", "/s"),
        ("accepted", ""),
        ("cpu_ms_per_request_total", "ms"),
        ("cpu_cores_busy", "cores"),
        ("server_cpu_cores_busy", "cores"),
    ],
    "control_plane_profile": [
        ("services.scheduler.cpu_ms_per_request", "ms"),
        ("services.ledger.cpu_ms_per_request", "ms"),
        ("services.confirmation.cpu_ms_per_request", "ms"),
        ("services.entitlement.cpu_ms_per_request", "ms"),
    ],
    "quota_fairness": [
        ("flood_rate_quota_per_s", "/s"),
        ("at_limit_flood_sent_per_s", "/s"),
        ("at_limit_flood_admitted_per_s", "/s"),
        ("ratio_p50_at_limit_to_idle", "x"),
        ("ignoring_flood_sent_per_s", "/s"),
        ("ignoring_flood_admitted_per_s", "/s"),
        ("ratio_p50_ignoring_retry_after_to_idle", "x"),
    ],
    "heavy_manifests": [
        ("manifest_bytes", "B"),
        ("refusal.p50_ms", "ms"),
        ("refusal.max_ms", "ms"),
        ("status_idle.p95_ms", "ms"),
        ("status_under_burst.p95_ms", "ms"),
        ("ratio_p95_under_burst_to_idle", "x"),
    ],
    "upload_throughput": [
        ("bytes", "B"),
        ("upload_mb_per_s", "MB/s"),
        ("copy_mb_per_s", "MB/s"),
        ("upload_over_copy_time", "x"),
    ],
    "exactly_once": [
        ("requests", ""),
        ("keys", ""),
        ("runs", ""),
        ("duplicates", ""),
        ("lost", ""),
        ("work_queue_messages", ""),
        ("requests_per_s", "/s"),
    ],
    "cost_estimate": [
        ("demo_estimate_over_actual", "x"),
        ("short_estimate_over_actual", "x"),
        ("full_recipe_estimate_over_actual", "x"),
        ("worst_ratio_low", "x"),
        ("worst_ratio_high", "x"),
    ],
    "trainer_pretrain": [("ours_steps_per_s", "/s"), ("plain_steps_per_s", "/s"), ("ratio", "x")],
    "trainer_dpo": [("ours_steps_per_s", "/s"), ("plain_steps_per_s", "/s"), ("ratio", "x")],
    "trainer_vs_reference_tiny": [("ours_steps_per_s", "/s"), ("plain_steps_per_s", "/s"), ("ratio", "x")],
    "trainer_vs_reference_small": [("ours_steps_per_s", "/s"), ("plain_steps_per_s", "/s"), ("ratio", "x")],
    "trainer_grpo": [("ours_steps_per_s", "/s"), ("plain_steps_per_s", "/s"), ("ratio", "x")],
    "memory_estimate": [("min_ratio", "x"), ("max_ratio", "x")],
    "checkpoint_tiny": [
        ("checkpoint_bytes", "B"),
        ("async_stall_s", "s"),
        ("first_stall_s", "s"),
        ("staging_wait_s", "s"),
        ("sync_torch_save_s", "s"),
        ("stall_ratio", "x"),
        ("checkpoint_write_mb_s", "MB/s"),
        ("raw_write_mb_s", "MB/s"),
        ("bandwidth_ratio", "x"),
    ],
    "checkpoint_150M": [
        ("checkpoint_bytes", "B"),
        ("async_stall_s", "s"),
        ("first_stall_s", "s"),
        ("staging_wait_s", "s"),
        ("sync_torch_save_s", "s"),
        ("stall_ratio", "x"),
        ("checkpoint_write_mb_s", "MB/s"),
        ("raw_write_mb_s", "MB/s"),
        ("bandwidth_ratio", "x"),
    ],
    "cli_startup": [("ecc_help_s", "s"), ("ecc_status_json_s", "s"), ("python_bare_start_s", "s")],
    "hf_sft": [("ours_step_ms", "ms"), ("trl_step_ms", "ms"), ("rate", "x")],
    "hf_dpo": [("ours_step_ms", "ms"), ("trl_step_ms", "ms"), ("rate", "x")],
    "hf_tokenize": [
        ("ours_rows_per_s", "/s"),
        ("datasets_rows_per_s", "/s"),
        ("ours_tokens_per_s", "/s"),
        ("datasets_tokens_per_s", "/s"),
        ("rate", "x"),
    ],
    "hf_export": [("ours_s", "s"), ("save_pretrained_s", "s"), ("rate", "x")],
    "sample_tiny": [("ours_ms", "ms"), ("generate_ms", "ms"), ("rate", "x")],
    "sample_small": [("ours_ms", "ms"), ("generate_ms", "ms"), ("rate", "x")],
}


def figure(figures: dict, path: str):
    value = figures
    for part in path.split("."):
        value = value[part]
    return value


def git_commit() -> str | None:
    """HEAD's commit, read from .git without running git (the working tree may differ from it)."""
    git = REPO / ".git"
    try:
        if git.is_file():  # a worktree: .git names its own dir; refs live in the common one
            git = (REPO / git.read_text().strip().removeprefix("gitdir: ")).resolve()
        common = (
            (git / (git / "commondir").read_text().strip()).resolve() if (git / "commondir").exists() else git
        )
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head.removeprefix("ref: ")
        for root in (git, common):
            if (root / ref).exists():
                return (root / ref).read_text().strip()
        for line in (common / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except OSError:
        pass
    return None


LIBRARIES = ("msgspec", "nats-py", "redis", "faststream", "pynacl", "hiredis")
"""The request path's libraries: their versions go with the figures (issue 30)."""


def cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def library_versions() -> dict[str, str]:
    from importlib import metadata

    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def environment(mode: str) -> dict:
    import torch

    return {
        "mode": mode,
        "started_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model(),
        "libraries": library_versions(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "git_commit": git_commit(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def with_targets(name: str, entry: dict) -> dict:
    """Attach each target of this benchmark with this run's value and whether it was met."""
    checks = []
    for t in TARGETS:
        if t.benchmark != name or entry.get("status") != "ok":
            continue
        value = entry["figures"][t.figure]
        checks.append(
            {
                "figure": t.figure,
                "op": t.op,
                "limit": t.limit,
                "value": value,
                "met": t.met(value),
                "target": t.why,
            }
        )
    return {**entry, "targets": checks}


def write(path: pathlib.Path, env: dict, benchmarks: dict[str, dict]) -> None:
    env = {**env, "load_avg_at_end": [round(x, 2) for x in os.getloadavg()]}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"environment": env, "benchmarks": benchmarks}, indent=2) + "\n")


def _fmt(value) -> str:
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def table(env: dict, benchmarks: dict[str, dict]) -> str:
    rows = [("benchmark", "figure", "value", "target", "met")]
    for name, entry in benchmarks.items():
        if entry.get("status") != "ok":
            rows.append(
                (name, entry.get("status", "?"), entry.get("reason") or entry.get("error", ""), "", "")
            )
            continue
        targets = {t["figure"]: t for t in entry.get("targets", [])}
        shown = [p for p, _ in HEADLINES.get(name, [])]
        for path, unit in HEADLINES.get(name, []):
            t = targets.get(path)
            rows.append(
                (
                    name,
                    path,
                    f"{_fmt(figure(entry['figures'], path))} {unit}".strip(),
                    f"{t['op']} {_fmt(t['limit'])}" if t else "",
                    _fmt(t["met"]) if t else "",
                )
            )
        for path, t in targets.items():
            if path not in shown:
                rows.append((name, path, _fmt(t["value"]), f"{t['op']} {_fmt(t['limit'])}", _fmt(t["met"])))
    widths = [max(len(str(r[i])) for r in rows) for i in range(5)]
    lines = [
        f"ito-training bench ({env['mode']}): {env['cpu_count']} CPUs, python {env['python']}, "
        f"torch {env['torch']}, commit {(env['git_commit'] or '?')[:12]}, load {env['load_avg_at_start']}, "
        f"auth {env.get('auth', 'off')}"
    ]
    lines += environment_lines(env)
    for i, row in enumerate(rows):
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    profile = benchmarks.get("control_plane_profile", {})
    if profile.get("status") == "ok":
        from bench.cpu_profile import lines as profile_lines

        f = profile["figures"]
        lines.append(
            f"\nwhere the gated path's CPU goes (py-spy, {f['requests']} requests from {f['clients']} clients):"
        )
        lines += profile_lines(f)
    return "\n".join(lines)


def environment_lines(env: dict) -> list[str]:
    """The machine and versions the figures depend on, so that two machines' runs compare."""
    infra = env.get("infra", {})
    libs = ", ".join(f"{k} {v}" for k, v in env.get("libraries", {}).items())
    out = [f"cpu: {env.get('cpu_model', '?')}; libraries: {libs}"]
    if "nats_server" in infra:
        out.append(
            f"servers: nats-server {infra.get('nats_server', '?')}, redis {infra.get('redis_server', '?')} "
            f"(appendfsync {infra.get('redis_appendfsync', '?')})"
        )
    return out


def print_table(env: dict, benchmarks: dict[str, dict]) -> None:
    print(table(env, benchmarks), file=sys.stdout, flush=True)
