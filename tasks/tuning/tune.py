"""tune-parallelism: find the knee of throughput against parallelism with few, real rollouts.

Search. Doubling from the baseline (the diagnosis' high level, or `start`), each step long enough to
measure a steady rate (`step_rollouts`: at least `cycles` x P rollouts). It stops on
- errors: more failures (or failed attempts) than the threshold and than at the lowest level;
- degradation: throughput fell below (1 - degrade) x the best so far;
- plateau: the gain, normalised to one doubling, is under `plateau_gain` (10%);
- latency knee: utilisation u = throughput x base latency / P (the share of requests in flight that the
  backend actually serves, Little's law) fell under `knee_utilisation` while the gain was already
  sub-linear; this sees a saturated backend one doubling earlier than the plateau does.

Knee. The bandwidth-delay product: knee = peak throughput x base latency (the unloaded p50), the fewest
requests in flight that keep the backend's peak rate busy. With N slots and latency L it is N exactly.
Refinement measures the knee estimate itself (and, if that falls short of `peak_fraction` of the peak,
bisects once toward the nearest measured point above it), so the knee is known far closer than 2x.

Choice. chosen = max(ceil(headroom x knee), P_floor), P_floor = the smallest measured parallelism whose
throughput reached `peak_fraction` (92%) of the peak: as close to the peak as short steps measure (their
rates carry a few percent of noise, and Little's law overshoots a filling queue by up to ~7%). Headroom
(0.8) trims parallelism that buys almost nothing on a soft knee; it never cuts into throughput: on a sharp
knee (fixed slots) 0.8 x knee gives only 80% of capacity, and the floor keeps the choice at the knee.

Stability. The chosen value runs for a longer stretch (`stability_rollouts`, >= `stability_cycles` x P);
if errors or a latency spread (p95/p50) well beyond the unloaded one appear, it backs off x `backoff`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollflow.tasks.collect.chunk import CollectContext
from rollflow.tasks.collect.plan import RunPlan
from rollflow.tasks.tuning.probe import ProbeFeed, StepResult, probe_next


@dataclass
class TuneOptions:
    """Knobs of the search; defaults suit backends whose latency is 10 ms to minutes."""

    start: int = 8
    min_rollouts: int = 100
    cycles: float = 2.0
    stability_rollouts: int = 200
    stability_cycles: float = 3.0
    plateau_gain: float = 0.10
    degrade: float = 0.10
    max_error_rate: float = 0.02
    knee_utilisation: float = 0.90
    knee_gain: float = 1.7
    saturated_utilisation: float = 0.75
    headroom: float = 0.8
    peak_fraction: float = 0.92
    refine_steps: int = 2
    near: float = 0.05
    backoff: float = 0.75
    max_backoffs: int = 2
    spread_jump: float = 1.5
    max_parallelism: int = 4096
    max_steps: int = 12
    time_budget_s: float = 900.0


@dataclass
class TuneStep:
    """One measured point of the curve, as the report shows it."""

    phase: str
    parallelism: int
    rollouts_per_s: float
    latency_p50_s: float | None
    latency_p95_s: float | None
    errors: int
    rollouts: int
    utilisation: float | None = None
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "parallelism": self.parallelism,
            "rollouts_per_s": round(self.rollouts_per_s, 3),
            "latency_p50_s": None if self.latency_p50_s is None else round(self.latency_p50_s, 6),
            "latency_p95_s": None if self.latency_p95_s is None else round(self.latency_p95_s, 6),
            "errors": self.errors,
            "rollouts": self.rollouts,
            "utilisation": None if self.utilisation is None else round(self.utilisation, 3),
            "note": self.note,
        }


@dataclass
class Tuning:
    """The curve, the knee, the choice, and what it cost (nothing is discarded)."""

    steps: list[TuneStep]
    knee: int
    chosen_parallelism: int
    probe_rollouts: int
    stop_reason: str
    peak_rollouts_per_s: float
    base_latency_s: float | None
    stable: bool = True
    seed_rollouts: int = 0
    discarded: int = 0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": [s.as_dict() for s in self.steps],
            "knee": self.knee,
            "chosen_parallelism": self.chosen_parallelism,
            "probe_rollouts": self.probe_rollouts,
            "seed_rollouts": self.seed_rollouts,
            "discarded": self.discarded,
            "stop_reason": self.stop_reason,
            "peak_rollouts_per_s": round(self.peak_rollouts_per_s, 3),
            "base_latency_s": None if self.base_latency_s is None else round(self.base_latency_s, 6),
            "stable": self.stable,
            "notes": self.notes,
        }


# ---- pure decisions (unit-tested on synthetic steps) -------------------------------------------


def step_rollouts(parallelism: int, opts: TuneOptions, stability: bool = False) -> int:
    """Rollouts for a step at `parallelism`: enough whole cycles for a steady measurement."""
    if stability:
        return max(opts.stability_rollouts, math.ceil(opts.stability_cycles * parallelism))
    return max(opts.min_rollouts, math.ceil(opts.cycles * parallelism))


def attempt_error_rate(step: StepResult) -> float:
    attempts = step.measure.ok + sum(step.attempt_errors.values())
    return sum(step.attempt_errors.values()) / attempts if attempts else 0.0


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
    rate = attempt_error_rate(step)
    return rate > 2 * attempt_error_rate(baseline) + 2 * opts.max_error_rate


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


def knee_estimate(valid: Sequence[StepResult]) -> int:
    """Peak throughput x unloaded latency, within the measured range."""
    peak = max(valid, key=lambda s: s.rollouts_per_s)
    latency0 = base_latency(valid)
    lo = min(s.parallelism for s in valid)
    if not latency0:
        return peak.parallelism
    bdp = peak.rollouts_per_s * latency0
    return int(min(max(round(bdp), lo, 1), peak.parallelism))


def peak_floor(valid: Sequence[StepResult], opts: TuneOptions) -> int:
    """The smallest measured parallelism whose throughput reached peak_fraction of the peak."""
    peak = max(s.rollouts_per_s for s in valid)
    return min(s.parallelism for s in valid if s.rollouts_per_s >= opts.peak_fraction * peak)


def choose(valid: Sequence[StepResult], knee: int, opts: TuneOptions) -> int:
    """max(ceil(headroom x knee), the peak floor): trims parallelism that buys little, not throughput."""
    return max(math.ceil(opts.headroom * knee), peak_floor(valid, opts), 1)


def refine_target(valid: Sequence[StepResult], knee: int, opts: TuneOptions) -> int | None:
    """Where to measure next to pin the knee down: the estimate itself, then a bisection between it and
    the nearest measured point above it (None: the knee is known closely enough)."""
    near = [s for s in valid if abs(s.parallelism - knee) <= opts.near * knee]
    if not near:
        return knee
    peak = max(s.rollouts_per_s for s in valid)
    if any(s.rollouts_per_s >= opts.peak_fraction * peak for s in near):
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


# ---- the search against a backend --------------------------------------------------------------


def _row(phase: str, step: StepResult, latency0: float | None, note: str = "") -> TuneStep:
    m = step.measure
    return TuneStep(
        phase=phase,
        parallelism=step.parallelism,
        rollouts_per_s=m.rollouts_per_s,
        latency_p50_s=m.p50_s,
        latency_p95_s=m.p95_s,
        errors=m.error_count,
        rollouts=m.rollouts,
        utilisation=utilisation(step, latency0),
        note=note,
    )


async def tune(
    ctx: CollectContext,
    plan: RunPlan,
    options: TuneOptions | None = None,
    *,
    feed: ProbeFeed | None = None,
    seeds: Sequence[StepResult] = (),
) -> Tuning:
    """Search, refine, choose, check stability; every rollout is real and saved as a part.

    `seeds` are steps already measured (the diagnosis' low and high levels): they count as points of
    the curve, and the search starts above them.
    """
    opts = options or TuneOptions()
    own = feed is None
    feed = feed or ProbeFeed(ctx, plan)
    t0 = time.monotonic()
    history: list[tuple[str, StepResult, str]] = [("seed", s, "") for s in seeds]
    spent = 0
    notes: list[str] = []

    def valid() -> list[StepResult]:
        good = [s for _, s, _ in history if s.measure.rollouts and not too_many_errors(s, baseline(), opts)]
        return [s for s in good if s.measure.method != "span"] or good

    def baseline() -> StepResult | None:
        steps = [s for _, s, _ in history if s.measure.rollouts]
        return min(steps, key=lambda s: s.parallelism) if steps else None

    def out_of_budget() -> bool:
        return len(history) - len(seeds) >= opts.max_steps or time.monotonic() - t0 > opts.time_budget_s

    async def measure(parallelism: int, phase: str, stability: bool = False) -> StepResult | None:
        nonlocal spent
        n = step_rollouts(parallelism, opts, stability)
        step = await probe_next(ctx, plan, feed, parallelism, n, f"tune-{phase}-p{parallelism}")
        if step is not None:
            spent += step.rollouts
        return step

    try:
        stop = await _search(history, opts, valid, baseline, out_of_budget, measure)
        good = valid()
        if not good:
            raise RuntimeError(
                "Tuning found no parallelism at which the backend answered reliably "
                f"({'; '.join(f'{s.parallelism}: {s.errors} errors' for _, s, _ in history)}). "
                "Check the backend, or pass a fixed --parallelism."
            )
        knee = knee_estimate(good)
        stability_step: StepResult | None = None
        for _ in range(opts.refine_steps):
            target = refine_target(good, knee, opts)
            if target is None or out_of_budget():
                break
            step = await measure(target, "refine", stability=True)
            if step is None:
                notes.append("the input ran out during refinement")
                break
            history.append(("refine", step, ""))
            stability_step = step
            good = valid()
            knee = knee_estimate(good)
        chosen = choose(good, knee, opts)
        stable, chosen = await _stability(
            history, chosen, stability_step, opts, valid, measure, notes, out_of_budget
        )
    finally:
        if own:
            feed.close()
    latency0 = base_latency(valid())
    return Tuning(
        steps=[_row(phase, s, latency0, note) for phase, s, note in history],
        knee=knee,
        chosen_parallelism=chosen,
        probe_rollouts=spent,
        stop_reason=stop,
        peak_rollouts_per_s=max(s.rollouts_per_s for s in valid()),
        base_latency_s=latency0,
        stable=stable,
        seed_rollouts=sum(s.rollouts for s in seeds),
        notes=notes,
    )


async def _search(history, opts, valid, baseline, out_of_budget, measure) -> str:  # type: ignore[no-untyped-def]
    """The doubling search; appends to `history` and returns why it stopped."""
    good = valid()
    stop: str | None = None
    if len(good) >= 2:
        top = max(good, key=lambda s: s.parallelism)
        stop = search_stop([s for s in good if s is not top], top, baseline(), opts)
        parallelism = top.parallelism * 2
    else:
        parallelism = max(good[0].parallelism * 2, opts.start) if good else opts.start
    while stop is None:
        if out_of_budget():
            return "step or time budget"
        if parallelism > opts.max_parallelism:
            return "max-parallelism"
        step = await measure(parallelism, "search")
        if step is None:
            return "input exhausted"
        earlier = valid()
        reason = search_stop(earlier, step, baseline(), opts)
        history.append(("search", step, reason or ""))
        if reason == "errors" and not earlier:
            if parallelism == 1:
                return "errors"
            parallelism = max(1, parallelism // 2)
            continue
        stop = reason
        parallelism *= 2
    return stop


async def _stability(history, chosen, measured, opts, valid, measure, notes, out_of_budget):  # type: ignore[no-untyped-def]
    """Run the chosen value for a longer stretch; back off x opts.backoff while it is unstable."""
    step = measured if measured is not None and measured.parallelism == chosen else None
    for attempt in range(opts.max_backoffs + 1):
        if step is None:
            if out_of_budget():
                notes.append("no stability check: step or time budget reached")
                return False, chosen
            step = await measure(chosen, "stability", stability=True)
            if step is None:
                notes.append("no stability check: the input ran out")
                return False, chosen
            history.append(("stability", step, ""))
        why = unstable(step, valid(), opts)
        if why is None:
            return True, chosen
        lower = max(1, math.floor(chosen * opts.backoff))
        history[-1] = (history[-1][0], history[-1][1], f"unstable: {why}")
        if lower == chosen or attempt == opts.max_backoffs:
            notes.append(f"still unstable at {chosen}: {why}")
            return False, lower
        notes.append(f"backed off {chosen} -> {lower}: {why}")
        chosen, step = lower, None
    return False, chosen
