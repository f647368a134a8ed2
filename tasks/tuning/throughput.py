"""Steady throughput of one probe step, with its uncertainty, from the per-request timeline.

A step at parallelism P starts with P requests sent at once and ends with the in-flight count draining
to zero; neither edge is the rate the backend sustains. Two ways of reading the middle overshoot:
- counting completions in a window: requests that started together finish in waves, so a window that
  opens just before a wave counts one wave too many (up to slots / window x capacity);
- Little's law (mean in flight / mean hold) over a window shorter than a few holds: the requests of
  the first wave held their slots for less than the steady hold (the queue was still filling), and the
  ones still in flight when the window opens carry that into it; on a real client (whose own lag makes
  the first waves shorter still) this read 5-13% above slots / latency.

So the rate is the *progress* of the requests in flight (`measure_step`): each request advances by
overlap / its own hold, and the sum over the steady window, divided by its length, is the rate at which
whole requests complete there. It has no wave edges (progress is continuous) and needs no alignment:
1. Ramp-up: the window opens when the first wave is done (the P-th completion), so no request whose
   hold was shortened by a filling queue is counted; steps too short for that (under ~2.5 cycles) open
   at the first completion instead, with a few percent of overshoot that their uncertainty covers.
2. Tail: the window closes at the last start; after it the in-flight count drains.
3. Failures: the rate is multiplied by the share of counted progress that succeeded.
4. Mix: when the backend reports output tokens, each request's progress is weighted by its tokens over
   the step's mean. An engine that decodes every running sequence at one pace finishes short replies
   first, so a step that starts P requests at once completes more of them per second for its first few
   cycles than it sustains (the in-flight mix has not yet filled with the long ones that stay longest):
   on a batching engine a 3-cycle step read 9-14% high. The tokens decoded per second do not depend
   on the mix, and over the step's mean reply length they give the rollouts/s a long run sustains.
Uncertainty: the window is cut into `BINS` equal intervals; `rate_err` is the standard error of their
rates (a short or uneven step gets a wide one); the tuner's decisions use it. `edge_err` bounds the
edges' misplaced progress, `EDGE_SHARE` x rate x one latency / window (a window of one latency reads a
few percent either way on a loaded machine, one of four latencies a quarter of that); reports state both.
A step with no window falls back to the whole-span rate
(successes / first start to last end, an underestimate) with an error as large as the rate itself.

p50/p95 latency are over successful requests of the whole step; errors are counted by kind.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import stdev
from typing import Protocol

from rollflow.tasks.collect.percentiles import percentiles

BINS = 6
MIN_STEADY = 5


class Record(Protocol):
    start: float
    end: float
    error: str | None
    tokens: int


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
    method: str = "progress"
    rate_err: float = 0.0
    edge_err: float = 0.0  # the window edges' share (a bias bound, not noise: extending does not shrink it)

    @property
    def reported_err(self) -> float:
        """The uncertainty a report states: the statistical error and the edge term together."""
        return math.hypot(self.rate_err, self.edge_err)

    @property
    def rel_err(self) -> float:
        """rate_err / rate (1.0 when nothing was measured)."""
        return self.rate_err / self.rollouts_per_s if self.rollouts_per_s > 0 else 1.0

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


def progress(records: Sequence[Record], t0: float, t1: float, unit: float | None = None) -> float:
    """Whole successful requests' worth of progress made between t0 and t1 (each at 1 / its hold), each
    weighted by its tokens / `unit` when the step is measured in tokens."""
    return sum(
        max(0.0, min(r.end, t1) - max(r.start, t0)) / (r.end - r.start) * (r.tokens / unit if unit else 1.0)
        for r in records
        if r.error is None and r.end > r.start
    )


def token_unit(records: Sequence[Record]) -> float | None:
    """The mean output tokens of the step's successful requests, or None when any lacks a count."""
    ok = [r.tokens for r in records if r.error is None]
    if not ok or min(ok) <= 0:
        return None
    return sum(ok) / len(ok)


def steady_window(records: Sequence[Record], parallelism: int) -> tuple[float, float] | None:
    """(opens, closes): from the end of the first wave (or, if that leaves no window, the first
    completion) to the last start; None when nothing is left between them."""
    ends = sorted(r.end for r in records)
    last_start = max(r.start for r in records)
    wave_done = ends[min(max(parallelism, 1), len(ends)) - 1]
    holds = sorted(r.end - r.start for r in records)
    for opens, min_span in ((wave_done, holds[len(holds) // 2]), (ends[0], 0.0)):
        later = sum(1 for r in records if r.start >= opens)
        if last_start - opens > min_span and later >= MIN_STEADY:
            return opens, last_start
    return None


EARLY_BIAS = 0.05  # the overshoot a window opened at the first completion may carry (see the docstring)
# Edge term: the requests in flight at either edge of the window carry progress the uniform-progress model
# can misplace by a few percent of one latency's worth of completions; a window of one latency reads up
# to ~7% high or low on a loaded 2-core machine (measured), one of four latencies about a quarter of that.
EDGE_SHARE = 0.05


def rate_and_error(
    records: Sequence[Record], t0: float, t1: float, unit: float | None = None
) -> tuple[float, float]:
    """Successful progress per second over [t0, t1], and the standard error of its BINS sub-intervals."""
    span = t1 - t0
    rate = progress(records, t0, t1, unit) / span
    width = span / BINS
    parts = [progress(records, t0 + i * width, t0 + (i + 1) * width, unit) / width for i in range(BINS)]
    return rate, stdev(parts) / math.sqrt(BINS)


def measure_step(records: Sequence[Record], parallelism: int) -> StepMeasure:
    """Steady throughput with its uncertainty, latency percentiles and errors (see the module docstring)."""
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
        return StepMeasure(parallelism, n, ok, rate, p50, p95, dict(errors), wall, wall, n, "span", rate)
    t0, t1 = window
    rate, err = rate_and_error(records, t0, t1, token_unit(records))
    edge = EDGE_SHARE * rate * min(1.0, (p50 or 0.0) / (t1 - t0))
    if t0 < sorted(r.end for r in records)[min(max(parallelism, 1), n) - 1]:
        err = max(err, EARLY_BIAS * rate)
    return StepMeasure(
        parallelism=parallelism,
        rollouts=n,
        ok=ok,
        rollouts_per_s=rate,
        p50_s=p50,
        p95_s=p95,
        errors=dict(errors),
        wall_s=wall,
        window_s=t1 - t0,
        window_completions=sum(1 for r in records if t0 < r.end <= t1),
        method="progress",
        rate_err=err,
        edge_err=edge,
    )


def combine_measures(measures: Sequence[StepMeasure], records: Sequence[Record]) -> StepMeasure:
    """Separate steps at one parallelism as one: counts summed, percentiles over all `records`, and the
    rates that agree with the highest (within 2 standard errors) weighted by inverse variance (an error
    floor of 1% keeps one lucky step from outweighing the rest). A rate far below the others is a loaded
    client's (this estimator does not read high), so it is left out."""
    best = max(measures, key=lambda m: m.rollouts_per_s)
    agree = [
        m
        for m in measures
        if best.rollouts_per_s - m.rollouts_per_s <= 2 * math.hypot(best.rate_err, m.rate_err)
    ]
    weights = [1.0 / max(m.rate_err, 0.01 * m.rollouts_per_s, 1e-9) ** 2 for m in agree]
    rate = sum(w * m.rollouts_per_s for w, m in zip(weights, agree, strict=True)) / sum(weights)
    errors: Counter[str] = Counter()
    for m in measures:
        errors.update(m.errors)
    p50, p95 = percentiles([r.end - r.start for r in records if r.error is None])
    return StepMeasure(
        parallelism=measures[0].parallelism,
        rollouts=sum(m.rollouts for m in measures),
        ok=sum(m.ok for m in measures),
        rollouts_per_s=rate,
        p50_s=p50,
        p95_s=p95,
        errors=dict(errors),
        wall_s=sum(m.wall_s for m in measures),
        window_s=sum(m.window_s for m in measures),
        window_completions=sum(m.window_completions for m in measures),
        method="progress" if any(m.method == "progress" for m in measures) else "span",
        rate_err=1.0 / math.sqrt(sum(weights)),
        edge_err=sum(m.edge_err for m in agree) / len(agree),
    )
