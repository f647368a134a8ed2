"""Diagnosis and tuning of several endpoints at once: each endpoint's own knee, and their sum.

Replicas of unequal speed have unequal knees, so each is probed on its own (its own in-flight level)
while the others are probed too: tuning N endpoints takes about as long as tuning the slowest one.
All endpoints draw their probe rows from one feed, so no row is probed twice and every probe is kept.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from rollflow.tasks.backends.endpoints import EndpointPool
from rollflow.tasks.backends.limiter import ConcurrencyLimit
from rollflow.tasks.collect.plan import RunPlan
from rollflow.tasks.collect.rollouts import CollectContext, WorkItem
from rollflow.tasks.tuning.diagnose import TuningError
from rollflow.tasks.tuning.probe import ProbeFeed

T = TypeVar("T")


def endpoint_context(ctx: CollectContext, url: str) -> CollectContext:
    """A copy of `ctx` that sends every request to the one endpoint `url` (its own pool of one)."""
    limit = ConcurrencyLimit(1)
    pool = EndpointPool([url], {url: 1}, limit)
    return dataclasses.replace(ctx, backend=ctx.backend.for_url(url), limit=limit, pool=pool)


class SharedFeed(ProbeFeed):
    """A ProbeFeed that several concurrent tunings draw from: one reader at a time, rows never repeated."""

    def __init__(self, ctx: CollectContext, plan: RunPlan) -> None:
        super().__init__(ctx, plan)
        self._lock: asyncio.Lock | None = None

    async def next(self, n: int) -> list[WorkItem]:
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            return await super().next(n)


@dataclass
class Timed(Generic[T]):
    """One endpoint's result and when its work ran (seconds since the stage started)."""

    url: str
    value: T
    started_s: float
    ended_s: float


async def for_each_endpoint(
    urls: Sequence[str],
    work: Callable[[str], Awaitable[T]],
    *,
    clock: Callable[[], float] = time.perf_counter,
) -> list[Timed[T]]:
    """Run `work(url)` for every endpoint concurrently; results in the order of `urls`.

    The first failure cancels the others and is raised as itself (with several endpoints a TuningError
    names its endpoint), so the CLI shows one clear message rather than an exception group.
    """
    t0 = clock()

    async def one(url: str) -> Timed[T]:
        start = clock() - t0
        try:
            value = await work(url)
        except TuningError as exc:
            if len(urls) == 1:
                raise
            raise exc.named(url) from exc
        return Timed(url, value, round(start, 6), round(clock() - t0, 6))

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(url)) for url in urls]
    except BaseExceptionGroup as eg:
        raise _first_leaf(eg) from None
    return [t.result() for t in tasks]


async def split_reachable(
    urls: Sequence[str], check: Callable[[str], Awaitable[None]]
) -> tuple[list[str], list[str]]:
    """(reachable, unreachable) endpoints; only when none answers is it an error (the first one's).

    A replica that is down at the start is not tuned; collection still gives it load when it returns.
    """
    results = await asyncio.gather(*(check(url) for url in urls), return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException)]
    if len(errors) == len(urls):
        raise errors[0]
    for error in errors:
        if not isinstance(error, Exception):
            raise error
    live = [url for url, r in zip(urls, results, strict=True) if not isinstance(r, BaseException)]
    return live, [url for url in urls if url not in live]


def _first_leaf(eg: BaseExceptionGroup) -> BaseException:
    first = eg.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def combine_diagnoses(runs: Sequence[Timed[dict[str, Any]]]) -> dict[str, Any]:
    """One diagnosis per endpoint, and a verdict line for all: the shared verdict, or `mixed`."""
    found = [Timed(r.url, r.value["diagnosis"], r.started_s, r.ended_s) for r in runs]
    verdicts = [f.value["verdict"] for f in found]
    shared = verdicts[0] if len(set(verdicts)) == 1 else "mixed"
    return {
        "verdict": shared,
        "next_step": " ".join(f"[{f.url}] {f.value['next_step']}" for f in found),
        "reason": " ".join(f"[{f.url}] {f.value['verdict']}: {f.value['reason']}" for f in found),
        "probe_rollouts": sum(f.value["probe_rollouts"] for f in found),
        "endpoints": [{"url": f.url, **f.value} for f in found],
    }


SUMMED = ("knee", "probe_rollouts", "seed_rollouts", "total_probe_rollouts")


def combine_endpoints(
    runs: Sequence[Timed[dict[str, Any]]], down: Sequence[str]
) -> tuple[int, dict[str, Any]]:
    """(the run's parallelism, report sections) from each endpoint's {"diagnosis", "tuning"?, "chosen"}.

    An endpoint that was down gets the smallest limit chosen for the others, so it takes a fair share of
    load if it comes back, without an untuned guess at more.
    """
    found: dict[str, Any] = {"diagnosis": combine_diagnoses(runs)}
    if "tuning" in runs[0].value:
        found["tuning"] = combine_tunings(
            [Timed(r.url, r.value["tuning"], r.started_s, r.ended_s) for r in runs], down
        )
    limits = {r.url: r.value["chosen"] for r in runs}
    limits.update(dict.fromkeys(down, min(limits.values())))
    if down:
        found["diagnosis"]["unreachable"] = list(down)
    return sum(limits.values()), found


def combine_tunings(found: Sequence[Timed[dict[str, Any]]], down: Sequence[str] = ()) -> dict[str, Any]:
    """Each endpoint's tuning (with when it ran) under `endpoints`, the sums on top, `limits` by URL.

    The run's parallelism is the sum of `limits`, what collection gives each endpoint: its own choice,
    or for one that was `down`, the smallest of the others'.
    """
    per = [{"url": f.url, **f.value, "started_s": f.started_s, "ended_s": f.ended_s} for f in found]
    limits = {p["url"]: p["chosen_parallelism"] for p in per}
    limits.update(dict.fromkeys(down, min(limits.values())))
    combined: dict[str, Any] = {key: sum(p[key] for p in per) for key in SUMMED}
    combined.update(
        peak_rollouts_per_s=round(sum(p["peak_rollouts_per_s"] for p in per), 3),
        stop_reason="; ".join(f"{p['url']}: {p['stop_reason']}" for p in per),
        stable=all(p["stable"] for p in per),
        chosen_parallelism=sum(limits.values()),
        limits=limits,
        unreachable=list(down),
        wall_s=round(max(p["ended_s"] for p in per) - min(p["started_s"] for p in per), 6),
        endpoints=per,
    )
    return combined
