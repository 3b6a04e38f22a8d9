"""Desk telemetry: what the desk prices training blocks from. Published on `desk.telemetry.>`
(a JetStream stream, so a subscriber that starts late replays it)."""

from datetime import datetime

from contracts.base import Internal

# The badput categories, in the order a person reads them. Goodput plus these is 100 % of a run's
# wall time (accepted -> final state); a rollup adds `idle` (IDLE): the GPU-hours of its bookings
# that no run held (the booking's other GPUs while a run goes, and every GPU while none does).
BADPUT = (
    "queued",
    "startup",
    "data_loading",
    "checkpoint_stall",
    "checkpoint_restore",
    "lost_to_interruptions",
    "recovery",
    "eval",
    "other",
)
IDLE = "idle"
BOOKED_BADPUT = (*BADPUT, IDLE)
"""A rollup's badput categories: goodput plus these is 100 % of its booked GPU-hours."""


ROLLUP_BY: dict[str, str] = {"booking": "booking_id", "region": "region", "gpu_model": "gpu_model"}
"""A rollup's `by` -> the RunTelemetry field whose value is its key (what runs are rolled up by)."""


class RunTelemetry(Internal, frozen=True, kw_only=True):
    """`desk.telemetry.run.<run_id>`: one finished run."""

    run_id: str
    account: str
    booking_id: str
    region: str
    gpu_model: str
    gpus: int
    state: str
    accepted_at: datetime
    ended_at: datetime
    wall_s: float
    goodput_s: float  # steps whose work was kept
    badput_s: dict[str, float]  # every BADPUT category, seconds
    goodput: float  # goodput_s / wall_s
    gpu_hours: float
    interruptions: int
    interruption_causes: dict[str, int]
    checkpoint_saves: int
    checkpoint_bytes_per_s_p50: float | None = None
    checkpoint_bytes_per_s_min: float | None = None
    booked_gpus: int = 0  # the booking's GPUs (0: not known)
    booked_gpu_hours: float = 0.0  # the booking's whole window, every GPU (0: not known)


class Rollup(Internal, frozen=True, kw_only=True):
    """`desk.telemetry.rollup.<by>.<key>`: the runs of one booking, region or GPU model so far."""

    by: str  # "booking", "region", "gpu_model"
    key: str
    runs: int
    wall_gpu_hours: float
    goodput_gpu_hours: float
    goodput: float
    badput_gpu_hours: dict[str, float]  # every BOOKED_BADPUT category (`idle` included)
    interruptions: int
    interruptions_per_1000_gpu_hours: float
    interruption_causes: dict[str, int]
    checkpoint_bytes_per_s_p50: float | None = None
    checkpoint_bytes_per_s_min: float | None = None
    updated_at: datetime
    # Every booking of these runs, whole window and every GPU (a booking whose size is not known
    # counts the GPU-hours its runs held); idle = booked - wall.
    booked_gpu_hours: float = 0.0
