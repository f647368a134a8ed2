"""tune-parallelism: the parallelism that gives the backend's best throughput, with few, real rollouts.

For dataset generation throughput is the objective; latency matters only through timeouts and errors.
A continuous-batching engine (vLLM, SGLang) buys throughput with latency: its decode step slows as the
batch grows, so its curve rises gradually to a compute or KV-cache limit. No rule here stops on latency.

Search. Doubling from the baseline (the diagnosis' high level, or `start`), each step long enough to
measure a steady rate (`step_rollouts`: at least `cycles` x P rollouts), while throughput grows beyond its
uncertainty. It stops on
- errors: more failures (failed rollouts, or failed attempts: timeouts, 429s) than the threshold and than
  at the lowest level;
- degradation: throughput fell below (1 - degrade) x the best so far;
- plateau: the gain, normalised to one doubling, is under `plateau_gain` (5%), or not beyond `z`
  standard errors of the two rates' difference.
A stop read off one step, or one that hangs on a rate's uncertainty, is confirmed by extending that step.

Choice. The smallest measured parallelism as good as the best: its rate within `z` standard errors of
the best measured, or at least `target_share` (0.97) of it. Refinement measures where the choice could
come down: the bandwidth-delay knee (peak x unloaded latency, where fixed slots peak) when it lies below
the choice, then the middle between the choice and the level below it. Steps the choice hangs on while
their rates are uncertain (the choice, the level below, a noisy peak) are extended before choosing.

Stability. The chosen value runs for a longer stretch (`stability_rollouts`, >= `stability_cycles` x P);
only errors or timeouts there apply the headroom (x `headroom`, up to `max_backoffs` times).

Engine signal. When the backend publishes vLLM's or SGLang's gauges at /metrics, the search steps are
short (`engine_cycles` x P); it stops at the first step whose waiting queue stays non-empty once
throughput stopped growing, the knee is the engine's running count where requests first waited, and one
short step a little above it confirms it (search.py). Without a queue the rate rules above apply.

The report says which rule decided (`choice_rule`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rollflow.tasks.backends.engine_metrics import EngineSampler
from rollflow.tasks.collect.plan import RunPlan
from rollflow.tasks.collect.rollouts import CollectContext
from rollflow.tasks.tuning.diagnose import TuningError
from rollflow.tasks.tuning.engine import engine_sampler
from rollflow.tasks.tuning.fail_fast import failures_said
from rollflow.tasks.tuning.probe import ProbeFeed, StepResult
from rollflow.tasks.tuning.search import ENGINE_QUEUE, Search
from rollflow.tasks.tuning.tune_rules import (
    TuneOptions,
    base_latency,
    choice_rule,
    choose,
    knee_estimate,
    refine_target,
    search_stop,
    step_rollouts,
    utilisation,
)
from rollflow.tasks.tuning.verify_load import VerifyLoad, verification_limits, verify_next_step

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
    engine: dict[str, Any] | None = None
    cores: dict[str, float] = field(default_factory=dict)  # the client's and the machine's busy cores

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
            **self.cores,
            **({"engine": self.engine} if self.engine is not None else {}),
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
    engine: dict[str, Any] | None = None
    limited_by: str = "backend"  # or "verification": the checks, not the backend, capped the curve
    verification: dict[str, Any] = field(default_factory=dict)
    choice_rule: str = ""

    def evidence(self) -> dict[str, Any]:
        """What the chosen level measured: every error-free reading there, their mean, the spread between
        them and each one's own error, so a choice is never read as surer than its readings."""
        at = [s for s in self.steps if s.parallelism == self.chosen_parallelism and s.errors == 0]
        if not at:
            below = [s for s in self.steps if s.parallelism < self.chosen_parallelism and s.errors == 0]
            near = max(below, key=lambda s: s.parallelism, default=None)
            return {"readings": 0, "nearest_below": None if near is None else near.parallelism}
        rates = [s.rollouts_per_s for s in at]
        return {
            "readings": len(at),
            "rollouts_per_s": round(sum(rates) / len(rates), 3),
            "low": round(min(rates), 3),
            "high": round(max(rates), 3),
            "err": round(max(s.rollouts_per_s_err for s in at), 3),  # the least sure reading's error
            # two readings further apart than their errors allow: the rate moved while tuning
            "agree": max(rates) - min(rates)
            <= 2 * math.hypot(*sorted(s.rollouts_per_s_err for s in at)[-2:]),
        }

    def as_dict(self) -> dict[str, Any]:
        return {
            "steps": [s.as_dict() for s in self.steps],
            "knee": self.knee,
            "chosen_parallelism": self.chosen_parallelism,
            "evidence": self.evidence(),
            "probe_rollouts": self.probe_rollouts,
            "seed_rollouts": self.seed_rollouts,
            "stop_reason": self.stop_reason,
            "choice_rule": self.choice_rule,
            "peak_rollouts_per_s": round(self.peak_rollouts_per_s, 3),
            "base_latency_s": None if self.base_latency_s is None else round(self.base_latency_s, 6),
            "stable": self.stable,
            "notes": self.notes,
            "limited_by": self.limited_by,
            "verification": self.verification,
            **({"engine": self.engine} if self.engine is not None else {}),
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
        rollouts_per_s_err=m.reported_err,
        engine=step.engine.as_dict() if step.engine is not None else None,
        cores=step.usage.cores(),
    )


@dataclass
class _Choice:
    """Where the curve bends, what runs, whether it held there, and the rule that decided."""

    knee: int
    chosen: int
    stable: bool
    rule: str


async def tune(
    ctx: CollectContext,
    plan: RunPlan,
    options: TuneOptions | None = None,
    *,
    feed: ProbeFeed | None = None,
    seeds: Sequence[StepResult] = (),
    engine: EngineSampler | None = None,
) -> Tuning:
    """Search, refine, choose, check stability; every rollout is real and saved as a part.

    `seeds` are steps already measured (the diagnosis' low and high levels): they count as points of
    the curve, and the search starts above them. The backend's /metrics is sampled meanwhile (through
    `engine`, or a sampler of its own); with its signal the search is the engine's (module docstring).
    """
    opts = options or TuneOptions()
    own = feed is None
    run = Search(ctx, plan, feed or ProbeFeed(ctx, plan), opts, seeds)
    try:
        async with engine_sampler(ctx, engine) as sampler:
            run.engine = sampler
            stop = await run.search()
            _require_a_valid_level(run)
            choice = await _choose(run, stop, opts)
            figures = sampler.summary(since=run.t0_perf)
            if figures is not None:
                figures.update(sampler.stated())
    finally:
        if own:
            run.feed.close()
    return _tuning(run, stop, choice, figures, seeds, getattr(ctx.verifier, "processes", None))


def _require_a_valid_level(run: Search) -> None:
    """No level answered reliably: nothing to choose from, and the message says what each level did."""
    if not run.valid():
        steps = [s for _, s, _ in run.history]
        kinds = sum((Counter(s.attempt_errors) for s in steps), Counter[str]())
        first = next((s.first_failure for s in steps if s.first_failure), "")
        raise TuningError(
            "Tuning found no parallelism at which the backend answered reliably "
            f"({'; '.join(f'{s.parallelism}: {s.errors} errors' for s in steps)})."
            f"{failures_said(kinds, first)} "
            "Check the backend, or pass a fixed --parallelism."
        )


async def _choose(run: Search, stop: str, opts: TuneOptions) -> _Choice:
    """The engine's knee confirmed one step above it, or the rate rules' choice refined and held."""
    if stop == ENGINE_QUEUE:
        knee = run.engine_knee()
        stable, chosen = await run.engine_confirm(knee)
        rule = f"engine queue: running when requests waited ({knee}) + {opts.engine_queue_share:g}"
        return _Choice(knee, chosen, stable, rule)
    knee, refined = await run.refine()
    knee = await run.extend_ambiguous(knee)
    measured = choose(run.valid(), opts)
    rule = choice_rule(run.valid(), measured, opts)
    stable, chosen = await run.stability(measured, refined)
    if chosen < measured:
        rule = f"headroom x{opts.headroom:g} after errors at {measured} ({rule})"
    return _Choice(knee, chosen, stable, rule)


def _tuning(
    run: Search,
    stop: str,
    choice: _Choice,
    figures: dict[str, Any] | None,
    seeds: Sequence[StepResult],
    processes: int | None,
) -> Tuning:
    """The report's view of a finished search, with a note when verification, not the backend, capped it."""
    latency0 = base_latency(run.valid())
    limited, load = _verification_limit(run.valid(), processes)
    if limited and load is not None:
        run.notes.append(
            f"throughput stopped growing because verification limits it, not the backend "
            f"({load.clause()}). {verify_next_step(load.processes)}"
        )
    return Tuning(
        steps=[_row(phase, s, latency0, note) for phase, s, note in run.history],
        knee=choice.knee,
        chosen_parallelism=choice.chosen,
        probe_rollouts=run.spent,
        stop_reason=stop,
        peak_rollouts_per_s=max(s.rollouts_per_s for s in run.valid()),
        base_latency_s=latency0,
        stable=choice.stable,
        seed_rollouts=sum(s.rollouts for s in seeds),
        notes=run.notes,
        engine=None if figures is None else {**figures, "knee_from_engine": stop == ENGINE_QUEUE},
        limited_by="verification" if limited else "backend",
        verification=load.as_dict() if load is not None else {},
        choice_rule=choice.rule,
    )


def _verification_limit(valid: list[StepResult], processes: int | None) -> tuple[bool, VerifyLoad | None]:
    """Whether verification held the curve (from its lowest level to its highest), and its load at the top.

    At each level the step with the most rollouts stands for it: repeats of one level are no slope."""
    levels: dict[int, StepResult] = {}
    for step in valid:
        best = levels.get(step.parallelism)
        if best is None or step.rollouts > best.rollouts:
            levels[step.parallelism] = step
    if not levels:
        return False, None
    low, high = levels[min(levels)], levels[max(levels)]
    return low is not high and verification_limits(low, high, processes), VerifyLoad.of(high, processes)
