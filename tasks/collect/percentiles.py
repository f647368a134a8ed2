"""Figures as the reports compute and show them: p50 and p95 of latencies (one method for the run report
and the tuning table alike), and one way to write a value or a share in a summary (the CLI, report.md,
the dataset card)."""

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


NOT_SET = "-"


def shown(value: object, digits: int = 3, missing: str = NOT_SET) -> str:
    """A summary's value as a person reads it: nothing (None) as `-`; whole numbers with thousands
    separators; a fraction to `digits` significant digits (0.124), more where fewer would read as a whole
    number it is not (0.9996, never 1); a larger float to as many as its whole part needs and at most one
    decimal (138.4, 4,096), never a float's raw digits (138.40500000001)."""
    if value is None:
        return missing
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return str(value)
        if value == int(value) and abs(value) < 1e15:
            return f"{int(value):,}"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 1:
            return f"{value:,.1f}".removesuffix(".0")
        text = f"{value:.{digits}g}"
        while float(text) == int(float(text)) and digits < 9:  # 0.9996 at 3 digits reads as 1: say more
            digits += 1
            text = f"{value:.{digits}g}"
        return text
    return str(value)


def shown_share(fraction: float | None) -> str:
    """A share as a percentage that never reads as another: 0% and 100% only when exactly so, `<0.1%` and
    `>99.9%` at the ends, else one decimal where it matters (0.5%, 12.3%, 50%)."""
    if fraction is None:
        return NOT_SET
    if fraction <= 0:
        return "0%"
    if fraction >= 1:
        return "100%"
    percent = 100 * fraction
    if percent < 0.1:
        return "<0.1%"
    if percent > 99.9:
        return ">99.9%"
    return f"{percent:.1f}".removesuffix(".0") + "%"
