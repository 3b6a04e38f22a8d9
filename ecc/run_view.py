"""How a run and its records read for a person (ecc/render.py dispatches here by type): its status,
the runs list, log lines, metrics (plain lines, or a loss sparkline per stage on a terminal), the
committed checkpoints, the eval gates, the gate decisions and a cleanup. Pure functions of the
decoded answers; the lines scripts parse start with the ids.
"""

from datetime import UTC

from contracts.api import CleanupResult, LogLineView, RunList, RunSummary, RunView
from contracts.audit import AuditTrail
from contracts.runs import CheckpointList, EvalList, MetricsPage
from ecc import charts
from ecc.gates import bound, gate_line
from ecc.units import usd, when


def log_line(ln: LogLineView) -> str:
    return f"{when(ln.at)} {ln.level}: {ln.message}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Columns as wide as their widest cell, two spaces apart; the last one unpadded."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in [header, *rows]
    ]


def _run_row(run: RunSummary) -> list[str]:
    progress = f"{run.step}/{run.total_steps}" if run.total_steps else "-"
    loss = "-" if run.loss is None else f"{run.loss:.4f}"
    cost = "-" if run.estimate_usd is None else usd(run.estimate_usd).removesuffix(" USD")
    return [
        run.run_id,
        str(run.state),
        run.booking_id,
        run.stage or "-",
        progress,
        loss,
        cost,
        f"{run.created_at.astimezone(UTC):%Y-%m-%d %H:%M:%S}",
        run.idempotency_key,
    ]


def runs(page: RunList) -> str:
    """One row per run, newest first, then where the next page starts when there is one."""
    header = ["RUN", "STATE", "BOOKING", "STAGE", "STEP", "LOSS", "EST USD", "CREATED (UTC)", "KEY"]
    rows = _table(header, [_run_row(r) for r in page.runs]) if page.runs else ["(no runs)"]
    if page.next is not None:
        rows.append(f"more: the same command with --cursor {page.next}")
    return "\n".join(rows)


def run(view: RunView) -> str:
    """A run's view: one line of state and progress, then one indented line per detail it has."""
    line = f"run {view.run_id}: {view.state}"
    if view.stage:
        line += f" (stage {view.stage}, step {view.step}/{view.total_steps}"
        if view.loss is not None:
            line += f", loss {view.loss:.4f}"
        line += ")"
    if view.message:
        line += f"\n  {view.message}"
    for gate in view.gates:
        line += f"\n  {gate_line(gate)}"
    if view.provenance:
        steps = ", ".join(f"{s.name} {s.before}->{s.after}" for s in view.provenance.steps)
        line += f"\n  data: {steps}"
    if view.proposal:
        p = view.proposal
        line += (
            f"\n  proposal ({p.reason}): restart {p.stage} from checkpoint step {p.checkpoint_step}, "
            f"skipping batches [{p.skip_from}, {p.skip_to}); approve with "
            f"`ecc ito confirm --action restart_from_checkpoint --run {view.run_id}` then `ecc ito approve`"
        )
    if view.parallelism:
        used = view.parallelism
        mesh = " x ".join(f"{dim} {size}" for dim, size in used.mesh.items()) or "none"
        line += f"\n  parallelism: {used.strategy}, world size {used.world_size}, mesh {mesh}"
        if view.nodes > 1:
            line += f", {view.nodes} nodes"
    if view.plan:
        line += f"\n  plan: {view.plan.strategy}, estimate {usd(view.plan.cost.total_usd)}"
    if view.spend is not None and view.spend.held_gpu_s > 0:
        sp = view.spend
        line += (
            f"\n  spent: {sp.spent_usd:.6f} USD of its limit {sp.limit_usd:.6f} USD "
            f"({sp.held_gpus} GPU(s) held {sp.held_gpu_s / max(sp.held_gpus, 1):.1f}s)"
        )
    return line


def points(page: MetricsPage) -> str:
    return (
        "\n".join(
            f"{p.stage} step {p.step}/{p.total_steps} loss {p.loss:.4f} "
            f"lr {p.learning_rate:.2e} {p.tokens_per_s:.0f} tok/s"
            for p in page.points
        )
        or "(none)"
    )


def curves(page: MetricsPage) -> str:
    return "\n".join(charts.stage_lines(page.points)) or "(none)"


def checkpoints(listed: CheckpointList) -> str:
    rows = [
        f"step {c.step}: {c.bytes / 1e6:.1f} MB, loop stalled {c.stall_s * 1000:.1f} ms, "
        f"saved in {c.save_s:.2f} s  {c.path}"
        for c in listed.checkpoints
    ]
    return "\n".join(rows) or ("(removed by cleanup)" if listed.cleaned_up else "(none yet)")


def evals(listed: EvalList) -> str:
    rows = []
    for g in listed.gates:
        rows.append(f"{g.stage}: {'passed' if g.passed else 'FAILED'}")
        rows += [
            f"  {m.name} = {m.value:.4f} ({bound(m)}) {'ok' if m.passed else 'FAIL'}"
            + (f"\n    {m.sentence}" if m.sentence else "")
            for m in g.metrics
        ]
        rows += [f"  finding: {f}" for f in g.findings]
    return "\n".join(rows) or "(no stage has been evaluated yet)"


def cleanup(result: CleanupResult) -> str:
    rows = [f"removed {a.path} ({a.bytes} bytes)" for a in result.removed]
    rows.append(
        f"{len(result.removed)} artifacts removed; booking release requested: "
        f"{result.booking_release_requested}"
    )
    return "\n".join(rows)


def decisions(trail: AuditTrail) -> str:
    return (
        "\n".join(f"{when(d.at)} {d.gate}: {'pass' if d.ok else f'FAIL {d.code}'}" for d in trail.decisions)
        or "(no decisions)"
    )
