"""Concurrency that follows the engine's own gauges (vLLM/SGLang `/metrics`), per replica, as the run goes.

A self-hosted engine rarely answers 429: given too much it queues, fills its KV cache and preempts. So each
endpoint's limit is moved from what its engine says every interval, not from rates that need many
rollouts to read:
- preemptions: cut below what ran meanwhile and keep that as a ceiling until a calm spell has passed,
  so the engine is never driven into repeated preemption (from what ran, so that preemptions while a
  cut drains do not cut again; a full cache while that excess drains holds the limit, likewise);
- KV cache above `kv_high`: trim (the cache is the limit, and preemption is near);
- requests waiting for capacity beyond a small queue (`queue_share` of those running, at least 2): the
  engine is full, so give back the excess, down to what it runs plus that queue at most; the small
  queue keeps it fed between replies;
- nothing waiting, the KV cache below `kv_grow` and the limit used: grow, x2 while far from any limit,
  else x`grow`, never past what the cache holds at `kv_high` by the most KV per running request in one
  sample (a few requests' use swings with their lengths: the peak share bounds a batch); only after
  `room_intervals` such intervals in a row, and not while a tenth of those in flight have not reached
  the engine (its API server holds them: more would only wait there);
- the cache's use says little of requests that have just begun (each one's share grows as it writes),
  and the first to end are the short ones: so the limit grows once per turnover (every request in flight
  when the limit was last set has ended, and as many as the limit have ended), judged by the cache's
  peak use over that turnover; and where the
  engine counts the tokens its finished requests held (vLLM), never past the requests of that size its
  cache holds at `kv_high`;
- a queue seen at R running is a knee: growth from below it stops at R plus the small queue, until the
  engine runs more than R (its capacity came back), so the limit does not swing past it and back;
- otherwise hold, and say why.
An endpoint whose engine publishes no gauges (OpenAI, a gateway) falls back to the latency and 429
rules of `adaptive.py`. `decide` is pure; every decision is kept with the signals behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import statistics
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollflow.tasks.backends.endpoints import AFFINITY_SLACK, EndpointPool
from rollflow.tasks.backends.engine_metrics import EngineSample, EngineSampler
from rollflow.tasks.backends.observe import AttemptLog
from rollflow.tasks.tuning import adaptive


@dataclass(frozen=True)
class EngineOptions:
    interval_s: float = 1.0
    min_limit: int = 1
    max_limit: int = 4096
    max_start: int = 1024
    blind_intervals: int = 3  # intervals without an engine sample before the latency rules take over
    history_kept: int = 4000  # decisions kept per endpoint; older holds are thinned past it
    queue_share: float = 0.1
    min_queue: int = 2
    kv_grow: float = 0.75
    kv_high: float = 0.9
    fast_grow: float = 2.0
    grow: float = 1.25
    trim: float = 0.9
    cut: float = 0.8
    calm_intervals: int = 20
    probe_above_ceiling: float = 1.1
    client_bound: float = 0.9
    front_share: float = 0.9
    front_rise: float = 0.15  # a held share this much above the one at the last growth: the front is full
    room_intervals: int = 2


@dataclass(frozen=True)
class Reading:
    """One interval of one engine: medians of running and waiting for capacity, the KV cache's highest
    use, the preemptions counted in it, and the most this run had in flight there during it."""

    samples: int
    running: float | None
    waiting: float | None
    kv: float | None
    preempted: int
    in_flight: int
    at_engine: float | None = None  # the most running + waiting in one sample (its API server lags)
    running_peak: float | None = None  # the most running in one sample
    footprint: float | None = None  # KV tokens one finished request held, in whole blocks (None: unknown)
    cache_tokens: int | None = None  # the KV cache's size, where the engine counts finished requests
    stated: float | None = None  # requests of full length the engine says its cache holds
    ended: int = 0  # this run's requests to the endpoint that ended in the interval (answered or failed)
    kv_share: float | None = None  # the most KV use per running request in one sample (a full batch's)
    left: int | None = None  # requests in flight when the limit was last set not yet ended (None: unknown)

    def as_dict(self) -> dict[str, Any]:
        return {
            "running": _round(self.running),
            "waiting": _round(self.waiting),
            "kv_cache_usage": _round(self.kv, 3),
            "preempted": self.preempted,
            "in_flight": self.in_flight,
        }


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def reading(
    samples: Sequence[EngineSample],
    before: EngineSample | None,
    in_flight: int,
    first: EngineSample | None = None,
    ended: int = 0,
    left: int | None = None,
) -> Reading:
    """The interval's reading from its samples; `before` is the last sample of the interval before (the
    preemption counter is cumulative, so its growth is counted from there), `first` the run's first (the
    requests finished since then give the footprint)."""
    running = [s.running for s in samples if s.running is not None]
    waiting = [_waiting(s) for s in samples if _waiting(s) is not None]
    seen = [(s.running or 0) + (_waiting(s) or 0) for s in samples if s.running is not None]
    last = samples[-1] if samples else None
    kv = [s.kv_cache_usage for s in samples if s.kv_cache_usage is not None]
    counts = [s.preemptions for s in (before, *samples) if s is not None and s.preemptions is not None]
    # a restarted engine starts its counter again: only growth between neighbours counts
    preempted = sum(max(0, b - a) for a, b in itertools.pairwise(counts))
    return Reading(
        samples=len(samples),
        running=statistics.median(running) if running else None,
        waiting=statistics.median(waiting) if waiting else None,  # type: ignore[type-var]
        kv=max(kv) if kv else None,
        preempted=preempted,
        in_flight=in_flight,
        at_engine=max(seen) if seen else None,
        running_peak=max(running) if running else None,
        footprint=footprint(first, last),
        cache_tokens=None if last is None or last.finished is None else last.kv_capacity_tokens,
        stated=None if last is None else last.kv_max_concurrency,
        ended=ended,
        kv_share=kv_share(samples, in_flight),
        left=left,
    )


def kv_share(samples: Sequence[EngineSample], in_flight: int) -> float | None:
    """The most KV use per running request in one sample of a batch (at least half those in flight
    running); with no such sample, in any sample with one running (a bound from few is cautious, never
    none). The sum of a few requests' use swings with their lengths: the highest share seen bounds the
    next batch, where the share at the highest use seen (a lucky sample of short replies) overflows it."""
    least = max(1.0, in_flight / 2)
    shares = [
        (s.running >= least, s.kv_cache_usage / s.running)
        for s in samples
        if s.kv_cache_usage is not None and s.running
    ]
    batch = [share for full, share in shares if full]
    return max(batch or [share for _, share in shares], default=None)


def footprint(first: EngineSample | None, last: EngineSample | None) -> float | None:
    """The KV tokens one request finished since `first` held (prompt + reply, in whole blocks); None when
    the engine does not count them or none finished."""
    if first is None or last is None or None in (first.finished, last.finished, first.finished_tokens):
        return None
    done = last.finished - first.finished  # type: ignore[operator]
    tokens = (last.finished_tokens or 0) - first.finished_tokens  # type: ignore[operator]
    if done <= 0 or tokens <= 0:
        return None
    block = last.kv_block_tokens or 1
    return float(math.ceil(tokens / done / block) * block)


def _waiting(sample: EngineSample) -> int | None:
    """Requests waiting for capacity (vLLM says why they wait); all waiting when the engine does not."""
    return sample.waiting_for_capacity if sample.waiting_for_capacity is not None else sample.waiting


def start_limit(sample: EngineSample | None, fallback: int, opts: EngineOptions) -> tuple[int, str]:
    """Where to start: the requests of full length the engine says its KV cache holds (never more than
    `max_start`, nor than the tokens it says the cache has), else `fallback`."""
    if sample is None:
        return fallback, "no engine gauges read at the start: started at the given parallelism"
    stated = sample.kv_max_concurrency
    if stated is None:
        return fallback, "the engine states no KV capacity: started at the given parallelism"
    bound = min(opts.max_start, opts.max_limit, sample.kv_capacity_tokens or opts.max_start)
    n = max(opts.min_limit, min(bound, math.floor(stated)))
    capped = "" if n >= math.floor(stated) else f" (started at {n})"
    return n, f"the engine's KV cache holds {stated:g} requests of its longest{capped}"


@dataclass
class EngineState:
    limit: int
    ceiling: int | None = None
    calm: int = 0
    room: int = 0  # consecutive intervals that showed room
    calm_needed: int | None = None  # calm intervals before a probe reaches `bad_level` (None: the option's)
    since_probe: int | None = None  # intervals since the ceiling was last lifted or raised
    held: float = 0.0  # the share of this run's requests in flight not yet at the engine, now
    held_at_growth: float | None = None  # that share when the limit last grew
    bad_level: int | None = None  # the limit the last preemption came at
    knee: float | None = None  # the most running when a queue last formed (None: none, or it ran more since)
    ended: int = 0  # requests ended since the limit last moved (or the last turnover was judged)
    kv_peak: float | None = None  # the cache's highest use over those
    share_peak: float | None = None  # and the most KV use per running request (see `kv_share`)
    down: bool = False  # whether the limit's last move was down (its excess drains)

    def turn(self, r: Reading) -> None:
        """Count the interval into the turnover under way."""
        self.ended += r.ended
        if r.kv is not None:
            self.kv_peak = r.kv if self.kv_peak is None else max(self.kv_peak, r.kv)
        if r.kv_share is not None:  # None: no sample with a request running
            self.share_peak = r.kv_share if self.share_peak is None else max(self.share_peak, r.kv_share)

    def new_turnover(self) -> None:
        self.ended, self.kv_peak, self.share_peak = 0, None, None

    def move(self, new: int) -> None:
        """The limit moves (by any rule): the next growth is judged by a turnover at the new limit, after
        room is seen anew; a move down leaves an excess to drain."""
        if new != self.limit:
            self.new_turnover()
            self.down, self.room = new < self.limit, 0
        self.limit = new


def _after_probe(state: EngineState, r: Reading, opts: EngineOptions) -> None:
    """A preemption soon after a probe doubles the wait before a probe may reach that level again (up to
    16x), so a gauge that misleads (a KV use stuck at 0) costs a burst ever more rarely; a probe that held
    at or above that level for a calm spell forgets it."""
    if r.preempted > 0:
        if state.since_probe is not None:
            state.calm_needed = min(16 * opts.calm_intervals, 2 * (state.calm_needed or opts.calm_intervals))
        state.bad_level = min(state.limit, state.bad_level or state.limit)
        state.since_probe = None
    elif state.since_probe is not None:
        state.since_probe += 1
        if state.since_probe > opts.calm_intervals:
            if state.bad_level is not None and state.limit >= state.bad_level:
                state.calm_needed = state.bad_level = None
            state.since_probe = None


Rule = Callable[[EngineState, Reading, EngineOptions], tuple[int, str]]


def decide(state: EngineState, r: Reading, opts: EngineOptions) -> tuple[int, str]:
    """The next limit and why; updates `state`. Pure apart from `state`."""
    limit, why = _decide(state, r, opts)
    if not why.startswith("room in the engine") and r.samples:
        state.room = 0  # growth needs room in consecutive sampled intervals (a missed scrape tells nothing)
    return limit, why


def _decide(state: EngineState, r: Reading, opts: EngineOptions) -> tuple[int, str]:
    state.turn(r)  # requests end in an interval without a sample too
    if r.samples == 0:
        return state.limit, "no engine sample in the interval"
    _after_probe(state, r, opts)
    if state.knee is not None and r.running_peak is not None and r.running_peak > state.knee:
        state.knee = None  # it runs more than where it queued: its capacity came back
    if r.preempted > 0:
        state.calm = 0
        # below what ran while it preempted: that is what the cache holds now (from what ran, not from the
        # limit: while the requests of a cut drain, preemptions go on, and the cut must not compound)
        held = min(r.in_flight, math.inf if r.running is None else r.running)
        cut = max(opts.min_limit, min(state.limit, math.floor(held * opts.cut)))
        state.ceiling = cut
        return _set(state, opts, cut, f"{r.preempted} preemptions: cut, and hold below {cut} a while")
    state.calm += 1
    if r.in_flight > math.ceil(state.limit * (1 + AFFINITY_SLACK)):  # affinity may carry it past a little
        # a full cache while the excess drains is the excess itself: trimming again would compound
        return state.limit, f"draining to the new limit ({r.in_flight} in flight)"
    if r.kv is not None and r.kv >= opts.kv_high:
        if state.down and r.in_flight > state.limit and r.left:  # full of the excess the last cut drains
            return (
                state.limit,
                f"KV cache {r.kv:.0%} used while {r.left} requests from before the last move run",
            )
        trimmed = max(opts.min_limit, math.floor(state.limit * opts.trim))
        state.ceiling = min(state.ceiling or trimmed, trimmed) if state.ceiling else trimmed
        return _set(state, opts, trimmed, f"KV cache {r.kv:.0%} used: trim")
    queue = max(opts.min_queue, opts.queue_share * (r.running or 0.0))
    if r.waiting and r.running_peak is not None:
        state.knee = r.running_peak
    if r.waiting is not None and r.waiting > queue:
        # give back the excess; and no more than the engine runs plus the queue (requests its API server
        # holds are not yet counted as waiting, so the excess alone can take several intervals)
        lower = min(state.limit - math.ceil(r.waiting - queue), math.ceil((r.running or 0.0) + queue))
        return _set(state, opts, lower, f"{r.waiting:g} waiting for capacity at {r.running:g} running: full")
    if r.in_flight < opts.client_bound * state.limit:
        return state.limit, f"only {r.in_flight} of {state.limit} in flight: the run, not the engine, limits"
    at_engine = r.at_engine if r.at_engine is not None else (r.running or 0.0) + (r.waiting or 0.0)
    state.held = max(0.0, 1.0 - at_engine / r.in_flight) if r.in_flight else 0.0
    # Requests held before the engine (its API server, the network): a share that stays as the limit
    # grows is time each request spends there, and more in flight still reaches the engine; a share that
    # rose since the last growth is a front at its capacity, where more would only wait.
    rose = state.held_at_growth is not None and state.held > state.held_at_growth + opts.front_rise
    if state.held > 1 - opts.front_share and rose:
        return state.limit, (
            f"{r.in_flight} in flight, {at_engine:g} at the engine: its API server or the network holds "
            f"more of them since the limit last grew ({state.held:.0%}, was {state.held_at_growth:.0%}), "
            "so more would only wait there"
        )
    if r.waiting:
        return state.limit, f"at the knee: {r.waiting:g} waiting, {r.running:g} running"
    if r.kv is not None and r.kv >= opts.kv_grow:
        return state.limit, f"KV cache {r.kv:.0%} used: holding"
    state.room += 1
    if state.room < opts.room_intervals:
        return state.limit, "room in the engine: grow if it stays"
    if r.left:
        return state.limit, (
            f"room in the engine: grow once the requests in flight when the limit was last set have ended "
            f"({r.left} of them still running; the cache's use says little of requests still writing)"
        )
    if state.ended < state.limit:
        return state.limit, (
            f"room in the engine: grow once the requests in flight turn over ({state.ended} of "
            f"{state.limit} ended since the limit was last set)"
        )
    state.room = 0
    limit, why = _grow(state, r, opts)
    state.new_turnover()
    return limit, why


def _grow(state: EngineState, r: Reading, opts: EngineOptions) -> tuple[int, str]:
    """Room in the engine: x2 while far from every limit, else x`grow`; never past the KV projection or,
    until calm, the ceiling a preemption or a trim set."""
    # far: the cache mostly empty and a doubling still under any ceiling (a limit cut well below its
    # ceiling by a tenant who has since left climbs back at x2, not by quarters)
    below_ceiling = state.ceiling is None or state.limit * opts.fast_grow <= state.ceiling
    kv, share = state.kv_peak, state.share_peak  # over the turnover, this interval's reading among them
    far = below_ceiling and (kv is None or kv < opts.kv_grow / 2)
    knee = (
        None
        if state.knee is None
        else math.ceil(state.knee + max(opts.min_queue, opts.queue_share * state.knee))
    )
    if knee is not None and state.limit >= knee:
        far = False
    new = math.ceil(state.limit * (opts.fast_grow if far else opts.grow))
    why = "room in the engine: grow"
    if knee is not None and state.limit < knee < new:
        new, why = knee, f"grow to the knee: a queue formed at {state.knee:g} running"
    fits = _fits(r, opts)
    if fits is not None and fits < new:
        size = f"of {r.footprint:g} tokens" if r.footprint else "of full length (none has ended yet)"
        new, why = fits, f"up to the {fits} requests {size} the KV cache holds"
    if share:
        projected = math.floor(opts.kv_high / share)
        if projected < new:
            new, why = projected, f"up to what the KV cache holds at {opts.kv_high:.0%} by its peak use"
    probed = (
        _probe(state, r, opts) if state.ceiling is not None and state.calm >= opts.calm_intervals else None
    )
    if state.ceiling is not None and state.ceiling < new:
        new, why = state.ceiling, f"up to the ceiling {state.ceiling} (set by preemption or a full KV cache)"
    why = f"{probed}; {why}" if probed else why
    if new <= state.limit:
        return state.limit, f"room in the engine, but held: {why}"
    state.held_at_growth = state.held
    return _set(state, opts, new, why)


def _fits(r: Reading, opts: EngineOptions) -> int | None:
    """Requests the cache holds at `kv_high`, of the size finished ones held; before one has finished,
    the requests of full length the engine states (None where it does not count finished requests)."""
    if r.cache_tokens is None:
        return None
    if r.footprint is not None:
        return max(opts.min_limit, math.floor(r.cache_tokens * opts.kv_high / r.footprint))
    return None if r.stated is None else max(opts.min_limit, math.floor(r.stated))


def _probe(state: EngineState, r: Reading, opts: EngineOptions) -> str | None:
    """After a calm spell under a ceiling: lift it when the cache reports room, else raise it 10%; never to
    the level that last preempted before the longer wait a repeat earned has passed."""
    ceiling = state.ceiling or 0
    wary = state.bad_level is not None and state.calm < (state.calm_needed or opts.calm_intervals)
    probe = max(ceiling + 1, math.ceil(ceiling * opts.probe_above_ceiling))
    if wary and probe >= state.bad_level:  # type: ignore[operator]
        probe = state.bad_level - 1  # type: ignore[operator]
    peak = state.kv_peak  # over the turnover, as growth is judged; 0 with requests running tells nothing
    if not wary and peak and peak < opts.kv_grow / 2:
        state.ceiling, state.calm, state.since_probe = None, 0, 0
        return (
            f"calm for {opts.calm_intervals} intervals, KV cache at most {peak:.0%} used: "
            "the ceiling is lifted"
        )
    if probe <= ceiling:
        return None  # below where it preempted: wait out the longer spell
    state.ceiling, state.calm, state.since_probe = probe, 0, 0
    return f"calm for {opts.calm_intervals} intervals: probe up to {probe}"


def _set(state: EngineState, opts: EngineOptions, new: int, why: str) -> tuple[int, str]:
    state.move(max(opts.min_limit, min(opts.max_limit, new)))
    return state.limit, why


@dataclass
class EngineController:
    """One endpoint's controller: the engine's gauges when it has them, else latency and 429s."""

    limit: adaptive.Resizable
    sampler: EngineSampler
    log: AttemptLog
    in_flight: Callable[[], int]  # this run's most requests in flight at the endpoint in the interval
    options: EngineOptions = field(default_factory=EngineOptions)
    # starts a turnover (counts down the requests in flight now), and how many of them have not ended
    mark: Callable[[], None] = lambda: None
    left: Callable[[], int | None] = lambda: None
    fallback: adaptive.AdaptiveOptions = field(default_factory=adaptive.AdaptiveOptions)
    history: list[dict[str, Any]] = field(default_factory=list)
    rule: Rule = decide  # another rule set, for benchmarks beside it

    async def run(self, stop: asyncio.Event) -> None:
        opts = self.options
        state = EngineState(limit=self.limit.limit)
        latency = adaptive.AdaptiveState(limit=self.limit.limit)
        attempts = adaptive.Intervals(self.log)
        t_last = t_start = time.perf_counter()
        before: EngineSample | None = self.sampler.latest
        first = before if before is not None and before.finished is not None else None
        blind = 0
        self.mark()
        applied = self.limit.limit
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), opts.interval_s)
            now = time.perf_counter()
            sample = attempts.sample(now - t_last)
            errors = sample.errors
            samples = self.sampler.between(t_last, now)
            t_last = now
            entry: dict[str, Any] = {
                "t_s": round(now - t_start, 3),
                "at": round(time.time(), 3),  # epoch seconds, to set beside the engine's own logs
                "rate": round(sample.rate, 3),
            }
            if self.limit.limit != applied:  # set from outside (a share of the run's limit): a new turnover
                state.move(self.limit.limit)
                self.mark()
            state.limit = latency.limit = self.limit.limit
            blind = blind + 1 if not samples else 0
            if stop.is_set():
                new, why = self.limit.limit, "the run ended"
            elif self.sampler.seen_signal and blind < opts.blind_intervals:
                first = first or next((s for s in samples if s.finished is not None), None)
                ended = sample.ok + sum(errors.values())
                r = reading(samples, before, self.in_flight(), first, ended, self.left())
                before = samples[-1] if samples else before
                if errors.get("http_429"):
                    new, why = adaptive.decide(latency, sample, self.fallback)
                    state.move(new)
                else:
                    new, why = self.rule(state, r, opts)
                entry.update(r.as_dict(), turnover={"ended": state.ended, "left": r.left,
                             "kv_peak": _round(state.kv_peak, 3),
                             "kv_share_peak": _round(state.share_peak, 4)})  # fmt: skip
            else:
                new, why = adaptive.decide(latency, sample, self.fallback)
                seen = self.sampler.seen_signal
                why = f"{f'no engine sample for {blind} intervals' if seen else 'no engine gauges'}: {why}"
                state.move(new)
            if new != self.limit.limit:
                self.limit.set_limit(new)
                self.mark()  # growth waits for the requests in flight now to end (whichever rule moved it)
            applied = self.limit.limit
            self.history.append({**entry, "limit": new, "why": why})
            if len(self.history) > opts.history_kept:
                self.history = thinned(self.history)


def thinned(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The older half without every other hold (a decision that kept the limit): every move stays, and
    a day-long run's record stays bounded."""
    half = len(history) // 2
    older = history[:half]
    kept = [h for i, h in enumerate(older) if i % 2 == 0 or h["limit"] != older[i - 1]["limit"]]
    return kept + history[half:]


@dataclass
class EngineGroup(adaptive.AdaptiveGroup):
    """One controller per endpoint; the report holds each one's decisions with their signals."""

    started: dict[str, str] = field(default_factory=dict)

    def report(self) -> dict[str, Any]:
        """report.json's `adaptive`: the mode, where each limit started, and the latency rules' report."""
        return {"mode": "engine", "started": self.started, **super().report()}


async def first_samples(samplers: dict[str, EngineSampler]) -> dict[str, EngineSample | None]:
    """Each endpoint's first reading (waiting for its first answer, within the sampler's bound)."""
    found = {}
    for url, sampler in samplers.items():
        found[url] = sampler.latest if await sampler.has_signal() else None
    return found


@contextlib.asynccontextmanager
async def engine_control(
    pool: EndpointPool,
    samplers: dict[str, EngineSampler],
    options: EngineOptions | None = None,
    rule: Rule | None = None,
) -> AsyncIterator[EngineGroup]:
    """Within the block, each endpoint's limit follows its engine (from the engine's own capacity when it
    states one); the pool keeps the total at their sum."""
    opts = options or EngineOptions()
    group = EngineGroup(pool, {})
    for url, sample in (await first_samples(samplers)).items():
        limit, why = start_limit(sample, pool.endpoint(url).limit, opts)
        pool.set_limit(url, limit)
        group.started[url] = f"{limit}: {why}"
        log = AttemptLog()
        pool.observe(url, log)
        ep = pool.endpoint(url)
        group.controllers[url] = EngineController(
            adaptive.EndpointLimit(pool, url), samplers[url], log, ep.take_peak, opts, rule=rule or decide,
            mark=ep.mark, left=lambda ep=ep: ep.left,
        )  # fmt: skip
    async with group.running():
        yield group
