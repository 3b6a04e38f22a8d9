"""Summaries of timing samples: percentiles by linear interpolation, nothing clever."""

import statistics


def percentile(samples: list[float], p: float) -> float:
    """The p-th percentile (0-100) of `samples`, interpolated between the closest ranks."""
    assert samples, "a percentile needs at least one sample"
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * p / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(samples: list[float]) -> float:
    return statistics.median(samples)


def ms(seconds: float) -> float:
    """Seconds to milliseconds, rounded for the results file (microsecond resolution)."""
    return round(seconds * 1000.0, 3)


def latency_summary(samples_s: list[float]) -> dict[str, float]:
    """p50, p90, p95, p99, mean and max in milliseconds, and the sample count."""
    return {
        "p50_ms": ms(percentile(samples_s, 50)),
        "p90_ms": ms(percentile(samples_s, 90)),
        "p95_ms": ms(percentile(samples_s, 95)),
        "p99_ms": ms(percentile(samples_s, 99)),
        "mean_ms": ms(statistics.fmean(samples_s)),
        "max_ms": ms(max(samples_s)),
        "samples": len(samples_s),
    }
