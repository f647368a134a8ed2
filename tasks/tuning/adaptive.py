"""Adaptive parallelism (`--parallelism adaptive`): keep each endpoint's limit at its knee as the run goes.

Output lengths and backend load change during a long run, so a value tuned at the start can go stale.
A controller per endpoint samples that endpoint's attempts of the last interval (successes, failures by
kind, latency) and moves its limit in the pool (the shared limit is their sum):
- 429s, or errors that grew with load: back off x `backoff` at once, then hold a while (errors as
  frequent as at a lower limit are random faults: cutting would not make them rarer);
- growing: after raising the limit, keep raising while the rate grows by at least `min_gain`: x2 while
  the rate grows nearly in proportion (`linear`) or before the first plateau, else x`grow`;
- plateau: settle just above the last level that still paid (x`settle`), hold, then probe upward again,
  so added capacity is found;
- latency drop: latency fell by `latency_drop` at the same limit (the queue drains: capacity was
  added), so the hold ends and the probe starts at once;
- latency knee: while holding, if latency rose by `latency_knee` at a rate that did not rise, the
  backend lost capacity: step down x`shrink` and re-probe.
The first interval after every change is skipped (the queue is still settling). `decide` is pure.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Protocol

from rollflow.tasks.backends.endpoints import EndpointPool
from rollflow.tasks.backends.observe import AttemptLog
from rollflow.tasks.collect.rollouts import CollectContext


@dataclass
class AdaptiveOptions:
    interval_s: float = 1.0
    min_completions: int = 30
    min_limit: int = 1
    max_limit: int = 4096
    min_gain: float = 0.05
    grow: float = 1.25
    settle: float = 1.1
    backoff: float = 0.75
    shrink: float = 0.8
    latency_knee: float = 0.5
    max_error_rate: float = 0.02
    hold_intervals: int = 3
    linear: float = 0.7
    latency_drop: float = 0.2


@dataclass
class Sample:
    """One interval's attempts."""

    duration_s: float
    ok: int
    errors: dict[str, int]
    p50_s: float | None

    @property
    def rate(self) -> float:
        return self.ok / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def error_rate(self) -> float:
        total = self.ok + sum(self.errors.values())
        return sum(self.errors.values()) / total if total else 0.0


@dataclass
class AdaptiveState:
    limit: int
    slow_start: bool = True
    prev_limit: int | None = None
    prev_rate: float | None = None
    ref_rate: float | None = None
    ref_latency: float | None = None
    hold: int = 0
    settling: bool = False
    probing: bool = False
    # each limit's error rate when last read without backing off: errors that were as frequent at a
    # lower limit do not grow with load (random faults), so they do not cut the limit
    errors_at: dict[int, float] = field(default_factory=dict)


def decide(state: AdaptiveState, sample: Sample, opts: AdaptiveOptions) -> tuple[int, str]:
    """The next limit and why; updates `state`. Pure apart from `state`."""
    if state.settling:
        state.settling = False
        return state.limit, "settling"
    if sample.ok + sum(sample.errors.values()) < opts.min_completions:
        return state.limit, "too few completions"
    load = _load_errors(state, sample, opts)
    state.errors_at[state.limit] = sample.error_rate
    if sample.errors.get("http_429", 0) or load:
        return _back_off(state, sample, opts)
    if state.prev_limit is not None and state.prev_rate is not None:
        return _after_raise(state, sample, opts, state.prev_limit, state.prev_rate)
    return _steady(state, sample, opts)


def _load_errors(state: AdaptiveState, sample: Sample, opts: AdaptiveOptions) -> bool:
    """Errors above `max_error_rate` that follow load: no other limit read shows them about as often (a
    lower one had fewer, a higher one more). With no other limit read yet, any such errors count."""
    rate = sample.error_rate
    if rate <= opts.max_error_rate:
        return False
    margin = opts.max_error_rate
    return all(abs(other - rate) > margin for limit, other in state.errors_at.items() if limit != state.limit)


def _change(state: AdaptiveState, opts: AdaptiveOptions, new: int, why: str) -> tuple[int, str]:
    """Move the limit (within the options' bounds); a real move skips the next interval while it settles."""
    new = max(opts.min_limit, min(opts.max_limit, new))
    if new != state.limit:
        state.settling = True
    state.limit = new
    return new, why


def _forget_rates(state: AdaptiveState, hold: int) -> None:
    """Rates and latency read before a move say nothing after it; hold `hold` intervals first."""
    state.prev_limit, state.prev_rate = None, None
    state.ref_rate, state.ref_latency = None, None
    state.hold = hold


def _back_off(state: AdaptiveState, sample: Sample, opts: AdaptiveOptions) -> tuple[int, str]:
    """Errors or 429s: down x `backoff` at once, then hold."""
    state.slow_start = False
    state.probing = False
    _forget_rates(state, opts.hold_intervals)
    return _change(state, opts, math.floor(state.limit * opts.backoff), f"errors {dict(sample.errors)}")


def _after_raise(
    state: AdaptiveState, sample: Sample, opts: AdaptiveOptions, prev_limit: int, prev_rate: float
) -> tuple[int, str]:
    """The interval after a raise: keep raising while the rate grows, else settle above what still paid."""
    limit = state.limit
    prev = max(1, prev_limit)  # an endpoint can start with 0 fixed slots (split_limit)
    if sample.rate >= prev_rate * (1 + opts.min_gain):
        state.probing = False
        linear = sample.rate >= prev_rate * (1 + opts.linear * (limit / prev - 1))
        state.prev_limit, state.prev_rate = limit, sample.rate
        factor = 2.0 if state.slow_start or linear else opts.grow
        return _change(state, opts, math.ceil(limit * factor), f"rate grew to {sample.rate:.1f}/s")
    state.slow_start = False
    _forget_rates(state, opts.hold_intervals)
    settled = prev if state.probing else max(prev + 1, math.ceil(prev * opts.settle))
    state.probing = False
    return _change(state, opts, settled, f"plateau at {sample.rate:.1f}/s")


def _steady(state: AdaptiveState, sample: Sample, opts: AdaptiveOptions) -> tuple[int, str]:
    """At a settled limit: step down at a latency knee, hold while told to, then probe upward."""
    limit = state.limit
    if state.ref_rate is None:
        state.ref_rate, state.ref_latency = sample.rate, sample.p50_s
    elif _latency_knee(state, sample, opts):
        state.ref_rate, state.ref_latency = None, None
        state.hold = opts.hold_intervals
        p50_ms = (sample.p50_s or 0.0) * 1000
        return _change(state, opts, math.floor(limit * opts.shrink), f"latency knee: p50 {p50_ms:.0f} ms")
    if (
        sample.p50_s is not None
        and state.ref_latency is not None
        and sample.p50_s < state.ref_latency * (1 - opts.latency_drop)
    ):
        state.hold = 0  # the queue is draining at the same limit: capacity was added, look for it now
    if state.hold > 0:
        state.hold -= 1
        return limit, "holding"
    state.prev_limit, state.prev_rate = limit, sample.rate
    state.ref_rate, state.ref_latency = None, None
    state.probing = not state.slow_start
    factor = 2.0 if state.slow_start else opts.grow
    return _change(state, opts, math.ceil(limit * factor), "probing upward")


def _latency_knee(state: AdaptiveState, sample: Sample, opts: AdaptiveOptions) -> bool:
    """Latency rose by `latency_knee` over the reference while the rate did not: capacity was lost."""
    return (
        sample.p50_s is not None
        and state.ref_latency is not None
        and state.ref_rate is not None
        and sample.p50_s > state.ref_latency * (1 + opts.latency_knee)
        and sample.rate < state.ref_rate * (1 + opts.min_gain)
    )


class Intervals:
    """Reads an AttemptLog interval by interval: each `sample` holds the attempts since the last one."""

    def __init__(self, log: AttemptLog) -> None:
        self.log = log
        self.ok, self.errors = log.ok, dict(log.errors)

    def sample(self, duration_s: float) -> Sample:
        log, seen = self.log, self.errors
        errors = {k: v - seen.get(k, 0) for k, v in log.errors.items() if v > seen.get(k, 0)}
        latencies = log.drain_latencies()
        sample = Sample(duration_s, log.ok - self.ok, errors, median(latencies) if latencies else None)
        self.ok, self.errors = log.ok, dict(log.errors)
        return sample


class Resizable(Protocol):
    """A limit the controller reads and moves: a ConcurrencyLimit, or one endpoint's share of a pool."""

    @property
    def limit(self) -> int: ...

    def set_limit(self, limit: int) -> None: ...


@dataclass
class EndpointLimit:
    """One endpoint's limit in a pool; moving it moves the pool's total with it."""

    pool: EndpointPool
    url: str

    @property
    def limit(self) -> int:
        return self.pool.endpoint(self.url).limit

    def set_limit(self, limit: int) -> None:
        self.pool.set_limit(self.url, limit)


@dataclass
class AdaptiveController:
    """Samples an AttemptLog every interval and resizes a limit; keeps a history."""

    limit: Resizable
    log: AttemptLog
    options: AdaptiveOptions = field(default_factory=AdaptiveOptions)
    history: list[dict[str, Any]] = field(default_factory=list)

    async def run(self, stop: asyncio.Event) -> None:
        opts = self.options
        state = AdaptiveState(limit=self.limit.limit)
        attempts = Intervals(self.log)
        t_last = t_start = time.perf_counter()
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), opts.interval_s)
            now = time.perf_counter()
            sample, t_last = attempts.sample(now - t_last), now
            state.limit = self.limit.limit
            new, why = decide(state, sample, opts)
            if new != self.limit.limit:
                self.limit.set_limit(new)
            self.history.append(
                {"t_s": round(now - t_start, 3), "rate": round(sample.rate, 3), "limit": new, "why": why}
            )


class Controller(Protocol):
    """A controller of one endpoint's limit: runs until `stop`, feeding on `log`, keeping a `history`."""

    limit: Resizable
    log: AttemptLog
    history: list[dict[str, Any]]

    async def run(self, stop: asyncio.Event) -> None: ...


@dataclass
class AdaptiveGroup:
    """One controller per endpoint, each fed by that endpoint's own attempts."""

    pool: EndpointPool
    controllers: dict[str, Controller]
    errors: list[str] = field(default_factory=list)

    @property
    def history(self) -> list[dict[str, Any]]:
        """One endpoint: its controller's history; several: all of them by time, each row with its URL."""
        if len(self.controllers) == 1:
            return next(iter(self.controllers.values())).history
        rows = [{"endpoint": url, **h} for url, c in self.controllers.items() for h in c.history]
        return sorted(rows, key=lambda h: h["t_s"])

    def report(self) -> dict[str, Any]:
        """report.json's `adaptive`: the final total and history, and with several endpoints each one's."""
        out: dict[str, Any] = {"final_parallelism": self.pool.total.limit, "history": self.history}
        if len(self.controllers) > 1:
            out["endpoints"] = [
                {"url": url, "final_limit": c.limit.limit, "history": c.history}
                for url, c in self.controllers.items()
            ]
        if self.errors:
            out["errors"] = self.errors
        return out

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Each controller runs while the block does. One that fails leaves its limit where it was and is
        named in the report: steering is advice, and never fails a collection."""
        stop = asyncio.Event()
        tasks = [asyncio.create_task(c.run(stop)) for c in self.controllers.values()]
        try:
            yield
        finally:
            stop.set()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for url, result in zip(self.controllers, results, strict=True):
                if isinstance(result, Exception):
                    self.errors.append(f"{url}: {type(result).__name__}: {result}")
            for url, c in self.controllers.items():
                self.pool.endpoint(url).observers.remove(c.log)


@contextlib.asynccontextmanager
async def adaptive_control(
    ctx: CollectContext, options: AdaptiveOptions | None = None
) -> AsyncIterator[AdaptiveGroup]:
    """Within the block, each endpoint of ctx.pool has a controller that moves its limit from its attempts.

    The pool keeps ctx.limit at the sum of the endpoints' limits.
    """
    pool, opts = ctx.pool, options or AdaptiveOptions()
    group = AdaptiveGroup(pool, {})
    for ep in pool.endpoints:
        log = AttemptLog()
        pool.observe(ep.url, log)
        group.controllers[ep.url] = AdaptiveController(EndpointLimit(pool, ep.url), log, opts)
    async with group.running():
        yield group
