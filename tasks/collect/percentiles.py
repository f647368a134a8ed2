"""p50 and p95 of latencies: one method for the run report and the tuning table alike."""

from __future__ import annotations

from collections.abc import Sequence
from statistics import quantiles


def percentiles(values: Sequence[float]) -> tuple[float | None, float | None]:
    """p50 and p95 (inclusive method, so small samples do not extrapolate past the largest value)."""
    if not values:
        return None, None
    if len(values) == 1:
        return values[0], values[0]
    cuts = quantiles(values, n=20, method="inclusive")
    return cuts[9], cuts[18]
