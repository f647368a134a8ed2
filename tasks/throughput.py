"""Steady-state throughput of one probe step, from its per-request timeline.

A step at parallelism P starts with P requests sent at once and ends with the in-flight count draining
to zero; neither edge is the rate the backend sustains. The method (`measure_step`):

1. Ramp-up: drop the first 10% of completions, and every completion before the in-flight count first
   reached min(P, n). The window opens at the end time of the first kept completion.
2. Tail: the window may not reach past the last request's start (after it the in-flight count only
   falls) nor into the last 10% of completions.
3. Whole cycles: in a closed loop of P requests, about P completions happen while one request is
   served, so completion k+P comes one latency after completion k. The window is cut to span a whole
   number of cycles (a multiple of P completions) so that requests which started together and finish
   in waves are not counted half a wave short or long. Rate = successes in the window / its length.
4. A step too short for one whole steady cycle falls back to the whole-span rate (successes / first
   start to last end), which underestimates; `method` says which was used. Steps of >= 4 P rollouts
   (see `tasks.tune.step_rollouts`) always get a steady measurement.

p50/p95 latency are over successful requests of the whole step; errors are counted by kind.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import quantiles
from typing import Protocol

RAMP_FRACTION = 0.10
TAIL_FRACTION = 0.10


class Record(Protocol):
    start: float
    end: float
    error: str | None


@dataclass
class StepMeasure:
    """What one step measured: steady throughput, latency percentiles, errors by kind."""

    parallelism: int
    rollouts: int
    ok: int
    rollouts_per_s: float
    p50_s: float | None
    p95_s: float | None
    errors: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    window_s: float = 0.0
    window_completions: int = 0
    method: str = "steady"

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())

    @property
    def error_rate(self) -> float:
        return self.error_count / self.rollouts if self.rollouts else 0.0

    @property
    def spread(self) -> float | None:
        """p95 / p50: how much the slow tail stretches (queueing shows here before throughput drops)."""
        if self.p50_s and self.p95_s:
            return self.p95_s / self.p50_s
        return None


def percentiles(values: Sequence[float]) -> tuple[float | None, float | None]:
    """p50 and p95 (inclusive method, so small samples do not extrapolate past the largest value)."""
    if not values:
        return None, None
    if len(values) == 1:
        return values[0], values[0]
    cuts = quantiles(values, n=20, method="inclusive")
    return cuts[9], cuts[18]


def ramp_reached_at(records: Sequence[Record], target: int) -> float:
    """The time the in-flight count first reached `target` (the last start if it never did)."""
    events = sorted(
        [(r.start, 1) for r in records] + [(r.end, -1) for r in records], key=lambda e: (e[0], -e[1])
    )
    in_flight = 0
    for t, delta in events:
        in_flight += delta
        if in_flight >= target:
            return t
    return max(r.start for r in records)


def steady_window(records: Sequence[Record], parallelism: int) -> tuple[int, int] | None:
    """Indices (a, b) into the records sorted by end: the window is (end[a], end[b]]; None if too short."""
    n = len(records)
    if n < 4:
        return None
    ends = sorted(records, key=lambda r: r.end)
    p = max(1, min(parallelism, n))
    t_ramp = ramp_reached_at(records, p)
    a = max(math.ceil(RAMP_FRACTION * n) - 1, 0)
    while a < n and ends[a].end < t_ramp:
        a += 1
    t_drain = max(r.start for r in records)
    b = n - 1 - math.ceil(TAIL_FRACTION * n)
    while b > a and ends[b].end > t_drain:
        b -= 1
    if b - a < p:
        return None
    b = a + ((b - a) // p) * p
    if ends[b].end <= ends[a].end:
        return None
    return a, b


def measure_step(records: Sequence[Record], parallelism: int) -> StepMeasure:
    """Steady throughput, latency percentiles and error counts of one step (see the module docstring)."""
    n = len(records)
    errors = Counter(r.error for r in records if r.error is not None)
    ok_latencies = [r.end - r.start for r in records if r.error is None]
    p50, p95 = percentiles(ok_latencies)
    ok = len(ok_latencies)
    if n == 0:
        return StepMeasure(parallelism, 0, 0, 0.0, None, None)
    wall = max(r.end for r in records) - min(r.start for r in records)
    window = steady_window(records, parallelism)
    if window is None:
        rate = ok / wall if wall > 0 else 0.0
        return StepMeasure(parallelism, n, ok, rate, p50, p95, dict(errors), wall, wall, n, method="span")
    a, b = window
    ends = sorted(records, key=lambda r: r.end)
    t_a, t_b = ends[a].end, ends[b].end
    good = sum(1 for r in ends[a + 1 : b + 1] if r.error is None)
    return StepMeasure(
        parallelism=parallelism,
        rollouts=n,
        ok=ok,
        rollouts_per_s=good / (t_b - t_a),
        p50_s=p50,
        p95_s=p95,
        errors=dict(errors),
        wall_s=wall,
        window_s=t_b - t_a,
        window_completions=b - a,
    )
