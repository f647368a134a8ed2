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
throughput reached `peak_fraction` (92%) of the peak, a rate within `z` standard errors of that counting
as reaching it (each step's rate carries its uncertainty; the smaller parallelism wins a tie). When the
floor or the peak stands where it does only within that uncertainty, that step is extended (up to
`max_extensions` times) before the choice is made. Headroom (0.8) trims parallelism that buys almost
nothing on a soft knee; it never cuts into throughput: on a sharp knee (fixed slots) 0.8 x knee gives
only 80% of capacity, and the floor keeps the choice at the knee.

Stability. The chosen value runs for a longer stretch (`stability_rollouts`, >= `stability_cycles` x P);
if errors or a latency spread (p95/p50) well beyond the unloaded one appear, it backs off x `backoff`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollflow.tasks.collect.plan import RunPlan
from rollflow.tasks.collect.rollouts import CollectContext
from rollflow.tasks.tuning.diagnose import TuningError
from rollflow.tasks.tuning.probe import ProbeFeed, StepResult, merge_steps, probe_next
from rollflow.tasks.tuning.tune_rules import (
    TuneOptions,
    base_latency,
    choose,
    knee_estimate,
    refine_target,
    search_stop,
    step_rollouts,
    stop_uncertain,
    to_extend,
    too_many_errors,
    unstable,
    utilisation,
)

__all__ = [
    "TuneOptions",
    "TuneStep",
    "Tuning",
    "choose",
    "knee_estimate",
    "refine_target",
    "search_stop",
    "step_rollouts",
    "tune",
]


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
    rollouts_per_s_err: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "parallelism": self.parallelism,
            "rollouts_per_s": round(self.rollouts_per_s, 3),
            "rollouts_per_s_err": round(self.rollouts_per_s_err, 3),
            "latency_p50_s": None if self.latency_p50_s is None else round(self.latency_p50_s, 6),
            "latency_p95_s": None if self.latency_p95_s is None else round(self.latency_p95_s, 6),
            "errors": self.errors,
            "rollouts": self.rollouts,
            "utilisation": None if self.utilisation is None else round(self.utilisation, 3),
            "note": self.note,
        }


@dataclass
class Tuning:
    """The curve, the knee, the choice, and what it cost (the run report counts what chunks adopted)."""

    steps: list[TuneStep]
    knee: int
    chosen_parallelism: int
    probe_rollouts: int
    stop_reason: str
    peak_rollouts_per_s: float
    base_latency_s: float | None
    stable: bool = True
    seed_rollouts: int = 0
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": [s.as_dict() for s in self.steps],
            "knee": self.knee,
            "chosen_parallelism": self.chosen_parallelism,
            "probe_rollouts": self.probe_rollouts,
            "seed_rollouts": self.seed_rollouts,
            "stop_reason": self.stop_reason,
            "peak_rollouts_per_s": round(self.peak_rollouts_per_s, 3),
            "base_latency_s": None if self.base_latency_s is None else round(self.base_latency_s, 6),
            "stable": self.stable,
            "notes": self.notes,
        }


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
        rollouts_per_s_err=m.rate_err,
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
        """Good steps, a step and its extensions merged into one measurement per parallelism."""
        good = [s for _, s, _ in history if s.measure.rollouts and not too_many_errors(s, baseline(), opts)]
        good = [s for s in good if s.measure.method != "span"] or good
        by_level: dict[int, list[StepResult]] = {}
        for s in good:
            by_level.setdefault(s.parallelism, []).append(s)
        return [merge_steps(steps) for steps in by_level.values()]

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
            raise TuningError(
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
        for _ in range(opts.max_extensions):
            ambiguous = to_extend(good, opts)
            if ambiguous is None or out_of_budget():
                break
            step = await measure(ambiguous.parallelism, "extend")
            if step is None:
                break
            history.append(("extend", step, f"rate {ambiguous.rollouts_per_s:,.0f} uncertain"))
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
        earlier = [s for s in good if s is not top]
        stop = search_stop(earlier, top, baseline(), opts)
        stop = await _confirm(history, earlier, top, stop, opts, baseline, out_of_budget, measure)
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
        reason = await _confirm(history, earlier, step, reason, opts, baseline, out_of_budget, measure)
        if reason == "errors" and not earlier:
            if parallelism == 1:
                return "errors"
            parallelism = max(1, parallelism // 2)
            continue
        stop = reason
        parallelism *= 2
    return stop


async def _confirm(history, earlier, step, reason, opts, baseline, out_of_budget, measure):  # type: ignore[no-untyped-def]
    """Extend the latest step while its stop (or go-on) hangs on its rate's uncertainty; the decision
    is then made on the step and its extensions together."""
    merged = step
    for _ in range(opts.max_extensions):
        if reason == "errors" or not stop_uncertain(earlier, merged, baseline(), opts) or out_of_budget():
            break
        extra = await measure(step.parallelism, "extend")
        if extra is None:
            break
        history.append(("extend", extra, f"confirming {reason or 'the gain'}"))
        merged = merge_steps([merged, extra])
        reason = search_stop(earlier, merged, baseline(), opts)
    return reason


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
        if why is not None and why.startswith("latency spread") and not out_of_budget():
            # A latency spike without errors may be the client's own (a loaded machine): confirm it
            # with a second stretch before backing off; both are real rollouts, both are kept.
            again = await measure(chosen, "stability", stability=True)
            if again is not None:
                history.append(("stability", again, ""))
                if unstable(again, valid(), opts) is None:
                    return True, chosen
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
