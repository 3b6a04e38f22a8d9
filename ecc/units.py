"""How a time, an amount of dollars and GPU time read, the same in every view: a time as the wire
spells it, dollars to the cent (or two significant digits below one), GPU time in the unit that reads.
"""

import math
from datetime import datetime

import msgspec

_encoder = msgspec.json.Encoder()


def when(at: datetime) -> str:
    """A time as the wire spells it (RFC 3339, `Z` for UTC)."""
    return _encoder.encode(at).decode().strip('"')


def usd(amount: float) -> str:
    """Dollars to the cent, or to two significant digits below a cent (a tiny run costs 0.00018 USD,
    not 0.00)."""
    if amount >= 0.01 or amount <= 0:
        return f"{amount:.2f} USD"
    digits = min(12, 1 - math.floor(math.log10(amount)))
    return f"{amount:.{digits}f} USD"


def gpu_time(gpu_hours: float) -> str:
    """GPU time in the unit that reads: GPU-seconds under a GPU-minute, GPU-minutes under a
    GPU-hour, GPU-hours above (a tiny run is "28 GPU-s", not "0.0000 GPU-h")."""
    seconds = gpu_hours * 3600
    if seconds < 60:
        return f"{seconds:.2g} GPU-s" if seconds < 10 else f"{seconds:.0f} GPU-s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} GPU-min"
    return f"{gpu_hours:,.2f} GPU-h"
