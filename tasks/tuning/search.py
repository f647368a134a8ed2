"""The tuner's search as one object: the steps measured so far and the moves over them (double,
confirm, refine, extend, check stability). The rules each move applies live in tune_rules.

With the engine's signal (vLLM/SGLang /metrics), the doubling takes short steps and stops where the
engine's waiting queue stays non-empty and throughput stopped growing with it; the running count where
requests first waited is the knee, confirmed by one short step instead of refinement and a statistical
stability stretch. A queue that appears while throughput still grows does not stop it."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from rollflow.tasks.backends.engine_metrics import EngineSampler
from rollflow.tasks.collect.plan import RunPlan
from rollflow.tasks.collect.rollouts import CollectContext
from rollflow.tasks.tuning.probe import ProbeFeed, StepResult, merge_steps, probe_next
from rollflow.tasks.tuning.tune_rules import (
    TuneOptions,
    base_latency,
    engine_step_rollouts,
    knee_estimate,
    refine_target,
    search_stop,
    step_rollouts,
    still_growing,
    stop_uncertain,
    to_extend,
    too_many_errors,
    unstable,
)

Entry = tuple[str, StepResult, str]  # (phase, step, note)
ENGINE_QUEUE = "engine queue"
NO_SIGNAL = "no engine signal"


@dataclass
class Search:
    """Steps in the order they ran (`history`), and the probe rollouts they cost (`spent`)."""

    ctx: CollectContext
    plan: RunPlan
    feed: ProbeFeed
    opts: TuneOptions
    seeds: Sequence[StepResult] = ()
    history: list[Entry] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    spent: int = 0
    t0: float = field(default_factory=time.monotonic)
    t0_perf: float = field(default_factory=time.perf_counter)
    engine: EngineSampler | None = None

    def __post_init__(self) -> None:
        self.history = [("seed", s, "") for s in self.seeds]

    def valid(self) -> list[StepResult]:
        """Good steps, a step and its extensions merged into one measurement per parallelism."""
        base = self.baseline()
        good = [
            s for _, s, _ in self.history if s.measure.rollouts and not too_many_errors(s, base, self.opts)
        ]
        good = [s for s in good if s.measure.method != "span"] or good
        by_level: dict[int, list[StepResult]] = {}
        for s in good:
            by_level.setdefault(s.parallelism, []).append(s)
        return [merge_steps(steps) for steps in by_level.values()]

    def baseline(self) -> StepResult | None:
        steps = [s for _, s, _ in self.history if s.measure.rollouts]
        return min(steps, key=lambda s: s.parallelism) if steps else None

    def out_of_budget(self) -> bool:
        ran = len(self.history) - len(self.seeds)
        return ran >= self.opts.max_steps or self.out_of_time() or self.out_of_rollouts()

    def out_of_rollouts(self) -> bool:
        """The run's share for probing is spent (`max_probe_rollouts`; None: no such bound)."""
        cap = self.opts.max_probe_rollouts
        spent = sum(s.rollouts + s.errors for _, s, _ in self.history[len(self.seeds) :])
        return cap is not None and spent >= cap

    def out_of_time(self) -> bool:
        return time.monotonic() - self.t0 > self.opts.time_budget_s

    async def measure(
        self, parallelism: int, phase: str, stability: bool = False, short: bool = False
    ) -> StepResult | None:
        """A step of the search; `short`: sized for the engine's signal rather than for a steady rate."""
        n = (
            engine_step_rollouts(parallelism, self.opts, confirm=stability)
            if short
            else step_rollouts(parallelism, self.opts, stability)
        )
        latency0 = base_latency(self.valid()) if self.valid() else None
        step = await probe_next(
            self.ctx, self.plan, self.feed, parallelism, n, f"tune-{phase}-p{parallelism}",
            self.engine, None if latency0 is None else latency0 / 2,
        )  # fmt: skip
        if step is not None:
            self.spent += step.rollouts
        return step

    async def signalled(self) -> bool:
        """Whether the engine's figures are there to steer by (the backend publishes /metrics)."""
        return self.engine is not None and await self.engine.has_signal()

    async def search(self) -> str:
        """The doubling search; appends to `history` and returns why it stopped."""
        if await self.signalled():
            reason = await self.engine_search()
            if reason != NO_SIGNAL:
                return reason
        good, opts = self.valid(), self.opts
        stop: str | None = None
        if len(good) >= 2:
            top = max(good, key=lambda s: s.parallelism)
            earlier = [s for s in good if s is not top]
            stop = await self.confirm(earlier, top, search_stop(earlier, top, self.baseline(), opts))
            parallelism = top.parallelism * 2
        else:
            parallelism = max(good[0].parallelism * 2, opts.start) if good else opts.start
        while stop is None:
            if self.out_of_budget():
                return "step or time budget"
            if parallelism > opts.max_parallelism:
                return "max-parallelism"
            step = await self.measure(parallelism, "search")
            if step is None:
                return "input exhausted"
            earlier = self.valid()
            reason = search_stop(earlier, step, self.baseline(), opts)
            self.history.append(("search", step, reason or ""))
            reason = await self.confirm(earlier, step, reason)
            if reason == "errors" and not earlier:
                if parallelism == 1:
                    return "errors"
                parallelism = max(1, parallelism // 2)
                continue
            stop = reason
            parallelism *= 2
        return stop

    async def confirm(self, earlier: list[StepResult], step: StepResult, reason: str | None) -> str | None:
        """Extend the latest step while its stop (or go-on) hangs on its rate's uncertainty; the decision
        is then made on the step and its extensions together."""
        merged = step
        for _ in range(self.opts.max_extensions):
            uncertain = stop_uncertain(earlier, merged, self.baseline(), self.opts)
            if reason == "errors" or not uncertain or self.out_of_budget():
                break
            extra = await self.measure(step.parallelism, "extend")
            if extra is None:
                break
            self.history.append(("extend", extra, f"confirming {reason or 'the gain'}"))
            merged = merge_steps([merged, extra])
            reason = search_stop(earlier, merged, self.baseline(), self.opts)
        return reason

    async def refine(self) -> tuple[int, StepResult | None]:
        """Measure around the knee estimate; returns the knee and the last refinement step."""
        good = self.valid()
        knee, last = knee_estimate(good), None
        for _ in range(self.opts.refine_steps):
            target = refine_target(good, knee, self.opts)
            if target is None or self.out_of_budget():
                break
            step = await self.measure(target, "refine", stability=True)
            if step is None:
                self.notes.append("the input ran out during refinement")
                break
            self.history.append(("refine", step, ""))
            last, good = step, self.valid()
            knee = knee_estimate(good)
        return knee, last

    async def extend_ambiguous(self, knee: int) -> int:
        """Extend the steps the choice would hang on while their rates are too uncertain; the new knee."""
        for _ in range(self.opts.max_extensions):
            good = self.valid()
            ambiguous = to_extend(good, self.opts)
            if ambiguous is None or self.out_of_budget():
                break
            step = await self.measure(ambiguous.parallelism, "extend")
            if step is None:
                break
            self.history.append(("extend", step, f"rate {ambiguous.rollouts_per_s:,.0f} uncertain"))
            knee = knee_estimate(self.valid())
        return knee

    async def stability(self, chosen: int, measured: StepResult | None) -> tuple[bool, int]:
        """Run the chosen value for a longer stretch; while it fails (errors, timeouts, 429s) back off by
        the headroom (x opts.headroom), the only place headroom applies."""
        step = measured if measured is not None and measured.parallelism == chosen else None
        for attempt in range(self.opts.max_backoffs + 1):
            if step is None:
                step = await self._stretch(chosen)
                if step is None:
                    return False, chosen
            why = unstable(step, self.valid(), self.opts)
            if why is None:
                return True, chosen
            lower = max(1, math.floor(chosen * self.opts.headroom))
            self.history[-1] = (self.history[-1][0], self.history[-1][1], f"unstable: {why}")
            if lower == chosen or attempt == self.opts.max_backoffs:
                self.notes.append(f"still unstable at {chosen}: {why}")
                return False, lower
            self.notes.append(f"backed off {chosen} -> {lower}: {why}")
            chosen, step = lower, None
        return False, chosen

    async def _stretch(self, chosen: int) -> StepResult | None:
        """The step budget bounds the search, not the check of its choice: only the time budget and the
        run's share for probing skip it."""
        if self.out_of_time():
            self.notes.append("no stability check: time budget reached")
            return None
        if self.out_of_rollouts():
            self.notes.append(
                f"no stability check: the probing share ({self.opts.max_probe_rollouts}) is spent"
            )
            return None
        step = await self.measure(chosen, "stability", stability=True)
        if step is None:
            self.notes.append("no stability check: the input ran out")
            return None
        self.history.append(("stability", step, ""))
        return step

    async def engine_search(self) -> str:
        """Doubling on short steps until the engine's waiting queue stays non-empty through a step while
        throughput stopped growing (ENGINE_QUEUE); errors, a lost signal, requests that no longer reach
        the engine, or throughput that stopped growing without a queue end it as the plain search would."""
        good = self.valid()
        if good:
            top = max(good, key=lambda s: s.parallelism)
            if self.engine_stop([s for s in good if s is not top], top) == ENGINE_QUEUE:
                return ENGINE_QUEUE
        parallelism = max(max(s.parallelism for s in good) * 2, self.opts.start) if good else self.opts.start
        while True:
            if self.out_of_budget():
                return "step or time budget"
            if parallelism > self.opts.max_parallelism:
                return "max-parallelism"
            step = await self.measure(parallelism, "search", short=True)
            if step is None:
                return "input exhausted"
            earlier = self.valid()
            reason = self.engine_stop(earlier, step)
            if reason == "errors" and not earlier and parallelism > 1:
                self.history.append(("search", step, reason))
                parallelism = max(1, parallelism // 2)
                continue
            self.history.append(("search", step, self._engine_note(step, reason)))
            if reason in ("plateau", "degradation"):
                reason = await self.confirm(earlier, step, reason)
            if reason is not None:
                return reason
            if step.engine is None:
                return NO_SIGNAL  # the plain search goes on from here
            parallelism *= 2

    @staticmethod
    def _engine_note(step: StepResult, reason: str | None) -> str:
        if reason == ENGINE_QUEUE:
            return "waiting queue stays non-empty"
        if reason is None and step.engine is not None and step.engine.saturated:
            return "queue, throughput still growing"
        return reason or ""

    def engine_stop(self, earlier: list[StepResult], step: StepResult) -> str | None:
        """Why to stop at a step read with the engine's figures: errors; a waiting queue while throughput
        stopped growing (ENGINE_QUEUE); requests that no longer reach the engine (its running count stopped
        growing with parallelism: the client or verifier is the limit); else the rate rules."""
        if step.engine is None:
            return search_stop(earlier, step, self.baseline(), self.opts)
        if too_many_errors(step, self.baseline(), self.opts):
            return "errors"
        below = [s for s in earlier if s.parallelism < step.parallelism]
        prev = max(below, key=lambda s: s.parallelism) if below else None
        if step.engine.saturated:
            growing = prev is not None and still_growing(prev, step, self.opts)
            return None if growing else ENGINE_QUEUE
        engines = [s for s in below if s.engine is not None]
        if engines and step.engine.running_max is not None:
            last = max(engines, key=lambda s: s.parallelism).engine
            if last is not None and last.running_max and step.engine.running_max < 1.2 * last.running_max:
                return "engine not filling"
        return search_stop(earlier, step, self.baseline(), self.opts)

    def engine_knee(self) -> int:
        """The engine's running count while requests waited, at the lowest parallelism where they did."""
        queued = [s for _, s, _ in self.history if s.engine is not None and s.engine.saturated]
        lowest = min(queued, key=lambda s: s.parallelism)
        running = lowest.engine.running_when_queued if lowest.engine is not None else None
        return max(1, min(running or lowest.parallelism, lowest.parallelism))

    async def engine_confirm(self, knee: int) -> tuple[bool, int]:
        """One short step at the choice, the knee plus a short queue (`engine_queue_share`): errors there
        back off to the knee; no errors confirm it."""
        chosen = max(knee, math.ceil(knee * (1 + self.opts.engine_queue_share)))
        step = await self.measure(chosen, "stability", stability=True, short=True)
        if step is None:
            self.notes.append("no confirmation: the input ran out")
            return False, knee
        if too_many_errors(step, self.baseline(), self.opts):
            self.history.append(("stability", step, f"unstable: {step.errors} failed rollouts"))
            self.notes.append(f"backed off {chosen} -> {knee}: errors above the engine's knee")
            return False, knee
        self.history.append(("stability", step, "engine confirmation"))
        return True, chosen
