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
    plateau_gain: float = 0.05
    degrade: float = 0.10
    max_error_rate: float = 0.02
    headroom: float = 0.8
    target_share: float = 0.97
    z: float = 2.0
    extend_rel_err: float = 0.015
    max_extensions: int = 3
    refine_steps: int = 2
    near: float = 0.05
    max_backoffs: int = 2
    max_parallelism: int = 4096
    max_steps: int = 14
    time_budget_s: float = 900.0
    max_probe_rollouts: int | None = None  # a run's share for probing; None: the steps and time bound it
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
            target_share=params.target_share,
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


def grew(lower: StepResult, upper: StepResult, opts: TuneOptions) -> bool:
    """Whether `upper` is faster than `lower` beyond `z` standard errors of their difference."""
    sigma = math.hypot(lower.measure.rate_err, upper.measure.rate_err)
    return upper.rollouts_per_s - lower.rollouts_per_s > opts.z * sigma


def still_growing(lower: StepResult, upper: StepResult, opts: TuneOptions) -> bool:
    """Whether a doubling still pays: a gain of at least `plateau_gain` per doubling, beyond the rates'
    uncertainty (else it is a plateau)."""
    return normalised_gain(lower, upper) >= 1 + opts.plateau_gain and grew(lower, upper, opts)


def search_stop(
    valid: Sequence[StepResult], latest: StepResult, baseline: StepResult | None, opts: TuneOptions
) -> str | None:
    """Why the doubling search stops after `latest` (None: keep doubling). `valid`: earlier good steps.

    Only throughput and failures stop it: latency that grows with the batch is how a continuous-batching
    engine buys throughput, so it is no reason to stop while the rate still grows beyond its uncertainty."""
    if too_many_errors(latest, baseline, opts):
        return "errors"
    lower = [s for s in valid if s.parallelism < latest.parallelism]
    best = max((s.rollouts_per_s for s in valid), default=0.0)
    if best and latest.rollouts_per_s < (1 - opts.degrade) * best:
        return "degradation"
    if not lower:
        return None
    prev = max(lower, key=lambda s: s.parallelism)
    if not still_growing(prev, latest, opts):
        return "plateau"
    if latest.parallelism * 2 > opts.max_parallelism:
        return "max-parallelism"
    return None


def stop_uncertain(
    valid: Sequence[StepResult], latest: StepResult, baseline: StepResult | None, opts: TuneOptions
) -> bool:
    """Whether the search's decision on `latest` flips within `z` standard errors of its rate (a rate
    that reads low stops the search early, one that reads high runs it a doubling too far)."""
    decided = search_stop(valid, latest, baseline, opts)
    if decided in ("plateau", "degradation") and "+" not in latest.label:
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
    """Peak throughput x unloaded latency, within the measured range: the bandwidth-delay product, where
    a backend of fixed slots reaches its peak (a batching engine's curve goes on rising past it)."""
    peak = peak_step(valid)
    latency0 = base_latency(valid)
    lo = min(s.parallelism for s in valid)
    if not latency0:
        return peak.parallelism
    bdp = peak.rollouts_per_s * latency0
    return int(min(max(round(bdp), lo, 1), peak.parallelism))


def peak_step(valid: Sequence[StepResult]) -> StepResult:
    return max(valid, key=lambda s: s.rollouts_per_s)


def reaches_target(step: StepResult, valid: Sequence[StepResult], opts: TuneOptions) -> bool:
    return step.rollouts_per_s >= opts.target_share * peak_step(valid).rollouts_per_s


def as_good_as_best(step: StepResult, valid: Sequence[StepResult], opts: TuneOptions) -> bool:
    """Within `z` standard errors of the best measured rate, or at least `target_share` of it."""
    peak = peak_step(valid)
    sigma = math.hypot(step.measure.rate_err, peak.measure.rate_err)
    return reaches_target(step, valid, opts) or peak.rollouts_per_s - step.rollouts_per_s <= opts.z * sigma


def choose(valid: Sequence[StepResult], opts: TuneOptions) -> int:
    """The smallest measured parallelism as good as the best (fewer requests in flight at the same
    throughput: shorter latency, less memory on the engine)."""
    return min(s.parallelism for s in valid if as_good_as_best(s, valid, opts))


def choice_rule(valid: Sequence[StepResult], chosen: int, opts: TuneOptions) -> str:
    """Which rule decided `chosen`, for the report."""
    peak = peak_step(valid)
    step = next((s for s in valid if s.parallelism == chosen), None)
    if step is None:
        return "headroom below the measured choice"
    if step is peak:
        return "best measured throughput"
    share = step.rollouts_per_s / peak.rollouts_per_s if peak.rollouts_per_s else 0.0
    if reaches_target(step, valid, opts):
        return f"smallest at >= {opts.target_share:g} of the best ({share:.3f})"
    return f"smallest within the uncertainty of the best ({share:.3f} of it)"


def to_extend(valid: Sequence[StepResult], opts: TuneOptions) -> StepResult | None:
    """The step the choice hangs on while its rate is uncertain: the choice when it is as good as the best
    only within its uncertainty, the level below it when a rate z errors higher would have chosen it, or
    a noisy peak; None when the choice is clear."""
    chosen = choose(valid, opts)
    by_level = {s.parallelism: s for s in valid}
    floor, peak = by_level[chosen], peak_step(valid)
    if not reaches_target(floor, valid, opts) and floor.measure.rel_err > opts.extend_rel_err:
        return floor
    below = [s for s in valid if s.parallelism < chosen]
    if below:
        step = max(below, key=lambda s: s.parallelism)
        hopeful = step.rollouts_per_s + opts.z * step.measure.rate_err
        if hopeful >= opts.target_share * peak.rollouts_per_s and step.measure.rel_err > opts.extend_rel_err:
            return step
    if peak.measure.rel_err > 2 * opts.extend_rel_err:
        return peak
    return None


def refine_target(valid: Sequence[StepResult], knee: int, opts: TuneOptions) -> int | None:
    """Where to measure next to bring the choice down: the bandwidth-delay knee when it lies unmeasured
    between the choice and every level below it (a fixed-slots backend peaks exactly there), else the
    middle between the choice and the highest level below it that could still qualify (None: they are
    close, or that middle was measured).

    Little's law bounds the search from below: P in flight give at most P / unloaded latency, so no level
    under `target_share` x the knee reaches the target."""
    chosen = choose(valid, opts)
    measured = [s.parallelism for s in valid]
    below = max([p for p in measured if p < chosen], default=0)
    if below < knee < chosen and not any(abs(p - knee) <= opts.near * knee for p in measured):
        return knee
    floor = max(below, math.floor(opts.target_share * knee))
    mid = (floor + chosen) // 2
    if chosen - floor <= max(1, opts.near * chosen) or any(abs(p - mid) <= opts.near * mid for p in measured):
        return None
    return mid


def unstable(step: StepResult, reference: Sequence[StepResult], opts: TuneOptions) -> str | None:
    """Why a stability stretch failed, else None: failed rollouts or attempts (errors, timeouts, 429s)
    beyond the threshold. A longer latency tail is expected at a loaded engine and is no failure."""
    baseline = min(reference, key=lambda s: s.parallelism) if reference else None
    if too_many_errors(step, baseline, opts):
        return f"{step.errors} failed rollouts, {sum(step.attempt_errors.values())} failed attempts"
    return None
