"""The pure decisions of tune-parallelism (see tasks/tune.py): step sizes, when the search stops, the
knee, the choice, refinement, extension and stability; unit-tested on synthetic steps.

Rates carry an uncertainty (tasks/throughput.py). Two rates within `z` standard errors of each other
are equal, and the smaller parallelism (lower latency) wins; a step the choice hangs on while its rate
is that uncertain is extended (more rollouts at the same parallelism, kept like every probe rollout).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from rollflow.settings import TuningSettings
from rollflow.tasks.tuning.probe import StepResult


@dataclass
class TuneOptions:
    """Knobs of the search; defaults suit backends whose latency is 10 ms to minutes."""

    start: int = 8
    min_rollouts: int = 100
    cycles: float = 3.0
    stability_rollouts: int = 200
    stability_cycles: float = 4.0
    plateau_gain: float = 0.10
    degrade: float = 0.10
    max_error_rate: float = 0.02
    knee_utilisation: float = 0.90
    knee_gain: float = 1.7
    saturated_utilisation: float = 0.75
    headroom: float = 0.8
    peak_fraction: float = 0.92
    z: float = 2.0
    over_knee: float = 1.25
    extend_rel_err: float = 0.015
    max_extensions: int = 3
    refine_steps: int = 2
    near: float = 0.05
    backoff: float = 0.75
    max_backoffs: int = 2
    spread_jump: float = 1.5
    max_parallelism: int = 4096
    max_steps: int = 12
    time_budget_s: float = 900.0
    # With the engine's signal a step only needs to hold P in flight past one mid-step sample.
    engine_cycles: float = 1.5
    engine_confirm_cycles: float = 2.0
    engine_min_rollouts: int = 20
    # Run a little above the engine's knee: a short waiting queue keeps every slot busy while the client
    # turns a reply into the next request (at exactly the knee a slot idles for that long each time).
    engine_queue_share: float = 0.25

    @classmethod
    def from_settings(cls, params: TuningSettings) -> TuneOptions:
        """The user-facing knobs come from the settings; the rest are the search's own constants."""
        return cls(
            start=params.tune_start,
            min_rollouts=params.tune_step_rollouts,
            plateau_gain=params.plateau_gain,
            max_error_rate=params.max_error_rate,
            headroom=params.headroom,
            max_parallelism=params.max_parallelism,
        )


def step_rollouts(parallelism: int, opts: TuneOptions, stability: bool = False) -> int:
    """Rollouts for a step at `parallelism`: enough whole cycles for a steady measurement."""
    if stability:
        return max(opts.stability_rollouts, math.ceil(opts.stability_cycles * parallelism))
    return max(opts.min_rollouts, math.ceil(opts.cycles * parallelism))


def engine_step_rollouts(parallelism: int, opts: TuneOptions, confirm: bool = False) -> int:
    """Rollouts for a step read by the engine's queue: enough to keep P in flight past its sample."""
    cycles = opts.engine_confirm_cycles if confirm else opts.engine_cycles
    return max(opts.engine_min_rollouts, math.ceil(cycles * parallelism))


def too_many_errors(step: StepResult, baseline: StepResult | None, opts: TuneOptions) -> bool:
    """Failed rollouts above the threshold, or failed attempts that grew with load: clearly more than at
    the lowest level (a backend that fails a steady few percent at any load is flaky, not overloaded;
    retries cover it)."""
    if step.measure.rollouts == 0:
        return True
    if step.measure.error_rate > opts.max_error_rate:
        return True
    if baseline is None or baseline is step or baseline.parallelism >= step.parallelism:
        return False
    return step.attempt_error_rate > 2 * baseline.attempt_error_rate + 2 * opts.max_error_rate


def base_latency(steps: Sequence[StepResult]) -> float | None:
    """The unloaded latency: the lowest p50 seen (the lowest levels run below the knee)."""
    values = [s.measure.p50_s for s in steps if s.measure.p50_s]
    return min(values) if values else None


def utilisation(step: StepResult, latency0: float | None) -> float | None:
    """Throughput x unloaded latency / P: 1.0 below the knee, P_knee / P above it."""
    if not latency0 or step.parallelism <= 0:
        return None
    return step.rollouts_per_s * latency0 / step.parallelism


def normalised_gain(lower: StepResult, upper: StepResult) -> float:
    """Throughput ratio scaled to one doubling of parallelism (so x1.5 steps compare with x2)."""
    if lower.rollouts_per_s <= 0:
        return float("inf")
    ratio = upper.rollouts_per_s / lower.rollouts_per_s
    octaves = math.log2(upper.parallelism / lower.parallelism)
    return ratio ** (1 / octaves) if octaves > 0 else ratio


def search_stop(
    valid: Sequence[StepResult], latest: StepResult, baseline: StepResult | None, opts: TuneOptions
) -> str | None:
    """Why the doubling search stops after `latest` (None: keep doubling). `valid`: earlier good steps."""
    if too_many_errors(latest, baseline, opts):
        return "errors"
    lower = [s for s in valid if s.parallelism < latest.parallelism]
    best = max((s.rollouts_per_s for s in valid), default=0.0)
    if best and latest.rollouts_per_s < (1 - opts.degrade) * best:
        return "degradation"
    if not lower:
        return None
    prev = max(lower, key=lambda s: s.parallelism)
    gain = normalised_gain(prev, latest)
    if gain < 1 + opts.plateau_gain:
        return "plateau"
    u = utilisation(latest, base_latency([*valid, latest]))
    if u is not None and (
        u < opts.saturated_utilisation or (u < opts.knee_utilisation and gain < opts.knee_gain)
    ):
        return "latency-knee"
    if latest.parallelism * 2 > opts.max_parallelism:
        return "max-parallelism"
    return None


def stop_uncertain(
    valid: Sequence[StepResult], latest: StepResult, baseline: StepResult | None, opts: TuneOptions
) -> bool:
    """Whether the search's decision on `latest` flips within `z` standard errors of its rate (a rate
    that reads low stops the search early, one that reads high runs it a doubling too far)."""
    decided = search_stop(valid, latest, baseline, opts)
    if decided in ("plateau", "latency-knee", "degradation") and "+" not in latest.label:
        return True  # a stop read off one step is confirmed once: a loaded client reads low, never high
    if latest.measure.rel_err <= opts.extend_rel_err:
        return False
    for sign in (1, -1):
        rate = max(0.0, latest.rollouts_per_s + sign * opts.z * latest.measure.rate_err)
        bumped = replace(latest, measure=replace(latest.measure, rollouts_per_s=rate))
        if search_stop(valid, bumped, baseline, opts) != decided:
            return True
    return False


def knee_estimate(valid: Sequence[StepResult]) -> int:
    """Peak throughput x unloaded latency, within the measured range."""
    peak = peak_step(valid)
    latency0 = base_latency(valid)
    lo = min(s.parallelism for s in valid)
    if not latency0:
        return peak.parallelism
    bdp = peak.rollouts_per_s * latency0
    return int(min(max(round(bdp), lo, 1), peak.parallelism))


def peak_step(valid: Sequence[StepResult]) -> StepResult:
    return max(valid, key=lambda s: s.rollouts_per_s)


def shortfall(step: StepResult, valid: Sequence[StepResult], opts: TuneOptions) -> float:
    """How far `step` is below peak_fraction of the peak, in standard errors of that difference
    (<= 0: it reached it; under opts.z: within the uncertainty, so as good)."""
    peak = peak_step(valid)
    gap = opts.peak_fraction * peak.rollouts_per_s - step.rollouts_per_s
    if gap <= 0:
        return gap
    sigma = math.hypot(step.measure.rate_err, opts.peak_fraction * peak.measure.rate_err)
    return gap / sigma if sigma > 0 else math.inf


def peak_floor(valid: Sequence[StepResult], opts: TuneOptions) -> int:
    """The smallest measured parallelism whose throughput reached peak_fraction of the peak, a rate
    within the uncertainty of that counting as reaching it (the smaller parallelism wins a tie)."""
    return min(s.parallelism for s in valid if shortfall(s, valid, opts) < opts.z)


def to_extend(valid: Sequence[StepResult], opts: TuneOptions) -> StepResult | None:
    """The step the choice hangs on while its rate is uncertain: the floor (or the peak) when it
    stands where it does only within its uncertainty; None when the choice is clear."""
    floor = min((s for s in valid if shortfall(s, valid, opts) < opts.z), key=lambda s: s.parallelism)
    peak = peak_step(valid)
    if shortfall(floor, valid, opts) > 0 and floor.measure.rel_err > opts.extend_rel_err:
        return floor
    if peak.measure.rel_err > 2 * opts.extend_rel_err:
        return peak
    return None


def choose(valid: Sequence[StepResult], knee: int, opts: TuneOptions) -> int:
    """max(ceil(headroom x knee), the peak floor): trims parallelism that buys little, not throughput.
    A floor far above the bandwidth-delay knee means the steps between read low (a loaded client), not
    that the backend needs that many in flight: it is capped at `over_knee` x knee."""
    floor = min(peak_floor(valid, opts), math.ceil(opts.over_knee * knee))
    return max(math.ceil(opts.headroom * knee), floor, 1)


def refine_target(valid: Sequence[StepResult], knee: int, opts: TuneOptions) -> int | None:
    """Where to measure next to pin the knee down: the estimate itself, then a bisection between it and
    the nearest measured point above it (None: the knee is known closely enough)."""
    near = [s for s in valid if abs(s.parallelism - knee) <= opts.near * knee]
    if not near:
        return knee
    if any(shortfall(s, valid, opts) < opts.z for s in near):
        return None
    above = [s.parallelism for s in valid if s.parallelism > knee * (1 + opts.near)]
    if not above:
        return None
    mid = (knee + min(above)) // 2
    if any(abs(s.parallelism - mid) <= opts.near * mid for s in valid):
        return None
    return mid


def unstable(step: StepResult, reference: Sequence[StepResult], opts: TuneOptions) -> str | None:
    """Why a stability stretch failed, else None: errors, or a p95/p50 spread that jumped beyond what the
    shorter steps at or below this level showed (queueing at the knee itself is expected, so the bar is
    `spread_jump` x that and at least 2)."""
    baseline = min(reference, key=lambda s: s.parallelism) if reference else None
    if too_many_errors(step, baseline, opts):
        return f"{step.errors} failed rollouts, {sum(step.attempt_errors.values())} failed attempts"
    spread = step.measure.spread
    seen = [s.measure.spread for s in reference if s is not step and s.parallelism <= step.parallelism]
    ref = max((x for x in seen if x is not None), default=None)
    if spread is not None and ref is not None and spread > max(opts.spread_jump * ref, 2.0):
        return f"latency spread p95/p50 {spread:.2f} against {ref:.2f} in shorter steps"
    return None
