"""How what comes before a run reads for a person (ecc/render.py dispatches here by type): the
account and its quotas, its bookings, the plan (strategy, estimate and its basis, the booking's GPUs,
every check and gate) and a confirmation with every bound it carries. Pure functions of the decoded
answers.
"""

from contracts.api import BOOKING_ACTIONS, FILE_ACTIONS, AuthInfo, BookingView, ConfirmationIssued
from contracts.plans import Plan
from ecc import files_view
from ecc.units import gpu_time, usd, when


def auth(info: AuthInfo) -> str:
    """Who, then the account's quotas: each limit beside what it uses now."""
    lines = [f"logged in as {info.account} (key {info.key_id})"]
    if info.quotas is not None:
        lim, use = info.quotas.limits, info.quotas.usage
        confirmations = "?" if use.confirmations is None else str(use.confirmations)
        lines += [
            "quotas (in use / limit):",
            f"  requests       {lim.rate_per_s:g}/s, bursts of {lim.burst} ({use.tokens:g} available now)",
            f"  confirmations  {confirmations} / {lim.confirmations} outstanding",
            f"  runs           {use.runs} / {lim.runs} unfinished",
            f"  queued         {use.queued} / {lim.queued} waiting for a trainer",
        ]
        if lim.files:  # 0: a scheduler from before uploads
            lines.append(
                f"  files          {use.files} / {lim.files} ({files_view.size(use.file_bytes)} of "
                f"{files_view.size(lim.file_bytes)}), models {use.models} / {lim.models}"
            )
    return "\n".join(lines)


def bookings(views: list[BookingView]) -> str:
    rows = []
    for v in views:
        b, t = v.booking, v.booking.topology
        allows = "allows training" if v.allows_training else f"no training: {v.reason}"
        rows.append(
            f"{b.booking_id}: {b.state}, {t.nodes}x{t.gpus_per_node} {t.gpu_model}, "
            f"{b.fabric}, {b.region}, until {when(b.window_end)} ({allows})"
        )
    return "\n".join(rows) or "(no bookings)"


def confirmation(issued: ConfirmationIssued) -> str:
    """What the person just authorised, every bound of it: the reference, then the action and its
    target, the manifest (by digest) and the most it may cost, where bound, and when it expires."""
    target = (
        "booking" if issued.action in BOOKING_ACTIONS else "file" if issued.action in FILE_ACTIONS else "run"
    )
    rows = [
        f"confirmation_ref: {issued.confirmation_ref}",
        f"  authorises: {issued.action.value} on {target} {issued.target}, once",
    ]
    if issued.manifest_digest:
        rows.append(f"  manifest: sha256 {issued.manifest_digest}")
    if issued.max_cost_usd is not None:
        rows.append(f"  cost bound: at most {usd(issued.max_cost_usd)}")
    rows.append(f"  expires: {when(issued.expires_at)}")
    return "\n".join(rows)


def _degrees(degrees: dict[str, int]) -> str:
    """A plan's parallel degrees in words: `dp_replicate 2 x dp_shard 2 (4 ranks)`."""
    used = {dim: size for dim, size in degrees.items() if size > 1}
    if not used:
        return "one process"
    ranks = 1
    for size in used.values():
        ranks *= size
    return " x ".join(f"{dim} {size}" for dim, size in used.items()) + f" ({ranks} ranks)"


def _capacity(plan: Plan) -> list[str]:
    """The booking's GPUs as the plan states them: held, idle, their cost, and the suggestion when
    most stay idle (the window is the `booking_window` check's line)."""
    return [] if plan.capacity is None else [f"GPUs: {plan.capacity.sentence}"]


def plan(plan: Plan) -> str:
    cost = plan.cost
    rows = [
        f"strategy {plan.strategy}, {_degrees(plan.degrees)}, precision {plan.precision}",
        f"estimate {usd(cost.total_usd)} ({gpu_time(cost.gpu_hours)} at "
        f"{cost.price_per_gpu_hour_usd:.2f} USD per GPU-hour)",
    ]
    rows += _capacity(plan)
    rows += _memory(plan)
    rows += _estimate_basis(plan)
    rows += [f"  [{'ok' if c.ok else 'FAIL'}] {c.name}: {c.reason}" for c in plan.checks]
    rows += [f"  gate {g.stage}: " + "; ".join(g.rules) for g in plan.gates]
    return "\n".join(rows)


def _memory(plan: Plan) -> list[str]:
    """The micro-batch the memory model picked and its per-GPU estimate (none on an older plan)."""
    m = plan.memory
    if m is None or plan.micro_batch_size <= 0:
        return []
    return [
        f"memory: micro-batch {plan.micro_batch_size} x {plan.grad_accumulation} accumulation, "
        f"activation checkpointing {plan.activation_checkpointing}; ~{m.total_bytes / 1e9:.2f} GB per GPU "
        f"of {m.usable_bytes / 1e9:.1f} GB usable (state {m.state_bytes / 1e9:.2f}, activations "
        f"{m.activation_bytes / 1e9:.2f}, logits {m.logits_bytes / 1e9:.2f} GB; {m.margin:.0%} kept free)",
        f"  memory figures: {m.basis}",
    ]


def _estimate_basis(plan: Plan) -> list[str]:
    """What the estimate stands on: the wall seconds by phase and where its figures come from."""
    cost = plan.cost
    if not cost.phases_s:  # FLOPs at the assumed MFU alone: the line above says all there is
        return []
    phases = ", ".join(f"{name} {s:.1f}s" for name, s in cost.phases_s.items() if s > 0)
    return [
        f"  basis: {cost.wall_s:.1f}s held x {cost.gpus} GPU(s) ({phases}); figures: {cost.basis}",
        "  spend is metered while the run runs: it stops with a checkpoint before budget_cap_usd is crossed",
    ]
