"""The engine's own load during a probe step (vLLM/SGLang `/metrics`), for the verdict and the tuner.

A closed loop of P requests over an engine that serves N at once keeps P - N waiting for as long as the
step feeds it, and none when P <= N. So one sample from the middle of a step says which side of the knee
P is on, and the running count while requests wait is the knee itself; throughput needs several cycles
of rollouts to say the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from rollflow.tasks.backends.engine_metrics import EngineSample, EngineSampler
from rollflow.tasks.backends.http import auth_headers, session_for_loop
from rollflow.tasks.collect.rollouts import CollectContext, RequestRecord


@dataclass(frozen=True)
class EngineStep:
    """What the engine showed over one step's fed part (after the first requests arrived, until the last
    one was sent): the figures, and whether requests waited in every sample."""

    samples: int
    running_max: int | None
    waiting_min: int | None
    waiting_max: int | None
    kv_cache_usage_max: float | None
    running_when_queued: int | None

    @property
    def saturated(self) -> bool:
        return self.samples > 0 and self.waiting_min is not None and self.waiting_min > 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "running_max": self.running_max,
            "waiting_min": self.waiting_min,
            "waiting_max": self.waiting_max,
            "kv_cache_usage_max": self.kv_cache_usage_max,
            "saturated": self.saturated,
        }


def engine_step(samples: Sequence[EngineSample]) -> EngineStep | None:
    """The step's engine figures from its samples; None without any (too short a step, or no signal)."""
    if not samples:
        return None
    running = [s.running for s in samples if s.running is not None]
    waiting = [s.waiting for s in samples if s.waiting is not None]
    kv = [s.kv_cache_usage for s in samples if s.kv_cache_usage is not None]
    queued = [s.running for s in samples if s.running is not None and s.waiting]
    return EngineStep(
        samples=len(samples),
        running_max=max(running, default=None),
        waiting_min=min(waiting) if len(waiting) == len(samples) else None,
        waiting_max=max(waiting, default=None),
        kv_cache_usage_max=max(kv, default=None),
        running_when_queued=round(statistics.median(queued)) if queued else None,
    )


def engine_clause(step: EngineStep, parallelism: int) -> str:
    """The verdict's reading of the engine: saturated (queue, cache) or not (running of those in flight)."""
    if step.saturated:
        cache = "" if step.kv_cache_usage_max is None else f", KV cache {step.kv_cache_usage_max:.0%} used"
        return f"backend saturated: {step.waiting_max} requests waiting{cache} at {parallelism} in flight"
    running = "-" if step.running_max is None else step.running_max
    state = "idle" if step.running_max is not None and step.running_max <= parallelism / 2 else "not queueing"
    return f"backend {state}: {running} of {parallelism} running, none waiting"


@contextlib.asynccontextmanager
async def engine_sampler(
    ctx: CollectContext, given: EngineSampler | None = None
) -> AsyncIterator[EngineSampler]:
    """The caller's sampler, or one over the backend for the duration (same session, same credentials)."""
    if given is not None:
        yield given
        return
    session = session_for_loop()
    async with EngineSampler(ctx.backend.url, session, auth_headers(ctx.backend)) as sampler:
        yield sampler


async def sample_mid_step(
    sampler: EngineSampler, records: list[RequestRecord], started: float, delay_s: float | None
) -> None:
    """One sample while the step's queue is steady: `delay_s` after the start (half the known latency),
    or, without it, half a latency after the first request came back. The background cadence waits
    meanwhile, so it cannot spend the rate limit on the ramp; the step cancels this when it ends."""
    if delay_s is None:
        while not records:
            await asyncio.sleep(0.005)
        delay_s = 1.5 * (records[0].end - started)
    await asyncio.sleep(max(0.0, started + delay_s - time.perf_counter()))
    await sampler.sample_soon()


def fed_window(
    sampler: EngineSampler, records: Sequence[RequestRecord], started: float, delay_s: float | None
) -> list[EngineSample]:
    """The step's samples from when its queue had formed to its last start (the in-flight count drains
    after that, so a falling queue there says nothing about the level)."""
    if not records:
        return []
    first = min(r.end for r in records)
    opened = started + (delay_s if delay_s is not None else first - started) * 0.5
    return sampler.between(opened, max(r.start for r in records))
