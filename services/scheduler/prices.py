"""The desk's price table: each GPU model's price per GPU-hour and the planning assumptions beside
it (peak bf16 TFLOP/s, the MFU a well-tuned run reaches, memory, fp8), the checkpoint storage price,
and the backend's measured wall-time figures (services/scheduler/calibration.py).

Read once when the scheduler starts (`load_prices`: desk_prices.json and desk_calibration.json
beside this module) and handed to the pure planner (services/scheduler/planning.py) and to the
desk's reads; nothing here is asked again per request.
"""

import json
import pathlib
from dataclasses import dataclass, field

from services.scheduler import calibration

PRICES_PATH = pathlib.Path(__file__).with_name("desk_prices.json")


@dataclass(frozen=True, slots=True)
class GpuPrice:
    price_per_gpu_hour_usd: float
    peak_bf16_tflops: float
    assumed_mfu: float
    memory_gb: float
    fp8: bool


@dataclass(frozen=True, slots=True)
class PriceTable:
    storage_usd_per_gb_month: float
    gpus: dict[str, GpuPrice]
    # The backend's measured wall-time figures per GPU model (services/scheduler/calibration.py);
    # empty: the estimate is FLOPs at the assumed MFU alone (basis "flops").
    calibration: "dict[str, calibration.Figures]" = field(default_factory=dict)


def load_prices(
    path: pathlib.Path = PRICES_PATH, calibration_path: pathlib.Path = calibration.CALIBRATION_PATH
) -> PriceTable:
    raw = json.loads(path.read_text())
    gpus = {name: GpuPrice(**v) for name, v in raw["gpus"].items()}
    return PriceTable(
        storage_usd_per_gb_month=raw["storage_usd_per_gb_month"],
        gpus=gpus,
        calibration=calibration.load(calibration_path, mfu={n: g.assumed_mfu for n, g in gpus.items()}),
    )
