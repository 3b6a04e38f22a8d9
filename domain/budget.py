"""Cost as spent: a run's metered spend, its limit, and when the scheduler stops it: pure functions.

A run holds every GPU of its placement (the plan's `gpus`: nodes x GPUs per node) from the
trainer's start of the run until release; its trainer meters the GPU-seconds held and reports them
with each lease renewal (services/trainer/worker.py). Spend is those GPU-hours at the plan's price
per GPU-hour. The limit is the lowest of the manifest's `budget_cap_usd`, what the booking covers
plus `max_incremental_cost_usd`, and the cost bound of the confirmation the run consumed (what the
person authorised); the plan's checkpoint-storage figure counts against it too. The
scheduler stops the run while a clean stop (a step, a checkpoint, the final report) still fits
under the limit: `verdict` is asked at each renewal, so the next renewal counts in the margin.
"""

from dataclasses import dataclass

from contracts.manifest import Manifest
from contracts.plans import CostEstimate

STOP_ALLOWANCE_S = 3.0  # on top of the trainer's own stop figure: the final report and its ack, and
# a renewal that arrives late on a busy machine; raise it where the bus is slow


@dataclass(frozen=True, slots=True)
class Verdict:
    stop: bool
    spent_usd: float
    limit_usd: float
    projected_usd: float  # spent when a stop asked for now would be over


def spend_usd(held_gpu_s: float, cost: CostEstimate) -> float:
    """GPU-seconds held at the plan's price."""
    return held_gpu_s / 3600.0 * cost.price_per_gpu_hour_usd


def manifest_limit(manifest: Manifest, cost: CostEstimate) -> float:
    """What the manifest and the booking allow: the cap, and the booking plus the allowed
    incremental cost, whichever is lower (a confirmation's default cost bound)."""
    booked = cost.booked_gpu_hours * cost.price_per_gpu_hour_usd
    return max(0.0, min(manifest.budget_cap_usd, booked + manifest.max_incremental_cost_usd))


def spend_limit(manifest: Manifest, cost: CostEstimate, bound_usd: float | None = None) -> float:
    """The most the run may spend: what the manifest and the booking allow, and the confirmation's
    cost bound (`bound_usd`, None: no bound carried), whichever is lower."""
    limit = manifest_limit(manifest, cost)
    return limit if bound_usd is None else max(0.0, min(limit, bound_usd))


def verdict(
    held_gpus: int,
    held_gpu_s: float,
    stop_s: float,
    cost: CostEstimate,
    limit_usd: float,
    renew_every_s: float,
) -> Verdict:
    """Stop now when spend plus what the next renewal and a clean stop would add reaches the limit
    (`stop_s`: the trainer's own figure for a step plus a checkpoint save; `renew_every_s`: how often
    the lease is renewed, the liveness timers' figure, handed in so the pure rule imports no settings)."""
    spent = spend_usd(held_gpu_s, cost)
    margin_s = renew_every_s + max(stop_s, 0.0) + STOP_ALLOWANCE_S
    projected = spent + spend_usd(held_gpus * margin_s, cost)
    storage = cost.checkpoint_storage_usd
    return Verdict(
        stop=projected + storage >= limit_usd, spent_usd=spent, limit_usd=limit_usd, projected_usd=projected
    )


def stopping_message(v: Verdict) -> str:
    """The run's message while the scheduler stops it."""
    return (
        f"budget: spent {v.spent_usd:.4f} USD of its limit {v.limit_usd:.4f} USD; stopping with a "
        "checkpoint before the limit is crossed"
    )


def exhausted_message(spent_usd: float, limit_usd: float, kept: str) -> str:
    """The run's final message (the trainer's, once its checkpoint is committed)."""
    return (
        f"budget exhausted: spent {spent_usd:.4f} USD of its limit {limit_usd:.4f} USD, stopped before "
        f"crossing it{kept}. Raise budget_cap_usd to train further."
    )
