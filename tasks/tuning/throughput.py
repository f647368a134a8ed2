"""Steady-state throughput of one probe step, from its per-request timeline.

A step at parallelism P starts with P requests sent at once and ends with the in-flight count draining
to zero; neither edge is the rate the backend sustains, and with short steps (100-200 rollouts) the
edges are most of the step. Counting completions over a window is fragile too: requests that started
together finish in waves, and while a backend queue fills up (P above its capacity) completions come
faster than they will later. So the rate comes from Little's law, which needs no window alignment:

    throughput = mean requests in flight / mean time each one holds its slot

over the steady part of the step (`measure_step`):
1. Ramp-up: only requests that *started* after the first completion count. By then the first wave has
   met the backend, so each later request sees the queue (or free slots) the steady state has.
2. Tail: nothing starts during the drain (it begins at the last start), and requests already running
   keep the wait they queued for, so no request is dropped. (On a backend that shares its capacity
   among the requests in flight the last ones finish a little early; the bias is a few percent.)
3. In flight: the time-weighted mean in-flight count between the first completion and the last start
   (P whenever the step keeps its limit full, as probes do). Successes only: the rate is multiplied by
   the share of the counted requests that succeeded.
A step with fewer than 5 such requests falls back to the whole-span rate (successes / first start to
last end), which underestimates; `method` says which was used. Steps of >= 2 P rollouts are enough.

p50/p95 latency are over successful requests of the whole step; errors are counted by kind.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import quantiles
from typing import Protocol

TAIL_FRACTION = 0.0  # share of the latest starts left out (kept as a knob; see the docstring)
MIN_STEADY = 5


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
    method: str = "little"

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


def mean_in_flight(records: Sequence[Record], t0: float, t1: float) -> float:
    """Time-weighted mean number of requests in flight between t0 and t1."""
    if t1 <= t0:
        return float(sum(1 for r in records if r.start <= t0 < r.end))
    busy = sum(max(0.0, min(r.end, t1) - max(r.start, t0)) for r in records)
    return busy / (t1 - t0)


def steady_requests(records: Sequence[Record]) -> tuple[list[Record], float, float]:
    """The requests counted (started after the first completion), and the interval they started in."""
    first_end = min(r.end for r in records)
    later = sorted((r for r in records if r.start >= first_end), key=lambda r: r.start)
    keep = later[: len(later) - math.floor(TAIL_FRACTION * len(later))]
    last_start = max(r.start for r in records)
    return keep, first_end, last_start


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
    steady, t0, t1 = steady_requests(records)
    if len(steady) < MIN_STEADY:
        rate = ok / wall if wall > 0 else 0.0
        return StepMeasure(parallelism, n, ok, rate, p50, p95, dict(errors), wall, wall, n, method="span")
    in_flight = mean_in_flight(records, t0, t1)
    hold = sum(r.end - r.start for r in steady) / len(steady)
    good = sum(1 for r in steady if r.error is None)
    rate = in_flight / hold * good / len(steady) if hold > 0 else 0.0
    return StepMeasure(
        parallelism=parallelism,
        rollouts=n,
        ok=ok,
        rollouts_per_s=rate,
        p50_s=p50,
        p95_s=p95,
        errors=dict(errors),
        wall_s=wall,
        window_s=max(0.0, t1 - t0),
        window_completions=len(steady),
        method="little",
    )
